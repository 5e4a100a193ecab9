"""Optimal checkpoint interval and the expected cost of failures (one implementation for
`meshtron train --checkpoint-every auto` and `meshtron cost`).

Model: failures arrive as a Poisson process with mean time between failures M (the whole job's,
i.e. one GPU's MTBF divided by the GPU count); a checkpoint stalls training for delta seconds;
after a failure the job needs R seconds to restart and then redoes the work since the last
complete checkpoint.

- Young (1974), "A first order approximation to the optimum checkpoint interval":
  tau = sqrt(2 delta M).
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3), eq. 37: tau = sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta
  for delta < 2M, else tau = M.
- Daly's complete model (same paper, eq. 13): the expected wall time to finish T_s seconds of
  work in segments of tau work + delta checkpoint is
  T_w = M exp(R / M) (exp((tau + delta) / M) - 1) T_s / tau.

All times are seconds.
"""

from __future__ import annotations

import math

from meshtron.errors import UserError

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4, Table 5): 419
# unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (the 47
# planned ones are maintenance, not failures). 419 / (54 * 24 h * 16,384 GPUs) = 1.97e-5 failures
# per GPU-hour, i.e. one GPU fails every ~50,700 hours and the 16k-GPU job every ~3.1 hours.
DEFAULT_GPU_FAILURES_PER_HOUR = 419 / (54 * 24 * 16_384)


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UserError(f"{name}: {value!r} is not allowed; give a positive finite number")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise UserError(f"{name}: {value!r} is not allowed; give a finite number >= 0")
    return float(value)


def cluster_mtbf_s(gpus: int, failures_per_gpu_hour: float = DEFAULT_GPU_FAILURES_PER_HOUR
                   ) -> float:
    """The job's mean time between failures: independent GPUs (with their hosts and links
    folded into the per-GPU rate) fail at rates that add."""
    if not (isinstance(gpus, int) and gpus >= 1):
        raise UserError(f"gpus: {gpus!r} is not allowed; give a whole number >= 1")
    rate = _positive("failures_per_gpu_hour", failures_per_gpu_hour)
    return 3600.0 / (gpus * rate)


def young_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: work between checkpoints = sqrt(2 delta M)."""
    delta = _positive("save_cost_s", save_cost_s)
    return math.sqrt(2.0 * delta * _positive("mtbf_s", mtbf_s))


def daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (better than Young when delta is not << M)."""
    delta = _positive("save_cost_s", save_cost_s)
    m = _positive("mtbf_s", mtbf_s)
    if delta >= 2.0 * m:
        return m
    x = delta / (2.0 * m)
    return math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def expected_wall_s(work_s: float, interval_s: float, save_cost_s: float, mtbf_s: float,
                    restart_s: float = 0.0) -> float:
    """Daly's expected wall time for `work_s` seconds of failure-free training, checkpointing
    after every `interval_s` seconds of work (exponential failures, failures possible during
    checkpoints and restarts)."""
    work = _non_negative("work_s", work_s)
    tau = _positive("interval_s", interval_s)
    delta = _non_negative("save_cost_s", save_cost_s)
    m = _positive("mtbf_s", mtbf_s)
    r = _non_negative("restart_s", restart_s)
    try:
        return m * math.exp(r / m) * math.expm1((tau + delta) / m) * work / tau
    except OverflowError:  # e^(R/M) or e^(L/M) past 1e308: the run never finishes
        return math.inf


def expected_overhead_fraction(interval_s: float, save_cost_s: float, mtbf_s: float,
                               restart_s: float = 0.0) -> float:
    """Expected extra wall time per second of useful work (0.05 = 5% slower than failure-free,
    checkpoint-free training), from Daly's complete model."""
    return expected_wall_s(1.0, interval_s, save_cost_s, mtbf_s, restart_s) - 1.0


def first_order_overhead_fraction(interval_s: float, save_cost_s: float, mtbf_s: float,
                                  restart_s: float = 0.0) -> float:
    """The first-order terms, to explain the total: checkpoint stalls delta / tau, lost work
    (tau + delta) / 2M per failure (half a segment on average) and restarts R / M."""
    tau = _positive("interval_s", interval_s)
    delta = _non_negative("save_cost_s", save_cost_s)
    m = _positive("mtbf_s", mtbf_s)
    return delta / tau + (tau + delta) / (2.0 * m) + _non_negative("restart_s", restart_s) / m


def interval_steps(step_time_s: float, save_cost_s: float, mtbf_s: float) -> int:
    """Daly's optimum rounded to whole optimizer steps (at least 1)."""
    step = _positive("step_time_s", step_time_s)
    return max(1, round(daly_interval_s(save_cost_s, mtbf_s) / step))


def expected_lost_work_s(interval_s: float, save_cost_s: float, mtbf_s: float) -> float:
    """Expected work lost to one failure that strikes a segment of tau + delta seconds (work
    plus checkpoint write): the time from the segment's start to an exponential failure given
    that it falls inside the segment, E[X | X < L] = M - L e^(-L/M) / (1 - e^(-L/M)) with
    L = tau + delta; about L / 2 when L << M (the first-order term above)."""
    tau = _positive("interval_s", interval_s)
    m = _positive("mtbf_s", mtbf_s)
    seg = tau + _non_negative("save_cost_s", save_cost_s)
    x = seg / m
    if x < 1e-6:
        return seg / 2.0  # the series' first term; the closed form cancels catastrophically
    return m - seg / math.expm1(x)
