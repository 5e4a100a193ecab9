"""Memory per GPU, component by component, for the dtype and the framework a run uses.

The peak of a training step is in the backward pass of the fullest pipeline stage's last
in-flight micro-batch: model states, the unsharded parameter copies the data-parallel wrapper
keeps for compute, the stored activations of every in-flight micro-batch, and the working set of
whichever moment is largest (`peak_moment`): the loss (last stage: the logits and their
gradients), a block's backward (the layer being recomputed, beside FSDP2's reduce-scatter input
of the previous block) or, under tensor parallelism, the embedding's backward (its gradient
made whole over the vocabulary). Each moment is read off the tensors `meshtron rehearse` finds
alive at the peak (tests/test_rehearse.py).

The pieces live in their own modules:

- model states (bytes per parameter, parameters per rank): memory_states.py;
- the compute copies and gradients of each moment of the peak: memory_peak.py;
- activations per block, recomputation and the loss's logits: memory_acts.py;
- a block's own backward temporaries (its gradients between ops, the unit gradient not yet
  made): memory_bwd.py;
- the options that decide them (dtype, framework, saved tensors, loss): memory_options.py;
- interleaved pipelines' uneven chunks: memory_pipeline.py; MoE layers: moe_memory.py;
  every rank of a run, tensor by tensor: memory_ranks.py.

This module puts them together: one stage's memory as a function of its layer count
(`stage_memory`, which the layer partition uses) and its breakdown (`breakdown`), with the
workspace around the tensors. The names of the modules above are re-exported here, so that
`memory.X` stays the one entry point of the planner's memory model.

Workspace (device memory outside the tensors): the CUDA context and kernels (~0.5 GiB on
A100/H100), cuBLAS workspaces and NCCL's buffers (NCCL_BUFFSIZE = 4 MiB per channel and peer,
over several communicators), 1 GiB together, capped at 5% of a small device; and the caching
allocator's fragmentation: it carves requests from cached segments it does not return
(PyTorch CUDA semantics docs), so reserved memory exceeds the allocated peak; 8% of the
tensors without expandable segments (memory_options.FRAGMENTATION, the one undetermined margin
of the model), none with them (FRAGMENTATION_EXPANDABLE: a launch that sets them, as
torchtitan's run_train.sh does, says so with MemoryOptions.expandable_segments).
`MemoryBreakdown.allocated` is the figure `torch.cuda.max_memory_allocated` reports, `total` the
one the device must hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshtron.planner.memory_acts import (  # noqa: F401  (re-exported)
    FUSED_LOSS_ACC_BYTES, LOSS_PARALLEL_BYTES, RNG_STATE_BYTES, activation_bytes,
    chunked_loss_bytes, chunked_loss_held_bytes, final_norm_bytes, gathered_kv_bytes,
    logits_bytes, loss_or_recompute,
    TE_FP8_WEIGHT_CACHE_BYTES, backward_working_bytes, fp8_cast_working_bytes,
    recompute_working_bytes,
    rope_copy_bytes, te_fp8_inputs, te_weight_cache_bytes)
from meshtron.planner.memory_options import (  # noqa: F401  (re-exported)
    DEFAULT, DTYPES, FRAGMENTATION, FRAGMENTATION_EXPANDABLE, FRAMEWORKS, GIB, LOSSES,
    SELECTIVE, WORKSPACE_FIXED_GIB, WORKSPACE_FIXED_MAX_FRACTION, MemoryOptions, options_for)
from meshtron.planner.memory_peak import (  # noqa: F401  (re-exported)
    DEEPSPEED_MAX_LIVE_PARAMS, DEEPSPEED_PREFETCH_PARAMS, DEEPSPEED_REDUCE_BUCKET,
    backward_gathered_bytes, block_moment, embedding_accum_bytes, embedding_grad_extra,
    MOMENTS, embedding_moment, gathered_bytes, moment_parts, peak_moment,
    previous_gradient_bytes)
from meshtron.planner.memory_states import (  # noqa: F401  (re-exported)
    GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, embedding_params_local, head_params_local,
    largest_param_local, layer_params_local, rope_table_bytes, state_bytes)


def workspace_bytes(tensors: float, capacity: float, mem: MemoryOptions = DEFAULT) -> float:
    """Workspace and fragmentation allowance for a GPU holding `tensors` bytes under the
    stack's allocator settings (`MemoryOptions.fragmentation`)."""
    return workspace_fixed(capacity) + mem.fragmentation * tensors


