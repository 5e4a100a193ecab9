"""meshtron doctor, inside the ranks: the collective recorder and watchdog that run in every
rank and dump what they saw to RUN_DIR/trace. Reading the dumps afterwards (the verdict naming
the culprit, the timeline, NCCL logs) is `meshtron.diagnose`, the `meshtron doctor` command.

The trainer calls `start(..., joining=True)` once per rank before it joins the process group
(a rank that never comes is then caught and named), `joined()` once it has,
`watch_mesh(mesh)` when the mesh exists,
`beat(step)` after each step and `current().close()` at the end; these are no-ops when no
session runs (one process, or the recorder turned off). The session is per process (signal
handlers are), never per process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshtron.doctor.session import DoctorSession

__all__ = ["DoctorSession", "EXIT_WATCHDOG", "start", "joined", "current", "beat", "watch_mesh",
           "trace_dir", "attempt_dirs", "prepare_env"]

_session: "DoctorSession | None" = None


def __getattr__(name: str):
    # Lazy: `meshtron doctor RUN_DIR` reads JSON and must not pay for `import torch`.
    if name in ("DoctorSession", "EXIT_WATCHDOG"):
        from meshtron.doctor import session

        return getattr(session, name)
    raise AttributeError(name)


ATTEMPT_PREFIX = "attempt_"


def trace_dir(run_dir: Path | str, attempt: int = 0) -> Path:
    """RUN_DIR/trace for a run's first attempt; RUN_DIR/trace/attempt_N for torchrun's restart
    N (`--max-restarts`), so that each attempt's dumps (the hang that caused a restart) are kept
    beside the later ones."""
    base = Path(run_dir) / "trace"
    return base / f"{ATTEMPT_PREFIX}{attempt}" if attempt else base


def attempt_dirs(base: Path) -> dict[int, Path]:
    """attempt -> its trace folder, under a run's trace folder `base` (attempt 0: `base`)."""
    out = {0: base}
    for sub in base.glob(f"{ATTEMPT_PREFIX}*"):
        number = sub.name.removeprefix(ATTEMPT_PREFIX)
        if sub.is_dir() and number.isdigit():
            out[int(number)] = sub
    return dict(sorted(out.items()))


def prepare_env() -> None:
    """Before the process group exists: ask PyTorch's Flight Recorder to keep a trace on NCCL
    (it must be sized before the communicators are made; gloo gets nothing from it)."""
    import os

    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        # CUDA events around each NCCL kernel: the Flight Recorder's duration_ms (GPU time of
        # every collective, for the timeline; flight.py).
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")


def start(run_dir: Path | str, rank: int, world_size: int, attempt: int = 0,
          joining: bool = False, **options: Any) -> "DoctorSession":
    """Start this process's session (replacing an earlier one); `attempt`: torchrun's restart
    attempt (`trace_dir`); `joining`: before the process group exists (`joined()` after it
    does); options as DoctorSession."""
    global _session
    from meshtron.doctor.session import DoctorSession

    if _session is not None:
        _session.close(final_dump=False)
    _session = DoctorSession(trace_dir(run_dir, attempt), rank, world_size,
                             **options).start(joining=joining)
    return _session


def joined() -> None:
    """The process group of a session started `joining` exists (DoctorSession.joined)."""
    if _session is not None:
        _session.joined()


def current() -> "DoctorSession | None":
    return _session


def stop(final_dump: bool = True) -> None:
    global _session
    if _session is not None:
        _session.close(final_dump=final_dump)
        _session = None


def note_interrupted() -> None:
    """SIGINT (Ctrl-C; the rank then leaves at once, without a dump): say so in this rank's
    hello file, so that `meshtron doctor` reports an interrupted run, not a killed one."""
    if _session is not None:
        import time

        from meshtron.doctor import dump

        dump.note_in_hello(_session.trace_dir, _session.rank, interrupted_t=time.time())


def beat(step: int) -> None:
    if _session is not None:
        _session.beat(step)


def step_starts() -> None:
    """The training loop starts a step (after the last one's logging, evaluation, checkpoint)."""
    if _session is not None:
        _session.step_starts()


def watch_mesh(mesh, extra: dict[str, Any] | None = None) -> None:
    """Name groups by mesh axis; `extra` names the groups of submeshes the mesh has no axis for
    (a meshtron mesh's: `meshtron.parallel.mesh.named_submeshes`, its flattened data axis
    "dp" and the expert-parallel axes). Given by the caller: the doctor sits below the
    parallel runtime and does not import it."""
    if _session is None:
        return
    _session.watch_mesh(mesh, extra)
