"""What a training run costs: days, GPU-hours, energy and money, with failures and preemptions.

The checkpoint interval is Daly's optimum from meshtron/reliability/interval.py (the code
`meshtron train --checkpoint-every auto` uses); the expected wall time and its parts are the
closed form (expectation.py: Daly 2006 eq. 13, failures striking restarts too) of the very
process the Monte Carlo in montecarlo.py samples for the distribution (P50, P90), so the "days"
are the mean of the runs behind P50/P90 and the overheads add up to the total. Everything is per whole job: the job's failure rate is
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
counts). The expected overhead keeps preemptions a cause of their own: an interruption is a
failure or a preemption by their rates, a failure costing its lost work and restart, a
preemption also the time to get capacity back. Billing assumes every GPU is paid for over the whole wall time, restarts
included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshtron.cost.catalogue import DEFAULT_PUE, GpuEconomics
from meshtron.cost.expectation import Expectation, expect
from meshtron.cost.montecarlo import RunProcess, simulate
from meshtron.errors import UserError
from meshtron.reliability import DEFAULT_GPU_FAILURES_PER_HOUR, cluster_mtbf_s, daly_interval_s

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
    """Expected wall time of the Monte Carlo's process (expectation.py; inf: never finishes)."""
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
    work_s: float = math.nan
    """Failure-free work of the run (an interval at least this long: one segment)."""
    never: str | None = None
    """Why this pricing never finishes (expectation.py); None: it does."""

    @property
    def checkpoints_before_end(self) -> int:
        """Saves before the final one (0: the interval is at least the run)."""
        return max(0, math.ceil(self.work_s / self.interval_s) - 1)

    def percentile_days(self, q: float) -> float:
        if self.never is not None:
            return math.inf
        return float(np.percentile(self.samples_wall_s, q)) / 86400.0

    def mc_mean_sem_s(self) -> tuple[float, float]:
        """The Monte Carlo's mean wall time and its standard error (sample sd / sqrt(runs))."""
        s = self.samples_wall_s
        return float(s.mean()), float(s.std(ddof=1) / math.sqrt(len(s)))


def expected_pricing(run: RunSpec, spot: bool) -> tuple[float, Expectation]:
    """(interval, expected wall time and its parts) from the closed form of the very process
    the Monte Carlo samples (expectation.py: Daly 2006 eq. 13, restarts struck included)."""
    proc = run.process(spot)
    return proc.interval_s, expect(proc)


def cost_run(run: RunSpec, econ: GpuEconomics, runs: int = 2000, seed: int = 0,
             scan: bool = True) -> dict[str, Pricing]:
    """Both pricings: expected figures and `runs` Monte Carlo samples each (none for a pricing
    that never finishes: Pricing.never says why)."""
    if not (isinstance(runs, int) and runs >= 10):
        raise UserError(f"runs={runs!r}: must be a whole number >= 10")
    out = {}
    for name, spot, price in (("on_demand", False, econ.on_demand), ("spot", True, econ.spot)):
        tau, exp = expected_pricing(run, spot)
        mtbf, counts = run.interval_mtbf(spot)
        samples = (np.full(runs, math.inf) if exp.never
                   else simulate(run.process(spot), runs, seed).wall_s)
        p = Pricing(name, tau, exp.wall_s, exp.parts, samples, price, mtbf_s=mtbf,
                    mtbf_counts=counts, daly_s=daly_interval_s(run.save_s, mtbf),
                    work_s=run.work_s, never=exp.never)
        if scan and not exp.never:
            small = max(10, runs // 4)
            base = min(tau, run.work_s)  # an interval past the run: scan fractions of the run
            for f in INTERVAL_FACTORS:
                proc = run.process(spot, base * f)
                # a factor whose run never finishes is not sampled (its counts overflow)
                p.interval_scan[f] = (math.inf if expect(proc).never else
                                      float(simulate(proc, small, seed + 1).wall_s.mean()))
        out[name] = p
    return out
