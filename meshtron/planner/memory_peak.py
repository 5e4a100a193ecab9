"""The compute copies and gradients alive at each moment of the peak, and which moment wins.

The peak holds the largest of three moments, never alive together (`peak_moment`): the
loss's (last stage: the logits and their gradients beside the compute copies,
`gathered_bytes`), a block's backward (its compute copies and the layer being recomputed,
beside FSDP2's reduce-scatter input of the previous block: `block_moment`) and, under tensor
parallelism, the embedding's backward (its gradient made whole over the vocabulary:
`embedding_moment`). Each moment is read off the tensors `meshtron rehearse` finds alive at
the peak (tests/test_rehearse.py).

Unsharded compute copies (`gathered_bytes`): FSDP2 all-gathers one wrapped unit (a transformer
block, or the root: embedding + final norm + head) at a time into a new buffer in the compute
dtype and prefetches the next unit (FSDP2 docs, "implicit prefetching"); with
reshard_after_forward=True (ZeRO-3) at most the current and the prefetched unit are alive; with
False (ZeRO-2, and the replicate path meshtron uses for ZeRO-0/1 under FSDP2) every unit stays
gathered from its forward to its backward, i.e. the whole stage's parameters in the compute
dtype. A shard group of one rank (meshtron's ZeRO-0/1 under FSDP2) still copies the parameters
into that buffer (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `wait_for_unshard`),
in fp32 too. During a unit's backward its unsharded gradient exists in the compute dtype (the fp32
copy for reduce_dtype=fp32 is made after the unit's backward, when its activations are gone).
DeepSpeed ZeRO-3 gathers per submodule and caps the parameters
alive at `stage3_max_live_parameters` (default 1e9) plus a `stage3_prefetch_bucket_size`
(default 5e8) prefetch; its gradients go through a `reduce_bucket_size` (default 5e8 elements)
bucket (DeepSpeed configuration docs). Megatron-LM uses the bf16 weights directly.
"""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner.memory_options import MemoryOptions
from meshtron.planner.memory_states import GRAD_BYTES

DEEPSPEED_MAX_LIVE_PARAMS = 1e9
"""DeepSpeed `stage3_max_live_parameters` default."""
DEEPSPEED_PREFETCH_PARAMS = 5e8
"""DeepSpeed `stage3_prefetch_bucket_size` default (elements)."""
DEEPSPEED_REDUCE_BUCKET = 5e8
"""DeepSpeed `reduce_bucket_size` default (elements)."""


def gathered_bytes(mem: MemoryOptions, zero: int, dp: int, layers: int, p_layer: float,
                   p_root: float, largest: float, grad_bytes: float = GRAD_BYTES,
                   keep_gathered: bool = False, root_unit: float | None = None) -> float:
    """Unsharded compute copies of parameters and gradients alive at the peak (module docstring).

    `layers` and `p_layer`: the stage's blocks and the parameters of one on this GPU; `p_root`:
    parameters outside the blocks on this stage (embedding, final norm, head); `root_unit`:
    the largest FSDP unit of them (meshtron and torchtitan wrap the embedding and [norm, head]
    apart: the larger of the two; default `p_root`, one unit)."""
    cb = mem.compute_bytes
    if mem.framework == "fsdp2":
        if dp == 1 and mem.dtype == "fp32":
            return 0.0  # no FSDP2 at all: the fp32 parameters are used directly
        # one unit's unsharded gradient in the compute dtype; its fp32 copy for the reduction
        # is made after the unit's backward, once its activations are freed
        unit = p_root if root_unit is None else root_unit
        grad_unit = gradient_unit_bytes(mem, dp, p_layer, p_root, root_unit)
        if zero == 3 and dp > 1 and not keep_gathered:
            # at the loss the head's unit alone and its gradient (rehearsed: the last block
            # is gathered after the loss's backward); the current and prefetched blocks of
            # the blocks' backward are that moment's (`block_moment`), which the peak weighs
            # apart: counted here too, a MoE block of large experts was one unit too many
            # (keep_gathered: pipelining, where the units stay gathered over the step's
            # micro-batches)
            return 2.0 * cb * unit
        return cb * (layers * p_layer + p_root) + grad_unit
    if zero == 3 and dp > 1:
        # DeepSpeed's per-module gathering, the ZeRO-3 of 16-bit-weight frameworks
        live = max(largest, min(DEEPSPEED_MAX_LIVE_PARAMS, p_layer + p_root))
        return cb * (live + DEEPSPEED_PREFETCH_PARAMS) + grad_bytes * max(largest,
                                                                          DEEPSPEED_REDUCE_BUCKET)
    if mem.framework == "deepspeed" and zero == 2 and dp > 1:
        return grad_bytes * DEEPSPEED_REDUCE_BUCKET
    return 0.0


