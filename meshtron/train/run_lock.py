"""One live run per run folder: a lock that dies with its holders.

A run holds `RUN_DIR/.meshtron.lock` with flock(2) for as long as any of its processes live:
the process that claimed the folder (the launcher, or the one process of a single-process run)
and every rank. The kernel drops a flock when its last holder exits, however it exits (SIGKILL
included), so the lock never goes stale the way a pid file does; and a rank that outlives
its launcher for a moment still holds the folder.

Claiming takes the lock exclusively without waiting (refused: another run lives), writes the
claimer's pid into it (for the refusal's message only; the lock itself is the truth), then
downgrades it to shared, which is what the ranks also take, so that a later claim fails while
any of them lives. Between these steps nobody else can hold it: a refusal, never two runs.
A file system without flock support (some network mounts) gets no protection, silently.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from meshtron.errors import UserError

LOCK_NAME = ".meshtron.lock"
_HELD: dict[str, tuple[int, bool, bool]] = {}
"""run folder -> (the open lock file of this process, kept open until the run ends; whether
the claim created the folder; whether it created the lock file)."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)


def check_free(run_dir: str | Path) -> None:
    """Refuse a folder that a live run holds (creates and writes nothing)."""
    if str(Path(run_dir).resolve()) in _HELD:  # this process's own run (API callers)
        return
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # no lock file (no run ever claimed it) or not ours to open
        return
    try:
        if _try(fd, fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            raise _in_use(run_dir, fd)
    finally:
        os.close(fd)


def claim(run_dir: str | Path) -> None:
    """Take the run folder for this run (created if missing), held until `release` or until
    this process exits."""
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return
    created = not Path(run_dir).exists()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    new_file = not (Path(run_dir) / LOCK_NAME).exists()
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    if not _try(fd, fcntl.LOCK_EX):
        error = _in_use(run_dir, fd)
        os.close(fd)
        raise error
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    if not _try(fd, fcntl.LOCK_SH):  # a claim that came in between the two steps
        error = _in_use(run_dir, fd)
        os.close(fd)
        raise error
    _HELD[key] = (fd, created, new_file)


def release(run_dir: str | Path) -> None:
    """This process's run in `run_dir` is over (its ranks are gone): let the folder go. A
    process that exits releases it anyway; this is for callers that live on (the Python
    API, tests calling the command line in-process)."""
    held = _HELD.pop(str(Path(run_dir).resolve()), None)
    if held is not None:
        os.close(held[0])


def abandon(run_dir: str | Path) -> None:
    """Undo `claim` when the run stops before writing anything (bad input found after the
    claim): what the claim created (the lock file, the folder) goes."""
    held = _HELD.pop(str(Path(run_dir).resolve()), None)
    if held is None:
        return
    fd, created, new_file = held
    if new_file:
        (Path(run_dir) / LOCK_NAME).unlink(missing_ok=True)
    os.close(fd)
    if created:
        try:
            Path(run_dir).rmdir()
        except OSError:  # something else was put there meanwhile: keep it
            pass


def join(run_dir: str | Path) -> None:
    """A rank of the run that claimed `run_dir` holds it too, until it exits (waits only for a
    claim in progress, which holds the lock exclusively for microseconds)."""
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return
        raise
    _HELD[key] = (fd, False, False)


def _try(fd: int, kind: int) -> bool:
    """flock without waiting: True when taken (or when the file system has no locks)."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return True
        raise
    return True


def _in_use(run_dir: str | Path, fd: int) -> UserError:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    who = f" (pid {pid})" if pid.isdigit() else ""
    return UserError(f"train.run_dir={str(run_dir)!r}: a live run{who} is using it; wait for "
                     "it to end or stop it, or choose another --run-dir")
