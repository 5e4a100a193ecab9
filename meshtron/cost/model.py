"""What a training run costs: days, GPU-hours, energy and money, with failures and preemptions.

Expected values come from meshtron/reliability/interval.py (Young/Daly, Daly's expected wall
time: the same code `meshtron train --checkpoint-every auto` uses); the distribution (P50, P90)
from the Monte Carlo in montecarlo.py. Everything is per whole job: the job's failure rate is
the per-GPU rate times the GPUs (any failed GPU stops a synchronous job), its preemption rate
the per-node rate times the nodes.

Checkpoint save cost: the model states one checkpoint holds, fp32 master weights and two fp32
AdamW moments (12 bytes per parameter; bf16 copies are rebuilt on load), plus, for a plan with
gradient compression or DiLoCo, their state (planner/memory_compress.py
`checkpoint_extra_per_param`: every rank's own error-feedback residual, so 4 B x the
data-parallel group's size per parameter, and the group's mean), written at the
storage's aggregate bandwidth: a synchronous save stalls training that long (asynchronous
checkpointing would hide most of it; this is the conservative figure). Restart = fixed restart
time (reschedule, start processes, NCCL init) + reading the checkpoint back at the same rate.

Spot: a preemption whose notice covers a checkpoint write (notice >= save cost) loses no work
but costs the save and a restart after reacquiring capacity; otherwise it loses work as a
failure does, and spot's interval is Daly's for the failures and those preemptions together
(RunSpec.interval_mtbf: every interval printed names the MTBF it is set for and what it
counts). The expected overhead keeps preemptions a cause of their own: the interruptions are
split by their rates, a failure costing its lost work and restart, a preemption also the time
to get capacity back. Billing assumes every GPU is paid for over the whole wall time, restarts
included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshtron.cost.catalogue import DEFAULT_PUE, GpuEconomics
from meshtron.cost.montecarlo import RunProcess, simulate
from meshtron.errors import UserError
from meshtron.reliability import (DEFAULT_GPU_FAILURES_PER_HOUR, cluster_mtbf_s,
                                  daly_interval_s, expected_lost_work_s, expected_wall_s)

CHECKPOINT_BYTES_PER_PARAM = 12.0
"""fp32 master weights + two fp32 AdamW moments (module docstring)."""
DEFAULT_STORAGE_GB_PER_S = 100.0
"""Aggregate checkpoint write bandwidth, GB/s: a mid-size parallel file system (Llama 3's
Tectonic sustained 2,000 GB/s for 16k GPUs, Dubey et al. 2024, section 3.3.1)."""
DEFAULT_RESTART_S = 600.0
"""Restart after a failure before the checkpoint load: detect, reschedule, start, init NCCL."""
DEFAULT_SPOT_PREEMPTIONS_PER_NODE_HOUR = 0.2 / 720
"""AWS Spot Instance Advisor's worst interruption bucket (> 20% of instances per month), where
8-GPU instances usually sit: 0.2 per node-month."""
DEFAULT_SPOT_NOTICE_S = 120.0
"""AWS's two-minute spot interruption notice (GCP and Azure give 30 s)."""
DEFAULT_SPOT_REACQUIRE_S = 1800.0
"""Time to get spot capacity back after a preemption (assumption; depends on the market)."""
FAILURES_ONLY = "hardware failures only"
"""What the job MTBF counts on demand, and on spot when a preemption's notice covers a save."""
FAILURES_AND_PREEMPTIONS = "hardware failures + spot preemptions without notice enough to save"
"""What the MTBF of spot's checkpoint interval counts when preemptions lose work."""
INTERVAL_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
"""Checkpoint intervals tried by the Monte Carlo, as multiples of Daly's."""


def _check(name: str, value: float, positive: bool = False, finite: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value > 0 if positive else value >= 0) and (math.isfinite(value) or not finite)
    if not ok:
        raise UserError(f"{name}={value!r}: must be a {'positive' if positive else 'non-negative'}"
                        " finite number")
    return float(value)


