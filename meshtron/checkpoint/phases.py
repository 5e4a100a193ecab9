"""Wall-clock marks of a rank's start-up, so a restart's recovery seconds can be split into its
phases (bench/recovery.py, bench/chaos.py): kill -> the new process exists (the agent noticed
the failure, stopped the group, re-ran its rendezvous and spawned the ranks), -> the rank's
Python code runs (interpreter start, `import torch`), -> the process group is up, -> the
engine is built, -> the state is restored, -> the first step is committed.

Marks are `time.time()` (comparable across processes on one host; the bench's kill time is
taken with the same clock). No torch import here: `meshtron train --help` must not pay for it.
"""

from __future__ import annotations

import os
import time

_MARKS: dict[str, float] = {}

ORDER = ("process_start", "rank_entry", "torch_imported", "group_ready", "engine_built", "restored")
"""The marks in the order a start-up passes them (the restart record's `phases`)."""


def mark(name: str) -> None:
    """Record `name` at the current wall-clock time (the first call for a name wins)."""
    _MARKS.setdefault(name, time.time())


def process_start() -> float | None:
    """When this process was created (Linux: /proc/self/stat's start time in clock ticks after
    boot, against /proc/uptime: 10 ms resolution; /proc/stat's btime has whole seconds only),
    or None where that is not readable."""
    try:
        now = time.time()
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc(5); fields[0] here is field 3
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def marks() -> dict[str, float]:
    """Every mark so far, with the process start, in start-up order."""
    out = dict(_MARKS)
    start = process_start()
    if start is not None:
        out["process_start"] = start
    return {k: out[k] for k in ORDER if k in out} | {k: v for k, v in out.items()
                                                     if k not in ORDER}
