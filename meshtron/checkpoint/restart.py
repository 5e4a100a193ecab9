"""Automatic restarts through torchrun's elastic agent: joining the group again, and saying why.

torchrun (`--max-restarts R`) restarts every rank when one dies; the new ranks see
TORCHELASTIC_RESTART_COUNT = the attempt number and resume from the newest complete checkpoint.

Joining again on the same host: the agent's store keeps the previous attempt's keys, and new gloo
groups then hang or fail with 'Gloo connectFullMesh failed ... Connection refused' (shared notes,
pytorch-2.13-cpu-facts.md). The group is therefore built on a store namespaced per attempt.

Why the previous attempt ended: a rank that fails with a Python exception (including a CUDA
out-of-memory error) leaves a note (`note_failure`) in RUN_DIR/attempts, outside the checkpoint
folder, so that a checkpoint-disk failure (a read-only or full checkpoint folder) cannot also
take away the note that names it; a rank killed by a signal (SIGKILL, the kernel's OOM killer)
cannot, so the ranks without a note are reported as killed. A note that cannot be written is
said on the rank's stderr (never silently dropped).

Errors that recur on every attempt are not retried: a rank that fails on bad input (exit code 2)
or on a storage error (`storage_error`, exit code EXIT_STORAGE) or is preempted (exit code 75)
under meshtron's own launcher notes the code (`note_final`) and stops torchrun's agent with
SIGTERM before it exits (meshtron/train/rank.py `_end_restarts`): the agent stops the other ranks and its process returns that code
instead of restarting (meshtron/launch.py `FINAL_CODES`; torchelastic itself restarts on any
failure, whatever the exit code: torch 2.13 elastic/agent/server/api.py `_invoke_run`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

from meshtron.checkpoint import store

ATTEMPTS = "attempts"
EXITS = "exits.json"
FINAL = "final"
BRIEF = ".cause"


def attempt(env: Mapping[str, str] | None = None) -> int:
    """This process's restart attempt (0: the first start)."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def torchrun_restarts(env: Mapping[str, str] | None = None) -> bool:
    """torchrun restarts this process's world when a rank fails: its --max-restarts > 0,
    given to every rank as TORCHELASTIC_MAX_RESTARTS (torch/distributed/elastic/agent/server/
    local_elastic_agent.py `_start_workers`): meshtron's launcher passes it, an outside
    torchrun its user."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def attempt_store(rank: int, world_size: int, timeout_s: float):
    """The store of this attempt's default process group: torchrun's, namespaced by the
    attempt; None when not under torchrun's environment (the usual rendezvous applies). The
    group itself is made by `meshtron.runtime.init_rank`, as in every other mode."""
    import torch.distributed as dist

    env = os.environ
    if "MASTER_ADDR" not in env or "TORCHELASTIC_RESTART_COUNT" not in env \
            or dist.is_initialized():
        return None
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                         is_master=not agent_store and rank == 0,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=not agent_store)
    return dist.PrefixStore(f"meshtron/attempt_{attempt()}", base)


_RECURRING_ERRNOS = frozenset({
    # the same path on the same file system answers the same way on the next attempt
    errno.EACCES, errno.EPERM,   # permissions of the checkpoint folder (the audit's chattr +i)
    errno.EROFS,                 # read-only mount; also what ext4 errors=remount-ro leaves
                                 # after an I/O error (ext4(5)): every write fails again
    errno.ENOTDIR, errno.EISDIR,  # a file where a folder is expected, or the reverse
    errno.ENAMETOOLONG, errno.ELOOP,  # the path itself (--run-dir) is invalid
    errno.EXDEV,                 # a rename across mounts: the folders' layout, not a moment
    # the next attempt writes the same bytes: a save that did not fit will not fit again
    # (the partial save is removed at the restart, but the next save needs the same space)
    errno.ENOSPC, errno.EDQUOT,  # a full disk or quota
    errno.EFBIG,                 # a shard over the file system's or RLIMIT_FSIZE's file size
})
"""OSError numbers that a new attempt on the same machine and folder meets again: not worth a
restart (exit code EXIT_STORAGE, one line). Retried (left out on purpose): EIO (a network file
system's soft mount reports a server's timeout as EIO, nfs(5); a local disk's bad block is
remapped on the next write), ESTALE (a file handle gone after an NFS server restart: the
next attempt opens the path again), ENOENT (a folder removed under the run: the next attempt
creates the checkpoint folder again), EMFILE / ENFILE / EAGAIN / EBUSY / ETXTBSY (per-process
or momentary limits: a new process starts with none of them), and the connection and timeout
errors (ECONNRESET, ETIMEDOUT, ...) that are OSErrors too: a peer's end or a network's blip,
which is what a restart is for."""


def storage_error(exc: BaseException) -> bool:
    """`exc` is a file-system error that a restart on the same folder would meet again
    (PermissionError on a read-only checkpoint folder, a full disk, ...): not worth a restart.
    Looked for through what wraps it: DCP's CheckpointException (a BaseException holding each
    rank's (exception, traceback) in `failures`) and the exceptions' causes and contexts (a
    shard's write fails inside torch.save's zip writer, which raises RuntimeError('[enforce
    fail at inline_container.cc] unexpected pos ...') with the OSError as its context;
    integrity.RecordingWriter raises the OSError itself, as DCP's gathering drops contexts)."""
    return storage_cause(exc) is not None


def storage_cause(exc: BaseException) -> OSError | None:
    """The recurring OSError `storage_error` finds in `exc`, or None."""
    return next((e for e in _within(exc)
                 if isinstance(e, OSError) and e.errno in _RECURRING_ERRNOS), None)


def cause_text(exc: BaseException) -> str:
    """'Type: message' of `exc`; for a storage error wrapped in another (DCP's
    CheckpointException), the OSError's, naming the wrapper."""
    found = storage_cause(exc)
    if found is None or found is exc:
        return f"{type(exc).__name__}: {exc}"
    return f"{type(found).__name__}: {found} (inside {type(exc).__name__})"


def _within(exc: BaseException) -> list[BaseException]:
    """`exc`, what it wraps (DCP's per-rank failures) and its causes and contexts."""
    out: list[BaseException] = []
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo and len(out) < 64:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return out


def _notes_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / ATTEMPTS


def _notes_dir(run_dir: str | Path, n: int) -> Path:
    return _notes_root(run_dir) / f"attempt_{n}"


def open_notes(run_dir: str | Path) -> None:
    """Make this attempt's notes folder at its start (never raises): a folder needs a block on
    most file systems, which a disk that fills up later no longer has, while the notes' files
    (an inode each, `note_final`'s link) may still be made then."""
    with contextlib.suppress(OSError):
        _notes_dir(run_dir, attempt()).mkdir(parents=True, exist_ok=True)


def note_failure(run_dir: str | Path, rank: int, cause: str, kind: str = "exception",
                 brief: str | None = None) -> None:
    """Record why this rank is failing (never raises: a note that cannot be written is one line
    on stderr). `kind`: "exception" (a Python error), "watchdog" (the doctor's watchdog abort)
    or "teardown" (stopped by torchrun after another rank ended: not a cause of its own).
    `brief` (`brief_cause`): kept as a symbolic link's target when the note's content cannot
    be written (a full disk), so that the cause is still named."""
    folder = _notes_dir(run_dir, attempt())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank_{rank}.json").write_text(json.dumps(
            {"rank": rank, "cause": cause[:500], "kind": kind, "time": time.time()}))
    except OSError as exc:
        print(f"meshtron train (rank {rank}): could not write the failure note ({exc}); the "
              f"cause was: {cause[:500]}", file=sys.stderr, flush=True)
        if brief:
            with contextlib.suppress(OSError):
                os.symlink(brief, folder / f"rank_{rank}{BRIEF}")


