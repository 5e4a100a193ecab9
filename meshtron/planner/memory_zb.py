"""What a pipeline rank holds under torch's zero-bubble schedules, walked in torch's order.

torch.distributed.pipelining splits each backward in two (torch 2.13, stage.py
`backward_one_chunk(full_backward=False)` then `backward_weight_one_chunk`; _backward.py):

* B (`stage_backward_input`) runs `torch.autograd.grad(outputs, inputs, retain_graph=True)`
  and keeps, per parameter group, the graph nodes where the weight paths leave the input path
  ("intermediates": a weight GEMM's mm node, a norm's weight product) and the gradient that
  reached each of them (`param_group["grads"]`, captured by a pre-hook). The intermediates
  reference the rest of the graph down to the stage input and retain_graph kept every node's
  saved tensors: everything the forward saved stays until W, not only the weight GEMMs'
  inputs (measured on torch 2.13 CPU, two Llama-style blocks: 100% of the saved bytes alive
  after B, plus the captured gradients, 26% of them at h = 64, f = 176: exactly the outputs
  of the q/k/v, o, gate/up and down GEMMs and of the two norms; tests/test_memory_zb.py).
  `backward_state` also keeps the stage's output and the received output gradient until W.
* The first stage skips B (stage.py: "Skip the backward for the first stage since we will
  perform the weight update with autograd.backward in backward_weight_one_chunk"): its W runs
  the whole backward, nothing is captured.
* W (`stage_backward_weight`) frees them all.

So under 'zb' a micro-batch's activations live from its F to its W, not its B: every rank
holds about p of them under ZB1P (1F1B: p - i on rank i), and the gradients captured for the
B..W window beside them. `held` walks a rank's order (pipeline_zb.orders, torch's own) and
returns the largest sum of both, with the chunk outputs alive at that moment.
"""

from __future__ import annotations

from functools import lru_cache

from meshtron.planner import pipeline_zb


def captured_grad_bytes(model, tp: int, sp: bool, tokens: int, compute_bytes: float) -> float:
    """Bytes of the gradients `stage_backward_input` captures for one block and micro-batch of
    `tokens` tokens per rank: the output gradient of every weight GEMM (column-parallel q, k, v
    and gate/up: their local 1/tp share; row-parallel o and down: the whole hidden width, the
    gradient of their partial sums) and of each norm's weight product (sequence-sharded with
    sequence parallelism)."""
    q = model.heads * model.head_dim
    ffn = model.ffn_hidden * (2 if model.mlp == "swiglu" else 1)
    column = q + 2 * model.kv_dim + ffn
    if model.qk_norm:  # Qwen3's per-head q and k norms: their weight products
        column += q + model.kv_dim
    column /= tp
    row = 2 * model.hidden
    norms = 2 * model.hidden / (tp if sp and tp > 1 else 1)
    return tokens * (column + row + norms) * compute_bytes


def head_grad_bytes(model, tp: int, tokens: int, compute_bytes: float) -> float:
    """The logits' gradient the output projection's intermediate captures on the last stage
    (vocabulary-parallel: vocab / tp per rank) and the final norm's output gradient."""
    return tokens * (model.vocab / tp + model.hidden) * compute_bytes


@lru_cache(maxsize=4096)
def held(p: int, v: int, m: int, rank: int, layers: tuple[int, ...], act: float, grad: float,
         out: float, head: float) -> tuple[float, float]:
    """(layer bytes, other bytes) pipeline rank `rank` holds at its peak under 'zb' with v
    stages per rank: `layers[s]` the layers of virtual stage s (all p v of them), `act` and
    `grad` the stored activations and captured gradients per layer and micro-batch, `out` a
    chunk output (and a received output gradient), `head` what the last stage captures beside
    its layers' (`head_grad_bytes`). Layer bytes: activations and captured gradients of the
    layers; other: outputs, received gradients and the head's captured gradient."""
    n = p * v
    now_l = now_o = 0.0
    best = (0.0, 0.0)
    for kind, s in _order(p, v, m)[rank]:
        a = act * layers[s]
        g = 0.0 if s == 0 else grad * layers[s]
        h = head if s == n - 1 and s != 0 else 0.0
        o = out if s != n - 1 else 0.0  # the last stage's output is the loss
        if kind == "F":
            now_l, now_o = now_l + a, now_o + o
            if now_l + now_o > sum(best):
                best = (now_l, now_o)
        elif kind == "B":  # kept until W: captured gradients, the received output gradient
            # counted from the next operation on: while B runs, its own captured gradients
            # are its working set, which the memory model charges apart (the loss moment's
            # logits, a block's backward: memory.stage_memory)
            if now_l + now_o > sum(best):
                best = (now_l, now_o)
            now_l, now_o = now_l + g, now_o + h + o
        else:
            if now_l + now_o > sum(best):  # the W's start: all it frees still held
                best = (now_l, now_o)
            now_l, now_o = now_l - a - g, now_o - h - 2 * o
    return best


@lru_cache(maxsize=256)
def _order(p: int, v: int, m: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """torch's per-rank orders (pipeline_zb.orders), kinds and stages only."""
    return tuple(tuple((k, s) for k, s, _ in o) for o in pipeline_zb.orders(p, v, m))


def in_flight(p: int, v: int, m: int, layers: tuple[int, ...], act: float, grad: float,
              out: float, head: float) -> tuple[list[float], list[float]]:
    """Per pipeline rank, (micro-batches' worth of its layers' activations held at the peak,
    counting the captured gradients in activation bytes; bytes of the outputs, received
    gradients and head gradient held then), the multiplier `pipeline.in_flight` gives the
    memory model."""
    mult, other = [], []
    for r in range(p):
        n_r = sum(layers[s] for s in range(p * v) if pipeline_zb.stage_rank(p, v, s) == r)
        lay, oth = held(p, v, m, r, layers, act, grad, out, head)
        mult.append(lay / (act * n_r) if n_r and act else 0.0)
        other.append(oth)
    return mult, other