def workspace_fixed(capacity: float) -> float:
    """The fixed part of the workspace (CUDA context, cuBLAS, NCCL) on a device of `capacity`."""
    return min(WORKSPACE_FIXED_GIB * GIB, WORKSPACE_FIXED_MAX_FRACTION * capacity)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of the fullest GPU of a plan, GiB."""

    params: float
    """Parameters at rest (fp32 master shards for FSDP2; 16-bit weights otherwise)."""
    grads: float
    """Gradients (accumulation buffers / sharded gradients)."""
    optimizer: float
    """AdamW moments (+ fp32 master weights for 16-bit-weight frameworks)."""
    gathered: float
    """Unsharded compute copies of parameters and gradients alive at the peak (FSDP/ZeRO)."""
    activations: float
    """Stored activations of one micro-batch in all of the stage's layers."""
    in_flight: float
    """Stored activations of the other in-flight micro-batches and the chunk outputs a
    pipeline schedule keeps for their backward (pipeline schedules)."""
    recompute: float
    """Working set of the layer being recomputed beyond the logits' bytes (the two are alive at
    different times, `loss_or_recompute`)."""
    logits: float
    """Logits of one micro-batch and their gradients (last stage only)."""
    workspace: float
    """Workspace and fragmentation allowance."""
    capacity: float
    """Device memory."""
    stage: int
    """Pipeline stage this breakdown belongs to (the fullest one)."""
    dtype: str = "bf16"
    """Compute dtype the breakdown assumes."""
    host: float = 0.0
    """Host memory one node fills with what host offload moves off its GPUs (their parameter,
    gradient and optimizer shards, the saved activations with offload_activations), GiB."""
    host_capacity: float | None = None
    """Host memory of one node offload may use (cluster host_memory_gib x
    HOST_USABLE_FRACTION), GiB; None: unknown, not checked."""
    derived: float = 0.0
    """Of `params`: tensors derived from the spec (RoPE tables, rope_table_bytes) that no
    checkpoint or snapshot holds, GiB."""
    device: str = "GPU"
    """What one rank's memory is called in the lines the planner prints (ClusterSpec
    `device_word`: 'CPU rank' on a CPU machine, where no GPU is involved)."""

    @property
    def host_fits(self) -> bool:
        """The offloaded states of all the node's GPUs fit in its host memory."""
        return self.host_capacity is None or self.host <= self.host_capacity

    @property
    def allocated(self) -> float:
        """Peak of the tensors (what torch.cuda.max_memory_allocated reports)."""
        return (self.params + self.grads + self.optimizer + self.gathered + self.activations
                + self.in_flight + self.recompute + self.logits)

    @property
    def total(self) -> float:
        return self.allocated + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def parts(self) -> list[tuple[str, float]]:
        """(component, GiB) in the order they add up to `total`."""
        return [("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                ("gathered", self.gathered), ("activations", self.activations),
                ("in-flight", self.in_flight), ("recompute", self.recompute),
                ("logits", self.logits), ("workspace", self.workspace)]

    def describe(self) -> str:
        """'params 1.2 + grads 1.2 + ...' listing the non-zero components, GiB."""
        return " + ".join(f"{name} {gib:.3g}" for name, gib in self.parts() if gib > 0)

    def to_dict(self) -> dict[str, float | int | str]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "gathered": self.gathered, "activations": self.activations,
                "in_flight": self.in_flight, "recompute": self.recompute,
                "logits": self.logits, "workspace": self.workspace,
                "allocated": self.allocated, "total": self.total, "capacity": self.capacity,
                "stage": self.stage, "dtype": self.dtype, "host": self.host,
                "host_capacity": self.host_capacity}


