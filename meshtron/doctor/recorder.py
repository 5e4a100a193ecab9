"""The collective recorder: every collective and point-to-point operation this rank's recording
process groups run, in a bounded ring buffer.

Where the records come from: on CPU a rank of `meshtron train` joins a `RecordingProcessGroup`
(backend.py), meshtron's own gloo process group, whose collective methods call `issue()` here
before running the operation. Nothing of torch is patched or replaced, and `torch.compile`
compiles the same graphs with or without it (backend.py says why; tests/test_no_torch_patching.py
and tests/test_compile_recorder.py check it). On NCCL the session reads PyTorch's own Flight
Recorder instead (flight.py). Groups made with an explicit other backend (e.g. the checkpoint
side groups, `new_group(backend="gloo")`) are not recorded.

Numbering: collectives carry their group's sequence number (every member of a group issues the
same collectives in the same order, so records of different ranks align by it). Point-to-point
operations are numbered apart, per (group, direction, peer): the k-th send from A to B matches
the k-th receive on B from A. The groups count from their creation (backend.py).

Cost per collective: a short list (times from the monotonic clock, turned into wall time only
when read) and a small Work wrapper; the Python stack (at most `STACK_FRAMES` frames) only with
`stacks=True` or MESHTRON_DOCTOR_STACKS=1 (the dumps' thread stacks already say where a hung
rank is). `bench/recorder_overhead.py` measures it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

import torch

STACK_FRAMES = 8
PENDING_KEPT = 64
"""Works kept for a completion check at dump time (those never waited on, e.g. DDP's)."""
# Frames of these files say nothing about where the user's code is.
_SKIP_FILES = ("meshtron/doctor/", "torch/distributed/distributed_c10d.py",
               "torch/distributed/c10d_logger.py")

# Record fields (a list per record: cheaper than an object).
SEQ, GROUP, OP, SHAPES, DTYPES, T_ENQUEUE, T_START, T_END, STATE, STACK, PEER = range(11)
STACKS_ENV = "MESHTRON_DOCTOR_STACKS"
"""Set to 1 to keep each collective's Python stack (a debugging aid: a frame walk per call)."""
clock = _clock = time.perf_counter  # CLOCK_MONOTONIC on Linux: never jumps; wall time added when read
_DTYPE_NAMES: dict[Any, str] = {}
_SKIPPED: dict[tuple[Any, tuple[str, ...]], bool] = {}  # (code, skip list) -> skipped


class GroupInfo:
    """A process group as the dumps describe it."""

    __slots__ = ("name", "ranks", "axis", "desc")

    def __init__(self, name: str, ranks: list[int], axis: str | None, desc: str):
        self.name, self.ranks, self.axis, self.desc = name, ranks, axis, desc

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "axis": self.axis, "desc": self.desc}


def short_stack(skip_files: tuple[str, ...] = _SKIP_FILES) -> tuple[tuple[Any, int], ...]:
    """(code, line) of the innermost STACK_FRAMES frames above the caller's caller whose file
    names contain none of `skip_files` (default: this package and c10d's Python wrappers),
    innermost first; names are formatted only when dumped."""
    out = []
    frame = sys._getframe(2)
    depth = 0
    while frame is not None and len(out) < STACK_FRAMES and depth < 64:
        code = frame.f_code
        skip = _SKIPPED.get((code, skip_files))
        if skip is None:
            skip = _SKIPPED[code, skip_files] = any(s in code.co_filename for s in skip_files)
        if not skip:
            out.append((code, frame.f_lineno))
        frame = frame.f_back
        depth += 1
    return tuple(out)


def shape_dtype(value: Any, shapes: list, dtypes: list) -> None:
    """Append the shape and dtype name of every tensor in `value` (nested lists/tuples)."""
    if isinstance(value, torch.Tensor):
        shapes.append(list(value.shape))
        name = _DTYPE_NAMES.get(value.dtype)
        if name is None:
            name = _DTYPE_NAMES[value.dtype] = str(value.dtype).replace("torch.", "")
        dtypes.append(name)
    elif isinstance(value, (list, tuple)):
        for v in value:
            shape_dtype(v, shapes, dtypes)


def record_dict(rec: list, group: GroupInfo | None, wall) -> dict[str, Any]:
    """One record as the dumps write it; `wall` turns the monotonic clock into wall time."""
    d = {"seq": rec[SEQ], "group": rec[GROUP], "op": rec[OP], "shapes": rec[SHAPES],
         "dtypes": rec[DTYPES], "enqueue_t": wall(rec[T_ENQUEUE]),
         "start_t": wall(rec[T_START]), "end_t": wall(rec[T_END]), "state": rec[STATE],
         "axis": group.axis if group else None,
         "stack": [f"{c.co_filename}:{line} in {c.co_name}" for c, line in rec[STACK]]}
    if rec[PEER] is not None:
        d["peer"] = rec[PEER]
    return d


