"""The compression / DiLoCo note of `meshtron plan`: when the best plan is bound by inter-node
data-parallel traffic, the same layout priced with int8 gradients and with DiLoCo.

Apart from compression.py because it runs the estimator (estimate.py), which itself prices
compression through compression.py: kept here, the two form no import circle."""

from __future__ import annotations

from typing import Any

from meshtron.planner.compression import changes_dp
from meshtron.planner.estimate import Evaluator
from meshtron.planner.placement import groups_for_cost


def _best_variant(est, cfg, change: dict, variants) -> tuple[Any, str] | None:
    """Fastest plan that fits among `cfg` with `change` and each (ZeRO stage, dp_replicate) of
    `variants`; returns (estimate, its flags)."""
    found = None
    for zero, rep in variants:
        try:
            plan = cfg.replace(zero=zero, dp_replicate=rep, **change)
            est_ = est.evaluate(plan)
        except ValueError:  # the plan rules refuse this combination
            continue
        if est_ is not None and est_.fits and (found is None
                                               or est_.time.total < found[0].time.total):
            # flags `meshtron plan` and `meshtron train` take as written
            found = (est_, f"--zero {zero}" + (f" --dp-replicate {rep}" if rep > 1 else ""))
    return found


def advice(result) -> str | None:
    """One line for `meshtron plan` (a SearchResult) when the best plan is bound by inter-node
    data-parallel traffic (at least 10% of its step, over a group spanning nodes): the best
    plan's layout with int8 gradient compression (any ZeRO stage that fits) and with DiLoCo
    (H=16: full replicas with ZeRO-0, or one replica per node sharded inside it), and their
    step times. None otherwise."""
    best = result.best
    if best is None or changes_dp(best.config):
        return None
    cfg, t = best.config, best.time
    group = groups_for_cost(cfg, result.cluster.gpus_per_node)["dp"]
    if group.nodes <= 1 or t.dp_comm < 0.1 * t.total:
        return None
    est = Evaluator(result.model, result.cluster, result.global_batch, result.seq_len,
                    result.options)
    options = []
    per_node = [(z, group.nodes) for z in (2, 3) if cfg.dp % group.nodes == 0]
    for label, change, variants in (
            ("--grad-compression int8", dict(grad_compression="int8"),
             [(z, 1) for z in (0, 1, 2, 3)]),
            ("--diloco 16", dict(diloco=16), [(0, 1)] + per_node)):
        found = _best_variant(est, cfg, change, variants)
        if found is None:
            options.append(f"{label}: does not fit")
            continue
        other, flags = found
        gain = t.total / other.time.total
        verdict = f"{gain:.2f}x faster" if gain > 1 else "no gain"
        options.append(f"{label} {flags}: {other.time.total:.3g} s ({verdict})")
    return (f"inter-node bound: data-parallel traffic is {t.dp_comm / t.total:.0%} of the "
            f"{t.total:.3g} s step across {group.nodes} nodes; " + "; ".join(options)
            + " (DiLoCo's loss per step is not modelled)")
