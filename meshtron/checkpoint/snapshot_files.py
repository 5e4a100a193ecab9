"""Where in-memory snapshots live, how a slot is known to be complete, and which generation a
restarted attempt restores (pure functions: no process group, no torch at import).

Layout, under ROOT = $MESHTRON_SNAPSHOT_DIR (default /dev/shm, a tmpfs: host memory) /
meshtron-snapshots-<hash of the run folder>:

    node_<n>/own/rank_<r>/slot_<k>/{data.bin, meta.json}    rank r's own shard (r on node n)
    node_<n>/held/rank_<s>/slot_<k>/{data.bin, meta.json}   the copy of rank s's shard that
                                                            rank s + ranks_per_node keeps

`node_<n>` stands for the host memory of node n: a rank reads and writes only the folder of its
own node, and a shard it does not hold there reaches it over the network (gloo send/recv from
the rank holding the copy), as it would from another machine. On one machine a real node loss
is therefore simulated by deleting `node_<n>` (what the loss of that machine's RAM takes away);
a process killed by a signal loses nothing here, as on a real machine (tmpfs outlives the
process). Each path has one writer (the rank named by it), so no locks.

A slot is complete when meta.json exists and data.bin has the size it states: meta.json is
removed before a slot is rewritten and put in place last (`os.replace`). Two slots per rank
(generation g goes to slot g % 2), so the previous generation survives a failure while the next
is written (the memory cost is therefore 2 x (own + peer copy)).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "meshtron-snapshot/1"
DIR_ENV = "MESHTRON_SNAPSHOT_DIR"
DEFAULT_DIR = "/dev/shm"
DATA = "data.bin"
META = "meta.json"
SLOTS = 2
ALIGN = 64
"""Byte alignment of every tensor in data.bin (any dtype view of the mapped file is legal)."""


def job_root(run_dir: str | Path, base: str | None = None) -> Path:
    """The snapshot folder of the run in `run_dir` (one per run folder)."""
    base = base or os.environ.get(DIR_ENV) or DEFAULT_DIR
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(base) / f"meshtron-snapshots-{key}"


def node_size(ranks_per_node: int | None, world: int, local_world: int) -> int:
    """Ranks per node for the snapshots: the plan's `ranks_per_node` (--ranks-per-node), else
    torchrun's LOCAL_WORLD_SIZE; it must split the world into whole nodes."""
    rpn = ranks_per_node or local_world
    if rpn > world or world % rpn:
        from meshtron.errors import UserError

        raise UserError(f"--ranks-per-node={rpn}: --snapshot-every needs a divisor of the "
                        f"{world} ranks (whole nodes)")
    return rpn


@dataclass(frozen=True)
class Layout:
    """A rank's place among the "nodes" that keep each other's snapshots (Gemini's ring:
    rank r's copy is kept by rank r + ranks_per_node, on the next node)."""

    rank: int
    """Global rank."""
    world: int
    """Number of ranks."""
    ranks_per_node: int
    """Ranks per node (a node's ranks lose their memory together)."""

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def has_peer(self) -> bool:
        """Another node exists to keep a copy (one node: own snapshots only)."""
        return self.world > self.ranks_per_node

    @property
    def keeper(self) -> int:
        """The rank that keeps this rank's copy."""
        return (self.rank + self.ranks_per_node) % self.world

    @property
    def source(self) -> int:
        """The rank whose copy this rank keeps."""
        return (self.rank - self.ranks_per_node) % self.world

    def slot(self, root: Path, kind: str, owner: int, k: int) -> Path:
        """Slot `k` of `owner`'s shard in this rank's node folder (`kind` 'own' or 'held')."""
        return root / f"node_{self.node}" / kind / f"rank_{owner}" / f"slot_{k}"


def read_meta(slot: Path) -> dict[str, Any] | None:
    """The slot's meta.json when the slot is complete, else None."""
    try:
        doc = json.loads((slot / META).read_text())
        if doc.get("format") != FORMAT or (slot / DATA).stat().st_size != doc["bytes"]:
            return None
        return doc
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_meta(slot: Path, doc: dict[str, Any]) -> None:
    """Mark the slot complete (after data.bin is written)."""
    part = slot / (META + ".part")
    part.write_text(json.dumps(doc))
    os.replace(part, slot / META)


def invalidate(slot: Path) -> None:
    """Mark the slot incomplete before rewriting it."""
    (slot / META).unlink(missing_ok=True)


def inventory(root: Path, lay: Layout, run_id: str) -> dict[str, dict[int, int]]:
    """{'own': {step: slot}, 'held': {step: slot}}: the complete slots this rank finds in its
    node folder for its own shard and for its source's copy, of this job (`run_id`) only."""
    out: dict[str, dict[int, int]] = {"own": {}, "held": {}}
    for kind, owner in (("own", lay.rank), ("held", lay.source)):
        if kind == "held" and not lay.has_peer:
            continue
        for k in range(SLOTS):
            doc = read_meta(lay.slot(root, kind, owner, k))
            if doc and doc.get("run_id") == run_id and doc.get("world_size") == lay.world \
                    and doc.get("rank") == owner:
                out[kind][int(doc["step"])] = k
    return out


@dataclass(frozen=True)
class Choice:
    """The generation every rank restores, and where each rank's shard comes from."""

    step: int
    """The generation's step."""
    from_keeper: tuple[int, ...]
    """Ranks whose own slot is gone: their keeper sends the copy (gloo)."""


def choose(inventories: list[dict[str, dict[int, int]]], ranks_per_node: int
           ) -> Choice | None:
    """The newest step for which every rank's shard is present, in its own slot or as the copy
    its keeper holds (None: no such generation; restore from disk). Every rank computes the same
    answer from the gathered inventories."""
    world = len(inventories)
    steps = {s for inv in inventories for kind in inv.values() for s in kind}
    for step in sorted(steps, reverse=True):
        missing = [r for r in range(world) if step not in _keys(inventories[r]["own"])]
        keepers = [(r + ranks_per_node) % world for r in missing]
        if all(k != r and step in _keys(inventories[k]["held"])
               for r, k in zip(missing, keepers)):
            return Choice(step, tuple(missing))
    return None


def _keys(d: dict) -> set[int]:
    return {int(k) for k in d}


def remove_rank(root: Path, lay: Layout) -> None:
    """Delete this rank's slots (own and the copy it keeps) from its node folder."""
    for kind, owner in (("own", lay.rank), ("held", lay.source)):
        shutil.rmtree(root / f"node_{lay.node}" / kind / f"rank_{owner}", ignore_errors=True)


def remove_job(run_dir: str | Path) -> None:
    """Delete the run's snapshots on this machine (the launcher, after torchrun ends)."""
    shutil.rmtree(job_root(run_dir), ignore_errors=True)
