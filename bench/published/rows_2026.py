"""Validation rows added in session 41 (issue 30, branch valrows3), every input fixed from its
source before the table was first run with them (runs.ADDED_S41):

* DGXC: NVIDIA/dgxc-benchmarking (the DGX Cloud benchmarking recipes), release v24.11.1 at
  35a9aec (its first stored release), the "Expected Performance" tables of the H100 pre-training
  recipes llama3.1/README_{8b,70b,405b}.md, nemotron/README_{15b,340b}.md and
  nemo_megatron/README_175b.md: seconds per step and tokens per second at each GPU count, BF16
  and FP8, on NeMo 1.0's Megatron-Core GPT (NeMo-Framework-Launcher, containers 24.09 and, for
  GPT-3, 24.05). What ran is in the same release: the model yamls (llama3.1/llama3.1_*.yaml,
  nemotron/nemotron4-*-synth.yaml, nemo_megatron/gpt3_175b_hydra.yaml) and the overrides of
  configure.sh / launch.sh.
* DGXC25: the same repository's release v25.05 at 68eaf7e, deepseek_v3/pretraining/README.md
  "H100 Performance" (BF16, 1,024 H100, NeMo 25.04.01), run by NVIDIA/NeMo
  scripts/performance/llm/pretrain_deepseek_v3.py at the commit its setup.sh pins
  (7a8f1cc7bc, llmb-nemo-r2.3.0; Megatron-LM 7094270c6f, Megatron-Core 0.12.2) with the
  launch.sh arguments.

Which rows, by a rule set before any was run: for every v24.11.1 H100 recipe whose table states
the whole layout (Llama 3.1 8B / 70B / 405B, Nemotron-4 15B / 340B, GPT-3 175B), BF16 and FP8
at the smallest and the largest GPU count at which the whole model runs (405B: 576 and 2,304;
below 576 GPUs configure.sh runs a 7-, 21- or 42-layer proxy); and v25.05's one H100 MoE row
(DeepSeek-V3; FP8 "not currently supported" there). Rows of these sources the command line
cannot express are in `NOT_EXPRESSIBLE`. Figures: the published tokens per second over the
GPUs (each equals sequence x global batch / step time of the same table).

Whatever the source states is taken as stated; every other input is the stack's documented
default or the recipe's value, named "assumed" in the row's note. No row here has steered a
choice: validation part."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.memory import MemoryOptions
from bench.published.rows_nvidia_h100 import _mcore_2024, _padded_vocab, nemotron_model
from bench.published.table import PublishedRun, gpt_model

DGXC = ("DGXC NVIDIA/dgxc-benchmarking v24.11.1 (35a9aec) Expected Performance, H100: "
        "{readme}")
DGXC25 = ("DGXC25 NVIDIA/dgxc-benchmarking v25.05 (68eaf7e) deepseek_v3/pretraining/README.md "
          "H100 Performance")

NOT_EXPRESSIBLE = {
    "DGXC v24.11.1 Llama 3.1 405B on 32 / 96 / 192 H100": "proxy runs of 7, 21 and 42 of the "
        "126 layers (llama3.1/configure.sh), not the published model",
    "DGXC v24.11.1 / v25.05 Grok-1 314B": "no Grok-1 model preset (mixture of 8 experts with "
        "its own attention and logit soft-capping); the v24.11.1 H100 table's columns and "
        "step times do not match its layout table",
    "DGXC v25.05 Llama 4 Maverick 400B (512 H100, BF16 and FP8)": "no Llama 4 preset: "
        "alternating dense / MoE layers with a shared expert and chunked attention are not "
        "in the model spec",
    "DGXC v25.05 Nemotron-H": "hybrid Mamba-2 model: no Mamba layer in the model spec",
    "DGXC v24.11.1 maxtext / paxml (Llama2 70B, GPT 5B / 175B)": "JAX stacks, not "
        "torch.distributed: no framework preset",
    "DGXC v24.11.1 HF Llama 2 70B / Mistral 7B fine-tuning": "samples per second of a "
        "Hugging Face fine-tuning run whose sequence lengths the README does not state",
    "Megatron-LM examples/llama/README.md FP8 table (bf6e99859f: Llama 3 8B / 70B / 405B on "
    "8 / 64 / 1,024 H100)": "not added: each repeats a layout already in the table (NM24.07 "
        "LLAMA3-8B; MB25.09 Llama3 70b and 405b), from an unnamed NeMo container",
    "Megatron-Bridge 26.06 SFT / LoRA Llama3 70B on 32 / 8 H100 (performance-summary-archive"
    ".md at 4ab94dfad)": "fine-tuning on packed SQuAD sequences (variable-length documents "
        "per 4,096-token row) and, for LoRA, frozen base weights: neither is a plan input",
    "NeMo AutoModel LoRA table (docs/performance-summary.mdx at cb9765441)": "LoRA (frozen "
        "base weights, adapters only) is not a plan input",
    "NeMo Framework 24.09-25.07 performance summaries (docs.nvidia.com)": "only their "
        "GB200 / B200 tables and the first H100 row of 25.02 could be read from the stored "
        "pages; that row (GPT3-175B on 512 H100, 866 tokens/s/GPU) repeats NM24.07's layout",
}
"""Rows of the session-41 sources the command line cannot express (or that were left out), and
why."""


def _nemo1_stack(tp: int, fp8: bool, dropout: bool):
    """NeMo 1.0's Megatron-Core GPT as these recipes run it, over the megatron@2024 preset
    (Transformer Engine, flash / fused attention, delayed FP8 scaling: the yamls' fp8_hybrid
    with amax history 1024, 'max'): Apex DistributedFusedAdam with grad_sync_dtype bf16 (the
    distributed optimizer's gradient buffer and reduce-scatter in bf16, as the NM24.07 rows),
    overlap_grad_sync / overlap_param_sync, userbuffers TP overlap (ub_tp_comm_overlap true in
    the yamls, set again by nemotron/configure.sh) with sequence parallel, FP8 parameters where
    FP8 runs (+model.fp8_params=$FP8_ENABLED in llama3.1 and nemotron configure.sh;
    gpt3_175b_hydra.yaml fp8_params true); GPT-3's hidden and attention dropout 0.1."""
    kernel, mem = _mcore_2024()
    opts = dataclasses.replace(kernel, fp32_grad_reduce=False, tp_comm_overlap=tp > 1,
                               fp8_param_gather=fp8, dropout=dropout)
    return opts, mem


def _dfa_master(family: str, fp8: bool) -> dict[str, object]:
    """The MemoryOptions of Apex DistributedFusedAdam's master weights as NeMo v2.0.0 (the 24.09
    container; 2.0.0rc1 alike) megatron_base_model.py `setup_optimization` sets them up beside
    the bf16 O2 model (MemoryOptions.master_weights): fp8_params (configure.sh's
    +model.fp8_params=$FP8_ENABLED; gpt3_175b_hydra.yaml's fp8_params true in both dtypes)
    keeps store_params, a copy in the optimizer's dtype; otherwise an fp32 optimizer stores int16
    remainders and a bf16 one none. Optimizer dtype: fp32 (no yaml sets one) except
    nemotron4-340b-synth.yaml's optim.dtype bf16, whose moments are bf16 too. Set in session
    41 (branch review41b) from the code and yamls, applying the rule branch mem405 gave the
    NM24.07 rows."""
    bf16_optim = family == "nemotron4-340b"
    if fp8 or family == "gpt3-175b":  # store_params
        return dict(master_weights="bf16", bf16_moments=True) if bf16_optim else {}
    return dict(master_weights="none", bf16_moments=True) if bf16_optim else dict(
        master_weights="remainders")


def _llama(size: str, tp: int) -> ModelSpec:
    """Llama 3.1 as the recipe yamls build it: the preset's shape, the vocabulary padded to
    make_vocab_size_divisible_by (128) x tp; 405B with num_query_groups 16 as
    llama3.1_405b.yaml sets it (the released model has 8)."""
    base = preset(f"llama3-{size}")
    if size == "405b":
        base = base.replace(kv_heads=16)
    return base.replace(vocab=_padded_vocab(base.vocab, tp))


def _model(family: str, tp: int) -> ModelSpec:
    if family.startswith("llama"):
        return _llama(family.split("-")[1], tp)
    if family == "nemotron4-15b":  # nemotron4-15b-synth.yaml
        return nemotron_model("nemotron4-15b", 32, 6144, 24576, 48, 8)
    if family == "nemotron4-340b":  # nemotron4-340b-synth.yaml
        return nemotron_model("nemotron4-340b", 96, 18432, 73728, 96, 8)
    # gpt3_175b_hydra.yaml: GPT-2 BPE vocabulary (50,257) padded by 128 x tp, tied embeddings
    return gpt_model("dgxc-gpt3-175b", 96, 12288, 96, vocab=_padded_vocab(50257, tp),
                     seq=2048, tied=True)


# family, readme, container, seq, tp, pp, cp, vp, mbs, recompute, GBS per GPU, dtype,
# [(GPUs, published tokens/s of the whole run)]
_DENSE = [
    ("llama3-8b", "llama3.1/README_8b.md", "24.09", 8192, 1, 1, 2, None, 1, "none", 16,
     "bf16", [(8, 81222.0), (128, 1280704.0)]),
    ("llama3-8b", "llama3.1/README_8b.md", "24.09", 8192, 1, 1, 2, None, 1, "none", 16,
     "fp8", [(8, 108436.0), (128, 1708474.0)]),
    ("llama3-70b", "llama3.1/README_70b.md", "24.09", 8192, 4, 4, 2, 5, 1, "none", 2,
     "bf16", [(64, 71235.0), (2048, 2248957.0)]),
    ("llama3-70b", "llama3.1/README_70b.md", "24.09", 8192, 4, 4, 2, 5, 1, "none", 2,
     "fp8", [(64, 95239.0), (2048, 2945955.0)]),
    # 405B: GBS 252 x GPUs / 576 (configure.sh)
    ("llama3-405b", "llama3.1/README_405b.md", "24.09", 8192, 8, 9, 2, 7, 1, "none", 0.4375,
     "bf16", [(576, 120022.0), (2304, 468646.0)]),
    ("llama3-405b", "llama3.1/README_405b.md", "24.09", 8192, 8, 9, 2, 7, 1, "none", 0.4375,
     "fp8", [(576, 183664.0), (2304, 668626.0)]),
    ("nemotron4-15b", "nemotron/README_15b.md", "24.09", 4096, 4, 1, 1, None, 4, "none", 4,
     "bf16", [(16, 92630.0), (2048, 11335957.0)]),
    ("nemotron4-15b", "nemotron/README_15b.md", "24.09", 4096, 4, 1, 1, None, 4, "none", 4,
     "fp8", [(16, 126031.0), (2048, 15391941.0)]),
    # 340B: selective recompute (nemotron4-340b-synth.yaml), GBS 2 x nodes (configure.sh)
    ("nemotron4-340b", "nemotron/README_340b.md", "24.09", 4096, 8, 8, 1, 12, 1, "selective",
     0.25, "bf16", [(128, 28432.0), (2048, 433296.0)]),
    ("nemotron4-340b", "nemotron/README_340b.md", "24.09", 4096, 8, 8, 1, 12, 1, "selective",
     0.25, "fp8", [(128, 41478.0), (2048, 600903.0)]),
    # GPT-3: GBS 16 x nodes (nemo_megatron/launch.sh), container 24.05
    ("gpt3-175b", "nemo_megatron/README_175b.md", "24.05", 2048, 4, 8, 1, 12, 1, "none", 2,
     "bf16", [(128, 58843.0), (2048, 930001.0)]),
    ("gpt3-175b", "nemo_megatron/README_175b.md", "24.05", 2048, 4, 8, 1, 12, 1, "none", 2,
     "fp8", [(128, 88562.0), (2048, 1344328.0)]),
]

_LABEL = {"llama3-8b": "Llama3.1 8B", "llama3-70b": "Llama3.1 70B",
          "llama3-405b": "Llama3.1 405B", "nemotron4-15b": "Nemotron4 15B",
          "nemotron4-340b": "Nemotron4 340B", "gpt3-175b": "GPT3 175B"}


def dgxc_dense() -> list[PublishedRun]:
    """DGXC v24.11.1's dense H100 rows (module docstring), priced on the NeMo 1.0 stack."""
    runs = []
    for (family, readme, container, seq, tp, pp, cp, vp, mbs, recompute, gbs_per_gpu, dtype,
         points) in _DENSE:
        model = _model(family, tp)
        gpt3 = family == "gpt3-175b"
        opts, mem = _nemo1_stack(tp, dtype == "fp8", dropout=gpt3)
        for gpus, tokens_s in points:
            gbs = round(gbs_per_gpu * gpus)
            dp = gpus // (tp * pp * cp)
            runs.append(PublishedRun(
                f"DGXC {_LABEL[family]} {gpus}xH100 {dtype.upper()}", DGXC.format(readme=readme),
                f"Megatron-Core (NeMo {container}, NeMo-Framework-Launcher)", model,
                preset_cluster("dgx-h100", gpus // 8), gbs, seq, tp, pp, dp, 1, recompute,
                tp > 1, opts, "tokens_per_gpu", tokens_s / gpus, micro_batches=(mbs,),
                schedules=("interleaved",) if vp else ("1f1b",), virtual_stages=vp, cp=cp,
                dtype=dtype, memory=dataclasses.replace(mem, **_dfa_master(family,
                                                                           dtype == "fp8")),
                confident=False,
                note=f"{dtype.upper()}, TP {tp}, PP {pp}, CP {cp}, VP {vp or '-'}, micro-batch "
                     f"{mbs}, GBS {gbs}, sequence {seq} as published ({tokens_s:.0f} tokens/s "
                     f"on {gpus} GPUs); NeMo {container} container (launch.sh FW_VERSION); "
                     f"recomputation '{recompute}', distributed_fused_adam with "
                     "grad_sync_dtype bf16, overlapped grad / param sync, master weights as "
                     "NeMo sets them up (fp32 or bf16 copy with fp8_params, else int16 "
                     "remainders or none; bf16 optimizer states for Nemotron-4 340B), "
                     + ("userbuffers TP overlap with sequence parallel, " if tp > 1 else "")
                     + ("FP8 parameters (fp8_params), delayed scaling (fp8_hybrid, amax "
                        "history 1024), " if dtype == "fp8" else "")
                     + ("dropout 0.1, " if gpt3 else "no dropout, ")
                     + ("Transformer Engine's flash-attn 2 backend (NVTE_FUSED_ATTN=0), "
                        if family in ("gpt3-175b", "nemotron4-340b") else
                        "cuDNN fused attention (NVTE_FUSED_ATTN=1), ")
                     + "from the release's yaml and configure.sh / launch.sh. Assumed: the "
                     "megatron@2024 preset's kernels, Megatron-Core's even layer split of "
                     "that time (megatron-even), datasheet clocks"
                     + ("; num_query_groups 16 as the yaml sets it" if family == "llama3-405b"
                        else "")
                     + ("; squared ReLU costed as GeLU, half RoPE as RoPE, layernorm1p as "
                        "LayerNorm" if family.startswith("nemotron") else "")))
    return runs


def dgxc_deepseek_v3() -> list[PublishedRun]:
    """DGXC25: DeepSeek-V3 on 1,024 H100, BF16, NeMo 25.04.01 (module docstring). launch.sh
    (h100): TP 2, PP 16, CP 1, VP 1, EP 64, ETP 1, MBS 1, GBS 8 x GPUs, 61 layers,
    recompute_modules [mla_up_proj], no activation offload. pretrain_deepseek_v3.py at
    7a8f1cc7bc: MegatronTokenDropCallback (capacity factor 1.0, inputs padded to capacity: every
    expert runs the mean number of rows), moe_permute_fusion, recompute_granularity selective
    with the modules above (replacing the default core_attn: the attention core is kept),
    tp_comm_overlap False, first / last pipeline stages of 3 / 2 layers; the recipe
    (recipes/deepseek_v3.py pretrain_recipe, use_mtp True: one MTP layer; DeepSeekV3Config:
    'alltoall' dispatcher, 8 router groups, group top-k 4, shared-expert overlap), the
    distributed optimizer, bf16_mixed with grad_reduce_in_fp32 (NeMo's default: not changed for
    BF16 by utils.set_primary_perf_configs), sequence parallel with TP (utils.py)."""
    from meshtron.planner.frameworks import PRESETS

    # Megatron-Core 0.12.2 (7094270c6f): the alltoall dispatcher sends every top-k copy (no
    # per-node deduplication: ep_node_limit 0 whatever the group-limited routing);
    # token_unpermutation takes no probabilities, TEGroupedMLP applies them in
    # weighted_bias_swiglu_impl (experts.py): moe_weighted_act
    # MegatronTokenDropCallback's capacity factor 1.0 with padding (expert_capacity) and
    # pretrain_deepseek_v3.py's moe_router_dtype 'fp32' (router_dtype; session 41, branch
    # mcoremoe)
    # (moe_pad_expert_input_to_capacity True in the callback; Megatron-Core's default, the
    # preset's, is False: expert_capacity_pad set here, branch fix42a)
    kernel = dataclasses.replace(PRESETS["megatron@2024"].kernel, expert_imbalance=1.0,
                                 expert_capacity=1.0, expert_capacity_pad=True,
                                 router_dtype="fp32")
    mem = MemoryOptions(framework="megatron", pipeline_split="megatron-ends",
                        recompute_up_proj=True, moe_weighted_act=True)
    return [PublishedRun(
        "DGXC25 DSV3 671B 1024xH100 BF16 tokendrop", DGXC25, "Megatron-Core (NeMo 25.04.01)",
        preset("deepseek-v3").replace(mtp_depth=1), preset_cluster("dgx-h100", 128), 8192,
        4096, 2, 16, 32, 1, "none", True, kernel, "tokens_per_gpu", 644781.55 / 1024,
        micro_batches=(1,), schedules=("1f1b",), ep=64, etp=1, dtype="bf16", memory=mem,
        confident=False,
        note="BF16, TP 2, PP 16, EP 64, ETP 1, VP 1, micro-batch 1, GBS 8192 as published "
             "(644,781.55 tokens/s, 52.04 s per step); token drop at capacity 1.0 padded "
             "(every expert runs the mean rows), the alltoall dispatcher, no A2A or TP "
             "overlap, MLA up-projections recomputed and the attention core kept "
             "(recompute_modules [mla_up_proj]), one MTP layer, fp32 gradient reduction "
             "(pretrain_deepseek_v3.py and the recipe at NeMo 7a8f1cc7bc). Not expressible: "
             "the 3 / 2-layer first and last stages (the planner's 'megatron-ends' split "
             "prices the embedding and loss stages its own way). Assumed: the megatron@2024 "
             "preset's kernels, datasheet clocks")]


def added_s41() -> list[PublishedRun]:
    """The validation rows of session 41 (module docstring)."""
    return dgxc_dense() + dgxc_deepseek_v3()
