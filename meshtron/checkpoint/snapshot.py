"""In-memory snapshots: fast recovery without storage (Gemini, Wang et al., SOSP 2023: each
machine keeps its own checkpoint in host memory and a copy of a peer machine's).

Every `every` steps each rank copies its shard of the model and optimizer state (the
checkpointer's `EngineState.tensors()`: DTensor local shards, plain tensors, extras), with the
data position, LR-schedule position and RNG states, into host memory that outlives the process
(a file in /dev/shm mapped into the process: `snapshot_files` has the layout and what "node"
means on one machine), then sends that copy to its keeper on the next node (gloo send/recv on a
group of its own). The copy runs on a background thread, as the disk checkpoint's staging does:
the training thread blocks only before the next optimizer step (the first write to the copied
tensors) if the copy is not done by then; the exchange with the peer overlaps the next steps.

After torchrun restarts the ranks (`--max-restarts`), `restore` (collective) gathers what every
rank still holds and restores the newest generation whose every shard is present, in its own
slot or as its keeper's copy (sent over gloo to a rank whose node lost it); the copy loads into
the fresh engine through the same template and `load_tensors` as a DCP load, so the state is
bit-identical to the one saved. With no complete generation, or a newer checkpoint on disk, the
caller loads from disk.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtron.checkpoint import staging
from meshtron.checkpoint import snapshot_files as files
from meshtron.checkpoint.snapshot_files import ALIGN, DATA, SLOTS, Layout


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """{path: leaf} of a nested state dict."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def index(leaves: dict[tuple[str, ...], Any]) -> tuple[list[list[Any]], dict[str, Any], int]:
    """(tensor entries [path, dtype, shape, offset], non-tensor values, total bytes) of a
    rank's flattened state; offsets aligned to ALIGN bytes."""
    entries, values, offset = [], {}, 0
    for path, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor):
            t = _local(leaf)
            entries.append([list(path), str(t.dtype), list(t.shape), offset])
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            values[json.dumps(list(path))] = leaf
        else:
            raise TypeError(f"snapshot: state entry {'.'.join(path)} is a "
                            f"{type(leaf).__name__}; tensors and JSON scalars only")
    return entries, values, offset