# ---- one stage ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageMemory:
    """Bytes of pipeline stage i as a function of its layer count k: k * per_layer + fixed."""

    per_layer: float
    """States, gathered copies and in-flight activations per layer of the stage."""
    fixed: float
    """Embedding / head states, logits, recompute working set, fixed buffers."""


def stage_memory(mem: MemoryOptions, zero: int, dp: int, states: tuple[float, float, float],
                 p_layer: float, p_root: float, largest: float, act: float, in_flight: float,
                 work: float, logits: float, grad_bytes: float = GRAD_BYTES,
                 keep_gathered: bool = False, accum: float = 0.0, p_expert: float = 0.0,
                 expert_states: tuple[float, float, float] | None = None,
                 root_unit: float | None = None, reduce_bytes: float = 4.0,
                 grad_extra: float = 0.0, outputs: float = 0.0,
                 weight_cache: float = 0.0, extra_accum: float | None = None,
                 moment: str | None = None, p_loose: float = 0.0) -> StageMemory:
    """Linear model of one stage's memory in its layer count (used by the layer partition).

    FSDP2's gathered copies with ZeRO-0/1/2 grow with the layers (every block stays gathered);
    with ZeRO-3 they do not (two units) unless `keep_gathered` (pipelining). `accum`: bytes
    per local parameter of unsharded gradients accumulated over the micro-batches (ZeRO-2/3
    with accumulate_unsharded or pipelining: FSDP2 keeps them in the reduce dtype);
    `grad_extra`: accumulated gradient elements beyond the stage's local parameters
    (`embedding_grad_extra`), held over the step at `extra_accum` bytes each (default
    `accum`; `embedding_accum_bytes`); `outputs`: bytes of the chunk outputs a pipeline schedule
    keeps for backward (memory_pipeline.held_outputs); `weight_cache`: bytes per block of
    quantised weight copies kept over the step (memory_acts.te_weight_cache_bytes);
    `reduce_bytes`: bytes per element of
    the reduce-scatter input
    a block's backward runs beside (the reduce dtype; 0 where gradients are reduced after the
    last backward: pipelining). The peak is the larger of the loss's and a block's backward
    moment (`peak_moment`); the block's counts the previous block's gradient on every stage
    (a one-block stage has none: conservative). `moment`: that moment's alone (`MOMENTS`,
    `moment_parts`), for a stage whose moments hold different activations. `p_loose`: routed
    experts per block held outside FSDP2 (MemoryOptions.experts_outside_fsdp): their
    `expert_states` only, no gathered copy, no unsharded gradient accumulated beside them."""
    return StageMemory(*stage_terms(
        mem, zero, dp, states, p_layer, p_root, largest, act, in_flight, work, logits,
        grad_bytes, keep_gathered, accum, p_expert, expert_states, root_unit, reduce_bytes,
        grad_extra, outputs, weight_cache, accum if extra_accum is None else extra_accum,
        moment, p_loose))


def stage_terms(mem: MemoryOptions, zero: int, dp: int, states: tuple[float, float, float],
                p_layer: float, p_root: float, largest: float, act: float, in_flight: float,
                work: float, logits: float, grad_bytes: float, keep_gathered: bool,
                accum: float, p_expert: float,
                expert_states: tuple[float, float, float] | None, root_unit: float | None,
                reduce_bytes: float, grad_extra: float, outputs: float,
                weight_cache: float, extra_accum: float,
                moment: str | None = None, p_loose: float = 0.0) -> tuple[float, float]:
    """`stage_memory` as (per_layer, fixed), every argument given but `moment` (the
    search's ~90k calls: estimate.Evaluator._stage_memories)."""
    parts = _stage_parts(
        mem, zero, dp, states, p_layer, p_root, largest, act, work, logits, grad_bytes,
        keep_gathered, accum, p_expert, expert_states, root_unit, reduce_bytes, grad_extra,
        extra_accum, p_loose)
    base, gathered_per_layer = parts[0], parts[1]
    fixed = parts[2] if moment is None else parts[2 + MOMENTS.index(moment)]
    # the same sums in the same order as written out in `_stage_parts` (bit for bit): the
    # terms linear in what differs between a plan's ranks, added to the memoised rest
    per_layer = base + act * in_flight + weight_cache
    if moment == "embedding":  # the moment frees this micro-batch's every layer (`breakdown`)
        per_layer -= act
    if gathered_per_layer is not None:
        per_layer += gathered_per_layer
    return per_layer, fixed + outputs


