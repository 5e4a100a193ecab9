"""Validation rows added in session 42 (issue 30, branch valrows4) from a stack the table had not
seen, every input fixed from its source before the table was first run with them
(runs.ADDED_S42):

* OLMC: allenai/OLMo-core README.md, "Official training scripts": throughput in tokens per
  second per device "from a cluster with NVIDIA H100 GPUs", at 8c03ca8a21 (2024-09-26: OLMo 1B
  / 7B BF16 and FP8, 13B BF16) and 41400c46fc (2024-11-01: the Llama 8B rows and 13B FP8
  added). What ran is
  the launch command each row prints (`python src/scripts/train/OLMo-7B.py launch RUN
  CLUSTER` [--model.float8_config.enabled=true]) with the scripts and library of the same
  commit: src/scripts/train/OLMo-{1B,7B,13B}.py (8c03ca8a21), Llama-8B.py (41400c46fc),
  src/olmo_core/internal/experiment.py (BeakerLaunchConfig num_nodes 1, num_gpus 8: no row
  overrides it, so one node of 8 H100; the dolma2 tokenizer, 100,278 entries padded to 100,352;
  sequence 4,096).

Which rows, by a rule set before any was run: every row of the two tables (the 1B / 7B and
13B BF16 figures are the same in both; the 8B's and 13B FP8's are in the second only: the 13B
FP8 row was missed at first and added by branch fix42a, its inputs from the source as the 13B
BF16 row's, before the table was run with it). The figures are printed to two
or three significant digits (10,000; 4,600; 12,500): a rounding of up to 5% is in them.

Priced on the olmo-core@2024 preset since session 43 (branch olmocore; torchtitan@2025 before,
the closest then). The preset was read from OLMo-core's code, but these rows' errors were known
when it was written (the task that asked for it quoted them), so all eight are calibration
(runs.LOOKED_AT)."""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.kernel_options import KernelOptions
from meshtron.planner.memory import MemoryOptions
from bench.published.stacks import from_preset
from bench.published.table import PublishedRun

OLMC_0926 = ("OLMC allenai/OLMo-core README.md 'Official training scripts' at 8c03ca8a21 "
             "(2024-09-26), tokens/s per H100")
OLMC_1101 = ("OLMC allenai/OLMo-core README.md 'Official training scripts' at 41400c46fc "
             "(2024-11-01), tokens/s per H100")

