"""Rows of PyTorch-native stacks (sources in runs.py): Meta's Llama 3 (L3), torchtitan's
benchmarks (TT24, TTA, and the N-D layouts on the Grand Teton H100s) and llm-foundry's MPT
throughput tables (LF)."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import preset
from meshtron.planner import memory
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import KernelOptions
from bench.published.stacks import (LLM_FOUNDRY_AMP, LLM_FOUNDRY_AMP_2023, LLM_FOUNDRY_MEMORY,
                                    LLM_FOUNDRY_PURE, TORCHTITAN_COMPILED, TORCHTITAN_EAGER,
                                    TORCHTITAN_MEMORY)
from bench.published.table import (PublishedRun, a100_40gb, grand_teton_h100_500w,
                                   mpt_model)


def llama3() -> list[PublishedRun]:
    # "FP32 gradient accumulation during backward computation over multiple micro-batches and
    # ... reduce-scatter gradients in FP32 across data parallel workers" (section 3.3.2,
    # numerical stability): a 4-byte gradient buffer over the step, reduced in fp32
    opts = KernelOptions(stack="fused", sharding="zero", separate_projections=False,
                         fp32_grad_reduce=True)
    # Section 3.3.2: one layer fewer on the first and last stages, "the first model chunk on
    # the first stage has only the embedding, and the last model chunk on the last stage has
    # only output projection and loss calculation": chunks of one layer, 8 per rank over
    # pp = 16 (126 + 2 = 16 x 8), the split of Megatron-Core's
    # account_for_embedding/loss_in_pipeline_split ('megatron-ends')
    # ("Our use of FSDP for Llama 3 shards the optimizer states and gradients", same
    # section): FSDP makes a block's fp32 accumulation buffer at its first backward, not a
    # buffer over the whole step as Megatron-Core's (MemoryOptions.grads_at_first_backward)
    mem = dataclasses.replace(memory.options_for(opts), pipeline_split="megatron-ends",
                              grads_at_first_backward=True)
    return [PublishedRun(
        f"Llama3 405B {nodes * 8}", "L3 Table 4", "Meta (Llama 3)", preset("llama3-405b"),
        preset_cluster("dgx-h100", nodes), 2048, 8192, 8, 16, dp, 1, "none", True,
        opts, "model_tflops", tf,
        schedules=("interleaved",), virtual_stages=8, memory=mem,
        note="FlashAttention, SP, no recomputation, ZeRO-1-like sharding, micro-batch 1 "
             "(assumed); interleaved, 8 one-layer chunks per rank, embedding-only first and "
             "loss-only last chunk; fp32 gradient accumulation and reduce-scatter, FSDP's "
             "accumulation buffers made at each block's first backward (section 3.3.2)")
        for nodes, dp, tf in ((1024, 64, 430.0), (2048, 128, 400.0))]


def torchtitan() -> list[PublishedRun]:
    runs = []
    l31 = preset("llama3-8b")
    for gpus, eager, compiled in ((8, 5762.0, 6667.0), (128, 5605.0, 6514.0)):
        for label, opts, tps in (("eager", TORCHTITAN_EAGER, eager),
                                 ("compile", TORCHTITAN_COMPILED, compiled)):
            runs.append(PublishedRun(
                f"TT Llama3.1 8B {gpus} {label}", f"TT24 Table {1 if gpus == 8 else 3}",
                f"torchtitan FSDP2 {label}", l31, grand_teton_h100_500w(gpus // 8), 2 * gpus,
                8192, 1, 1, gpus, 3, "half", False, opts, "tokens_per_gpu", tps,
                micro_batches=(2,), memory=TORCHTITAN_MEMORY,
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
            TORCHTITAN_EAGER, "tokens_per_gpu", tps, micro_batches=(lb,), memory=TORCHTITAN_MEMORY,
            note="network not stated: 8 x 200 Gb/s per node assumed; 'selective op' costed "
                 "as every second layer recomputed"))
    return runs


def torchtitan_nd() -> list[PublishedRun]:
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
            memory=TORCHTITAN_MEMORY,
            published_memory_gib=mem, note="local batch 1; Float8; 500 W peak assumed 912"))
    for label, opts, tps, mem in (("2D", TORCHTITAN_COMPILED, 829.0, 71.9),
                                  ("2D+AsyncTP", async_tp, 876.0, 67.6)):
        runs.append(PublishedRun(
            f"TT 70B FSDP32 TP8 {label}", src.format(4), "torchtitan FSDP2 compile", l31_70b,
            grand_teton_h100_500w(32), 512, 8192, 8, 1, 32, 3, "full", True, opts,
            "tokens_per_gpu", tps, micro_batches=(16,), dtype="fp8",
            memory=TORCHTITAN_MEMORY, published_memory_gib=mem,
            note="local batch 16; Float8; sequence parallel with TP (torchtitan's default)"))
    for sched, tps, mem in (("1f1b", 100.0, 82.5), ("interleaved", 128.0, 72.7)):
        runs.append(PublishedRun(
            f"TT 405B FSDP8 TP8 PP8 {sched}", src.format(5), "torchtitan FSDP2 compile",
            l31_405b, grand_teton_h100_500w(64), 256, 8192, 8, 8, 8, 3, "full", True, async_tp,
            "tokens_per_gpu", tps, micro_batches=(4,), schedules=(sched,), dtype="fp8",
            virtual_stages=2 if sched == "interleaved" else None, published_memory_gib=mem,
            memory=TORCHTITAN_MEMORY,
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
            memory=TORCHTITAN_MEMORY,
            published_memory_gib=mem, note="local batch 8, 1F1B; Float8 + AsyncTP"))
    return runs


def llm_foundry() -> list[PublishedRun]:
    # layers, hidden, heads of scripts/train/yamls/pretrain/mpt-*.yaml (30b: 56 heads of 128)
    mpt = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32),
           "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
    # size, seq, gpus, gpu preset, micro-batch, grad accumulation, global batch, activation
    # checkpointing, ZeRO stage (3 FULL_SHARD, 2 SHARD_GRAD_OP), precision, T/s/GPU,
    # attn_impl. attn_impl: the >= 128-GPU H100 table's runs are scripts/train/benchmarking/
    # sweep.py's (llm-foundry #838, January 2024: `--attn_impl flash` for 1b, 3b, 7b and 70b,
    # `triton` for 13b and 30b, flash-attn 2.4.2 from the `gpu-flash2` extra); the 8-GPU rows
    # are sweep.sh's (#543, October 2023), which passes no --attn_impl: submit_benchmarks.py's
    # default 'triton'.
    rows = [
        ("70b", 2048, 512, "dgx-h100", 8, 1, 4096, True, 3, "amp", 1007.0, "flash"),
        ("70b", 2048, 128, "dgx-h100", 8, 1, 1024, True, 3, "amp", 1058.0, "flash"),
        ("30b", 2048, 512, "dgx-h100", 8, 1, 4096, True, 3, "amp", 2115.0, "triton"),
        ("13b", 2048, 512, "dgx-h100", 16, 1, 8192, True, 3, "amp", 4952.0, "triton"),
        ("7b", 2048, 512, "dgx-h100", 6, 1, 3072, False, 3, "amp", 9670.0, "flash"),
        ("7b", 2048, 128, "dgx-h100", 6, 1, 768, False, 3, "amp", 10475.0, "flash"),
        ("3b", 2048, 512, "dgx-h100", 8, 1, 4096, False, 2, "amp", 21664.0, "flash"),
        ("1b", 2048, 512, "dgx-h100", 12, 1, 6144, False, 2, "amp", 39837.0, "flash"),
        ("7b", 2048, 8, "dgx-h100", 6, 1, 48, False, 3, "amp", 10643.0, "triton"),
        ("13b", 2048, 8, "dgx-h100", 2, 1, 16, False, 3, "amp", 4792.0, "triton"),
        ("7b", 8192, 8, "dgx-h100", 8, 2, 128, True, 3, "amp", 6935.0, "triton"),
        ("7b", 2048, 8, "dgx-a100", 6, 2, 96, False, 3, "amp", 4641.0, "triton"),
        ("13b", 2048, 8, "dgx-a100", 2, 3, 48, False, 3, "amp", 2262.0, "triton"),
        ("30b", 2048, 8, "dgx-a100", 3, 21, 504, True, 3, "amp", 916.0, "triton"),
        ("70b", 2048, 64, "dgx-a100", 8, 4, 2048, True, 3, "pure", 410.0, "triton"),
        ("70b", 2048, 128, "a100-40gb", 4, 1, 512, True, 3, "pure", 376.0, "triton"),
        ("13b", 2048, 128, "a100-40gb", 16, 1, 2048, True, 3, "pure", 1972.0, "triton"),
        ("7b", 2048, 128, "a100-40gb", 18, 1, 2304, True, 3, "pure", 3623.0, "triton"),
    ]
    runs = []
    for size, seq, gpus, kind, mb, ga, gbs, ac, zero, prec, tps, attn in rows:
        L, h, a = mpt[size]
        if kind == "a100-40gb":
            cl = a100_40gb(max(1, gpus // 8))
            table = "A100 40GB, 1600 Gbps RoCE per node"
        else:
            cl = preset_cluster(kind, max(1, gpus // 8))
            table = ("H100 80GB" if kind == "dgx-h100" else "A100 80GB, 1600 Gbps RoCE per node")
        gpu = "H100" if kind == "dgx-h100" else "A100"
        # 'flash': flash-attn's varlen kernel behind bert_padding (KernelOptions.flash_unpad);
        # 'triton': llm-foundry's 2022 Triton FlashAttention under triton-pre-mlir, whose
        # compiler issues Ampere's mma.sync only: half the bf16 peak on H100
        # (KernelOptions.flash_isa 'sm80', planner/flash_isa.py; unchanged on A100)
        # the >= 128-GPU rows ran Composer 0.17.2 (January 2024), the 8-GPU ones 0.16.x
        # (October 2023, llm-foundry v0.3.0): stacks.py
        opts = (LLM_FOUNDRY_PURE if prec == "pure" else
                LLM_FOUNDRY_AMP if gpus >= 128 else LLM_FOUNDRY_AMP_2023)
        opts = dataclasses.replace(opts, flash_unpad=attn == "flash",
                                   flash_isa="sm80" if attn == "triton" else "native")
        runs.append(PublishedRun(
            f"LF MPT-{size} s{seq} {gpus}x{gpu}", f"LF, {table} table", "llm-foundry FSDP",
            mpt_model(f"mpt-{size}", L, h, a, seq), cl, gbs, seq, 1, 1, gpus, zero,
            "full" if ac else "none", False, opts, "tokens_per_gpu", tps,
            micro_batches=(mb,), memory=LLM_FOUNDRY_MEMORY,
            note=f"micro-batch {mb} x {ga} accumulation; "
                 f"{'SHARD_GRAD_OP' if zero == 2 else 'FULL_SHARD'}; {prec}; attn_impl {attn}"))
    return runs


def torchtitan_float8_1d() -> list[PublishedRun]:
    """TT24 Tables 1 and 3, the "FSDP + torch.compile + Float8" rows the torchtitan() rows
    above left out (added in session 39 before they were ever run: validation): Llama 3.1 8B,
    FSDP on 8 and 128 of the 500 W Grand Teton H100s, local batch 2, selective (op)
    activation checkpointing as the tables state; torchao Float8 with torchtitan's default
    recipe of the time (tensorwise, TORCHTITAN_COMPILED's fp8_scaling)."""
    l31 = preset("llama3-8b")
    return [PublishedRun(
        f"TT Llama3.1 8B {gpus} compile+fp8", f"TT24 Table {1 if gpus == 8 else 3}",
        "torchtitan FSDP2 compile", l31, grand_teton_h100_500w(gpus // 8), 2 * gpus, 8192, 1,
        1, gpus, 3, "half", False, TORCHTITAN_COMPILED, "tokens_per_gpu", tps,
        micro_batches=(2,), dtype="fp8", memory=TORCHTITAN_MEMORY,
        note="local batch 2, selective (op) activation checkpointing, torch.compile, Float8 "
             "(tensorwise, torchtitan's default then); 500 W H100 peak assumed 912 TFLOP/s")
        for gpus, tps in ((8, 8532.0), (128, 8380.0))]


TTA_2506 = ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
            "(June 2025; torchtitan 820504e, torch 38410cf9)")

ROWWISE_1207 = ("TTA_2506's own note: 'the low baseline performance of the vanilla TP float8 "
                "rowwise training is being addressed here: pytorch/torchtitan#1207' (whether "
                "and when it was fixed is not checked here)")


def torchtitan_async_tp_2025() -> list[PublishedRun]:
    """torchtitan's June 2025 async-TP benchmark (TTA_2506), both tables: Llama 3.1 70B on 256
    H100s (FSDP 32, TP 8, torch.compile, full AC, local batch 16) and Llama 3.1 8B on 64 H100s
    (FSDP 8, TP 8, torch.compile, per-op SAC, local batch 12), bf16 and float8 tensorwise /
    rowwise, with vanilla and async TP; the same 500 W Grand Teton H100s as TT24. The stack is
    the torchtitan@2025 preset (fused AdamW and torch.nn.RMSNorm by then) compiled; PyTorch's
    async TP is KernelOptions.async_tp. Added in session 39 before they were ever run:
    validation."""
    from meshtron.planner.frameworks import PRESETS

    fw = PRESETS["torchtitan@2025"]
    compiled = dataclasses.replace(fw.kernel, stack="compiled")
    models = {"70B": (preset("llama3-70b"), 32, 16, "full", "full activation checkpointing"),
              "8B": (preset("llama3-8b"), 8, 12, "half",
                     "per-op selective activation checkpointing (op)")}
    rows = [  # model, quantisation, vanilla TP tokens/s, async TP tokens/s (per GPU)
        ("70B", "bf16", 597.3, 652.4), ("70B", "tensorwise", 809.8, 942.4),
        ("70B", "rowwise", 599.6, 624.8),
        ("8B", "bf16", 4378.0, 4809.4), ("8B", "tensorwise", 5078.1, 5570.1),
        ("8B", "rowwise", 3708.5, 3914.9),
    ]
    runs = []
    for size, quant, vanilla, asynchronous in rows:
        model, fsdp, lb, rec, ac = models[size]
        base = compiled if quant == "bf16" else dataclasses.replace(
            compiled, fp8_scaling=f"torchao-{quant}")
        for label, atp, tps in (("TP", False, vanilla), ("AsyncTP", True, asynchronous)):
            runs.append(PublishedRun(
                f"TT25 {size} FSDP{fsdp} TP8 {quant} {label}", TTA_2506,
                "torchtitan FSDP2 compile", model, grand_teton_h100_500w(fsdp), fsdp * lb, 8192,
                8, 1, fsdp, 3, rec, True, dataclasses.replace(base, async_tp=atp),
                "tokens_per_gpu", tps, micro_batches=(lb,),
                dtype="bf16" if quant == "bf16" else "fp8", memory=fw.memory,
                regression=ROWWISE_1207 if (quant, atp) == ("rowwise", False) else "",
                note=f"local batch {lb}, {ac}, torch.compile, "
                     f"{'bf16' if quant == 'bf16' else 'float8 ' + quant}, "
                     f"{'async' if atp else 'vanilla'} TP as published; 'tokens/sec' read "
                     "as per GPU (torchtitan logs tps per GPU; TT24's 2D row of the same "
                     "layout is 829 per GPU); sequence 8192 (seq_len of train_configs/"
                     "llama3_8b.toml and llama3_70b.toml at 820504e). Assumed: sequence "
                     "parallel with TP (torchtitan's default), "
                     "the loss outside the compiled blocks (the preset's); 500 W peak 912"))
    return runs
