"""FLOPs and time of one transformer layer (and of the embedding and LM head) on one GPU.

Counting. Model FLOPs follow `ModelSpec.flops_per_token` (6N plus the attention square; Kaplan et
al. 2020; Narayanan et al. 2021, eq. 3). Hardware FLOPs add what recomputation executes again:
full recomputation repeats every layer's forward pass (Chen et al. 2016; Narayanan et al. 2021
count it as 4x forward instead of 3x), selective recomputation repeats only the attention core
QK^T / softmax / AV (Korthikanti et al. 2022, section 5). FlashAttention's own recomputation
inside its backward kernel is not counted as hardware FLOPs, as is customary.

Timing. Each GEMM (m x k) @ (k x n) is timed with a roofline:
    t = max(2mnk / (peak * ceiling * s(m) s(n) s(k)),  2(mk + kn + mn) bytes / HBM bandwidth)
where `ceiling` is the GPU's maximum achievable matmul fraction (cluster.py) and
s(x) = x / (x + d) models tile quantisation and SM under-occupancy of small dimensions: cuBLAS
tiles are 64-256 wide, so on A100 (d = 128) a 1024-wide shard loses about 11% per small dimension
and a 128-wide one (an attention head) about half (e.g. NVIDIA's "Matrix Multiplication
Background" guide on tile and wave quantisation). d grows with the GPU's FLOP-per-byte balance
(`REFERENCE_RIDGE`): about 240 on H100, about 110 on V100. Small per-GPU shards (large tp)
therefore run less efficiently, more so on newer GPUs.
A calibrated cluster (`cluster.gemm_efficiency`, measured by `meshtron calibrate`) replaces the
ceiling and the saturation term by the measured efficiency of the nearest measured shape
(`measured_gemm_efficiency`); the bandwidth bound stays.
Backward runs two GEMMs of the forward's shape per weight (input gradient and weight gradient).
FP8 GEMMs (1-byte operands, bf16 output) run at the FP8 peak with the same model, its widths
counted as the kernels tile them: Hopper's FP8 tiles are as wide in m and n as bf16's and twice
as deep in k, the same 128 bytes per k-step (the cuBLAS kernels profiled on one H200,
bench/results/gpu_check_h200_2026-12-04.json: FP8 nvjet_sm90_qqtst_128x128_128x6 against bf16
nvjet_sm90_tst_128x256_64x4; CUTLASS's Hopper examples: 54_hopper_fp8_warp_specialized_gemm
TileShape 64x128x128 for FP8, 48_hopper_warp_specialized_gemm 128x128x32 for 4-byte TF32). Each operand byte feeds twice the FLOPs at twice the peak, so m
and n saturate at the bf16 width d (in elements); the k loop runs half the steps per element of
k for the same prologue and bf16 epilogue, so k saturates at the width the FP8 balance gives,
2d (`gemm_time` operand_bytes). Published rates agree: cuBLASLt's tensorwise FP8 GEMMs ran
1.94-2.54x bf16's on four training shapes (meta-pytorch/float8_experimental#100), where this
model gives 1.6-1.9x (bench/fp8_gemm_vs_published.py). Blockwise-scaled FP8 GEMMs
(KernelOptions.fp8_gemm 'blockwise': DeepSeek-V3's 1x128 / 128x128 scales, the partial sums
promoted to CUDA cores every 128 k-elements, its report's section 3.3.2) add that promotion
to every k-step of every output tile; DeepGEMM's published throughput (its first README table,
H800, M = 4096: 0.79-1.08 of this) matches m and n saturating at the FP8 balance's width too,
which is how they are priced (`fp8_tile_scale`).

Non-GEMM work (norms, residual adds, activation functions, rotary embedding, softmax, dropout,
casts, cross-entropy) is memory-bound: time = bytes moved / (HBM bandwidth * 0.8), 0.8 being what
streaming kernels reach (STREAM-like copy rates on A100/H100 HBM). What moves depends on the
software stack (`KernelOptions.stack`), itemised per operation in `_elementwise_bytes`:

A calibrated cluster's `elementwise_gb_per_s` (what eager RMSNorm, silu(a)*b and softmax reach on
it) replaces HBM bandwidth * 0.8 for the eager stack, and its `eager_kernel_overhead_us` replaces
the per-kernel dispatch constant below.

* 'eager' (meshtron's own runtime; plain PyTorch modules without torch.compile): every operation
  is its own kernel that reads its inputs from HBM and writes its output back. RMSNorm as written
  in Llama-style code upcasts to fp32 and runs five kernels; rotary embedding is half-split
  slicing, a negation, a concatenation, two products and a sum; SwiGLU is a SiLU kernel plus a
  product; cross-entropy upcasts the logits to fp32. Each kernel also costs the host-side
  dispatch of eager PyTorch (about 10 us per operation with autograd recording; e.g. H. He,
  "Making Deep Learning Go Brrrr From First Principles", 2022): a layer cannot run faster than
  its kernels can be issued.
* 'fused' (Megatron-LM / Transformer Engine): norms, rotary embedding, the activation and the
  bias-dropout-add are single kernels that read each input once and write each output once
  (Megatron's fused kernels, Shoeybi et al. 2019; Korthikanti et al. 2022), the loss too.
* 'compiled' (per-block torch.compile: meshtron's --compile, torchtitan's apply_compile): inside
  each block inductor fuses what 'fused' fuses, but not into its extern kernels (cuBLAS, SDPA),
  so the attention output's layout copy stays; the final norm, head and loss, the optimizer
  step and the gradient accumulation run outside the compiled blocks, eager. Compile can
  therefore save no more than the blocks' eager element-wise work and kernel issue (measured on
  one H200: 5.2% of the step, bench/results/gpu_check_h200_2026-12-04.json).

An eager RMSNorm is one ATen kernel when the model uses torch.nn.RMSNorm on PyTorch >= 2.8
(`KernelOptions.eager_norm` 'aten'); the reference module's five kernels are 'python'.

Backward moves about twice the forward's bytes (it reads the saved input and the incoming
gradient and writes the outgoing one).

Tensor-parallel collectives (`tp_exposed`): each all-gather / reduce-scatter can hide only
behind the GEMM it feeds or follows (QKV, output projection, MLP-up, MLP-down), never behind
the layer's other GEMMs: Transformer Engine's userbuffers (ring exchange on the copy engines
for the gathers, a 4-chunk pipelined reduce-scatter on 16 SMs taken from its GEMM, 'bulk'
overlaps in the backward), PyTorch async TP (tp chunks run one after another), Megatron's
linears (the input gradient reduced beside the weight-gradient GEMM, the sequence-parallel
input re-gathered beside the input-gradient GEMM), or nothing (autograd's conjugates).

Attention core: 'flash' (FlashAttention-2, Dao 2023) skips the masked half of a causal square,
keeps no s x s matrix in memory, and its backward executes 2.5x the forward's matmul FLOPs (5
GEMMs instead of 2); its GEMMs are head_dim wide, timed by the same efficiency model. 'unfused'
(Megatron-LM 2019-2022, used by the calibration runs) computes the full square with two batched
GEMMs and moves the a*s^2 score matrix through softmax (and dropout) in HBM.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, host
from meshtron.planner.placement import tp_group
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.fp8 import (  # noqa: F401  (quantisation_bytes re-exported)
    FP8_FILTERS, FP8_SCALINGS, GEMM_GROUPS, cast_bytes, fp8_fractions, fp8_input_casts,
    fp8_weight_elements, quantisation_bytes)
from meshtron.planner.overlap import (  # noqa: F401  (re-exported: one formula everywhere)
    DEFAULT_SMS, OVERLAP_INTERFERENCE, TE_UB_COMM_SMS, TE_UB_PIPELINE_SPLITS, overlapped,
    sm_count, sm_margin, tp_exposed)

SAT_DIM = 128.0
"""Half-efficiency dimension of the GEMM shape model s(x) = x / (x + d) on the reference GPU."""
REFERENCE_RIDGE = 0.80 * 312e12 / 2.039e12
"""Achieved FLOP per HBM byte of the reference GPU (A100 80GB: its matmul ceiling times peak over
bandwidth) at which SAT_DIM holds. A GEMM tile of width x reuses each operand byte in proportion
to x, so the width at which feeding the tensor cores costs as much as the math grows with the
machine balance: d = SAT_DIM * ridge / REFERENCE_RIDGE (about 240 on H100 SXM, whose peak grew
3.2x over A100 and its bandwidth 1.6x; this is why Hopper kernels use 128x256 tiles)."""
HBM_EFFICIENCY = 0.8
"""Fraction of HBM bandwidth reached by memory-bound elementwise kernels."""
BF16 = 2
"""Bytes per bf16 element."""
FP8 = 1
"""Bytes per FP8 element (e4m3 / e5m2 GEMM operands)."""
FP8_GEMMS = ("cublas", "blockwise")
"""How a stack's FP8 GEMMs scale their operands (KernelOptions.fp8_gemm): 'cublas' = one scale
per tensor or per row / column, applied in the epilogue (cuBLASLt, torch._scaled_mm:
Transformer Engine's delayed and current scaling, torchao's tensorwise and rowwise);
'blockwise' = 1x128 / 128x128 block scales promoted in the k loop (DeepSeek-V3, DeepGEMM)."""

ATTENTION_KINDS = ("flash", "unfused")
STACKS = ("eager", "fused", "compiled")
SHARDINGS = ("fsdp", "zero")
OPTIMIZERS = ("fused", "foreach")
EAGER_NORMS = ("aten", "python")
DISPATCH_S = 10e-6
"""Host-side cost of issuing one operation from Python (module docstring); fused stacks issue
fewer kernels per layer, Megatron still dispatches them from Python."""


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
    (Megatron-LM's scatter/gather, Narayanan et al. 2021, section 4.1). False: every tensor
    rank sends the whole [micro_batch*s, h] activation (DeepSpeed's pipeline engine)."""
    p2p_blocking: bool = False
    """Pipeline sends and receives are blocking steps of each stage's instruction stream
    (DeepSpeed's pipeline engine, 2021-2022): per micro-batch and direction a stage pays both its
    receive and its send. False: Megatron's batched isend/irecv, one transfer per boundary."""
    stack: str = "eager"
    """'eager' (plain PyTorch modules, meshtron's runtime), 'fused' (Megatron-LM / Transformer
    Engine fused kernels) or 'compiled' (per-block torch.compile: meshtron's --compile,
    torchtitan's apply_compile): what the memory-bound operations cost (module docstring)."""
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
    (partitioned_param_coordinator.py); 0: no prefetch (DeepSpeed 0.3's synchronous fetch)."""

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
    sets how the GEMM saturates (module docstring, `fp8_tile_scale`)."""
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
    flattens its input first): 3 extra HBM bytes per gathered byte, 2 per reduce-scattered byte."""
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
    2023 FSDP mixed precision 'DEFAULT': param_dtype fp32, reduce_dtype bf16): ZeRO-3 gathers 4
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
    ep_overlap: bool = False
    """Expert parallelism: the token all-to-alls overlap another micro-batch's computation
    (DeepSeek's DualPipe, DeepSeek-V3 report section 3.2.1; Megatron-Core's
    overlap_moe_expert_parallel_comm). False (meshtron's runtime, torchtitan 2025): exposed
    (planner/moe_cost.py)."""
    ep_node_limit: int = 0
    """Node-limited routing with per-node deduplication: a token crosses to at most this many
    nodes, once per node (DeepSeek-V3: M = 4, with its DeepEP-style dispatch); 0: every one of
    its top_k copies travels (planner/moe_cost.py `a2a_time`)."""
    expert_imbalance: float = DEFAULT_IMBALANCE
    """Routed tokens on the fullest expert-parallel rank over the mean (DEFAULT_IMBALANCE
    above, priced by moe_cost.py; measured from router statistics by `meshtron calibrate`)."""
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
    Transformer Engine FusedAdam in Megatron, DeepSpeed's FusedAdam) or 'foreach' (one pass per
    arithmetic step: torch's foreach and for-loop AdamW, torchtitan 2024, Composer's
    DecoupledAdamW). Independent of `stack`: compiling the blocks leaves the optimizer alone."""
    grad_accum_fusion: bool = False
    """The weight-gradient GEMM accumulates into the fp32 main gradient (Megatron-LM's
    --gradient-accumulation-fusion, on by default: fused_weight_gradient_mlp_cuda / Transformer
    Engine's main_grad epilogue), so accumulating micro-batch gradients costs no pass of its
    own. False: every micro-batch's gradient is added to the accumulated one by a separate
    memory-bound kernel (meshtron's BF16Compute.accumulate, FSDP2 without gradient sync, torch
    DDP's no_sync): `grad_accumulation_bytes`."""
    @property
    def head_stack(self) -> str:
        """The stack the final norm + head + loss are priced with: per-block torch.compile
        ('compiled') fuses inside the blocks only, the head and the loss stay eager."""
        return "eager" if self.stack == "compiled" else self.stack

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise UserError(f"attention={self.attention!r}: allowed values are "
                             f"{', '.join(ATTENTION_KINDS)}")
        if self.stack not in STACKS:
            raise UserError(f"stack={self.stack!r}: allowed values are {', '.join(STACKS)}")
        if self.sharding not in SHARDINGS:
            raise UserError(f"sharding={self.sharding!r}: allowed values are "
                             f"{', '.join(SHARDINGS)}")
        if self.fp8_filter not in FP8_FILTERS:
            raise UserError(f"fp8_filter={self.fp8_filter!r}: allowed values are "
                             f"{', '.join(FP8_FILTERS)}")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise UserError(f"fp8_scaling={self.fp8_scaling!r}: allowed values are "
                             f"{', '.join(FP8_SCALINGS)}")
        if self.fp8_gemm not in FP8_GEMMS:
            raise UserError(f"fp8_gemm={self.fp8_gemm!r}: allowed values are "
                             f"{', '.join(FP8_GEMMS)}")
        if self.fp8_param_gather and not self.fp8_scaling.startswith("te-"):
            raise UserError(f"fp8_param_gather=True with fp8_scaling={self.fp8_scaling!r}: "
                             "Transformer Engine's FP8 parameters need fp8_scaling te-delayed "
                             "or te-current (torchao gathers FP8 by itself for tensorwise)")
        pre = self.prefetch_params
        if pre is not None and (isinstance(pre, bool) or not isinstance(pre, (int, float))
                                or pre < 0):
            raise UserError(f"prefetch_params={pre!r}: must be None or a number >= 0")
        ru = self.reduce_units_per_layer
        if ru is not None and (isinstance(ru, bool) or not isinstance(ru, int) or ru < 1):
            raise UserError(f"reduce_units_per_layer={ru!r}: must be None or a positive integer")
        im = self.expert_imbalance
        if isinstance(im, bool) or not isinstance(im, (int, float)) or not 1.0 <= im <= 64.0:
            raise UserError(f"expert_imbalance={im!r}: must be a number from 1 (balanced) to 64")
        if self.eager_norm not in EAGER_NORMS:
            raise UserError(f"eager_norm={self.eager_norm!r}: allowed values are "
                             f"{', '.join(EAGER_NORMS)}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer={self.optimizer!r}: allowed values are "
                             f"{', '.join(OPTIMIZERS)}")
        nl = self.ep_node_limit
        if isinstance(nl, bool) or not isinstance(nl, int) or nl < 0:
            raise UserError(f"ep_node_limit={nl!r}: must be an integer >= 0 (0: no limit)")
        if not isinstance(self.shard_units_per_layer, int) or self.shard_units_per_layer < 1:
            raise UserError(f"shard_units_per_layer={self.shard_units_per_layer!r}: must be a "
                             "positive integer")


def gemm_time(m: float, n: float, k: float, peak: float, hbm: float,
              operand_bytes: float = BF16, tile_scale: float = 1.0) -> float:
    """Roofline time of an (m x k) @ (k x n) GEMM with `operand_bytes`-byte inputs (BF16, or
    FP8 at the FP8 `peak`) and a bf16 output; `peak` already includes the ceiling. The k width
    follows the machine balance at this peak; m and n saturate at `tile_scale` times it
    (`fp8_tile_scale`: FP8 / BF16 for cuBLAS's FP8 kernels, whose operand bytes feed twice a
    bf16 byte's FLOPs; 1 for bf16 and blockwise FP8; module docstring)."""
    d_k = SAT_DIM * (peak / hbm) / REFERENCE_RIDGE
    d = d_k * tile_scale
    sat = (m / (m + d)) * (n / (n + d)) * (k / (k + d_k))
    t_flops = 2.0 * m * n * k / (peak * sat)
    t_bytes = (operand_bytes * (m * k + k * n) + BF16 * m * n) / hbm
    return t_flops if t_flops > t_bytes else t_bytes


def measured_gemm_efficiency(m: float, n: float, k: float, cluster: ClusterSpec) -> float:
    """Measured fraction of peak of the calibrated shape nearest to (m, n, k).

    Nearest in log space, |log(m/m_i)| + |log(n/n_i)| + |log(k/k_i)|: what costs a GEMM its
    efficiency (tile and wave quantisation, SM occupancy, operand reuse) acts per dimension and
    multiplies (the s(m)s(n)s(k) of the analytical model), so it depends on ratios of dimensions,
    not on differences: a 512-wide shard is as far from a 1024-wide one as 4096 from 8192.
    Nearest-neighbour rather than interpolation: a measured point is never averaged with one
    that runs in a different kernel regime, and a shape in the table gets exactly its measurement.
    """
    lm, ln, lk = math.log(m), math.log(n), math.log(k)
    best = min(cluster.gemm_efficiency,
               key=lambda g: (abs(lm - math.log(g.m)) + abs(ln - math.log(g.n))
                              + abs(lk - math.log(g.k)), -g.efficiency))
    return best.efficiency


def cluster_gemm_time(m: float, n: float, k: float, cluster: ClusterSpec,
                      operand_bytes: float = BF16, tile_scale: float = 1.0) -> float:
    """Time of an (m x k) @ (k x n) GEMM on `cluster` (`operand_bytes`, `tile_scale`: BF16 and
    1, or an FP8 GEMM's on a cluster at its FP8 peak, `gemm_time`): the measured efficiency of
    the nearest calibrated shape when the cluster has a `gemm_efficiency` table (the bandwidth
    bound still applies, for shapes less arithmetic-intense than any measured), else
    `gemm_time`."""
    if cluster.gemm_efficiency is None:
        return gemm_time(m, n, k, cluster.peak_flops * cluster.matmul_ceiling,
                         cluster.hbm_bytes_per_s, operand_bytes, tile_scale)
    t_flops = 2.0 * m * n * k / (cluster.peak_flops * measured_gemm_efficiency(m, n, k, cluster))
    t_bytes = (operand_bytes * (m * k + k * n) + BF16 * m * n) / cluster.hbm_bytes_per_s
    return t_flops if t_flops > t_bytes else t_bytes


def gemm_efficiency(m: float, n: float, k: float, cluster: ClusterSpec) -> float:
    """Fraction of peak the cost model uses for one GEMM shape (for display and tests)."""
    return 2.0 * m * n * k / cluster_gemm_time(m, n, k, cluster) / cluster.peak_flops


def membound_bytes_per_s(cluster: ClusterSpec, stack: str) -> float:
    """Bandwidth memory-bound (non-matmul) kernels reach: the calibrated eager element-wise
    bandwidth for the eager stack when measured, else HBM bandwidth * HBM_EFFICIENCY (fused
    kernels are not what `meshtron calibrate` times, so they keep the streaming figure)."""
    if stack == "eager" and cluster.elementwise_gb_per_s is not None:
        return cluster.elementwise_gb_per_s * 1e9
    return cluster.hbm_bytes_per_s * HBM_EFFICIENCY


def dispatch_s(cluster: ClusterSpec) -> float:
    """Host cost of issuing one kernel in a training forward: the calibrated
    `eager_kernel_overhead_us` (a no-grad op) with autograd's recording (host.AUTOGRAD_RECORD),
    else DISPATCH_S."""
    if cluster.eager_kernel_overhead_us is not None:
        return cluster.eager_kernel_overhead_us * 1e-6 * host.AUTOGRAD_RECORD
    return DISPATCH_S


@dataclass(frozen=True)
class LayerCost:
    """Seconds one GPU spends on one transformer layer for one micro-batch."""

    fwd: float
    """Forward compute (GEMMs, attention core, memory-bound kernels)."""
    bwd: float
    """Backward compute (input and weight gradients)."""
    wgrad: float
    """Part of `bwd` that computes weight gradients (deferrable by zero-bubble schedules)."""
    core_fwd: float
    """Forward of the attention core alone (what selective recomputation repeats)."""
    tp_fwd: float
    """Tensor-parallel communication of the forward pass (2 all-reduces, or RS+AG with SP)."""
    tp_bwd: float
    """Tensor-parallel communication of the backward pass."""

    def per_microbatch(self, recompute: str, attention: str) -> tuple[float, float, float, float]:
        """(compute, tp comm, forward part, weight-grad part) of fwd+bwd with recomputation."""
        compute = self.fwd + self.bwd
        tpc = self.tp_fwd + self.tp_bwd
        if recompute in ("full", "half"):
            share = 1.0 if recompute == "full" else 0.5  # 'half': every second block
            compute += share * self.fwd
            tpc += share * self.tp_fwd
        elif recompute == "selective" and attention == "unfused":
            compute += self.core_fwd
        return compute, tpc, self.fwd + self.tp_fwd, self.wgrad


@dataclass(frozen=True)
class EdgeCost:
    """Seconds for the embedding (first stage) or the final norm + LM head + loss (last stage)."""

    compute: float
    """Forward + backward compute for one micro-batch."""
    tp: float
    """Tensor-parallel communication for one micro-batch."""
    fwd: float
    """Forward part (compute + comm) of the above."""
    wgrad: float
    """Weight-gradient part of `compute`."""


# Bytes per element read + written by one forward operation, bf16 activations (2 bytes) and fp32
# intermediates (4 bytes) where the code upcasts. Eager figures follow the operations as written
# in plain PyTorch (meshtron/model/transformer.py, torchtitan's and Hugging Face's Llama):
#   RMSNorm: cast to fp32 (2+4), square (4+4), mean (4), scale (4+4), cast back (4+2), weight (2+2)
#   LayerNorm: one ATen kernel (2+2) in both stacks
#   RoPE (q and k): negate half (1+1), concatenate (2+2), x*cos (2+2), rotated*sin (2+2), sum (4+2)
#   SwiGLU: SiLU (2+2) and product (4+2) per ffn element; fused: one kernel (4+2)
#   GeLU: one kernel (2+2) in both stacks (Megatron fuses it with the bias add)
#   residual add: (4+2) per add in both stacks (Megatron fuses bias-dropout-add: same traffic)
#   dropout: eager mask + scale kernel (2+2+1) before the add; fused: +1 byte of mask
#   head-major transposes around the attention kernel: the output copied back (2+2) in eager
#   compiled (per-block torch.compile): inductor fuses each chain of pointwise ops and the norm
#   reductions into single kernels, as 'fused'; it cannot fuse into the extern kernels (cuBLAS
#   GEMMs, the SDPA kernel), so the attention output's head-major -> token-major copy stays
#   (2+2), and everything outside the compiled blocks (final norm, head, loss) is eager
_NORM_BYTES = {("eager", "rmsnorm"): 36.0, ("fused", "rmsnorm"): 4.0,
               ("eager", "layernorm"): 4.0, ("fused", "layernorm"): 4.0,
               ("compiled", "rmsnorm"): 4.0, ("compiled", "layernorm"): 4.0}
_NORM_KERNELS = {("eager", "rmsnorm"): 6, ("fused", "rmsnorm"): 1,
                 ("eager", "layernorm"): 1, ("fused", "layernorm"): 1,
                 ("compiled", "rmsnorm"): 1, ("compiled", "layernorm"): 1}
_ROPE_BYTES = {"eager": 20.0, "fused": 4.0, "compiled": 4.0}
_SWIGLU_BYTES = {"eager": 10.0, "fused": 6.0, "compiled": 6.0}


def norm_key(stack: str, eager_norm: str, norm: str) -> tuple[str, str]:
    """The `_NORM_BYTES` / `_NORM_KERNELS` entry of a norm: an eager RMSNorm through ATen's
    fused kernel (KernelOptions.eager_norm 'aten') moves what a fused one does."""
    if stack == "eager" and eager_norm == "aten":
        return ("fused", norm)
    return (stack, norm)


def _elementwise_bytes(model: ModelSpec, tp: int, sp: bool, opts: KernelOptions) -> float:
    """HBM bytes moved per token by one layer's memory-bound kernels in the forward pass.

    Per operation as in the table above. Replicated across tensor-parallel ranks unless sequence
    parallelism shards them (Korthikanti et al. 2022, section 4.2.2): the two norms, the two
    residual adds and the hidden dropouts. Sharded by tp: rotary embedding of q and k, the MLP
    activation and the attention-output copy. The unfused attention's softmax/dropout traffic is
    counted with the attention core in `layer_cost`; GEMM inputs and outputs are part of the GEMM
    roofline, not counted here.
    """
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    st = opts.stack
    replicated = 2 * _NORM_BYTES[norm_key(st, opts.eager_norm, model.norm)] * h + 2 * 6.0 * h
    if opts.dropout:
        replicated += 2 * (5.0 if st == "eager" else 1.0) * h
    sharded = _ROPE_BYTES[st] * (h + kv) if model.position == "rope" else 0.0
    sharded += (_SWIGLU_BYTES[st] if model.mlp == "swiglu" else 4.0) * f
    if st in ("eager", "compiled"):  # the attention output's layout copy (table above)
        sharded += 4.0 * h
    return (replicated / tp if sp else replicated) + sharded / tp


def kernels_per_layer(model: ModelSpec, opts: KernelOptions) -> int:
    """Kernels one layer's forward issues (GEMMs, attention, memory-bound operations). The
    eager count is what meshtron's Block launches, counted from its code path by
    bench/host_kernel_count.py (tests/test_planner_host.py checks it): eager RoPE is, per q
    and k, two casts of the cos/sin tables to the activation dtype, a negation, a
    concatenation, two products and a sum; the flash kernel's output is already token-major,
    so its transpose + reshape launches nothing in eager code."""
    st = opts.stack
    n = 2 * _NORM_KERNELS[norm_key(st, opts.eager_norm, model.norm)] + 2  # norms, residual adds
    n += (3 if model.mlp == "swiglu" else 2) + 4  # MLP and attention linears (q, k, v, out)
    n += 1 if opts.attention == "flash" else 4  # flash kernel, or QK^T, softmax, (dropout), AV
    if model.position == "rope":
        n += 14 if st == "eager" else 1
    if st == "compiled" or (st == "eager" and opts.attention != "flash"):
        n += 1  # attention-output copy
    if st == "eager":
        n += 2 if model.mlp == "swiglu" else 1  # activation (+ product)
        n += 2 if opts.dropout else 0
    return n


def compiled(opts: KernelOptions) -> KernelOptions:
    """`opts` as per-block torch.compile runs them (meshtron's --compile): an eager stack
    becomes 'compiled'; a stack that fuses already keeps its kernels."""
    return dataclasses.replace(opts, stack="compiled") if opts.stack == "eager" else opts


def fp8_tile_scale(opts: KernelOptions) -> float:
    """Saturation width of an FP8 GEMM's m and n over its k width (`gemm_time` tile_scale):
    FP8 / BF16 for cuBLAS's per-tensor / per-row scaled kernels (their tiles are bf16's, fed at
    half the bytes), 1 for blockwise scaling (the per-128-k promotion on CUDA cores: DeepGEMM's
    published throughput, module docstring)."""
    return 1.0 if opts.fp8_gemm == "blockwise" else FP8 / BF16


def compute_dtypes(dtype: str) -> tuple[str, str]:
    """(dtype of the blocks' linear GEMMs, dtype of everything else): FP8 recipes (Transformer
    Engine's fp8_autocast around the blocks' Linear layers, torchao float8 on nn.Linear in the
    blocks) keep the attention core, the output head and the small GEMMs in bf16."""
    if dtype == "fp8":
        return "fp8", "bf16"
    return dtype, dtype


def fp8_step_cast_s(model: ModelSpec, cluster: ClusterSpec, tp: int, opts: KernelOptions,
                    fp8_frac: tuple[float, ...], recipe: str = "rowwise") -> float:
    """Seconds per layer and optimizer step casting the FP8 weights once (Transformer Engine's
    weight cache, CastBytes.weight_step; zero for torchao, which casts every micro-batch)."""
    cb = cast_bytes(opts.fp8_scaling, recipe, opts.stack == "compiled")
    if not cb.weight_step:
        return 0.0
    frac = dict(zip(GEMM_GROUPS, fp8_frac))
    cl = cluster.at_dtype("bf16")
    return cb.weight_step * fp8_weight_elements(model, tp, frac) / membound_bytes_per_s(
        cl, opts.stack)


@lru_cache(maxsize=4096)
def layer_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
               sp: bool, opts: KernelOptions, cp: int = 1, dtype: str = "bf16",
               fp8_frac: tuple[float, ...] | None = None,
               fp8_recipe: str = "rowwise") -> LayerCost:
    """Per-GPU time of one layer for one micro-batch of `micro_batch` sequences of `seq` tokens,
    a 1/cp slice of each sequence's tokens on this rank (context parallelism), GEMMs at the
    peak of `dtype` (cluster.at_dtype; fp8: the block GEMMs whose Linears pass the runtime's
    rule, planner/fp8.py `fp8_linear`, the rest in bf16, see compute_dtypes). `fp8_frac`: the
    FP8 share of each GEMM group (planner/fp8.py GEMM_GROUPS, `fp8_fractions` of the real
    model: `model` may be a mixture's active equivalent, whose averaged width is no Linear's);
    None: from `model` with torchao's thresholds (opts.fp8_filter). `fp8_recipe`: the plan's
    torchao recipe (what opts.fp8_scaling 'torchao' casts with)."""
    lin_dt, other_dt = compute_dtypes(dtype)
    lin_cl, cluster = cluster.at_dtype(lin_dt), cluster.at_dtype(other_dt)
    bw = membound_bytes_per_s(cluster, opts.stack)
    tokens = micro_batch * seq / cp
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    up = 2 * f if model.mlp == "swiglu" else f
    # Megatron tensor parallelism (Shoeybi et al. 2019): QKV and MLP-up split by columns,
    # attention output and MLP-down split by rows.
    frac = None
    if lin_dt == "fp8":
        frac = (dict(zip(GEMM_GROUPS, fp8_frac)) if fp8_frac is not None
                else fp8_fractions(model, tp, fp8_recipe, opts.fp8_filter))
    shapes = {"qkv": ((h + 2 * kv) / tp, h, True), "out": (h, h / tp, False),
              "up": (up / tp, h, True), "down": (h, f / tp, False)}

    def gemm(group: str, rows: float = tokens) -> float:
        n, k, split = shapes[group]
        return _gemm_group(rows, n, k, lin_cl, cluster, frac, group, split, fp8_kernel)
    fp8_kernel = (FP8, fp8_tile_scale(opts)) if lin_dt == "fp8" else (BF16, 1.0)
    gemms = {g: gemm(g) for g in shapes}
    linear = sum(gemms.values())
    heads_local = model.heads / tp
    hd = model.head_dim
    batch_heads = micro_batch * heads_local
    q_len = seq / cp  # each context rank's queries attend to the whole (causal) sequence
    if opts.attention == "flash":
        # Causal FlashAttention computes about half the square; per head: QK^T and PV (with
        # context parallelism the load-balanced split gives every rank 1/cp of the square).
        one = (cluster_gemm_time(q_len, seq, hd, cluster)
               + cluster_gemm_time(q_len, hd, seq, cluster))
        core_fwd = 0.5 * batch_heads * one
        core_bwd = 2.5 * core_fwd
    else:
        one = (cluster_gemm_time(q_len, seq, hd, cluster)
               + cluster_gemm_time(q_len, hd, seq, cluster))
        core_fwd = batch_heads * one
        # Score matrix through the fused scale-mask-softmax kernel, per token and local head:
        # read + write 2s bytes each = 4s; with dropout a separate kernel reads the
        # probabilities, writes the dropped copy and a 1-byte mask: +5s (the tensors of
        # Korthikanti et al. 2022's activation list). Eager code masks in a kernel of its own
        # before the softmax: +4s. The GEMMs' own reads and writes of the scores are in their
        # roofline.
        per_score = (9 if opts.dropout else 4) + (4 if opts.stack == "eager" else 0)
        score_bytes = per_score * heads_local * seq * tokens
        core_fwd += score_bytes / bw
        core_bwd = 2.0 * core_fwd
    elementwise = tokens * _elementwise_bytes(model, tp, sp, opts) / bw
    q_f = q_b = 0.0
    if lin_dt == "fp8":
        # casts of activations (per token) and of the local weights (torchao: each
        # micro-batch, forward and transposed for the input gradient, and rowwise's pass over
        # the weight gradient; Transformer Engine: once per step, fp8_step_cast_s)
        cb = cast_bytes(opts.fp8_scaling, fp8_recipe, opts.stack == "compiled")
        weights = fp8_weight_elements(model, tp, frac)
        casts = fp8_input_casts(model, tp, fp8_recipe, opts.fp8_filter) if cb.per_linear \
            else None
        per_tok_f, per_tok_b = quantisation_bytes(model, tp, frac, cb, casts, sp)
        q_f = (tokens * per_tok_f + cb.weight_fwd * weights) / bw
        q_b = (tokens * per_tok_b + (cb.weight_bwd + cb.wgrad_out) * weights) / bw
    if opts.fp32_params_autocast:
        weights = (h * (h + 2 * kv) + h * h + h * (up + f)) / tp
        elementwise += 6.0 * weights / bw
    fwd = linear + core_fwd + elementwise + q_f
    bwd = 2.0 * linear + core_bwd + 2.0 * elementwise + q_b
    # Tensor-parallel communication: 2 all-reduces of the [tokens, h] activation per pass
    # (Shoeybi et al. 2019, fig. 4); with sequence parallelism each becomes a reduce-scatter plus
    # an all-gather of the same total volume (Korthikanti et al. 2022, section 4.2.2). Which
    # GEMM each collective can hide behind: `tp_exposed`.
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    act_bytes = (4.0 if dtype == "fp32" else BF16) * tokens * h
    # FP8 recipes cast a column-parallel GEMM's input before gathering it (Transformer
    # Engine's fp8_buf userbuffers, torchao's Float8ColwiseParallel): 1 byte per element
    in_bytes = tokens * h if lin_dt == "fp8" else act_bytes
    colls = {"ag": comm.all_gather(act_bytes, group, fab),
             "ag_in": comm.all_gather(in_bytes, group, fab),
             "rs": comm.reduce_scatter(act_bytes, group, fab),
             "ar": comm.all_reduce(act_bytes, group, fab)}
    tp_f, tp_b = (tp_exposed(colls, gemms, gemm, tokens, tp, sp, opts, sm_count(cluster),
                             host.sm_interference(cluster, group.nodes > 1))
                  if tp > 1 else (0.0, 0.0))
    if cp > 1:
        # K/V of the local tokens travel to the other cp-1 ranks (ring: cp-1 p2p steps of the
        # local K/V chunk; all-gather: the same volume), their gradients come back in the
        # backward (Liu et al. 2023 "Ring Attention"; Megatron-Core context parallelism docs)
        kv_bytes = (4.0 if dtype == "fp32" else BF16) * tokens * 2 * kv / tp
        cpg = cp_group(tp, cp, cluster.gpus_per_node)
        cp_f = comm.all_gather(kv_bytes * cp, cpg, fab)
        cp_b = comm.reduce_scatter(kv_bytes * cp, cpg, fab)
        if opts.cp_overlap:
            nccl = host.sm_interference(cluster, cpg.nodes > 1)
            cp_f, cp_b = overlapped(cp_f, core_fwd, nccl), overlapped(cp_b, core_bwd, nccl)
        tp_f, tp_b = tp_f + cp_f, tp_b + cp_b
    # the host launches every kernel and collective: where they are shorter than their launches
    # the GPU waits on it (planner/host.py), over the layer's compute and exposed communication
    issue_f, issue_b = host.layer_issue(kernels_per_layer(model, opts),
                                        host.tp_collectives(tp, sp) + (2 if cp > 1 else 0),
                                        dispatch_s(cluster))
    fwd += host.launch_bound(fwd + tp_f, issue_f)
    bwd += host.launch_bound(bwd + tp_b, issue_b)
    return LayerCost(fwd=fwd, bwd=bwd, wgrad=linear, core_fwd=core_fwd,
                     tp_fwd=tp_f, tp_bwd=tp_b)


def _gemm_group(tokens: float, n: float, k: float, fp8_cl: ClusterSpec, bf16_cl: ClusterSpec,
                frac: dict[str, float] | None, group: str, split_n: bool,
                kernel: tuple[float, float] = (BF16, 1.0)) -> float:
    """One fused block GEMM [tokens, k] x [k, n]: at `fp8_cl`'s peak with `kernel` =
    (operand bytes, tile scale) (`gemm_time`; FP8's for dtype fp8) when `frac` is None (or all
    of its Linears are FP8), else split into its FP8 and bf16 parts (along n for the
    column-parallel fused QKV / MLP-up, whole for the single-Linear groups)."""
    f = 1.0 if frac is None else frac[group]
    if f >= 1.0:
        return cluster_gemm_time(tokens, n, k, fp8_cl, *kernel)
    if f <= 0.0:
        return cluster_gemm_time(tokens, n, k, bf16_cl)
    if not split_n:  # pragma: no cover - a one-Linear group is all or nothing
        raise AssertionError(group)
    return (cluster_gemm_time(tokens, n * f, k, fp8_cl, *kernel)
            + cluster_gemm_time(tokens, n * (1.0 - f), k, bf16_cl))


def cp_group(tp: int, cp: int, gpus_per_node: int) -> comm.Group:
    """The context-parallel Group: cp ranks tp apart (mesh order ..., "cp", "tp")."""
    from meshtron.planner.placement import MESH_AXES_CP, Placement

    return Placement(MESH_AXES_CP, (1, 1, 1, cp, tp), gpus_per_node).group("cp")


@lru_cache(maxsize=4096)
def head_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
              sp: bool, stack: str = "fused", cp: int = 1, dtype: str = "bf16",
              eager_norm: str = "aten") -> EdgeCost:
    """Final norm + vocabulary-parallel LM head + cross-entropy for one micro-batch.

    The head GEMM is [tokens, h] x [h, V/tp]; the fused loss reads bf16 logits and writes fp32
    probabilities (6 bytes per logit) forward, and the reverse backward; eager PyTorch casts the
    logits to fp32 (2+4), runs log-softmax (4+4) and, backward, its gradient (4+4+4) and the cast
    back (4+2): 14 bytes per logit forward, 18 backward (Megatron's
    vocab-parallel cross-entropy; only 3 floats per token cross the tensor group, in three
    fp32 all-reduces: max logit, target logit, sum of exponentials).

    Tensor-parallel traffic of the head's input (Shoeybi et al. 2019, the f/g operators;
    Korthikanti et al. 2022, section 4.2.2): without sequence parallelism the replicated input
    enters the vocabulary-parallel GEMM through an identity whose backward all-reduces the
    input gradient [tokens, h]; with it, the sequence-sharded input is all-gathered forward and
    its gradient reduce-scattered backward.

    With context parallelism a rank holds 1/cp of the tokens; FP8 recipes keep the head in bf16.
    """
    cluster = cluster.at_dtype(compute_dtypes(dtype)[1])
    hbm = membound_bytes_per_s(cluster, stack)
    tokens = micro_batch * seq / cp
    gemm = cluster_gemm_time(tokens, model.vocab / tp, model.hidden, cluster)
    logits = tokens * model.vocab / tp
    loss_f, loss_b = (14.0, 18.0) if stack == "eager" else (6.0, 6.0)
    norm_b = _NORM_BYTES[norm_key(stack, eager_norm, model.norm)]
    norm = tokens * norm_b * model.hidden / (tp if sp else 1) / hbm
    fwd_c = gemm + logits * loss_f / hbm + norm
    compute = fwd_c + 2 * gemm + logits * loss_b / hbm + 2 * norm
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    nbytes = BF16 * tokens * model.hidden
    loss_ar = 3 * comm.all_reduce(4.0 * tokens, group, fab)
    if sp:
        tp_f = comm.all_gather(nbytes, group, fab) + loss_ar
        tp_b = comm.reduce_scatter(nbytes, group, fab)
    else:
        tp_f = loss_ar
        tp_b = comm.all_reduce(nbytes, group, fab)
    # launches (planner/host.py): the norm, the head GEMM and the loss (eager: cast,
    # log-softmax, target gather, mean; fused: one kernel), the loss's all-reduces with tp
    kernels = (_NORM_KERNELS[norm_key(stack, eager_norm, model.norm)] + 1
               + (4 if stack == "eager" else 1))
    colls = (3 if tp > 1 else 0) + (1 if sp and tp > 1 else 0)
    issue_f, issue_b = host.layer_issue(kernels, colls, dispatch_s(cluster))
    wait_f = host.launch_bound(fwd_c + tp_f, issue_f)
    wait_b = host.launch_bound(compute - fwd_c + tp_b, issue_b)
    fwd_c += wait_f
    compute += wait_f + wait_b
    return EdgeCost(compute=compute, tp=tp_f + tp_b, fwd=fwd_c + tp_f, wgrad=gemm)