DOLMA2_PADDED = 128 * ((100278 + 127) // 128)
"""The dolma2 tokenizer's 100,278 entries padded to a multiple of 128 (olmo_core/data/
tokenizer.py TokenizerConfig.padded_vocab_size at 8c03ca8a21): 100,352."""


def _olmo(name: str, hidden: int, layers: int, heads: int) -> ModelSpec:
    """OLMo 1B / 7B / 13B as olmo_core/nn/transformer/model.py at 8c03ca8a21 builds them:
    TransformerConfig.olmo_{1B,7B,13B} = llama2_{1B,7B,13B} (d_model 2048 / 4096 / 5120, 18 /
    32 / 40 layers, 16 / 32 / 40 heads, no GQA) with the reordered_norm block (a norm after
    attention and after the MLP, before each residual add: norm_layout 'post'), qk_norm (one
    RMSNorm over the whole query and one over the whole key projection, d_model wide:
    qk_norm_whole), rope_theta 500,000; llama_like: SwiGLU of hidden 8 d / 3 rounded up to a
    multiple of 256 (5,632 / 11,008 / 13,824), RMSNorm without bias, untied embeddings."""
    ffn = 256 * -(-int(8 * hidden / 3) // 256)
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn_hidden=ffn, vocab=DOLMA2_PADDED, max_seq=4096, mlp="swiglu",
                     norm="rmsnorm", position="rope", tied_embeddings=False, bias=False,
                     rope_theta=500000.0, qk_norm=True, qk_norm_whole=True, norm_layout="post")


def _llama_8b() -> ModelSpec:
    """TransformerConfig.llama3_8B at 41400c46fc (nn/transformer/config.py): the Llama 3 8B
    shape (32 layers, d_model 4096, 32 heads, 8 KV heads, FFN 1.3 x 8 d / 3 rounded to 1,024:
    14,336, rope_theta 500,000) with the dolma2 vocabulary of the experiment."""
    return preset("llama3-8b").replace(vocab=DOLMA2_PADDED, max_seq=4096)


def _olmo_core_stack(fused_loss: bool) -> tuple[KernelOptions, MemoryOptions]:
    """The olmo-core@2024 preset (planner/framework_presets.py: the four scripts' FSDP2 with
    param bf16 / reduce fp32 on one node, per-block torch.compile with SDPA, fused AdamW,
    z-loss 1e-5, fp32 logits, torchao tensorwise FP8), with the script's loss (`fused_loss`):
    OLMo-7B / 13B.py and Llama-8B.py set TrainerConfig fused_loss=True (its triton/
    cross_entropy_loss.py, flash-attn's Triton cross-entropy with inplace_backward False, the
    z-loss inside the same kernel: the options flash_ce, loss 'flash-ce'); OLMo-1B.py does
    not (train/config.py at 8c03ca8a21: fused_loss defaults False), so train/trainer.py
    calls nn/functional/cross_entropy_loss.py `cross_entropy_loss`: F.cross_entropy and a
    separate logsumexp for the z-loss on the fp32 logits, the preset's own loss. Before
    session 43 these rows were priced on torchtitan@2025 with the same kernel choices but
    the z-loss, the fp32 logits and the Python final norm."""
    options = {"flash_ce": True, "loss": "flash-ce"} if fused_loss else {}
    fw = from_preset("olmo-core@2024", **options)
    return fw.kernel, fw.memory


# name, source, model, micro-batch (sequences), global batch (sequences), dtype, tokens/s/GPU
_ROWS = [
    ("OLMo 1B", OLMC_0926, ("olmo-1b", 2048, 18, 16), 4, 1024, "bf16", 44000.0),
    ("OLMo 1B", OLMC_0926, ("olmo-1b", 2048, 18, 16), 4, 1024, "fp8", 51000.0),
    ("OLMo 7B", OLMC_0926, ("olmo-7b", 4096, 32, 32), 2, 1024, "bf16", 10000.0),
    ("OLMo 7B", OLMC_0926, ("olmo-7b", 4096, 32, 32), 2, 1024, "fp8", 13000.0),
    ("OLMo 13B", OLMC_0926, ("olmo-13b", 5120, 40, 40), 1, 2048, "bf16", 4600.0),
    ("OLMo 13B", OLMC_1101, ("olmo-13b", 5120, 40, 40), 1, 2048, "fp8", 5500.0),
    ("Llama 8B", OLMC_1101, None, 2, 1024, "bf16", 9500.0),
    ("Llama 8B", OLMC_1101, None, 2, 1024, "fp8", 12500.0),
]


def olmo_core() -> list[PublishedRun]:
    """The OLMC rows (module docstring): FSDP over one node of 8 H100, no activation
    checkpointing (no script sets ac_config), sequence 4,096."""
    runs = []
    for label, source, shape, mbs, gbs, dtype, tps in _ROWS:
        fused_loss = label != "OLMo 1B"  # OLMo-1B.py leaves TrainerConfig.fused_loss False
        kernel, mem = _olmo_core_stack(fused_loss)
        model = _olmo(*shape) if shape else _llama_8b()
        script = f"OLMo-{label.split()[1]}.py" if shape else "Llama-8B.py"
        runs.append(PublishedRun(
            f"OLMC {label} 8xH100 {dtype.upper()}", source, "OLMo-core (FSDP2, torch.compile)",
            model, preset_cluster("dgx-h100", 1), gbs, 4096, 1, 1, 8, 3, "none", False, kernel,
            "tokens_per_gpu", tps, micro_batches=(mbs,), dtype=dtype, memory=mem,
            confident=False,
            note=f"{dtype.upper()} {tps:.0f} tokens/s per device as published (rounded); "
                 f"src/scripts/train/{script}: FSDP (bf16 parameters, fp32 reduction), "
                 f"torch.compile, rank_microbatch_size {mbs} x 4096 tokens, global batch "
                 f"{gbs} x 4096, fused AdamW, "
                 + ("fused (flash-attn Triton) loss with z-loss" if fused_loss else
                    "unfused loss (fused_loss unset, its default False: F.cross_entropy on the "
                    "logits cast to fp32, then a logsumexp pass for the z-loss; corrected by "
                    "branch fix42a from the script, an input from its source, not a fit: the "
                    "first run priced the fused loss)")
                 + ", no activation checkpointing; one node of 8 GPUs (the launch default: the "
                 "published command sets no --launch.num_nodes)"
                 + ("; FP8: torchao Float8Linear, dynamic tensorwise scaling" if dtype == "fp8"
                    else "")
                 + ". Assumed: DGX H100 (the README says 'a cluster with NVIDIA H100 GPUs'), "
                 "datasheet clocks. Priced on olmo-core@2024 (session 43; torchtitan@2025 "
                 "before, which saw neither the z-loss, the fp32 logits, the Python final norm"
                 + (" nor FSDP's float8 all-gather" if dtype == "fp8" else "")
                 + "). Not seen by the preset: FSDP2's root unit holding the embedding, final "
                 "norm and head together (priced as two units)"
                 + ("; the per-step amax all-reduce of precompute_float8_dynamic_scale_for_"
                    "fsdp" if dtype == "fp8" else "")))
    return runs
