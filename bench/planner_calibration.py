"""Print the planner's error on the ten published Megatron-LM 2021 runs (../shared/calibration)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published.megatron2021 import megatron_2021_rows, predict_megatron_row  # noqa: E402

CSV = ROOT.parent / "shared" / "calibration" / "megatron_2021_weak_scaling.csv"
if not CSV.is_file():  # a checkout that does not sit beside ../shared: the tests' copy
    CSV = ROOT / "tests" / "data" / CSV.name


def main() -> int:
    print(f"{'params':>8} {'tp':>3} {'pp':>3} {'dp':>4} {'mb':>3} {'schedule':>14} "
          f"{'published':>9} {'predicted':>9} {'error':>7}")
    worst = 0.0
    for row in megatron_2021_rows(CSV):
        p = predict_megatron_row(row)
        c = p.estimate.config
        sched = f"interleaved:{c.virtual_stages}" if c.schedule == "interleaved" else (c.schedule or "-")
        print(f"{row['params_b']:>7}B {c.tp:>3} {c.pp:>3} {c.dp:>4} {c.micro_batch:>3} "
              f"{sched:>14} {p.published:>9.1f} {p.predicted:>9.1f} {p.error * 100:>+6.1f}%")
        worst = max(worst, abs(p.error))
    print(f"worst |error|: {worst * 100:.1f}%")
    return 0


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    sys.exit(main())