class RecordBook:
    """What a recorder keeps and how it is read back: the ring of records (`capacity`: the
    oldest are dropped), the groups with their mesh-axis names, the monotonic clock's offset to
    wall time, the progress signal. Shared with the tests' reference recorder
    (testkit/collective_mode.py), so that both keep and read records the same way. `on_issue`:
    called with no arguments at each collective (the watchdog reads `last_issue_t` instead,
    which costs nothing per call). `stacks`: keep each collective's Python stack (default:
    MESHTRON_DOCTOR_STACKS=1)."""

    def __init__(self, rank: int, capacity: int = 2000, on_issue=None,
                 stacks: bool | None = None):
        self.rank = rank
        self.stacks = os.environ.get(STACKS_ENV) == "1" if stacks is None else stacks
        # Wall time of the monotonic clock's origin: records keep monotonic seconds, readers
        # get wall seconds (comparable across the ranks of a host, as the analysis needs).
        self._wall_offset = time.time() - _clock()
        self.last_issue_t = 0.0
        """Monotonic time of the latest collective issued (the watchdog's progress signal)."""
        self.records: collections.deque = collections.deque(maxlen=capacity)
        self.groups: dict[str, GroupInfo] = {}
        self._axes: dict[str, str] = {}
        self._on_issue = on_issue
        self.waits: collections.deque | None = None
        """timeline.py's deque of (start, end) of main-thread waits, when it runs."""
        self._main = threading.main_thread().ident

    def name_axis(self, group, axis: str) -> None:
        """Call a process group by its mesh axis name in the records."""
        self._axes[group.group_name] = axis
        info = self.groups.get(group.group_name)
        if info is not None:
            info.axis = axis

    def wall(self, t: float | None) -> float | None:
        """Wall-clock seconds of a monotonic time of this recorder."""
        return None if t is None else t + self._wall_offset

    def _sweep(self) -> None:
        """Mark the records whose operations have finished completed (before a read)."""

    def snapshot(self) -> list[dict[str, Any]]:
        """The records, oldest first, as plain dicts (safe to call from any thread)."""
        self._sweep()
        return [record_dict(r, self.groups.get(r[GROUP]), self.wall) for r in list(self.records)]

    def group_table(self) -> dict[str, dict[str, Any]]:
        return {name: g.to_dict() for name, g in list(self.groups.items())}


class CollectiveRecorder(RecordBook):
    """Records what the recording process groups run while attached (`install()`, for a
    training rank's whole run; `uninstall()` detaches); what it keeps: `RecordBook`."""

    clock = staticmethod(_clock)

    def __init__(self, rank: int, capacity: int = 2000, on_issue=None,
                 stacks: bool | None = None):
        super().__init__(rank, capacity, on_issue, stacks)
        self._by_group: dict[int, GroupInfo] = {}
        self._pending: collections.deque = collections.deque(maxlen=PENDING_KEPT)
        self.blocked_s = 0.0
        """Seconds the main thread has spent blocked in waits on recorded operations so far
        (`waited`; the doctor's straggler rule, diagnose/straggler.py)."""

    # -- attaching -----------------------------------------------------------------------------
    def install(self) -> None:
        """Attach to the recording process groups (backend.py) of this process."""
        from meshtron.doctor import backend

        backend.attach(self)

    def uninstall(self) -> None:
        from meshtron.doctor import backend

        if backend.attached() is self:
            backend.attach(None)

    def __enter__(self) -> "CollectiveRecorder":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- what the recording groups call ----------------------------------------------------------
    def issue(self, group, op: str, seq: int, tensors, peer: int | None) -> list:
        """A new record of `op` (`peer`: the group rank of a send's or receive's peer)."""
        now = self.last_issue_t = _clock()
        info = self._by_group.get(id(group))
        if info is None:
            info = self._group(group)
        shapes: list = []
        dtypes: list = []
        shape_dtype(tensors, shapes, dtypes)
        if peer is not None:
            ranks = info.ranks
            peer = ranks[peer] if 0 <= peer < len(ranks) else peer
        rec = [seq, info.name, op, shapes, dtypes, now, None, None, "issued",
               short_stack() if self.stacks else (), peer]
        self.records.append(rec)
        if self._on_issue is not None:
            self._on_issue()
        return rec

    def started(self, rec: list) -> None:
        """The operation was handed to the backend (its call returned)."""
        rec[T_START], rec[STATE] = _clock(), "started"

    def waited(self, rec: list, t0: float) -> None:
        """A wait on the operation returned (or raised; a failure reaches the training
        thread as an exception, which the dump records)."""
        t1 = _clock()
        if rec[T_END] is None:
            rec[T_END], rec[STATE] = t1, "completed"
        if threading.get_ident() == self._main:
            self.blocked_s += t1 - t0
            if self.waits is not None:
                self.waits.append((t0, t1))  # timeline.py: the main thread was blocked

    def completed(self, rec: list) -> None:
        if rec[T_END] is None:
            rec[T_END], rec[STATE] = _clock(), "completed"

    def pending(self, rec: list, work) -> None:
        """Keep a Work nobody may wait on, to check its completion at dump time."""
        self._pending.append((rec, work))

    def _group(self, group) -> GroupInfo:
        import torch.distributed as dist

        name = group.group_name
        info = self.groups.get(name)
        if info is None:
            try:
                ranks = list(dist.get_process_group_ranks(group))
            except (RuntimeError, ValueError, KeyError):  # not (yet) registered
                ranks = []
            info = GroupInfo(name, ranks, self._axes.get(name),
                             getattr(group, "group_desc", "") or "")
            self.groups[name] = info
        if info.ranks:
            self._by_group[id(group)] = info
        return info

    # -- reading -------------------------------------------------------------------------------
    def _sweep(self) -> None:
        for rec, work in list(self._pending):
            if rec[T_END] is None:
                try:
                    if work.is_completed():
                        self.completed(rec)
                except RuntimeError:  # failed: the exception reached its waiter
                    self.completed(rec)

