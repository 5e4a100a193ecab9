"""Validation rows added in session 42 (issue 30, branch valrows4), every input fixed from its
source before the table was first run with them (runs.ADDED_S42):

* DGXC2504: NVIDIA/dgxc-benchmarking release v25.04 (tag v25.04, 741c886025), the "Expected
  Performance" tables of the H100 pre-training recipes llama3.1/README.md, nemotron/README.md
  and nemo_megatron/README_175b.md: seconds per step and tokens per second at each GPU count,
  BF16 and FP8. Llama 3.1 and Nemotron-4 ran on NeMo 2.0 (container nemo:25.02.01; NeMo at
  d2b21556f2, Megatron-Core at ee6737da82, both pinned by the recipes' setup.sh): NeMo's
  scripts/performance/llm/pretrain_llama31.py as the release ships it (llama3.1/
  pretrain_llama31.py, llama31_utils.py: the layouts) and pretrain_nemotron4_{15b,340b}.py
  with nemotron/launch.sh's overrides. GPT-3 175B ran on NeMo 1.0's launcher in the 24.12
  container (nemo_megatron/launch.sh FW_VERSION, configure.sh, cfg/gpt3_175b_hydra.yaml:
  the v24.11.1 recipe of rows_2026.py with virtual stages 6 instead of 12).

Which rows, by a rule set before any was run (the one session 41 used): for every v25.04 H100
recipe, BF16 and FP8 at the smallest and the largest GPU count at which the whole model runs
(405B: 512 and 2,048; its 32- / 64- / 128-GPU columns are 8-, 30- and 62-layer proxies). The
release's earlier stack (v24.11.1, NeMo 1.0 for every model) is in rows_2026.py; here the
Llama and Nemotron layouts and software differ (NeMo 2.0, Megatron-Core's own distributed
optimizer, 70B FP8 at PP 8 / CP 1, 405B at PP 8 / VP 8 with GBS GPUs / 2, Nemotron-4 15B at
TP 2 / MBS 2, 340B at GBS GPUs / 4). Figures: the published tokens per second over the GPUs
(each equals sequence x global batch / step time of the same table).

Whatever the source states is taken as stated; every other input is the stack's documented
default or the recipe's value, named "assumed" in the row's note. No row here has steered a
choice: validation part."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.kernel_options import KernelOptions
from meshtron.planner.memory import MemoryOptions
from bench.published.rows_2026 import _dfa_master, _model as _nemo1_model, _nemo1_stack
from bench.published.rows_nvidia_h100 import _padded_vocab, nemotron_model
from bench.published.table import PublishedRun

DGXC2504 = ("DGXC2504 NVIDIA/dgxc-benchmarking v25.04 (741c886025) Expected Performance, H100: "
            "{readme}")

NOT_EXPRESSIBLE = {
    "DGXC v25.04 Llama 3.1 405B on 32 / 64 / 128 H100": "proxy runs of 8, 30 and 62 of the "
        "126 layers (llama3.1/llama31_utils.py llama31_auto_configs), not the published model",
    "DGXC v25.04 Grok-1 314B": "no Grok-1 model preset (mixture of 8 experts with its own "
        "attention and logit soft-capping)",
    "DGXC v25.04 maxtext Llama2 70B": "JAX stack, not torch.distributed: no framework preset",
    "DGXC v25.04 ft_llama3 8B / 70B fine-tuning": "not read: fine-tuning recipes (SFT / LoRA "
        "on packed sequences) are not a plan input (rows_2026.NOT_EXPRESSIBLE)",
}
"""Rows of the session-42 source the command line cannot express (or that were left out), and
why."""


def _nemo2_stack(tp: int, fp8: bool) -> KernelOptions:
    """NeMo 2.0's Megatron-Core GPT as the v25.04 recipes run it (NeMo d2b21556f2, Megatron-Core
    ee6737da82), over the megatron@2024 preset (Transformer Engine, cuDNN fused attention:
    NVTE_FUSED_ATTN=1 in llama31_utils.py's executor and NeMo's PerfEnvPlugin):
    - gradients reduced in bf16: every recipe's pretrain_performance_optimizations sets
      grad_reduce_in_fp32 False (recipes/llama3_8b.py, llama3_70b.py, llama31_405b.py,
      nemotron4_15b.py, nemotron4_340b.py), and for FP8 the scripts set it again after
      bf16_with_fp8_mixed();
    - FP8: bf16_with_fp8_mixed (recipes/precision/mixed_precision.py): fp8 'hybrid', delayed
      scaling with amax history 1024 'max' (te-delayed, the preset's), fp8_params True (FP8
      parameters gathered in FP8);
    - TP communication overlap with sequence parallel where TP > 1 (MegatronCommOverlapCallback
      tp_comm_overlap True in the 70B / 405B / Nemotron-4 recipes; set_primary_perf_configs:
      sequence_parallel = tp > 1);
    - the DDP of the recipes' trainer (overlap_grad_reduce, overlap_param_gather,
      average_in_collective, check_for_nan_in_grad all True): Megatron-Core's start_grad_sync
      (distributed/param_and_grad_buffer.py at ee6737da82) reads every bucket once for the
      NaN check (check_grads) and does not scale it (the scaling factor is 1 when averaging in
      the collective): grad_bucket_passes 1."""
    from meshtron.planner.frameworks import PRESETS

    return dataclasses.replace(PRESETS["megatron@2024"].kernel, fp32_grad_reduce=False,
                               tp_comm_overlap=tp > 1, fp8_param_gather=fp8,
                               grad_bucket_passes=1)


def _nemo2_model(family: str, tp: int) -> ModelSpec:
    """The models as NeMo 2.0 builds them (nemo/collections/llm/gpt/model/llama.py and
    nemotron.py at d2b21556f2): Llama 3 / 3.1 with num_query_groups 8 (Llama3Config; the 405B
    too, unlike v24.11.1's yaml), the vocabulary padded to make_vocab_size_divisible_by (128)
    x tp; Nemotron4Config15B / 340B (32 / 96 layers, hidden 6,144 / 18,432, FFN 24,576 /
    73,728, 48 / 96 heads, 8 query groups, the null tokenizer's 256,000 entries, a multiple of
    128 x 8)."""
    if family.startswith("llama"):
        base = preset(family)
        return base.replace(vocab=_padded_vocab(base.vocab, tp))
    if family == "nemotron4-15b":
        return nemotron_model("nemotron4-15b", 32, 6144, 24576, 48, 8)
    return nemotron_model("nemotron4-340b", 96, 18432, 73728, 96, 8)


# family, readme, seq, {dtype: (tp, pp, cp, vp)}, mbs, GBS per GPU, layer split,
# {dtype: [(GPUs, published tokens/s of the whole run)]}
_NEMO2 = [
    # llama31_auto_configs: GBS 16 x GPUs, TP 1, PP 1, CP 2, MBS 1
    ("llama3-8b", "llama3.1/README.md", 8192, {"bf16": (1, 1, 2, None), "fp8": (1, 1, 2, None)},
     1, 16, "megatron-even",
     {"bf16": [(8, 85459.0), (128, 1360683.0)], "fp8": [(8, 112388.0), (128, 1758618.0)]}),
    # GBS 2 x GPUs, TP 4, VP 5; PP 4 / CP 2 (BF16), PP 8 / CP 1 (FP8)
    ("llama3-70b", "llama3.1/README.md", 8192, {"bf16": (4, 4, 2, 5), "fp8": (4, 8, 1, 5)},
     1, 2, "megatron-even",
     {"bf16": [(64, 71526.0), (2048, 2288843.0)], "fp8": [(64, 106346.0), (2048, 3305855.0)]}),
    # GBS GPUs / 2, TP 8, PP 8, CP 2, VP 8; llama31_405b.py: account_for_embedding /
    # account_for_loss_in_pipeline_split True
    ("llama3-405b", "llama3.1/README.md", 8192, {"bf16": (8, 8, 2, 8), "fp8": (8, 8, 2, 8)},
     1, 0.5, "megatron-ends",
     {"bf16": [(512, 106024.0), (2048, 422175.0)], "fp8": [(512, 169535.0), (2048, 667883.0)]}),
    # nemotron/launch.sh: TP 2, PP 1, CP 1, MBS 2, GBS 4 x GPUs
    ("nemotron4-15b", "nemotron/README.md", 4096, {"bf16": (2, 1, 1, None),
                                                   "fp8": (2, 1, 1, None)},
     2, 4, "megatron-even",
     {"bf16": [(16, 98550.0), (2048, 12069940.0)], "fp8": [(16, 132396.0), (2048, 16054752.0)]}),
    # nemotron/launch.sh: TP 8, PP 8, CP 1, VP 12 (the README's layout table says NA), MBS 1,
    # GBS GPUs / 4
    ("nemotron4-340b", "nemotron/README.md", 4096, {"bf16": (8, 8, 1, 12),
                                                    "fp8": (8, 8, 1, 12)},
     1, 0.25, "megatron-even",
     {"bf16": [(256, 60125.0), (2048, 473398.0)], "fp8": [(256, 89469.0), (2048, 687591.0)]}),
]

_LABEL = {"llama3-8b": "Llama3.1 8B", "llama3-70b": "Llama3.1 70B",
          "llama3-405b": "Llama3.1 405B", "nemotron4-15b": "Nemotron4 15B",
          "nemotron4-340b": "Nemotron4 340B", "gpt3-175b": "GPT3 175B"}


def _nemo2_note(family: str, dtype: str, layout: tuple, mbs: int, gbs: int, seq: int,
                split: str, gpus: int, tokens_s: float) -> str:
    tp, pp, cp, vp = layout
    return (f"{dtype.upper()}, TP {tp}, PP {pp}, CP {cp}, VP {vp or '-'}, micro-batch {mbs}, "
            f"GBS {gbs}, sequence {seq} as published ({tokens_s:.0f} tokens/s on {gpus} GPUs); "
            "NeMo 2.0 (nemo:25.02.01, NeMo d2b21556f2, Megatron-Core ee6737da82): Megatron-"
            "Core's distributed optimizer (fp32 master weights and moments), bf16 gradient "
            "reduction (the recipes' performance mode), overlapped grad reduce / param gather "
            "averaged in the collective with the NaN check (one pass over each bucket), no "
            "recomputation (the recipes set none), "
            + ("userbuffers TP overlap with sequence parallel, " if tp > 1 else "")
            + ("FP8 parameters (fp8_params), delayed scaling (fp8 'hybrid', amax history "
               "1024), " if dtype == "fp8" else "")
            + f"layer split '{split}'"
            + (" (account_for_embedding / loss_in_pipeline_split)" if split == "megatron-ends"
               else "")
            + ", from the release's scripts and NeMo's recipes at that commit. Assumed: the "
            "megatron@2024 preset's kernels, datasheet clocks"
            + ("; squared ReLU costed as GeLU, half RoPE as RoPE, layernorm1p as LayerNorm"
               if family.startswith("nemotron") else "")
            + ("; not priced: defer_embedding_wgrad_compute" if family in (
                "llama3-70b", "llama3-405b", "nemotron4-340b") else ""))


def dgxc2504_nemo2() -> list[PublishedRun]:
    """DGXC2504's Llama 3.1 and Nemotron-4 rows on NeMo 2.0 (module docstring)."""
    runs = []
    for family, readme, seq, layouts, mbs, gbs_per_gpu, split, points in _NEMO2:
        for dtype, dtype_points in points.items():
            tp, pp, cp, vp = layouts[dtype]
            model = _nemo2_model(family, tp)
            opts = _nemo2_stack(tp, dtype == "fp8")
            mem = MemoryOptions(framework="megatron", pipeline_split=split)
            for gpus, tokens_s in dtype_points:
                gbs = round(gbs_per_gpu * gpus)
                dp = gpus // (tp * pp * cp)
                runs.append(PublishedRun(
                    f"DGXC2504 {_LABEL[family]} {gpus}xH100 {dtype.upper()}",
                    DGXC2504.format(readme=readme),
                    "Megatron-Core (NeMo 2.0, 25.02.01)", model,
                    preset_cluster("dgx-h100", gpus // 8), gbs, seq, tp, pp, dp, 1, "none",
                    tp > 1, opts, "tokens_per_gpu", tokens_s / gpus, micro_batches=(mbs,),
                    schedules=("interleaved",) if vp else ("1f1b",), virtual_stages=vp,
                    cp=cp, dtype=dtype, memory=mem, confident=False,
                    note=_nemo2_note(family, dtype, (tp, pp, cp, vp), mbs, gbs, seq, split,
                                     gpus, tokens_s)))
    return runs


def dgxc2504_gpt3() -> list[PublishedRun]:
    """DGXC2504's GPT-3 175B rows: NeMo 1.0's launcher in the 24.12 container, the v24.11.1
    recipe's stack (rows_2026._nemo1_stack, _dfa_master) with cfg/gpt3_175b_hydra.yaml's
    virtual stages 6; configure.sh: GBS 16 x nodes, NVTE_FUSED_ATTN=1."""
    runs = []
    tp, pp, vp, seq = 4, 8, 6, 2048
    model = _nemo1_model("gpt3-175b", tp)
    for dtype, points in (("bf16", [(128, 63099.0), (2048, 988057.0)]),
                          ("fp8", [(128, 93190.0), (2048, 1407485.0)])):
        opts, mem = _nemo1_stack(tp, dtype == "fp8", dropout=True)
        mem = dataclasses.replace(mem, **_dfa_master("gpt3-175b", dtype == "fp8"))
        for gpus, tokens_s in points:
            gbs = 2 * gpus
            dp = gpus // (tp * pp)
            runs.append(PublishedRun(
                f"DGXC2504 GPT3 175B {gpus}xH100 {dtype.upper()}",
                DGXC2504.format(readme="nemo_megatron/README_175b.md"),
                "Megatron-Core (NeMo 24.12, NeMo-Framework-Launcher)", model,
                preset_cluster("dgx-h100", gpus // 8), gbs, seq, tp, pp, dp, 1, "none", True,
                opts, "tokens_per_gpu", tokens_s / gpus, micro_batches=(1,),
                schedules=("interleaved",), virtual_stages=vp, dtype=dtype, memory=mem,
                confident=False,
                note=f"{dtype.upper()}, TP {tp}, PP {pp}, VP {vp}, micro-batch 1, GBS {gbs}, "
                     f"sequence {seq} as published ({tokens_s:.0f} tokens/s on {gpus} GPUs; "
                     "the layout table's GBS 1204 at 512 GPUs is a typo: 2,048 x 1,024 / "
                     "5.774 s is its FP8 figure); NeMo 24.12 container (launch.sh "
                     "FW_VERSION); distributed_fused_adam with grad_sync_dtype bf16, "
                     "overlapped grad / param sync, the master weights NeMo sets up with "
                     "fp8_params (a copy in the optimizer's dtype), userbuffers TP overlap "
                     "with sequence parallel, "
                     + ("FP8 parameters, delayed scaling (fp8_hybrid, amax history 1024), "
                        if dtype == "fp8" else "")
                     + "dropout 0.1, cuDNN fused attention (configure.sh NVTE_FUSED_ATTN=1), "
                     "no recomputation, from cfg/gpt3_175b_hydra.yaml and configure.sh. "
                     "Assumed: the megatron@2024 preset's kernels, Megatron-Core's even layer "
                     "split (megatron-even), Apex DistributedFusedAdam's master-weight rule of "
                     "NeMo v2.0.0 unchanged in the 24.12 container, datasheet clocks"))
    return runs


def added_s42() -> list[PublishedRun]:
    """The validation rows of session 42 (module docstring)."""
    return dgxc2504_nemo2() + dgxc2504_gpt3()
