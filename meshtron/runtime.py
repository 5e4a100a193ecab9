"""Process-group set-up and tear-down for one rank, the same on CPU/gloo and CUDA/NCCL."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtron.launch import World


def init_rank(world: World, timeout_s: float = 600.0) -> torch.device:
    """Join the job's default process group; returns this rank's device."""
    if torch.cuda.is_available():
        # Modulo: under Slurm each task may see only its own GPU (CUDA_VISIBLE_DEVICES).
        device = torch.device("cuda", world.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # One process per core share: oversubscribed threads made gloo ranks 20-50x slower
        # (shared notes, "Speed on 2 cores").
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, world.local_world_size)))
    if world.source != "single" and not dist.is_initialized():  # a 1-rank world too
        kwargs = {}
        if world.init_method:  # Slurm: rendezvous at MASTER_ADDR:MASTER_PORT, ranks from srun
            kwargs = dict(init_method=world.init_method, rank=world.rank,
                          world_size=world.world_size)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return device


def shutdown_rank(exit_code: int = 0) -> None:
    """Leave cleanly and exit: barrier, destroy the group, then `os._exit`, which avoids gloo's
    'terminate called without an active exception' abort at interpreter shutdown (shared notes)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
