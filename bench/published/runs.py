"""The rows of the validation table (see published.py for what every field and metric means).

Sources, abbreviated in the rows:

* N21: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (SC'21), Table 2 (PTD-P vs DeepSpeed ZeRO-3 without model parallelism,
  Selene DGX A100 80GB, 8 x HDR 200 Gb/s per node).
* K22: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Tables 3 and 5 (Selene).
* MTNLG: Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
  section 2.3 (Selene, batch 1920).
* L3: Llama Team 2024, "The Llama 3 Herd of Models", Table 4 (H100 700 W, 400 Gb/s RoCE).
* TT24: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3
  (Llama 3.1 8B, H100 96 GB HBM2e 500 W, 400 Gb/s per GPU).
* TTA: pytorch/torchtitan docs/performance.md (2024 version), Llama 3 and Llama 2 tables
  (FSDP2, 64 A100 80GB, eager: torch.compile was off by default).
* LF: mosaicml/llm-foundry scripts/train/benchmarking/README.md, MPT throughput tables
  (Composer + PyTorch FSDP, FlashAttention/Triton attention, low-precision LayerNorm, no
  torch.compile; T/s/GPU column).
* M19: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
  Using Model Parallelism", section 5.1 and Figure 1 (DGX-2H V100 32GB).
* BLOOM: BigScience 2022, "BLOOM", section 3.4 (Jean Zay A100 80GB).
* OPT: Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models", section 2.4.
* MB: NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (25.11 NeMo container) and
  docs/performance-summary-archive.md (26.02 NeMo container), DGX-H100 pre-training tables
  (Megatron-Core through Megatron-Bridge's performance recipes, scripts/performance/).
* DSV3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), sections 3.1-3.3
  and Table 1: 2,048 H800 (NVLink 160 GB/s and IB 50 GB/s achieved, section 3.2.2), 16-way
  pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no
  tensor parallelism, FP8 mixed precision, 180K H800 GPU-hours per trillion tokens.
* NEOX: Black et al. 2022, "GPT-NeoX-20B: An Open-Source Autoregressive Language Model",
  sections 2.3 and 3 (12 nodes of 8 A100-SXM4-40GB, 4 ConnectX-6 HDR HCAs per node).
"""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import ClusterSpec, preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.memory import MemoryOptions
from bench.published.table import (PublishedRun, dgx2h, gpt_model, grand_teton_h100_500w,
                                        jean_zay, mpt_model)

# Software stacks as KernelOptions -----------------------------------------------------------------
MEGATRON_2021 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                              fp32_grad_reduce=True, stack="fused", sharding="zero")
"""Megatron-LM 2021-2022: fused kernels, materialised attention scores with dropout, fp32
main_grad reduced after the backward pass."""
MEGATRON_2022 = dataclasses.replace(MEGATRON_2021, grad_accum_fusion=True, megatron_linear=True)
"""Megatron-LM of K22 (spring 2022, the sequence-parallel and selective-recompute commits):
gradient accumulation fusion (Feb 2022, commit 83b1e42f30, on unless
--no-gradient-accumulation-fusion) adds each micro-batch's weight gradient to main_grad in the
wgrad GEMM; its LinearWithGradAccumulationAndAsyncCommunication reduces the input gradient beside
the weight-gradient GEMM and re-gathers the sequence-parallel input beside the input-gradient
GEMM (the async tensor-parallel all-reduce of late 2021 and K22's section 4.2.2)."""
DEEPSPEED_PIPE_2021 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                                    fp32_grad_reduce=False, p2p_scatter_gather=False,
                                    p2p_blocking=True, stack="fused", sharding="zero")
"""Megatron-DeepSpeed (MT-NLG, BLOOM): Megatron's fused kernels, DeepSpeed's pipeline engine."""
MEGATRON_DEEPSPEED_MEMORY = MemoryOptions(framework="megatron",
                                          pipeline_split="deepspeed-transformer")
"""Megatron-DeepSpeed's memory layout (16-bit weights, options_for's 'megatron') and its layer
split: GPTModelPipe builds DeepSpeed's PipelineModule with partition_method='type:transformer'
(GPT-NeoX: 'type:transformer|mlp'), DeepSpeed's balanced split over the blocks alone."""
DEEPSPEED_ZERO3_2021 = KernelOptions(attention="unfused", dropout=True, fp32_grad_reduce=False,
                                     overlap_grad_reduce=False, stack="fused", sharding="zero",
                                     shard_units_per_layer=4, reduce_units_per_layer=12,
                                     prefetch_params=0.0,
                                     recompute_regathers=True, list_collectives=True)
