"""The JSON document of `meshtron cost` (schema 'meshtron-cost/1'), its recommendation and the
warnings on regimes where the figures need a word (model.py computes them)."""

from __future__ import annotations

import math
from typing import Any

from meshtron.cost.catalogue import GpuEconomics
from meshtron.cost.model import FAILURES_ONLY, Pricing, RunSpec

LABELS = {"on_demand": "on-demand", "spot": "spot"}
"""How the text names a pricing (the JSON keys keep the underscore)."""


def seconds_text(x: float) -> str:
    """'0.96 s', '48.7 s', '9,636 s': three significant figures, no false precision."""
    return f"{x:.3g} s" if x < 100 else f"{x:,.0f} s"


def summary(run: RunSpec, econ: GpuEconomics, pricings: dict[str, Pricing],
            deadline_days: float | None = None) -> dict[str, Any]:
    """The JSON document. The top-level days, GPU-hours, energy and P50/P90 are one pricing's,
    named by `top_level_pricing` (on-demand's, unless it never finishes); each pricing's own
    figures are under its key."""
    od, sp = pricings["on_demand"], pricings["spot"]
    top = od if od.never is None else sp
    facility_kw = run.gpus * econ.system_w_per_gpu * run.pue / 1000.0

    def pricing_doc(p: Pricing) -> dict[str, Any]:
        doc = {"checkpoint_interval_s": p.interval_s,
               "checkpoints_before_end": p.checkpoints_before_end,
               "interval_mtbf_s": p.mtbf_s, "interval_mtbf_counts": p.mtbf_counts,
               "daly_interval_s": p.daly_s, "price_per_gpu_hour": p.price,
               "finishes": p.never is None, "never_finishes": p.never}
        if p.never is not None:
            return {**doc, **dict.fromkeys((
                "days", "gpu_hours", "cost_usd", "energy_kwh", "gpu_energy_kwh", "expected_s",
                "p50_days", "p90_days", "p50_cost_usd", "p90_cost_usd", "mc_mean_days",
                "mc_sem_days", "interval_scan_mean_days"))}
        h = p.expected_wall_s / 3600.0
        cost = lambda days: days * 24 * run.gpus * p.price  # noqa: E731
        mean, sem = p.mc_mean_sem_s()
        return {**doc, "days": h / 24, "gpu_hours": run.gpus * h,
                "cost_usd": run.gpus * h * p.price, "energy_kwh": facility_kw * h,
                "gpu_energy_kwh": run.gpus * econ.tdp_w * h / 1000,
                "expected_s": p.breakdown_s,
                "p50_days": p.percentile_days(50), "p90_days": p.percentile_days(90),
                "p50_cost_usd": cost(p.percentile_days(50)),
                "p90_cost_usd": cost(p.percentile_days(90)),
                "mc_mean_days": mean / 86400, "mc_sem_days": sem / 86400,
                "interval_scan_mean_days": {str(f): _finite(w / 86400)
                                            for f, w in p.interval_scan.items()}}

    docs = {"on_demand": pricing_doc(od), "spot": pricing_doc(sp)}
    head = docs[top.name]
    return {
        "schema": "meshtron-cost/1",
        "gpus": run.gpus, "step_time_s": run.step_time_s, "tokens": run.tokens,
        "failure_free_days": run.work_s / 86400,
        "top_level_pricing": top.name,
        **{k: head[k] for k in ("days", "gpu_hours", "energy_kwh", "gpu_energy_kwh",
                                "p50_days", "p90_days")},
        "cost_usd": {name: d["cost_usd"] for name, d in docs.items()},
        "checkpoint": {"bytes": run.checkpoint_bytes,
                       "bytes_per_param": run.checkpoint_bytes_per_param,
                       "bytes_per_param_parts": run.checkpoint_parts,
                       "save_s": run.save_s, "restart_s": run.fail_restart_s,
                       "mtbf_s": run.mtbf_s, "mtbf_counts": FAILURES_ONLY,
                       "daly_interval_s": od.daly_s,  # on demand's: failures only
                       "spot_preemption_mtbf_s": _finite(run.preempt_mtbf_s),
                       "spot_notice_s": run.spot_notice_s,
                       "spot_reacquire_s": run.spot_reacquire_s},
        **docs,
        "prices": {"on_demand": econ.on_demand, "spot": econ.spot, "source": econ.source,
                   "tdp_w": econ.tdp_w, "system_w_per_gpu": econ.system_w_per_gpu,
                   "pue": run.pue},
        "recommendation": recommend(run, pricings, deadline_days),
    }


