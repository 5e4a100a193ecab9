"""Validation rows of 2025-26 added in session 40 (issue 30, branch valrows2), every input fixed
from its source before the table was first run with them (runs.ADDED_S40):

* MB25: NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at fa0315ae2 (2025-10-10, the
  25.09 container) and docs/performance-summary-archive.md at 4ab94dfad (2026-08-11: the
  25.11 and 26.04.01 containers), DGX-H100 pre-training rows; the recipes that ran them:
  scripts/performance/configs/*/*.yaml and run_script.py at fa0315ae2 (25.09),
  scripts/performance/configs/qwen3/ at tag v0.2.0 (25.11) and configs/{llama,qwen}/ at
  tag v0.4.1 (2026-05-06, the 26.04.01 patch container's).
* AM: NVIDIA-NeMo/Automodel docs/performance-summary.mdx at cb9765441 (2026-06-12),
  "Pre-Training Performance, System: DGX-H100, Precision: BF16"; the configurations it names,
  examples/llm_benchmark/*.yaml at the same commit.
* TTH200: pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md at
  cbccb3878 (2025-07-11; torchtitan e7c0cae, torch 2.8.0a0, torchao 0afa4c1).

Which rows of those sources are here, by a rule set before any was run: every DGX-H100
pre-training row of 25.09, of 25.11 not already in the table, and of 26.04.01 (the newest
container with a whole H100 table: 26.06 repeats two of its layouts; 26.02 / 26.02.01 / 26.04
repeat the same layouts at other figures); every AutoModel H100 pre-training row; both
torchtitan H200 rows. Rows of those sources the command line cannot express are named in
`NOT_EXPRESSIBLE` with the reason, not dropped silently.

Whatever a source states is taken as stated; every other input is the stack's documented
default or the recipe's value, named "assumed" in the row's note. No row here has steered a
choice: validation part."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.memory import MemoryOptions
from bench.published.rows_nvidia_h100 import _padded_vocab
from bench.published.table import PublishedRun

MB2509 = "MB 25.09 DGX-H100 table (performance-summary.md at fa0315ae2, 2025-10-10)"
MB2511 = "MB 25.11 DGX-H100 table (performance-summary-archive.md at 4ab94dfad)"
MB260401 = "MB 26.04.01 DGX-H100 rows (performance-summary-archive.md at 4ab94dfad)"
AM = ("AM Pre-Training, DGX-H100, BF16 (NVIDIA-NeMo/Automodel docs/performance-summary.mdx "
      "at cb9765441, 2026-06-12)")
TTH200 = ("TTH200 pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md "
          "(cbccb3878; torchtitan e7c0cae, June 2025)")

NOT_EXPRESSIBLE = {
    "MB GPT OSS 120B 64xH100 (25.11, 26.04.01)": "model type gpt_oss (alternating sliding-"
        "window attention with sinks, biased experts) has no preset and config.json "
        "model_type 'gpt_oss' is not among the supported types",
    "MB Nemotron_3_Nano 16xH100 (26.04.01)": "hybrid Mamba-2 / attention / MoE model: no "
        "Mamba layer in the model spec",
    "AM Nemotron V3 Super 120B / Nano 30B / Ultra 550B": "hybrid Mamba-2 models (as above)",
    "AM GPT-OSS 20B / 120B": "model type gpt_oss (as above)",
    "MB DGX-B200 / GB200 / GB300 / B300 rows": "no DGX-B200 cluster preset (the catalogue's "
        "B200 is an estimated ceiling), no GB200/GB300 NVL72 NVLink domain in the catalogue, "
        "and MXFP8 / NVFP4 are not a --dtype",
    "torchtitan mxfp8.md B200 / GB200 tables": "MXFP8 is not a --dtype; the B200s were "
        "'power limited' at an unstated limit",
    "NeMo long-sequence Llama2-7B FP8, 4K-1M tokens on 4-1024 H100 (NVIDIA/NeMo docs/source/"
    "performance/performance_long_sequence.md at 19fadb67b0, NeMo 24.03.01)": "the figure is "
        "TFLOP/s per GPU by a count the repository did not hold when it was published "
        "(nemo/utils/flops_formulas.py arrived in f0bf77bcf7, 2025-01-22): whether the "
        "attention square is counted causal or whole, a factor near 2 at 128K-1M tokens, "
        "cannot be fixed from the source",
}
"""Rows of the session-40 sources the command line cannot express, and why."""


def _mcore_fp8_cs():
    """Megatron-Bridge's 'fp8_cs' precision over the megatron@2024 stack: Transformer Engine
    current scaling with FP8 parameters gathered in FP8 (training/mixed_precision.py
    bf16_with_fp8_current_scaling_mixed: fp8_param_gather True), gradients reduced in bf16
    (every recipe read: grad_reduce_in_fp32 False in the 25.09 yamls, set_llama3_common_configs
    / set_llama31_common_configs / set_qwen3_common_configs at v0.2.0 and v0.4.1)."""
    from meshtron.planner.frameworks import PRESETS

    return dataclasses.replace(PRESETS["megatron@2024"].kernel, fp8_scaling="te-current",
                               fp8_param_gather=True, fp32_grad_reduce=False)


def megatron_bridge_dense() -> list[PublishedRun]:
    """MB25 Llama rows on DGX-H100, FP8. The 25.09 table states no precision: its layouts are
    the recipes' fp8 ones (llama3_70b_llm_pretrain.yaml at fa0315ae2: pp 8 cp 1 for fp8_ds /
    fp8_cs, pp 4 cp 2 for bf16; llama3_8b: Megatron-FSDP for fp8 only), and the 25.11 table
    gives the same layouts as FP8-CS: FP8 current scaling assumed. The vocabulary is padded
    as the recipes ask (should_pad_vocab: 128 x tp)."""
    kernel = _mcore_fp8_cs()
    mem = MemoryOptions(framework="megatron", pipeline_split="megatron-ends")
    models = {"8b": "llama3-8b", "70b": "llama3-70b", "405b": "llama3-405b"}
    rows = [  # container, model, gpus, GBS, FSDP, tp, pp, cp, vp, tokens/s/GPU
        ("25.09", "8b", 8, 128, True, 1, 1, 1, None, 14079.0),
        ("25.09", "70b", 64, 128, False, 4, 8, 1, 5, 1619.0),
        ("25.09", "405b", 1024, 512, False, 8, 8, 2, 8, 302.0),
        ("26.04.01", "70b", 64, 256, False, 4, 8, 1, 5, 1664.0),
        ("26.04.01", "405b", 1024, 1536, False, 8, 8, 2, 8, 328.0),
    ]
    runs = []
    for ver, size, gpus, gbs, fsdp, tp, pp, cp, vp, tps in rows:
        base = preset(models[size])
        model = base.replace(vocab=_padded_vocab(base.vocab, tp))
        dp = gpus // (tp * pp * cp)
        runs.append(PublishedRun(
            f"MB{ver} Llama3 {size} {gpus}xH100", MB2509 if ver == "25.09" else MB260401,
            "Megatron-Core (Megatron-Bridge)", model, preset_cluster("dgx-h100", gpus // 8),
            gbs, 8192, tp, pp, dp, 3 if fsdp else 1, "any", tp > 1,
            dataclasses.replace(kernel, tp_comm_overlap=tp > 1), "tokens_per_gpu", tps,
            micro_batches=(1,), schedules=("interleaved",) if vp else ("1f1b",), cp=cp,
            dtype="fp8", virtual_stages=vp, memory=mem, confident=False,
            note=f"micro-batch 1, VP {vp or '-'}, "
                 f"{'Megatron-FSDP' if fsdp else 'distributed optimizer'} as published; "
                 "bf16 gradient reduction and the padded vocabulary as the recipe sets them; "
                 "TP communication overlap (userbuffers configs of the recipes) with sequence "
                 "parallel. Assumed: FP8 current scaling"
                 + (" (the 25.09 table states no precision)" if ver == "25.09" else "")
                 + "; recomputation not stated ('any': the fastest the memory model "
                 "accepts); Megatron-Core's layer split with the embedding and loss stages "
                 "(megatron-ends)"))
    return runs


def _qwen_kernel(a2a_overlap: bool, tp_overlap: bool, dispatch: str = "bf16",
                 capacity: float = 0.0):
    """Qwen3 recipes: no recomputation, bf16 reduction (set_qwen3_common_configs), the router
    force-balanced for dropless rows (moe_router_force_load_balancing) or token drop at
    capacity factor 1.0 with padding to capacity (25.09: utils/moe_token_drop.py): either way
    every expert runs the mean number of rows (imbalance 1). `dispatch`: the flex dispatcher's
    backend where the recipe runs it: 'hybridep' (session 40, branch automoe, read after the
    first run, priced it as 'deepep'; session 41, branch qwen3reg: HybridEP's own
    routing-map all-gather, moe_deepep.hybridep_map_gather_time). `capacity`: the token-drop
    rows' capacity factor, padded (expert_capacity; session 41, branch mcoremoe: it decides
    whether Transformer Engine's Fp8Padding copies the rows, moe_fp8.fp8_pad_passes)."""
    # the token-drop rows pad to capacity (utils/moe_token_drop.py sets
    # moe_pad_expert_input_to_capacity True; Megatron-Core's own default, the preset's, is
    # False: branch fix42a made it explicit here)
    return dataclasses.replace(_mcore_fp8_cs(), expert_imbalance=1.0, ep_overlap=a2a_overlap,
                               tp_comm_overlap=tp_overlap, ep_dispatch=dispatch,
                               expert_capacity=capacity, expert_capacity_pad=capacity > 0)


