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