_CANONICAL: dict[MemoryOptions, MemoryOptions] = {}


def canonical(mem: MemoryOptions) -> MemoryOptions:
    """One object for every equal MemoryOptions of the process: `_stage_parts`'s memo
    compares its keys' options, which costs a field-by-field __eq__ per lookup unless they
    are the same object (each Evaluator, each dtype makes its own equal copy)."""
    return _CANONICAL.setdefault(mem, mem)


@lru_cache(maxsize=16384, typed=True)
def _stage_parts(mem: MemoryOptions, zero: int, dp: int, states: tuple[float, float, float],
                 p_layer: float, p_root: float, largest: float, act: float, work: float,
                 logits: float, grad_bytes: float, keep_gathered: bool, accum: float,
                 p_expert: float, expert_states: tuple[float, float, float] | None,
                 root_unit: float | None, reduce_bytes: float,
                 grad_extra: float, extra_accum: float, p_loose: float = 0.0
                 ) -> tuple[float, float | None, float, float, float, float]:
    """`stage_memory` less its terms in `in_flight`, `outputs` and `weight_cache`, which are
    what a search's plans and a plan's ranks vary most (a search asks ~90k stage memories of
    ~5k of these): (per-layer sum before the in-flight activations, the gathered copies per
    layer added after them or None, fixed bytes before the outputs at each of `MOMENTS`: the
    peak, the loss's, the block's, the embedding's). Keyed by every other argument of
    `stage_memory`
    (tests/test_planner_caches.py): the moments are all formed from the same key."""
    sb = sum(states)
    # routed experts under expert parallelism (`p_expert`: E/ep experts of one block on this
    # rank, `p_layer` the rest of the block) keep their ZeRO states over the dp*cp/ep ranks
    # holding the same experts (`expert_states`); the compute copies gather both
    eb = sum(expert_states) if expert_states is not None else sb
    # experts outside FSDP2 (`p_loose`) hold their states alone: never gathered, their
    # gradients accumulated in place (MemoryOptions.experts_outside_fsdp)
    base = p_layer * (sb + accum) + p_expert * (eb + accum) + p_loose * eb
    p_layer = p_layer + p_expert
    cb = mem.compute_bytes
    fsdp_all = (mem.framework == "fsdp2" and not (dp == 1 and mem.dtype == "fp32")
                and not (zero == 3 and dp > 1 and not keep_gathered))
    # fsdp_all: the gathered blocks are in per_layer; else a stage of 3 blocks or more,
    # whose later blocks prefetch a block (memory_peak.block_moment)
    k = 0 if fsdp_all else 3
    args = (mem, zero, dp, k, p_layer, p_root, largest, grad_bytes, keep_gathered, root_unit)
    at_block = block_moment(*args, reduce_bytes, act)
    at_loss = gathered_bytes(*args)
    # the embedding's moment frees one layer's activations here (k layers' in `breakdown`)
    previous = previous_gradient_bytes(mem, dp, 2, p_layer, keep_gathered, reduce_bytes)
    at_embedding = embedding_moment(mem, at_loss, previous, grad_extra, act)
    gathered, recompute = peak_moment(logits, work, at_loss, at_block, at_embedding)
    # a loose block's expert gradient is made whole before AccumulateGrad adds it to the kept
    # one: one block's worth in the compute dtype (at every moment: conservative)
    rest = p_root * (sb + accum) + grad_extra * extra_accum + cb * p_loose
    return (base, cb * p_layer if fsdp_all else None,
            rest + gathered + recompute + logits,
            rest + sum(moment_parts(logits, work, at_loss, at_block, at_embedding, "loss")),
            rest + sum(moment_parts(logits, work, at_loss, at_block, at_embedding, "block")),
            # the embedding's alone: what it frees per layer is stage_terms' (exact in the
            # layers, as `breakdown` counts it; the others' one layer is conservative)
            rest + embedding_moment(mem, at_loss, previous, grad_extra, 0.0))


