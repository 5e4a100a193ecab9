"""Rank functions for tests/test_doctor.py: a small training-like loop on a real gloo mesh where
one rank misbehaves. Each rank runs a DoctorSession with a short watchdog, like `meshtron train`."""

from __future__ import annotations

import os
import signal
import time

CULPRIT = -1  # the last rank


def load_batch(seconds: float) -> None:
    time.sleep(seconds)  # stands for a data loader that stalls


def faulty_loop(trace_dir: str, fault: str, mesh_shape: tuple, axes: tuple,
                timeout_s: float = 3.0, steps: int = 6, fault_step: int = 3) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.doctor import DoctorSession

    rank, world = dist.get_rank(), dist.get_world_size()
    culprit = world - 1
    session = DoctorSession(trace_dir, rank, world, watchdog_timeout_s=timeout_s,
                            first_step_timeout_s=30.0).start()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axes)
    session.watch_mesh(mesh)
    inner, outer = mesh[axes[-1]].get_group(), mesh[axes[0]].get_group()
    try:
        for step in range(1, steps + 1):
            bad = rank == culprit and step == fault_step
            if fault == "straggler" and rank == culprit:
                load_batch(0.15)
            if bad and fault == "never_entered":
                load_batch(120)
            if bad and fault == "dead_rank":
                os.kill(os.getpid(), signal.SIGKILL)
            if bad and fault == "frozen_rank":
                os.kill(os.getpid(), signal.SIGSTOP)
            x = torch.ones(16 if bad and fault == "mismatched_shape" else 8)
            if bad and fault == "mismatched_op":
                dist.broadcast(x, src=dist.get_process_group_ranks(inner)[0], group=inner)
            else:
                dist.all_reduce(x, group=inner)
            dist.all_reduce(x, group=outer)
            session.beat(step)
    except BaseException as exc:
        session.dump_exception(exc)
        raise
    session.close()
    return rank


def signalled_loop(trace_dir: str, marker: str) -> str:
    """Rank 0 blocks in an all-reduce (C++, GIL released) until rank 1 joins; rank 1 has a
    SIGTERM handler of its own (like a preemption checkpoint) and waits for the test's SIGTERM
    before joining. The test sends SIGUSR1 to rank 0 while it is blocked, SIGTERM to rank 1."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from meshtron.doctor import DoctorSession

    rank = dist.get_rank()
    got = []
    if rank == 1:
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    session = DoctorSession(trace_dir, rank, 2).start()
    x = torch.ones(4)
    if rank == 1:
        deadline = time.time() + 60
        while not got and time.time() < deadline:
            time.sleep(0.05)
        Path(marker).write_text(f"previous handler called {len(got)} time(s)")
    dist.all_reduce(x)
    session.close()
    return f"rank {rank} done"
