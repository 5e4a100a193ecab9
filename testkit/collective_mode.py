"""A reference recorder for tests: a `TorchDispatchMode` on the `c10d` and `_c10d_functional`
operator namespaces, which sees every collective the code under `with CollectiveMode(rank):`
issues on this thread, on any process group (shared notes, "Seeing collectives"), except
those DTensor issues inside its own operator handlers (the mode is suspended there).

Tests count collectives with it on plain gloo groups (tests/test_dp_collectives.py,
test_ep_collectives.py, test_cp_train.py) and compare meshtron doctor's recorder with it
(tests/test_doctor_recorder.py). It is not the product's recorder (meshtron/doctor/backend.py):
a mode puts every operator of the thread through Python, and torch.compile does not compile
under one. The records have the product recorder's format (`snapshot()`, `groups`).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The product recorder's record format and helpers (the records must read the same).
from meshtron.doctor.recorder import (  # noqa: F401  (record fields are re-exported for tests)
    DTYPES, GROUP, OP, PEER, SEQ, SHAPES, STACK, STACKS_ENV, STATE, T_END, T_ENQUEUE, T_START,
    GroupInfo, RecordBook, clock, record_dict, shape_dtype, short_stack)

WATCHED_NAMESPACES = frozenset(("c10d", "_c10d_functional"))
# Operators that are bookkeeping, not communication.
IGNORED_OPS = frozenset(("wait_tensor", "_wrap_tensor_autograd", "barrier_wait"))
P2P_OPS = {"send": "send", "recv_": "recv", "recv_any_source_": "recv"}
# c10d's operator names -> the Python API's names (the functional ones already are).
_RENAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all",
            "allreduce_coalesced": "all_reduce_coalesced",
            "allgather_into_tensor_coalesced": "all_gather_coalesced",
            "allgather_coalesced": "all_gather_coalesced", "alltoall_base": "all_to_all_single",
            "allgather_base": "all_gather_into_tensor",
            "reduce_scatter_base": "reduce_scatter_tensor",
            "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced"}


def op_name(raw: str) -> str:
    """'_allgather_base_' -> 'all_gather_into_tensor', 'allreduce_' -> 'all_reduce'."""
    name = raw.strip("_")
    return _RENAMES.get(name, name)


# Arguments that only the root fills (scatter's inputs, gather's outputs): not recorded, so that
# every member's record of one collective has the same shapes.
ROOT_ONLY = {"scatter_": ("input_tensors",), "gather_": ("output_tensors",)}
PENDING_PER_GROUP = 8
# Frames of these files say nothing about where the user's code is.
_SKIP_FILES = ("torch/utils/_python_dispatch.py", "meshtron/doctor/", "torch/_ops.py",
               "torch/distributed/c10d_logger.py")
_is_compiling = torch.compiler.is_compiling


class _OpInfo:
    """What the schema says about one collective operator (computed once per operator)."""

    __slots__ = ("name", "raw", "group_index", "peer_index", "p2p", "tensor_indices")

    def __init__(self, func):
        schema = func._schema
        self.raw = func._overloadpacket.__name__
        self.name = op_name(self.raw)
        self.p2p = P2P_OPS.get(self.raw)
        self.group_index = self.peer_index = None
        self.tensor_indices = []
        for i, arg in enumerate(schema.arguments):
            text = str(arg.type)
            if "ProcessGroup" in text or arg.name == "group_name":
                self.group_index = i
            elif arg.name in ("dst", "src", "srcRank", "dstRank"):
                self.peer_index = i
            elif "Tensor" in text and arg.name not in ROOT_ONLY.get(self.raw, ("sparse_indices",)):
                self.tensor_indices.append(i)


class CollectiveMode(TorchDispatchMode, RecordBook):
    """Records the collectives of this thread while entered (`with mode:`; every operator goes
    through Python, 1.5-2x slower steps on small models). What it keeps, and how it is read:
    the product recorder's `RecordBook` (same arguments)."""

    def __init__(self, rank: int, capacity: int = 2000, on_issue=None,
                 stacks: bool | None = None):
        TorchDispatchMode.__init__(self)
        RecordBook.__init__(self, rank, capacity, on_issue, stacks)
        self._by_object: dict[int, tuple[Any, GroupInfo]] = {}
        self._seq: dict[str, int] = collections.defaultdict(int)
        self._p2p_seq: dict[tuple, int] = collections.defaultdict(int)
        self._ops: dict[Any, _OpInfo] = {}
        self._pending_functional: dict[int, list] = {}
        self._lock = threading.Lock()
        self._pending_works: dict[str, collections.deque] = collections.defaultdict(
            collections.deque)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps every mode's __torch_dispatch__ in a dynamo-disable wrapper,
        # which cost 100-350 us per operator on a loaded 2-core machine (cProfile: 800 calls,
        # 0.3 s per step of the debug model) and made steps 1.5-2.5x slower. The mode never runs
        # compiled code, so it opts out.
        return False

    # -- interception ----------------------------------------------------------------------------
    def _call(self, info: _OpInfo, run, args, kwargs):
        """Record the collective, run it (`run(*args, **kwargs)`), note when it completes."""
        if _is_compiling():  # tracing for torch.compile: no records of traced (fake) calls
            return run(*args, **kwargs)
        if info.raw in IGNORED_OPS or info.group_index is None:
            if info.raw != "wait_tensor":
                return run(*args, **kwargs)
            t0 = clock()
            out = run(*args, **kwargs)
            if self.waits is not None and threading.get_ident() == self._main:
                self.waits.append((t0, clock()))  # timeline.py: main thread blocked
            if self._pending_functional:
                rec = self._pending_functional.pop(id(args[0]), None)
                if rec is not None:
                    rec[T_END], rec[STATE] = clock(), "completed"
            return out
        rec = self._record(info, args, kwargs)
        out = run(*args, **kwargs)
        rec[T_START] = clock()
        self._watch_completion(rec, out)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """The reference path (`with recorder:`): sees every operator of this thread."""
        if func.namespace not in WATCHED_NAMESPACES:
            return func(*args, **(kwargs or {}))
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _OpInfo(func)
        return self._call(info, func, args, kwargs or {})

    def _record(self, info: _OpInfo, args, kwargs) -> list:
        now = self.last_issue_t = clock()
        group = self._group(args[info.group_index] if info.group_index < len(args)
                            else kwargs.get("group_name"))
        shapes: list = []
        dtypes: list = []
        for i in info.tensor_indices:
            if i < len(args):
                shape_dtype(args[i], shapes, dtypes)
        name = group.name if group is not None else "?"
        peer = None
        with self._lock:  # collectives may come from several threads (kernels are global)
            if info.p2p is not None:  # numbered per (group, direction, peer)
                local = int(args[info.peer_index]) if info.peer_index is not None else -1
                peer = group.ranks[local] if group and 0 <= local < len(group.ranks) else local
                key = (name, info.p2p, peer)
                self._p2p_seq[key] += 1
                seq = self._p2p_seq[key]
            else:  # numbered per group
                self._seq[name] += 1
                seq = self._seq[name]
        rec = [seq, name, info.p2p or info.name, shapes, dtypes, now, None, None,
               "issued", short_stack(_SKIP_FILES) if self.stacks else (), peer]
        self.records.append(rec)
        if self._on_issue is not None:
            self._on_issue()
        return rec

    def _group(self, ref) -> GroupInfo | None:
        """The GroupInfo of a ProcessGroup script object or a functional group name."""
        from torch._C._distributed_c10d import ProcessGroup

        if isinstance(ref, str):
            key, obj = ref, ref
        else:
            try:  # a new script-object wrapper per call, the same ProcessGroup behind it
                obj = ProcessGroup.unbox(ref)
            except RuntimeError:
                return None
            key = id(obj)
        hit = self._by_object.get(key)
        if hit is not None and (hit[0] is obj or hit[0] == obj):
            return hit[1]
        import torch.distributed as dist

        try:
            if isinstance(ref, str):
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(ref)
            else:
                pg = obj
            name = pg.group_name
            info = self.groups.get(name)
            if info is None:
                info = GroupInfo(name, list(dist.get_process_group_ranks(pg)),
                                 self._axes.get(name), getattr(pg, "group_desc", "") or "")
                self.groups[name] = info
        except (RuntimeError, ValueError, KeyError):
            return None
        self._by_object[key] = (obj, info)
        return info

    def _watch_completion(self, rec: list, out) -> None:
        """Completion: a c10d Work is kept (at most PENDING_PER_GROUP per group) and polled with
        `is_completed()` when the group's list is full (so about one poll per collective, not
        one per pending Work), after every main-thread wait (timeline.py) and at dumps; the
        completion time is when a poll saw it. Polling, not a future
        callback: the callback runs on the backend's thread and had to take the GIL from the
        training thread, which cost ~2.5 ms per collective on a loaded 2-core machine
        (bench/recorder_overhead.py). Functional collectives complete at their wait_tensor."""
        work = out[1] if isinstance(out, tuple) and len(out) == 2 else out
        if isinstance(work, torch.ScriptObject):
            from torch._C._distributed_c10d import Work

            try:
                work = Work.unbox(work)
            except RuntimeError:
                return
            pending = self._pending_works[rec[GROUP]]
            if len(pending) >= PENDING_PER_GROUP:
                self._sweep_group(rec[GROUP])
                if len(pending) >= PENDING_PER_GROUP:
                    pending.popleft()  # forget it: its state stays "issued"
            pending.append((rec, work))
        elif isinstance(out, torch.Tensor):
            rec[STATE] = "started"
            if len(self._pending_functional) > 4096:  # never waited: forget them
                self._pending_functional.clear()
            self._pending_functional[id(out)] = rec

    def _sweep_group(self, group: str) -> None:
        """Mark the finished Works of a group completed."""
        pending = self._pending_works.get(group)
        if not pending:
            return
        now = clock()
        for item in list(pending):
            rec, work = item
            try:
                if not work.is_completed():
                    continue
            except RuntimeError:
                pass
            # Completed or failed: Work's success/exception getters are deprecated (and warn);
            # a failure reaches the training thread as an exception, which the dump records.
            rec[T_END], rec[STATE] = now, "completed"
            try:
                pending.remove(item)
            except ValueError:  # swept by another thread
                pass

    # -- reading (RecordBook.snapshot) ------------------------------------------------------------
    def _sweep(self) -> None:
        for group in list(self._pending_works):
            self._sweep_group(group)




def record_last_step(pm, opt, mesh, inputs, targets, steps: int) -> CollectiveMode:
    """Train `steps` steps of a parallel model on this data-parallel rank's rows of `inputs` /
    `targets` ([step, global batch, ...]), each step's forward and backward under a new
    CollectiveMode; the last step's (the first steps carry one-time traffic, e.g. lazy state)."""
    import torch.distributed as dist

    from meshtron.parallel.mesh import data_mesh

    dp, r = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
    rows = inputs.shape[1] // dp
    rec = None
    for step in range(steps):
        rec = CollectiveMode(dist.get_rank())
        with rec:
            pm.forward_backward(inputs[step, r * rows:(r + 1) * rows],
                                targets[step, r * rows:(r + 1) * rows])
        opt.step()
        opt.zero_grad()
    return rec
