"""Memory per GPU, component by component, for the dtype and the framework a run uses.

The peak of a training step is in the backward pass of the fullest pipeline stage's last
in-flight micro-batch: model states, the unsharded parameter copies the data-parallel wrapper
keeps for compute, the stored activations of every in-flight micro-batch, and the working set of
whichever moment is largest (`peak_moment`): the loss (last stage: the logits and their
gradients), a block's backward (the layer being recomputed, beside FSDP2's reduce-scatter input
of the previous block) or, under tensor parallelism, the embedding's backward (its gradient
made whole over the vocabulary). Each moment is read off the tensors `meshtron rehearse` finds
alive at the peak (tests/test_rehearse.py).

Model states, bytes per parameter (Rajbhandari et al. 2020, "ZeRO", sections 3 and 5):

* `fsdp2` (meshtron's own runtime, torchtitan): the parameters ARE the fp32 master weights
  (FSDP2's sharded parameters keep their dtype; MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32) only casts the all-gathered copy, FSDP2 docs), fp32 gradients (the sharded
  gradient takes the sharded parameter's dtype) and AdamW's two fp32 moments: 4 + 4 + 8 = 16 bytes
  in fp32 and in bf16 runs alike. The compute copy (2 bytes in bf16, 4 in fp32) exists only
  while a unit is all-gathered (see `gathered_bytes`).
* `megatron` / `deepspeed` (mixed-precision AdamW as in the ZeRO paper): 2-byte weights,
  2-byte gradients (4 with Megatron-LM's fp32 main_grad, `KernelOptions.fp32_grad_reduce`) and
  K = 12 bytes of fp32 master weights and moments; fp32 runs: 4 + 4 + 8.

Sharding over the data-parallel group: ZeRO-1 the optimizer states, ZeRO-2 also the gradients,
ZeRO-3 also the weights. meshtron's ZeRO-2 is FSDP2 without resharding after forward, so its
parameters are sharded at rest too; its ZeRO-1 keeps parameters and gradients whole and gives
each data-parallel rank the AdamW state of the parameters it owns.

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

Activations per layer and micro-batch: the tensors autograd saves, listed op by op
(`activation_bytes`). Three lists:

* `korthikanti` (Megatron-LM / Transformer Engine fused kernels; Korthikanti et al. 2022,
  section 4, eqs. 1-5, generalised to grouped-query attention and SwiGLU): norm inputs 4h, QKV
  and MLP inputs 4h (both /t with sequence parallelism), Q 2h, K and V 4kv, attention output 2h,
  MLP 6f (SwiGLU, fused: gate and up inputs + product) or 4f (GeLU), dropout masks 2h; the
  attention core 2as (unfused; 5as with dropout), or a fp32 log-sum-exp per head with
  FlashAttention. Selective recomputation drops the attention core.
* `eager` (meshtron's model in eager PyTorch, read off its autograd graph; checked against
  `torch.autograd.graph.saved_tensors_hooks` in tests/test_memory.py): norm inputs (x, x1), the
  normed inputs of QKV and of the MLP (gathered, so full width even with sequence parallelism:
  DTensor saves the all-gathered input), Q and K after RoPE and V as SDPA sees them (K and V
  at kv width with native GQA; repeated to all query heads where `gqa_copies`), SDPA's output and its reshaped copy
  (the out-projection's input), the log-sum-exp, and SwiGLU's gate, up, SiLU output and product
  (GeLU: pre-activation and output). Selective recomputation (meshtron's policy,
  meshtron/parallel/recompute.py) keeps the block input, every matmul output (the row-parallel
  ones at full width, before their reduction) and every collective's output.
* `alternate-matmul` (torchtitan's selective "op" policy): the block input, every other matmul
  output (wq, wv, w1, w2) and the SDPA output with its log-sum-exp.

Full recomputation keeps each block's input (/t with sequence parallelism) and, while one block
is recomputed, that block's activations (`recompute_working_bytes`). That working set and the
loss's (below) are alive at different times of the backward: the peak holds the larger
(`loss_or_recompute`).

Logits (last stage, one micro-batch; [tokens, vocab/t] elements): meshtron's runtime at tp = 1
without a pipeline never builds them (meshtron/model/loss.py chunks the head and the loss over
tokens): what it holds is one chunk's logits and the head's weight gradients summed over the
chunks (`chunked_loss_bytes`). Elsewhere the eager loss casts the
logits to fp32 and takes log_softmax, whose fp32 output is saved; at the start of backward the
saved output, the incoming gradient and log_softmax's input gradient are alive together: 12
bytes per element (the compute-dtype logits are freed after the loss, nothing saves them;
pipeline schedules keep the stage output, + the compute dtype's bytes); torch's loss_parallel
(tensor-parallel heads) 16 (`LOSS_PARALLEL_BYTES`). Every figure of meshtron's own runtime here
is checked against `meshtron rehearse` (one rank run under fake tensors; tests/test_rehearse.py). Megatron's fused
vocabulary-parallel cross-entropy keeps bf16 logits + an fp32 softmax that its backward
overwrites in place: 6 bytes; flash-attn's fused loss with in-place backward (llm-foundry's
default) only the 16-bit logits: 2 bytes (`MemoryOptions.loss`).

Workspace (device memory outside the tensors): the CUDA context and kernels (~0.5 GiB on
A100/H100), cuBLAS workspaces and NCCL's buffers (NCCL_BUFFSIZE = 4 MiB per channel and peer,
over several communicators), 1 GiB together, capped at 5% of a small device; and the caching
allocator's fragmentation: it rounds requests >= 1 MiB to 2 MiB and carves them from cached
segments it does not return (PyTorch CUDA semantics docs), so reserved memory exceeds the
allocated peak; 8% of the tensors (reserved/allocated of LLM training runs is typically 1.05-1.15).
`MemoryBreakdown.allocated` is the figure `torch.cuda.max_memory_allocated` reports, `total` the
one the device must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.compute import KernelOptions

GIB = float(2**30)
WEIGHT_BYTES = 2.0
"""bf16 weights (mixed-precision frameworks that keep 16-bit parameters)."""
GRAD_BYTES = 2.0
"""bf16 gradients (4.0 with an fp32 accumulation buffer)."""
OPTIMIZER_BYTES = 12.0
"""fp32 master weights + AdamW first and second moments (ZeRO's K = 12)."""
WORKSPACE_FIXED_GIB = 1.0
"""CUDA context, cuBLAS and NCCL workspaces."""
WORKSPACE_FIXED_MAX_FRACTION = 0.05
"""Cap of the fixed allowance on small devices, as a fraction of device memory."""
FRAGMENTATION = 0.08
"""Caching-allocator fragmentation allowance, fraction of all tensors."""
DEEPSPEED_MAX_LIVE_PARAMS = 1e9
"""DeepSpeed `stage3_max_live_parameters` default."""
DEEPSPEED_PREFETCH_PARAMS = 5e8
"""DeepSpeed `stage3_prefetch_bucket_size` default (elements)."""
DEEPSPEED_REDUCE_BUCKET = 5e8
"""DeepSpeed `reduce_bucket_size` default (elements)."""

RNG_STATE_BYTES = 5056.0
"""A checkpointed block keeps the CPU generator's state to replay dropout identically
(torch.utils.checkpoint, preserve_rng_state=True; torch.get_rng_state() is 5056 bytes)."""

DTYPES = ("bf16", "fp32", "fp8")
"""fp8 runs keep bf16 activations, weights and compute copies here (Transformer Engine saves
some GEMM inputs in FP8, which this does not count: memory is not underestimated)."""
FRAMEWORKS = ("fsdp2", "megatron", "deepspeed")
SELECTIVE = ("eager", "korthikanti", "alternate-matmul")
LOSSES = ("chunked", "eager", "vocab-parallel", "inplace")


@dataclass(frozen=True)
class MemoryOptions:
    """What decides the bytes of a plan besides its layout: precision and framework."""

    dtype: str = "bf16"
    """Compute dtype of the run: 'bf16' (mixed precision, fp32 master weights) or 'fp32'."""
    framework: str = "fsdp2"
    """'fsdp2' (meshtron's runtime, torchtitan), 'megatron' (Megatron-LM) or 'deepspeed'."""
    activations: str | None = None
    """Saved-tensor list: 'eager', 'korthikanti' or 'alternate-matmul' (torchtitan's selective
    op policy); None: 'eager' for fsdp2, 'korthikanti' for the others."""
    loss: str | None = None
    """Cross-entropy implementation: 'chunked' (meshtron's runtime: the head and loss over
    chunks of tokens, no whole logits, at tp = 1 without a pipeline; whole logits elsewhere),
    'eager' (fp32 copy + log_softmax, 12 bytes per logit at the start of backward; 16 under
    tensor parallelism's loss_parallel), 'vocab-parallel' (Megatron-LM: bf16 logits + fp32
    softmax overwritten by its gradient, 6) or 'inplace' (flash-attn's fused loss as
    llm-foundry uses it: the gradient overwrites the 16-bit logits, 2); None: 'chunked' for
    fsdp2, 'vocab-parallel' otherwise."""
    gqa_copies: bool = False
    """Grouped-query attention copies K and V to every query head before attention
    (`repeat_kv` in torchtitan's and Hugging Face's Llama, saved for backward at full width:
    the torchtitan and DeepSpeed@2024 presets); False: SDPA's native GQA (`enable_gqa=True`,
    meshtron/model/attention.py) keeps them at kv width."""
    fused_norm: bool = True
    """RMSNorm runs as one kernel saving only its input (CUDA: aten._fused_rms_norm, PyTorch
    PR #153666); False: the composite path (PyTorch on CPU), which also saves an fp32 copy of
    the input and the fp32 normalised tensor."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"dtype={self.dtype!r}: allowed values are {', '.join(DTYPES)}")
        if self.framework not in FRAMEWORKS:
            raise UserError(f"memory.framework={self.framework!r}: allowed values are "
                             f"{', '.join(FRAMEWORKS)}")
        if self.loss is not None and self.loss not in LOSSES:
            raise UserError(f"memory.loss={self.loss!r}: allowed values are {', '.join(LOSSES)}")
        if self.activations is not None and self.activations not in SELECTIVE:
            raise UserError(f"memory.activations={self.activations!r}: allowed values are "
                             f"{', '.join(SELECTIVE)}")

    @property
    def compute_bytes(self) -> float:
        """Bytes of one activation / compute-copy element."""
        # fp8 runs keep bf16 activations and compute copies (DTYPES): only fp32 is 4 bytes
        return 4.0 if self.dtype == "fp32" else 2.0

    @property
    def saved(self) -> str:
        if self.activations is not None:
            return self.activations
        return "eager" if self.framework == "fsdp2" else "korthikanti"

    @property
    def loss_kind(self) -> str:
        if self.loss is not None:
            return self.loss
        return "chunked" if self.framework == "fsdp2" else "vocab-parallel"


DEFAULT = MemoryOptions()


def options_for(opts: KernelOptions | None, dtype: str = "bf16") -> MemoryOptions:
    """The memory layout that goes with the cost model's options: `sharding='fsdp'` (FSDP2 /
    FSDP: meshtron's runtime, torchtitan, llm-foundry) keeps fp32 parameters and gathers compute
    copies; `sharding='zero'` (Megatron-LM, DeepSpeed) keeps 16-bit weights with fp32 master
    weights in the optimizer. Without a `sharding` option, `stack='fused'` means Megatron-LM."""
    sharding = getattr(opts, "sharding", None)
    if sharding is not None:
        framework = "fsdp2" if sharding == "fsdp" else "megatron"
    else:
        framework = "megatron" if getattr(opts, "stack", "eager") == "fused" else "fsdp2"
    return MemoryOptions(dtype=dtype, framework=framework)


# ---- model states -------------------------------------------------------------------------------
def state_bytes(zero: int, dp: int, grad_bytes: float = GRAD_BYTES,
                mem: MemoryOptions | None = None,
                fsdp_zero1: bool = True) -> tuple[float, float, float]:
    """Bytes per parameter held by one GPU for (weights, gradients, optimizer) at a ZeRO stage.

    Mixed-precision frameworks (megatron, deepspeed): `grad_bytes` is 4 with an fp32 gradient
    buffer (Megatron-LM's main_grad): 2 + 4 + 12 = 18 bytes per parameter, 6 + 12/d with the
    distributed optimizer (the table of Megatron-LM's docs/distrib_optimizer.md). fsdp2: fp32
    parameters and gradients, 8 bytes of moments (module docstring). meshtron's ZeRO-1 is
    FSDP2 over the whole data axis (`fsdp_zero1`; parallel/data_parallel.py): parameters and
    gradients are sharded at rest like the states, and the gradients of a step's micro-batches
    accumulate unsharded (the caller's `accum`); False: compressed ZeRO-1 / DiLoCo, whole
    parameters and gradients, states by owner."""
    mem = mem or DEFAULT
    if mem.framework == "fsdp2":
        w, g, o = 4.0, 4.0, 8.0 / dp if zero >= 1 else 8.0
        if zero >= 2 or (zero == 1 and fsdp_zero1):  # FSDP2 shards parameters at rest
            w, g = w / dp, g / dp
        return w, g, o
    if mem.dtype == "fp32":
        w, g, o = 4.0, 4.0, 8.0
        w = w / dp if zero >= 3 else w
    else:
        w, g, o = WEIGHT_BYTES, grad_bytes, OPTIMIZER_BYTES
        w = w / dp if zero >= 3 else w
    g = g / dp if zero >= 2 else g
    o = o / dp if zero >= 1 else o
    return w, g, o


def layer_params_local(model: ModelSpec, tp: int, pp: int = 1) -> float:
    """Parameters of one layer held by one tensor-parallel rank (norm weights replicated).

    Mixtures of experts hold ALL their experts (`ModelSpec.layer_params`, total parameters;
    only the active ones compute, `compute.active_equivalent`). With dense first layers
    (DeepSeek-V3) the blocks differ: without pipelining the mean block (the stage's total is
    exact), with it the largest (the fullest stage holds MoE blocks only)."""
    if model.is_moe:
        sizes = [model.layer_params(i) for i in range(model.layers)]
        per = sum(sizes) / len(sizes) if pp == 1 else max(sizes)
        return (per - 2 * model.norm_params) / tp + 2 * model.norm_params
    return (model.attention_params() + model.mlp_params()) / tp + 2 * model.norm_params


def embedding_params_local(model: ModelSpec, tp: int) -> float:
    """Vocabulary-parallel token embedding (+ vocabulary-parallel learned position table)."""
    return model.embedding_params() - model.vocab * model.hidden + model.vocab * model.hidden / tp


def head_params_local(model: ModelSpec, tp: int, pp: int) -> float:
    """Final norm + LM head on the last stage; a tied head needs its own copy when pp > 1."""
    out = model.vocab * model.hidden / tp
    if model.tied_embeddings and pp == 1:
        out = 0.0
    return model.norm_params + out


def largest_param_local(model: ModelSpec, tp: int) -> float:
    """Elements of the largest single weight matrix of a layer on one tensor rank."""
    return max(model.hidden * model.ffn_hidden, model.hidden * model.hidden) / tp


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
        grad_unit = cb * max(p_layer, unit)
        if zero == 3 and dp > 1 and not keep_gathered:
            # current + prefetched unit in the blocks' backward; at the loss the head's unit
            # alone (rehearsed: the last block is gathered after the loss's backward)
            # (keep_gathered: pipelining, where the units stay gathered over the step's
            # micro-batches)
            return cb * max(2.0 * p_layer, unit) + grad_unit
        return cb * (layers * p_layer + p_root) + grad_unit
    if zero == 3 and dp > 1:
        # DeepSpeed's per-module gathering, the ZeRO-3 of 16-bit-weight frameworks
        live = max(largest, min(DEEPSPEED_MAX_LIVE_PARAMS, p_layer + p_root))
        return cb * (live + DEEPSPEED_PREFETCH_PARAMS) + grad_bytes * max(largest,
                                                                          DEEPSPEED_REDUCE_BUCKET)
    if mem.framework == "deepspeed" and zero == 2 and dp > 1:
        return grad_bytes * DEEPSPEED_REDUCE_BUCKET
    return 0.0


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
                            keep_gathered: bool = False, root_unit: float | None = None) -> float:
    """Compute copies alive while a block runs its backward, besides the previous block's
    gradient (`previous_gradient_bytes`); `gathered_bytes` is the loss's moment and the peak
    holds the larger (`peak_moment`). FSDP2: the block's unit, its unsharded gradient building
    up and, with ZeRO-3, the prefetched next unit in backward order (the embedding's for the
    first block). Rehearsed at a recomputed block's backward (2-layer model, ZeRO-3): 0.374
    GiB = 0.168 (the previous block's fp32 gradient) + 0.122 (the prefetched embedding) +
    0.084 (the block)."""
    if mem.framework != "fsdp2" or keep_gathered or (dp == 1 and mem.dtype == "fp32"):
        return gathered_bytes(mem, zero, dp, layers, p_layer, p_root, largest, grad_bytes,
                              keep_gathered, root_unit)
    cb = mem.compute_bytes
    unit = p_root if root_unit is None else root_unit
    if zero == 3 and dp > 1:
        held = cb * (p_layer + max(p_layer, unit))  # this block + the prefetched unit
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
    """`at_block` of `peak_moment`: compute copies and the previous block's gradient, less
    the previous block's stored activations (`act`, one micro-batch), which its backward
    released before this one ran."""
    previous = previous_gradient_bytes(mem, dp, max(layers, 2), p_layer, keep_gathered,
                                       reduce_bytes)
    held = backward_gathered_bytes(mem, zero, dp, layers, p_layer, p_root, largest, grad_bytes,
                                   keep_gathered, root_unit)
    return held + previous - (act if previous else 0.0)


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
    accumulated one."""
    if not grad_extra:
        return 0.0
    return at_loss + previous + mem.compute_bytes * grad_extra - freed


def embedding_grad_extra(model: ModelSpec, tp: int) -> float:
    """Gradient elements a vocabulary-parallel token embedding makes beyond its local shard.
    DTensor's embedding backward returns the weight gradient whole ([vocab, hidden],
    Replicate, on every tensor rank; parallel/api.py `_align_grad_placements` shards it after
    backward), so where FSDP2 accumulates gradients unsharded over micro-batches (ZeRO-0/1,
    `accumulate_unsharded`, pipelining) the embedding's is tp times its shard, in the reduce
    dtype. Rehearsed at tp=4: a [32000, 2048] fp32 gradient (0.244 GiB) beside a 0.061 GiB
    shard."""
    if tp == 1:
        return 0.0
    return model.vocab * model.hidden * (1.0 - 1.0 / tp)


# ---- activations ---------------------------------------------------------------------------------
def _eager_none(model: ModelSpec, tp: int, sp: bool, mem: MemoryOptions, attention: str,
                seq: int) -> float:
    """Bytes per token one eager block saves without recomputation (module docstring)."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    cb = mem.compute_bytes
    kv_sdpa = h if mem.gqa_copies and model.heads != model.kv_heads else kv
    h_in = h / (tp if sp else 1)                           # norm inputs, sequence-sharded with SP
    if model.norm == "rmsnorm" and not mem.fused_norm:
        # composite rms_norm: fp32 copy of the input and the fp32 normalised tensor
        norm = 2.0 * (4.0 * h_in + 4.0 * h_in)
    else:
        norm = 2.0 * cb * h_in                             # input (+ per-row statistics)
    stats = (8.0 if model.norm == "layernorm" else 4.0) / (tp if sp else 1)  # fp32 mean/rstd
    norm += 2.0 * stats
    gathered = 2.0 * h                                     # normed inputs of QKV and MLP
    # q after RoPE, k and v as SDPA sees them, SDPA's output (= the out-projection's input:
    # attention kernels return it in [batch, seq, heads, dim] layout, so the reshape is a view)
    attn = 2.0 * h + 2.0 * kv_sdpa
    mlp = 4.0 * f if model.mlp == "swiglu" else 2.0 * f
    core = 4.0 * a                                          # fp32 log-sum-exp per head
    if attention == "unfused":
        core += cb * a * seq                                # softmax output
    return norm + cb * (gathered + (attn + mlp) / tp) + core / tp


def rope_copy_bytes(model: ModelSpec, seq: int, mem: MemoryOptions) -> float:
    """Per layer and micro-batch: RoPE's cos/sin cast to a 16-bit compute dtype (2 calls x 2)."""
    if model.position != "rope" or mem.dtype == "fp32":
        return 0.0
    return 4.0 * seq * model.head_dim * mem.compute_bytes


def _eager_selective(model: ModelSpec, tp: int, sp: bool, cb: float) -> float:
    """meshtron's selective policy: block input, matmul outputs, collective outputs."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    block_in = h / (tp if sp else 1)
    col = h + 2.0 * kv + (2.0 * f if model.mlp == "swiglu" else f)  # wq wk wv w1 (w3), sharded
    row = 2.0 * h  # wo and w2 outputs: full width on every tensor rank before the reduction
    coll = 0.0
    if tp > 1:
        coll = 2.0 * h + (2.0 * h / tp if sp else 0.0)  # all-gathers (SP) or all-reduces; + RS
    return cb * (block_in + col / tp + row + coll)


def _alternate_matmul(model: ModelSpec, tp: int, sp: bool, cb: float) -> float:
    """torchtitan's selective op policy: block input, wq, wv, w1, w2 and SDPA outputs."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    block_in = h / (tp if sp else 1)
    return cb * (block_in + (h + kv + f + h) / tp + h) + 4.0 * a / tp


def _korthikanti(model: ModelSpec, tp: int, sp: bool, recompute: str, opts: KernelOptions,
                 seq: int) -> float:
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    replicated = 8.0 * h + (2.0 * h if opts.dropout else 0.0)
    sharded = 4.0 * h + 4.0 * kv + (6.0 * f if model.mlp == "swiglu" else 4.0 * f)
    if opts.attention == "unfused":
        core = 0.0 if recompute == "selective" else (5.0 if opts.dropout else 2.0) * a * seq
    else:
        core = 4.0 * a
    return (replicated / tp if sp else replicated) + (sharded + core) / tp


def activation_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                     recompute: str, opts: KernelOptions,
                     mem: MemoryOptions | None = None) -> float:
    """Bytes one layer keeps for one micro-batch until its backward pass (module docstring)."""
    mem = mem or DEFAULT
    if recompute == "half":
        # every second block keeps only its input, the others everything: the mean per block
        return 0.5 * sum(activation_bytes(model, tp, sp, micro_batch, seq, r, opts, mem)
                         for r in ("none", "full"))
    tokens = micro_batch * seq
    sp = sp and tp > 1
    if recompute == "full":
        return tokens * mem.compute_bytes * model.hidden / (tp if sp else 1) + RNG_STATE_BYTES
    cb = mem.compute_bytes
    if mem.saved == "korthikanti":
        per_token = _korthikanti(model, tp, sp, recompute, opts, seq) * cb / 2.0
    elif recompute == "none":
        per_token = _eager_none(model, tp, sp, mem, opts.attention, seq)
        return tokens * per_token + rope_copy_bytes(model, seq, mem)
    elif mem.saved == "alternate-matmul":
        per_token = _alternate_matmul(model, tp, sp, cb)
    else:
        per_token = _eager_selective(model, tp, sp, cb)
    return tokens * per_token + (RNG_STATE_BYTES if mem.saved != "korthikanti" else 0.0)


def recompute_working_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                            recompute: str, opts: KernelOptions,
                            mem: MemoryOptions | None = None) -> float:
    """Extra bytes alive while a recomputed layer runs its backward (one layer, one micro-batch)."""
    if recompute == "none":
        return 0.0
    full = activation_bytes(model, tp, sp, micro_batch, seq, "none", opts, mem)
    if recompute in ("full", "half"):  # 'half': a checkpointed block replays all of itself
        return full
    return max(0.0, full - activation_bytes(model, tp, sp, micro_batch, seq, recompute, opts, mem))


def gathered_kv_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int, cp: int,
                      recompute: str, opts: KernelOptions, mem: MemoryOptions) -> float:
    """Bytes one layer keeps for backward of the K/V gathered over the cp ranks (one micro-batch,
    `seq` the whole sequence): with the all-gather design (`opts.cp_overlap` False: meshtron's
    runtime, meshtron/parallel/context.py) attention saves the whole sequence's K and V on every
    cp rank, which do not shrink with cp (measured: bench/cp_memory.py); full recomputation
    gathers them again in backward instead. Ring attention (p2p) keeps only the local chunk."""
    if cp == 1 or opts.cp_overlap or recompute == "full":
        return 0.0
    return 2.0 * micro_batch * seq * model.kv_dim / tp * mem.compute_bytes


LOSS_PARALLEL_BYTES = 16.0
"""Bytes per local logit at the peak of torch's `loss_parallel` cross-entropy (tensor-parallel
heads; torch/distributed/tensor/parallel/loss.py): the saved fp32 log-softmax, and in its
fused nll + log-softmax backward `zeros_like(x)`, `exp(x)` and their sum, alive together
(measured by `meshtron rehearse` at tp=2 and 4: 4 + 12)."""
CHUNKED_HEAD_GRAD_COPIES = 2.0
"""The chunked loss (meshtron/model/loss.py) uses the head's weight once per chunk: autograd
adds the chunks' weight gradients as they come (the running sum, the new chunk's gradient and
their sum: three head-sized tensors in the compute dtype; measured by `meshtron rehearse`:
6 bytes per vocabulary x hidden element in bf16). One of the three is the unit gradient
`gathered_bytes` already holds: two more here."""


def chunked_loss_bytes(model: ModelSpec, tokens: int, mem: MemoryOptions) -> float:
    """Peak bytes of meshtron's chunked cross-entropy (tp = 1, no pipeline): no whole logits;
    the head's weight gradients summed over the chunks plus one chunk's logits (Liger's chunk:
    tokens / ceil(vocab / hidden) tokens, about as many elements as the hidden states) in the
    compute dtype and fp32 (12 bytes per element, as the whole-logits loss)."""
    import math

    chunk = max(1, math.ceil(tokens / math.ceil(model.vocab / model.hidden)))
    cb = mem.compute_bytes
    return CHUNKED_HEAD_GRAD_COPIES * cb * model.vocab * model.hidden + chunk * model.vocab * (
        12.0 + cb)


def logits_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int,
                 mem: MemoryOptions | None = None, pipelined: bool = False) -> float:
    """Logits of one micro-batch and their gradients at the loss (module docstring)."""
    mem = mem or DEFAULT
    elements = micro_batch * seq * model.vocab / tp
    kind = mem.loss_kind
    if kind == "vocab-parallel":
        return elements * 6.0
    if kind == "inplace":
        return elements * mem.compute_bytes
    if kind == "chunked" and tp == 1 and not pipelined:
        return chunked_loss_bytes(model, micro_batch * seq, mem)
    # whole logits: a pipeline's last stage also keeps its output (the compute dtype's bytes)
    kept = mem.compute_bytes if pipelined else 0.0
    if tp > 1:  # vocabulary-parallel logits under loss_parallel
        return elements * (LOSS_PARALLEL_BYTES + kept)
    return elements * (12.0 + kept)


def loss_or_recompute(logits: float, work: float) -> float:
    """Bytes of the loss's working set and of a recomputed block's, which are never alive
    together: autograd runs the loss's backward (logits, their fp32 copies and gradients) and
    the head's to completion, freeing them, before the last block's checkpointed forward is
    replayed (torch.utils.checkpoint recomputes inside the block's backward node), so the peak
    holds the larger of the two, not their sum. In a pipeline schedule one micro-batch's loss
    and another's recomputation do not overlap either: a stage runs one action at a time."""
    return max(logits, work)


def workspace_bytes(tensors: float, capacity: float) -> float:
    """Workspace and fragmentation allowance for a GPU holding `tensors` bytes."""
    return workspace_fixed(capacity) + FRAGMENTATION * tensors


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
    """Stored activations of the other in-flight micro-batches (pipeline schedules)."""
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
                 grad_extra: float = 0.0) -> StageMemory:
    """Linear model of one stage's memory in its layer count (used by the layer partition).

    FSDP2's gathered copies with ZeRO-0/1/2 grow with the layers (every block stays gathered);
    with ZeRO-3 they do not (two units) unless `keep_gathered` (pipelining). `accum`: bytes
    per local parameter of unsharded gradients accumulated over the micro-batches (ZeRO-2/3
    with accumulate_unsharded or pipelining: FSDP2 keeps them in the reduce dtype);
    `grad_extra`: accumulated gradient elements beyond the stage's local parameters
    (`embedding_grad_extra`); `reduce_bytes`: bytes per element of the reduce-scatter input
    a block's backward runs beside (the reduce dtype; 0 where gradients are reduced after the
    last backward: pipelining). The peak is the larger of the loss's and a block's backward
    moment (`peak_moment`); the block's counts the previous block's gradient on every stage
    (a one-block stage has none: conservative)."""
    sb = sum(states)
    # routed experts under expert parallelism (`p_expert`: E/ep experts of one block on this
    # rank, `p_layer` the rest of the block) keep their ZeRO states over the dp*cp/ep ranks
    # holding the same experts (`expert_states`); the compute copies gather both
    eb = sum(expert_states) if expert_states is not None else sb
    per_layer = p_layer * (sb + accum) + p_expert * (eb + accum) + act * in_flight
    p_layer = p_layer + p_expert
    cb = mem.compute_bytes
    fsdp_all = (mem.framework == "fsdp2" and not (dp == 1 and mem.dtype == "fp32")
                and not (zero == 3 and dp > 1 and not keep_gathered))
    k = 0 if fsdp_all else 2  # fsdp_all: the gathered blocks are in per_layer
    if fsdp_all:
        per_layer += cb * p_layer
    args = (mem, zero, dp, k, p_layer, p_root, largest, grad_bytes, keep_gathered, root_unit)
    at_block = block_moment(*args, reduce_bytes, act)
    at_loss = gathered_bytes(*args)
    # the embedding's moment frees one layer's activations here (k layers' in `breakdown`)
    previous = previous_gradient_bytes(mem, dp, 2, p_layer, keep_gathered, reduce_bytes)
    gathered, recompute = peak_moment(logits, work, at_loss, at_block, embedding_moment(
        mem, at_loss, previous, grad_extra, act))
    return StageMemory(per_layer=per_layer,
                       fixed=p_root * (sb + accum) + grad_extra * accum + gathered + recompute
                       + logits)


