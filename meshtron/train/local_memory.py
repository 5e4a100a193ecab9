"""The one-process run's memory floor: a model whose weights, gradients and AdamW state alone
exceed the device's memory cannot train in one process. Refused in one line before the run
folder is written (`meshtron train --model llama3-8b` on a 23 GiB CPU machine built the model
until the allocator failed: a traceback, a half-written run folder; on a machine with more
swap than sense, the OOM killer).

A floor, not the planner's estimate: activations, workspace and fragmentation come on top, so
a model refused here fails for certain, and one let through may still not fit.
"""

from __future__ import annotations

import os

import torch

from meshtron.errors import UserError

BYTES_PER_PARAM = {"fp32": 16, "bf16": 18, "fp8": 18}
"""Bytes per parameter a one-process run holds whatever else it does: fp32 weights (4), their
gradients (4) and AdamW's two moments (8), plus the bf16 compute copy (2) of a bf16 or FP8 run
(train/loop.py LocalEngine, BF16Compute)."""


def device_memory_bytes(device: torch.device, gpu=None) -> int | None:
    """The device's total memory: a GPU's (`gpu`: the CUDA device API, injectable), or the
    host's physical memory for the CPU; None where unknown."""
    if device.type == "cuda":
        gpu = torch.cuda if gpu is None else gpu
        return int(gpu.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_fits(cfg, device: torch.device, total: int | None = None) -> None:
    """UserError when the model's floor (BYTES_PER_PARAM) exceeds `total` bytes (default: the
    device's memory)."""
    total = device_memory_bytes(device) if total is None else total
    params = cfg.model.num_params()
    per = BYTES_PER_PARAM.get(cfg.train.dtype, BYTES_PER_PARAM["fp32"])
    need = params * per
    if not total or need <= total:
        return
    raise UserError(
        f"model={cfg.model.name}: one process needs at least {need / 2**30:,.1f} GiB for its "
        f"weights, gradients and AdamW state ({params:,} parameters x {per} B, "
        f"train.dtype={cfg.train.dtype}), more than this {device.type}'s "
        f"{total / 2**30:,.1f} GiB; allowed: a model that fits, or its ranks over several "
        "devices (--nproc N with --plan; `meshtron plan` finds a layout that fits)")