def breakdown(mem: MemoryOptions, zero: int, dp: int, states: tuple[float, float, float],
              layers: int, p_layer: float, p_root: float, largest: float, act: float,
              in_flight: float, work: float, logits: float, capacity: float, stage: int,
              grad_bytes: float = GRAD_BYTES, keep_gathered: bool = False,
              accum: float = 0.0, p_expert: float = 0.0,
              expert_states: tuple[float, float, float] | None = None,
              root_unit: float | None = None, reduce_bytes: float = 4.0,
              grad_extra: float = 0.0, outputs: float = 0.0,
              weight_cache: float = 0.0, extra_accum: float | None = None,
              moment: str | None = None, p_loose: float = 0.0,
              fixed: float = 0.0, buffers: float = 0.0) -> MemoryBreakdown:
    """The component breakdown of a stage holding `layers` blocks (GiB); `p_expert`,
    `expert_states`, `reduce_bytes`, `grad_extra`, `outputs`, `weight_cache`, `extra_accum`,
    `moment`, `p_loose`: as stage_memory
    (the kept chunk outputs are counted with the in-flight activations, the cached quantised
    weights with the parameters); `fixed`: bytes allocated outside PyTorch's allocator
    (DeepEP's buffers), counted with the workspace; `buffers`: bytes of tensors derived from
    the spec the stage keeps (RoPE tables, rope_table_bytes), counted with the parameters."""
    wb, gb, ob = states
    ewb, egb, eob = expert_states if expert_states is not None else states
    experts = layers * (p_expert + p_loose)
    params = layers * p_layer + p_root
    args = (mem, zero, dp, layers, p_layer + p_expert, p_root, largest, grad_bytes,
            keep_gathered, root_unit)
    at_block = (block_moment(*args, reduce_bytes, act) if layers > 1
                else backward_gathered_bytes(*args))
    at_loss = gathered_bytes(*args)
    previous = previous_gradient_bytes(mem, dp, layers, p_layer + p_expert, keep_gathered,
                                       reduce_bytes)
    gathered, work, logits = moment_parts(logits, work, at_loss, at_block, embedding_moment(
        mem, at_loss, previous, grad_extra, layers * act), moment)
    made = accum * (params + layers * p_expert) + grad_extra * (
        accum if extra_accum is None else extra_accum)
    gathered += mem.compute_bytes * p_loose
    all_acts = layers * act * in_flight
    if all_acts < 0.0:
        # a moment before some chunks' gradients are made (an interleaved last rank's loss,
        # priced beside every layer's gradients: estimate_moments.py): what it holds below
        # them is gradients not made yet, taken off the accumulated ones
        made += all_acts
        all_acts = 0.0
    # FSDP2's unsharded accumulation counts with its gathered copies; a ZeRO framework's
    # buffer made at the first backward (MemoryOptions.grads_at_first_backward) as gradients
    made_grads = 0.0 if mem.framework == "fsdp2" else made
    gathered += made - made_grads
    acts = min(layers * act, all_acts)
    extra = all_acts - acts + outputs
    cache = layers * weight_cache + buffers
    tensors = (params * (wb + gb + ob) + experts * (ewb + egb + eob) + gathered + made_grads
               + all_acts + outputs + work + logits + cache)
    return MemoryBreakdown(
        params=(params * wb + experts * ewb + cache) / GIB,
        grads=(params * gb + experts * egb + made_grads) / GIB,
        optimizer=(params * ob + experts * eob) / GIB,
        gathered=gathered / GIB, activations=acts / GIB,
        in_flight=extra / GIB, recompute=work / GIB, logits=logits / GIB,
        workspace=(workspace_bytes(tensors, capacity, mem) + fixed) / GIB,
        capacity=capacity / GIB,
        stage=stage, dtype=mem.dtype, derived=buffers / GIB)
