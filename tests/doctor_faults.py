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
            if fault == "periodic_straggler" and rank == culprit and step % 3 == 0:
                load_batch(0.3)  # late by a lot in one step of three: a median of 0
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


def skipped_all_to_all(trace_dir: str, timeout_s: float = 3.0, steps: int = 5,
                       fault_step: int = 3) -> int:
    """Expert parallelism on a (dp, ep) = (2, 2) mesh: every rank runs a small MoE whose
    experts are sharded over ep (meshtron/parallel/expert.py: counts all-to-all, then the
    uneven token all-to-alls); at `fault_step` the last rank skips its forward (a rank that
    took another branch), so its ep peer waits in the all-to-all alone."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.doctor import DoctorSession
    from meshtron.model.spec import PRESETS
    from meshtron.model.transformer import Transformer
    from meshtron.parallel.expert import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    session = DoctorSession(trace_dir, rank, world, watchdog_timeout_s=timeout_s,
                            first_step_timeout_s=30.0).start()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    session.watch_mesh(mesh)
    model = Transformer(PRESETS["tiny-moe"].replace(layers=1), init_seed=0)
    apply_expert_parallel(model, mesh["ep"], global_counts=False)
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(1, steps + 1):
            if not (rank == world - 1 and step == fault_step):
                with torch.no_grad():
                    model(torch.randint(0, 259, (1, 8), generator=g))
            else:
                load_batch(120)
            session.beat(step)
    except BaseException as exc:
        session.dump_exception(exc)
        raise
    session.close()
    return rank


def torn_down_after_peer(trace_dir: str) -> int:
    """Rank 1 is killed; rank 0 then gets SIGTERM, as torchrun stops the survivors after a rank
    failed. Rank 0 has the checkpointer's preemption watch installed after the doctor, as in
    `meshtron train`; the session must end it (128+15) without promising a checkpoint."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from meshtron.checkpoint.preempt import PreemptionWatch, set_peer_check
    from meshtron.doctor import DoctorSession

    rank = dist.get_rank()
    session = DoctorSession(trace_dir, rank, 2).start()
    session.end_on_teardown = True  # as `meshtron train` sets it for a fixed world
    PreemptionWatch(rank)
    set_peer_check(session.peers_gone)
    session.on_fatal = lambda cause, kind: Path(trace_dir, f"note_{rank}.json").write_text(
        json.dumps({"cause": cause, "kind": kind}))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a rank killed (the OOM killer, kill -9)
    deadline = time.time() + 30
    while not session.peers_gone() and time.time() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the session ends this process before
    return rank
