"""Which rank order should the runtime's mesh use? The cost model's answer, side by side.

Two orders (outermost axis first; tensor parallelism innermost in both):

- "pp outer" (the runtime's order since this change; Megatron-LM and torchtitan): pipeline
  neighbours are tp*dp ranks apart, data-parallel groups the next closest after tp.
- "dp outer" (the runtime's order before): pipeline stages next to the tensor group,
  data-parallel groups tp*pp ranks apart.

For each case the full search runs once per order (the cost model asks the placement for every
group), and the best plan's step time is printed with the ratio. The order is all that changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtron.model.spec import resolve_model  # noqa: E402
from meshtron.planner import placement as pl  # noqa: E402
from meshtron.planner.cluster import resolve_cluster  # noqa: E402
from meshtron.planner.search import search_plans  # noqa: E402

ORDERS = {"pp outer": ("pp", "dp_replicate", "dp_shard", "tp"),
          "dp outer": ("dp_replicate", "dp_shard", "pp", "tp")}
FIXED = [  # layouts where the orders place groups differently: model, cluster, batch, seq, knobs
    ("llama3-70b", "dgx-h100:16", 1024, 8192, {"tp": 2, "pp": 4, "dp": 16, "zero": 3}),
    ("llama3-70b", "dgx-h100:16", 1024, 8192, {"tp": 4, "pp": 2, "dp": 16, "zero": 1}),
    ("llama3-8b", "dgx-h100:8", 512, 8192, {"tp": 1, "pp": 2, "dp": 32, "zero": 2}),
    ("llama2-70b", "dgx-a100:32", 1024, 4096, {"tp": 2, "pp": 8, "dp": 16, "zero": 1}),
]
CASES = [  # model, cluster, global batch, seq len
    ("llama3-8b", "dgx-h100:8", 512, 8192),
    ("llama3-70b", "dgx-h100:16", 1024, 8192),
    ("llama3-70b", "dgx-a100:64", 1024, 4096),
    ("llama2-70b", "dgx-a100:32", 1024, 4096),
    ("llama3-405b", "dgx-h100:256", 2048, 8192),
    ("llama3-405b", "dgx-h100:2048", 2048, 8192),
]


def best_under(order: tuple[str, ...], model, cluster, batch: int, seq: int, fixed=None):
    """Search with the placement's axis order set to `order` (restored afterwards)."""
    saved = pl.MESH_AXES
    pl.MESH_AXES = order
    try:
        return search_plans(model, cluster, batch, seq, fixed, top_k=1, explain=False).best
    finally:
        pl.MESH_AXES = saved


def main() -> None:
    print("Best plan of the whole search under each order:")
    print(f"{'case':42} {'pp outer':>24} {'dp outer':>24} {'dp outer / pp outer':>20}")
    for name, cl, batch, seq in CASES:
        model, cluster = resolve_model(name), resolve_cluster(cl)
        best = {k: best_under(order, model, cluster, batch, seq) for k, order in ORDERS.items()}
        cells = [f"{e.config.layout()} {e.step_time_s:7.3f} s" for e in best.values()]
        ratio = best["dp outer"].step_time_s / best["pp outer"].step_time_s
        print(f"{name + ' on ' + cl + f' ({batch}x{seq})':42} {cells[0]:>24} {cells[1]:>24} "
              f"{ratio:20.3f}")
    print("\nFixed layouts (best remaining knobs under each order):")
    print(f"{'case':62} {'pp outer s':>10} {'dp outer s':>10} {'ratio':>7}")
    for name, cl, batch, seq, knobs in FIXED:
        model, cluster = resolve_model(name), resolve_cluster(cl)
        ests = [best_under(order, model, cluster, batch, seq, knobs) for order in ORDERS.values()]
        label = f"{name} on {cl} " + ",".join(f"{k}={v}" for k, v in knobs.items())
        if None in ests:  # the memory model rejects the layout: no time to compare
            print(f"{label:62} {'does not fit in memory':>29}")
            continue
        t = [e.step_time_s for e in ests]
        print(f"{label:62} {t[0]:10.3f} {t[1]:10.3f} {t[1] / t[0]:7.3f}")


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    main()