@lru_cache(maxsize=4096)
def chunked_loss_extra(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, seq: int,
                       cp: int = 1, dtype: str = "bf16", stack: str = "eager") -> float:
    """Seconds meshtron's chunked cross-entropy (meshtron/model/loss.py, tp = 1 without a
    pipeline) adds to `head_cost` per micro-batch. It runs the head and the loss on chunks of
    tokens/ceil(vocab/hidden) tokens under activation checkpointing, so the backward (1)
    replays each chunk's head GEMM and loss forward, (2) computes the head's weight gradient
    chunk by chunk, a [vocab, hidden] product over only `chunk` tokens each (bound by writing
    its output), and (3) autograd sums the chunks' weight gradients, one add of a
    [vocab, hidden] tensor per chunk after the first (read both, write the sum)."""
    cl = cluster.at_dtype(compute_dtypes(dtype)[1])
    hbm = membound_bytes_per_s(cl, stack)
    tokens = micro_batch * seq / cp
    v, h = model.vocab, model.hidden
    chunk = math.ceil(tokens / math.ceil(v / h))
    chunks = math.ceil(tokens / chunk)
    replay = cluster_gemm_time(tokens, v, h, cl) + tokens * v * (
        14.0 if stack == "eager" else 6.0) / hbm
    wgrad = chunks * cluster_gemm_time(v, h, chunk, cl) - cluster_gemm_time(v, h, tokens, cl)
    elem = 4.0 if dtype == "fp32" else BF16
    grad_sum = (chunks - 1) * 3.0 * elem * v * h / (cl.hbm_bytes_per_s * HBM_EFFICIENCY)
    return replay + max(0.0, wgrad) + grad_sum