def breakdown(mem: MemoryOptions, zero: int, dp: int, states: tuple[float, float, float],
              layers: int, p_layer: float, p_root: float, largest: float, act: float,
              in_flight: float, work: float, logits: float, capacity: float, stage: int,
              grad_bytes: float = GRAD_BYTES, keep_gathered: bool = False,
              accum: float = 0.0, p_expert: float = 0.0,
              expert_states: tuple[float, float, float] | None = None,
              root_unit: float | None = None, reduce_bytes: float = 4.0,
              grad_extra: float = 0.0) -> MemoryBreakdown:
    """The component breakdown of a stage holding `layers` blocks (GiB); `p_expert`,
    `expert_states`, `reduce_bytes`, `grad_extra`: as stage_memory."""
    wb, gb, ob = states
    ewb, egb, eob = expert_states if expert_states is not None else states
    experts = layers * p_expert
    params = layers * p_layer + p_root
    args = (mem, zero, dp, layers, p_layer + p_expert, p_root, largest, grad_bytes,
            keep_gathered, root_unit)
    at_block = (block_moment(*args, reduce_bytes, act) if layers > 1
                else backward_gathered_bytes(*args))
    at_loss = gathered_bytes(*args)
    previous = previous_gradient_bytes(mem, dp, layers, p_layer + p_expert, keep_gathered,
                                       reduce_bytes)
    gathered, work = peak_moment(logits, work, at_loss, at_block, embedding_moment(
        mem, at_loss, previous, grad_extra, layers * act))
    gathered += accum * (params + experts + grad_extra)
    all_acts = layers * act * in_flight
    acts = min(layers * act, all_acts)
    extra = all_acts - acts
    tensors = (params * (wb + gb + ob) + experts * (ewb + egb + eob) + gathered + all_acts
               + work + logits)
    return MemoryBreakdown(
        params=(params * wb + experts * ewb) / GIB, grads=(params * gb + experts * egb) / GIB,
        optimizer=(params * ob + experts * eob) / GIB,
        gathered=gathered / GIB, activations=acts / GIB,
        in_flight=extra / GIB, recompute=work / GIB, logits=logits / GIB,
        workspace=workspace_bytes(tensors, capacity) / GIB, capacity=capacity / GIB,
        stage=stage, dtype=mem.dtype)