def brief_cause(exc: BaseException) -> str:
    """`exc` in at most 59 bytes, what an ext4 symbolic link keeps in its inode (a fast
    symlink: no data block, so it is made on a full disk too; tmpfs keeps 128): 'OSError:
    [Errno 28] No space left on device' for a storage error (its errno, not its path), else
    the error's type."""
    found = storage_cause(exc)
    if found is None:
        return type(exc).__name__[:59]
    return f"{type(found).__name__}: [Errno {found.errno}] {os.strerror(found.errno)}"[:59]


def note_final(run_dir: str | Path, code: int) -> bool:
    """Note that this attempt ends the job with `code` (meshtron/train/rank.py
    `_end_restarts`); False when another rank of the attempt noted it first. The note is a
    symbolic link whose target is the code: made in one step, by one rank only (EEXIST), and
    its two bytes kept in the inode (ext4's fast symlinks, tmpfs's short ones), so it is
    written on a full disk too, where a file's content is not (a storage error's usual case:
    an empty final.json left the launcher blaming the agent's SIGTERM, exit 143)."""
    note = _notes_dir(run_dir, attempt()) / FINAL
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(str(code), note)
    except FileExistsError:
        return False
    except OSError:  # the notes' disk failed too: the agent still stops, with its own code
        pass
    return True


def final_code(run_dir: str | Path) -> int | None:
    """The code a rank ended the job with in the newest attempt (`note_final`), or None."""
    try:
        return int(os.readlink(_notes_dir(run_dir, last_attempt(run_dir)) / FINAL))
    except (OSError, ValueError):
        return None


def note_agent_exits(run_dir: str | Path, n: int, exits: Mapping[int, int]) -> None:
    """What torchrun's agent saw end attempt `n`: {rank: exit code, negative for a signal}
    (written by the agent's process, meshtron/agent_exits.py; never raises)."""
    try:
        folder = _notes_dir(run_dir, n)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / EXITS).write_text(json.dumps({str(r): code for r, code in exits.items()}))
    except OSError as exc:
        print(f"meshtron: could not write torchrun's view of the ranks' ends ({exc})",
              file=sys.stderr, flush=True)


