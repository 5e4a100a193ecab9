"""Process-group set-up and tear-down for one rank, the same on CPU/gloo and CUDA/NCCL."""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtron.launch import World


NCCL_ENV = {
    # On a collective timeout or NCCL error the watchdog kills the process without running
    # NCCL's clean-up (mode 3, SkipCleanUp; mode 1 would abort communicators first, which can
    # itself hang on a broken fabric): a hang becomes an exit torchrun sees and restarts.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # Flight Recorder: the last N collectives per rank, dumped when a collective times out
    # (PyTorch's own record of what every rank was waiting for; `meshtron doctor` reads it).
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
"""Environment defaults for NCCL ranks (a value the user exported wins)."""


def nccl_env(dump_prefix: str | None = None) -> dict[str, str]:
    """NCCL_ENV, plus where the Flight Recorder writes its per-rank dump (the rank is
    appended to the prefix)."""
    env = dict(NCCL_ENV)
    if dump_prefix:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = dump_prefix
    return env


def local_device(local_rank: int | None = None, gpu=None) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (modulo the visible GPUs: under Slurm each task may
    see only its own) made current, or the CPU. Also what `build_mesh` calls for Python-API
    users who did their own init_process_group. `gpu`: the CUDA device API (`is_available`,
    `device_count`, `current_device`, `set_device`; default `torch.cuda`), injectable so that
    the CUDA branch runs on a CPU machine."""
    gpu = torch.cuda if gpu is None else gpu
    if not gpu.is_available():
        return torch.device("cpu")
    if local_rank is None:
        if "LOCAL_RANK" not in os.environ:  # not launched per GPU: keep the caller's choice
            return torch.device("cuda", gpu.current_device())
        local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank % gpu.device_count())
    gpu.set_device(device)
    return device


def batch_to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device` without making the host wait for the device. From pageable
    memory a CUDA copy is staged through the driver's small pinned buffers, and a batch larger
    than those waits for the DMA of its earlier chunks, i.e. for every kernel queued before it
    (the stream drains once per step). Copied into page-locked memory first (torch's caching
    host allocator: reused buffers, each kept until its copy has run), the copy is one
    asynchronous DMA. Devices without page-locked staging (CPU) copy as before."""
    return copy_source(batch, device).to(device, non_blocking=True)


def copy_source(batch: torch.Tensor, device: torch.device, pin=None) -> torch.Tensor:
    """The tensor `batch_to_device` copies from: `batch`, or for a pageable host batch bound
    for a CUDA device its page-locked copy. `pin`: the page-locking kernel (default
    `torch.Tensor.pin_memory`), injectable so that the CUDA branch runs on a CPU machine (whose
    torch has no page-locked allocator)."""
    if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
        return (torch.Tensor.pin_memory if pin is None else pin)(batch)
    return batch


def cpu_backend(record: bool, say: bool = False) -> str:
    """The backend of a CPU rank's default group: "gloo", or with `record` meshtron doctor's
    recording gloo group (doctor/backend.py: every collective recorded, nothing of torch
    patched; its sub-groups, e.g. the mesh axes, inherit it). On a torch whose ProcessGroup
    cannot be overridden so (2.11) plain gloo, and with `say` one warning line naming it."""
    if not record:
        return "gloo"
    from meshtron.doctor.backend import register, unsupported_line

    line = unsupported_line()
    if line is None:
        return register()
    if say:
        print(f"meshtron train: warning: {line}", file=sys.stderr, flush=True)
    return "gloo"


def cpu_threads(local_ranks: int, env: Mapping[str, str] | None = None) -> int:
    """Intra-op threads of a CPU rank: OMP_NUM_THREADS when set (meshtron's launcher sets 1,
    as torchrun does for more than one rank; a user's own value is kept), else one share of
    the cores per local rank. Oversubscribed threads made gloo ranks 20-50x slower (shared
    notes, "Speed on 2 cores"), and a lone rank on a loaded host 13x slower with 2 threads than
    with 1 (user audit, session 44: 4.5 s/step vs 0.35 s on 2 ranks)."""
    env = os.environ if env is None else env
    text = env.get("OMP_NUM_THREADS", "")
    if text.isdigit() and int(text) > 0:
        return int(text)
    cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def init_rank(world: World, timeout_s: float = 600.0, dump_prefix: str | None = None,
              store: dist.Store | None = None, record: bool = False) -> torch.device:
    """Join the job's default process group; returns this rank's device. The one place a
    meshtron rank makes its group, in every mode (torchrun, Slurm, restarts, elastic).

    CUDA: `meshtron.backend.backend_for` (NCCL for CUDA tensors, gloo for CPU ones), bound to
    this rank's GPU (`device_id`: NCCL makes its communicator eagerly, on the right device,
    and later groups can split from it), with NCCL_ENV set first. CPU: gloo; with `record`,
    gloo through meshtron doctor's recording process group (`cpu_backend`). `store`: the
    rendezvous store to use instead of torchrun's environment (restart mode: one namespaced per
    attempt, meshtron.checkpoint.restart)."""
    device = local_device(world.local_rank)
    if device.type == "cuda":
        for key, value in nccl_env(dump_prefix).items():
            os.environ.setdefault(key, value)
    else:
        torch.set_num_threads(cpu_threads(world.local_world_size))
    if world.source != "single" and not dist.is_initialized():  # a 1-rank world too
        backend, kwargs = group_init_args(world, device, timeout_s, store, record)
        dist.init_process_group(backend, **kwargs)
    return device


def group_init_args(world: World, device: torch.device, timeout_s: float = 600.0,
                    store: dist.Store | None = None, record: bool = False) -> tuple[str, dict]:
    """(backend, keyword arguments) of `init_rank`'s `init_process_group` for a rank on
    `device`. Apart from `init_rank` so that its CUDA branch (NCCL for CUDA tensors, bound to
    the rank's GPU with `device_id`) runs on a CPU machine too, with the device injected: the
    call itself needs a GPU."""
    from meshtron.backend import backend_for

    backend = (backend_for(device.type) if device.type == "cuda"
               else cpu_backend(record, say=world.rank == 0))
    kwargs: dict = {"timeout": timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=world.rank, world_size=world.world_size)
    elif world.init_method:  # Slurm: rendezvous at MASTER_ADDR:MASTER_PORT, ranks from srun
        kwargs.update(init_method=world.init_method, rank=world.rank,
                      world_size=world.world_size)
    if device.type == "cuda":
        kwargs["device_id"] = device
    return backend, kwargs


def abort_rank(exit_code: int) -> None:
    """Leave after a failure without waiting for peers: no barrier (they may be stuck in a
    collective), NCCL communicators aborted (`destroy_process_group` would wait for their
    pending work, forever if a peer is gone; abort is non-blocking and done for all groups
    inside one NCCL group call, pytorch#119797), gloo left to the process exit. Never
    returns."""
    if dist.is_initialized():
        try:
            from meshtron.backend import group_is_nccl

            if group_is_nccl():
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def shutdown_rank(exit_code: int = 0, then: Callable[[], None] | None = None) -> None:
    """Leave cleanly and exit: barrier, destroy the group, then `os._exit`, which avoids gloo's
    'terminate called without an active exception' abort at interpreter shutdown (shared notes).
    `then`: run once every rank has passed the barrier (nothing of the group is needed any more),
    just before the exit."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    if then is not None:
        then()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
