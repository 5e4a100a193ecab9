"""torchtitan's context-parallel rows (TT24 Table 2: Llama 3.1 8B on 8 H100, FSDP x CP, local
batch 1, full AC, compile, Float8; every rank holds 32,768 tokens) split into what the
attention core costs per unit of work and what the rest costs, published and predicted.

With the round-robin balancer a rank's calls have the same shapes in every row (a causal
32k square, then cp - 1 unmasked 32k x 16k pairs): its attention work is cp units of the
cp-1 row's causal 32k square, everything else (linears, element-wise, loss, FSDP) is the same
per rank. So the published step per rank, less the planner's non-core part, over cp is the
core time per unit the row implies. A model in which the core costs the same per unit at the
same call shapes cannot give rows whose implied units differ: where they differ, a cost the
planner does not price (or the published reading) varies between the rows. Prints, per row:
published and predicted step per rank, the planner's core (forward + recompute + backward,
all layers) and the rest, the implied core per unit and its rate in TFLOP/s.

    python bench/cp_rows_per_unit.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planner_cli_table import run_row  # noqa: E402
from bench.published.runs import published_runs  # noqa: E402
from meshtron.planner.compute import layer_cost  # noqa: E402


def _core_step(run) -> float:
    """The planner's attention core of one step on one rank: per layer the forward twice
    (full AC recomputes it) and the backward (2.5x the forward, compute_core.py), all layers."""
    lc = layer_cost(run.model, run.cluster, run.tp, 1, run.seq_len, run.sp, run.opts,
                    cp=run.cp, dtype=run.dtype, gqa_repeat=True)
    return run.model.layers * 4.5 * lc.core_fwd


def main() -> int:
    rows = [r for r in published_runs() if r.name.startswith("TT 8B FSDP")]
    print(f"{'row':24s} {'pub s':>7s} {'pred s':>7s} {'core':>6s} {'rest':>5s} "
          f"{'unit pub':>8s} {'unit pred':>9s} {'TF/s pub':>8s}")
    unit_flops = None
    for r in rows:
        local = r.seq_len / r.cp
        pub = local / r.published
        res = run_row(r)
        pred = local / res["value"]
        core = _core_step(r)
        rest = pred - core
        if unit_flops is None:  # causal square of the local tokens, 4.5 forwards, all layers
            unit_flops = 4.5 * r.model.layers * 2.0 * local * local * r.model.hidden
        unit_pub = (pub - rest) / r.cp
        print(f"{r.name:24s} {pub:7.2f} {pred:7.2f} {core:6.2f} {rest:5.2f} {unit_pub:8.2f} "
              f"{core / r.cp:9.2f} {unit_flops / unit_pub / 1e12:8.0f}")
    _increments(rows + [r for r in published_runs()
                        if r.name.startswith("TT 405B TP8 PP8 FSDP")])
    return 0


def _increments(rows) -> None:
    """Second view, published figures only: in each table a rank's work is the same but for
    its attention, which grows by one unit per cp, so the GPU-seconds per million tokens
    (1e6 / tokens per GPU per second) grow, from one row to the next, by the added units'
    cost. Printed per added unit, published and predicted, for the 8B and the 405B rows."""
    print("\nGPU-s per million tokens, added per unit of attention work (cp a -> b: / (b - a))")
    for prefix in ("TT 8B FSDP", "TT 405B TP8 PP8 FSDP"):
        group = [r for r in rows if r.name.startswith(prefix)]
        pred = {r.name: run_row(r)["value"] for r in group}
        for a, b in zip(group, group[1:]):
            units = b.cp - a.cp
            pub = (1e6 / b.published - 1e6 / a.published) / units
            mod = (1e6 / pred[b.name] - 1e6 / pred[a.name]) / units
            print(f"{prefix:22s} cp {a.cp} -> {b.cp}: published {pub:8.1f}  predicted {mod:8.1f}"
                  f"  ratio {pub / mod:5.2f}")


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    sys.exit(main())
