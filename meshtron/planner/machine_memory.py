"""The memory this machine gives the processes meshtron starts here: its physical memory, or the
memory limit of the control group this process runs in where that is lower. Torch-free (the
planner's `nominal-cpu` cluster reads it: cluster.py `nominal_cpu_cluster`).

Why the control group: a container started with a memory limit (`docker run --memory`) and a
Slurm job under `ConstrainRAMSpace` (task/cgroup) see the host's physical memory through
os.sysconf, but the kernel's OOM killer stops them at the group's limit (the kernel's
Documentation/admin-guide/cgroup-v2.rst, `memory.max`; cgroup v1's
`memory.limit_in_bytes`). The limits of the group's ancestors bind too, so the least over
the path is taken. "max" (v2) or v1's page-rounded 2**63 means no limit.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
SYSFS_CGROUP = Path("/sys/fs/cgroup")


def physical_bytes() -> int:
    """This machine's physical memory in bytes (os.sysconf: no torch, no psutil)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit_bytes(proc_cgroup: Path = PROC_CGROUP,
                       sysfs: Path = SYSFS_CGROUP) -> int | None:
    """The least memory limit of this process's control group and its ancestors, v2
    (`0::/path`: sysfs/path/memory.max) or v1 (`N:memory:/path`:
    sysfs/memory/path/memory.limit_in_bytes); None without one (or off Linux)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            base, name = sysfs, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = sysfs / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):  # the group, then each ancestor
            limits.append(_read_limit(base.joinpath(*parts[:depth], name)))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": none


def machine_memory_bytes(proc_cgroup: Path = PROC_CGROUP, sysfs: Path = SYSFS_CGROUP) -> int:
    """Physical memory, or the control group's limit where lower (module docstring)."""
    physical = physical_bytes()
    limit = cgroup_limit_bytes(proc_cgroup, sysfs)
    return physical if limit is None else min(physical, limit)


__all__ = ["cgroup_limit_bytes", "machine_memory_bytes", "physical_bytes"]
