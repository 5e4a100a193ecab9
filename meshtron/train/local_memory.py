"""The one-process run's memory floor: a model whose weights, gradients and AdamW state alone
exceed the memory the device has available cannot train in one process. Refused in one line
before the run folder is written (`meshtron train --model llama3-8b` on a 23 GiB CPU machine
built the model until the allocator failed: a traceback, a half-written run folder; on a
machine with more swap than sense, the OOM killer).

A floor, not the planner's estimate: activations, workspace and fragmentation come on top, so
a model refused here fails for certain, and one let through may still not fit. The limit is the
memory available now, not the total (a shared machine's other jobs hold the rest: audit s54,
finding 5): on Linux the kernel's MemAvailable estimate (/proc/meminfo: free memory plus the
page cache and reclaimable slabs it could drop, without swapping), on a GPU the driver's free
memory (torch.cuda.mem_get_info, cudaMemGetInfo); the line says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from meshtron.errors import UserError

BYTES_PER_PARAM = {"fp32": 16, "bf16": 18, "fp8": 18}
"""Bytes per parameter a one-process run holds whatever else it does: fp32 weights (4), their
gradients (4) and AdamW's two moments (8), plus the bf16 compute copy (2) of a bf16 or FP8 run
(train/loop.py LocalEngine, BF16Compute)."""
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class DeviceMemory:
    """What a one-process run may fill, and where the figure comes from."""

    available: int
    """Bytes the run may take now."""
    total: int | None
    """The device's (or host's) total bytes; None where unknown."""
    source: str
    """How `available` was read, for the refusal's line."""


def device_memory(device: torch.device, gpu=None, meminfo: Path = MEMINFO,
                  cgroup: tuple[Path, Path] | None = None) -> DeviceMemory | None:
    """The memory available on `device`: a GPU's free memory (`gpu`: the CUDA device API,
    injectable), the host's MemAvailable for the CPU (its physical memory where /proc/meminfo
    is not there: not Linux), at most the limit of this process's control group (a
    container's or a Slurm job's: MemAvailable is the host's; `cgroup`: the files
    planner/machine_memory.py reads, injectable); None where unknown."""
    if device.type == "cuda":
        gpu = torch.cuda if gpu is None else gpu
        free, total = gpu.mem_get_info(device)
        return DeviceMemory(int(free), int(total), "free (torch.cuda.mem_get_info)")
    if device.type != "cpu":
        return None
    from meshtron.planner.machine_memory import cgroup_limit_bytes, physical_bytes

    try:
        total = physical_bytes()
    except (ValueError, OSError, AttributeError):
        total = None
    available = _mem_available(meminfo)
    found = None
    if available is not None:
        found = DeviceMemory(available, total, f"available (MemAvailable, {meminfo})")
    elif total is not None:
        found = DeviceMemory(total, total, "physical (no MemAvailable)")
    limit = cgroup_limit_bytes(*(cgroup or ()))
    if limit is not None and (found is None or limit < found.available):
        return DeviceMemory(limit, total,
                            "allowed by this process's control group (its memory limit)")
    return found


def _mem_available(meminfo: Path) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the kernel writes kB = KiB), None without it."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable" and rest.split()[:1] and rest.split()[0].isdigit():
            return int(rest.split()[0]) * 1024
    return None


def check_fits(cfg, device: torch.device, memory: DeviceMemory | None = None) -> None:
    """UserError when the model's floor (BYTES_PER_PARAM) exceeds the available memory
    (`memory`; default: `device_memory(device)`)."""
    memory = device_memory(device) if memory is None else memory
    params = cfg.model.num_params()
    per = BYTES_PER_PARAM.get(cfg.train.dtype, BYTES_PER_PARAM["fp32"])
    need = params * per
    if memory is None or need <= memory.available:
        return
    of_total = f" of {memory.total / 2**30:,.1f} GiB" if memory.total else ""
    raise UserError(
        f"model={cfg.model.name}: one process needs at least {need / 2**30:,.1f} GiB for its "
        f"weights, gradients and AdamW state ({params:,} parameters x {per} B, "
        f"train.dtype={cfg.train.dtype}), more than this {device.type}'s "
        f"{memory.available / 2**30:,.1f} GiB {memory.source}{of_total}; allowed: a model "
        "that fits, or its ranks over several devices (--nproc N with --plan; `meshtron plan` "
        "finds a layout that fits)")
