"""The planner against what one H200 measured (calibration: these runs steered issue 30's
compile and optimizer physics, so they never count as validation).

Reads bench/results/gpu_check_h200_2026-12-04.json (meshtron's runtime, torch 2.11, one H200,
llama3-8b widths, seq 4096, global batch 8) and prints, for every measured plan, the
measured step, the planner's step for exactly that plan now, and their ratio; then what
per-block torch.compile saved and what FP8 gained, measured against predicted. Side-by-side
ratios only; no timing here.

    python bench/h200_vs_planner.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.model import preset  # noqa: E402
from meshtron.planner.cluster import resolve_cluster  # noqa: E402
from meshtron.planner.search import evaluate_plan  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu_check_h200_2026-12-04.json"


def _knobs(plan: str, dtype: str, compiled: bool) -> dict:
    """'tp=1,pp=1,dp=1 zero=0 mb=1 recompute=full sp=off schedule=-' as planner knobs."""
    parts = dict(p.split("=") for p in plan.replace(",", " ").split())
    return {"tp": int(parts["tp"]), "pp": int(parts["pp"]), "dp": int(parts["dp"]),
            "zero": int(parts["zero"]), "micro_batch": int(parts["mb"]),
            "recompute": parts["recompute"], "dtype": dtype, "compile": compiled}


def predict(run: dict, layers: int) -> float:
    cluster = dataclasses.replace(resolve_cluster("dgx-h200:1"), gpus_per_node=1)
    spec = dataclasses.replace(preset("llama3-8b"), layers=layers)
    est = evaluate_plan(spec, cluster, 8, 4096, _knobs(run["plan"], run["dtype"],
                                                       run["compiled"]))
    return est.step_time_s


def main() -> int:
    cases = json.loads(RESULTS.read_text())["cases"]
    rows = []
    for name in ("eager", "compile"):
        run = cases[name]["result"]["run"]
        rows.append((name, run, run["model"]["layers"]))
    fp8 = cases["fp8"]["result"]
    for name in ("bf16", "fp8"):
        run = fp8[name]
        rows.append((f"fp8 case {name}", run, run["model"]["layers"]))
    pred = {}
    print(f"{'case':18} {'plan':58} {'measured':>9} {'planner':>9} {'meas/pred':>9}")
    for name, run, layers in rows:
        p = predict(run, layers)
        pred[name] = (run["step_time_s"], p)
        print(f"{name:18} {run['plan'] + (' compiled' if run['compiled'] else ''):58} "
              f"{run['step_time_s']:9.3f} {p:9.3f} {run['step_time_s'] / p:9.3f}")
    (me, pe), (mc, pc) = pred["eager"], pred["compile"]
    print(f"compile saves: measured {1 - mc / me:.1%}, predicted {1 - pc / pe:.1%}")
    (mb, pb), (mf, pf) = pred["fp8 case bf16"], pred["fp8 case fp8"]
    print(f"fp8 / bf16 tokens/s: measured {mb / mf:.3f}, predicted {pb / pf:.3f}")
    return 0


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    raise SystemExit(main())