"""DeepSpeed ZeRO-3 as of N21 (v0.3.15, April 2021; deepspeed/runtime/zero/stage3.py,
partition_parameters.py and constants.py at that version). Gathers: `fetch_sub_module` gathers
each parameter of a submodule with its own `_allgather_param` call, each after a
torch.cuda.synchronize(), then synchronizes again; parameters below
`stage3_param_persistence_threshold` (default 1e5 elements: biases and norms) stay gathered, so a
GPT layer gathers its four weight matrices (shard_units_per_layer=4). The prefetch issues its
gathers the same way and every fetch synchronises the whole device (prefetch 0). Reductions:
every parameter's gradient is reduce-scattered by its own call (`_reduce_scatter_gradients`, 12
per GPT layer with biases); ZeRO-3's overlap_comm defaults to on, but the device-wide
synchronisation of the next fetch waits for it, so it is costed as not overlapped. Parameters
are released after every forward, so the recomputed forward gathers them again. Every call goes
through list-based collectives: zero-filled gather buffers, PyTorch 1.8's per-chunk staging
copies and a Python loop over the ranks (list_collectives; estimate.LIST_HOST_S_PER_RANK)."""
LLM_FOUNDRY_MEMORY = MemoryOptions(framework="fsdp2", loss="inplace")
"""llm-foundry's MPT: FSDP with fp32 sharded parameters, and flash-attn's fused cross-entropy
(its default `loss_fn: fused_crossentropy`), whose backward overwrites the logits in place."""
DEEPSPEED_MEMORY = MemoryOptions(framework="deepspeed")
"""DeepSpeed ZeRO: 16-bit weights, fp32 master weights and moments in the optimizer, ZeRO-3
gathering per submodule under stage3_max_live_parameters."""
TORCHTITAN_EAGER = KernelOptions(fp32_grad_reduce=True, stack="eager", fp8_filter="all",
                                 fp8_scaling="torchao-tensorwise",
                                 optimizer="foreach", eager_norm="python")
"""torchtitan FSDP2 without torch.compile: bf16 parameters, fp32 gradient reduce-scatter;
foreach AdamW (torchtitan/optimizer.py of December 2024: `--optimizer.fused` off by default,
fused became the default in February 2025, #881); its own Python RMSNorm (norms.py, until the
switch to torch.nn.RMSNorm in March 2025, #985)."""
TORCHTITAN_COMPILED = KernelOptions(fp32_grad_reduce=True, stack="compiled", cp_overlap=True,
                                    fp8_filter="all", fp8_scaling="torchao-tensorwise",
                                    optimizer="foreach",
                                    eager_norm="python")
"""torchtitan FSDP2 with torch.compile (per-block compilation fuses the memory-bound ops of
each TransformerBlock; train.py of December 2024 leaves `torch.compile(loss_fn)` commented
out, so the final norm, head and loss stay eager; foreach AdamW as above)."""
LLM_FOUNDRY_AMP = KernelOptions(fp32_grad_reduce=False, fp32_params_autocast=True,
                                stack="eager", optimizer="foreach")
"""llm-foundry, amp_bf16 with FSDP mixed precision DEFAULT, as Composer defined it in 2023:
fp32 parameters (gathered in fp32, cast by autocast), bf16 gradient reduction; Composer's
DecoupledAdamW steps parameter by parameter with separate ops (optimizer 'foreach' bytes)."""
LLM_FOUNDRY_PURE = KernelOptions(fp32_grad_reduce=False, stack="eager", optimizer="foreach")
"""llm-foundry, bf16 with FSDP mixed precision PURE (bf16 gradient reduction)."""
MEGATRON_2019 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                              fp32_grad_reduce=False, stack="eager", sharding="zero",
                              optimizer="foreach")
"""Megatron-LM 2019: apex fused LayerNorm only; softmax, GeLU, dropout as separate kernels; fp16
gradients all-reduced after the backward pass (its 'local' DDP); FP16_Optimizer's separate
copy / unscale / norm passes around the Adam step (optimizer 'foreach' bytes)."""