@lru_cache(maxsize=4096)
def embedding_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
                   sp: bool, cp: int = 1) -> EdgeCost:
    """Vocabulary-parallel embedding lookup: write [tokens, h] forward, scatter-add backward,
    plus the all-reduce (reduce-scatter with SP) that combines the vocabulary shards forward;
    with SP the backward all-gathers the sequence-sharded gradient (the conjugate of the
    reduce-scatter, Korthikanti et al. 2022, section 4.2.2), without it the backward is local."""
    hbm = cluster.hbm_bytes_per_s * HBM_EFFICIENCY
    tokens = micro_batch * seq / cp
    nbytes = BF16 * tokens * model.hidden
    compute = 3 * nbytes / hbm
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    if sp:
        tp_f = comm.reduce_scatter(nbytes, group, fab)
        tp_b = comm.all_gather(nbytes, group, fab)
    else:
        tp_f, tp_b = comm.all_reduce(nbytes, group, fab), 0.0
    return EdgeCost(compute=compute, tp=tp_f + tp_b, fwd=nbytes / hbm + tp_f, wgrad=0.0)


def active_equivalent(model: ModelSpec) -> ModelSpec:
    """The dense model that computes what a token of `model` computes: a mixture of experts
    becomes one SwiGLU per block of the mean active width (top_k routed experts + shared
    experts, the router's E outputs as E/3 more columns of the three GEMMs: same FLOPs), so
    GEMM time, memory-bound traffic and saved activations count active parameters only
    (memory counts all of them: `memory.layer_params_local`). What the experts cost beyond
    it (grouped GEMMs of the per-expert rows, permutation copies, routing imbalance, the
    expert-parallel all-to-alls) is planner/moe_cost.py's. A dense model is returned
    unchanged."""
    if not model.is_moe:
        return model
    moe = (model.moe_top_k + model.moe_shared_experts) * model.moe_ffn_hidden \
        + model.moe_experts / 3.0
    width = (model.moe_dense_layers * model.ffn_hidden + model.moe_layers * moe) / model.layers
    return model.replace(ffn_hidden=max(1, round(width)), mlp="swiglu", moe_experts=0,
                         moe_top_k=0, moe_ffn_hidden=0, moe_shared_experts=0,
                         moe_dense_layers=0, moe_aux_loss=0.0, moe_bias_update=0.0)


def model_flops_per_step(model: ModelSpec, tokens: float, seq: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recomputation)."""
    return model.flops_per_token(seq) * tokens


def recompute_flops_per_token(model: ModelSpec, seq: int, recompute: str, attention: str) -> float:
    """FLOPs executed again by recomputation, per token (see module docstring)."""
    core = 4.0 * model.layers * model.hidden * seq  # QK^T + AV forward, full square
    if recompute in ("full", "half"):
        share = 1.0 if recompute == "full" else 0.5  # 'half': every second block
        # active parameters only: recomputation replays the experts a token ran through
        matmul = sum(model.attention_params() + model.ffn_params(i, active=True)
                     for i in range(model.layers))
        return share * (2.0 * matmul + core)
    if recompute == "selective" and attention == "unfused":
        return core
    return 0.0
