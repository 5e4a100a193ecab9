"""What a GPipe stage holds at each moment of its backward: accumulated gradients that do not
exist yet at its fullest one.

torch 2.13's ScheduleGPipe (torch/distributed/pipelining/schedules.py,
`ScheduleGPipe._step_microbatches`) runs every micro-batch's forward, then every backward in
micro-batch order 0 .. m - 1, and reduces the gradients after the last
(`perform_reduce_grad`); until then the stage runs its FSDP2 units without gradient sync
(stage.py `backward_maybe_with_nosync`). FSDP2 makes a unit's fp32 accumulator at the unit's
first post-backward (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
`to_accumulated_grad_if_needed`, called from _fsdp_param_group.py `post_backward`) and adds
into it at the later ones (`accumulate_unsharded_grad_if_needed`). So the stage's moments are:

* A, the first backward's first moment (the loss's on the last stage, the first block's in
  backward order on the others): all m micro-batches' activations, no accumulated gradient
  (on the last stage, at its first block, the head's: its backward ran first);
* C, the first backward's last (the embedding's, on the first stage under tensor
  parallelism): m micro-batches' activations less this one's (freed by the moment's own
  bytes, memory_peak.embedding_moment) beside every block's accumulated gradient, not yet the
  embedding's;
* B, the second backward's first: m - 1 micro-batches' activations and every gradient. Its
  later moments hold fewer activations beside the same gradients, and the first backward's
  inner ones lie between A's and B's (each block's backward frees a micro-batch's
  activations of that block and adds its gradient: linear in the blocks done). With one
  micro-batch there is no B: the first backward's last block stands for it.

The linear model (memory.stage_memory) prices all m micro-batches beside all the gradients:
rehearsed, 'mid' pp 2, 10 layers, FSDP2 ZeRO-1, stage 0, +12.2% (1.084 GiB of fp32 gradients
that do not exist at A, the peak there; docs/measurements.md, branch halfrest).

The last stage also keeps what each micro-batch's loss saved, from its forward to its
backward: GPipe runs the loss of every micro-batch before the first backward (torch's
schedule computes it right after the stage's forward, `_maybe_compute_loss`), where 1F1B's
last stage holds one micro-batch at a time. `loss_saved_bytes`.
"""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner.memory_acts import chunked_loss_held_bytes
from meshtron.planner.memory_options import MemoryOptions


def loss_saved_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int,
                     mem: MemoryOptions) -> float:
    """Bytes one micro-batch's loss keeps on a pipeline's last stage from its forward to its
    backward. The eager loss (meshtron/model/loss.py `cross_entropy_loss`: logits cast to
    fp32, F.cross_entropy) saves log_softmax's fp32 output, and torch's pipelining keeps the
    stage output, the logits in the compute dtype (PipelineStage.fwd_cache): 4 bytes + the
    compute dtype's per element ([tokens, vocab / tp] under loss_parallel too). Megatron's
    vocabulary-parallel loss its bf16 logits and fp32 softmax (6); the in-place fused loss
    the 16-bit logits (memory_acts.logits_bytes, the loss's working set, counts the
    micro-batch at its backward). meshtron's chunked loss (tp = 1: the last stage returns the
    loss, parallel/parallel_model.py `_stage_computes_loss`) no logits: its weight-gradient
    accumulator and input gradient (memory_acts.chunked_loss_held_bytes)."""
    elements = micro_batch * seq * model.vocab / tp
    kind = mem.loss_kind
    if kind == "chunked" and tp == 1:
        return chunked_loss_held_bytes(model, micro_batch * seq, mem)
    if kind == "vocab-parallel":
        return elements * 6.0
    if kind in ("inplace", "flash-ce"):  # the 16-bit logits until the loss's backward
        return elements * mem.compute_bytes
    if kind == "eager-bf16":  # log_softmax's output in the compute dtype
        return elements * 2.0 * mem.compute_bytes
    return elements * (4.0 + mem.compute_bytes)


