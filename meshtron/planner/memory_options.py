"""What decides the bytes of a plan besides its layout: the run's precision, the framework
whose memory layout it has, the saved-tensor list and the loss (`MemoryOptions`), and the
constants the memory modules share. memory.py describes the peak these options price.
Which values meshtron's own runtime runs is decided per field in
plan_rules_options.RUNTIME_OPTIONS (a new field needs its decision there); under framework
meshtron any other value is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.errors import UserError
from meshtron.planner.compute import KernelOptions
from meshtron.planner.plan_rules_offload import OFFLOAD_RULES
from meshtron.planner.plan_rules_stack import LAYOUT_RULES
from meshtron.planner.plan_rules_zero import ZERO_RULES

GIB = float(2**30)
WORKSPACE_FIXED_GIB = 1.0
"""CUDA context, cuBLAS and NCCL workspaces."""
WORKSPACE_FIXED_MAX_FRACTION = 0.05
"""Cap of the fixed allowance on small devices, as a fraction of device memory."""
FRAGMENTATION = 0.08
"""The one undetermined margin of the memory model: what PyTorch's CUDA caching allocator
reserves beyond the tensors alive at the peak, as a fraction of them, for a stack that runs it
without expandable segments (its default). That allocator (c10/cuda/CUDACachingAllocator.cpp)
rounds every request to 512 B (kMinBlockSize), serves <= 1 MiB from 2 MiB segments
(kSmallBuffer) and 1-10 MiB from 20 MiB ones (kLargeBuffer, kMinLargeAlloc), rounds larger
segments to 2 MiB (kRoundLarge), and keeps freed blocks cached in the segments it cut them
from: a block freed between two live ones serves only a request that fits it, so the reserved
peak exceeds the allocated one by an amount that depends on the order of allocations and
frees, which no closed form of a plan gives. 8% stands for the reserved/allocated ratio of
1.05-1.15 reported for LLM training; no measurement of ours reads reserved memory (the H200
check records max_memory_allocated only). See `MemoryOptions.expandable_segments`."""
RESERVED_RATIO_HIGH = 1.15
"""The top of the reserved/allocated range FRAGMENTATION stands for (1.05-1.15): a plan whose
headroom under the device is below (RESERVED_RATIO_HIGH - 1 - FRAGMENTATION) of its tensors
would not fit at that end of the range; the plan report calls it tight (report.tight_note)."""
FRAGMENTATION_EXPANDABLE = 0.0
"""The same allowance with expandable segments (PYTORCH_ALLOC_CONF=expandable_segments:True,
PyTorch CUDA semantics docs): one segment per stream grows by mapping physical pages and
unmaps free pages when an allocation would fail, so freed blocks between live ones give their
memory back; what stays is the 512 B rounding of each block and at most a page per free gap,
megabytes against tens of GiB: none charged (`MemoryOptions.expandable_segments`)."""

DTYPES = ("bf16", "fp32", "fp8")
"""fp8 runs keep bf16 activations, weights and compute copies here (Transformer Engine saves
some GEMM inputs in FP8, which this does not count: memory is not underestimated)."""
FRAMEWORKS = ("fsdp2", "megatron", "deepspeed")
MASTER_WEIGHTS = ("fp32", "bf16", "remainders", "none")
"""How a mixed-precision ZeRO optimizer keeps the fp32 master weights
(MemoryOptions.master_weights): bytes per parameter in memory_states.MASTER_BYTES."""
PARAM_DTYPES = ("fp32", "bf16")
"""dtype of FSDP2's sharded parameters (MemoryOptions.param_dtype)."""
SELECTIVE = ("eager", "korthikanti", "alternate-matmul")
HALF_COUNTS = ("part", "rank", "chunk")
"""MemoryOptions.half_counts values: how a stack's `half` recomputation counts its blocks."""
LOSSES = ("chunked", "eager", "vocab-parallel", "inplace", "flash-ce", "eager-bf16")
FP8_TILE_BYTES = 1.0 + 4.0 / 128
"""Bytes per element of an activation kept in FP8 with one fp32 scale per 1x128 tile
(DeepSeek-V3 report 3.3.2-3.3.3, fine-grained quantization; MemoryOptions.swiglu_recompute)."""
E5M6_TILE_BYTES = 1.5 + 4.0 / 128
"""Bytes per element of DeepSeek's E5M6 cache of the attention output (12 bits: sign, 5
exponent, 6 mantissa) with its 1x128 tile scales (report 3.3.3, "converted from an 1x128
quantization tile to an 128x1 tile in the backward pass"; MemoryOptions.attn_out_e5m6)."""

