"""KernelOptions: the software choices (attention kernel, fused or compiled stack, FP8 scaling,
ZeRO flavour, communication overlaps, optimizer) that change what the same layout costs. The
framework presets (planner/frameworks.py) are instances; planner/compute.py, gemm.py and
elementwise.py read them. Which values meshtron's own runtime runs is decided per field in
plan_rules_options.RUNTIME_OPTIONS (a new field needs its decision there:
tests/test_runtime_options.py); under framework meshtron any other value is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.errors import UserError
from meshtron.planner.flash_isa import FLASH_ISAS
from meshtron.planner.fp8 import FP8_FILTERS, FP8_SCALINGS

FP8_GEMMS = ("cublas", "blockwise")
"""How a stack's FP8 GEMMs scale their operands (KernelOptions.fp8_gemm): 'cublas' = one scale
per tensor or per row / column, applied in the epilogue (cuBLASLt, torch._scaled_mm:
Transformer Engine's delayed and current scaling, torchao's tensorwise and rowwise);
'blockwise' = 1x128 / 128x128 block scales promoted in the k loop (DeepSeek-V3, DeepGEMM)."""

EP_DISPATCHES = ("bf16", "fp8", "deepep", "hybridep")
"""What the expert-parallel dispatch sends (KernelOptions.ep_dispatch): 'bf16' = the routed
rows as the layer holds them; 'fp8' = quantised first, with 1x128 fp32 block scales
(DeepSeek-V3 report section 3.3.3; DeepEP's normal kernels, "FP8 dispatching and BF16
combining"), priced as NCCL's all-to-all of those bytes; 'deepep' = DeepEP's normal kernels in
the compute dtype, one row per destination rank and node (planner/moe_deepep.py: NeMo
AutoModel's and Megatron-Core's flex dispatcher with BF16 experts); 'hybridep' = NVIDIA's
HybridEP kernels (DeepEP's hybrid-ep branch, Megatron-Core's flex dispatcher with
moe_flex_dispatcher_backend 'hybridep'): DeepEP's rows plus the routing map all-gathered over
the ep group every forward (moe_deepep.hybridep_map_gather_time)."""
ROUTINGS = ("spread", "contiguous")
"""How a token's top-k experts are picked (KernelOptions.expert_routing; moe_deepep.ROUTINGS)."""

MAX_PASSES = 16
"""Upper bound of the counted options (train_metrics, grad_bucket_passes): the stacks priced
have 0-3; a bound keeps a typo from pricing a step of years (or overflowing the reliability
model)."""

ROUTER_DTYPES = ("bf16", "fp32")
"""KernelOptions.router_dtype values: the gating GEMM's dtype (Megatron-Core moe_router_dtype;
its default None runs the input's, bf16; priced in planner/moe_router.py)."""

ATTENTION_KINDS = ("flash", "unfused")
STACKS = ("eager", "fused", "compiled")
SHARDINGS = ("fsdp", "zero")
OPTIMIZERS = ("fused", "foreach", "for-loop")
EAGER_NORMS = ("aten", "python")
V_WIDTHS = ("padded", "native")
"""The head size the attention kernel runs V at when it is narrower than Q and K (MLA: 128
against 192; KernelOptions.v_width)."""
_CHOICES = (("attention", ATTENTION_KINDS), ("stack", STACKS), ("sharding", SHARDINGS),
            ("fp8_filter", FP8_FILTERS), ("fp8_scaling", FP8_SCALINGS), ("fp8_gemm", FP8_GEMMS),
            ("ep_dispatch", EP_DISPATCHES), ("expert_routing", ROUTINGS),
            ("eager_norm", EAGER_NORMS), ("optimizer", OPTIMIZERS),
            ("flash_isa", FLASH_ISAS), ("v_width", V_WIDTHS), ("router_dtype", ROUTER_DTYPES))
"""The KernelOptions fields that take one of a few names, with the names each allows."""


DEFAULT_IMBALANCE = 1.25
"""Tokens on the fullest expert-parallel rank over the mean, when not measured. The capacity
factor GShard (Lepikhin et al. 2020, section 2.2) and Switch Transformer (Fedus et al. 2022,
section 2.1 and Table 1: 1.0-1.25) size expert buffers with, i.e. the load a balanced router
stays under; the aux-loss-free balancing of DeepSeek-V3 keeps the per-batch load near that
(its Figure 9). A convention, replaced by a measured value from router statistics."""


@dataclass(frozen=True)
class KernelOptions:
    """Software choices that change the cost of the same layout."""

    attention: str = "flash"
    """'flash' (FlashAttention, default) or 'unfused' (materialised scores, Megatron-LM <= 2022)."""
    dropout: bool = False
    """Dropout on attention probabilities and hidden outputs (GPT-2/3 era; modern LLMs: off)."""
    overlap_grad_reduce: bool = True
    """Gradient reduction overlaps the last backward (DDP buckets; Megatron-LM since 2023)."""
    fp32_grad_reduce: bool = False
    """Gradients are accumulated and reduced in fp32 (Megatron-LM's main_grad), not bf16."""
    p2p_scatter_gather: bool = True
    """Pipeline sends split the activation over the tensor group and re-gather it over NVLink
    (Megatron-LM's scatter/gather, Narayanan et al. 2021, section 4.1; DeepSpeed's pipeline
    engine too, PartitionedTensor over the tensor group: runtime/pipe/engine.py
    is_pipe_partitioned = is_model_parallel, v0.3.15 on). False: every tensor rank sends the
    whole [micro_batch*s, h] activation."""
    p2p_blocking: bool = False
    """Pipeline sends and receives are blocking steps of each stage's instruction stream
    (DeepSpeed's pipeline engine, 2021-2022): per micro-batch and direction a stage pays both its
    receive and its send; the fill and drain chains one transfer per boundary each
    (pipeline.train_schedule_hops, the walk of its TrainSchedule). False: Megatron's batched
    isend/irecv, one transfer per boundary."""
    stack: str = "eager"
    """'eager' (plain PyTorch modules, meshtron's runtime), 'fused' (Megatron-LM / Transformer
    Engine fused kernels) or 'compiled' (per-block torch.compile: meshtron's --compile,
    torchtitan's apply_compile): what the memory-bound operations cost (planner/elementwise.py)."""
    shard_units_per_layer: int = 1
    """Parameter all-gathers per layer and pass under ZeRO-3: FSDP wraps one transformer block (1);
    DeepSpeed's ZeRO-3 fetches each parameterised submodule (6 for a GPT layer: two norms, QKV,
    output projection, two MLP linears; Rajbhandari et al. 2021, ZeRO-Infinity, section 6)."""

    reduce_units_per_layer: int | None = None
    """Gradient reduce-scatters per layer and micro-batch under ZeRO-3 (None: one per gather
    unit). DeepSpeed 0.3.x reduces every parameter separately, biases and norms included (12 for
    a GPT layer with biases), while it gathers only the parameters above
    `stage3_param_persistence_threshold` (the four weight matrices); FSDP reduces per unit."""

    prefetch_params: float | None = None
    """Parameters ZeRO-3 all-gathers ahead of the unit computing (None: the whole next unit, as
    FSDP's one-unit prefetch). DeepSpeed's `stage3_prefetch_bucket_size` (default 5e7) admits
    whole parameters until it is full, so any bucket > 0 prefetches the next unit whole
    (0.3.13-0.5.x: stage3.py PrefetchCoordinator.get_params_to_prefetch, issued on the fetch
    stream right after each synchronous fetch; 0.6+: partitioned_param_coordinator.py); 0: no
    prefetch."""

    max_live_params: float | None = None
    """DeepSpeed's `stage3_max_live_parameters` (default 1e9): the coordinator prefetches only
    while the gathered parameters it holds are fewer than this (0.3.13-0.5.x stage3.py
    prefetch_next_sub_modules: `total_available_parameter_numel <
    max_available_parameters_in_numel`; 0.6+ partitioned_param_coordinator.py fetch_sub_module:
    at most max_live - available). A unit with at least this many parameters, once fetched,
    leaves nothing to prefetch beside its compute: the next unit's gather is exposed. None: no
    limit (FSDP)."""

    live_embedding: bool = False
    """A tied word embedding stays gathered over the whole step and counts toward
    `max_live_params` at every prefetch check: Megatron's GPT2Model under ZeRO-3 registers it
    as an external parameter of the top module (DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3
    megatron/model/gpt2_model.py, 2cd968f2 of March 2021: `register_external_parameter(self,
    ...word_embeddings.weight)`), so stage3.py fetches it at the model's pre-forward hook, keeps
    it at its post-forward (`_keep_for_later`: the model's pre-backward is the next entry of the
    trace, reuse distance 0) and partitions it only in `_partition_all_parameters` after the
    backward (the model's post-backward never runs: its inputs, token ids, carry no gradient).
    False: the embedding is gathered and released like any unit (FSDP, HF models)."""

    recompute_regathers: bool = False
    """Under ZeRO-3 with full recomputation, the recomputed forward gathers a unit's parameters
    again and the backward once more (DeepSpeed: its per-submodule hooks release parameters
    after every forward, recomputed ones included). False: FSDP, whose pre-backward unshard
    serves both."""

    fp8_filter: str = "torchao"
    """With dtype fp8, which block Linears run in FP8 (planner/fp8.py FP8_FILTERS): 'torchao'
    (meshtron's runtime: torchao's size thresholds, the rule its conversion applies) or 'all'
    (Transformer Engine, torchtitan, DeepSeek-V3: every aligned Linear)."""
    fp8_scaling: str = "torchao"
    """With dtype fp8, how the operands are quantised and what that moves (planner/fp8.py
    FP8_SCALINGS, `cast_bytes`): 'torchao' (the plan's fp8_recipe: meshtron's runtime),
    'torchao-rowwise' / 'torchao-tensorwise' (torchtitan's float8 converter), 'te-delayed' /
    'te-current' (Transformer Engine under Megatron-Core)."""
    fp8_gemm: str = "cublas"
    """With dtype fp8, the FP8 GEMM kernels' scaling (FP8_GEMMS): 'cublas' (per-tensor or
    per-row scales in the epilogue: Transformer Engine, torchao, meshtron) or 'blockwise'
    (DeepSeek-V3's fine-grained 1x128 / 128x128 scales promoted every 128 k-elements), which
    sets how the GEMM saturates (planner/gemm.py, `fp8_tile_scale`)."""
    fp8_split_accum_bwd: bool = True
    """With dtype fp8, a Linear's input- and weight-gradient GEMMs accumulate without fast
    accumulation, and only its forward GEMM with it. On Hopper the FP8 tensor cores keep
    about 14 bits of the accumulator (DeepSeek-V3 report, section 3.3.2), so a kernel
    without fast accumulation (cuBLASLt CUBLASLT_MATMUL_DESC_FAST_ACCUM 0, Transformer
    Engine's `use_split_accumulator`) adds its partial sums into fp32 registers every few
    k-steps: the promotion blockwise kernels also make, priced the same way
    (gemm.fp8_tile_scale). torchao: Float8LinearConfig's gemm_config_output has
    use_fast_accum=True, gemm_config_grad_input / grad_weight the Float8GemmConfig default
    False, for the tensorwise and the rowwise recipe alike (torchao/float8/config.py, at
    pytorch/ao eab345c of 2024-12-23, the torchtitan benchmarks' pin, and on main; meshtron's
    runtime takes from_recipe_name's config, meshtron/parallel/fp8.py). Transformer Engine:
    pytorch/module/base.py `_2X_ACC_FPROP = False`, `_2X_ACC_DGRAD = True`,
    `_2X_ACC_WGRAD = True`, passed as use_split_accumulator to the dgrad / wgrad GEMMs of
    Linear, LayerNormLinear and LayerNormMLP. False: all three with fast accumulation (a
    Float8LinearConfig built with use_fast_accum=True for every GEMM)."""
    separate_projections: bool = True
    """The blocks' q/k/v projections and SwiGLU's gate and up projections are separate
    nn.Linear modules, each its own GEMM (meshtron's runtime, meshtron/model/transformer.py;
    torchtitan's Llama, torchtitan/models/llama/model.py Attention.wq/wk/wv and
    FeedForward.w1/w3, 2024-25; Hugging Face Llama's q/k/v_proj, gate/up_proj): at tp = 8 on a
    GQA model wk and wv are GEMMs only kv_dim / tp wide (128 columns for Llama 3 405B), priced
    by the same shape model (compute.layer_cost). False: one fused GEMM per group
    (Megatron-LM's query_key_value and Megatron-Core's linear_qkv / linear_fc1,
    Megatron-DeepSpeed's GPT, MPT's Wqkv)."""
    fp8_param_gather: bool = False
    """With dtype fp8, the FP8 Linears' weights are kept as Transformer Engine FP8 tensors and
    the parameter all-gathers move them at 1 byte per element (Megatron-Core's
    `--fp8-param-gather`, DistributedDataParallelConfig.fp8_param_gather, default False: the
    distributed optimizer and Megatron-FSDP quantise the updated shard, then gather FP8;
    Megatron-Bridge's bf16_with_fp8_current_scaling_mixed precision config, which its
    performance recipes' 'fp8_cs' use, sets it True). torchao's FSDP2 float8 all-gather is
    not this option: planner/fp8.py `fp8_gathers_fp8`. Dense models only (dp_cost.py)."""
    list_collectives: bool = False
    """ZeRO-3 collectives through list-of-tensors APIs with staging copies (DeepSpeed 0.3.x on
    PyTorch <= 1.10: each parameter's gather buffer is zero-filled, torch.distributed.all_gather
    into a list gathers into a flat buffer and copies every chunk out, reduce_scatter from a list
    flattens its input first, after stage3.py average_tensor has divided every gradient in
    place): 3 extra HBM bytes per gathered byte, 4 per reduce-scattered byte;
    and the fetch reads every gathered parameter once more after its synchronisation (the debug
    message of stage3.py fetch_sub_module, 0.3.13-0.5.10, formats `param.norm()` whether or not it
    prints), a host-side Python loop over the ranks (dp_cost.LIST_HOST_S_PER_RANK)."""
    sharding: str = "fsdp"
    """How ZeRO stages 0-2 run. 'fsdp' (meshtron's runtime on FSDP2, torchtitan, llm-foundry):
    one collective per FSDP unit (embedding, blocks, [norm, head]); ZeRO-0/1 reduce once per
    step, ZeRO-1 as reduce-scatter + all-gather in the compute dtype; ZeRO-2 gathers each unit
    once per step and reduce-scatters per micro-batch (parallel/data_parallel.py; the list
    planner/collectives.py `step_collectives` counts). 'zero' (DeepSpeed, Megatron's
    distributed optimizer): gradients accumulate locally and are reduced once per step,
    ZeRO-1/2 reduce-scatter them and all-gather the updated bf16 weights once."""
    fp32_params_autocast: bool = False
    """Parameters stay fp32 and autocast casts each weight to bf16 in every forward (Composer's
    FSDP mixed precision 'DEFAULT' of v0.12-v0.13, December 2022 to March 2023: param_dtype
    fp32, reduce_dtype bf16; composer#2047 made it param_dtype bf16): ZeRO-3 gathers 4
    bytes per parameter, and each forward (recomputed ones too) reads 4 and writes 2 bytes per
    local weight."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives overlap the GEMMs they feed or follow (Megatron-Core with
    Transformer Engine `--tp-comm-overlap`: userbuffers pipelining of the sequence-parallel
    all-gather / reduce-scatter with chunks of the column/row-parallel GEMM). Needs sequence
    parallelism; each collective against its own GEMM only, as TE's methods run it
    (`tp_exposed`)."""
    async_tp: bool = False
    """PyTorch asynchronous TP (plan.async_tp; Wang et al., "[Distributed w/ TorchTitan]
    Introducing Async Tensor Parallelism in PyTorch", PyTorch dev-discuss 2024): inductor
    decomposes each sequence-parallel all-gather + matmul (and matmul + reduce-scatter) into tp
    chunks over symmetric memory; the local shard's chunk computes while the next shard
    arrives, so the transfers hide behind (tp-1)/tp of the GEMMs (the last chunk's product has
    nothing left to hide). The post measured ~8% end-to-end (up to 29% on the forward) for
    Llama 3 8B/70B on H100. Needs sequence parallelism; each collective against the chunks of
    its own GEMM, run one after another at tokens/tp rows (`tp_exposed`), OVERLAP_INTERFERENCE
    of the hidden part (its copy-engine transfers avoid SM contention but still share HBM)."""
    cp_overlap: bool = False
    """Context parallelism: the K/V exchange of each layer overlaps the attention of the chunks
    already received (Megatron-Core / Transformer Engine ring attention with p2p; torch's
    ring rotation). False (meshtron's runtime, meshtron/parallel/context.py): K/V are
    all-gathered before attention and its gradients reduce-scattered after it, exposed, and
    the gathered K/V are kept for backward (memory.gathered_kv_bytes)."""
    complex_rope: bool = False
    """Rotary embedding as torchtitan's Llama `apply_rotary_emb` (until 2026): q and k upcast to
    fp32, multiplied by the frequencies as complex numbers (view_as_complex) and cast back
    (type_as), three kernels each. Inductor generates no code for complex tensors (it falls
    back to the ATen kernel: torch/_inductor/lowering.py `unsupported_input_tensor`, the
    warning torchtitan#15 reports), so under per-block compile this RoPE moves its eager
    bytes (elementwise.py). False: RoPE as the stack fuses it (meshtron's half-split code
    under compile, Megatron's fused kernel)."""
    torch_ring: bool = False
    """Context parallelism runs torch's experimental `context_parallel` ring attention
    (torch/distributed/tensor/experimental/_attention.py, torchtitan's CP): per-step flash calls
    with their outputs merged in fp32, the K/V all-gathered once per pass, the dk/dv partial
    sums sent around the ring in fp32 (planner/ring_attention.py prices those). False: the
    exchange priced by `cp_overlap` alone; with `cp_overlap`, Transformer Engine's p2p ring,
    whose own output corrections and gradient accumulations ring_attention.te_ring_bytes
    prices."""
    ep_overlap: bool = False
    """Expert parallelism: the token all-to-alls overlap another micro-batch's computation
    (DeepSeek's DualPipe, DeepSeek-V3 report section 3.2.1; Megatron-Core's
    overlap_moe_expert_parallel_comm). False (meshtron's runtime, torchtitan 2025): exposed
    (planner/moe_cost.py)."""
    ep_node_limit: int = 0
    """Node-limited routing with per-node deduplication: a token crosses to at most this many
    nodes, once per node (DeepSeek-V3: M = 4, with its DeepEP-style dispatch); 0: every one of
    its top_k copies travels (planner/moe_cost.py `a2a_time`)."""
    ep_dispatch: str = "bf16"
    """What the token all-to-alls toward the experts carry (EP_DISPATCHES). 'fp8': the
    forward dispatch and its backward twin toward the experts (the output gradient before the
    down-projection) send FP8 rows with 1x128 fp32 scales, the two combines stay BF16
    (DeepSeek-V3 report section 3.3.3, "Low-Precision Communication"; DeepEP's normal kernels,
    docs/legacy.md: "FP8 dispatching and BF16 combining"). Only where the expert GEMMs are FP8
    (the rows are quantised for them anyway); 'bf16': every all-to-all in the compute dtype
    (Megatron-Core's alltoall dispatcher, meshtron, torchtitan); 'deepep': DeepEP's normal
    kernels in the compute dtype, a token sent once per destination rank and node
    (planner/moe_deepep.py; NeMo AutoModel's `dispatcher: deepep`, Megatron-Core's flex
    dispatcher); 'hybridep': HybridEP's kernels, DeepEP's rows plus a routing-map all-gather
    per forward (Megatron-Core's flex dispatcher with the hybridep backend).
    planner/moe_cost.py."""
    expert_routing: str = "spread"
    """Where a token's top-k experts sit, which decides what DeepEP's deduplicated dispatch
    sends (ep_dispatch 'deepep'; planner/moe_deepep.py): 'spread' = k distinct experts
    uniform over the E (a learned router on average; Megatron-Core's force-balanced
    routing); 'contiguous' = NeMo AutoModel's fake balanced gate (FakeBalancedGate, noise 0:
    token t takes experts t k .. t k + k - 1 mod E, so a few neighbouring ranks)."""
    expert_imbalance: float = DEFAULT_IMBALANCE
    """Routed tokens on the fullest expert-parallel rank over the mean (DEFAULT_IMBALANCE
    above, priced by moe_cost.py; measured from router statistics by `meshtron calibrate`)."""
    router_dtype: str = "bf16"
    """The MoE router's gating GEMM dtype (ROUTER_DTYPES; Megatron-Core's moe_router_dtype,
    whose default runs the input's, bf16; Megatron-Bridge's and NeMo's DeepSeek-V3 recipes set
    fp32): 'fp32' prices its TF32 backward and casts over a bf16 one
    (planner/moe_router.py)."""
    expert_capacity: float = 0.0
    """Token drop at this capacity factor f (Megatron-Core's moe_expert_capacity_factor;
    DeepSpeed-MoE's and GShard's capacity_factor): every expert takes at most
    C = ceil(f x T k / E) rows from each rank routing T tokens (moe_utils.py `get_capacity`);
    0: dropless, the splits the router chose. Priced (planner/moe_capacity.py): the rows the
    grouped GEMMs multiply (per GPU, at the planner's GEMM efficiency for those shapes), the
    permutations copy, the all-to-alls carry and the expert MLP's activations hold; the
    hardware FLOPs (HFU) count the rows multiplied, the model FLOPs (MFU) the routed tokens.
    Padded (`expert_capacity_pad`): every local expert multiplies C rows from each of the ep
    (x etp gathered) ranks and each rank sends C E rows, whatever the routing imbalance;
    also whether FP8 experts copy their rows into aligned buffers
    (moe_fp8.fp8_pad_passes) and that the dispatcher does not sync with the host
    (moe_host.dispatcher_syncs). Not padded: the routing imbalance capped at f, min(1, f)
    of the slots sent. meshtron's runtime drops no tokens."""
    expert_capacity_pad: bool = True
    """With `expert_capacity` > 0: pad every expert's rows to the capacity (Megatron-Core's
    moe_pad_expert_input_to_capacity, token_dispatcher.py `drop_and_pad`; DeepSpeed-MoE's
    GShard dispatch into [E, C, h]); False: drop only (Megatron-Core's capacity factor
    alone). Ignored dropless. Each stack's value is its framework preset's
    (framework_presets.py: False on the Megatron-Core presets, moe_pad_expert_input_to_capacity
    defaulting False in transformer_config.py at core_v0.12.2 and core_v0.15.0; True on
    DeepSpeed's, whose GShard dispatch always fills [E, C, h]; True, inert, on meshtron's
    dropless runtime); the dataclass default True is the DeepSpeed / GShard one."""
    p2p_overlap: bool = False
    """Pipeline transfers of the steady state overlap the chunks' compute (Megatron-Core's
    overlap_p2p_comm: on by default with the interleaved schedule, which alone supports it);
    False: each transfer waits on the critical path (batched or blocking p2p, torch's
    pipelining schedules receiving just before the compute). `pipeline.p2p_time`."""
    eager_norm: str = "aten"
    """How an eager RMSNorm runs: 'aten' (torch.nn.RMSNorm / F.rms_norm, one fused kernel
    forward and one backward on CUDA since PyTorch 2.8: aten::_fused_rms_norm, pytorch#153666;
    meshtron's model, torchtitan since March 2025, #985) or 'python' (the Llama reference
    module: fp32 cast, square, mean, rsqrt-scale, cast back, weight: five kernels; torchtitan
    before #985, Hugging Face's LlamaRMSNorm). LayerNorm is one ATen kernel either way."""
    megatron_linear: bool = False
    """Tensor-parallel linears are Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication
    (megatron/core/tensor_parallel/layers.py; Transformer Engine's Linear does the same): the
    column-parallel backward launches the input-gradient collective asynchronously beside the
    weight-gradient GEMM (all-reduce, or reduce-scatter with sequence parallelism), and with
    sequence parallelism it does not keep the gathered input: it all-gathers it again for the
    weight gradient, beside the input-gradient GEMM. False: autograd's conjugate collectives
    (DTensor, torchtitan, meshtron), each exposed, the gathered input saved."""
    optimizer: str = "fused"
    """AdamW implementation, which sets the optimizer step's HBM traffic (estimate.py):
    'fused' (one kernel reads and writes every state once: torch.optim.AdamW(fused=True) as
    meshtron/train/optim.py builds it on CUDA, torchtitan since Feb 2025 (#881), apex /
    Transformer Engine FusedAdam in Megatron, DeepSpeed's FusedAdam), 'foreach' (one pass per
    arithmetic step over all tensors at once: torch's foreach AdamW, torchtitan 2024) or
    'for-loop' (the same passes, launched tensor by tensor from a Python loop with a step
    counter read per tensor: Composer's DecoupledAdamW with FSDP's per-gradient clipping, as
    llm-foundry runs it; launch-bound on a small shard, planner/optimizer_loop.py).
    Independent of `stack`: compiling the blocks leaves the optimizer alone."""
    grad_clip: bool = True
    """Gradients are clipped by their global norm before the optimizer step (meshtron's
    optim.grad_clip 1.0, torchtitan's max_norm 1.0, Megatron-LM's --clip-grad 1.0: every default
    here): one pass reads every local gradient for the norm (torch's foreach norm, apex's
    multi_tensor_l2norm) and one scales it in place (foreach mul, multi_tensor_scale), 3
    gradient-sized passes beside the optimizer's own (estimate_stage.py `optimizer_bytes`)."""
    grad_accum_fusion: bool = False
    """The weight-gradient GEMM accumulates into the fp32 main gradient (Megatron-LM's
    --gradient-accumulation-fusion, on by default: fused_weight_gradient_mlp_cuda / Transformer
    Engine's main_grad epilogue), so accumulating micro-batch gradients costs no pass of its
    own. False: every micro-batch's gradient is added to the accumulated one by a separate
    memory-bound kernel (meshtron's BF16Compute.accumulate, FSDP2 without gradient sync, torch
    DDP's no_sync): `grad_accumulation_bytes`."""
    zero1_all_reduce: bool = False
    """Under a pipeline (pp > 1), ZeRO-1 reduces the gradients with a full all-reduce (every
    rank receives all of them, steps its shard and all-gathers the parameters), not a
    reduce-scatter: DeepSpeed's pipeline engine until v0.3.16 calls
    buffered_allreduce_fallback whatever the ZeRO stage (microsoft/DeepSpeed v0.3.15
    runtime/pipe/engine.py `_exec_reduce_grads`; v0.4.0 on: the engine's
    allreduce_gradients, ZeRO-1's reduce-scatter), and BF16_Optimizer's own ZeRO-1
    all-reduces its fp32 gradients (v0.6.5 pipe/engine.py `_bf16_reduce_grads`). Without a
    pipeline the engine's ZeRO-1 reduce-scatters (v0.3.15 runtime/engine.py
    allreduce_gradients: reduce_scatter_gradients)."""
    p2p_grads_whole: bool = False
    """With p2p_scatter_gather, the backward's gradients are still sent whole by every tensor
    rank: DeepSpeed's pipeline engine before v0.5.4 splits the activations it sends over the
    tensor group (is_pipe_partitioned = is_model_parallel) but not the gradients
    (is_grad_partitioned = False until microsoft/DeepSpeed#1407, September 2021)."""
    residual_reduce_once: bool = False
    """A parallel-residual block (ModelSpec.parallel_residual) adds its attention and MLP
    outputs before one tensor-parallel all-reduce instead of reducing each (GPT-NeoX's
    gpt_j_residual, EleutherAI/gpt-neox megatron/model/transformer.py: `residual +
    self.reduce(output)`); the backward still all-reduces both column-parallel inputs'
    gradients. False: each branch reduced (meshtron's runtime, DTensor's RowwiseParallel)."""
    score_bias_copy: bool = False
    """Unfused attention starts its scores from a materialised bias: Megatron-DeepSpeed's ALiBi
    (bigscience-workshop/Megatron-DeepSpeed megatron/model/transformer.py: torch.baddbmm(alibi,
    q, k^T, beta != 0)) makes ATen copy the broadcast bias into the [b*np, s, s] output and the
    GEMM read it back: 4 more bytes per bf16 score in each forward (none in the backward: the
    bias needs no gradient)."""
    flash_unpad: bool = False
    """The flash kernel is flash-attn's variable-length one behind `bert_padding`'s unpad / pad
    of q, k, v and the output (llm-foundry's `attn_impl: flash`, flash_attn_fn): gather /
    scatter copies and six host synchronisations per layer forward (planner/flash_unpad.py)."""
    flash_isa: str = "native"
    """Tensor-core instructions the flash kernel issues (planner/flash_isa.py FLASH_ISAS):
    'native' (the GPU's own: its core's GEMMs at the datasheet peak) or 'sm80' (Ampere's
    mma.sync only: llm-foundry's `attn_impl: triton`, the 2022 Triton kernel under
    triton-pre-mlir), which on Hopper issue at half the datasheet peak."""
    v_width: str = "padded"
    """Where V's head is narrower than Q's and K's (MLA: 128 against 192), the width the
    attention kernel runs PV (and dP, dV) at: 'padded' = V zero-padded to the q/k head size
    because the kernel takes one head size (meshtron/model/mla.py for SDPA's flash kernels,
    whose check_head_dim_size requires q, k and v alike; Hugging Face's DeepseekV3Attention
    pads V likewise when its attn_implementation is flash_attention_2); 'native' = the kernel takes its own V width
    (Transformer Engine's cuDNN fused attention under Megatron-Core's MLA, head_dim_qk /
    head_dim_v; FlashAttention-3's hdim 192/128; torchtitan's deepseek_v3 model.py, which
    hands SDPA or flex_attention V unpadded, so CUDA's SDPA takes the memory-efficient
    kernel; DeepSeek's own stack, priced as native). No effect when V is as wide as Q/K."""
    launch_blocking: bool = False
    """CUDA_LAUNCH_BLOCKING=1: every launch returns when its kernel has finished, so the host's
    issue time adds to the GPU's instead of running ahead of it (host.layer_issue). BLOOM ran so
    (bigscience-workshop/bigscience train/tr11-176B-ml README: a workaround for a hang at 40+
    nodes, "a tiny impact or no impact at all to the throughput")."""
    vocab_parallel_ce: bool = False
    """The loss is Megatron-Core's unfused VocabParallelCrossEntropy (megatron/core/
    tensor_parallel/cross_entropy.py, what Megatron-LM runs without --cross-entropy-loss-fusion,
    off by default at f2e5db402c): separate passes over the [tokens, V/tp] logits instead of
    one fused kernel (compute_edges.loss_bytes)."""
    grad_bucket_passes: int = 0
    """Reads and writes of every local gradient element that a bucketed data-parallel
    reduction makes on the compute stream before each bucket is reduced, at the gradient
    buffer's element size (dp_cost.bucket_passes_s). Megatron-LM's training loop at f2e5db402c
    builds its DDP with average_in_collective off and check_for_nan_in_grad on
    (--no-check-for-nan-in-loss-and-grad unset): start_grad_sync computes the bucket's norm
    (one read) and scales it by 1/dp in place (a read and a write): 3. NeMo 2.0 and
    Megatron-Bridge average in the collective and skip the check: 0."""
    flash_ce: bool = False
    """The loss is flash-attn's fused cross-entropy (flash_attn/losses/cross_entropy.py: the
    Triton kernels of flash_attn/ops/triton/cross_entropy.py in 2.4.2, xentropy_cuda_lib in
    1.0.9), llm-foundry's `loss_fn: fused_crossentropy`: the forward reads the 16-bit logits
    once and keeps only one loss and one log-sum-exp per token, the backward reads them again
    and writes their gradient (2 and 2 + 2 bytes per logit, compute_edges.loss_bytes). False:
    the stack's own loss (eager PyTorch's fp32 cast and log-softmax, or a fused one)."""
    flat_param: bool = False
    """FSDP runs as PyTorch's FSDP1 FlatParameter (torch <= 2.3 FullyShardedDataParallel, which
    Composer wraps: llm-foundry): each unit's all-gather writes straight into the padded
    unsharded flat parameter, of which the original parameters are views
    (torch/distributed/fsdp/flat_param.py `_all_gather_flat_param`, `_use_unsharded_views`,
    torch 2.1): no copy-out per gather. In the backward the views' gradients reach the flat
    parameter through the split's backward, a cat of the unit's gradients into one flat
    gradient: one read and one write of every unsharded element per micro-batch
    (dp_cost.copy_out_s's bytes, once per backward instead of once per gather). False:
    FSDP2's per-parameter DTensors and their copy-out."""
    fp8_fsdp_gather: bool = False
    """With dtype fp8 and fp8_scaling 'torchao-tensorwise' under FSDP (sharding 'fsdp'), torchao's
    Float8LinearConfig enable_fsdp_float8_all_gather is on: FSDP2 gathers the FP8 Linears'
    weights in FP8, 1 byte per element (planner/fp8.py `fp8_gathers_fp8`; OLMo-core's
    Float8Config sets it True by default, src/olmo_core/float8.py at 41400c46fc; torchtitan's
    float8 config leaves it False). The 'torchao' scaling (meshtron's runtime) decides it by
    itself from the recipe; no effect on any other scaling."""
    z_loss: bool = False
    """The loss adds the z-loss (a multiple of each token's log-sum-exp squared, PaLM's
    auxiliary loss) as OLMo-core's trainer computes it when z_loss_multiplier is set
    (allenai/OLMo-core 41400c46fc, src/olmo_core/train/trainer.py get_losses;
    nn/functional/cross_entropy_loss.py). With the stack's own loss (flash_ce False) it is a
    separate `logits.logsumexp(-1)` over the fp32 logits and its backward, whose gradient is
    added to the cross-entropy's (compute_edges.Z_LOSS_BYTES); inside flash-attn's fused
    kernel (flash_ce, lse_square_scale) it reuses the kernel's log-sum-exp: no pass of its
    own."""
    logits_fp32: bool = False
    """The model hands the loss its logits cast to fp32 (OLMo-core nn/transformer/model.py
    Transformer.forward, `self.w_out(h).float()`, at 8c03ca8a21 and 41400c46fc): a fused loss
    (flash_ce) then reads them and writes their gradient at 4 bytes per logit, after the cast
    forward (2 + 4) and before the gradient's cast back (4 + 2): compute_edges.
    FLASH_CE_FP32_BYTES. The eager loss casts to fp32 anyway (its bytes already hold the
    cast): no change there."""
    train_metrics: int = 0
    """Cross-entropy train metrics Composer updates on the whole logits after every
    micro-batch's backward and synchronises over the world at every step's end
    (planner/composer_metrics.py): llm-foundry's ComposerMPTCausalLM has 2
    (LanguageCrossEntropy, LanguagePerplexity). 0: none (every other stack)."""

    @property
    def head_stack(self) -> str:
        """The stack the final norm + head + loss are priced with: per-block torch.compile
        ('compiled') fuses inside the blocks only, the head and the loss stay eager."""
        return "eager" if self.stack == "compiled" else self.stack

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES:
            value = getattr(self, name)
            if value not in allowed:
                raise UserError(f"{name}={value!r}: allowed values are {', '.join(allowed)}")
        if self.fp8_param_gather and not self.fp8_scaling.startswith("te-"):
            raise UserError(f"fp8_param_gather=True with fp8_scaling={self.fp8_scaling!r}: "
                             "Transformer Engine's FP8 parameters need fp8_scaling te-delayed "
                             "or te-current (torchao gathers FP8 by itself for tensorwise)")
        pre = self.prefetch_params
        if pre is not None and (isinstance(pre, bool) or not isinstance(pre, (int, float))
                                or pre < 0):
            raise UserError(f"prefetch_params={pre!r}: must be None or a number >= 0")
        live = self.max_live_params
        if live is not None and (isinstance(live, bool) or not isinstance(live, (int, float))
                                 or live <= 0):
            raise UserError(f"max_live_params={live!r}: must be None or a number > 0")
        ru = self.reduce_units_per_layer
        if ru is not None and (isinstance(ru, bool) or not isinstance(ru, int) or ru < 1):
            raise UserError(f"reduce_units_per_layer={ru!r}: must be None or a positive integer")
        im = self.expert_imbalance
        if isinstance(im, bool) or not isinstance(im, (int, float)) or not 1.0 <= im <= 64.0:
            raise UserError(f"expert_imbalance={im!r}: must be a number from 1 (balanced) to 64")
        cap = self.expert_capacity
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 <= cap <= 64:
            raise UserError(f"expert_capacity={cap!r}: must be a number from 0 (dropless) to 64")
        if not isinstance(self.expert_capacity_pad, bool):
            raise UserError(f"expert_capacity_pad={self.expert_capacity_pad!r}: must be true "
                             "or false")
        if cap and self.expert_capacity_pad and self.ep_dispatch == "deepep":
            # Megatron-Core's flex dispatcher with the DeepEP backend raises on padding to
            # capacity (token_dispatcher.py, core_v0.15.0 and later: its fused dispatch sends
            # the routed rows only)
            raise UserError("expert_capacity_pad=true with ep_dispatch='deepep': DeepEP "
                            "dispatches the routed rows only (Megatron-Core refuses the pair); "
                            "allowed: expert_capacity_pad=false, or another ep_dispatch")
        nl = self.ep_node_limit
        if isinstance(nl, bool) or not isinstance(nl, int) or nl < 0:
            raise UserError(f"ep_node_limit={nl!r}: must be an integer >= 0 (0: no limit)")
        if self.flat_param and self.sharding != "fsdp":
            # the FSDP1 passes dp_cost prices (grad_prep_s, the gradient cat) are PyTorch FSDP's
            raise UserError(f"flat_param=True with sharding={self.sharding!r}: FSDP1's flat "
                             "parameters need sharding 'fsdp' (DeepSpeed and Megatron-Core "
                             "gather into the parameters' own storage)")
        tm = self.train_metrics
        if isinstance(tm, bool) or not isinstance(tm, int) or not 0 <= tm <= MAX_PASSES:
            raise UserError(f"train_metrics={tm!r}: must be an integer from 0 (none) to "
                             f"{MAX_PASSES}")
        gp = self.grad_bucket_passes
        if isinstance(gp, bool) or not isinstance(gp, int) or not 0 <= gp <= MAX_PASSES:
            raise UserError(f"grad_bucket_passes={gp!r}: must be an integer from 0 to "
                             f"{MAX_PASSES}")
        if not isinstance(self.shard_units_per_layer, int) or self.shard_units_per_layer < 1:
            raise UserError(f"shard_units_per_layer={self.shard_units_per_layer!r}: must be a "
                             "positive integer")


def compiled(opts: KernelOptions) -> KernelOptions:
    """`opts` as per-block torch.compile runs them (meshtron's --compile): an eager stack
    becomes 'compiled'; a stack that fuses already keeps its kernels."""
    return dataclasses.replace(opts, stack="compiled") if opts.stack == "eager" else opts

