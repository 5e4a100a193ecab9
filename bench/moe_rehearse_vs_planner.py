"""The planner's mixture-of-experts memory against `meshtron rehearse`, one layout kind per row
(ep with ZeRO 0/1/3, ep+tp+sp, ep+pp, recomputation; Mixtral-style softmax routing and
DeepSeek-style sigmoid routing with a shared expert and a dense first block).

Each row rehearses the first rank of the planner's fullest stage (fake process group, fake
tensors; every MoE layer routes the mean T*k/E tokens per expert and the rehearsed rank's
experts 1.25x it, the planner's default `expert_imbalance`, on both sides) and prints the
rehearsed peak next to the planner's tensors, total and by category (rehearsal/planner, GiB).
The table is tests/test_rehearse_moe.py's.

    python bench/moe_rehearse_vs_planner.py [KIND ...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_rehearse_moe import BASE, KINDS  # noqa: E402


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
        model, knobs = KINDS[name]
        spec = ModelSpec(**model)
        plan = as_plan({**BASE, **knobs, "model": spec.name}).validate(8, spec)
        r = rehearse(spec, plan, resolve_cluster("dgx-h100:1"), "cpu")
        rows = {x["row"]: (x["rehearsal_gib"], x["planner_gib"]) for x in r["memory"]}
        got, want = rows.pop("total")
        cats = " ".join(f"{k} {a:.3f}/{b:.3f}" for k, (a, b) in rows.items())
        print(f"| {name} | {got:.3f} | {want:.3f} | {want / got - 1:+.1%} | {cats} | "
              f"{r['wall_s']:.1f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
