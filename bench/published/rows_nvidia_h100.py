"""Validation rows of NVIDIA's own H100 tables, added in session 39 (issue 30) from their sources
before any of them was run through the planner (sources in runs.py: MC24, NM24.07):

* MC24: Megatron-LM's README weak-scaling table (GPT models of 1.7B to 462B, bf16, DGX-H100);
* NM24.07: NeMo's performance summary of the 24.07 container (FP8 pre-training, DGX-H100).

Every field the source gives is taken as given; every other one is the stack's documented
default, named "assumed" in the row's note. No row here steered a choice (none was looked at
before the table was run once): validation part (runs.ADDED_S39), except the NM24.07 rows,
whose memory breakdowns were examined afterwards (branch nemomem): calibration (runs.LOOKED_AT)."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.memory import MemoryOptions
from bench.published.table import PublishedRun, gpt_model


def _mcore_2024():
    """Megatron-Core 0.7-0.8 (mid 2024) as the megatron@2024 preset states it, with the layer
    split of that time: num_layers // pp per stage and // (pp * v) per chunk ('megatron-even';
    the embedding/loss-aware and uneven splits arrived in 2025, Megatron-LM ef490839e8)."""
    from meshtron.planner.frameworks import PRESETS

    fw = PRESETS["megatron@2024"]
    mem: MemoryOptions = dataclasses.replace(fw.memory, pipeline_split="megatron-even")
    return fw.kernel, mem


def mcore_flops_per_sequence(model: ModelSpec, seq: int) -> float:
    """FLOPs per sequence as Megatron-LM logs its per-GPU teraFLOP/s (megatron/training/
    training.py `num_floating_point_operations` at f2e5db402c, 2024-07-15, the commit of the
    README's table): 12 s L h^2 ((1 + g/a + s/h) q/h + f/h * (3/2 if gated) + V / (2 L h)), with
    no recomputation and the whole (non-causal) s x s score matrix counted."""
    h, L = model.hidden, model.layers
    q_ratio = model.heads * model.head_dim / h
    gated = 1.5 if model.mlp == "swiglu" else 1.0
    attn = (1 + model.kv_heads / model.heads + seq / h) * q_ratio
    return 12.0 * seq * L * h * h * (attn + model.ffn_hidden / h * gated
                                     + model.vocab / (2 * L * h))


def megatron_readme() -> list[PublishedRun]:
    """MC24: the "Model table" of NVIDIA/Megatron-LM README.md, Performance Benchmarking
    (images/model_table.png, commit f2e5db402c of 2024-07-15, "New scaling figures on H100
    GPUs"; unchanged at the README of 2026): vocabulary 131,072, sequence 4,096, data-parallel
    48 everywhere, overlap of the DP (--overlap-grad-reduce, --overlap-param-gather), TP
    (--tp-comm-overlap) and PP communication. The published figure is per-GPU teraFLOP/s by
    Megatron's own FLOP count (mcore_flops_per_sequence), converted to tokens per second per
    GPU with that count (free of any FLOP convention of the planner's)."""
    kernel, mem = _mcore_2024()
    rows = [  # size, heads, hidden, layers, tp, pp, gpus, batch, per-GPU TFLOP/s
        ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    ]
    runs = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in rows:
        # untied embeddings: the parameter counts of the table's first column need them
        # (177B: 173.9B in the blocks + 2 x 1.61B of embedding and head; tied it is 175.6B)
        model = gpt_model(f"mcore-gpt-{size}", layers, hidden, heads, vocab=131072, seq=4096,
                          tied=False)
        tps = tflops * 1e12 / mcore_flops_per_sequence(model, 4096) * 4096
        # Megatron-LM's pretrain_gpt.py defaults at that commit (found in session 39's
        # smallgemm, after the first run: these rows are calibration, runs.LOOKED_AT): no
        # --cross-entropy-loss-fusion, and a DDP that scales and NaN-checks each bucket
        opts = dataclasses.replace(kernel, tp_comm_overlap=tp > 1, vocab_parallel_ce=True,
                                   grad_bucket_passes=3)
        runs.append(PublishedRun(
            f"MC24 GPT {size} {gpus}xH100", "MC24 Model table (README.md, f2e5db402c, "
            "2024-07-15)", "Megatron-Core (Megatron-LM)", model,
            preset_cluster("dgx-h100", gpus // 8), batch, 4096, tp, pp, 48, 1, "none", tp > 1,
            opts, "tokens_per_gpu", tps, micro_batches=(1, 2, 4), memory=mem,
            confident=False,
            note=f"{tflops} TFLOP/s per GPU by Megatron's count = {tps:.0f} tokens/s/GPU; "
                 "layout, batch, sequence, vocabulary as published; distributed optimizer "
                 "(--overlap-param-gather needs it); sequence parallel with TP "
                 "(--tp-comm-overlap needs it). Assumed (not stated): bf16 (the MFU column is "
                 "the TFLOP/s over 989), GPT blocks (GeLU MLP of 4h, LayerNorm, biases, "
                 "learned positions: Megatron's defaults), no recomputation and the 1F1B "
                 "schedule (Megatron's defaults), micro-batch searched over 1, 2, 4, DGX-H100 "
                 "nodes"))
    return runs


def _padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's `_vocab_size_with_padding`: rounded up to make_vocab_size_divisible_by x tp
    (NeMo's GPTConfig: make_vocab_size_divisible_by 128)."""
    step = multiple * tp
    return -(-vocab // step) * step


def nemotron_model(name: str, layers: int, hidden: int, ffn: int, heads: int,
                   kv_heads: int) -> ModelSpec:
    """Nemotron-3/4 as NeMo builds it (nemo/collections/llm/gpt/model/nemotron.py at
    9c5c5e9709: NemotronConfig): LayerNorm (zero-centred gamma), squared-ReLU MLP of two
    matrices (costed as the 'gelu' kind: the same GEMMs, a different element-wise function),
    RoPE on half of each head (rotary_percent 0.5, costed as full RoPE), no biases, untied
    embeddings, vocabulary 256,000 (the Nemotron tokenizer), sequence 4,096."""
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=ffn, vocab=256000, max_seq=4096, mlp="gelu", norm="layernorm",
                     position="rope", tied_embeddings=False, bias=False)


UB_TP_OVERLAP = ("GPT3-20B", "LLAMA2-70B", "Nemotron-8B", "Nemotron-22B", "LLAMA3-70B")
"""The NM24.07 rows whose training yaml in NVIDIA/NeMo-Framework-Launcher tag 24.07 (8325688d83)
sets `ub_tp_comm_overlap: true` with sequence_parallel true and tensor_model_parallel_size > 1
(launcher_scripts/conf/training/gpt3/20b.yaml, llama/llama2_70b.yaml, nemotron/
nemotron_8b.yaml, nemotron/nemotron_22b.yaml, llama/llama3_70b.yaml), which the example
scripts of the same tag (examples/training/*/h100/*_fp8*.sh) do not override (llama3_70b_fp8.sh
names its FP8 userbuffers config, ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192): Transformer
Engine's userbuffers TP overlap, KernelOptions.tp_comm_overlap. gpt3/175b.yaml and
nemotron/nemotron_340b.yaml set it false; the tp = 1 rows' yamls false too. Read in session 43
(branch olmocore); session 42 (branch memfix) had found it and left it unapplied."""


def nemo_2407() -> list[PublishedRun]:
    """NM24.07: NVIDIA/NeMo docs/source/performance/performance_summary.md at 9c5c5e9709
    (2024-09-09, "24.07 perf numbers"), Pretraining table: FP8, NeMo 24.07 container,
    DGX-H100; model, GPUs, GBS, MBS, sequence, TP, PP, CP, VP and tokens/s/GPU as published
    (VP 1: no interleaving).

    The gradient buffer's dtype follows the NeMo-Framework-Launcher of the same release (tag
    24.07), whose H100 FP8 example scripts ran these models on NeMo 1.0's Megatron-Core GPT
    with Apex's DistributedFusedAdam (launcher_scripts/conf/training/*/*.yaml: optim
    distributed_fused_adam, contiguous_grad_buffer true, overlap_param_sync true):
    examples/training/gpt/h100/*_fp8_*.sh, llama/h100/llama{2,3}_*_fp8.sh pass
    `+training.model.optim.grad_sync_dtype=bf16` and nemotron/nemotron_340b.yaml sets it,
    so the optimizer's whole-size gradient buffer (apex distributed_fused_adam.py
    `_init_grad_buffer`: torch.zeros([buffer_size], dtype=grad_sync_dtype)) is bf16, 2 bytes
    per parameter, and the data-parallel reduce-scatter runs in bf16; the Nemotron-8B and
    -22B scripts do not pass it (grad_sync_dtype defaults to the fp32 state dtype). The GPT3
    models run with dropout (gpt3/5b, 20b, 175b.yaml: hidden_dropout and attention_dropout
    0.1: Megatron's dropout masks, 1 byte per element of the two hidden-state dropouts). Set on
    2026-12-05 (branch nemomem) after the rows' memory verdicts were seen: these rows are
    calibration from then on (runs.LOOKED_AT)."""
    kernel, mem = _mcore_2024()
    bf16_grads = dataclasses.replace(kernel, fp32_grad_reduce=False)
    gpt = {"5B": (24, 4096, 32), "20B": (44, 6144, 48), "175B": (96, 12288, 96)}
    nemotron = {"8B": (32, 4096, 16384, 32, 32), "22B": (40, 6144, 24576, 48, 48),
                "340B": (96, 18432, 73728, 96, 8)}
    rows = [  # model, gpus, GBS, MBS, seq, tp, pp, cp, vp, tokens/s/GPU
        ("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 1, 23406.0),
        ("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 1, 5851.0),
        ("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 716.0),
        ("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 825.0),
        ("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16934.0),
        ("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8715.0),
        ("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1728.0),
        ("Nemotron-8B", 64, 256, 4, 4096, 2, 1, 1, 1, 12507.0),
        ("Nemotron-22B", 64, 256, 2, 4096, 2, 4, 1, 10, 4312.0),
        ("Nemotron-340B", 128, 32, 1, 4096, 8, 8, 1, 12, 326.0),
        ("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12273.0),
        ("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1524.0),
    ]
    # The optimizer's master weights as NeMo 2.0.0rc1 (the 24.07 container's NeMo) sets up
    # Apex DistributedFusedAdam (megatron_base_model.py `setup_optimization`): with the
    # launcher's megatron_amp_O2 bf16 model (every row's training yaml) and an fp32 optimizer
    # dtype (no yaml but nemotron_340b.yaml sets one; no 24.07 training script overrides it)
    # store_param_remainders, 2 bytes per parameter; with optim.dtype bf16
    # (nemotron/nemotron_340b.yaml) store_params False and bf16 moments: the bf16 parameters
    # are the master weights. Nemotron-340B's yaml also sets activations_checkpoint_granularity
    # selective (Megatron-Core's checkpointed core attention); the others' null. Read on
    # 2026-12-05 (branch mem405, after the 20B and 340B rows' memory verdicts were seen).
    yaml = {"Nemotron-340B": (dict(master_weights="none", bf16_moments=True), "selective")}
    runs = []
    for name, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps in rows:
        family, size = name.split("-")
        row_mem, recompute = yaml.get(name, (dict(master_weights="remainders"), "none"))
        if family == "GPT3":
            L, h, a = gpt[size]
            # NeMo's GPTConfig (gpt/model/base.py at 9c5c5e9709): tied embeddings, learned
            # positions, GeLU, LayerNorm, biases; the GPT-2 BPE vocabulary of 50,257, padded
            model = gpt_model(f"nemo-gpt3-{size.lower()}", L, h, a,
                              vocab=_padded_vocab(50257, tp), seq=2048, tied=True)
            what = "GPT blocks as NeMo's GPTConfig, vocabulary 50,257 padded for tp"
        elif family == "Nemotron":
            L, h, f, a, g = nemotron[size]
            model = nemotron_model(f"nemotron-{size.lower()}", L, h, f, a, g)
            what = ("Nemotron3Config8B / Nemotron4Config22B / 340B shapes "
                    "(nemotron.py at 9c5c5e9709); squared ReLU costed as GeLU, half RoPE as RoPE")
        else:
            model = preset(f"{family.lower()}-{size.lower()}")
            what = "the model preset"
        dp = gpus // (tp * pp * cp)
        opts = kernel if family == "Nemotron" and size != "340B" else bf16_grads
        if name in UB_TP_OVERLAP:  # the launcher yaml's ub_tp_comm_overlap (tp > 1, sp on)
            opts = dataclasses.replace(opts, tp_comm_overlap=True)
        if family == "GPT3":  # the launcher's gpt3/*.yaml: hidden_dropout, attention_dropout 0.1
            opts = dataclasses.replace(opts, dropout=True)
        runs.append(PublishedRun(
            f"NM24.07 {name} {gpus}xH100", "NM24.07 Pretraining table (performance_summary.md "
            "at 9c5c5e9709, 2024-09-09)", "Megatron-Core (NeMo 24.07)", model,
            preset_cluster("dgx-h100", gpus // 8), gbs, seq, tp, pp, dp, 1, recompute, tp > 1,
            opts,
            "tokens_per_gpu", tps, micro_batches=(mbs,),
            schedules=("interleaved",) if vp > 1 else ("1f1b",),
            virtual_stages=vp if vp > 1 else None, cp=cp, dtype="fp8",
            memory=dataclasses.replace(mem, **row_mem),
            confident=False,
            note=f"FP8, micro-batch {mbs}, VP {vp} as published; {what}. Assumed (not "
                 "stated): the megatron@2024 preset's defaults (Transformer Engine delayed "
                 "scaling"
                 + ("; TP communication overlap on: the launcher yaml's ub_tp_comm_overlap "
                    "true, tag 24.07, set in session 43" if name in UB_TP_OVERLAP else
                    ", no TP communication overlap: the launcher yaml's ub_tp_comm_overlap "
                    "false")
                 + "), sequence parallel with TP and the "
                 "distributed optimizer as NeMo's recipes of that commit set them "
                 "(recipes/llama3_70b.py sequence_parallelism=True, recipes/optim/adam.py "
                 "use_distributed_optimizer=True), "
                 + ("selective recomputation and bf16 optimizer state (its launcher yaml), "
                    if recompute != "none" else "no recomputation (NeMo's default), ")
                 + ("Apex's param remainders (NeMo's rule for an fp32 optimizer), "
                    if row_mem.get("master_weights") == "remainders" else "")
                 + "gradient buffer dtype as the 24.07 launcher's FP8 example scripts set it "
                 "(grad_sync_dtype bf16 except Nemotron-8B/22B) and GPT3's dropout 0.1 "
                 "(set after the memory verdicts were seen), "
                 "datasheet clocks (the summary's 'vboost' commits raised the clock "
                 "boost, which the catalogue cannot state)"))
    return runs


def nvidia_h100() -> list[PublishedRun]:
    return megatron_readme() + nemo_2407()
