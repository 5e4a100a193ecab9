"""Monte Carlo of a whole training run under random failures and spot preemptions (numpy).

The process simulated, per run (the one expectation.py gives the expected value of in closed
form, Daly 2006 eq. 13 with two kinds of interruption):

* the run needs `work_s` seconds of failure-free training, cut into segments of `interval_s`
  work plus a checkpoint write of `save_s` (the last segment is the remainder of the work; the
  run ends with a save, its final weights; an interval longer than the run: one segment);
* lossy interruptions (hardware failures, and spot preemptions whose notice is too short to
  write a checkpoint) arrive as a Poisson process of rate `lossy_rate`; one that strikes a
  segment loses the time since the segment started, then the job restarts (`restart_s`, or
  `preempt_restart_s` for a preemption: reacquiring capacity) and redoes the segment; an
  interruption during a restart loses it and starts another (its kind drawn by the rates):
  at scale a restart is a fair share of the MTBF, and Daly's model lets failures strike it;
* spot preemptions with enough notice (`notice_s >= save_s`) write a checkpoint inside the
  notice window and lose no work: each costs `save_s + preempt_restart_s`, arriving at
  `preempt_rate` over the whole wall time.

Vectorised without a loop over events: a segment of length L needs one uninterrupted attempt,
so the failed attempts of S segments are negative-binomial (S successes, success probability
exp(-rate L)); likewise the failed restart attempts of K interruptions (K successes,
probability Q = sum_j p_j exp(-rate R_j)), each attempt's kind binomial given whether it
failed; the time lost in a failed attempt is an exponential truncated to [0, L), drawn by
inverting its CDF (a run with more than EXACT_DRAWS of them: a gamma of the sum's exact mean
and variance); lossless preemptions during a wall time T are Poisson(rate T), iterated for the
time they add themselves (a subcritical branching process: it dies out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EXACT_DRAWS = 64
"""Truncated-exponential losses drawn one by one per run up to this many; above, their sum is
drawn as a gamma with its exact mean and variance (skewness <= 2 / sqrt(64) = 0.25 of one
draw's, against a run-to-run spread set by the count of interruptions itself)."""
MAX_PREEMPTION_ROUNDS = 10_000
"""Rounds of preemptions-during-preemptions (each round's expected time is the last one's x
rate x cost < 1; expectation.py refuses rate x cost >= 1)."""


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

    def segments(self) -> list[tuple[int, float]]:
        """(count, seconds of work + save) of the run's segments: full intervals, then the
        remainder of the work (an interval longer than the run: the run is one segment)."""
        tau = min(self.interval_s, self.work_s)
        full = int(self.work_s // tau)
        rest = self.work_s - full * tau
        out = [(full, tau + self.save_s)]
        if rest > 1e-9 * tau:
            out.append((1, rest + self.save_s))
        return out

    def restart_kinds(self) -> list[tuple[float, float, str]]:
        """(share of the lossy interruptions, restart seconds, cause) of each kind."""
        lam = self.lossy_rate
        kinds = [(self.fail_rate / lam, self.restart_s, "failures")]
        if not self.preempt_saves and self.preempt_rate > 0:
            kinds.append((self.preempt_rate / lam, self.preempt_restart_s, "preemptions"))
        return kinds


@dataclass(frozen=True)
class RunSamples:
    """Per-run results of the Monte Carlo (arrays of length runs)."""

    wall_s: np.ndarray
    """Wall time of each run."""
    interruptions: np.ndarray
    """Lossy interruptions (failures, short-notice preemptions) of each run, restarts struck
    included."""
    lost_s: np.ndarray
    """Work lost to interruptions of segments (time since the last checkpoint), per run."""
    saved_preemptions: np.ndarray
    """Preemptions that checkpointed inside their notice, per run."""


def simulate(proc: RunProcess, runs: int, seed: int = 0) -> RunSamples:
    """Sample `runs` complete training runs of process `proc`."""
    rng = np.random.default_rng(seed)
    segments = proc.segments()
    lam = proc.lossy_rate
    wall = np.full(runs, sum(n * length for n, length in segments), dtype=float)
    interrupts = np.zeros(runs, dtype=np.int64)
    lost = np.zeros(runs)
    if lam > 0:
        for count, length in segments:
            if count == 0:
                continue
            k = rng.negative_binomial(count, math.exp(-lam * length), size=runs)
            interrupts += k
            lost += _truncated_exp_sums(rng, k, lam, length)
        restarts, struck = _restarts(rng, interrupts, lam, proc.restart_kinds())
        wall += lost + restarts
        interrupts += struck
    saved = np.zeros(runs, dtype=np.int64)
    if proc.preempt_saves and proc.preempt_rate > 0:
        each = proc.save_s + proc.preempt_restart_s
        span = wall.copy()
        for _ in range(MAX_PREEMPTION_ROUNDS):  # preemptions during the time earlier ones added
            n = rng.poisson(proc.preempt_rate * span)
            saved += n
            span = n * each
            wall += span
            if not span.any():
                break
    return RunSamples(wall_s=wall, interruptions=interrupts, lost_s=lost,
                      saved_preemptions=saved)


def _restarts(rng: np.random.Generator, interrupts: np.ndarray, lam: float,
              kinds: list[tuple[float, float, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(restart seconds, restart attempts struck) per run after `interrupts` interruptions:
    each needs one uninterrupted restart attempt; an attempt of kind j (share p_j) succeeds
    with probability e^(-lam R_j), so of all attempts the successful ones are of kind j with
    probability p_j e^(-lam R_j) / Q and the struck ones p_j (1 - e^(-lam R_j)) / (1 - Q)."""
    ok = [p * math.exp(-lam * r) for p, r, _ in kinds]
    q = sum(ok)
    hit = interrupts > 0
    struck = np.zeros_like(interrupts)
    if q < 1.0:
        struck[hit] = rng.negative_binomial(interrupts[hit], q)
    seconds = np.zeros(len(interrupts))
    left_ok, left_struck = interrupts.copy(), struck.copy()
    for i, (p, r, _) in enumerate(kinds):
        last = i == len(kinds) - 1
        n_ok = left_ok if last else rng.binomial(left_ok, min(1.0, ok[i] / q))
        fail_share = (p - ok[i]) / (1.0 - q) if q < 1.0 else 0.0
        n_struck = left_struck if last else rng.binomial(left_struck, min(1.0, fail_share))
        left_ok, left_struck = left_ok - n_ok, left_struck - n_struck
        seconds += n_ok * r
        if r > 0:
            seconds += _truncated_exp_sums(rng, n_struck, lam, r)
    return seconds, struck


def _truncated_exp_moments(lam: float, length: float) -> tuple[float, float]:
    """Mean and variance of an exponential(lam) time conditioned to fall in [0, length)."""
    x = lam * length
    if x < 1e-4:  # nearly uniform; the closed forms cancel catastrophically
        return length / 2.0 - lam * length ** 2 / 12.0, length ** 2 / 12.0
    mean = 1.0 / lam - length / math.expm1(x)
    second = 2.0 / lam ** 2 - (length ** 2 + 2.0 * length / lam) / math.expm1(x)
    return mean, max(second - mean ** 2, 0.0)


def _truncated_exp_sums(rng: np.random.Generator, k: np.ndarray, lam: float,
                        length: float) -> np.ndarray:
    """Per run, the sum of k[i] exponential(lam) times conditioned to fall in [0, length):
    drawn one by one up to EXACT_DRAWS per run, above as a gamma of the same mean and
    variance."""
    out = np.zeros(len(k))
    few = (k > 0) & (k <= EXACT_DRAWS)
    if few.any():
        kk = k[few]
        u = rng.random(int(kk.sum()))
        x = -np.log1p(-u * -math.expm1(-lam * length)) / lam
        owner = np.repeat(np.arange(len(kk)), kk)
        out[few] = np.bincount(owner, weights=x, minlength=len(kk))
    many = k > EXACT_DRAWS
    if many.any():
        mean, var = _truncated_exp_moments(lam, length)
        n = k[many].astype(float)
        if var <= 0.0:
            out[many] = n * mean
        else:  # gamma(shape a, scale s): mean a s = n mean, variance a s^2 = n var
            out[many] = rng.gamma(n * mean ** 2 / var, var / mean)
    return out
