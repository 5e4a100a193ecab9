"""The planner's FP8 / bf16 speedup of whole training steps against the speedups torchao and
torchtitan publish for the same runs (issue 30, FP8 pattern). Side-by-side ratios only; no
timing here, nothing fitted. These figures are physics references, not rows of the
published-run table (bench/published/runs.py): only their FP8 / bf16 ratio is compared.

Published (all on H100, Llama 3 8B, FSDP2, per-block torch.compile, sequence 8192):

* torchao's float8 README ("Training benchmarks", pytorch/ao torchao/float8/README.md, torch
  2.7.0a0, torchao 0.10.0, torchtitan 0.0.2): 8 GPUs, local batch 1, per-op SAC; median
  tokens/s 6150 bf16, 7689.5 tensorwise (with FP8 all-gather), 6768 rowwise (bf16 all-gather).
* torchtitan's 2024-12 benchmarks (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and
  3; Grand Teton 500 W H100s, torchao eab345c): 8 and 128 GPUs, local batch 2, selective AC;
  TPS/GPU 6667 / 6514 compiled bf16, 8532 / 8380 compiled + Float8 (torchtitan's float8
  defaults of the time: tensorwise, bf16 all-gather).

The planner prices each run through the command line's path (bench/planner_cli_table.py
`run_row`, the torchtitan compiled stack of bench/published/stacks.py) once in bf16 and once
with --dtype fp8. The README's tensorwise run gathered FP8 weights; the torchtitan stack the
planner prices gathers bf16 (its float8 default), so that row's FP8 side leaves out the
smaller all-gathers. Meshtron's own runtime against one H200 (rowwise, compiled, measured):
bench/h200_vs_planner.py.

    python bench/fp8_speedup_vs_published.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planner_cli_table import run_row  # noqa: E402
from bench.published.stacks import TORCHTITAN_COMPILED, TORCHTITAN_MEMORY  # noqa: E402
from bench.published.table import PublishedRun, grand_teton_h100_500w  # noqa: E402
from meshtron.model.spec import preset  # noqa: E402

ROWWISE = dataclasses.replace(TORCHTITAN_COMPILED, fp8_scaling="torchao-rowwise")
# name, GPUs, local batch, stack, published bf16 and fp8 tokens/s (per GPU or whole run: only
# their ratio is used)
REFERENCES = (
    ("torchao README, tensorwise (FP8 all-gather)", 8, 1, TORCHTITAN_COMPILED, 6150.0, 7689.5),
    ("torchao README, rowwise", 8, 1, ROWWISE, 6150.0, 6768.0),
    ("torchtitan 2024-12 Table 1, Float8", 8, 2, TORCHTITAN_COMPILED, 6667.0, 8532.0),
    ("torchtitan 2024-12 Table 3, Float8", 128, 2, TORCHTITAN_COMPILED, 6514.0, 8380.0),
)


def _run(gpus: int, local_batch: int, opts, dtype: str) -> PublishedRun:
    """The reference run as a table row would state it (selective op AC: the torchtitan
    preset's `--recompute selective` through the '(op)' note)."""
    return PublishedRun(
        "reference", "see module docstring", "torchtitan FSDP2 compile", preset("llama3-8b"),
        grand_teton_h100_500w(gpus // 8), local_batch * gpus, 8192, 1, 1, gpus, 3, "half",
        False, opts, "tokens_per_gpu", 1.0, micro_batches=(local_batch,),
        memory=TORCHTITAN_MEMORY, dtype=dtype, note="selective (op) activation checkpointing")


def predicted_speedup(gpus: int, local_batch: int, opts) -> float:
    """The planner's FP8 / bf16 tokens/s for the reference layout."""
    value = {dt: run_row(_run(gpus, local_batch, opts, dt))["value"] for dt in ("bf16", "fp8")}
    return value["fp8"] / value["bf16"]


def main() -> int:
    print(f"{'reference':46} {'published':>9} {'planner':>8} {'planner/published':>18}")
    for name, gpus, lb, opts, bf16, fp8 in REFERENCES:
        pub = fp8 / bf16
        pred = predicted_speedup(gpus, lb, opts)
        print(f"{name:46} {pub:9.3f} {pred:8.3f} {pred / pub:18.3f}")
    return 0


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    raise SystemExit(main())
