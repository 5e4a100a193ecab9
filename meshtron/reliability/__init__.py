"""Failure arithmetic shared by the trainer (checkpoint interval) and `meshtron cost`."""

from meshtron.reliability.interval import (
    DEFAULT_GPU_FAILURES_PER_HOUR,
    cluster_mtbf_s,
    daly_interval_s,
    expected_lost_work_s,
    expected_overhead_fraction,
    expected_wall_s,
    first_order_overhead_fraction,
    interval_steps,
    young_interval_s,
)

__all__ = [
    "DEFAULT_GPU_FAILURES_PER_HOUR",
    "cluster_mtbf_s",
    "daly_interval_s",
    "expected_lost_work_s",
    "expected_overhead_fraction",
    "expected_wall_s",
    "first_order_overhead_fraction",
    "interval_steps",
    "young_interval_s",
]