def _mapped(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    """The file as a uint8 tensor sharing its pages (writes go to the file: tmpfs memory)."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(nbytes)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    return torch.from_file(str(path), shared=create, size=nbytes, dtype=torch.uint8)


def _view(buf: torch.Tensor, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    dt = _dtype(dtype)
    n = 1
    for d in shape:
        n *= d
    nbytes = n * dt.itemsize
    return buf[offset:offset + nbytes].view(dt).view(shape)


def make_snapshots(ckpt: Any, state: Any, engine: Any, data: Any, run_dir: str | Path,
                   plan: Any = None) -> "Snapshots | None":
    """The rank's snapshots for `ckpt` (a CheckpointConfig; collective), or None when off."""
    if not ckpt.snapshot_every:
        return None
    world = dist.get_world_size()
    rpn = files.node_size(getattr(plan, "ranks_per_node", None), world,
                          int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return Snapshots(ckpt.snapshot_every, rpn, state, engine, data, run_dir)


class Snapshots:
    """One per rank, owned by the Checkpointer (collective constructor: every rank). `state`:
    its `EngineState`; `engine`, `data`: as the Checkpointer's."""

    def __init__(self, every: int, ranks_per_node: int, state: Any, engine: Any, data: Any,
                 run_dir: str | Path):
        self.every, self.state, self.engine, self.data = every, state, engine, data
        self.lay = Layout(dist.get_rank(), dist.get_world_size(), ranks_per_node)
        self.root = files.job_root(run_dir)
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        self.group = dist.new_group(backend="gloo")  # this thread's own (shared notes)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="meshtron-snapshot")
        self.streams = staging.device_streams()
        """The device's stream API the copy is ordered with (`torch.cuda`; None on the CPU,
        where copies need no ordering); replaced by tests to check the CUDA order on a CPU."""
        self._staging: Future | None = None
        self._inflight: Future | None = None
        self.bytes_per_rank: list[dict[str, int]] | None = None
        """Host bytes of every rank (own, peer copy, total over both slots), from the first
        snapshot of the attempt."""
        self.stalls_s: list[float] = []
        """Seconds the training thread was blocked by each snapshot (collecting the state,
        and waiting for the copy before the next optimizer step)."""
        self.restored: dict[str, Any] | None = None
        """What `restore` did (for the restart record), None when it did not restore."""
        self.presized = False
        """The last restore built the optimizer's states from the snapshot's index (no zero-lr
        optimizer step: EngineState.presize_optimizer)."""

    def say(self, text: str) -> None:
        if self.lay.rank == 0:
            print(f"meshtron train: {text}", file=sys.stderr, flush=True)

    def clear(self) -> None:
        """A fresh start: drop this rank's slots of an earlier run of the same folder."""
        files.remove_rank(self.root, self.lay)

    # ---- taking ----------------------------------------------------------------------------
    def after_step(self, step: int, total: int) -> None:
        if step % self.every == 0 and step != total:  # the last step: the run ends there
            self.take(step)

    def take(self, step: int) -> float:
        """Start snapshot `step` (collective); returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.wait()
        leaves = flatten(self.state.tensors(per_replica=self.state.diverged()))
        entries, values, nbytes = index(leaves)
        if self.bytes_per_rank is None:
            self._count(nbytes)
        from meshtron.checkpoint.state import rng_state

        meta = {"format": files.FORMAT, "step": step, "rank": self.lay.rank,
                "world_size": self.lay.world, "run_id": self.run_id, "bytes": nbytes,
                "entries": entries, "values": values, "data": self.data.state_dict(),
                "schedule_last_epoch": self.engine.scheduler.last_epoch, "rng": rng_state(),
                "per_replica": self.state.diverged(), "time": time.time()}
        tensors = [_local(leaves[tuple(e[0])]) for e in entries]
        slot = self.lay.slot(self.root, "own", self.lay.rank, (step // self.every) % SLOTS)
        files.invalidate(slot)
        stream = None
        if self.streams is not None:  # copy on a side stream, after the step's kernels
            stream = self.streams.Stream()
            stream.wait_stream(self.streams.current_stream())
        self._staging = self._executor.submit(self._stage, slot, meta, tensors, stream)
        self._inflight = self._executor.submit(self._exchange, slot, meta)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        return stall

    def _count(self, own: int) -> None:
        """Every rank's host bytes (a tiny all-gather on the training thread; the snapshot
        thread is idle here), logged once per attempt."""
        t = torch.zeros(self.lay.world, dtype=torch.int64, device="cpu")
        t[self.lay.rank] = own
        dist.all_reduce(t, group=self.group)
        owns = t.tolist()
        self.bytes_per_rank = []
        for r in range(self.lay.world):
            peer = owns[(r - self.lay.ranks_per_node) % self.lay.world] \
                if self.lay.has_peer else 0
            self.bytes_per_rank.append({"own": owns[r], "peer_copy": peer,
                                        "host_total": SLOTS * (owns[r] + peer)})
        most = max(b["host_total"] for b in self.bytes_per_rank)
        where = (f"its own and a copy of rank r-{self.lay.ranks_per_node}'s (the previous "
                 "node's)") if self.lay.has_peer else \
            "its own only (one node: no copy survives the loss of the node)"
        self.say(f"in-memory snapshots every {self.every} steps in {self.root}: each rank keeps "
                 f"{where}, {SLOTS} generations; host memory per rank up to "
                 f"{most / 2**20:.1f} MiB (rank 0: own {owns[0] / 2**20:.1f} MiB + peer copy "
                 f"{self.bytes_per_rank[0]['peer_copy'] / 2**20:.1f} MiB, x{SLOTS})")

    def _stage(self, slot: Path, meta: dict[str, Any], tensors: list[torch.Tensor],
               stream: Any) -> None:
        buf = _mapped(slot / DATA, meta["bytes"], create=True)
        with torch.no_grad():
            with self.streams.stream(stream) if stream is not None else nullcontext():
                for (_, dtype, shape, offset), t in zip(meta["entries"], tensors):
                    _view(buf, dtype, shape, offset).copy_(t)
            if stream is not None:
                stream.synchronize()  # this thread only: the training stream runs on
        files.write_meta(slot, meta)

    def _exchange(self, slot: Path, meta: dict[str, Any]) -> None:
        """Send this generation to the keeper; receive the source's into the held slot."""
        if not self.lay.has_peer:
            return
        k = (meta["step"] // self.every) % SLOTS
        held = self.lay.slot(self.root, "held", self.lay.source, k)
        files.invalidate(held)
        doc = _send_recv(self.group, self.lay.keeper, self.lay.source, meta,
                         _mapped(slot / DATA, meta["bytes"], create=False),
                         held / DATA)
        files.write_meta(held, doc)

    def wait_staging(self) -> float:
        """Block until the copy to host memory is done (before every optimizer step)."""
        return staging.wait_staging(self)

    def wait(self) -> None:
        """Wait for the snapshot in flight (its error, if any, is raised here)."""
        self.wait_staging()
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()

    def close(self, finished: bool) -> None:
        """End of the attempt; `finished`: the run completed, so the snapshots go."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            if finished:
                files.remove_rank(self.root, self.lay)

    def summary(self) -> dict[str, Any]:
        """For summary.json (main rank)."""
        return {"every": self.every, "ranks_per_node": self.lay.ranks_per_node,
                "slots": SLOTS, "bytes_per_rank": self.bytes_per_rank,
                "stall_s_max": max(self.stalls_s, default=0.0), "restored": self.restored}

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, disk_step: int | None) -> int | None:
        """Collective, on a restarted attempt: restore the newest complete generation when it
        is at least as new as `disk_step` (rank 0's newest committed checkpoint) and return
        its step; None: load from disk."""
        t0 = time.perf_counter()
        mine = files.inventory(self.root, self.lay, self.run_id)
        gathered: list[Any] = [None] * self.lay.world
        dist.all_gather_object(gathered, mine, group=self.group)
        choice = files.choose(gathered, self.lay.ranks_per_node)
        if choice is None or (disk_step is not None and disk_step > choice.step):
            why = "no complete in-memory generation" if choice is None else \
                f"the disk checkpoint of step {disk_step} is newer than snapshot {choice.step}"
            self.say(f"in-memory snapshots not used ({why}); loading from disk")
            self._drop_others(None, None)  # the run continues from an older step
            return None
        t1 = time.perf_counter()
        self._fetch(choice, gathered)
        t2 = time.perf_counter()
        k = mine["own"].get(choice.step)
        k = (choice.step // self.every) % SLOTS if k is None else k
        slot = self.lay.slot(self.root, "own", self.lay.rank, k)
        load_parts = self._load(slot)
        self._drop_others(choice.step, k)
        t3 = time.perf_counter()
        names = ("decide", "fetch", *load_parts)
        parts = torch.tensor([t3 - t0, t1 - t0, t2 - t1, *load_parts.values()],
                             dtype=torch.float64, device="cpu")
        dist.all_reduce(parts, op=dist.ReduceOp.MAX, group=self.group)
        seconds = parts[0]
        self.restored = {"restored_from": "memory", "restore_s": float(seconds),
                         "snapshot_step": choice.step, "from_peer": list(choice.from_keeper),
                         "presized_optimizer": self.presized,
                         "restore_parts_s": dict(zip(names, parts[1:].tolist()))}
        peers = (f"; rank(s) {', '.join(map(str, choice.from_keeper))} from their keeper's "
                 "copy over the network" if choice.from_keeper else "")
        self.say(f"restored step {choice.step} from in-memory snapshots in "
                 f"{float(seconds):.2f} s{peers}")
        return choice.step

    def _fetch(self, choice: files.Choice, gathered: list[Any]) -> None:
        """Keepers send the copies of the ranks that lost theirs; those write them into their
        own slot (so the next failure finds them again). One exchange per rank, sending and
        receiving at once, so no order of ranks can deadlock."""
        rank, lay = self.lay.rank, self.lay
        send = lay.has_peer and lay.source in choice.from_keeper  # I keep its copy
        recv = rank in choice.from_keeper
        if not (send or recv):
            return
        doc = data = slot = None
        if send:
            held = lay.slot(self.root, "held", lay.source, gathered[rank]["held"][choice.step])
            doc = files.read_meta(held)
            data = _mapped(held / DATA, doc["bytes"], create=False)
        if recv:
            slot = lay.slot(self.root, "own", rank, (choice.step // self.every) % SLOTS)
            files.invalidate(slot)
        got = _send_recv(self.group, lay.source if send else None,
                         lay.keeper if recv else None, doc, data,
                         slot / DATA if recv else None)
        if recv:
            files.write_meta(slot, got)

    def _load(self, slot: Path) -> dict[str, float]:
        """Load the slot into the engine; returns its parts' seconds (template: the engine's
        state dict to copy into, the same DCP template a disk load builds; read: the copy
        from host memory; apply: handing it to the model and optimizer)."""
        from meshtron.checkpoint.state import set_rng_state, set_schedule_position

        t0 = time.perf_counter()
        meta = files.read_meta(slot)
        if meta is None:
            raise RuntimeError(f"snapshot slot {slot} vanished during the restore")
        per_replica = bool(meta.get("per_replica"))
        # no zero-lr optimizer step to build the template (state.py presize_optimizer)
        self.presized = not per_replica and self.state.presize_optimizer({
            e[0][1]: (_dtype(e[1]), not e[2]) for e in meta["entries"]
            if len(e[0]) == 2 and e[0][0] == "optim"})
        template = self.state.tensors(per_replica)
        leaves = flatten(template)
        want = {tuple(e[0]) for e in meta["entries"]} | {tuple(json.loads(p))
                                                         for p in meta["values"]}
        if want != set(leaves):
            raise RuntimeError(f"snapshot {slot}: its keys differ from this engine's state "
                               f"({len(want ^ set(leaves))} differ)")
        t1 = time.perf_counter()
        buf = _mapped(slot / DATA, meta["bytes"], create=False)
        with torch.no_grad():
            for path, dtype, shape, offset in meta["entries"]:
                dst = _local(leaves[tuple(path)])
                src = _view(buf, dtype, shape, offset)
                if dst.dtype != src.dtype or list(dst.shape) != list(src.shape):
                    raise RuntimeError(f"snapshot {slot}: {'.'.join(path)} is {src.dtype} "
                                       f"{list(src.shape)}, the engine has {dst.dtype} "
                                       f"{list(dst.shape)}")
                dst.copy_(src)
        for p, value in meta["values"].items():
            _set(template, tuple(json.loads(p)), value)
        t2 = time.perf_counter()
        self.state.load_tensors(template, per_replica)
        set_schedule_position(self.engine.scheduler, meta["schedule_last_epoch"])
        self.data.load_state_dict(meta["data"])
        set_rng_state(meta["rng"])
        return {"template": t1 - t0, "read": t2 - t1, "apply": time.perf_counter() - t2}

    def _drop_others(self, step: int | None, k: int | None) -> None:
        """Invalidate every generation this rank holds but `step` (in slot `k`; None: all): a
        newer, incomplete one of the failed attempt must never be mixed with the timeline that
        continues from the restored step."""
        for j in range(SLOTS):
            own = self.lay.slot(self.root, "own", self.lay.rank, j)
            if j != k:
                files.invalidate(own)
            held = self.lay.slot(self.root, "held", self.lay.source, j)
            doc = files.read_meta(held)
            if doc is not None and doc["step"] != step:
                files.invalidate(held)


def _send_recv(group: Any, dst: int | None, src: int | None, meta: dict[str, Any] | None,
               data: torch.Tensor | None, out: Path | None) -> dict[str, Any] | None:
    """Send (`meta`, `data`) to `dst` and/or receive a (meta, data) from `src` into the file
    `out`, at the same time (a ring: every rank sends and receives); returns the received meta.
    Sizes travel first, so ranks with different shard sizes exchange safely."""
    ops = []
    send_sizes = recv_sizes = None
    if dst is not None:
        blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        send_sizes = torch.tensor([blob.numel(), data.numel()], dtype=torch.int64, device="cpu")
        ops.append(dist.P2POp(dist.isend, send_sizes, dst, group))
    if src is not None:
        recv_sizes = torch.zeros(2, dtype=torch.int64, device="cpu")
        ops.append(dist.P2POp(dist.irecv, recv_sizes, src, group))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ops = []
    if dst is not None:
        ops.append(dist.P2POp(dist.isend, blob, dst, group))
        if data.numel():
            ops.append(dist.P2POp(dist.isend, data, dst, group))
    got_blob = None
    if src is not None:
        n_meta, n_data = recv_sizes.tolist()
        got_blob = torch.empty(n_meta, dtype=torch.uint8, device="cpu")
        ops.append(dist.P2POp(dist.irecv, got_blob, src, group))
        got = _mapped(out, n_data, create=True)
        if n_data:
            ops.append(dist.P2POp(dist.irecv, got, src, group))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return json.loads(bytes(got_blob.numpy()).decode()) if got_blob is not None else None