def recommend(run: RunSpec, pricings: dict[str, Pricing],
              deadline_days: float | None = None) -> dict[str, Any]:
    """On-demand or spot (cheaper at P90 that meets the deadline at P90; only one that
    finishes), and the interval."""
    live = {n: p for n, p in pricings.items() if p.never is None}
    cost90 = {n: p.percentile_days(90) * 24 * run.gpus * p.price for n, p in live.items()}
    days90 = {n: p.percentile_days(90) for n, p in live.items()}
    reasons = []
    pick = min(cost90, key=cost90.get)
    other = "on_demand" if pick == "spot" else "spot"
    if other not in live:
        reasons.append(f"{LABELS[other]} never finishes: {pricings[other].never}; "
                       f"{LABELS[pick]}: P90 cost ${cost90[pick]:,.0f}, P90 days "
                       f"{days90[pick]:.1f}")
    else:
        saving = 1 - cost90[pick] / cost90[other] if cost90[other] > 0 else 0.0
        reasons.append(f"P90 cost {LABELS[pick]} ${cost90[pick]:,.0f} vs {LABELS[other]} "
                       f"${cost90[other]:,.0f} ({saving:.0%} less); P90 days "
                       f"{days90[pick]:.1f} vs {days90[other]:.1f}")
        if deadline_days is not None and days90[pick] > deadline_days >= days90[other]:
            reasons.append(f"{LABELS[pick]} misses the {deadline_days:g}-day deadline at P90 "
                           f"({days90[pick]:.1f} days); {LABELS[other]} meets it")
            pick = other
    chosen = pricings[pick]
    scan = chosen.interval_scan
    best_f = min(scan, key=scan.get) if scan else 1.0
    work = chosen.breakdown_s["work"]
    over = {k: v / work for k, v in chosen.breakdown_s.items() if k != "work"}
    reasons.append(
        "checkpoint every " + pricing_interval_text(chosen)
        + f"; save {seconds_text(run.save_s)}: expected overhead {sum(over.values()):.1%} = "
        + " + ".join(f"{overhead_label(k, chosen)} {v:.1%}" for k, v in over.items()))
    if scan:
        ref = scan.get(1.0, min(scan.values()))
        given = ("the run's length (the interval is longer)" if chosen.checkpoints_before_end == 0
                 else "Daly's interval" if is_daly(chosen.interval_s, chosen.daly_s)
                 else "that interval")
        reasons.append(f"Monte Carlo mean wall time at x0.25..x4 {given}: "
                       + ", ".join(f"x{f:g} {(w / ref - 1) * 100:+.2f}%" for f, w in scan.items()))
    return {"pricing": pick, "checkpoint_interval_s": chosen.interval_s,
            "best_scanned_factor": best_f, "reasons": reasons}


def regime_warnings(run: RunSpec, pricings: dict[str, Pricing]) -> list[str]:
    """Lines for a pricing that never finishes (the other is priced) and for regimes where
    failures dominate: a save or a restart longer than the MTBF the interval is set for."""
    said: dict[str, list[str]] = {}
    for name, p in pricings.items():
        if p.never is not None:
            other = LABELS["on_demand" if name == "spot" else "spot"]
            said.setdefault(f"never finishes: {p.never}; {other} is priced alone", []).append(
                name)
            continue
        m = p.mtbf_s
        if run.save_s > m:
            said.setdefault(
                f"save {seconds_text(run.save_s)} > MTBF {seconds_text(m)} ({p.mtbf_counts}): "
                "most checkpoint writes are struck before they complete"
                + (" (Daly 2006: for a save >= 2 MTBF the interval is the MTBF itself)"
                   if run.save_s >= 2 * m else ""), []).append(name)
        if run.fail_restart_s > m:
            said.setdefault(
                f"restart {seconds_text(run.fail_restart_s)} > MTBF {seconds_text(m)} "
                f"({p.mtbf_counts}): most restarts are struck and start again (Daly 2006 eq. "
                f"13's e^(R/M) = {math.exp(run.fail_restart_s / m):.3g}x the restart-free wall "
                "time)", []).append(name)
    return [f"{' and '.join(LABELS[n] for n in names)}: {text}" for text, names in said.items()]


def is_daly(interval_s: float, daly_s: float) -> bool:
    """The interval used is Daly's optimum (not --checkpoint-interval-min's)."""
    return math.isclose(interval_s, daly_s, rel_tol=1e-9)


def interval_text(interval_s: float, daly_s: float, mtbf_s: float, counts: str,
                  work_s: float = math.inf) -> str:
    """'8.3 min of work (Daly's optimum for MTBF 35.87 h: <counts>)', with an interval given
    what Daly's optimum for that MTBF would be, and an interval longer than the run said so."""
    mtbf = f"MTBF {mtbf_s / 3600:.2f} h: {counts}"
    if is_daly(interval_s, daly_s):
        why = f"Daly's optimum for {mtbf}"
    else:
        why = f"--checkpoint-interval-min; Daly's optimum {daly_s / 60:.1f} min for {mtbf}"
    text = f"{interval_s / 60:.1f} min of work ({why})"
    if interval_s >= work_s:
        return (f"{text}: longer than the run's {work_s / 60:.1f} min of work, no checkpoint "
                "needed before the end (one save, of the final weights)")
    return text


def pricing_interval_text(p: Pricing) -> str:
    return interval_text(p.interval_s, p.daly_s, p.mtbf_s, p.mtbf_counts, p.work_s)


def overhead_label(key: str, p: Pricing) -> str:
    """How the text names one overhead of `p`'s breakdown (expectation.py)."""
    if key == "preemptions":
        what = ("lost work, reacquiring capacity, restart" if p.mtbf_counts != FAILURES_ONLY
                else "a save in the notice, reacquiring capacity, restart")
        return f"spot preemptions ({what})"
    return {"checkpoint_stalls": "checkpoint stalls", "lost_work": "work lost to failures",
            "restarts": "restarts after failures"}.get(key, key.replace("_", " "))


def _finite(value: float) -> float | None:
    """None for inf (strict JSON has no Infinity)."""
    return value if math.isfinite(value) else None