def gradient_unit_bytes(mem: MemoryOptions, dp: int, p_layer: float, p_root: float,
                        root_unit: float | None = None) -> float:
    """FSDP2's one unsharded gradient unit in the compute dtype that `gathered_bytes` counts
    beside the gathered copies (the largest unit: a block, or the root's `root_unit`, default
    `p_root`): what a backward making weight gradients holds while FSDP2's post_backward has
    not yet folded it into the reduce-dtype accumulator. 0 where FSDP2 does not run (another
    framework; one fp32 rank)."""
    if mem.framework != "fsdp2" or (dp == 1 and mem.dtype == "fp32"):
        return 0.0
    unit = p_root if root_unit is None else root_unit
    return mem.compute_bytes * max(p_layer, unit)


def previous_gradient_bytes(mem: MemoryOptions, dp: int, layers: int, p_layer: float,
                            keep_gathered: bool, reduce_bytes: float) -> float:
    """The previous block's gradient a block's backward runs beside. FSDP2
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `post_backward`) keeps a unit's
    reduce-scatter input (its whole gradient in the reduce dtype: `reduce_bytes` per
    parameter, 4 in fp32, two bf16 units' worth) in `reduce_scatter_states` until the NEXT
    unit's post-backward. The first block in backward order follows the [norm, head] unit,
    whose buffer is released by then (rehearsed): a stage of one block has none. None either
    where gradients are reduced after the last backward (pipelining: `reduce_bytes` 0, or
    `keep_gathered`)."""
    if (mem.framework != "fsdp2" or keep_gathered or layers < 2
            or (dp == 1 and mem.dtype == "fp32")):
        return 0.0
    return reduce_bytes * p_layer


def backward_gathered_bytes(mem: MemoryOptions, zero: int, dp: int, layers: int, p_layer: float,
                            p_root: float, largest: float, grad_bytes: float = GRAD_BYTES,
                            keep_gathered: bool = False, root_unit: float | None = None,
                            last: bool = False) -> float:
    """Compute copies alive while a block runs its backward, besides the previous block's
    gradient (`previous_gradient_bytes`); `gathered_bytes` is the loss's moment and the peak
    holds the larger (`peak_moment`). FSDP2: the block's unit, its unsharded gradient building
    up (all of it: what is not made yet at the backward's fullest moment is memory_bwd.py's)
    and, with ZeRO-3, the prefetched next unit in backward order: a block, or for the `last`
    block in backward order the root's unit (the embedding's; on a stage without one
    `root_unit` is 0: nothing). Rehearsed at a recomputed block's backward (2-layer model,
    ZeRO-3): 0.374 GiB = 0.168 (the previous block's fp32 gradient) + 0.122 (the
    prefetched embedding) + 0.084 (the block)."""
    if mem.framework != "fsdp2" or keep_gathered or (dp == 1 and mem.dtype == "fp32"):
        return gathered_bytes(mem, zero, dp, layers, p_layer, p_root, largest, grad_bytes,
                              keep_gathered, root_unit)
    cb = mem.compute_bytes
    unit = p_root if root_unit is None else root_unit
    if zero == 3 and dp > 1:
        # this block + the prefetched unit
        held = cb * (p_layer + (unit if last else max(p_layer, unit)))
    else:
        held = cb * (layers * p_layer + p_root)     # every unit stays gathered
    return held + cb * p_layer


def peak_moment(logits: float, work: float, at_loss: float, at_block: float,
                at_embedding: float = 0.0) -> tuple[float, float]:
    """(gathered, recompute) bytes of the peak: the largest of the loss's moment (its working
    set `logits` beside the compute copies `at_loss`), a block's backward (a recomputed
    block's working set `work` beside `at_block`: its compute copies and the previous block's
    gradient, less the previous block's activations, released by then) and the embedding's
    backward (`at_embedding`: `embedding_moment`), never alive together
    (`loss_or_recompute`). `recompute` is what recomputation needs beyond the logits and
    `gathered` the rest, so that gathered + recompute + logits is the peak."""
    peak = max(at_loss + logits, at_block + work, at_embedding)
    recompute = max(0.0, work - logits)
    return peak - logits - recompute, recompute


def block_moment(mem: MemoryOptions, zero: int, dp: int, layers: int, p_layer: float,
                 p_root: float, largest: float, grad_bytes: float, keep_gathered: bool,
                 root_unit: float | None, reduce_bytes: float, act: float) -> float:
    """`at_block` of `peak_moment`: the larger of the first block's backward in backward
    order (its compute copies, no previous block's gradient) and a later one's (the same
    copies and the previous block's gradient, less the previous block's stored activations
    (`act`, one micro-batch), which its backward released before this one ran). Where a
    block's activations outweigh its fp32 gradient (large experts, few tokens) the first
    block's is the peak. Of a stage of two blocks the later one is the last in backward
    order, which prefetches the root's unit, not a block (rehearsed, 'mid' model at
    vocabulary 512, full recomputation: the embedding's 2 MiB gathered beside the first
    block's 172 MiB fp32 gradient)."""
    previous = previous_gradient_bytes(mem, dp, max(layers, 2), p_layer, keep_gathered,
                                       reduce_bytes)
    args = (mem, zero, dp, layers, p_layer, p_root, largest, grad_bytes, keep_gathered,
            root_unit)
    later = backward_gathered_bytes(*args, last=layers == 2) + previous - act
    return max(backward_gathered_bytes(*args), later)