@dataclass(frozen=True)
class RunSpec:
    """A training run to cost: the plan's speed and size, and the failure environment."""

    gpus: int
    """GPUs of the job."""
    gpus_per_node: int
    """GPUs per node (preemptions take whole nodes)."""
    step_time_s: float
    """Failure-free optimizer step time (the planner's)."""
    tokens_per_step: float
    """Tokens per optimizer step (global batch x sequence length)."""
    tokens: float
    """Training budget in tokens."""
    params: float
    """Model parameters (for the checkpoint size)."""
    storage_gb_per_s: float = DEFAULT_STORAGE_GB_PER_S
    """Aggregate checkpoint write (and read) bandwidth, GB/s."""
    restart_s: float = DEFAULT_RESTART_S
    """Fixed part of a restart, seconds (the checkpoint load is added)."""
    failures_per_gpu_hour: float = DEFAULT_GPU_FAILURES_PER_HOUR
    """Hardware failure rate per GPU-hour (default: Llama 3's, reliability/interval.py)."""
    spot_preemptions_per_node_hour: float = DEFAULT_SPOT_PREEMPTIONS_PER_NODE_HOUR
    """Spot preemptions per node-hour."""
    spot_notice_s: float = DEFAULT_SPOT_NOTICE_S
    """Spot preemption notice, seconds."""
    spot_reacquire_s: float = DEFAULT_SPOT_REACQUIRE_S
    """Extra restart time after a preemption (getting capacity back), seconds."""
    pue: float = DEFAULT_PUE
    """Facility power usage effectiveness (>= 1)."""
    interval_s: float | None = None
    """Work between checkpoints, seconds; None: Daly's optimum for each pricing."""
    checkpoint_bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM
    """Bytes one checkpoint holds per model parameter (module docstring)."""
    checkpoint_parts: str = "12 model and AdamW"
    """What those bytes are, per parameter (the report's words)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.gpus, int) and self.gpus >= 1):
            raise UserError(f"gpus={self.gpus!r}: must be a whole number >= 1")
        for name in ("step_time_s", "tokens_per_step", "tokens", "params", "storage_gb_per_s",
                     "failures_per_gpu_hour"):
            _check(name, getattr(self, name), positive=True)
        for name in ("restart_s", "spot_preemptions_per_node_hour", "spot_notice_s",
                     "spot_reacquire_s"):
            _check(name, getattr(self, name))
        if _check("pue", self.pue, positive=True) < 1.0:
            raise UserError(f"pue={self.pue!r}: must be >= 1 (facility power / IT power)")
        if self.interval_s is not None:
            _check("interval_s", self.interval_s, positive=True)

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.gpus / self.gpus_per_node))

    @property
    def work_s(self) -> float:
        return math.ceil(self.tokens / self.tokens_per_step) * self.step_time_s

    @property
    def save_s(self) -> float:
        return self.checkpoint_bytes / (self.storage_gb_per_s * 1e9)

    @property
    def checkpoint_bytes(self) -> float:
        return self.checkpoint_bytes_per_param * self.params

    @property
    def fail_restart_s(self) -> float:
        return self.restart_s + self.save_s  # reading back what was written

    @property
    def mtbf_s(self) -> float:
        return cluster_mtbf_s(self.gpus, self.failures_per_gpu_hour)

    @property
    def preempt_rate(self) -> float:
        return self.spot_preemptions_per_node_hour * self.nodes / 3600.0

    @property
    def preempt_mtbf_s(self) -> float:
        """Mean time between spot preemptions of the whole job (inf: none)."""
        return 1.0 / self.preempt_rate if self.preempt_rate > 0 else math.inf

    def interval_mtbf(self, spot: bool) -> tuple[float, str]:
        """(MTBF, what it counts) that the checkpoint interval of a pricing is set for: the
        interruptions that lose work (RunProcess.lossy_rate)."""
        proc = self.process(spot, 1.0)
        lossy = spot and proc.preempt_rate > 0 and not proc.preempt_saves
        return 1.0 / proc.lossy_rate, FAILURES_AND_PREEMPTIONS if lossy else FAILURES_ONLY

    def process(self, spot: bool, interval_s: float | None = None) -> RunProcess:
        """The Monte Carlo process for on-demand or spot, at `interval_s` (None: Daly's
        optimum for the interruptions that lose work)."""
        proc = RunProcess(work_s=self.work_s, interval_s=1.0, save_s=self.save_s,
                          fail_rate=1.0 / self.mtbf_s, restart_s=self.fail_restart_s,
                          preempt_rate=self.preempt_rate if spot else 0.0,
                          preempt_restart_s=self.fail_restart_s + self.spot_reacquire_s,
                          notice_s=self.spot_notice_s)
        tau = interval_s or self.interval_s or daly_interval_s(self.save_s, 1.0 / proc.lossy_rate)
        return RunProcess(**{**vars(proc), "interval_s": tau})


@dataclass
class Pricing:
    """Expected and Monte Carlo figures of one pricing (on-demand or spot)."""

    name: str
    """'on_demand' or 'spot'."""
    interval_s: float
    """Checkpoint interval used (work seconds between checkpoints)."""
    expected_wall_s: float
    """Expected wall time (Daly's formula, plus lossless preemptions)."""
    breakdown_s: dict[str, float]
    """Expected seconds by cause: work, checkpoint stalls, lost work, restarts, preemptions."""
    samples_wall_s: np.ndarray
    """Monte Carlo wall time of each run."""
    price: float
    """USD per GPU-hour."""
    interval_scan: dict[float, float] = field(default_factory=dict)
    """Monte Carlo mean wall seconds at multiples of Daly's interval."""
    mtbf_s: float = math.inf
    """MTBF the interval is set for (RunSpec.interval_mtbf)."""
    mtbf_counts: str = FAILURES_ONLY
    """What that MTBF counts."""
    daly_s: float = math.nan
    """Daly's optimum interval for that MTBF (the interval used, unless one was given)."""

    def percentile_days(self, q: float) -> float:
        return float(np.percentile(self.samples_wall_s, q)) / 86400.0


def expected_pricing(run: RunSpec, spot: bool) -> tuple[float, float, dict[str, float]]:
    """(interval, expected wall seconds, breakdown) from the closed forms."""
    proc = run.process(spot)
    m = 1.0 / proc.lossy_rate
    restart = proc.restart_s
    if spot and not proc.preempt_saves and proc.preempt_rate > 0:
        # mean restart over the two kinds of interruption, weighted by their rates
        restart = (proc.fail_rate * proc.restart_s
                   + proc.preempt_rate * proc.preempt_restart_s) / proc.lossy_rate
    wall = expected_wall_s(proc.work_s, proc.interval_s, proc.save_s, m, restart)
    checkpoints = proc.work_s / proc.interval_s
    interrupts = wall / m
    lost_each = expected_lost_work_s(proc.interval_s, proc.save_s, m)
    # the interruptions split by their rates (Poisson: each loses the same expected work), so
    # that preemptions stay an overhead of their own beside the failures
    failures = interrupts * proc.fail_rate / proc.lossy_rate
    parts = {"work": proc.work_s, "checkpoint_stalls": checkpoints * proc.save_s,
             "lost_work": failures * lost_each, "restarts": failures * proc.restart_s}
    if proc.lossy_rate > proc.fail_rate:  # spot preemptions without notice enough to save
        parts["preemptions"] = (interrupts - failures) * (lost_each + proc.preempt_restart_s)
    if spot and proc.preempt_saves and proc.preempt_rate > 0:
        each = proc.save_s + proc.preempt_restart_s
        busy = proc.preempt_rate * each
        if busy >= 1.0:
            raise UserError(f"spot_preemptions_per_node_hour={run.spot_preemptions_per_node_hour}"
                            f": a preemption every {1 / proc.preempt_rate:.0f} s but each costs "
                            f"{each:.0f} s; the run never finishes on spot")
        extra = wall * busy / (1.0 - busy)
        parts["preemptions"] = extra
        wall += extra
    return proc.interval_s, wall, parts


def cost_run(run: RunSpec, econ: GpuEconomics, runs: int = 2000, seed: int = 0,
             scan: bool = True) -> dict[str, Pricing]:
    """Both pricings: expected figures and `runs` Monte Carlo samples each."""
    if not (isinstance(runs, int) and runs >= 10):
        raise UserError(f"runs={runs!r}: must be a whole number >= 10")
    out = {}
    for name, spot, price in (("on_demand", False, econ.on_demand), ("spot", True, econ.spot)):
        tau, wall, parts = expected_pricing(run, spot)
        samples = simulate(run.process(spot), runs, seed)
        mtbf, counts = run.interval_mtbf(spot)
        p = Pricing(name, tau, wall, parts, samples.wall_s, price, mtbf_s=mtbf,
                    mtbf_counts=counts, daly_s=daly_interval_s(run.save_s, mtbf))
        if scan:
            small = max(10, runs // 4)
            for f in INTERVAL_FACTORS:
                s = simulate(run.process(spot, tau * f), small, seed + 1)
                p.interval_scan[f] = float(s.wall_s.mean())
        out[name] = p
    return out


def summary(run: RunSpec, econ: GpuEconomics, pricings: dict[str, Pricing],
            deadline_days: float | None = None) -> dict[str, Any]:
    """The JSON document of `meshtron cost` (schema 'meshtron-cost/1')."""
    od, sp = pricings["on_demand"], pricings["spot"]
    hours = od.expected_wall_s / 3600.0
    gpu_hours = run.gpus * hours
    facility_kw = run.gpus * econ.system_w_per_gpu * run.pue / 1000.0

    def pricing_doc(p: Pricing) -> dict[str, Any]:
        h = p.expected_wall_s / 3600.0
        cost = lambda days: days * 24 * run.gpus * p.price  # noqa: E731
        return {"checkpoint_interval_s": p.interval_s, "interval_mtbf_s": p.mtbf_s,
                "interval_mtbf_counts": p.mtbf_counts, "daly_interval_s": p.daly_s,
                "days": h / 24, "gpu_hours": run.gpus * h,
                "cost_usd": run.gpus * h * p.price, "price_per_gpu_hour": p.price,
                "expected_s": p.breakdown_s,
                "p50_days": p.percentile_days(50), "p90_days": p.percentile_days(90),
                "p50_cost_usd": cost(p.percentile_days(50)),
                "p90_cost_usd": cost(p.percentile_days(90)),
                "interval_scan_mean_days": {str(f): w / 86400 for f, w in p.interval_scan.items()}}

    return {
        "schema": "meshtron-cost/1",
        "gpus": run.gpus, "step_time_s": run.step_time_s, "tokens": run.tokens,
        "failure_free_days": run.work_s / 86400,
        "days": hours / 24, "gpu_hours": gpu_hours,
        "energy_kwh": facility_kw * hours, "gpu_energy_kwh": run.gpus * econ.tdp_w * hours / 1000,
        "cost_usd": {"on_demand": od.expected_wall_s / 3600 * run.gpus * od.price,
                     "spot": sp.expected_wall_s / 3600 * run.gpus * sp.price},
        "p50_days": od.percentile_days(50), "p90_days": od.percentile_days(90),
        "checkpoint": {"bytes": run.checkpoint_bytes,
                       "bytes_per_param": run.checkpoint_bytes_per_param,
                       "bytes_per_param_parts": run.checkpoint_parts,
                       "save_s": run.save_s, "restart_s": run.fail_restart_s,
                       "mtbf_s": run.mtbf_s, "mtbf_counts": FAILURES_ONLY,
                       "daly_interval_s": od.daly_s,  # on demand's: failures only
                       "spot_preemption_mtbf_s": _finite(run.preempt_mtbf_s),
                       "spot_notice_s": run.spot_notice_s,
                       "spot_reacquire_s": run.spot_reacquire_s},
        "on_demand": pricing_doc(od), "spot": pricing_doc(sp),
        "prices": {"on_demand": econ.on_demand, "spot": econ.spot, "source": econ.source,
                   "tdp_w": econ.tdp_w, "system_w_per_gpu": econ.system_w_per_gpu,
                   "pue": run.pue},
        "recommendation": recommend(run, pricings, deadline_days),
    }


def recommend(run: RunSpec, pricings: dict[str, Pricing],
              deadline_days: float | None = None) -> dict[str, Any]:
    """On-demand or spot (cheaper at P90 that meets the deadline at P90), and the interval."""
    od, sp = pricings["on_demand"], pricings["spot"]
    cost90 = {p.name: p.percentile_days(90) * 24 * run.gpus * p.price for p in (od, sp)}
    days90 = {p.name: p.percentile_days(90) for p in (od, sp)}
    reasons = []
    pick = min(cost90, key=cost90.get)
    other = "on_demand" if pick == "spot" else "spot"
    saving = 1 - cost90[pick] / cost90[other] if cost90[other] > 0 else 0.0
    reasons.append(f"P90 cost {pick} ${cost90[pick]:,.0f} vs {other} ${cost90[other]:,.0f} "
                   f"({saving:.0%} less); P90 days {days90[pick]:.1f} vs {days90[other]:.1f}")
    if deadline_days is not None and days90[pick] > deadline_days >= days90[other]:
        reasons.append(f"{pick} misses the {deadline_days:g}-day deadline at P90 "
                       f"({days90[pick]:.1f} days); {other} meets it")
        pick = other
    chosen = pricings[pick]
    scan = chosen.interval_scan
    best_f = min(scan, key=scan.get) if scan else 1.0
    work = chosen.breakdown_s["work"]
    over = {k: v / work for k, v in chosen.breakdown_s.items() if k != "work"}
    reasons.append(
        "checkpoint every "
        + interval_text(chosen.interval_s, chosen.daly_s, chosen.mtbf_s, chosen.mtbf_counts)
        + f"; save {run.save_s:.0f} s: expected overhead "
        + ", ".join(f"{overhead_label(k, chosen)} {v:.1%}" for k, v in over.items()))
    if scan:
        ref = scan.get(1.0, min(scan.values()))
        given = "Daly's" if is_daly(chosen.interval_s, chosen.daly_s) else "that"
        reasons.append(f"Monte Carlo mean wall time at x0.25..x4 {given} interval: "
                       + ", ".join(f"x{f:g} {(w / ref - 1) * 100:+.2f}%" for f, w in scan.items()))
    return {"pricing": pick, "checkpoint_interval_s": chosen.interval_s,
            "best_scanned_factor": best_f, "reasons": reasons}


def is_daly(interval_s: float, daly_s: float) -> bool:
    """The interval used is Daly's optimum (not --checkpoint-interval-min's)."""
    return math.isclose(interval_s, daly_s, rel_tol=1e-9)


def interval_text(interval_s: float, daly_s: float, mtbf_s: float, counts: str) -> str:
    """'8.3 min of work (Daly's optimum for MTBF 35.87 h: <counts>)', or with an interval given,
    what Daly's optimum for that MTBF would be."""
    mtbf = f"MTBF {mtbf_s / 3600:.2f} h: {counts}"
    if is_daly(interval_s, daly_s):
        return f"{interval_s / 60:.1f} min of work (Daly's optimum for {mtbf})"
    return (f"{interval_s / 60:.1f} min of work (--checkpoint-interval-min; Daly's optimum "
            f"{daly_s / 60:.1f} min for {mtbf})")


def overhead_label(key: str, p: Pricing) -> str:
    """How the text names one overhead of `p`'s breakdown (expected_pricing)."""
    if key == "preemptions":
        what = ("lost work, reacquiring capacity, restart" if p.mtbf_counts != FAILURES_ONLY
                else "a save in the notice, reacquiring capacity, restart")
        return f"spot preemptions ({what})"
    return {"checkpoint_stalls": "checkpoint stalls", "lost_work": "work lost to failures",
            "restarts": "restarts after failures"}.get(key, key.replace("_", " "))


def _finite(value: float) -> float | None:
    """None for inf (strict JSON has no Infinity)."""
    return value if math.isfinite(value) else None
