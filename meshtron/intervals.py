"""Half-open intervals merged into a sorted, disjoint union: the one implementation of the
context-parallel halo rows a rank needs (model/cp_halo_plan.py) and the busy time of a rank's
timeline (doctor/timeline.py). Torch-free, imported by every layer."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", int, float)


def merge_intervals(intervals: list[tuple[T, T]]) -> list[tuple[T, T]]:
    """Sorted, disjoint [lo, hi) intervals covering exactly the union of `intervals`; touching
    ones (hi == next lo) become one."""
    out: list[list[T]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]