def agent_exits(run_dir: str | Path, n: int) -> dict[int, int]:
    """{rank: exit code} torchrun's agent saw end attempt `n` (negative: killed by that
    signal); {} when it left none."""
    try:
        doc = json.loads((_notes_dir(run_dir, n) / EXITS).read_text())
        return {int(r): int(code) for r, code in doc.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def exit_text(code: int) -> str:
    """'killed by SIGKILL' for a negative exit code (torchrun's convention), else 'exit code N'."""
    import signal

    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def previous_cause(run_dir: str | Path, world_size: int) -> str:
    """Why attempt (this one - 1) ended, from the ranks' notes."""
    return attempt_cause(run_dir, world_size, attempt() - 1)


def attempt_cause(run_dir: str | Path, world_size: int, n: int) -> str:
    """Why attempt `n` ended, from its ranks' notes: a watchdog abort (with the ranks it found
    frozen or gone), else the ranks that left no note (killed by a signal) but not those that
    torchrun stopped after them, else the first Python error."""
    notes = _notes(run_dir, world_size, n)
    watchdog = [note for note in notes if note.get("kind") == "watchdog"]
    if watchdog:
        return min(watchdog, key=lambda note: note["time"])["cause"]
    silent = sorted(set(range(world_size)) - {note["rank"] for note in notes})
    exits = agent_exits(run_dir, n)
    seen = [r for r in silent if exits.get(r, 0) < 0] or [r for r in silent if r in exits]
    if seen:  # what torchrun's agent saw: the signal itself (before any rank it took along)
        return "; ".join(f"rank {r} {exit_text(exits[r])} (no Python error)" if exits[r] < 0
                         else f"rank {r} ended with exit code {exits[r]} and left no note of "
                         "its error (its output says why)" for r in seen)
    if silent:
        who = ", ".join(str(r) for r in silent)
        return (f"rank {who} ended without a Python error (killed by a signal: SIGKILL, the "
                "kernel's out-of-memory killer, or a crash)")
    causes = [note for note in notes if note.get("kind") != "teardown"] or notes
    first = min(causes, key=lambda note: note["time"])
    return f"rank {first['rank']} failed: {first['cause']}"


def failure_notes(run_dir: str | Path, world_size: int, n: int) -> list[dict[str, Any]]:
    """The notes the ranks of attempt `n` left on failing (`note_failure`): 'rank', 'cause',
    'kind', 'time' each (`meshtron doctor` reads them for a rank whose dump is missing)."""
    return _notes(run_dir, world_size, n)


def _notes(run_dir: str | Path, world_size: int, n: int) -> list[dict[str, Any]]:
    folder = _notes_dir(run_dir, n)
    notes = []
    for r in range(world_size):
        path = folder / f"rank_{r}.json"
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            if path.is_file():  # made, but its content not written (a full disk): no signal
                notes.append(_unwritten_note(r, path))
    return notes


def _unwritten_note(rank: int, path: Path) -> dict[str, Any]:
    """A rank's note whose file exists but holds no complete note: the rank did fail with a
    Python error (a killed rank makes no file), named by its brief cause when that was kept
    (`note_failure`), else by its output only."""
    try:
        cause = f"{os.readlink(path.with_suffix(BRIEF))} (its note could not be written)"
    except OSError:
        cause = ("an error whose note could not be written (the run folder's disk; its output "
                 "above names the error)")
    return {"rank": rank, "kind": "exception", "time": path.stat().st_mtime, "cause": cause}


def clear_notes(run_dir: str | Path) -> None:
    """Forget an earlier launch's notes (a new `meshtron train` counts its attempts from 0:
    a note left by the last launch's attempt 1 must not name this launch's causes)."""
    import shutil

    shutil.rmtree(_notes_root(run_dir), ignore_errors=True)
    # where meshtron before session 44 kept them
    shutil.rmtree(store.checkpoint_root(run_dir) / ATTEMPTS, ignore_errors=True)


def last_attempt(run_dir: str | Path) -> int:
    """The highest attempt that left notes (0 when none did)."""
    folder = _notes_root(run_dir)
    numbers = [int(p.name.removeprefix("attempt_")) for p in folder.glob("attempt_*")
               if p.name.removeprefix("attempt_").isdigit()]
    return max(numbers, default=0)


def resumed_words(resumed_from: int, lost: int | None) -> str:
    """'resumed from step 40, 3 logged step(s) lost' for the restart line; a failure before any
    step was logged (lost None) started over: it printed 'None logged step(s) lost'."""
    if lost is None:
        return f"started again from step {resumed_from} (no step had been logged)"
    return f"resumed from step {resumed_from}, {lost} logged step(s) lost"


def restart_record(run_dir: str | Path, world_size: int, resumed_from: int,
                   last_logged: int | None) -> dict[str, Any]:
    """The metrics.jsonl `restart` record of this attempt."""
    lost = None if last_logged is None else max(0, last_logged - resumed_from)
    return {"event": "restart", "attempt": attempt(), "cause": previous_cause(run_dir, world_size),
            "resumed_from_step": resumed_from, "last_logged_step": last_logged,
            "lost_steps": lost, "time": time.time()}
