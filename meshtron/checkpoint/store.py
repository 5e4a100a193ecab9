"""Checkpoint folders on disk: atomic commit, integrity manifest, `latest`, retention.

Layout (RUN_DIR/checkpoints/):

    step_00000120/              a complete checkpoint (only ever created by a rename)
        .metadata               DCP's index of the tensor shards (pickled by DCP)
        __<rank>_<n>.distcp     DCP tensor shards
        meta.json               step, data position, LR-schedule position, plan, run config
        rank_<r>.json           rank r's RNG states (base64), JSON
        manifest.json           size and SHA-256 of every file above; written last
    .tmp-step_00000150/         a save in progress (never loaded; removed on the next start)
    latest                      the name of the newest committed folder (for people and tools)
    preempted.json              written when a SIGTERM stopped the run (removed on resume)

Commit = every rank's files written and fsynced, then the manifest (fsynced), then
`os.rename(.tmp-step_N, step_N)` (atomic on POSIX file systems) and `latest` replaced by
`os.replace`. A crash at any point leaves either the old set of complete checkpoints or the old
set plus the new one, never a half-visible one. Loading re-checks the manifest: a missing or
truncated file or a checksum mismatch rejects that checkpoint and the previous one is used.

At scale the checksums are shared out: each rank hashes the files it wrote (`digest_files`,
on its background thread) and the manifest is assembled from their digests (`write_manifest`'s
`digests`); on resume each rank re-hashes its `share` of the files (`verify`), balanced by size.
No rank reads the whole checkpoint (0.84 TB for Llama-3-70B with AdamW).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "meshtron-checkpoint/1"
MANIFEST = "manifest.json"
META = "meta.json"
LATEST = "latest"
PREEMPTED = "preempted.json"
TMP_PREFIX = ".tmp-"
HASH = "sha256"
"""Checksum of every file. SHA-256 runs at ~0.5-2 GB/s per core (bench/checkpoint_save.py
measures it beside blake2b and crc32); it runs on the background thread, off the training path."""
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_CHUNK = 1 << 22


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def file_digest(path: Path, algorithm: str = HASH) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (POSIX: the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, doc: Any) -> None:
    """Write, fsync, then rename into place: a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def digest_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and checksum of each named file of `folder` (a manifest's `files` entries)."""
    return {name: {"bytes": (folder / name).stat().st_size, HASH: file_digest(folder / name)}
            for name in names}


def write_manifest(folder: Path, step: int,
                   digests: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Sizes and checksums of every file in `folder` (the manifest excluded); written last.
    `digests`: entries the ranks computed for the files they wrote; a file whose size has
    changed since, or that no rank reported, is hashed here."""
    digests = digests or {}
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in (MANIFEST, MANIFEST + ".part"):
            entry = digests.get(path.name)
            if entry is None or entry.get("bytes") != path.stat().st_size:
                entry = digest_files(folder, [path.name])[path.name]
            files[path.name] = entry
    doc = {"format": FORMAT, "step": step, "hash": HASH, "files": files}
    write_json(folder / MANIFEST, doc)
    return doc


def share(files: dict[str, dict[str, Any]], index: int, count: int) -> set[str]:
    """The names of `files` (manifest entries) that share `index` of `count` checks: largest
    first onto the least-loaded share, so every rank computes the same split."""
    load = [0] * count
    mine = set()
    for name in sorted(files, key=lambda n: (-_size(files[n]), n)):
        j = min(range(count), key=lambda k: (load[k], k))
        load[j] += _size(files[name])
        if j == index:
            mine.add(name)
    return mine


def _size(entry: Any) -> int:
    size = entry.get("bytes") if isinstance(entry, dict) else None
    return size if isinstance(size, int) else 0


def commit(root: Path, step: int) -> Path:
    """Rename the finished temporary folder into place and point `latest` at it."""
    tmp, final = root / (TMP_PREFIX + step_name(step)), root / step_name(step)
    if final.exists():  # the same step saved again (e.g. after a restart): replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    (root / (LATEST + ".part")).write_text(final.name + "\n")
    os.replace(root / (LATEST + ".part"), root / LATEST)
    fsync_dir(root)
    return final


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint folders, newest first (complete or not: see `verify`)."""
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and path.is_dir():
            out.append((int(m.group(1)), path))
    return sorted(out, reverse=True)


def verify(folder: Path, deep: bool = True,
           part: tuple[int, int] | None = None) -> str | None:
    """None when `folder` is a complete checkpoint, else what is wrong (one phrase).
    `deep`: also recompute checksums (otherwise sizes only): of every file, or with
    `part` = (index, count) of that `share` only (sizes of every file are still checked)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        text = manifest.read_text()
    except FileNotFoundError:  # removed meanwhile (a live run's retention: `prune`)
        return "no manifest.json (removed while reading)"
    try:
        doc = json.loads(text)
        files = doc["files"]
        algorithm = doc.get("hash", HASH)
        if doc.get("format") != FORMAT or not isinstance(files, dict):
            return f"manifest.json has format {doc.get('format')!r}, expected {FORMAT!r}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"manifest.json is not a valid manifest ({exc})"
    for needed in (".metadata", META):
        if needed not in files:
            return f"manifest.json does not list {needed}"
    hashed = share(files, *part) if deep and part is not None else set(files)
    for name, entry in files.items():
        path = folder / name
        try:
            size, want_size, want_sum = path.stat().st_size, entry["bytes"], entry[algorithm]
        except FileNotFoundError:
            return f"{name} is missing"
        except (KeyError, TypeError):
            return f"manifest.json entry for {name} is malformed"
        if size != want_size:
            what = "truncated" if size < want_size else "longer than written"
            return f"{name} has {size} bytes, the manifest says {want_size} ({what})"
        try:
            if deep and name in hashed and file_digest(path, algorithm) != want_sum:
                return f"{name} does not match its {algorithm} checksum in the manifest"
        except FileNotFoundError:  # removed while hashed (`prune` of a live run)
            return f"{name} is missing"
    return None


@dataclass(frozen=True)
class Found:
    """The newest complete checkpoint, and the damaged newer ones skipped to reach it."""

    step: int | None
    """Its step (None: no complete checkpoint)."""
    path: Path | None
    rejected: tuple[tuple[str, str], ...] = ()
    """(folder name, what is wrong) of every newer checkpoint that failed verification."""

    def skipped(self) -> str | None:
        """One line naming the damaged newer checkpoints and why, and the one used instead
        (None: none was skipped)."""
        if not self.rejected:
            return None
        damaged = "; ".join(f"{name} is damaged: {why}" for name, why in self.rejected)
        used = f"using {self.path.name}" if self.path is not None else "none is complete"
        return f"checkpoint {damaged}; not loaded, {used}"

    def report(self) -> list[str]:
        lines = [f"checkpoint {name} is damaged: {why}; not loaded" for name, why in
                 self.rejected]
        if self.rejected and self.path is not None:
            lines.append(f"using the previous complete checkpoint {self.path.name}")
        return lines


def find_latest(root: Path, deep: bool = True) -> Found:
    """The newest checkpoint that passes `verify`; damaged newer ones are reported, not used.
    One that a live run's retention (`prune`) removed while it was checked is not damaged:
    passed over without a word."""
    rejected = []
    for step, path in committed(root):
        problem = verify(path, deep)
        if problem is None:
            return Found(step, path, tuple(rejected))
        if path.is_dir():
            rejected.append((path.name, problem))
    return Found(None, None, tuple(rejected))


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((folder / META).read_text())


KEPT_ENTRIES = frozenset({"lost+found"})
"""What a fresh file system's root holds (ext4's mkfs): a mount point for checkpoints that holds
only this holds no run, and --overwrite leaves it."""


def holds_checkpoints(root: Path) -> bool:
    """`root` (RUN_DIR/checkpoints) holds anything of a run: a file, or a folder with entries.
    An empty folder (a link to another file system, or a mount point, made ready for the run)
    does not."""
    if not root.is_dir():
        return root.exists()
    try:
        return any(entry.name not in KEPT_ENTRIES for entry in root.iterdir())
    except OSError:  # unreadable: taken for a run, as before (the check writes nothing)
        return True


def clear_root(root: Path) -> None:
    """Remove every checkpoint under `root`, keeping the folder itself: RUN_DIR/checkpoints is
    fixed, so operators put checkpoints on another file system by making it a symbolic link or
    a mount point, which rmtree refuses (a link) or cannot remove (EBUSY, a mount point)."""
    for entry in root.iterdir():
        if entry.name in KEPT_ENTRIES:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def remove_partial(root: Path) -> None:
    """Delete temporary folders of saves that never committed (a crash mid-save)."""
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(TMP_PREFIX) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the `keep` newest complete checkpoints (damaged ones beyond those too);
    returns the removed folder names."""
    removed, kept = [], 0
    for _, path in committed(root):
        if kept < keep and verify(path, deep=False) is None:
            kept += 1
            continue
        if kept >= keep:
            _remove_whole(path)
            removed.append(path.name)
    return removed


def _remove_whole(path: Path) -> None:
    """Delete a checkpoint folder so that a reader (export or merge of a live run) sees it
    whole or gone, never half-deleted: renamed out of the step names first (atomic within the
    folder), then deleted; a crash in between leaves a temporary folder `remove_partial`
    sweeps at the next start."""
    doomed = path.with_name(TMP_PREFIX + "removed-" + path.name)
    try:
        os.rename(path, doomed)
    except OSError:  # e.g. a leftover of that name: delete in place as before
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def was_preempted(run_dir: str | Path) -> dict[str, Any] | None:
    """The preemption record (PREEMPTED) of the run in `run_dir` that just ended, if SIGTERM
    stopped it. Here, not in the checkpointer: the launcher reads it without importing torch."""
    try:
        return json.loads((checkpoint_root(run_dir) / PREEMPTED).read_text())
    except (OSError, ValueError):
        return None
