"""Checksums shared out over the ranks (issue 17: rank 0 hashing a 0.84 TB checkpoint alone, at
every commit and again on resume, takes hours and outlasts the group timeout).

- Saving: DCP's `FileSystemWriter`, recording which files this rank wrote (`RecordingWriter`);
  after the write each rank hashes its own files on its background thread and the digests are
  gathered on rank 0 over the checkpointer's own gloo group (`gather_digests`), which writes the
  manifest from them (store.write_manifest: only files no rank reported are hashed there).
- Resuming: every rank checks the manifest and the sizes of all files, and re-hashes its share
  of them (store.share: balanced by bytes, the same split on every rank); the verdicts are
  all-gathered, so every rank picks the same checkpoint (`find_latest`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from meshtron.checkpoint import store


class RecordingWriter(FileSystemWriter):
    """A FileSystemWriter that remembers the files this rank's `write_data` created."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.written: list[str] = []
        """Names (relative to the checkpoint folder) of the tensor files this rank wrote."""

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
        except Exception as exc:
            found = _storage_error(exc)
            if found is None:
                raise
            raise found from exc
        # FileSystemWriter writes before returning (its future is already complete).
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        return future


def _storage_error(exc: Exception) -> OSError | None:
    """A shard write that failed on a recurring file-system error (ENOSPC, EFBIG: restart.py
    `storage_cause`) wrapped in another exception, as that OSError to raise instead: torch.save's
    zip writer reports it as RuntimeError ('unexpected pos') with the OSError only as its
    context, which DCP's gathering of the ranks' failures (pickled) drops, and the rank's
    restart decision needs the errno. None otherwise (the exception is raised as it is)."""
    from meshtron.checkpoint.restart import storage_cause

    found = storage_cause(exc)
    if found is None or found is exc:
        return None
    return OSError(found.errno, found.strerror, found.filename)


def gather_digests(folder: Path, names: list[str], rank: int, world_size: int,
                   group: Any) -> dict[str, dict[str, Any]] | None:
    """Hash `names` (this rank's files in `folder`) and gather every rank's digests on rank 0:
    returns them all there, None on the other ranks. Collective over `group` (None: one
    process)."""
    mine = store.digest_files(folder, names)
    if group is None:
        return mine
    box: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, box, dst=0, group=group)
    if rank != 0:
        return None
    merged: dict[str, dict[str, Any]] = {}
    for digests in box:
        merged.update(digests or {})
    return merged


def find_latest(root: Path, rank: int, world_size: int, group: Any) -> store.Found:
    """store.find_latest, with the checksums shared out over `group` (collective; None: one
    process checks everything). Rank 0's listing is the one every rank checks."""
    if group is None:
        return store.find_latest(root)
    box: list[Any] = [[(s, str(p)) for s, p in store.committed(root)] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    rejected = []
    for step, path in box[0]:
        folder = Path(path)
        problems: list[Any] = [None] * world_size
        dist.all_gather_object(problems, store.verify(folder, part=(rank, world_size)),
                               group=group)
        problem = next((p for p in problems if p is not None), None)
        if problem is None:
            return store.Found(step, folder, tuple(rejected))
        rejected.append((folder.name, problem))
    return store.Found(None, None, tuple(rejected))
