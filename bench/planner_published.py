"""Published training runs outside the calibration set: published vs predicted, layout fixed.

Sources and the configuration of each row are in `meshtron.planner.calibration.published_runs`.
Error is of throughput (positive: the planner is optimistic). Rows marked '?' rest on assumed
details (see their notes) and are not used in tests. The ten Megatron-LM 2021 calibration rows
are printed first for reference (bench/planner_calibration.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.planner.calibration import (megatron_2021_rows, predict_megatron_row,  # noqa: E402
                                          predict_published, published_runs)

CSV = ROOT.parent / "shared" / "calibration" / "megatron_2021_weak_scaling.csv"
if not CSV.is_file():  # a checkout that does not sit beside ../shared: the tests' copy
    CSV = ROOT / "tests" / "data" / CSV.name


def _sched(c) -> str:
    if c.pp == 1:
        return "-"
    return f"interleaved:{c.virtual_stages}" if c.schedule == "interleaved" else c.schedule


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    print("Megatron-LM 2021 calibration rows (Narayanan et al. 2021, Table 1):")
    print(f"{'run':<24} {'layout':<17} {'mb':>3} {'sched':>14} {'metric':>12} "
          f"{'published':>9} {'predicted':>9} {'error':>7}  MFU")
    for row in megatron_2021_rows(CSV):
        p = predict_megatron_row(row)
        c = p.estimate.config
        print(f"{'Megatron21 ' + row['params_b'] + 'B':<24} {c.layout():<17} {c.micro_batch:>3} "
              f"{_sched(c):>14} {'hw_tflops':>12} {p.published:>9.1f} {p.predicted:>9.1f} "
              f"{p.error * 100:>+6.1f}%  {p.estimate.mfu * 100:4.1f}%")
    print("\nOther published runs ('?': rests on assumed details; 'time-only': time-balanced "
          "layer split, memory ignored):")
    print(f"{'run':<24} {'layout':<17} {'mb':>3} {'sched':>14} {'metric':>12} "
          f"{'published':>9} {'predicted':>9} {'error':>7}  {'MFU':>5}  {'GiB':>5}  "
          f"time-only (sched, value, error)")
    for run in published_runs():
        p = predict_published(run)
        e, t = p.estimate, p.timing
        c = e.config
        fmt = ".3f" if run.metric == "mfu" else ".2f" if run.metric == "step_s" else ".1f"
        flag = "" if run.confident else "?"
        fits = "" if e.fits else "!"
        print(f"{run.name + flag:<24} {c.layout():<17} {c.micro_batch:>3} {_sched(c):>14} "
              f"{run.metric:>12} {run.published:>9{fmt}} {p.predicted:>9{fmt}} "
              f"{p.error * 100:>+6.1f}%  {e.mfu * 100:4.1f}%  {e.memory.total:5.1f}{fits} "
              f" {_sched(t.config)}, {p.value(t):{fmt}}, {p.timing_error * 100:+.1f}%")
        if verbose:
            print(f"    {run.source}\n    {run.note}")
            for est in (e, t):
                print(f"    step {est.step_time_s:.3f}s  " + "  ".join(
                    f"{k}={v:.3f}" for k, v in est.time.to_dict().items()))
    print("\n'!': the planner's memory model says the published layout does not fit.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