def megatron_bridge_moe() -> list[PublishedRun]:
    """MB25 Qwen3 and DeepSeek-V3 rows on DGX-H100, FP8 current scaling (the 25.09 table states
    no precision; its Qwen3-30B micro-batch 2 is the fp8_cs entry of qwen3_30b_a3b_llm_pretrain
    .yaml at fa0315ae2, bf16 has 1; DeepSeek-V3's figure outside parentheses is not the
    128x128 blockwise one: FP8-CS assumed)."""
    mem = MemoryOptions(framework="megatron", moe_weighted_act=True)
    q30, q235 = preset("qwen3-30b-a3b"), preset("qwen3-235b-a22b")
    rows = [  # name, source, model, gpus, GBS, MBS, tp, pp, vp, ep, a2a overlap, tp overlap,
        #       tokens/s/GPU, what the recipe sets
        ("MB25.09 Qwen3 30B-A3B 16xH100 tokendrop", MB2509, q30, 16, 512, 2, 1, 2, 24, 8,
         False, True, 10494.0, "token drop (capacity 1.0, padded), no A2A overlap "
         "(run_script.py at fa0315ae2 sets tp_comm_overlap only)"),
        ("MB25.09 Qwen3 235B-A22B 256xH100 tokendrop", MB2509, q235, 256, 2048, 1, 2, 8, 4, 32,
         False, True, 1204.0, "token drop (capacity 1.0, padded), TP overlap, no A2A overlap "
         "(run_script.py at fa0315ae2)"),
        ("MB25.11 Qwen3 235B-A22B 256xH100", MB2511, q235, 256, 2048, 1, 2, 8, 4, 32, True,
         False, 1575.0, "dropless, force-balanced; moe_a2a_overlap, tp_comm_overlap False "
         "(configs/qwen3 at v0.2.0: QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG)"),
        ("MB26.04.01 Qwen3 30B-A3B 16xH100", MB260401, q30, 16, 1024, 1, 1, 1, None, 16,
         False, False, 8960.0, "dropless, force-balanced, EP 16, no A2A overlap, hybridep "
         "flex dispatcher (configs/qwen at v0.4.1: QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1), "
         "priced as DeepEP's hierarchical dispatch (session 40, branch automoe, after the "
         "first run: HybridEP sends a token once per node over RDMA, then NVLink, "
         "DeepEP's docs/README_Hybrid-EP.md) with HybridEP's routing-map all-gather per "
         "forward (session 41, branch qwen3reg: ep_dispatch 'hybridep')"),
        ("MB26.04.01 Qwen3 235B-A22B 256xH100", MB260401, q235, 256, 8192, 1, 2, 8, 4, 32,
         True, False, 1712.0, "dropless, force-balanced; moe_a2a_overlap, tp_comm_overlap False "
         "(configs/qwen at v0.4.1: ..._H100_FP8_CS_V2, GBS 8192)"),
    ]
    runs = []
    for name, src, model, gpus, gbs, mbs, tp, pp, vp, ep, a2a, tpo, tps, what in rows:
        dp = gpus // (tp * pp)
        runs.append(PublishedRun(
            name, src, "Megatron-Core (Megatron-Bridge)", model,
            preset_cluster("dgx-h100", gpus // 8), gbs, 4096, tp, pp, dp, 1, "none", tp > 1,
            _qwen_kernel(a2a, tpo and tp > 1, "hybridep" if "hybridep" in what else "bf16",
                         1.0 if what.startswith("token drop (capacity 1.0") else 0.0),
            "tokens_per_gpu", tps, micro_batches=(mbs,),
            schedules=("interleaved",) if vp else ("1f1b",), virtual_stages=vp, ep=ep,
            # the recipes' expert_tensor_parallel_size, 1 (fa0315ae2: scripts/performance/
            # configs/qwen3/qwen3_235b_a22b_llm_pretrain.yaml h100 num_gpus_256 "etp: 1", set
            # by utils/helpers.py; later tags: configs/qwen BASE_QWEN3_235B_A22B_CONFIG):
            # ep folded over tp x dp (Megatron-Core's folding); at tp 1 the stack's own
            etp=1 if tp > 1 else None,
            dtype="fp8", memory=mem, confident=False,
            note=f"micro-batch {mbs}, TP {tp}, PP {pp}, VP {vp or '-'}, EP {ep} as published; "
                 f"{what}; no recomputation, bf16 reduction (set_qwen3_common_configs). "
                 "Assumed: FP8 current scaling where the table states no precision (25.09); "
                 "routing weights applied in the experts (Megatron-Core >= 0.13)"))
    # DeepSeek-V3 (run_script.py at fa0315ae2, H100 branch): DeepEP with force-balanced
    # routing, MoE A2A overlapped with the other micro-batch (A2A_1F1B, delay_wgrad_compute),
    # overlap_grad_reduce False, recompute_modules [mla_up_proj, mlp], layout
    # "Et|(tt|)*30mL" (one MTP layer: recipes/deepseek/deepseek_v3.py mtp_num_layers=1), BF16
    # AdamW moments and bf16 main gradients (the recipe's optimizer config)
    # DeepEP (flex dispatcher, moe_enable_deepep) with the provider's group-limited routing
    # (DeepSeekV3ModelProvider: 8 groups, group top-k 4 -> 4 nodes at ep 64), read in session
    # 40 (branch automoe) after the row's first run
    # The provider's moe_router_dtype fp32 (src/megatron/bridge/models/deepseek/
    # deepseek_provider.py at fa0315ae2; router_dtype, session 41, branch mcoremoe)
    dsv3 = dataclasses.replace(_mcore_fp8_cs(), expert_imbalance=1.0, ep_overlap=True,
                               overlap_grad_reduce=False, ep_dispatch="deepep", ep_node_limit=4,
                               router_dtype="fp32")
    runs.append(PublishedRun(
        "MB25.09 DSV3 671B 1024xH100 dropless", MB2509, "Megatron-Core (Megatron-Bridge)",
        preset("deepseek-v3").replace(mtp_depth=1), preset_cluster("dgx-h100", 128), 8192, 4096,
        # recompute 'none' (branch mem405): the recipe replaces core_attn by [mla_up_proj,
        # mlp], so Megatron-Core's checkpointed core (now priced: its flash forward again)
        # is not run; the up-projections' recomputation is in the MemoryOptions below
        2, 8, 64, 1, "none", True, dsv3, "tokens_per_gpu", 1297.0, micro_batches=(1,),
        schedules=("interleaved",), virtual_stages=4, ep=64, dtype="fp8",
        # fa0315ae2: scripts/performance/configs/deepseek/deepseek_v3_llm_pretrain.yaml h100
        # num_gpus_1024 "etp: 1" (and recipes/deepseek/deepseek_v3.py model_config's 1)
        etp=1,
        memory=MemoryOptions(framework="megatron", recompute_up_proj=True, bf16_moments=True,
                             moe_weighted_act=True), confident=False,
        note="TP 2, PP 8, VP 4, EP 64, micro-batch 1, GBS 8192 as published; DeepEP force-"
             "balanced, A2A overlap, no DP overlap, MLA up-projection recompute, one MTP "
             "layer, BF16 moments (run_script.py and recipes/deepseek/deepseek_v3.py at "
             "fa0315ae2); DeepEP priced as DeepEP with 4-node group-limited routing "
             "(session 40, branch automoe, after the first run). Not expressible: "
             "recompute_modules [mla_up_proj, mlp] (replacing the default core_attn) is "
             "priced as no recomputation with the up-projections recomputed (MemoryOptions; "
             "'selective' until branch mem405 priced its core forward); 'mlp' recomputes the dense MLP submodule only (Megatron-Core's "
             "recompute_modules doc; 'moe' would be the MoE layer): the 3 dense blocks' MLPs, "
             "not priced (the attention core's recompute costs this row nothing: the same "
             "step with --recompute none, read in session 40); the custom layout "
             "Et|(tt|)*30mL (the planner's own split). "
             "Assumed: FP8 current scaling (the figure outside the parentheses)"))
    return runs


def automodel() -> list[PublishedRun]:
    """AM rows: NeMo AutoModel's FSDP2 over Hugging Face-shaped models with Transformer Engine
    attention, Linear and RMSNorm (BackendConfig attn/linear/rms_norm 'te', rope_fusion) and
    DeepEP, the fake balanced gate ('Fake balanced gate is enabled'), full activation
    checkpointing (activation_checkpointing: true wraps each block), FSDP2 reduce in fp32
    (components/moe/parallelizer.py apply_fsdp's MixedPrecisionPolicy reduce_dtype float32),
    torch.optim.Adam (foreach) for the MoE configs. Stack: the MoE rows are the
    nemo-automodel preset as it runs a mixture of experts (frameworks.for_model) plus their
    fake gate and bf16 cross-entropy; the Llama 3.1 70B row is the torchtitan@2025 preset
    (FSDP2, the same torch.distributed pieces) compiled, as before."""
    from meshtron.planner.frameworks import PRESETS, for_model

    fw = PRESETS["torchtitan@2025"]
    # the nemo-automodel preset as it runs a mixture of experts (its moe_path: TE kernels,
    # DeepEP, reduce in fp32, the bf16 model, experts outside FSDP2 on a one-rank ep_shard
    # group; framework_presets.py), plus these runs' own settings: the fake balanced gate
    # (BackendConfig.fake_balanced_gate: every rank's experts equally loaded, contiguous
    # experts per token) and MaskedCrossEntropy(fp32_upcast=False)
    am_moe = for_model(PRESETS["nemo-automodel@2025"], preset("deepseek-v3"))
    te = dataclasses.replace(am_moe.kernel, expert_imbalance=1.0, expert_routing="contiguous")
    am_mem = dataclasses.replace(am_moe.memory, loss="eager-bf16")
    # GA: the summary's gradient-accumulation column (docs/performance-summary.mdx: "number of
    # local-batches before optimizer step"); with PP each local batch of LBS/MBS micro-batches
    # is one schedule.step (recipes/llm/train_ft.py _run_train_optim_step), so GA schedule
    # calls per step (Plan.pipeline_runs); without PP it is plain accumulation
    rows = [  # name, model, gpus, GBS, MBS, pp, vp, ep, GA, tokens/s/GPU
        ("AM DSV3 671B 1024xH100", preset("deepseek-v3"), 1024, 8192, 1, 4, 8, 64, 4, 865.0),
        ("AM DSV3 671B 256xH100", preset("deepseek-v3"), 256, 512, 1, 4, 8, 64, 1, 1002.0),
        ("AM Kimi K2 256xH100", preset("kimi-k2"), 256, 512, 1, 8, 4, 32, 2, 924.0),
        ("AM Qwen3 30B-A3B 8xH100", preset("qwen3-30b-a3b"), 8, 512, 4, 1, None, 8, 16,
         12040.0),
    ]
    runs = []
    for name, model, gpus, gbs, mbs, pp, vp, ep, ga, tps in rows:
        dp = gpus // pp
        runs.append(PublishedRun(
            name, AM, "NeMo AutoModel FSDP2 (TE + DeepEP)", model,
            preset_cluster("dgx-h100", gpus // 8), gbs, 4096, 1, pp, dp, 3, "full", False, te,
            "tokens_per_gpu", tps, micro_batches=(mbs,),
            schedules=("interleaved",) if vp else ("1f1b",), virtual_stages=vp, ep=ep,
            memory=am_mem, confident=False, pipeline_runs=ga if pp > 1 else 1,
            note=f"BF16, GBS {gbs}, MBS {mbs}, PP {pp}, VP {vp or '-'}, EP {ep}, FSDP {dp}, "
                 f"GA {ga} as "
                 "published (interleaved1f1b where PP > 1: the yaml's pp_schedule); full "
                 "activation checkpointing, fake balanced gate, torch Adam as the "
                 "examples/llm_benchmark yamls set them. Assumed: no MTP module (Hugging "
                 "Face's DeepSeek-V3 has none), DeepEP not overlapped (dispatcher_async_"
                 "dispatch False); the torchtitan@2025 memory layout. Read after the first "
                 "run (session 40, branch automoe; calibration since): the bf16 model "
                 "(param_dtype), experts outside FSDP2 where ep_shard is one rank, DeepEP's "
                 "deduplicated dispatch of the fake gate's contiguous experts, the bf16 "
                 "cross-entropy (MaskedCrossEntropy fp32_upcast false). With PP the "
                 "schedule runs GA times per step, LBS/MBS micro-batches each (pipeline_runs, "
                 "branch pprounds, session 40). Not expressible: "
                 "reshard_after_forward False priced as the row's ZeRO-3"))
    # Llama 3.1 70B (custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml): FSDP2 with CP 2 over
    # SDPA, torch.compile, fp32 RMSNorm in torch, TE FusedAdam, full activation checkpointing
    compiled = dataclasses.replace(fw.kernel, stack="compiled", optimizer="fused")
    runs.append(PublishedRun(
        "AM Llama3 70B 64xH100 CP2", AM, "NeMo AutoModel FSDP2 compile", preset("llama3-70b"),
        preset_cluster("dgx-h100", 8), 128, 8192, 1, 1, 32, 3, "full", False, compiled,
        "tokens_per_gpu", 866.77, micro_batches=(1,), cp=2, memory=fw.memory, confident=False,
        note="BF16, GBS 128, local batch 1, CP 2, FSDP 32 as published; torch.compile, SDPA, "
             "full activation checkpointing, FSDP2 prefetch, TE FusedAdam (the yaml). "
             "Assumed: PyTorch's ring context parallelism (the preset's torch_ring), the "
             "torchtitan@2025 memory layout"))
    return runs


def torchtitan_h200() -> list[PublishedRun]:
    """TTH200: Llama 3.1 8B with torchtitan on 4 and 8 nodes of 8 H200 (400 Gb/s per GPU),
    FSDP over all GPUs, local batch 2, sequence 8192 and per-op selective AC (llama3_8b.toml at
    e7c0cae), torch.compile, float8 tensorwise (converters float8, recipe unset), with FSDP
    float8 all-gathers and precomputed scales."""
    from meshtron.planner.frameworks import PRESETS

    fw = PRESETS["torchtitan@2025"]
    kernel = dataclasses.replace(fw.kernel, stack="compiled", fp8_scaling="torchao-tensorwise")
    return [PublishedRun(
        f"TTH200 Llama3.1 8B FSDP{8 * nodes} compile+fp8", TTH200, "torchtitan FSDP2 compile",
        preset("llama3-8b"), preset_cluster("dgx-h200", nodes), 2 * 8 * nodes, 8192, 1, 1,
        8 * nodes, 3, "half", False, kernel, "tokens_per_gpu", tps, micro_batches=(2,),
        dtype="fp8", memory=fw.memory, confident=False,
        note="local batch 2, torch.compile, float8 (tensorwise) as published; sequence 8192 "
             "and selective AC (op) from train_configs/llama3_8b.toml at e7c0cae. Not "
             "expressible: enable_fsdp_float8_all_gather (priced as bf16 gathers: the "
             "torchao-tensorwise scaling of torchtitan's rows), "
             "force_recompute_fp8_weight_in_bwd. Assumed: datasheet H200 clocks, "
             "the output layer in bf16 (filter_fqns ['output'])")
        for nodes, tps in ((4, 10938.0), (8, 10753.0))]


def added_s40() -> list[PublishedRun]:
    """The validation rows of session 40 (module docstring)."""
    return megatron_bridge_dense() + megatron_bridge_moe() + automodel() + torchtitan_h200()
