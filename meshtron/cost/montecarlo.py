"""Monte Carlo of a whole training run under random failures and spot preemptions (numpy).

The process simulated, per run (the same one `model.py` takes expectations of):

* the run needs `work_s` seconds of failure-free training, cut into segments of `interval_s`
  work plus a checkpoint write of `save_s` (the last segment is shorter);
* lossy interruptions (hardware failures, and spot preemptions whose notice is too short to
  write a checkpoint) arrive as a Poisson process of rate `lossy_rate`; one that strikes a
  segment loses the time since the segment started, then the job restarts (`restart_s`, or
  `preempt_restart_s` for a preemption: reacquiring capacity) and redoes the segment;
* spot preemptions with enough notice (`notice_s >= save_s`) write a checkpoint inside the
  notice window and lose no work: each costs `save_s + preempt_restart_s`, arriving at
  `preempt_rate` over the whole wall time.

Vectorised without a loop over events: a segment of length L needs one failure-free attempt,
so the failed attempts of S segments are negative-binomial (S successes, success probability
exp(-rate L)); the time lost in a failed attempt is an exponential truncated to [0, L), drawn by
inverting its CDF; lossless preemptions during a wall time T are Poisson(rate T), iterated for
the time they add themselves (a geometric series, converged after a few rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_FAILURES_PER_BATCH = 20_000_000
"""Truncated-exponential draws held in memory at once (runs are processed in chunks)."""


@dataclass(frozen=True)
class RunProcess:
    """Inputs of the simulated process (seconds, events per second)."""

    work_s: float
    """Failure-free training time of the whole run."""
    interval_s: float
    """Work between checkpoints."""
    save_s: float
    """Checkpoint write stall."""
    fail_rate: float
    """Hardware failures of the whole job per second (1 / cluster MTBF)."""
    restart_s: float
    """Restart after a failure (rescheduling, process start, checkpoint load)."""
    preempt_rate: float = 0.0
    """Spot preemptions of the whole job per second (0: on-demand)."""
    preempt_restart_s: float = 0.0
    """Restart after a preemption (reacquiring capacity, then as after a failure)."""
    notice_s: float = 0.0
    """Preemption notice; a checkpoint written inside it saves the work."""

    @property
    def preempt_saves(self) -> bool:
        return self.notice_s >= self.save_s

    @property
    def lossy_rate(self) -> float:
        return self.fail_rate + (0.0 if self.preempt_saves else self.preempt_rate)


@dataclass(frozen=True)
class RunSamples:
    """Per-run results of the Monte Carlo (arrays of length runs)."""

    wall_s: np.ndarray
    """Wall time of each run."""
    interruptions: np.ndarray
    """Lossy interruptions (failures, short-notice preemptions) of each run."""
    lost_s: np.ndarray
    """Work lost to them (time since the last checkpoint), per run."""
    saved_preemptions: np.ndarray
    """Preemptions that checkpointed inside their notice, per run."""


def simulate(proc: RunProcess, runs: int, seed: int = 0) -> RunSamples:
    """Sample `runs` complete training runs of process `proc`."""
    rng = np.random.default_rng(seed)
    tau, delta = proc.interval_s, proc.save_s
    full = int(proc.work_s // tau)
    rest = proc.work_s - full * tau
    segments = [(full, tau + delta)]
    if rest > 1e-9 * tau:
        segments.append((1, rest + delta))
    lam = proc.lossy_rate
    wall = np.full(runs, proc.work_s + delta * sum(n for n, _ in segments), dtype=float)
    interrupts = np.zeros(runs, dtype=np.int64)
    lost = np.zeros(runs)
    if lam > 0:
        for count, length in segments:
            if count == 0:
                continue
            k = rng.negative_binomial(count, math.exp(-lam * length), size=runs)
            interrupts += k
            lost += _truncated_exp_sums(rng, k, lam, length)
    # which lossy interruptions were preemptions (their restart is longer)
    pre = np.zeros(runs, dtype=np.int64)
    if lam > 0 and not proc.preempt_saves and proc.preempt_rate > 0:
        pre = rng.binomial(interrupts, proc.preempt_rate / lam)
    wall += lost + (interrupts - pre) * proc.restart_s + pre * proc.preempt_restart_s
    saved = np.zeros(runs, dtype=np.int64)
    if proc.preempt_saves and proc.preempt_rate > 0:
        each = delta + proc.preempt_restart_s
        span = wall.copy()
        for _ in range(8):  # preemptions during the time earlier preemptions added
            n = rng.poisson(proc.preempt_rate * span)
            saved += n
            span = n * each
            wall += span
            if not span.any():
                break
    return RunSamples(wall_s=wall, interruptions=interrupts, lost_s=lost,
                      saved_preemptions=saved)


def _truncated_exp_sums(rng: np.random.Generator, k: np.ndarray, lam: float,
                        length: float) -> np.ndarray:
    """Per run, the sum of k[i] exponential(lam) times conditioned to fall in [0, length)."""
    out = np.zeros(len(k))
    cdf_top = -math.expm1(-lam * length)  # P(X < length)
    start = 0
    while start < len(k):
        # chunks of runs whose draws fit in memory
        csum = np.cumsum(k[start:])
        stop = start + max(1, int(np.searchsorted(csum, MAX_FAILURES_PER_BATCH, side="right")))
        kk = k[start:stop]
        total = int(kk.sum())
        if total:
            u = rng.random(total)
            x = -np.log1p(-u * cdf_top) / lam
            owner = np.repeat(np.arange(stop - start), kk)
            out[start:stop] = np.bincount(owner, weights=x, minlength=stop - start)
        start = stop
    return out
