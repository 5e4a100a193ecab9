"""The planner's honest validation table: published runs, predicted from their layouts.

Calibration part: the ten Megatron-LM 2021 rows (../shared/calibration, Narayanan et al. 2021,
Table 1) and Korthikanti et al. 2022 (the rows earlier versions were developed against).
Validation part: every other row (bench/published/runs.py, sources per row); no
constant was set by looking at them. Error = predicted / published throughput - 1.
Rows marked '?' rest on assumed details (see their notes; -v prints them); '!' marks a published
layout the planner's memory model rejects.

    python bench/planner_published.py [-v] [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published.megatron2021 import megatron_2021_rows, predict_megatron_row  # noqa: E402
from bench.published.table import predict_published, summary  # noqa: E402
from bench.published.runs import published_runs  # noqa: E402
from meshtron.errors import UserError  # noqa: E402

CSV = ROOT.parent / "shared" / "calibration" / "megatron_2021_weak_scaling.csv"
if not CSV.is_file():  # a checkout that does not sit beside ../shared: the tests' copy
    CSV = ROOT / "tests" / "data" / CSV.name

HEAD = (f"{'run':<30} {'GPU':<6} {'stack':<27} {'layout':<24} {'metric':<14} "
        f"{'published':>9} {'predicted':>9} {'error':>7}")


def _fmt(metric: str, x: float) -> str:
    if metric == "mfu":
        return f"{x:9.3f}"
    if metric == "step_s":
        return f"{x:9.2f}"
    return f"{x:9.1f}" if x < 1000 else f"{x:9.0f}"


def _gpu(name: str | None) -> str:
    return (name or "?").split("-")[0]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print each row's source, note, plan and step-time terms")
    p.add_argument("--csv", metavar="PATH", help="also write every row to this CSV file")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    verbose = args.verbose
    out_rows = []
    print("CALIBRATION PART (constants were chosen while looking at these)")
    print(HEAD)
    cal_errs = []
    for row in megatron_2021_rows(CSV):
        p = predict_megatron_row(row)
        c = p.estimate.config
        layout = f"tp={c.tp} pp={c.pp} dp={c.dp}"
        print(f"{'Megatron21 ' + row['params_b'] + 'B':<30} {'A100':<6} {'Megatron-LM':<27} "
              f"{layout:<24} {'hw_tflops':<14} {p.published:9.1f} {p.predicted:9.1f} "
              f"{p.error * 100:+6.1f}%")
        cal_errs.append(abs(p.error))
        out_rows.append(("calibration", f"Megatron21 {row['params_b']}B", "A100", "Megatron-LM",
                         layout, "hw_tflops", p.published, p.predicted, p.error, "N21 Table 1"))
    preds, refused = [], []
    for r in published_runs():
        try:
            preds.append(predict_published(r))
        except UserError as e:  # a published layout the planner's rules refuse: named below
            refused.append(f"{r.part[:3]} {r.name}: {e}")
    for part in ("calibration", "validation"):
        if part == "validation":
            print("\nVALIDATION PART (never used to set a constant)")
            print(HEAD)
        sel = [p for p in preds if p.run.part == part]
        for p in sel:
            r = p.run
            flag = ("" if r.confident else "?") + ("" if p.fits else "!")
            print(f"{r.name + flag:<30} {_gpu(r.gpu):<6} {r.stack[:27]:<27} {r.layout():<24} "
                  f"{r.metric:<14} {_fmt(r.metric, r.published)} {_fmt(r.metric, p.predicted)} "
                  f"{p.error * 100:+6.1f}%")
            if verbose:
                t = p.timing
                print(f"    {r.source}; {r.note}\n    {t.config.describe()}  step "
                      f"{p.step_s:.3f}s  " + "  ".join(
                          f"{k}={v:.3f}" for k, v in t.time.to_dict().items()))
            out_rows.append((part, r.name, _gpu(r.gpu), r.stack, r.layout(), r.metric,
                             r.published, p.predicted, p.error, r.source))
        if part == "calibration":
            errs = cal_errs + [abs(p.error) for p in sel]
            print(f"calibration: n={len(errs)}  mean |error| {sum(errs) / len(errs) * 100:.1f}%  "
                  f"max {max(errs) * 100:.1f}%")
        else:
            s = summary(sel)
            conf = summary([p for p in sel if p.run.confident])
            print(f"validation: n={s['n']}  mean |error| {s['mean'] * 100:.1f}%  "
                  f"max {s['max'] * 100:.1f}%   (confident rows only: n={conf['n']}, mean "
                  f"{conf['mean'] * 100:.1f}%, max {conf['max'] * 100:.1f}%)")
            stacks = sorted({p.run.stack for p in sel})
            for st in stacks:
                ss = summary([p for p in sel if p.run.stack == st])
                print(f"  {st:<32} n={ss['n']:>2}  mean {ss['mean'] * 100:5.1f}%  "
                      f"max {ss['max'] * 100:5.1f}%")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["part", "run", "gpu", "stack", "layout", "metric", "published",
                        "predicted", "error", "source"])
            w.writerows(out_rows)
    for line in refused:
        print(f"REFUSED {line}")
    print("\n'?': rests on assumed details; '!': the planner's memory model rejects the layout.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
