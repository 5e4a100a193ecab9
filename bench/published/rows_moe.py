"""Mixture-of-experts rows with their expert-parallel layouts (sources in runs.py): DeepSeek-V3
on 2,048 H800 (DSV3) and Qwen3-30B-A3B on DGX-H100 through Megatron-Bridge (MB)."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.memory import MemoryOptions
from bench.published.stacks import from_preset
from bench.published.table import PublishedRun, h800


QWEN3_30B_A2A_REGRESSION = (
    "Megatron-Bridge issue #1998 (2026-01-20, '[Regression] Low QWEN3 30B B200 and H100 "
    "performance with dropless': '25.11 is 2X slower than 25.09'; 10,494 tokens/s/GPU with "
    "token drop in 25.09). Fixed in the recipe, not in code: PR #2477 (main 4a6450755, "
    "2026-02-23; r0.3.0 f29a269f8, 2026-02-24; released in v0.3.1, the 26.02.01 container: "
    "docs/releases/known-issues.md 'Fixed in 26.02.01 (r0.3.1)') "
    "moved QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_*_V1 from PP 2 / VP 12 / EP 8 with "
    "moe_a2a_overlap to EP 16, no PP, moe_a2a_overlap False and the HybridEP dispatcher: "
    "9,058 in 26.02.01 (whose table still prints PP 2 VP 12 EP 8), 8,901 / 8,960 in 26.04 / "
    "26.04.01. The one setting both slow runs share and both healthy ones lack is "
    "moe_a2a_overlap (Megatron-Core's merged forward-backward A2A-overlap schedule over the "
    "interleaved pipeline; PR #1760 turned the same option off for Qwen3-235B on B200 'due to "
    "CPU overhead', 20.1 -> 16.9 s a step). No root cause was published, and the same "
    "overlap later sped this model up at EP 16 with HybridEP (PR #5094, 2026-07-25: 240 -> "
    "287 TFLOP/s/GPU, BF16; step 24.7 -> 21.0 s, which the planner prices 23.7 -> 19.4 s), so "
    "the code shows no steady-state cost of the overlap of this size for the planner to "
    "price; the rows are priced with the overlap's gain, like the other ep_overlap rows "
    "(docs/measurements.md#moe-qwen3-regression)")
"""What the Qwen3-30B-A3B 25.11 and 26.02 H100 rows measure (read in session 41, branch
qwen3reg: Megatron-Bridge tags v0.2.0, v0.3.0, v0.3.1, v0.4.1 and the issues named)."""


def moe_runs() -> list[PublishedRun]:
    """Published mixture-of-experts runs with their expert-parallel layouts. Added with their
    sources before the planner ever ran them (issue 21, part 4): validation part; nothing was
    changed after seeing their errors but software facts from the report: DeepSeek-V3's
    GEMMs are blockwise-scaled (section 3.3.2; issue 30, fp8m, with the FP8 GEMM kinds), its
    dispatch all-to-alls carry FP8 (section 3.3.3; issue 30, dsv3, 2026-12-05), and its
    DualPipe schedule, memory savings and MTP module (sections 2.2, 3.2.1, 3.2.3, 3.3.3;
    issue 30, dualpipe, 2026-12-05). The DSV3 row is calibration (runs.LOOKED_AT)."""
    from meshtron.planner.frameworks import PRESETS

    mcore = PRESETS["megatron@2024"].kernel
    # DeepSeek's own stack: Megatron-style fused kernels, DualPipe overlapping both
    # all-to-alls with another micro-batch, node-limited routing to M = 4 nodes with per-node
    # deduplication (DSV3 sections 2.1.2, 3.2.1, 3.2.2); imbalance: the documented default;
    # FP8 GEMMs with 1x128 / 128x128 block scales promoted every 128 k-elements (section 3.3.2);
    # the all-to-alls toward the experts in FP8, the combines in BF16 (section 3.3.3);
    # DualPipe (deepseek-ai/DualPipe: its engine, `pipeline_split = "dualpipe"`), the norms
    # and up-projections recomputed (3.2.3), SwiGLU inputs in FP8 with its output
    # recomputed, the attention output cached once in E5M6 and BF16 AdamW moments (3.3.3),
    # one MTP module (2.2, D = 1 in 4.2); the routing weights applied on the expert side
    # (DeepEP's combine sums unweighted and its backward is a dispatch by the handle:
    # deepseek-ai/DeepEP README, tests/legacy/test_intranode.py; MemoryOptions.moe_weighted_act)
    dsv3 = dataclasses.replace(mcore, ep_overlap=True, ep_node_limit=4, fp8_gemm="blockwise",
                               ep_dispatch="fp8")
    qwen = preset("qwen3-30b-a3b")
    runs = [PublishedRun(
        "DSV3 671B 2048xH800", "DSV3 sections 3.1-3.3 (180K H800 GPU-hours per 1T tokens)",
        "DeepSeek HAI-LLM (DualPipe)", preset("deepseek-v3").replace(mtp_depth=1), h800(256),
        15360, 4096, 1, 16,
        # recompute 'none': what DeepSeek recomputes (norms, up-projections, SwiGLU) is in
        # the MemoryOptions below; 'selective' is Megatron-Core's checkpointed attention
        # core, which the report does not list (and whose flash forward is now priced)
        128, 1, "none", False, dsv3, "tokens_per_gpu", 1e12 / (180e3 * 3600),
        micro_batches=(1, 2), schedules=("dualpipe",), dtype="fp8", ep=64,
        memory=MemoryOptions(framework="megatron", pipeline_split="dualpipe",
                             recompute_norms=True, recompute_up_proj=True,
                             swiglu_recompute=True, attn_out_e5m6=True,
                             bf16_moments=True, moe_weighted_act=True), confident=False,
        note="batch 15,360 x 4,096 (the schedule's plateau); DualPipe (section 3.2.1, "
             "planner/pipeline_dualpipe.py) with overlapped all-to-alls; recomputation of "
             "norms and MLA up-projections, FP8 SwiGLU inputs, the attention output cached "
             "once in E5M6, BF16 moments (sections 3.2.3, 3.3.3: MemoryOptions); routing "
             "weights applied on the expert side, DeepEP's combine unweighted "
             "(moe_weighted_act); multi-head latent attention (the preset's MLA); one MTP module "
             "(section 4.2, D = 1)")]
    # what the rows' recipes set (Megatron-Bridge tags v0.2.0 / v0.3.0, Qwen3-30B-A3B H100 FP8
    # performance recipes, read in issue 30's session 34): FP8 current scaling ("FP8-CS" in the
    # 25.11 table), moe_a2a_overlap on (overlap_moe_expert_parallel_comm), gradients reduced in
    # bf16, no recomputation; corrected from the megatron@2024 defaults, which the rows had
    # before. On the megatron-bridge@2025 preset (which states FP8 current scaling with FP8
    # parameters gathered, TE userbuffers and the weighted SwiGLU of Megatron-Core >= 0.13) as
    # [options]: the performance scripts' no NaN-check norm pass (utils/helpers.py),
    # moe_a2a_overlap and bf16 gradient reduction (configs/qwen3/qwen3_llm_pretrain.py), the
    # tables' forced balance ("In MoE training benchmarks, we force-balance the token
    # distribution among experts": imbalance 1). FP8 parameters as the recipes set them
    # (session 41, branch qwen3reg): utils/helpers.py get_precision_config('fp8_cs') at v0.2.0
    # and configs/qwen/qwen3_llm_pretrain.py at v0.3.0 take training/mixed_precision.py
    # bf16_with_fp8_current_scaling_mixed, fp8_param_gather True, so Transformer Engine keeps no
    # cached FP8 weight copies beside bf16 parameters (memory_acts.te_weight_cache_bytes); the
    # rows had fp8_param_gather False until then, which priced 4.2 GiB of copies the run did not
    # hold and the 25.11 layout at 83.6 GiB on 80 GB GPUs. The 26.02 recipe
    # (QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 at v0.3.0) asks for the flex dispatcher with
    # DeepEP, which recipes/qwen/qwen3_moe.py applies on Hopper (training/
    # flex_dispatcher_backend.py apply_flex_dispatcher_backend: moe_token_dispatcher_type
    # 'flex'): ep_dispatch 'deepep' there; 25.11's config names no backend (alltoall). The layer
    # split is the preset's, Megatron-Core's 'megatron-ends', which the command line priced these
    # rows with before (their memory options named no split, and the table's options file drops an
    # unset field) while the Python path priced the time-balanced one
    qwen_stack = from_preset("megatron-bridge@2025", grad_bucket_passes=0, ep_overlap=True,
                             fp32_grad_reduce=False, reduce_dtype="bf16", expert_imbalance=1.0)
    for ver, gbs, mbs, vp, tps, dispatch in (("25.11", 512, 2, 24, 5275.0, "bf16"),
                                             ("26.02", 1024, 1, 12, 5113.0, "deepep")):
        runs.append(PublishedRun(
            f"MB{ver} Qwen3 30B-A3B 16xH100", f"MB {ver} NeMo container, DGX-H100 table",
            "Megatron-Core (Megatron-Bridge)", qwen, preset_cluster("dgx-h100", 2), gbs, 4096,
            1, 2, 8, 1, "none", False,
            dataclasses.replace(qwen_stack.kernel, ep_dispatch=dispatch), "tokens_per_gpu", tps,
            micro_batches=(mbs,), schedules=("interleaved",), dtype="fp8", virtual_stages=vp,
            ep=8,
            # Megatron-Bridge 25.11 / 26.02 ship Megatron-Core >= 0.13: routing probabilities
            # applied in the experts' weighted SwiGLU (the preset's moe_weighted_act)
            memory=qwen_stack.memory, confident=False,
            regression=QWEN3_30B_A2A_REGRESSION,
            note=f"FP8 current scaling with FP8 parameters, micro-batch {mbs}, VP {vp}, EP 8 as "
                 "published; distributed optimizer (FSDP 0); router force-balanced; A2A overlap, "
                 "bf16 gradient reduction and no recomputation as the recipe sets them; "
                 + ("the all-to-all dispatcher; the v0.2.0 recipe itself sets VP 12 and leaves "
                    "micro-batch 1 (WorkloadBaseConfig's default), the table prints 25.09's 2 "
                    "and 24"
                    if dispatch == "bf16" else "DeepEP (the recipe's flex backend)")))
    return runs
