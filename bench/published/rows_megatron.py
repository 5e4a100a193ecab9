"""Rows of the Megatron-LM family (sources in runs.py): K22 (the calibration part), N21 Table 2
(PTD-P beside DeepSpeed ZeRO-3), Megatron-DeepSpeed (MT-NLG, BLOOM, GPT-NeoX, OPT), Megatron-LM
2019 (M19) and Megatron-Core through Megatron-Bridge on DGX-H100 (MB, dense)."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import ClusterSpec, preset_cluster
from meshtron.planner.compute import KernelOptions
from bench.published.stacks import (DEEPSPEED_MEMORY, DEEPSPEED_PIPE_2021, DEEPSPEED_ZERO3_2021,
                                    MEGATRON_2019, MEGATRON_2021, MEGATRON_2022,
                                    MEGATRON_DEEPSPEED_MEMORY, from_preset)
from bench.published.table import PublishedRun, a100_40gb, dgx2h, gpt_model, jean_zay


def k22() -> list[PublishedRun]:
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


def n21_table2() -> list[PublishedRun]:
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


BLOOM_STACK = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                            separate_projections=False, fp32_grad_reduce=True,
                            zero1_all_reduce=True, p2p_scatter_gather=True, p2p_blocking=True,
                            score_bias_copy=True, launch_blocking=True, stack="fused",
                            sharding="zero")
"""BLOOM's stack as bigscience-workshop/bigscience train/tr11-176B-ml (tr11-176B-ml.slurm and
README.md) ran it: Megatron-DeepSpeed's fused kernels with Megatron's default dropout of 0.1 on
the attention probabilities and hidden states (megatron/arguments.py --attention-dropout,
--hidden-dropout; the script sets neither, the README: "default Megatron-LM dropout settings
are inherited"); DeepSpeed's BF16_Optimizer (ZeRO stage 0 in the DeepSpeed config, "it
implements its own zero stage 1 equivalent"), which adds every micro-batch's bf16 gradients
into an fp32 buffer and all-reduces those fp32 gradients once per step (microsoft/DeepSpeed
v0.6.5 runtime/bf16_optimizer.py update_hp_grads, pipe/engine.py _bf16_reduce_grads:
fp32_grad_reduce, zero1_all_reduce), then all-gathers the updated bf16 shards; ALiBi as
torch.baddbmm from the bias tensor (bigscience-workshop/Megatron-DeepSpeed
megatron/model/transformer.py, March 2022: score_bias_copy); CUDA_LAUNCH_BLOCKING=1, set by
tr11-176B-ml.slurm against a hang (launch_blocking); DeepSpeed's pipeline engine of 2022 (the olruwase/elastic-ckpt-refresh
branch, after v0.5.5), which splits both the activation and the gradient it sends over the
tensor group and re-gathers them (pipe/engine.py is_pipe_partitioned = is_grad_partitioned =
is_model_parallel, since microsoft/DeepSpeed#1407 of September 2021: p2p_scatter_gather)."""


NEOX_STACK = from_preset("gpt-neox@2022", stack="fused").kernel
"""GPT-NeoX-20B's stack, the gpt-neox@2022 preset with configs/20B.yml's fusions (`stack =
"fused"`): EleutherAI/gpt-neox of early 2022 (configs/20B.yml; requirements pinned
EleutherAI/DeeperSpeed eb7f5cff, DeepSpeed 0.3.15): Megatron's fused upper-triangular softmax and
bias-GeLU kernels (scaled-upper-triang-masked-softmax-fusion, bias-gelu-fusion), dropout 0
(hidden-dropout and attention-dropout 0: nn.Dropout returns its input at p = 0), `gpt_j_residual`
(one tensor-parallel all-reduce of the summed attention and MLP outputs: residual_reduce_once),
fp16 (costed as bf16: the same A100 peak; the loss scaler's overflow check is one more pass over
the gradients, not priced); DeeperSpeed's pipeline engine: blocking transfers, the activation split
over the tensor group and re-gathered, the gradient sent whole (deepspeed/runtime/pipe/engine.py
is_pipe_partitioned = is_model_parallel, is_grad_partitioned = False: p2p_grads_whole) and ZeRO
stage 1 under it reducing by buffered_allreduce_fallback, a whole all-reduce (_exec_reduce_grads:
zero1_all_reduce). Not priced: the [1, 1, s, s] attention mask the engine sends as fp16 beside
every activation (has_attention_mask: the class is named GPT2ModelPipe; 8 MB a micro-batch at s =
2048) and the torch.cuda.synchronize() DeepSpeed's activation checkpointing runs at each
checkpointed layer's edges (synchronize-each-layer)."""


NEOX_ATTENTION_FLOPS = 60
"""GPT-NeoX's attention term: FLOPs per token per layer per unit of sequence x hidden
(`attn = seq_length * hidden_size * num_layers * 60` in get_flops, below)."""


def neox_logged_step_s(model: ModelSpec, global_batch: int, seq: int, tflops: float,
                       gpus: int) -> float:
    """Seconds per step behind a TFLOP/s figure that GPT-NeoX logged. The paper gives no FLOP
    formula for its 117 TFLOP/s; the code that trained the model (EleutherAI/gpt-neox
    megatron/logging.py `get_flops`, the same from May 2021 to September 2023: commits
    da0a017b, bca3f3da of January 2022, a42805b4 of the 20B release in April 2022; replaced by
    Megatron's formula in #1044) logs "approx flops per GPU" as
    train_batch_size * seq_length * (6 * total_params + 60 * seq_length * hidden_size *
    num_layers) / (iteration_time * world_size): 6 FLOPs per parameter and token, no
    recomputation, with `total_params` the parameters summed over the model-parallel ranks
    (megatron/utils.py `get_total_params`; the tensor-replicated norms and row-parallel biases
    counted twice, 0.008% of 20B, left out). For GPT-NeoX-20B at 2048 tokens that is 156.6
    GFLOP per token where Megatron's hardware formula with full recomputation (the planner's
    hardware FLOPs, N21 eq. 3) counts 170.2: read as hardware FLOP/s, 117 would mean a step
    8.7% longer than the one the run logged."""
    per_token = (6.0 * model.num_params()
                 + NEOX_ATTENTION_FLOPS * seq * model.hidden * model.layers)
    return global_batch * seq * per_token / (tflops * 1e12 * gpus)


def megatron_deepspeed() -> list[PublishedRun]:
    runs = []
    # tied word embedding: Megatron-DeepSpeed's GPTModelPipe builds the input embedding and
    # the output head as one TiedLayerSpec('embed', ...) on the first and last stages, whose
    # gradients the engine all-reduces each step (ReduceTiedGrads); microsoft/Megatron-
    # DeepSpeed megatron/model/gpt_model.py from June to October 2021 (8a132ced, 54884b5f)
    mtnlg = gpt_model("mt-nlg-530b", 105, 20480, 128)
    for nodes, tf in ((280, 126.0), (350, 121.0), (420, 113.0)):
        runs.append(PublishedRun(
            f"MT-NLG 530B {nodes * 8}", "MTNLG section 2.3 (Selene, batch 1920)",
            "Megatron-DeepSpeed", mtnlg, selene_2021(nodes), 1920, 2048, 8, 35,
            nodes * 8 // 280, 1, "full", False, DEEPSPEED_PIPE_2021, "hw_tflops", tf,
            memory=MEGATRON_DEEPSPEED_MEMORY, note="DeepSpeed 1F1B pipeline, ZeRO-1, micro-batch 1 (assumed)"))
    runs.append(PublishedRun(
        "BLOOM 176B 384", "BLOOM section 3.4 (~150 TFLOP/s per GPU); bigscience-workshop/"
        "bigscience train/tr11-176B-ml/README.md (log at iteration 85376: 104.70 s per "
        "iteration at batch 2048, 149.77 TFLOP/s)", "Megatron-DeepSpeed",
        gpt_model("bloom-176b", 70, 14336, 112, vocab=250880), jean_zay(48),
        2048, 2048, 4, 12, 8, 1, "full", False, BLOOM_STACK,
        "step_s", 104.70, micro_batches=(2,), memory=MEGATRON_DEEPSPEED_MEMORY,
        note="tp 4, pp 12, dp 8, micro-batch 2, full recomputation (tr11-176B-ml.slurm); "
             "BF16_Optimizer's own ZeRO-1 (DeepSpeed stage 0); ALiBi modelled as learned "
             "positions; the step logged in the training's README (149.77 TFLOP/s by "
             "Megatron's formula, the paper's 'about 150')", confident=False))
    neox = ModelSpec(name="gpt-neox-20b", layers=44, hidden=6144, heads=64, kv_heads=64,
                     ffn_hidden=4 * 6144, vocab=50432, max_seq=2048, mlp="gelu",
                     norm="layernorm", position="rope", tied_embeddings=False, bias=True,
                     parallel_residual=True)
    runs.append(PublishedRun(
        "GPT-NeoX 20B 96", "NEOX section 3 (117 TFLOP/s per GPU, 96 A100-SXM4-40GB)",
        "Megatron-DeepSpeed (GPT-NeoX)", neox, a100_40gb(12, 12.5), 1536, 2048, 2, 4, 12, 1,
        "full", False,
        NEOX_STACK, "step_s", neox_logged_step_s(neox, 1536, 2048, 117.0, 96), micro_batches=(4,),
        memory=MEGATRON_DEEPSPEED_MEMORY,
        note="tp 2, pp 4, ZeRO-1, micro-batch 4 x 32 accumulation steps (published: "
             "EleutherAI/gpt-neox configs/20B.yml); batch 1538 rounded to 1536 for dp 12; 4 HDR "
             "HCAs per 8-GPU node; rotary on a quarter of each head costed as full RoPE; the "
             "117 TFLOP/s converted to seconds per step by GPT-NeoX's own FLOP count "
             "(neox_logged_step_s), fp16 costed as bf16 (the same A100 peak)",
        confident=False))
    runs.append(PublishedRun(
        "OPT 175B 992", "OPT section 2.4 (147 TFLOP/s per A100 80GB)",
        "Metaseq (FSDP + Megatron TP)",
        gpt_model("opt-175b", 96, 12288, 96, tied=False), preset_cluster("dgx-a100", 124),
        992, 2048, 8, 1, 124, 3, "full", False,
        KernelOptions(attention="unfused", dropout=True, stack="fused",
                      separate_projections=False),
        "hw_tflops", 147.0, micro_batches=(1, 2, 4, 8),
        note="FSDP + Megatron TP 8; batch 992 (~2M tokens), full recomputation and the FLOP "
             "convention assumed", confident=False))
    return runs


def megatron_2019() -> list[PublishedRun]:
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


def megatron_bridge_h100() -> list[PublishedRun]:
    """MB, DGX-H100 rows of dense Llama models (the MoE rows are not expressible: the planner has
    no expert parallelism). Added to the validation part, with their layout, micro-batch and
    virtual stages as published, before they were ever run through the planner (round 2 of
    issue 18); nothing was changed after seeing their errors, except two software facts read
    later from Megatron-Bridge's own code (its current scaling, as the tables state, and its
    'fp8_cs' precision's FP8 parameter gather, added after their errors were known: a
    statement of the stack, not a fit; drop it to compare). The tables do not state the
    recomputation: 'any' (the fastest the memory model accepts)."""
    # the megatron-bridge@2025 preset (its library recipes: TE userbuffers with tp > 1, FP8 as
    # bf16_with_fp8_current_scaling_mixed with FP8 parameter gather, planner/frameworks.py);
    # the performance scripts that ran the tables turn check_for_nan_in_grad off
    # (scripts/performance/utils/helpers.py set_common_perf_overrides: no norm pass) and use
    # 'fp8_cs', the same precision with first_last_layers_bf16 off (every layer FP8, as the
    # preset prices). Not carried here: those scripts' Llama 3 configs also set
    # grad_reduce_in_fp32 False (configs/llama3/llama3_llm_pretrain.py), which the rows had
    # not when they were added (not applied with the preset: it moves these validation rows,
    # a change to make on its own and say so).
    bridge = from_preset("megatron-bridge@2025", grad_bucket_passes=0)
    mcore = bridge.kernel
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
            dtype="fp8", virtual_stages=vp, confident=False,
            # Megatron-Core's own split (the preset's, which the command line prices): equal
            # chunks, not the time-balanced split of meshtron's runtime
            memory=bridge.memory,
            note=f"FP8 (current scaling), micro-batch 1, VP {vp or '-'} as published; "
                 f"{'Megatron-FSDP' if fsdp else 'distributed optimizer (DDP column 0)'}; "
                 "sequence parallel with TP (required by tp_comm_overlap); recomputation "
                 "not published"))
    return runs
