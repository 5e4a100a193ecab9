"""The evidence of the launches a manual `--resume` follows: RUN_DIR/earlier/N.

A `meshtron train ... --resume` is a new launch: its ranks write RUN_DIR/trace (hello files,
dumps) and torchrun counts its restart attempts from 0 again (RUN_DIR/attempts/attempt_N, the
ranks' failure notes and torchrun's view of their ends: checkpoint/restart.py). Before it
starts any rank, the launcher renames the previous launch's `trace` and `attempts` folders into
RUN_DIR/earlier/N (N = 1 for the first launch, 2 for the next, ...), so that `meshtron doctor
RUN_DIR --earlier N` (or `meshtron doctor RUN_DIR/earlier/N`) still names why it ended, as it
did before the resume. Inside, each launch keeps the one layout restart mode uses (trace/,
trace/attempt_K, attempts/attempt_K), so the same reader reads it. Renames only (atomic on one
file system, nothing copied), done while the launcher holds the run folder (run_lock), and
never deleted by a later --resume; a fresh run over the folder (--overwrite) replaces them
with the rest of the old run.

`resumed.json` beside them keeps the newest complete checkpoint when the archive was made (the
step the --resume continued from): the run's checkpoint store has newer ones by the time the
doctor reads the archive.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

EARLIER = "earlier"
RESUMED = "resumed.json"
KEPT = ("trace", "attempts")
"""The per-launch folders (doctor.trace_dir's base; checkpoint/restart.py ATTEMPTS)."""


def root(run_dir: Path | str) -> Path:
    return Path(run_dir) / EARLIER


def launches(run_dir: Path | str) -> dict[int, Path]:
    """N -> RUN_DIR/earlier/N, in order (empty when no --resume kept one)."""
    found = {}
    for sub in root(run_dir).glob("*"):
        if sub.is_dir() and sub.name.isdigit():
            found[int(sub.name)] = sub
    return dict(sorted(found.items()))


def keep_previous(run_dir: Path | str, resumed_from: int | None) -> Path | None:
    """Rename the previous launch's trace and attempts folders into RUN_DIR/earlier/N (the
    next free N); None when it left neither (nothing to keep). Call with the run folder held
    and before any rank starts. `resumed_from`: the checkpoint step the resume continues from."""
    run_dir = Path(run_dir)
    present = [name for name in KEPT if _has_content(run_dir / name)]
    if not present:
        return None
    target = _new_slot(run_dir)
    for name in present:
        os.rename(run_dir / name, target / name)  # one rename each: never half-copied
    (target / RESUMED).write_text(json.dumps({"resumed_from_step": resumed_from}))
    return target


def keep_or_clear(run_dir: Path | str, resume: bool) -> None:
    """Before a launch's ranks write anything: the previous launch's trace and failure notes
    are kept in RUN_DIR/earlier/N on a --resume (`keep_previous`; said in one line), so that
    `meshtron doctor` can still say why it ended, or cleared with the earlier launches on a
    fresh run (a stale ABORT.json would stop it at once). Either way this launch's attempts are
    counted from 0 and its trace is new. Meshtron's launcher calls it, and rank 0 of every
    elastic round (train/elastic.py)."""
    from meshtron.checkpoint import restart, store
    from meshtron.doctor.dump import clear_trace
    from meshtron.errors import UserError

    run_dir = Path(run_dir)
    if resume:
        step = store.find_latest(store.checkpoint_root(run_dir), deep=False).step
        try:
            kept = keep_previous(run_dir, step)
        except OSError as exc:
            raise UserError(f"--resume: could not keep the previous launch's trace in "
                            f"{root(run_dir)} ({exc}); move {run_dir / 'trace'} and "
                            f"{run_dir / restart.ATTEMPTS} away, or free the folder") from None
        say_kept(run_dir, kept)
    else:
        forget(run_dir)
    clear_trace(run_dir)
    restart.clear_notes(run_dir)  # attempts are counted again from 0


def set_aside_in_place(run_dir: Path | str, world_size: int, resume: bool,
                       resumed_from: int | None) -> Path | None:
    """`keep_previous` (resume) or the clearing a fresh run does, for a launch with no meshtron
    parent (an outside torchrun or srun): rank 0 calls it after the rendezvous, when every rank
    of this launch has already written its hello file into RUN_DIR/trace (so the folder cannot
    be renamed under them). What is left of earlier launches moves file by file into
    RUN_DIR/earlier/N/trace (a fresh run: is removed): everything in trace/ but this launch's
    hello files and what was written since this launch's ranks started, and attempts/ whole.
    Before this, a reused folder kept the earlier launch's ABORT.json and dumps, which the
    doctor read as this launch's. Returns the archive (None: nothing kept)."""
    run_dir = Path(run_dir)
    tdir = run_dir / "trace"
    stale = []
    if tdir.is_dir():
        start_t = _launch_start(tdir, world_size)
        stale = [path for path in tdir.iterdir() if not _this_launch(path, world_size, start_t)]
    notes = run_dir / KEPT[1]
    if not resume:
        forget(run_dir)
        for path in stale:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        shutil.rmtree(notes, ignore_errors=True)
        return None
    if not stale and not _has_content(notes):
        return None
    target = _new_slot(run_dir)
    (target / "trace").mkdir()
    for path in stale:
        os.rename(path, target / "trace" / path.name)
    if _has_content(notes):
        os.rename(notes, target / KEPT[1])
    (target / RESUMED).write_text(json.dumps({"resumed_from_step": resumed_from}))
    return target


def _launch_start(tdir: Path, world_size: int) -> float:
    """When this launch's first rank started, on the file system's clock: the oldest
    modification time of this launch's hello files (each rank wrote its own before the
    rendezvous; a folder not shared between nodes shows rank 0 only its own node's). The file
    system's clock, not the ranks': an earlier launch's files carry its times too, so no
    margin for the nodes' clocks is needed, and a resume seconds after a failure is told
    apart (a 5 s margin on the ranks' clocks kept a watchdog's dumps of 3 s before)."""
    times = []
    for rank in range(world_size):
        try:
            times.append((tdir / f"rank_{rank}.hello.json").stat().st_mtime)
        except OSError:
            continue
    return min(times, default=time.time())


def _this_launch(path: Path, world_size: int, start_t: float) -> bool:
    """A hello file of one of this launch's ranks (each rank rewrote its own), or anything
    written since this launch's first rank started; older files are an earlier launch's."""
    if path.name in {f"rank_{rank}.hello.json" for rank in range(world_size)}:
        return True
    try:
        return path.stat().st_mtime >= start_t
    except OSError:
        return True  # gone meanwhile: nothing to move


def say_kept(run_dir: Path | str, kept: Path | None) -> None:
    """The launcher's (or an outside launch's rank 0's) line naming the archive just made."""
    if kept is not None:
        print(f"meshtron train: the previous launch's trace and failure notes are kept in "
              f"{kept} (meshtron doctor {run_dir} --earlier {kept.name})", flush=True)


def resumed_step(folder: Path | str) -> int | None:
    """The checkpoint step the --resume after archive `folder` continued from (None: not an
    archive, or no checkpoint was complete)."""
    try:
        step = json.loads((Path(folder) / RESUMED).read_text()).get("resumed_from_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def forget(run_dir: Path | str) -> None:
    """A fresh run over an old one (not a resume): the old run's earlier launches go with it,
    as its trace does (they would be read as this run's)."""
    shutil.rmtree(root(run_dir), ignore_errors=True)


def _has_content(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _new_slot(run_dir: Path) -> Path:
    """Make RUN_DIR/earlier/N for the next N (mkdir is exclusive: never an existing one)."""
    base = root(run_dir)
    base.mkdir(parents=True, exist_ok=True)
    number = max(launches(run_dir), default=0) + 1
    while True:
        try:
            (base / str(number)).mkdir()
            return base / str(number)
        except FileExistsError:
            number += 1