PIPELINE_SPLITS = ("any", "megatron-even", "megatron-ends", "deepspeed-transformer",
                   "deepspeed-parameters", "dualpipe")
"""How a stack assigns layers to pipeline stages (planner/pipeline_split.py, plan_rules
`split_problem`): 'any' (meshtron's runtime, torchtitan's split points: the planner's
time-balanced split), 'megatron-even' (Megatron-LM: equal layers per stage and chunk),
'megatron-ends' (Megatron-Core 0.9+: equal middle stages, first/last stage counts of their
own), 'deepspeed-transformer' / 'deepspeed-parameters' (DeepSpeed's PipelineModule
partition_method 'type:transformer' with the left-greedy split of DeepSpeed <= 0.12.4 /
'parameters' with the dynamic programme of 0.12.5+), 'dualpipe' (DeepSeek's stack: any
split, run by its DualPipe engine only, planner/pipeline_dualpipe.py)."""


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
    softmax overwritten by its gradient, 6) or 'inplace' (flash-attn's fused loss with
    inplace_backward=True: the gradient overwrites the 16-bit logits, 2), 'flash-ce'
    (flash-attn's fused loss at its default inplace_backward=False, as llm-foundry's
    ComposerMPTCausalLM builds it, `FusedCrossEntropyLoss(ignore_index=-100)`: the backward
    writes a new 16-bit gradient beside the logits, which Composer's state.outputs keeps for
    the train metrics, 4), 'eager-bf16'
    (F.cross_entropy on the compute-dtype logits, no fp32 cast: NeMo AutoModel's
    MaskedCrossEntropy with fp32_upcast false; log_softmax's output, the incoming gradient and
    the input gradient in the compute dtype, 6); None: 'chunked' for fsdp2, 'vocab-parallel'
    otherwise."""
    gqa_copies: bool = False
    """Grouped-query attention copies K and V to every query head before attention
    (`repeat_kv` in torchtitan's and Hugging Face's Llama, saved for backward at full width:
    the torchtitan and DeepSpeed@2024 presets); False: SDPA's native GQA (`enable_gqa=True`,
    meshtron/model/attention.py) keeps them at kv width."""
    fused_norm: bool = True
    """RMSNorm runs as one kernel saving only its input (CUDA: aten._fused_rms_norm, PyTorch
    PR #153666); False: the composite path (PyTorch on CPU), which also saves an fp32 copy of
    the input and the fp32 normalised tensor."""

    moe_weighted_act: bool = False
    """Megatron-Core 0.13 on (ADLR/megatron-lm!2668, "Memory efficient token permutation",
    April 2025): the routing probabilities scale the experts' SwiGLU output inside the
    weighted bias-SwiGLU kernel (moe/experts.py TEGroupedMLP, weighted_bias_swiglu_impl) and
    the combine's unpermute takes none, so it saves no [T*k, h] expert outputs for their
    gradient, only the permuted probabilities beside the SwiGLU's input
    (moe_memory.routed_saved_bytes); False: the probabilities applied at the unpermute
    (Megatron-Core 0.8-0.12, the megatron@2024 preset). A stack that combines through DeepEP
    (DeepSeek-V3's) cannot weight at the combine: DeepEP's combine sums the expert ranks' rows
    unweighted and its backward is a dispatch by the routing handle (deepseek-ai/DeepEP README
    combine_forward / combine_backward; tests/legacy/test_intranode.py checks combined_x as
    the plain sum), so the weights travel with the dispatch and scale the rows on the expert
    side; Megatron-Core's DeepEP path (token_dispatcher.py _DeepepManager: unpermute without
    probs, permuted probs to the experts) is this option. Where DeepSeek's own code applies
    them on the expert side is unpublished: scaling fc2's output instead would keep that
    output [R, h] for the weights' gradient, more than the unpermute's [T*k, h]."""

    recompute_norms: bool = False
    """The backward recomputes every RMSNorm from its kept input (DeepSeek-V3 report section
    3.2.3, "we recompute all RMSNorm operations and MLA up-projections during
    back-propagation"): the norms' outputs (the QKV, fc1 and router GEMM inputs) are not
    kept; False: kept (Megatron-Core, torchtitan, meshtron). The backward runs the norms again
    (Megatron-Core's recompute_modules "layernorm"): priced in the step by
    compute_parts.LayerCost.fine_recompute."""

    recompute_up_proj: bool = False
    """The backward recomputes the attention's up-projections (section 3.2.3, MLA): Q, K and V
    are not kept. Priced on the preset's GQA stand-in as its Q, K and V dropped; MLA's
    latents that rebuild them (1,536 + 512 + 64 per token in DeepSeek-V3's config, 2,112
    against 7,168 values: about 0.29 of an [T, h] bf16 unit) are not counted (ModelSpec has
    no MLA widths). The backward runs the up-projection GEMMs, the latent norms and the RoPE
    again (Megatron-Core's recompute_modules "mla_up_proj"): priced in the step and the
    hardware FLOPs (compute_parts.LayerCost.fine_recompute, compute_flops)."""

    swiglu_recompute: bool = False
    """SwiGLU keeps its input in FP8 with 1x128 tile scales and the backward recomputes its
    output (section 3.3.3, "we cache the inputs of the SwiGLU operator and recompute its
    output in the backward pass. These activations are also stored in FP8"): fc2's input is
    not kept, the [2f] input costs FP8_TILE_BYTES per element (dense MLP, shared
    and routed experts); False: fc1's bf16 output and fc2's input kept. The backward runs the
    activation again (Megatron-Core's recompute_modules "moe_act" for the routed experts):
    priced in the step by compute_parts.LayerCost.fine_recompute."""

    attn_out_e5m6: bool = False
    """The attention output (the out-projection's input) cached once, in E5M6 with 1x128
    tile scales, for both the out-projection's weight gradient and the attention core's
    backward (report 3.3.3, Low-Precision Activation (1): "Inputs of the Linear after the
    attention operator. These activations are also used in the backward pass of the attention
    operator ... We adopt a customized E5M6 data format exclusively for these activations"):
    E5M6_TILE_BYTES per element in place of the FP8 Linear's copy beside FlashAttention's
    bf16 output (memory_acts._korthikanti). Changes FP8 runs only: a bf16 run already keeps
    one bf16 copy for both. False: two copies (Transformer Engine, Megatron-Core)."""

    bf16_moments: bool = False
    """AdamW's two moments in BF16, master weights and gradients FP32 (section 3.3.3,
    "Low-Precision Optimizer States"): 4 + 2 + 2 optimizer bytes per parameter, not 12
    (memory_states.state_bytes); mixed-precision ZeRO frameworks only."""

    master_weights: str = "fp32"
    """How the optimizer keeps the master copy of a mixed-precision ZeRO framework's 16-bit
    parameters (MASTER_WEIGHTS; the bytes per parameter of memory_states.state_bytes). 'fp32':
    a 4-byte fp32 copy (Megatron-Core's distributed optimizer, DeepSpeed). The others are Apex
    DistributedFusedAdam as NeMo 2.0.0rc1's (and v2.0.0's) megatron_base_model.py
    `setup_optimization` sets it up beside the bf16 O2 model: with fp8_params, store_params, a
    copy in the optimizer's dtype ('fp32', or 'bf16': 2 bytes); else with an fp32 optimizer
    store_param_remainders ('remainders': the 2-byte int16 remainders that rebuild fp32 from
    the bf16 parameter); else, the optimizer's dtype the model's, store_params False ('none':
    the bf16 parameters are the optimizer's own). 'bf16' and 'none' come with bf16 moments
    (one optimizer dtype): set `bf16_moments` with them."""

    grads_at_first_backward: bool = False
    """A mixed-precision ZeRO framework's gradient accumulation buffer of a block is made at
    that block's first backward of the step, as PyTorch FSDP makes an unsharded gradient
    (autograd's first accumulation; FSDP2's `to_accumulated_grad_if_needed`), not held over
    the whole step as Megatron-Core's contiguous grad buffer (distributed/param_and_grad_buffer.py):
    an interleaved rank's peak then holds only the gradients of the chunks whose backward has
    begun (the walk of memory_pipeline.held_bytes, as for fsdp2). Meta's Llama 3 stack (paper
    arXiv 2407.21783 section 3.3.2: "Our use of FSDP for Llama 3 shards the optimizer states
    and gradients", "FP32 gradient accumulation during backward computation over multiple
    micro-batches"). Whole gradients (ZeRO-0/1) only: ZeRO-2/3 shard them anyway. False: the
    buffer over the step (Megatron-Core, DeepSpeed); fsdp2 always accumulates so (refused
    there as a no-op)."""

    fold_after_weight_pass: bool = True
    """After each zero-bubble W pass the stack hands the micro-batch's weight gradients to
    FSDP2's reduce-dtype accumulator itself (the no-sync half of FSDP2's post_backward,
    `accumulate_unsharded_grad_if_needed` + `to_accumulated_grad_if_needed`): a non-first
    stage then holds W's compute-dtype gradients only to W's end, not to its next B
    (memory_zb.held's `pending`). True: meshtron's runtime (meshtron/parallel/pipeline.py
    `_weight_grads_into_reduce_dtype`, `fold_weight_grads`, branch zbv), the default as every
    field's. False: torch's schedule unchanged, FSDP2 folds in the post_backward the next B
    fires (torchtitan: torchtitan/distributed/pipeline_parallel.py builds torch's
    PipelineStage and schedule class and wraps no W pass, pytorch/torchtitan b5bcd76c). Read
    only for fsdp2 under torch's zero bubble (estimate_walks._torch_zb)."""

    param_dtype: str = "fp32"
    """dtype FSDP2 keeps the sharded parameters in (PARAM_DTYPES; framework 'fsdp2' only).
    'fp32': master weights (meshtron's runtime, torchtitan). 'bf16': the model is built and
    trained in bf16 with no fp32 copy: NeMo AutoModel's NeMoAutoModelForCausalLM.from_config
    resolves torch_dtype 'auto' to torch.bfloat16 (_transformers/auto_model.py; recipes/llm/
    train_ft.py: "fp32 master-weight default planned to be enabled in follow-up PR", June
    2026), so FSDP2's sharded parameters, the sharded gradients (which take the parameter's
    dtype after the fp32 reduce-scatter) and torch.optim.Adam's exp_avg / exp_avg_sq
    (zeros_like the parameter) are all bf16: 2 + 2 + 4 bytes per parameter, not 4 + 4 + 8
    (memory_states.state_bytes). Unsharded gradients accumulated over micro-batches stay in
    the reduce dtype (FSDP2's to_accumulated_grad_if_needed upcasts them)."""

    experts_outside_fsdp: bool = False
    """Routed experts whose expert-data-parallel group (dp*cp/ep ranks holding the same experts)
    is a single rank are left out of FSDP2 (NeMo AutoModel moe/parallelizer.py apply_fsdp:
    fully_shard over the ep_shard mesh only when it has more than one rank, else the experts
    are the block's ignored_params): no all-gathered compute copy, and their gradients
    accumulate in place in the parameter dtype, not unsharded in the reduce dtype
    (memory.stage_memory `p_loose`). False: wrapped whatever the group's size (torchtitan's
    apply_fsdp wraps the experts over dp_shard_mod_ep even at size 1; meshtron's runtime)."""

    expandable_segments: bool = False
    """The run's launch sets PyTorch's caching allocator to expandable segments
    (PYTORCH_ALLOC_CONF="expandable_segments:True"): its fragmentation allowance is
    FRAGMENTATION_EXPANDABLE, not FRAGMENTATION. torchtitan's single-node run_train.sh sets it,
    its multinode_trainer.slurm does not (it sets NCCL_BUFFSIZE=2 MiB instead), so no preset
    assumes it: an options file says `expandable_segments = true` for a run launched so.
    False: the allocator's default (meshtron's runtime, Megatron-LM and DeepSpeed set
    nothing)."""

    @property
    def fragmentation(self) -> float:
        """Caching-allocator fragmentation allowance, fraction of the tensors at the peak."""
        return FRAGMENTATION_EXPANDABLE if self.expandable_segments else FRAGMENTATION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"dtype={self.dtype!r}: allowed values are {', '.join(DTYPES)}")
        if self.framework not in FRAMEWORKS:
            raise UserError(f"memory.framework={self.framework!r}: allowed values are "
                             f"{', '.join(FRAMEWORKS)}")
        if self.master_weights not in MASTER_WEIGHTS:
            raise UserError(f"memory.master_weights={self.master_weights!r}: allowed values "
                            f"are {', '.join(MASTER_WEIGHTS)}")
        if self.param_dtype not in PARAM_DTYPES:
            raise UserError(f"memory.param_dtype={self.param_dtype!r}: allowed values are "
                            f"{', '.join(PARAM_DTYPES)}")
        if self.param_dtype != "fp32" and self.framework != "fsdp2":
            raise UserError(f"memory.param_dtype={self.param_dtype!r}: priced for framework "
                            f"fsdp2 only (the ZeRO frameworks keep fp32 master weights); use "
                            f"fp32")
        if self.loss is not None and self.loss not in LOSSES:
            raise UserError(f"memory.loss={self.loss!r}: allowed values are {', '.join(LOSSES)}")
        for name in ("gqa_copies", "fused_norm", "moe_weighted_act", "expandable_segments",
                     "recompute_norms", "recompute_up_proj", "swiglu_recompute",
                     "attn_out_e5m6", "bf16_moments", "experts_outside_fsdp",
                     "grads_at_first_backward", "fold_after_weight_pass"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise UserError(f"memory.{name}={value!r}: allowed values are true, false")
        if self.pipeline_split is not None and self.pipeline_split not in PIPELINE_SPLITS:
            raise UserError(f"memory.pipeline_split={self.pipeline_split!r}: allowed values "
                            f"are {', '.join(PIPELINE_SPLITS)}")
        if self.host_offload is not None and self.host_offload not in OFFLOAD_RULES:
            raise UserError(f"memory.host_offload={self.host_offload!r}: allowed values "
                            f"are {', '.join(OFFLOAD_RULES)}")
        if self.zero_stages is not None and self.zero_stages not in ZERO_RULES:
            raise UserError(f"memory.zero_stages={self.zero_stages!r}: allowed values "
                            f"are {', '.join(ZERO_RULES)}")
        if self.half_counts is not None and self.half_counts not in HALF_COUNTS:
            raise UserError(f"memory.half_counts={self.half_counts!r}: allowed values "
                            f"are {', '.join(HALF_COUNTS)}")
        if self.layouts is not None and self.layouts not in LAYOUT_RULES:
            raise UserError(f"memory.layouts={self.layouts!r}: allowed values "
                            f"are {', '.join(LAYOUT_RULES)}")
        if self.split_priced is not None and self.split_priced not in PIPELINE_SPLITS:
            raise UserError(f"memory.split_priced={self.split_priced!r}: allowed values "
                            f"are {', '.join(PIPELINE_SPLITS)}")
        if self.activations is not None and self.activations not in SELECTIVE:
            raise UserError(f"memory.activations={self.activations!r}: allowed values are "
                             f"{', '.join(SELECTIVE)}")
        self._deepseek_savings_priced()

    def _deepseek_savings_priced(self) -> None:
        """DeepSeek's savings are priced on the Megatron-style saved-tensor list and the
        mixed-precision ZeRO states only: set elsewhere they would change nothing, silently."""
        for name in ("recompute_norms", "recompute_up_proj", "swiglu_recompute",
                     "attn_out_e5m6"):
            if getattr(self, name) and self.saved != "korthikanti":
                raise UserError(f"memory.{name}=true: priced on the 'korthikanti' saved-tensor "
                                f"list (Megatron-style stacks), not {self.saved!r}; use false")
        if self.framework == "fsdp2" and self.master_weights != "fp32":
            raise UserError(f"memory.master_weights={self.master_weights!r}: priced for the "
                            f"mixed-precision ZeRO frameworks (megatron, deepspeed), not "
                            f"fsdp2; use fp32")
        if self.framework == "fsdp2" and self.grads_at_first_backward:
            raise UserError("memory.grads_at_first_backward=true: fsdp2 accumulates its "
                            "gradients so already; use false")
        if self.bf16_moments and self.framework == "fsdp2":
            raise UserError("memory.bf16_moments=true: priced for the mixed-precision ZeRO "
                            "frameworks (megatron, deepspeed), not fsdp2; use false")
        if self.master_weights == "none" and not self.bf16_moments:
            # NeMo keeps no master copy only when the optimizer's dtype is the bf16 model's,
            # its moments then bf16 too (MemoryOptions.master_weights)
            raise UserError("memory.master_weights='none': the bf16 parameters are the "
                            "master weights only with bf16 moments; set bf16_moments = true "
                            "or use fp32 / remainders")
        if self.master_weights == "bf16" and not self.bf16_moments:
            # Apex keeps its master copy and moments in one optimizer dtype
            raise UserError("memory.master_weights='bf16': a bf16 master copy comes with bf16 "
                            "moments (one optimizer dtype); set bf16_moments = true or use "
                            "fp32 / remainders")

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

    pipeline_split: str | None = None
    """The stack's layer-to-stage rule (PIPELINE_SPLITS; the framework presets set theirs),
    which also names its pipeline engine: the schedules it runs (plan_rules.STACK_SCHEDULES)
    and, for DeepSpeed's, the pipe buffers it keeps (memory_pipeline.deepspeed_pipe_buffers);
    None: 'any'. The split changes every stage's time and memory."""

    host_offload: str | None = None
    """The host offload the stack's code runs (plan_rules_offload.STACK_OFFLOADS: the kinds and
    the ZeRO stages it runs them with; the framework presets set theirs): the search tries only
    those and an explicit other one is refused; None: 'any', every kind priced."""

    zero_stages: str | None = None
    """The ZeRO stages the stack's code runs (plan_rules_zero.STACK_ZEROS, which cites it; the
    framework presets set theirs): the search tries only those and an explicit other one is
    refused; None: 'any', every stage priced."""

    layouts: str | None = None
    """The tensor / pipeline parallelism and mixture-of-experts models the stack's code cannot
    run (plan_rules_stack.STACK_LAYOUTS, which cites it; the framework presets set theirs): the
    search offers none of them and an explicit one is refused; None: 'any', all priced."""

    half_counts: str | None = None
    """Which blocks the stack's partial recomputation (`recompute = "half"`) checkpoints
    (HALF_COUNTS): 'part', every second block of each model part, counted afresh per part
    (meshtron: parallel/recompute.py `i % 2 == 1` over the part's own blocks; an odd part
    priced as such, estimate_half.py); 'rank', every second block the process wraps, one
    counter across a rank's chunks (torchtitan: ptd_checkpoint_wrapper._count); 'chunk', N of
    each chunk's layers (Megatron's recompute_method 'block'; plan_rules_stack refuses it on
    one-layer chunks). 'rank' and 'chunk' are priced at the mean per block. None: 'part' for
    framework fsdp2, else 'chunk'."""

    split_priced: str | None = None
    """The layer-to-stage rule priced instead of the stack's own, set by the search only for a
    pinned layout the stack's rule cannot split (search_space.SplitFallback); the stack's
    engine (`engine`: its schedules, its buffers) stays the stack's. Not a user option."""

    @property
    def half_per_part(self) -> bool:
        """`half` counts its blocks per model part (meshtron's rule, `half_counts`): an odd
        part replays and stores half a block off the mean (estimate_half.py)."""
        counts = self.half_counts or ("part" if self.framework == "fsdp2" else "chunk")
        return counts == "part"

    @property
    def split_rule(self) -> str:
        """The layer-to-stage rule priced."""
        if self.split_priced is not None:
            return self.split_priced
        return self.engine

    @property
    def engine(self) -> str:
        """The stack's own rule, which names its pipeline engine (plan_rules.STACK_SCHEDULES,
        memory_pipeline.deepspeed_pipe_buffers)."""
        if self.pipeline_split is not None:
            return self.pipeline_split
        return "any"

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