def _calibration() -> list[PublishedRun]:
    """K22 Table 5 (dp = 1, no data-parallel traffic): the rows earlier planner versions were
    developed against; calibration part."""
    src = "K22 Tables 3 and 5 (Selene DGX A100 80GB)"
    runs = []
    k22 = [  # name, layers, hidden, heads, tp, pp, gpus, batch, selective+SP s, full s
        ("22B", 48, 6144, 64, 8, 1, 8, 4, 1.10, 1.42),
        ("175B", 96, 12288, 96, 8, 8, 64, 64, 13.75, 18.13),
        ("530B", 105, 20480, 128, 8, 35, 280, 280, 37.83, 49.05),
        ("1T", 128, 25600, 160, 8, 64, 512, 512, 71.49, 94.42),
    ]
    for name, L, h, a, tp, pp, gpus, B, t_sel, t_full in k22:
        model = gpt_model(f"gpt-{name}", L, h, a, tied=False)
        cl = preset_cluster("dgx-a100", gpus // 8)
        mbs = (4,) if name == "22B" else (1,)
        sch = ("1f1b",) if pp == 1 else ("1f1b", "interleaved")
        for label, rec, sp, t in (("sel+SP", "selective", True, t_sel),
                                  ("full", "full", False, t_full)):
            runs.append(PublishedRun(
                f"K22 {name} {label}", src, "Megatron-LM", model, cl, B, 2048, tp, pp, 1, 0, rec,
                sp, MEGATRON_2022, "step_s", t, "calibration", mbs, sch,
                note="dp=1; full-recompute baseline with SP off"))
    return runs


NCCL_2021_NET_LATENCY_US = 9.6
"""Network ring step of the NCCL that Selene's 2020-2021 runs used (N21, MT-NLG): NVIDIA/nccl
src/graph/tuning.cc hwLat[NET][Ring][Simple] is 9.6 us in every release from v2.7.3 (mid 2020)
to v2.11 (2021); 28 in v2.12-2.13 (March-August 2022), 9.6 again in v2.14-2.17 and 14.0 from
v2.18.1 (April 2023), the planner's default (cluster.DEFAULT_INTER_LATENCY_US). Rows whose
NCCL year is not known (K22's spring 2022 falls on the 2.11/2.12 boundary) keep the default."""


def selene_2021(nodes: int) -> ClusterSpec:
    """Selene (DGX A100 80GB) as its 2021 runs ran it: the NCCL of that year's latency."""
    return dataclasses.replace(preset_cluster("dgx-a100", nodes),
                               inter_node_latency_us=NCCL_2021_NET_LATENCY_US)


def _n21_table2() -> list[PublishedRun]:
    src = "N21 Table 2 (Selene DGX A100 80GB)"
    gpt175 = gpt_model("gpt-175B", 96, 12288, 96)
    gpt530 = gpt_model("gpt-530B", 105, 20480, 128)
    runs = []
    for gpus, tf in ((384, 153.0), (768, 149.0), (1536, 141.0)):
        runs.append(PublishedRun(
            f"N21 PTD-P 175B {gpus}", src, "Megatron-LM", gpt175,
            selene_2021(gpus // 8), 1536, 2048, 8, 12, gpus // 96, 0, "full",
            False, MEGATRON_2021, "hw_tflops", tf, schedules=("interleaved",),
            note="model-parallel size 96 = tp 8 x pp 12; micro-batch 1 (published)"))
    for gpus, tf in ((560, 171.0), (1120, 167.0), (2240, 159.0)):
        runs.append(PublishedRun(
            f"N21 PTD-P 530B {gpus}", src, "Megatron-LM", gpt530,
            selene_2021(gpus // 8), 2240, 2048, 8, 35, gpus // 280, 0, "full",
            False, MEGATRON_2021, "hw_tflops", tf, schedules=("interleaved",),
            note="model-parallel size 280 = tp 8 x pp 35; micro-batch 1 (published)"))
    for model, gpus, batch, mb, tf in ((gpt175, 384, 1536, 4, 144.0), (gpt175, 768, 1536, 2, 88.0),
                                       (gpt175, 1536, 1536, 1, 44.0),
                                       (gpt530, 640, 2560, 4, 138.0),
                                       (gpt530, 1120, 2240, 2, 98.0),
                                       (gpt530, 2240, 2240, 1, 48.0)):
        runs.append(PublishedRun(
            f"N21 ZeRO-3 {model.name[4:]} {gpus}", src, "DeepSpeed ZeRO-3", model,
            selene_2021(gpus // 8), batch, 2048, 1, 1, gpus, 3, "full", False,
            DEEPSPEED_ZERO3_2021, "hw_tflops", tf, micro_batches=(mb,), memory=DEEPSPEED_MEMORY,
            note="no model parallelism; micro-batch as published; full recomputation assumed "
                 "(the published FLOP formula counts it)"))
    return runs


def _megatron_deepspeed() -> list[PublishedRun]:
    runs = []
    mtnlg = gpt_model("mt-nlg-530b", 105, 20480, 128, tied=False)
    for nodes, tf in ((280, 126.0), (350, 121.0), (420, 113.0)):
        runs.append(PublishedRun(
            f"MT-NLG 530B {nodes * 8}", "MTNLG section 2.3 (Selene, batch 1920)",
            "Megatron-DeepSpeed", mtnlg, selene_2021(nodes), 1920, 2048, 8, 35,
            nodes * 8 // 280, 1, "full", False, DEEPSPEED_PIPE_2021, "hw_tflops", tf,
            memory=MEGATRON_DEEPSPEED_MEMORY, note="DeepSpeed 1F1B pipeline, ZeRO-1, micro-batch 1 (assumed)"))
    runs.append(PublishedRun(
        "BLOOM 176B 384", "BLOOM section 3.4 (~150 TFLOP/s per GPU)", "Megatron-DeepSpeed",
        gpt_model("bloom-176b", 70, 14336, 112, vocab=250880, tied=False), jean_zay(48),
        2048, 2048, 4, 12, 8, 1, "full", False,
        KernelOptions(attention="unfused", dropout=False, overlap_grad_reduce=False,
                      p2p_scatter_gather=False, p2p_blocking=True, stack="fused",
                      sharding="zero"),
        "hw_tflops", 150.0, micro_batches=(2,), memory=MEGATRON_DEEPSPEED_MEMORY,
        note="ZeRO-1, micro-batch 2, full recomputation; ALiBi modelled as learned positions; "
             "'about 150' TFLOP/s", confident=False))
    neox = ModelSpec(name="gpt-neox-20b", layers=44, hidden=6144, heads=64, kv_heads=64,
                     ffn_hidden=4 * 6144, vocab=50432, max_seq=2048, mlp="gelu",
                     norm="layernorm", position="rope", tied_embeddings=False, bias=True,
                     parallel_residual=True)
    runs.append(PublishedRun(
        "GPT-NeoX 20B 96", "NEOX section 3 (117 TFLOP/s per GPU, 96 A100-SXM4-40GB)",
        "Megatron-DeepSpeed (GPT-NeoX)", neox, _a100_40gb(12, 12.5), 1536, 2048, 2, 4, 12, 1,
        "full", False,
        KernelOptions(attention="unfused", dropout=False, overlap_grad_reduce=False,
                      p2p_scatter_gather=False, p2p_blocking=True, stack="fused",
                      sharding="zero"),
        "hw_tflops", 117.0, micro_batches=(4,), memory=MEGATRON_DEEPSPEED_MEMORY,
        note="tp 2, pp 4, ZeRO-1, micro-batch 4 x 32 accumulation steps (published: "
             "EleutherAI/gpt-neox configs/20B.yml); batch 1538 rounded to 1536 for dp 12; 4 HDR "
             "HCAs per 8-GPU node; rotary on a quarter of each head costed as full RoPE",
        confident=False))
    runs.append(PublishedRun(
        "OPT 175B 992", "OPT section 2.4 (147 TFLOP/s per A100 80GB)",
        "Metaseq (FSDP + Megatron TP)",
        gpt_model("opt-175b", 96, 12288, 96, tied=False), preset_cluster("dgx-a100", 124),
        992, 2048, 8, 1, 124, 3, "full", False,
        KernelOptions(attention="unfused", dropout=True, stack="fused"),
        "hw_tflops", 147.0, micro_batches=(1, 2, 4, 8),
        note="FSDP + Megatron TP 8; batch 992 (~2M tokens), full recomputation and the FLOP "
             "convention assumed", confident=False))
    return runs


def _llama3() -> list[PublishedRun]:
    return [PublishedRun(
        f"Llama3 405B {nodes * 8}", "L3 Table 4", "Meta (Llama 3)", preset("llama3-405b"),
        preset_cluster("dgx-h100", nodes), 2048, 8192, 8, 16, dp, 1, "none", True,
        KernelOptions(stack="fused", sharding="zero"), "model_tflops", tf,
        schedules=("interleaved",),
        note="FlashAttention, SP, no recomputation, ZeRO-1-like sharding, micro-batch 1 (assumed)")
        for nodes, dp, tf in ((1024, 64, 430.0), (2048, 128, 400.0))]


def _torchtitan() -> list[PublishedRun]:
    runs = []
    l31 = preset("llama3-8b")
    for gpus, eager, compiled in ((8, 5762.0, 6667.0), (128, 5605.0, 6514.0)):
        for label, opts, tps in (("eager", TORCHTITAN_EAGER, eager),
                                 ("compile", TORCHTITAN_COMPILED, compiled)):
            runs.append(PublishedRun(
                f"TT Llama3.1 8B {gpus} {label}", f"TT24 Table {1 if gpus == 8 else 3}",
                f"torchtitan FSDP2 {label}", l31, grand_teton_h100_500w(gpus // 8), 2 * gpus,
                8192, 1, 1, gpus, 3, "half", False, opts, "tokens_per_gpu", tps,
                micro_batches=(2,),
                note="local batch 2, selective (op) activation checkpointing; 500 W H100 "
                     "peak assumed 912 TFLOP/s"))
    a100 = [  # name, model, seq, local batch, recompute, TPS/GPU
        ("Llama3 8B sel-layer", preset("llama3-8b"), 8192, 1, "half", 2904.0),
        ("Llama3 8B sel-op", preset("llama3-8b"), 8192, 1, "half", 2973.0),
        ("Llama3 70B full", preset("llama3-70b"), 8192, 1, "full", 331.0),
        ("Llama2 13B no-AC", preset("llama2-13b"), 4096, 2, "none", 2162.0),
        ("Llama2 13B sel-layer", preset("llama2-13b"), 4096, 2, "half", 1914.0),
        ("Llama2 70B sel-op", preset("llama2-70b"), 4096, 1, "half", 355.0),
        ("Llama2 70B full", preset("llama2-70b"), 4096, 2, "full", 353.0),
    ]
    for name, model, seq, lb, rec, tps in a100:
        runs.append(PublishedRun(
            f"TT {name}", "TTA (64 A100 80GB)", "torchtitan FSDP2 eager", model,
            preset_cluster("dgx-a100", 8), 64 * lb, seq, 1, 1, 64, 3, rec, False,
            TORCHTITAN_EAGER, "tokens_per_gpu", tps, micro_batches=(lb,),
            note="network not stated: 8 x 200 Gb/s per node assumed; 'selective op' costed "
                 "as every second layer recomputed"))
    return runs


def _llm_foundry() -> list[PublishedRun]:
    mpt = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32),
           "13b": (40, 5120, 40), "30b": (48, 7168, 64), "70b": (80, 8192, 64)}
    # size, seq, gpus, gpu preset, micro-batch, grad accumulation, global batch, activation
    # checkpointing, ZeRO stage (3 FULL_SHARD, 2 SHARD_GRAD_OP), precision, T/s/GPU
    rows = [
        ("70b", 2048, 512, "dgx-h100", 8, 1, 4096, True, 3, "amp", 1007.0),
        ("70b", 2048, 128, "dgx-h100", 8, 1, 1024, True, 3, "amp", 1058.0),
        ("30b", 2048, 512, "dgx-h100", 8, 1, 4096, True, 3, "amp", 2115.0),
        ("13b", 2048, 512, "dgx-h100", 16, 1, 8192, True, 3, "amp", 4952.0),
        ("7b", 2048, 512, "dgx-h100", 6, 1, 3072, False, 3, "amp", 9670.0),
        ("7b", 2048, 128, "dgx-h100", 6, 1, 768, False, 3, "amp", 10475.0),
        ("3b", 2048, 512, "dgx-h100", 8, 1, 4096, False, 2, "amp", 21664.0),
        ("1b", 2048, 512, "dgx-h100", 12, 1, 6144, False, 2, "amp", 39837.0),
        ("7b", 2048, 8, "dgx-h100", 6, 1, 48, False, 3, "amp", 10643.0),
        ("13b", 2048, 8, "dgx-h100", 2, 1, 16, False, 3, "amp", 4792.0),
        ("7b", 8192, 8, "dgx-h100", 8, 2, 128, True, 3, "amp", 6935.0),
        ("7b", 2048, 8, "dgx-a100", 6, 2, 96, False, 3, "amp", 4641.0),
        ("13b", 2048, 8, "dgx-a100", 2, 3, 48, False, 3, "amp", 2262.0),
        ("30b", 2048, 8, "dgx-a100", 3, 21, 504, True, 3, "amp", 916.0),
        ("70b", 2048, 64, "dgx-a100", 8, 4, 2048, True, 3, "pure", 410.0),
        ("70b", 2048, 128, "a100-40gb", 4, 1, 512, True, 3, "pure", 376.0),
        ("13b", 2048, 128, "a100-40gb", 16, 1, 2048, True, 3, "pure", 1972.0),
        ("7b", 2048, 128, "a100-40gb", 18, 1, 2304, True, 3, "pure", 3623.0),
    ]
    runs = []
    for size, seq, gpus, kind, mb, ga, gbs, ac, zero, prec, tps in rows:
        L, h, a = mpt[size]
        if kind == "a100-40gb":
            cl = _a100_40gb(max(1, gpus // 8))
            table = "A100 40GB, 1600 Gbps RoCE per node"
        else:
            cl = preset_cluster(kind, max(1, gpus // 8))
            table = ("H100 80GB" if kind == "dgx-h100" else "A100 80GB, 1600 Gbps RoCE per node")
        gpu = "H100" if kind == "dgx-h100" else "A100"
        runs.append(PublishedRun(
            f"LF MPT-{size} s{seq} {gpus}x{gpu}", f"LF, {table} table", "llm-foundry FSDP",
            mpt_model(f"mpt-{size}", L, h, a, seq), cl, gbs, seq, 1, 1, gpus, zero,
            "full" if ac else "none", False,
            LLM_FOUNDRY_AMP if prec == "amp" else LLM_FOUNDRY_PURE, "tokens_per_gpu", tps,
            micro_batches=(mb,), memory=LLM_FOUNDRY_MEMORY,
            note=f"micro-batch {mb} x {ga} accumulation; "
                 f"{'SHARD_GRAD_OP' if zero == 2 else 'FULL_SHARD'}; {prec}"))
    return runs


def _megatron_2019() -> list[PublishedRun]:
    gpt83 = gpt_model("gpt2-8.3b", 72, 3072, 32, seq=1024)
    gpt12 = gpt_model("gpt2-1.2b", 40, 1536, 16, seq=1024)
    src = "M19 section 5.1, Figure 1 (DGX-2H V100 32GB)"
    note = "batch 8 per replica assumed; FLOPs by the paper's appendix formula (recomputation)"
    return [
        PublishedRun("M19 1.2B 1xV100", src, "Megatron-LM 2019", gpt12, dgx2h(1, 1), 8, 1024, 1, 1,
                     1, 0, "full", False, MEGATRON_2019, "hw_tflops", 39.0, micro_batches=(8,),
                     note=note + "; one GPU of the node", confident=False),
        PublishedRun("M19 8.3B 8xV100", src, "Megatron-LM 2019", gpt83, dgx2h(1, 8), 8, 1024, 8, 1,
                     1, 0, "full", False, MEGATRON_2019, "hw_tflops", 0.77 * 39.0,
                     micro_batches=(8,), note=note + "; 77% weak-scaling efficiency of 39",
                     confident=False),
        PublishedRun("M19 8.3B 512xV100", src, "Megatron-LM 2019", gpt83, dgx2h(32), 512, 1024,
                     8, 1, 64, 0, "full", False, MEGATRON_2019, "hw_tflops", 15.1e3 / 512,
                     micro_batches=(8,), note=note + "; 15.1 PFLOP/s over 512 GPUs"),
    ]


def _a100_40gb(nodes: int, nic_gb_per_s: float = 25.0) -> ClusterSpec:
    """A100-SXM4-40GB nodes of 8 on NVLink with `nic_gb_per_s` of network per GPU."""
    return dataclasses.replace(preset_cluster("dgx-a100", nodes), gpu="A100-SXM4-40GB",
                               memory_gib=40.0, hbm_gb_per_s=1555.0,
                               inter_node_gb_per_s=nic_gb_per_s, name=f"a100-40gb:{nodes}")


def _torchtitan_nd() -> list[PublishedRun]:
    """TT24 Tables 2, 4, 5 and 6: torchtitan's 2D/3D/4D runs with torch.compile and Float8
    linears (torchao; the output head stays bf16) on the same 500 W Grand Teton H100s, full
    activation checkpointing. Added after the cost model of this branch was written (nothing
    was changed after seeing them): validation part."""
    src = "TT24 Table {}"
    l31_8b, l31_70b, l31_405b = preset("llama3-8b"), preset("llama3-70b"), preset("llama3-405b")
    async_tp = dataclasses.replace(TORCHTITAN_COMPILED, tp_comm_overlap=True)
    runs = []
    for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 3890.0, 83.9), (4, 2, 65536, 2540.0, 84.2),
                                    (2, 4, 131072, 1071.0, 84.0), (1, 8, 262144, 548.0, 84.5)):
        runs.append(PublishedRun(
            f"TT 8B FSDP{fsdp} CP{cp} {seq // 1024}k", src.format(2), "torchtitan FSDP2 compile",
            l31_8b.replace(max_seq=seq), grand_teton_h100_500w(1), fsdp, seq, 1, 1, fsdp, 3,
            "full", False, TORCHTITAN_COMPILED, "tokens_per_gpu", tps, cp=cp, dtype="fp8",
            published_memory_gib=mem, note="local batch 1; Float8; 500 W peak assumed 912"))
    for label, opts, tps, mem in (("2D", TORCHTITAN_COMPILED, 829.0, 71.9),
                                  ("2D+AsyncTP", async_tp, 876.0, 67.6)):
        runs.append(PublishedRun(
            f"TT 70B FSDP32 TP8 {label}", src.format(4), "torchtitan FSDP2 compile", l31_70b,
            grand_teton_h100_500w(32), 512, 8192, 8, 1, 32, 3, "full", True, opts,
            "tokens_per_gpu", tps, micro_batches=(16,), dtype="fp8", published_memory_gib=mem,
            note="local batch 16; Float8; sequence parallel with TP (torchtitan's default)"))
    for sched, tps, mem in (("1f1b", 100.0, 82.5), ("interleaved", 128.0, 72.7)):
        runs.append(PublishedRun(
            f"TT 405B FSDP8 TP8 PP8 {sched}", src.format(5), "torchtitan FSDP2 compile",
            l31_405b, grand_teton_h100_500w(64), 256, 8192, 8, 8, 8, 3, "full", True, async_tp,
            "tokens_per_gpu", tps, micro_batches=(4,), schedules=(sched,), dtype="fp8",
            virtual_stages=2 if sched == "interleaved" else None, published_memory_gib=mem,
            note="local batch 32 in torchtitan's default pipeline_parallel_microbatches = pp "
                 "degree (8) micro-batches of 4 (torchtitan/parallelisms/pipelining_utils.py, "
                 "build_pipeline_schedule, 2024); interleaved: generate_split_points' default "
                 "of 2 stages per rank for multi-stage schedules"))
    for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 76.0, 75.3), (4, 2, 65536, 47.0, 75.9),
                                    (2, 4, 131072, 31.0, 77.1), (1, 8, 262144, 16.0, 84.9)):
        runs.append(PublishedRun(
            f"TT 405B TP8 PP8 FSDP{fsdp} CP{cp} {seq // 1024}k", src.format(6),
            "torchtitan FSDP2 compile", l31_405b.replace(max_seq=seq),
            grand_teton_h100_500w(64), 8 * fsdp, seq, 8, 8, fsdp, 3, "full", True, async_tp,
            "tokens_per_gpu", tps, micro_batches=(1,), schedules=("1f1b",), cp=cp, dtype="fp8",
            published_memory_gib=mem, note="local batch 8, 1F1B; Float8 + AsyncTP"))
    return runs


def _megatron_bridge_h100() -> list[PublishedRun]:
    """MB, DGX-H100 rows of dense Llama models (the MoE rows are not expressible: the planner has
    no expert parallelism). Added to the validation part, with their layout, micro-batch and
    virtual stages as published, before they were ever run through the planner (round 2 of
    issue 18); nothing was changed after seeing their errors, except two software facts read
    later from Megatron-Bridge's own code (its current scaling, as the tables state, and its
    'fp8_cs' precision's FP8 parameter gather, added after their errors were known: a
    statement of the stack, not a fit; drop it to compare). The tables do not state the
    recomputation: 'any' (the fastest the memory model accepts)."""
    from meshtron.planner.frameworks import PRESETS

    # Megatron-Bridge's performance recipes (scripts/performance) turn TE userbuffers on; their
    # 'fp8_cs' precision (scripts/performance/utils/precision.py: the library's
    # bf16_with_fp8_current_scaling_mixed with first_last_layers_bf16 turned off) keeps FP8
    # parameters and gathers them in FP8 (fp8_param_gather = True, training/mixed_precision.py)
    mcore = dataclasses.replace(PRESETS["megatron@2024"].kernel, tp_comm_overlap=True,
                                fp8_scaling="te-current",  # the tables' "FP8 (current scaling)"
                                fp8_param_gather=True)
    models = {"8b": preset("llama3-8b"), "70b": preset("llama3-70b"),
              "405b": preset("llama3-405b")}
    rows = [  # container, model, gpus, GBS, FSDP, tp, pp, cp, vp, tokens/s/GPU
        ("25.11", "8b", 8, 128, True, 1, 1, 1, None, 14451.0),
        ("25.11", "70b", 64, 128, False, 4, 8, 1, 5, 1602.0),
        ("25.11", "405b", 1024, 512, False, 8, 8, 2, 8, 292.0),
        ("26.02", "70b", 64, 256, False, 4, 8, 1, 5, 1621.0),
        ("26.02", "405b", 1024, 1536, False, 8, 8, 2, 8, 311.0),
    ]
    runs = []
    for ver, size, gpus, gbs, fsdp, tp, pp, cp, vp, tps in rows:
        dp = gpus // (tp * pp * cp)
        runs.append(PublishedRun(
            f"MB{ver} Llama3 {size} {gpus}xH100", f"MB {ver} NeMo container, DGX-H100 table",
            "Megatron-Core (Megatron-Bridge)", models[size], preset_cluster("dgx-h100", gpus // 8),
            gbs, 8192, tp, pp, dp, 3 if fsdp else 1, "any", tp > 1, mcore, "tokens_per_gpu",
            tps, micro_batches=(1,), schedules=("interleaved",) if vp else ("1f1b",), cp=cp,
            dtype="fp8", virtual_stages=vp, memory=MemoryOptions(framework="megatron"),
            confident=False,
            note=f"FP8 (current scaling), micro-batch 1, VP {vp or '-'} as published; "
                 f"{'Megatron-FSDP' if fsdp else 'distributed optimizer (DDP column 0)'}; "
                 "sequence parallel with TP (required by tp_comm_overlap); recomputation "
                 "not published"))
    return runs


def h800(nodes: int) -> ClusterSpec:
    """DeepSeek's H800 cluster (DSV3 sections 3.1, 3.2.2): H100 silicon with NVLink cut to 400
    GB/s bidirectional (200 per direction; 160 achieved, as the preset's 0.8 gives) and one
    400 Gb/s InfiniBand NIC per GPU (50 GB/s)."""
    c = preset_cluster("dgx-h100", nodes)
    # the catalogue's H100-SXM5-80GB: the same compute and HBM (the cut is NVLink only)
    return dataclasses.replace(c, name=f"h800:{nodes}", intra_node_gb_per_s=200.0,
                               inter_node_gb_per_s=50.0)


def _moe_runs() -> list[PublishedRun]:
    """Published mixture-of-experts runs with their expert-parallel layouts. Added with their
    sources before the planner ever ran them (issue 21, part 4): validation part; nothing was
    changed after seeing their errors but one software fact from the report, added in issue
    30 (fp8m) with the FP8 GEMM kinds: DeepSeek-V3's GEMMs are blockwise-scaled (section
    3.3.2)."""
    from meshtron.planner.frameworks import PRESETS

    mcore = PRESETS["megatron@2024"].kernel
    # the Megatron-Bridge tables force-balance the router ("In MoE training benchmarks, we
    # force-balance the token distribution among experts"): imbalance 1
    balanced = dataclasses.replace(mcore, expert_imbalance=1.0)
    # DeepSeek's own stack: Megatron-style fused kernels, DualPipe overlapping both
    # all-to-alls with another micro-batch, node-limited routing to M = 4 nodes with per-node
    # deduplication (DSV3 sections 2.1.2, 3.2.1, 3.2.2); imbalance: the documented default;
    # FP8 GEMMs with 1x128 / 128x128 block scales promoted every 128 k-elements (section 3.3.2)
    dsv3 = dataclasses.replace(mcore, ep_overlap=True, ep_node_limit=4, fp8_gemm="blockwise")
    qwen = preset("qwen3-30b-a3b")
    runs = [PublishedRun(
        "DSV3 671B 2048xH800", "DSV3 sections 3.1-3.3 (180K H800 GPU-hours per 1T tokens)",
        "DeepSeek HAI-LLM (DualPipe)", preset("deepseek-v3"), h800(256), 15360, 4096, 1, 16,
        128, 1, "selective", False, dsv3, "tokens_per_gpu", 1e12 / (180e3 * 3600),
        micro_batches=(1, 2), schedules=("zb",), dtype="fp8", ep=64,
        memory=MemoryOptions(framework="megatron", pipeline_split="any"), confident=False,
        note="batch 15,360 x 4,096 (the schedule's plateau); DualPipe priced as ZB-H1 with "
             "overlapped all-to-alls; recomputation of norms and MLA up-projections as "
             "selective; MLA approximated by the preset's GQA; the MTP module not counted")]
    # what the rows' recipes set (Megatron-Bridge tags v0.2.0 / v0.3.0, Qwen3-30B-A3B H100 FP8
    # performance recipes, read in issue 30's session 34): FP8 current scaling ("FP8-CS" in the
    # 25.11 table), moe_a2a_overlap on (overlap_moe_expert_parallel_comm), gradients reduced in
    # bf16, no recomputation; corrected from the preset's defaults, which the rows had before
    qwen_recipe = dataclasses.replace(balanced, fp8_scaling="te-current", ep_overlap=True,
                                      fp32_grad_reduce=False)
    dropless = ("Megatron-Bridge issue #1998 (2026-01-20): Qwen3-30B-A3B on H100 and B200 is 2x "
                "slower with the dropless schedule than with token drop, '25.11 is 2X slower "
                "than 25.09' (10,494 tokens/s/GPU with token drop in 25.09; 9,058 in the "
                "26.02.01 patch release)")
    for ver, gbs, mbs, vp, tps in (("25.11", 512, 2, 24, 5275.0), ("26.02", 1024, 1, 12, 5113.0)):
        runs.append(PublishedRun(
            f"MB{ver} Qwen3 30B-A3B 16xH100", f"MB {ver} NeMo container, DGX-H100 table",
            "Megatron-Core (Megatron-Bridge)", qwen, preset_cluster("dgx-h100", 2), gbs, 4096,
            1, 2, 8, 1, "none", False, qwen_recipe, "tokens_per_gpu", tps, micro_batches=(mbs,),
            schedules=("interleaved",), dtype="fp8", virtual_stages=vp, ep=8,
            # Megatron-Bridge 25.11 / 26.02 ship Megatron-Core >= 0.13: routing probabilities
            # applied in the experts' weighted SwiGLU (MemoryOptions.moe_weighted_act)
            memory=MemoryOptions(framework="megatron", moe_weighted_act=True), confident=False,
            regression=dropless,
            note=f"FP8 current scaling, micro-batch {mbs}, VP {vp}, EP 8 as published; "
                 "distributed optimizer (FSDP 0); router force-balanced; A2A overlap, bf16 "
                 "gradient reduction and no recomputation as the recipe sets them"))
    return runs


def steered(run: PublishedRun) -> bool:
    """The row uses a mechanism added while looking at rows of this table (a code review of
    issue 18 found commits that added them and quoted the new errors): DeepSpeed 0.3's ZeRO-3
    knobs (per-parameter reductions, list collectives, re-gathers, no prefetch), the blocking
    pipeline engine (p2p_blocking) and Composer's fp32 parameters under autocast. Such rows are
    calibration, whatever their original part."""
    o = run.opts
    return bool(o.p2p_blocking or o.list_collectives or o.fp32_params_autocast
                or o.reduce_units_per_layer or o.recompute_regathers)


LOOKED_AT = {
    **{f"TT 8B FSDP{8 // cp} CP{cp} {32 * cp}k": "their 96-106 GiB memory rejections led to "
       "the loss / recomputation peak (memory.loss_or_recompute) and the fp8 compute_bytes fix"
       for cp in (1, 2, 4, 8)},
    "TT 70B FSDP32 TP8 2D": "memory rejection: loss / recomputation peak, fp8 compute bytes",
    "TT 70B FSDP32 TP8 2D+AsyncTP": "memory rejection: loss / recomputation peak, fp8 bytes",
    **{f"TT 405B TP8 PP8 FSDP{8 // cp} CP{cp} {32 * cp}k": "its 96 GiB memory breakdown showed "
       "fp8 compute copies counted at 4 bytes (memory.MemoryOptions.compute_bytes)"
       for cp in (1, 2, 4, 8)},
    "TT 405B FSDP8 TP8 PP8 1f1b": "micro-batch fixed to torchtitan's default after its +80% "
                                  "error was known",
    "TT 405B FSDP8 TP8 PP8 interleaved": "micro-batch and virtual stages fixed to torchtitan's "
                                         "defaults after its +68% error was known",
    "Llama3 405B 8192": "its 86 GiB rejection was examined (round 2 of issue 18)",
    "DSV3 671B 2048xH800": "an FP8 GEMM tiling change that broke its error bound led to the "
                           "blockwise FP8 GEMM kind (KernelOptions.fp8_gemm, issue 30 session 34)",
    **{name: "the fp8_param_gather option was added after its error was known (issue 30 "
             "session 34): Megatron-Bridge's fp8_cs precision sets it"
       for name in ("MB25.11 Llama3 8b 8xH100", "MB25.11 Llama3 70b 64xH100",
                    "MB25.11 Llama3 405b 1024xH100", "MB26.02 Llama3 70b 64xH100",
                    "MB26.02 Llama3 405b 1024xH100")},
}
"""Rows looked at while changing the model or the runner in round 2 of issue 18, and what each
steered: calibration from then on."""


def published_runs() -> list[PublishedRun]:
    """Every published run of the table, calibration part first; rows that steered a choice
    (`steered`, `LOOKED_AT`) are relabelled calibration, with what they steered in the note."""
    runs = (_calibration() + _n21_table2() + _megatron_deepspeed() + _llama3() + _torchtitan()
            + _torchtitan_nd() + _llm_foundry() + _megatron_2019() + _megatron_bridge_h100()
            + _moe_runs())
    out = []
    for r in runs:
        if r.name in LOOKED_AT:
            r = dataclasses.replace(r, part="calibration",
                                    note=f"{r.note}; calibration: {LOOKED_AT[r.name]}")
        elif steered(r):
            r = dataclasses.replace(r, part="calibration")
        out.append(r)
    return out
