"""What a pipeline rank holds under torch's zero-bubble schedules, walked in torch's order.

torch.distributed.pipelining splits each backward in two (torch 2.13, stage.py
`backward_one_chunk(full_backward=False)` then `backward_weight_one_chunk`; _backward.py):

* B (`stage_backward_input`) runs `torch.autograd.grad(outputs, inputs, retain_graph=True)`
  and keeps, per parameter group, the graph nodes where the weight paths leave the input path
  ("intermediates": a weight GEMM's mm node, a norm's weight product) and the gradient that
  reached each of them (`param_group["grads"]`, captured by a pre-hook). The intermediates
  reference the rest of the graph down to the stage input and retain_graph kept every node's
  saved tensors: everything the forward saved stays until W, not only the weight GEMMs'
  inputs (measured on torch 2.13 CPU, two of meshtron's blocks: 100% of the saved bytes
  alive after B, plus the captured gradients, exactly the outputs of the q, k, v, o, w1, w3,
  w2 GEMMs and of the two norms: 16% of the saved bytes for the 'debug' preset, 6% for
  'tiny', at 16 tokens; tests/test_memory_zb.py).
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
         out: float, head: float, loss: float = 0.0) -> tuple[float, float]:
    """(layer bytes, other bytes) pipeline rank `rank` holds at its peak under 'zb' with v
    stages per rank: `layers[s]` the layers of virtual stage s (all p v of them), `act` and
    `grad` the stored activations and captured gradients per layer and micro-batch, `out` a
    chunk output (and a received output gradient), `head` what the last stage captures beside
    its layers' (`head_grad_bytes`). Layer bytes: activations and captured gradients of the
    layers; other: outputs, received gradients and the head's captured gradient. The walk's
    moments are counted once per order (`_moments`), then weighed here. `loss`: the loss
    moment's bytes the memory model adds to the last stage's rank (its logits,
    memory.stage_memory), there only while a B of the last stage runs: a W's start holds
    them no more, so it counts `loss` less against them (the result is what is held beside
    them)."""
    last = p * v - 1
    # one stage per rank and the V: the steady state repeats, so the moments of 4p
    # micro-batches are those of any more (checked for p <= 16: tests/test_memory_zb.py)
    stages, w_moments, b_moments = _moments(p, v, min(m, 4 * p) if v <= 2 else m, rank)
    # per stage of the rank: bytes per micro-batch in flight (F..W) and per one waiting (B..W)
    per_f = [(layers[s] * act, out if s != last else 0.0) for s in stages]
    per_w = [(layers[s] * (0.0 if s == 0 else grad),
              (out if s != last else 0.0) + (head if s == last and s != 0 else 0.0))
             for s in stages]
    best = (0.0, float("-inf"))
    for moments, less in ((w_moments, loss if b_moments else 0.0), (b_moments, 0.0)):
        for fw, bw in moments:
            lay = (sum(k * x[0] for k, x in zip(fw, per_f))
                   + sum(k * x[0] for k, x in zip(bw, per_w)))
            oth = (sum(k * x[1] for k, x in zip(fw, per_f))
                   + sum(k * x[1] for k, x in zip(bw, per_w)) - less)
            if lay + oth > sum(best):
                best = (lay, oth)
    return best if best[1] > float("-inf") else (0.0, 0.0)


@lru_cache(maxsize=8192)
def _moments(p: int, v: int, m: int, rank: int) -> tuple[tuple[int, ...], tuple, tuple]:
    """(the rank's stages, the moments of its order where what it holds can peak): per stage
    of the rank, the micro-batches between their F and their W and those of them between B
    and W, in torch's order (pipeline_zb.orders). F and B only add, W only frees, so the
    peaks are at the start of a W (the B before it finished: its transient working set gone,
    what it captured held); of those, the ones no other holds at least as much of everything
    as (every weight is >= 0). Third: the same at the start of each B of the last stage (the
    loss moment, when the memory model's logits are alive), if the rank holds it."""
    order = _order(p, v, m)[rank]
    stages = tuple(sorted({s for _, s in order}))
    at = {s: i for i, s in enumerate(stages)}
    fw, bw = [0] * len(stages), [0] * len(stages)
    seen: dict[tuple, None] = {}
    at_loss: dict[tuple, None] = {}
    for kind, s in order:
        i = at[s]
        if kind == "F":
            fw[i] += 1
        elif kind == "B":
            if s == p * v - 1:
                at_loss[(tuple(fw), tuple(bw))] = None
            bw[i] += 1
        else:
            seen[(tuple(fw), tuple(bw))] = None
            fw[i] -= 1
            bw[i] -= 1
    return stages, _undominated(seen), _undominated(at_loss)


def _undominated(seen: dict) -> tuple:
    """The moments no other holds at least as much of everything as."""
    flat = sorted(((f + b, (f, b)) for f, b in seen), key=lambda x: -sum(x[0]))
    kept: list[tuple] = []
    for vec, moment in flat:
        if not any(all(x <= y for x, y in zip(vec, k)) for k, _ in kept):
            kept.append((vec, moment))
    return tuple(moment for _, moment in kept)


@lru_cache(maxsize=1024)
def _order(p: int, v: int, m: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """torch's per-rank orders (pipeline_zb.orders), kinds and stages only."""
    return tuple(tuple((k, s) for k, s, _ in o) for o in pipeline_zb.cached_orders(p, v, m))


def in_flight(p: int, v: int, m: int, layers: tuple[int, ...], act: float, grad: float,
              out: float, head: float, loss: float = 0.0) -> tuple[list[float], list[float]]:
    """Per pipeline rank, (micro-batches' worth of its layers' activations held at the peak,
    counting the captured gradients in activation bytes; bytes of the outputs, received
    gradients and head gradient held then), the multiplier `pipeline.in_flight` gives the
    memory model."""
    mult, other = [], []
    per_rank = [0] * p  # each rank's layers, over its stages in one pass
    for s in range(p * v):
        per_rank[pipeline_zb.stage_rank(p, v, s)] += layers[s]
    for r, n_r in enumerate(per_rank):
        lay, oth = held(p, v, m, r, layers, act, grad, out, head, loss)
        mult.append(lay / (act * n_r) if n_r and act else 0.0)
        other.append(oth)
    return mult, other
