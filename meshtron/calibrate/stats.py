"""How `meshtron calibrate` turns the repeated timings of one kernel into a figure and a spread.

The practice of torch.utils.benchmark (`Timer.blocked_autorange`, `Measurement`) and of
triton.testing.do_bench: warm up, then time many repeats, each a block of back-to-back calls
long enough that the timer's resolution and the one device sync per block do not count, and
report an order statistic of the repeats together with their interquartile range.

The figure is the lower quartile of the per-call times (the upper quartile of throughput). Load
from outside (other processes, another rank on the same core) only ever slows a call down: the
times are bounded below by what the machine can do and their noise is one-sided, so a low
quantile estimates the machine, where a mean or median estimates the machine plus whatever ran
beside it at that moment. Not the minimum: one lucky repeat (a burst that lands on a core left
idle for a moment) would set the figure alone, and no rank keeps that rate up through training.

The spread is the interquartile range over the median, torch.utils.benchmark's confidence
measure (`Measurement.meets_confidence`: it warns at 10%, "could indicate system fluctuation",
and at 25%, "gross"). calibrate warns past `NOISY_SPREAD` (25%, planner/cluster.py) and records
every figure's spread in the cluster file (`measurement_spread`), so `plan` and `train` can say
that the figures they predict with are noisy. Why 25% and not 10%: a shared CPU machine
(several processes per core) spreads 10-20% at rest, which is below what the planner's own
validation error on published runs allows for (mean 5-6%, max ~25%, docs/measurements.md); past
25% the quartile itself can be off by more than the planner's worst row, and two calibrations on
a loaded machine differed 3x (matmul) and 100x (rms_norm) (audit 47, finding 6).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from meshtron.planner.cluster import NOISY_SPREAD, noisy_figures

REPEATS = 10
"""Timed repeats (blocks of calls) per figure: enough for quartiles that one outlier cannot
move (torch.utils.benchmark's blocked_autorange takes at least 10 blocks as well)."""
MIN_REPEATS = 5
"""Repeats kept when a figure runs past its time budget (kernels.repeat_times)."""


@dataclass(frozen=True)
class Timing:
    """One figure's time per call and how much its repeats disagree."""

    seconds: float
    """Lower quartile of the per-call times, seconds (module docstring)."""
    spread: float
    """Interquartile range / median of the per-call times (0: all repeats agree)."""


def summarize(times: Sequence[float]) -> Timing:
    """The figure and spread of the per-call `times` of one kernel's repeats (at least 2)."""
    if len(times) < 2:
        raise ValueError(f"summarize needs at least 2 repeats, got {len(times)}")
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Timing(seconds=q1, spread=(q3 - q1) / median if median > 0 else 0.0)


def warning_line(spread: dict[str, float]) -> str | None:
    """The one line calibrate prints when some figure's repeats spread past NOISY_SPREAD."""
    words = noisy_figures(spread)
    if not words:
        return None
    return (f"warning: noisy calibration: the repeats of {words} spread more than "
            f"{NOISY_SPREAD:.0%} (interquartile range / median), so the planner's step times "
            "from this file may be off by as much; something else is loading this machine: "
            "rerun `meshtron calibrate` when it is idle")
