"""Why one sweep point scales better or worse than the previous one, from the two plans' priced
pieces. Torch-free.

A point's pieces are the step seconds the planner priced, taken apart as finely as it prices
them: for a plan without a pipeline, planner/step_categories.py's kinds (GEMMs, attention core,
memory-bound kernels, FP8 casts, waiting on the host, gradient accumulation, optimizer, offload
copies) with the exposed communication kept per kind (TimeBreakdown's tp / dp / ep / pp parts);
for a pipelined plan, TimeBreakdown's parts (step_categories prices one stage only). Each piece
is turned into GPU-seconds per token (seconds x GPUs / tokens per step: constant under perfect
scaling). The explanation is the pieces whose GPU-seconds per token moved, in the direction the
whole step moved (the causes), then the ones that moved against it, and the plan's knobs that
changed: nothing is named as a cause unless its own priced seconds per token grew.
"""

from __future__ import annotations

import math
from typing import Any

PIECES = {
    "gemm": "GEMMs",
    "attention": "attention core",
    "elementwise": "memory-bound kernels",
    "fp8_cast": "FP8 casts",
    "host_wait": "GPU waiting on the host (launches, synchronisations)",
    "moe": "MoE layers' work beyond dense",
    "grad_accumulation": "gradient accumulation",
    "compute": "compute",
    "tp_comm": "tensor-parallel communication",
    "pp_comm": "pipeline transfers",
    "dp_comm": "exposed data-parallel communication",
    "ep_comm": "exposed expert-parallel all-to-all",
    "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "offload": "host-link copies of offloaded state",
    # grows with the world: Composer's train-metric sync over every rank (composer_metrics)
    "step_host": "host work at the step's end (train-metric sync over every rank)",
    # grows with dp x tp x cp at a fixed number of micro-batches (fp8_amax.py)
    "fp8_sync": "FP8 amax all-reduces (delayed scaling)",
}
"""Every piece a point can have, and how the explanation names it."""
COMM = ("tp_comm", "dp_comm", "ep_comm", "pp_comm", "fp8_sync")
"""TimeBreakdown's exposed communication, which step_categories sums into 'communication'."""
PARTS = ("compute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "ep_comm",
         "offload", "step_host", "fp8_sync")
"""Every part of estimate_results.TimeBreakdown (they add up to the step; each a column of the
sweep's CSV): the pieces of a pipelined plan. The step categories' kinds that are not parts
(GEMMs, attention, memory-bound kernels, FP8 casts, host waits, MoE, gradient accumulation)
add up to its 'compute'."""
EVEN = 5e-4
"""A change of GPU-time per token below 0.05% of the step is reported as even scaling."""
SHOWN = 3
"""Pieces named on each side of an explanation, largest change first."""
KNOB_NAMES = {"micro_batch": "mb", "virtual_stages": "vstages"}
"""Plan fields the plan-change text names shorter (as Plan.describe)."""
NOT_KNOBS = ("dp", "model", "cluster", "global_batch", "seq_len", "predicted", "stage_layers",
             "ranks_per_node")
"""Plan fields that are not choices of the plan: dp follows the GPU count, the rest the run."""


def priced_pieces(result: Any, model: Any, est: Any) -> dict[str, float]:
    """Seconds per step of `est` (the best plan of search `result`) by piece (module docstring);
    they add up to its step time."""
    t = est.time
    parts = {k: getattr(t, k) for k in PARTS}
    if est.config.pp != 1:
        return parts
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.step_categories import step_categories

    fw = result.framework
    ev = Evaluator(model, result.cluster, result.global_batch, result.seq_len, result.options,
                   mem=fw.memory if fw is not None else None)
    again = ev.evaluate(est.config)
    if again is None or not math.isclose(again.step_time_s, est.step_time_s, rel_tol=1e-9):
        return parts  # the search priced it otherwise: keep the parts it priced
    cats = step_categories(ev, again)
    cats.pop("communication")  # kept per kind, from the same TimeBreakdown
    cats["host_wait"] -= t.step_host  # step_categories folds the step's host work in there
    cats.update({k: getattr(t, k) for k in COMM}, step_host=t.step_host)
    return cats


def plan_knobs(config: Any) -> dict[str, Any]:
    """The knobs of a plan that a change of plan between two sizes is told by."""
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in NOT_KNOBS}


def plan_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """'tp 2->1, sp on->off' (empty when only the data-parallel degree changed)."""
    def show(value: Any) -> str:
        if isinstance(value, bool) or value is None:
            return {True: "on", False: "off", None: "none"}[value]
        return str(value)

    return ", ".join(f"{KNOB_NAMES.get(k, k)} {show(before.get(k))}->{show(v)}"
                     for k, v in after.items() if before.get(k) != v)


def explain(prev: Any, point: Any, seq: int) -> str:
    """Why `point` scales as it does against `prev` (two SweepPoints with plans)."""
    def per_token(q: Any) -> dict[str, float]:
        return {k: s * q.gpus / (q.global_batch * seq) for k, s in q.pieces_s.items()}

    before, after = per_token(prev), per_token(point)
    if ("compute" in before) != ("compute" in after):  # one plan pipelined: compare its parts
        before, after = _parts(before), _parts(after)
    base = sum(before.values())
    moved = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / base
             for k in dict.fromkeys([*before, *after])}
    total = sum(moved.values())
    change = plan_change(prev.knobs, point.knobs)
    plan = f"; plan {change}" if change else ""
    if abs(total) < EVEN:
        return f"scales evenly (GPU-time per token {total:+.2%}{plan})"
    sign = 1.0 if total > 0 else -1.0
    causes = _named([k for k in moved if moved[k] * sign > 0], moved, point, keep_one=True)
    against = _named([k for k in moved if moved[k] * sign < 0], moved, point)
    text = ", ".join(causes) + (f" (against: {', '.join(against)})" if against else "")
    if total > 0:
        return f"slower per token (GPU-time per token {total:+.1%}{plan}): {text}"
    return f"scales better (GPU-time per token {total:+.1%}{plan}): {text}"


def _parts(pieces: dict[str, float]) -> dict[str, float]:
    """Pieces folded into TimeBreakdown's parts (PARTS)."""
    out = {k: pieces.get(k, 0.0) for k in PARTS}
    out["compute"] = sum(v for k, v in pieces.items() if k not in PARTS) + pieces.get("compute",
                                                                                     0.0)
    return out


def _named(keys: list[str], moved: dict[str, float], point: Any,
           keep_one: bool = False) -> list[str]:
    """The SHOWN pieces of `keys` that moved most, as 'name +x.x%'; those that moved less than
    EVEN are left out (`keep_one`: except the largest, so that a cause is always named)."""
    keys = sorted(keys, key=lambda k: -abs(moved[k]))
    keys = keys[:int(keep_one)] + [k for k in keys[int(keep_one):] if abs(moved[k]) >= EVEN]
    out = []
    for k in keys[:SHOWN]:
        piped = k == "bubble" and point.knobs.get("pp", 1) > 1
        extra = f" ({point.microbatches} micro-batches per replica)" if piped else ""
        out.append(f"{PIECES.get(k, k)} {moved[k]:+.1%}{extra}")
    return out
