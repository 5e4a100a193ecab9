"""What Transformer Engine's FP8 scaling synchronises across ranks: its amax all-reduces.
Torch-free; priced with comm.small_all_reduce (NCCL's LL protocol: a few bytes, all latency).

Delayed scaling (fp8.FP8_SCALINGS 'te-delayed': Megatron-Core's default `--fp8-recipe
delayed`). Every FP8 module registers its amax slots once in one global buffer per (recipe,
group) (NVIDIA/TransformerEngine transformer_engine/pytorch/fp8.py at v1.11,
`add_fp8_tensors_to_global_buffer`: `amax_history[0]` of its forward meta, 3 slots per GEMM
-- input, weight, output -- and of its backward meta, 2 -- output gradient, input gradient).
`reduce_and_update_fp8_tensors` concatenates a direction's slots, all-reduces them (MAX,
`async_op=False`: the compute stream waits for it) over the autocast's group and updates the
scales. It runs
  * forward: when the outermost `fp8_autocast` exits (`fp8_autocast_exit`, depth 0, grad on);
  * backward: after the backward of the first FP8 module of that autocast, the last to run
    (module/linear.py, layernorm_linear.py, grouped_linear.py:
    `reduce_and_update_bwd_fp8_tensors = is_first_fp8_module()`).
Same code at v2.2 (fp8.py `fp8_autocast_exit`: "delayed scaling only"). Megatron-Core opens
one autocast per TransformerBlock forward, i.e. per micro-batch and model chunk (core_r0.9.0
and core_r0.10.0 megatron/core/transformer/transformer_block.py `fp8_context` around the layer
loop; core_v0.12.2 the `outer_fp8_context` for the delayed recipe), with
`fp8_group = parallel_state.get_amax_reduction_group(with_context_parallel=True)`: the
tensor x data x context parallel ranks of a pipeline stage (`_TENSOR_AND_DATA_PARALLEL_GROUP
_WITH_CP`, 'tp-dp-cp'; tp only with `tp_only_amax_red`, off by default). So two blocking
all-reduces per micro-batch per model chunk over dp x tp x cp ranks: the one FP8 cost that
grows with the data-parallel degree at a fixed number of micro-batches. Activation
recomputation adds none (TE's `checkpoint` replays the forward outside `fp8_autocast`,
distributed.py `_CheckpointFunction.backward` at v1.11). Not priced: the two tiny kernels
around each all-reduce (`torch.cat` of the slots, `fused_amax_and_scale_update_after_
reduction`), the once-per-step reduction of FP8 parameters' amaxes after the optimizer
(float8_tensor.py `post_optimizer_step_fwd_amax_reduction`), and the waiting for the slowest
rank of the group that every such synchronisation adds (no figure for it).

Current scaling ('te-current': `--fp8-recipe tensorwise`, TE >= 2.2). No global buffer; but
with sequence parallelism the tensors gathered in FP8 need one scale over the tensor-parallel
group, so their quantizer all-reduces the local amax (one fp32) over tp before casting and
waits for it (TE v2.2 module/linear.py and layernorm_linear.py: the column-parallel input's
and the row-parallel output gradient's quantizer `with_amax_reduction = True`,
`amax_reduction_group = self.tp_group`; csrc/extensions/cast.cpp and normalization.cpp:
`process_group->allreduce(...)->wait()` between `nvte_compute_amax` and the cast): per layer
and micro-batch, the QKV and fc1 inputs forward, the attention-output and fc2 output
gradients backward. Not a mixture's routed experts: Megatron-Core builds them with
`explicit_expert_comm` (tp > 1 or ep > 1), which hands TE `parallel_mode=None`, `tp_group=None`
(megatron/core/extensions/transformer_engine.py TEGroupedLinear.__init__ at core_v0.12.2, the
token dispatcher moves their tokens), and TE v2.2's module/grouped_linear.py sets no
`with_amax_reduction` at all; the shared experts (SharedExpertMLP: TE column / row parallel
Linears over the tp group) and dense blocks do reduce (`mlp_amax_share`).
"""

from __future__ import annotations

from typing import Any

from meshtron.planner import comm

AMAX_SLOTS_FWD = 3
"""Forward amax slots of one TE GEMM module: input, weight, output (fp8_meta 'scaling_fwd')."""
AMAX_SLOTS_BWD = 2
"""Backward amax slots of one TE GEMM module: output gradient, input gradient."""
AMAX_BYTES = 4
"""Each slot is one fp32 (amax_history's dtype)."""


