"""The planner's memory against `meshtron rehearse`, one layout kind per row.

Each row rehearses the first rank of the planner's fullest stage of one plan (fake process
group and fake tensors: the runtime's own modules, shards, optimizer and step at the plan's
shapes, nothing allocated) and prints the rehearsed peak next to the planner's tensors
(`MemoryBreakdown.allocated`, CPU kernels), total and by category (rehearsal/planner, GiB).
The model is tests/test_rehearse.py's (a 2-layer Llama-shaped model, 6 layers for the uneven
interleaved row, vocabulary 32,000, hidden 2,048, 2 x 2,048 tokens per micro-batch, 8 ranks).

    python bench/rehearse_vs_planner.py [KIND ...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_rehearse import BASE, KINDS, MODEL  # noqa: E402


def main(names: list[str]) -> None:
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.plan import as_plan
    from meshtron.rehearse.run import rehearse

    warnings.filterwarnings("ignore")
    print("| layout kind | rehearsal GiB | planner GiB | planner vs rehearsal | by category "
          "(rehearsal/planner) | wall |")
    print("|---|---|---|---|---|---|")
    for name in names or list(KINDS):
        knobs = dict(KINDS[name])
        spec = ModelSpec(**dict(MODEL, layers=knobs.pop("layers", MODEL["layers"])))
        plan = as_plan({**BASE, **knobs}).validate(8, spec)
        r = rehearse(spec, plan, resolve_cluster("dgx-h100:1"), "cpu")
        rows = {x["row"]: (x["rehearsal_gib"], x["planner_gib"]) for x in r["memory"]}
        got, want = rows.pop("total")
        cats = " ".join(f"{k} {a:.3f}/{b:.3f}" for k, (a, b) in rows.items())
        print(f"| {name} | {got:.3f} | {want:.3f} | {want / got - 1:+.1%} | {cats} | "
              f"{r['wall_s']:.1f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
