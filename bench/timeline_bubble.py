"""Measured pipeline bubble (meshtron doctor --timeline) vs the planner's prediction.

For each pipelined layout: a real `meshtron train --nproc N --plan LAYOUT` run on gloo, then the
timeline report of its last steady steps. Printed side by side: the measured bubble (stages'
main-thread time blocked before the neighbour's send/receive entered, share of step time, mean
over stages and per stage), the planner's predicted bubble share for the run's plan.toml
(`pipeline.bubble_time` inside its estimate) and the same formula fed with the measured per-stage
compute, plus each layout's mean compute / communication / idle fractions.

    .venv/bin/python bench/timeline_bubble.py                      # 8 ranks
    .venv/bin/python bench/timeline_bubble.py --nproc 4 --layouts pp=2,dp=2 pp=4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_LAYOUTS = ["pp=2,dp=4", "pp=4,dp=2", "pp=8", "tp=2,pp=2,dp=2"]


def run_layout(layout: str, nproc: int, args, tmp: Path):
    from meshtron.diagnose.timeline_view import build_report

    run_dir = tmp / layout.replace(",", "_").replace("=", "")
    cmd = [sys.executable, "-m", "meshtron", "train", "--nproc", str(nproc), "--plan", layout,
           "--model", args.model, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--global-batch", str(args.global_batch), "--eval-every", "0",
           "--run-dir", str(run_dir), "--set", f"model.layers={args.layers}"]
    if args.schedule:
        cmd += ["--schedule", args.schedule]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        return None, [line for line in proc.stderr.splitlines() if "rror" in line][-3:]
    return build_report(run_dir, png=False), None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layers", type=int, default=8, help="model.layers (pp <= layers)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", default=None, help="e.g. 1f1b (default: the planner's)")
    args = ap.parse_args()
    print(f"{args.nproc} ranks, model {args.model} with {args.layers} layers, seq {args.seq_len}, batch "
          f"{args.global_batch}; bubble = share of step time")
    print(f"{'layout':<18}{'schedule':>9}{'m':>4}{'measured':>10}{'planner':>9}"
          f"{'formula@meas':>13}{'compute':>9}{'comm':>7}{'idle':>7}  per stage")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            report, err = run_layout(layout, args.nproc, args, Path(tmp))
            if report is None:
                print(f"{layout:<18} failed: {err}")
                continue
            b = report.bubble
            n = len(report.ranks)
            mean = {k: sum(report.fractions(r)[k] for r in report.ranks) / n
                    for k in ("compute", "comm", "idle")}
            pred = b.get("predicted")
            stages = " ".join(f"{v:.0%}" for _, v in sorted(b["per_stage"].items()))
            print(f"{layout:<18}{b['schedule']:>9}{b['m']:>4}{b['measured']:>10.1%}"
                  f"{(f'{pred:.1%}' if pred is not None else 'n/a'):>9}"
                  f"{b['formula_on_measured']:>13.1%}{mean['compute']:>9.1%}"
                  f"{mean['comm']:>7.1%}{mean['idle']:>7.1%}  {stages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