def te_gemms_per_layer(model: Any, ep: int = 1) -> int:
    """GEMM modules with FP8 metadata in one Megatron-Core layer (its TE layer spec): fused QKV
    (TELayerNormColumnParallelLinear) and the output projection, or MLA's four / five
    projections (q down and up when q_lora_rank is set, kv down and up, output); fc1 and fc2,
    or in a mixture of experts one pair per local expert (TEGroupedMLP's GroupedLinear: a
    GEMM each) plus the shared experts' pair. Only the size of the reduced buffer depends on
    it."""
    if getattr(model, "is_mla", False):
        attention = 5 if getattr(model, "q_lora_rank", 0) else 4
    else:
        attention = 2
    if not getattr(model, "is_moe", False):
        return attention + 2
    local = max(1, model.moe_experts // max(1, ep))
    shared = 2 if getattr(model, "moe_shared_experts", 0) else 0
    return attention + 2 * local + shared


def _per_tensor(opts: Any, scaling: str) -> bool:
    """`opts` (compute.KernelOptions) quantises with Transformer Engine's per-tensor `scaling`.
    Not with block scales (fp8_gemm 'blockwise': DeepSeek-V3's 1x128 / 128x128 scales, each
    computed online from its own tile, report section 3.3.2: nothing to reduce across ranks)."""
    return opts.fp8_scaling == scaling and opts.fp8_gemm != "blockwise"


def delayed_amax_step_s(opts: Any, dtype: str, micro_batches: int, chunks: int,
                        layers: int, model: Any, ep: int, group: comm.Group,
                        fab: comm.Fabric) -> float:
    """Seconds per optimizer step a rank waits on delayed scaling's amax all-reduces (module
    doc): `micro_batches` x `chunks` (its model chunks, virtual pipeline stages) autocasts,
    each reducing forward and backward slots of the `layers` blocks the rank holds over
    `group` (dp x tp x cp ranks, placement.groups_for_cost 'amax'). 0 unless `opts`
    (compute.KernelOptions) scales per tensor with 'te-delayed' and `dtype` is 'fp8'."""
    if not _per_tensor(opts, "te-delayed") or dtype != "fp8" or group.size <= 1:
        return 0.0
    gemms = layers * te_gemms_per_layer(model, ep)
    fwd = comm.small_all_reduce(AMAX_SLOTS_FWD * AMAX_BYTES * gemms, group, fab)
    bwd = comm.small_all_reduce(AMAX_SLOTS_BWD * AMAX_BYTES * gemms, group, fab)
    return micro_batches * max(1, chunks) * (fwd + bwd)


def mlp_amax_share(model: Any) -> float:
    """Share of `model`'s blocks whose fc1 / fc2 reduce current scaling's amax over tp (module
    doc): every dense block; a mixture-of-experts block only where it has shared experts (its
    routed experts' grouped Linears reduce none). 1 for a dense model."""
    if not getattr(model, "is_moe", False):
        return 1.0
    moe = model.moe_layers / model.layers
    return 1.0 - moe + (moe if getattr(model, "moe_shared_experts", 0) else 0.0)


def current_amax_tp_s(opts: Any, sp: bool, frac: dict[str, float] | None,
                      group: comm.Group, fab: comm.Fabric,
                      mlp_share: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds per layer and micro-batch of current scaling's per-tensor
    amax all-reduces over the tensor-parallel `group` (module doc): one per column-parallel
    FP8 input forward ('qkv', 'up' of `frac`, fp8.fp8_fractions), one per row-parallel FP8
    output gradient backward ('out', 'down'); the MLP's ('up', 'down') on the `mlp_share` of
    blocks whose MLP reduces (`mlp_amax_share` of the real model: a mixture's routed experts
    do not). 0 unless `opts` (compute.KernelOptions) scales per tensor with 'te-current', with
    sequence parallelism over more than one rank."""
    if not _per_tensor(opts, "te-current") or not sp or group.size <= 1 or frac is None:
        return 0.0, 0.0
    one = comm.small_all_reduce(AMAX_BYTES, group, fab)
    weight = {"qkv": 1.0, "out": 1.0, "up": mlp_share, "down": mlp_share}
    fwd = sum(one * weight[g] for g in ("qkv", "up") if frac.get(g, 0.0) > 0)
    bwd = sum(one * weight[g] for g in ("out", "down") if frac.get(g, 0.0) > 0)
    return fwd, bwd
