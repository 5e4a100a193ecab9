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

Three more things the split backward holds that a whole backward does not (read in torch 2.13
and traced tensor by tensor on the V's middle rank, `meshtron rehearse`, 2026-12-05):

* W's weight gradients wait for the stage's next B. W assigns them itself
  (`stage_backward_weight`: `weight.grad = dw` on FSDP2's unsharded parameters, in the compute
  dtype), and FSDP2 folds a unit's `.grad` into its reduce-dtype accumulator only in its
  `post_backward` (_fsdp_param_group.py, `accumulate_unsharded_grad_if_needed` /
  `to_accumulated_grad_if_needed`), a hook on the unit's inputs that fires when their
  gradient is made: in the next B, not in W (W walks the weight paths only). So a non-first
  stage keeps its layers' compute-dtype gradients from each W to its next B (`pending`); the
  first stage's W is a whole backward and folds as it goes. A stack that folds them itself
  at W's end (MemoryOptions.fold_after_weight_pass: meshtron's runtime, parallel/pipeline.py
  `fold_weight_grads`) holds them only until then (`held`'s `folds`): the accumulator they
  go to is FSDP2's own, held either way.
* B frees nothing while it runs (retain_graph), so its own working set adds to what is held:
  at its last block the norm's backward (`input_backward_bytes`).
* `backward_state` keeps the stage's inputs to W and B set their `.grad` to the input
  gradient (`stage_backward_input`): one more [tokens, hidden] per waiting micro-batch of a
  non-first stage.
* Under checkpointed blocks ('full', 'half') each W parameter group recomputes its block and
  keeps, until W ends, what the nodes W never runs saved (`weight_recompute_kept_bytes`).
  W peaks before its end, while a group of the stage's last checkpointed block recomputes
  it (traced group by group on the V's rank 1 and zb's last stage, 2026-12-05, branch
  zbvfull): `weight_pass`.
"""

from __future__ import annotations

from functools import lru_cache
from operator import mul

from meshtron.planner import pipeline_zb
from meshtron.planner.zb_recompute import (
    WeightPass, block_groups, mla_groups, weight_groups)


def _composite_norm(model, fused_norm: bool) -> bool:
    """Whether the block's RMSNorm runs torch's composite path (the CPU's; memory_acts.py),
    which upcasts to fp32 and multiplies by the weight in fp32."""
    return model.norm == "rmsnorm" and not fused_norm


def captured_grad_bytes(model, tp: int, sp: bool, tokens: int, compute_bytes: float,
                        fused_norm: bool = True) -> float:
    """Bytes of the gradients `stage_backward_input` captures for one block and micro-batch of
    `tokens` tokens per rank: the output gradient of every weight GEMM (column-parallel q, k, v
    and gate/up: their local 1/tp share; row-parallel o and down: the whole hidden width, the
    gradient of their partial sums) and of each norm's weight product (sequence-sharded with
    sequence parallelism; fp32 for the composite RMSNorm, whose weight product runs in fp32:
    measured, 4 bytes per element on the 'mid' block): one per W parameter group
    (zb_recompute.block_groups)."""
    groups = block_groups(model, tp, sp, compute_bytes, _composite_norm(model, fused_norm))
    return tokens * sum(g.captured for g in groups)


def input_backward_bytes(model, tp: int, sp: bool, tokens: int, compute_bytes: float,
                         fused_norm: bool = True) -> float:
    """Bytes B's own working set adds to what it holds at its end (the captured gradients and
    the input gradient), at its peak: B frees none of the saved tensors it reads
    (retain_graph=True), so, unlike a whole backward, nothing it has finished makes room for
    its temporaries. Two candidates, the larger:

    * the stage's first norm, B's last op: the composite RMSNorm's backward holds five fp32
      [tokens, hidden] tensors at once (traced op by op on torch 2.13 CPU: the upcast
      gradient, then div, pow, mul, mul of the mean-square path), less the input gradient
      they become (made only after them; counted from B's end). Measured on two 'mid'
      blocks, ffn 2048 to 16384: 9 [tokens, hidden] bf16 tensors above B's end, as here. A
      fused norm's backward writes the input gradient directly: none.
    * the last block's SwiGLU backward: the product's and the SiLU output's gradients
      ([tokens, ffn / tp] each, alive together in the product's backward), less what B has
      not made yet then (the attention's captured gradients, the attention norm's and the
      input gradient). An upper bound: measured at ffn = 8 hidden, 1.5 [tokens, hidden]
      below it."""
    cb = compute_bytes
    h_in = model.hidden / (tp if sp and tp > 1 else 1)
    composite = _composite_norm(model, fused_norm)
    norm = tokens * h_in * (5 * 4.0 - cb) if composite else 0.0
    q = model.heads * model.head_dim
    attention = cb * ((q + 2 * model.kv_dim) / tp + model.hidden)  # its captured gradients
    if getattr(model, "is_mla", False):
        attention = sum(g.captured for g in mla_groups(model, tp, cb, 4.0 if composite
                                                       else cb, composite))
    later = attention + cb * h_in + (4.0 if composite else cb) * h_in
    gates = 2.0 if model.gated_mlp else 1.0
    mlp = tokens * (gates * cb * model.ffn_hidden / tp - later)
    return max(0.0, norm, mlp)


def head_grad_bytes(model, tp: int, tokens: int, compute_bytes: float,
                    fused_norm: bool = True, chunked: bool = False) -> float:
    """The logits' gradient the output projection's intermediate captures on the last stage
    (vocabulary-parallel: vocab / tp per rank) and the final norm's output gradient (fp32
    for the composite RMSNorm, as `captured_grad_bytes`). Not the logits themselves: torch's
    stage detaches the last stage's output in B and keeps only the loss to W
    (stage.py `backward_one_chunk`: `t.detach_()`, `backward_state` holds `(loss,)`), and
    with `return_outputs=False` (meshtron's runtime: parallel/pipeline.py `step_options`)
    `output_chunks` holds none of them either. `chunked` (meshtron's chunked loss, tp = 1): no
    logits' gradient (the loss node's own output, the loss, is what W starts from), and the
    norm's output gradient is the loss's input gradient, which `chunked_loss_held_bytes`
    counts (memory_zb.held's `saved`), unless the composite norm's fp32 one."""
    norm_bytes = 4.0 if _composite_norm(model, fused_norm) else compute_bytes
    if chunked:
        return tokens * model.hidden * (4.0 if _composite_norm(model, fused_norm) else 0.0)
    logits = tokens * model.vocab / tp * compute_bytes
    return logits + tokens * model.hidden * norm_bytes


def weight_recompute_kept_bytes(model, tp: int, sp: bool, tokens: int,
                                compute_bytes: float, fused_norm: bool = True) -> float:
    """Bytes W keeps per checkpointed layer of a non-first stage at its end, when the layer's
    block runs under a non-reentrant checkpoint ('full', the recomputed blocks of 'half').
    Each W parameter group is its own `autograd.grad`, so its own graph task, and
    torch/utils/checkpoint.py keeps a task's recomputed tensors (`frame.recomputed[gid]`)
    until the task unpacks them or their holders die with the graph: a group recomputes the
    whole block and unpacks only its own op's saved tensors (W runs with retain_graph=False,
    so the nodes it ran release theirs in every task), so what the nodes W never runs saved
    stays, once per group (`zb_recompute.weight_groups`), until W ends: the attention's q, k
    (after rope), v and output, the residual stream the MLP norm reads, and the MLP's
    activation inputs and output (SwiGLU: w1's and w3's outputs and the SiLU's). B leaves
    none (it unpacks everything it recomputed). Measured on two 'debug' blocks, torch 2.13
    CPU: 224 [tokens, hidden] fp32 above B's end after 16 of 18 groups, 18 x 12.25 = 220.5
    here (tests/test_memory_zb.py, docs/measurements.md #zb-full-recompute). The norms: a
    fused RMSNorm saves its input (the residual; the attention norm's is the checkpoint's
    input, not recomputed); the composite one (CPU) saves an fp32 upcast of its input instead,
    a new tensor for both norms when the compute dtype is narrower, and its fp32 rsqrt."""
    h_res = model.hidden / (tp if sp and tp > 1 else 1)
    q = model.heads * model.head_dim / tp
    mlp = (3 if model.gated_mlp else 1) * model.ffn_hidden / tp
    norms = h_res * compute_bytes
    if _composite_norm(model, fused_norm) and compute_bytes < 4.0:
        norms = 2 * (h_res + 1) * 4.0
    per_token = (2 * q + 2 * model.kv_dim / tp + mlp) * compute_bytes + norms
    return weight_groups(model) * tokens * (per_token + _mla_latents_kept(
        model, compute_bytes, _composite_norm(model, fused_norm)))


def _mla_latents_kept(model, cb: float, composite: bool) -> float:
    """Bytes per token MLA's latent norms save that W never runs (model/mla.py; q, k, V padded
    and the padded output are `weight_recompute_kept_bytes`' 2 q + 2 kv_dim, all 192 wide):
    a fused norm, or the composite one at fp32, its input: wq_a's output, and the latent, a
    view that keeps all of wkv_a's output (latent + rotary key); the composite norm at a
    narrower dtype its fp32 upcast and rsqrt instead. Replicated over tp. 0 without MLA."""
    if not getattr(model, "is_mla", False):
        return 0.0
    qr, kvr = model.q_lora_rank, model.kv_lora_rank
    if composite and cb < 4.0:
        return 4.0 * ((qr + 1 if qr else 0) + kvr + 1)
    return cb * (qr + kvr + model.qk_rope_head_dim)


def weight_pass(model, tp: int, sp: bool, tokens: int, compute_bytes: float,
                fused_norm: bool, every: int, pending: float) -> WeightPass:
    """What W holds at its peak on a non-first stage whose every `every`-th block is
    checkpointed (1 'full', 2 'half'), for micro-batches of `tokens` tokens per rank
    (zb_recompute.WeightPass; `pending`: the weight gradients per layer W leaves until the
    stage's next B, as `held`'s)."""
    composite = _composite_norm(model, fused_norm)
    groups = tuple(g._replace(captured=tokens * g.captured, last_holder=tokens * g.last_holder)
                   for g in block_groups(model, tp, sp, compute_bytes, composite))
    copy = weight_recompute_kept_bytes(model, tp, sp, tokens, compute_bytes,
                                       fused_norm) / weight_groups(model)
    return WeightPass(copy, groups, pending, every)


@lru_cache(maxsize=4096)
def held(p: int, v: int, m: int, rank: int, layers: tuple[int, ...], act: float, grad: float,
         out: float, head: float, loss: float = 0.0, pending: float = 0.0,
         work: float = 0.0, kept: WeightPass | None = None,
         odd: float = 0.0, saved: float = 0.0, folds: bool = False,
         idle: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(layer bytes, other bytes) pipeline rank `rank` holds at its peak under 'zb' with v
    stages per rank: `layers[s]` the layers of virtual stage s (all p v of them), `act` and
    `grad` the stored activations and captured gradients per layer and micro-batch, `out` a
    chunk output (a received output gradient, an input's gradient), `head` what the last
    stage captures beside its layers' (`head_grad_bytes`), `pending` the weight gradients per
    layer a W leaves until the stage's next B (module docstring; 0 where the accumulator is
    the gradient itself), `work` B's working set (`input_backward_bytes`), `kept` what W adds
    at its peak under checkpointed blocks (`weight_pass`; None without them), `odd` what a
    stage of an odd layer count holds per micro-batch beyond `act` per layer (`half`:
    memory_pipeline.half_odd_bytes). Layer bytes:
    activations, captured and pending gradients of the layers; other: outputs, received and
    input gradients, the head's captured gradient and B's working set. The walk's moments
    are counted once per order (`_moments`), then weighed here. `loss`: the loss moment's
    bytes the memory model adds to the last stage's rank (its logits beyond a block's
    recomputation working set, which B and W run: memory.stage_memory, estimate_walks._zb_held),
    there only while a B of the last stage starts: at any other moment they are gone, so it
    counts `loss` less there (the result is what is held beside them). `saved`: what the
    last stage's loss keeps per micro-batch from its F to its W (meshtron's chunked loss:
    memory_acts.chunked_loss_held_bytes, dropped after the weight pass,
    model/loss.py `OutputHead.split_backward`); at a loss moment the memory model's logits
    already count the micro-batch at its loss, so `saved` once less there. `folds`: W's
    gradients are folded into the accumulator at W's end (`_moments`), not at the next B.
    `idle`: (FSDP2's unsharded gradient unit, a whole backward's working set), which the stage
    memory counts for a backward making weight gradients (memory_peak.gathered_bytes,
    peak_moment) and, with `folds`, no B holds: B makes no weight gradient and W's were
    folded at W's end, so the unit is left out at the end of each B and at the loss's
    moments (a B's start), the working set at the end of each B, whose own is `work`.
    Traced tensor by tensor on the V's rank 1 ('mid', tests/test_rehearse.py 'pp zbv'): at
    its peak, stage 1's last B, no bf16 weight gradient is alive and no tensor of a block's
    backward but B's own norm backward."""
    last = p * v - 1
    # the steady state repeats, so the moments of a few rounds of p micro-batches are those
    # of any more: 4p for one stage per rank and the V, 5p for ZB1P's rounds of p (m a
    # multiple of p; checked: tests/test_memory_zb.py)
    stages, moments, at_loss = _moments(p, v, _walked(p, v, m), rank, folds)
    # per stage of the rank, per micro-batch in flight (F..W), waiting (B..W), per stage
    # holding a W's gradients, W at its peak, a rooted stage's W holding its root unit's
    # gradient (the first's whole backward, the last's W end): (layer bytes,
    # other bytes); last: B's working set (in place of a whole backward's, `idle`)
    # torch's V hands a stage's output to the next stage on the same rank as its input, and
    # that stage's input gradient back as the output gradient (stage.py set_local_fwd_input,
    # set_local_bwd_input): both are the next stage's receive-buffer slots
    # (memory_pipeline.receive_buffers), no tensor beside them
    sent = {s: out if s != last and s + 1 not in stages else 0.0 for s in stages}
    weights = ([(layers[s] * act + (odd if layers[s] % 2 == 1 else 0.0),
                 sent[s] if s != last else saved) for s in stages]
               + [(layers[s] * (0.0 if s == 0 else grad),
                   sent[s] + (out if s != 0 else 0.0)
                   + (head if s == last and s != 0 else 0.0)) for s in stages]
               + [(layers[s] * pending, 0.0) for s in stages])
    unit, block_work = idle if folds else (0.0, 0.0)
    weights = (weights
               + [(kept.peak(layers[s]) if kept and s != 0 else 0.0, 0.0) for s in stages]
               # the rooted stages' own gradient unit (the first's whole backward folds
               # unit by unit; the last's head beside its layers' `pending` late in its W)
               + [(0.0, unit if s in (0, last) else 0.0) for s in stages]
               # B's working set in place of a whole backward's, at least none (the moments
               # were pruned for weights >= 0: `_undominated`)
               + [(0.0, max(0.0, work - block_work))])
    # the same products summed in the same order as a generator over zip(vec, weights),
    # by map in C (the search weighs every moment of every zb plan: session 48)
    lay_w, oth_w = [x[0] for x in weights], [x[1] for x in weights]
    best = (0.0, float("-inf"))
    for group, less in ((moments, (loss if at_loss else 0.0) + unit),
                        (at_loss, saved + unit)):
        for vec in group:
            lay = sum(map(mul, vec, lay_w))
            oth = sum(map(mul, vec, oth_w)) - less
            if lay + oth > sum(best):
                best = (lay, oth)
    return best if best[1] > float("-inf") else (0.0, 0.0)


def _walked(p: int, v: int, m: int) -> int:
    """The micro-batches of torch's 'zb' order whose moments are those of m (`held`)."""
    if v <= 2:
        return min(m, 4 * p)
    return m if m % p else min(m, 5 * p)  # else rounds of m // (m // p): their own order


@lru_cache(maxsize=8192)
def _moments(p: int, v: int, m: int, rank: int,
             folds: bool = False) -> tuple[tuple[int, ...], tuple, tuple]:
    """(the rank's stages, the moments of its order where what it holds can peak, the loss
    moments): each a vector of, per stage of the rank, the micro-batches between their F and
    their W, those of them between B and W, and whether the stage holds a W's weight
    gradients (set by its W, folded by its next B; never for the first stage, whose W is a
    whole backward), whether the stage's W is at its peak (its recomputations kept,
    `weight_pass`), then whether B's working set is alive. F and B only add, W only frees
    activations (but what its recomputations keep), so the peaks are: the end of each F while
    a stage holds W's gradients (its next B folds them: torch's schedule as it is), the end
    of each B of a
    non-first stage, its working set alive (the stage's own W gradients folded by then but
    the last block's, which the memory model's gathered copies count), and the start, peak
    and end of each W (`folds`: its end holds its gradients, folded right after, so none
    waits for the next B), with, per stage, whether a rooted stage's W holds its root's
    gradient unit there (the first stage's at its start and peak: its whole backward; the
    last stage's at its peak and end: the head's gradient, made after its blocks'); of those,
    the ones no
    other holds at least as much of everything as (every weight is >= 0). The loss moments:
    the start of each B of the last stage (the memory model's logits alive), if the rank
    holds it."""
    order = _order(p, v, m)[rank]
    stages = tuple(sorted({s for _, s in order}))
    at = {s: i for i, s in enumerate(stages)}
    fw, bw, pend = [0] * len(stages), [0] * len(stages), [0] * len(stages)
    run = [0] * len(stages)  # W at its peak on the stage: its groups' recomputations kept
    inw = [0] * len(stages)  # a W of a rooted stage holding its root's gradient unit
    seen: dict[tuple, None] = {}
    at_loss: dict[tuple, None] = {}
    for kind, s in order:
        i = at[s]
        if kind == "F":
            fw[i] += 1
            if any(pend):  # W's gradients beside it, folded only by a B to come
                seen[(*fw, *bw, *pend, *run, *inw, 0)] = None
        elif kind == "B":
            if s == p * v - 1:
                at_loss[(*fw, *bw, *pend, *run, *inw, 0)] = None
            bw[i] += 1
            pend[i] = 0
            if s != 0:  # the first stage runs no B (its W is the whole backward)
                seen[(*fw, *bw, *pend, *run, *inw, 1)] = None
        else:
            # the first stage's W is a whole backward, FSDP2's unit made while its
            # micro-batch is held; the last stage's W makes the head's gradient after its
            # blocks' groups, alive to its end, the fold: its peak may be there (traced:
            # Llama 3 8B, the V's rank 0 at pp 4 under full recomputation; the 'mid' model's
            # peaks inside its last block's groups, before it)
            inw[i] = int(s == 0)
            seen[(*fw, *bw, *pend, *run, *inw, 0)] = None
            run[i] = 1  # W's peak, before it frees (weight_pass)
            inw[i] = int(s in (0, p * v - 1))
            seen[(*fw, *bw, *pend, *run, *inw, 0)] = None
            run[i] = 0
            fw[i] -= 1
            bw[i] -= 1
            pend[i] = int(s != 0)
            inw[i] = int(s == p * v - 1)
            seen[(*fw, *bw, *pend, *run, *inw, 0)] = None
            inw[i] = 0
            if folds:  # meshtron's runtime: fold_weight_grads right after W
                pend[i] = 0
    return stages, _undominated(seen), _undominated(at_loss)


def _undominated(seen: dict) -> tuple:
    """The moments no other holds at least as much of everything as (a waiting micro-batch
    is also one in flight: its activations count in both). Each vector is packed into one
    integer, a field per count with a guard bit above it, so that `k` holds at least `a`
    everywhere exactly when every guard bit of (k | guards) - a survives (no field borrows:
    the counts stay below the guard bit): one subtraction per pair, not a loop over counts
    (the looped zero bubble's walks hold thousands of moments)."""
    flat = sorted(seen, key=lambda vec: -sum(vec))
    if not flat:
        return ()
    width = max(max(vec) for vec in flat).bit_length() + 1
    guards = sum(1 << (i * width + width - 1) for i in range(len(flat[0])))
    kept: list[tuple] = []
    packed: list[int] = []
    for vec in flat:
        a = sum(x << (i * width) for i, x in enumerate(vec))
        if not any(((k | guards) - a) & guards == guards for k in packed):
            kept.append(vec)
            packed.append(a)
    return tuple(kept)


@lru_cache(maxsize=1024)
def _order(p: int, v: int, m: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """torch's per-rank orders (pipeline_zb.orders), kinds and stages only."""
    return tuple(tuple((k, s) for k, s, _ in o) for o in pipeline_zb.cached_orders(p, v, m))


def in_flight(p: int, v: int, m: int, layers: tuple[int, ...], act: float, grad: float,
              out: float, head: float, loss: float = 0.0, pending: float = 0.0,
              work: float = 0.0, kept: WeightPass | None = None,
              odd: float = 0.0, saved: float = 0.0, folds: bool = False,
              idle: list[tuple[float, float]] | None = None) -> tuple[list[float], list[float]]:
    """Per pipeline rank, (micro-batches' worth of its layers' activations held at the peak,
    counting the captured and pending gradients in activation bytes; bytes of the outputs,
    received and input gradients, head gradient and B's working set held then), the
    multiplier `pipeline.in_flight` gives the memory model (`held` for the arguments; `idle`
    per rank)."""
    mult, other = [], []
    per_rank = [0] * p  # each rank's layers, over its stages in one pass
    for s in range(p * v):
        per_rank[pipeline_zb.stage_rank(p, v, s)] += layers[s]
    for r, n_r in enumerate(per_rank):
        lay, oth = held(p, v, m, r, layers, act, grad, out, head, loss, pending, work, kept,
                        odd, saved, folds, idle[r] if idle else (0.0, 0.0))
        mult.append(lay / (act * n_r) if n_r and act else 0.0)
        other.append(oth)
    return mult, other