def embedding_moment(mem: MemoryOptions, at_loss: float, previous: float, grad_extra: float,
                     freed: float) -> float:
    """`at_embedding` of `peak_moment`: the embedding's backward on the stage holding it, the
    stage's last op for a micro-batch. The compute copies of the loss's moment (`at_loss`;
    accumulated gradients, alive at every moment, are the caller's), the first block's
    reduce-scatter input
    (`previous`, without a pipeline) and the embedding's gradient whole in the compute dtype
    (`grad_extra` elements beyond its shard, `embedding_grad_extra`, made before FSDP2 adds
    it to the accumulated one or slices its shard), less this micro-batch's activations on
    the rank (`freed`), all released by then. Rehearsed (Llama 3 405B, tp=8, pipeline rank
    0): the peak, a 3.9 GiB bf16 [128256, 16384] gradient beside the 7.8 GiB fp32
    accumulated one. DTensor's (meshtron's runtime, torchtitan): Megatron-LM's
    VocabParallelEmbedding and DeepSpeed's embeddings make only the local gradient, which
    lands in the states' gradient buffer (none here)."""
    if not grad_extra or mem.framework != "fsdp2":
        return 0.0
    return at_loss + previous + mem.compute_bytes * grad_extra - freed


MOMENTS = (None, "loss", "block", "embedding")
"""What a stage's peak is priced at: None the largest of its moments (`peak_moment`), "loss"
the loss's alone, "block" the others' (a block's backward, the embedding's), "embedding" the
embedding's alone: an interleaved pipeline's last rank holds different activations at its
loss than at its fullest moment (memory_pipeline.last_rank_moments), a GPipe stage different
gradients at each of its backward's moments (memory_gpipe.py), so each is priced with its
own."""


def moment_parts(logits: float, work: float, at_loss: float, at_block: float,
                 at_embedding: float, moment: str | None) -> tuple[float, float, float]:
    """(gathered, recompute, logits) bytes of the stage's `moment` (`MOMENTS`; arguments as
    `peak_moment`), adding up to what that moment holds: the loss's is its compute copies and
    the logits, no recomputation running (`loss_or_recompute`); the others' holds no logits."""
    if moment is None:
        return (*peak_moment(logits, work, at_loss, at_block, at_embedding), logits)
    if moment == "loss":
        return at_loss, 0.0, logits
    if moment == "embedding":
        return at_embedding, 0.0, 0.0
    held = max(at_block + work, at_embedding)
    # a backward's working set below zero (gradients not yet made outweighing its
    # temporaries: memory_acts.backward_working_bytes) is the compute copies', as `peak_moment`
    recompute = max(0.0, work)
    return held - recompute, recompute, 0.0


def embedding_grad_extra(model: ModelSpec, tp: int) -> float:
    """Gradient elements a vocabulary-parallel token embedding makes beyond its local shard.
    DTensor's embedding backward returns the weight gradient whole ([vocab, hidden],
    Replicate, on every tensor rank; parallel/parallel_model.py `_align_grad_placements` shards
    it after backward), so where FSDP2 accumulates gradients unsharded over micro-batches (ZeRO-0/1,
    `accumulate_unsharded`, pipelining) the embedding's is tp times its shard, in the reduce
    dtype. Rehearsed at tp=4: a [32000, 2048] fp32 gradient (0.244 GiB) beside a 0.061 GiB
    shard."""
    if tp == 1:
        return 0.0
    return model.vocab * model.hidden * (1.0 - 1.0 / tp)



def embedding_accum_bytes(mem: MemoryOptions, zero: int, accum: float, gsize: float, m: int,
                          pp: int, shard_dp: int) -> float:
    """Bytes per element of `embedding_grad_extra` held over the whole step: where FSDP2
    accumulates gradients unsharded (`accum`: ZeRO-1/2/3 with one reduction per step), in that
    accumulator. ZeRO-0 accumulates them unsharded too (FSDP2 on a size-1 shard axis, gradient
    sync only on the last micro-batch: parallel/data_parallel.py; under pipelining torch's
    `PipelineStage.backward_maybe_with_nosync` does it), in the reduce dtype (`gsize`;
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py `to_accumulated_grad_if_needed`):
    its states' gradient is that accumulator for the local shard, but the embedding's
    accumulates whole, tp times its shard, from the first stage's first backward to the
    step's end. Rehearsed (Llama 3 70B tp=8 pp=4 dp=1 interleaved:8, pipeline rank 0): a
    [128256, 8192] fp32 gradient (3.91 GiB) alive at the peak beside a 0.49 GiB shard, which
    the planner priced only at the embedding's own moment (4.6% under the rehearsal).
    One micro-batch without a pipeline accumulates nothing (the embedding's moment prices
    the whole gradient); no FSDP2 (fp32 at dp=1) shards it after every backward."""
    if accum:
        return accum
    if (zero == 0 and mem.framework == "fsdp2" and (m > 1 or pp > 1)
            and not (shard_dp == 1 and mem.dtype == "fp32")):
        return gsize
    return 0.0