def gpipe_moments(m: int, layers: int, per_mb: float, grads: float, root_grads: float,
                  loss_saved: float, head: bool, embedding: bool, stored_last: float = 0.0,
                  head_grads: float = 0.0,
                  resharded: tuple[float, float] = (0.0, 0.0), first_block: float = 0.0,
                  one_step: bool = False) -> list[tuple[float, str | None]]:
    """(bytes held, moment) of a GPipe stage's candidate peaks (module docstring: A, C, B),
    the moment as memory.MOMENTS names the working set beside them. `layers`: the stage's
    blocks; `per_mb`: one micro-batch's stored activations on the stage; `grads`: its blocks'
    accumulated gradients; `root_grads`: the embedding's or the head's (made at the first backward's
    last or first moment); `loss_saved`: what each micro-batch's loss keeps (the last stage,
    `head`); `embedding`: the first stage's embedding moment is priced apart (a whole
    vocabulary-parallel gradient, memory_peak.embedding_moment); `stored_last`: under
    meshtron's `half` on an odd stage, the stored last block's activations, whose backward
    runs first and frees them before the checkpointed block below is replayed (moment
    "replay": a block's backward with the recomputation's working set; rehearsed, 'mid' pp 2,
    stages of 5: the peak in block 3's replayed MLP after block 4's backward); `head_grads`:
    the head's own gradient, made by the head's backward while the loss's working set (the
    logits' gradient it multiplies) is alive (rehearsed, 'mid' pp 1, one micro-batch, ZeRO-0:
    the peak there, the head's fp32 gradient and no other); `resharded`: (the head's unit,
    one block's) compute copies freed once its backward ran (`resharded_after_backward`),
    taken off the moments after it; `first_block`: what the stage's block moment holds beyond
    the first block's backward in backward order (the previous unit's reduce-scatter input
    less a layer's activations, memory_peak.block_moment; the head's buffer is released
    before it), taken off the head's first block, the second block priced beside it (with a
    large previous gradient it outweighs the first: 'mid' at 2 layers the second is the
    last); `one_step`: the embedding is on this rank too (no pipeline), its gradient made
    last: the head's moments hold the head's alone."""
    others = loss_saved if head else 0.0
    head_unit, block_unit = resharded if head else (0.0, resharded[1])
    if head and one_step:
        root_grads = head_grads
    out = [(m * per_mb + (m - 1) * others + (head_grads if head else 0.0),
            "loss" if head else "block")]
    if head:  # its first block's backward: the head's gradient made, this loss's freed
        out.append((m * per_mb + (m - 1) * others + root_grads - head_unit - first_block,
                    "block"))
    if head and first_block and layers > 2:  # the second: beside the first's reduce-scatter
        # input (the block moment's later one), the first's copy freed and gradient made
        out.append((m * per_mb + (m - 1) * others + grads / layers + root_grads - head_unit
                    - block_unit, "block"))
    if stored_last and layers > 1:
        out.append((m * per_mb + (m - 1) * others - stored_last + grads / layers
                    + (root_grads if head else 0.0) - head_unit - block_unit, "replay"))
    if embedding:  # beside the head's gradient where the head is on this rank (pp 1)
        out.append((m * per_mb + grads + (head_grads if head else 0.0) - head_unit
                    - layers * block_unit, "embedding"))
    if m == 1:  # no second backward: the first's last block, the others' gradients made
        out.append((per_mb / layers + grads * (layers - 1) / layers
                    + (root_grads if head else 0.0) - head_unit
                    - (layers - 1) * block_unit, "block"))
    else:
        out.append(((m - 1) * per_mb + grads + root_grads + (m - 2) * others, None))
    return out


def looped_moments(m: int, layers: list[int], per_mb: list[float], grads: list[float],
                   root_grads: float, loss_saved: float, head: bool, embedding: bool,
                   stored_last: list[float], head_grads: float = 0.0
                   ) -> list[tuple[float, int, int, str | None]]:
    """(bytes held, chunk, that chunk's micro-batches held, moment) of a looped-BFS rank's
    candidate peaks. torch 2.13's ScheduleLoopedBFS (schedules.py
    `_calculate_single_rank_operations`) runs, on each rank, every micro-batch's forward of
    its first local chunk, then of the next, ..., then every backward of its last chunk (in
    reverse micro-batch order), then of the one before: each chunk's backwards are GPipe's
    (`gpipe_moments`, the chunk's own A, C, B) beside what the other chunks hold then, all m
    micro-batches of the chunks below (not yet backwarded) and the accumulated gradients of
    those above (done; FSDP2 made them at their first backward). Per chunk c (the rank's
    c-th, virtual stage c p + s): `layers[c]` blocks, `per_mb[c]` one micro-batch's stored
    activations, `grads[c]` its blocks' accumulated gradients, `stored_last[c]` (`half` on
    an odd chunk, `gpipe_moments`). `root_grads`: the embedding's (chunk 0, `embedding`
    its moment priced apart) or the head's (the last chunk, `head`, with every
    micro-batch's `loss_saved` and the head's own gradient `head_grads` at the loss). The
    linear model holds all m micro-batches of every chunk beside every gradient; the
    last chunk's first backward holds the activations without gradients, the earlier
    chunks' moments fewer activations beside the later chunks' gradients."""
    v = len(layers)
    out = []
    for c in range(v - 1, -1, -1):
        last, first = head and c == v - 1, embedding and c == 0
        # the chunks below hold every micro-batch, those above their gradients (and the
        # head's, made at the last chunk's first backward)
        base = m * sum(per_mb[:c]) + sum(grads[c + 1:]) + (
            root_grads if head and c < v - 1 else 0.0)
        roots = root_grads if last or (c == 0 and not head) else 0.0
        for held, moment in gpipe_moments(
                m, max(layers[c], 1), per_mb[c], grads[c], roots, loss_saved, last, first,
                stored_last[c], head_grads if last else 0.0):
            count = m - 1 if moment is None else m  # B: its first micro-batch's gone
            if moment is None and not (last or (c == 0 and not head)):
                moment = "block"  # no loss, no embedding in this chunk's backward
            out.append((base + held, c, count, moment))
    return out


def resharded_after_backward(m: int, pp: int, zero: int, fsdp_all: bool, cb: float,
                             p_head: float, p_block: float) -> tuple[float, float]:
    """(the head's unit, one block's) compute copies that FSDP2 frees once the unit's backward
    has run, bytes: without a pipeline the step's last (here only) micro-batch runs with
    `set_reshard_after_backward(True)` on every unit (parallel/data_parallel.py
    `set_microbatch_policy`: `last`), so under ZeRO-0/1/2, whose units stay gathered from
    their forward (`fsdp_all`: memory.stage_terms counts every block's copy), each unit's
    backward frees its copy (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
    `post_backward`: `reshard()`); the embedding's unit, last in backward order, stays.
    Rehearsed ('mid', 2 layers, dp 8, ZeRO-1, full recomputation, block 0's backward):
    0.374 GiB gathered = block 0 (0.084) + the embedding (0.122) + block 1's fp32
    reduce-scatter input (0.168), not the 0.656 GiB of every unit. ZeRO-3 regathers (its
    linear figure is two units), and with m > 1 or a pipeline the earlier micro-batches keep
    every unit gathered: (0, 0)."""
    if m != 1 or pp != 1 or zero == 3 or not fsdp_all:
        return 0.0, 0.0
    return cb * p_head, cb * p_block
