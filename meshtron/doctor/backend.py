"""The recording process group: gloo, seen through a `torch.distributed.ProcessGroup` subclass.

A CPU rank of `meshtron train` joins its default process group with backend `BACKEND`
(registered through `torch.distributed.Backend.register_backend`, PyTorch's plug-in API for
process groups). Its creator returns a `RecordingProcessGroup`: a Python subclass of
ProcessGroup (pybind's trampoline, which PyTorch provides so that process groups can be
written in Python) that owns a real `ProcessGroupGloo` as its CPU backend. Sub-groups
(`new_group`, DeviceMesh axes) inherit the default group's backend, so every group of the run
is one. Each collective method records the operation in the attached `CollectiveRecorder`
and then calls the base class's own method (`dist.ProcessGroup.allreduce(self, ...)`), which
pybind runs as the C++ base implementation (its trampoline does not call back into Python from
the overriding method itself): the c10d operator, dispatched to the gloo backend, exactly the
path a plain gloo group takes.

Why here, and not by patching: nothing of torch is replaced (no operator kernels, no module or
class attributes: `tests/test_no_torch_patching.py`), and the recording sits below
`torch.compile` by construction: dynamo, AOT autograd and inductor trace and compile the same
graph whatever the group's class is (the group is named by its group name in the graph), and
the compiled code's collectives reach this object at run time like eager ones, so they are
recorded too. Tracing runs on fake tensors and never calls the group: nothing is recorded then.

The returned Work is wrapped (`RecordedWork`, a Python subclass of `dist.Work`) so that a wait,
from Python (`work.wait()`) or from C++ (the functional collectives' `wait_tensor`, which
DTensor and compiled code use), marks the record completed and, on the main thread, adds the
blocked interval to the timeline (timeline.py).

Sequence numbers are counted by the group itself from its creation, whether or not a recorder
is attached, so that records of different ranks align even if they attached at different
moments: collectives per group; point-to-point operations per (direction, peer).
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch._C._distributed_c10d import (  # noqa: E402
    _allow_inflight_collective_as_graph_input as _allow_inflight,
    _register_work,
)

BACKEND = "meshtron_gloo"
"""The backend name `init_process_group` gets on recorded CPU ranks."""
_PG = dist.ProcessGroup
_recorder = None  # the attached CollectiveRecorder (one per process), or None
_register_lock = threading.Lock()


# The ProcessGroup methods overridden below, by the names pybind's trampoline and the Python
# API look up: torch 2.13's, or torch 2.11's for the five it renamed (`_OLDER`; 2.11's
# `dist.all_gather_into_tensor` calls `_allgather_base`, its functional all-gather reaches the
# trampoline as `allgather_into_tensor_coalesced`, one pair). A torch whose ProcessGroup has
# neither name of one would call its base methods with the GIL held (see the comment above the
# collectives): `supported()` then says no and ranks use plain gloo.
_OVERRIDDEN = ("allreduce", "allreduce_coalesced", "allgather", "all_gather_single",
               "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_single_coalesced", "all_to_all_single", "broadcast", "barrier",
               "send", "recv")
_OLDER = {"all_gather_single": "_allgather_base",
          "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
          "reduce_scatter_single": "_reduce_scatter_base",
          "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
          "all_to_all_single": "alltoall_base"}


def supported(pg_class: type = _PG) -> bool:
    """This torch's ProcessGroup has every method the recording group overrides."""
    return not missing(pg_class)


def missing(pg_class: type = _PG) -> list[str]:
    """The overridden methods `pg_class` (this torch's ProcessGroup) has under neither its torch
    2.13 name nor its torch 2.11 one."""
    return [name for name in _OVERRIDDEN
            if not hasattr(pg_class, name) and not hasattr(pg_class, _OLDER.get(name, name))]


def unsupported_line(pg_class: type = _PG) -> str | None:
    """What a CPU run is told when this torch cannot record its collectives (None: it can).
    Named by what is missing and the installed torch's version; decided by `missing`, not by
    the version."""
    absent = missing(pg_class)
    if not absent:
        return None
    return (f"torch {torch.__version__}'s ProcessGroup has no {', '.join(absent)} to override: "
            f"the doctor's recording group is off, this run's collectives are not recorded "
            f"(plain gloo)")


def register() -> str:
    """Register BACKEND with torch.distributed (once per process); returns its name."""
    with _register_lock:
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    return BACKEND


def attach(recorder) -> None:
    """Record this process's collectives in `recorder` from now on (None: stop)."""
    global _recorder
    _recorder = recorder


def attached():
    return _recorder


def is_recording_group(group) -> bool:
    return isinstance(group, RecordingProcessGroup)


def _create(store, rank: int, size: int, timeout: timedelta) -> "RecordingProcessGroup":
    return RecordingProcessGroup(store, rank, size, timeout)


class RecordedWork(dist.Work):
    """A collective's Work, as returned to its caller: waits mark the record (see module doc);
    everything else is the wrapped gloo Work's."""

    def __init__(self, work, rec: list, recorder):
        super().__init__()
        self._work, self._rec, self._recorder = work, rec, recorder

    def wait(self, timeout: timedelta | None = None) -> bool:
        recorder = self._recorder
        t0 = recorder.clock()
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        finally:
            recorder.waited(self._rec, t0)

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._recorder.completed(self._rec)
        return done


def _forward(name: str):
    """A RecordedWork method that returns the wrapped Work's `name`: set on the class, pybind's
    trampoline finds it as it finds one written in the class body, so C++ callers of the Work
    (a DDP comm hook's future, for one) reach the wrapped Work as Python callers do."""
    def method(self, *args):
        return getattr(self._work, name)(*args)

    method.__name__, method.__qualname__ = name, f"RecordedWork.{name}"
    return method


# What RecordedWork passes through unchanged, by the names of dist.Work's methods
for _name in ("get_future", "is_success", "exception", "source_rank", "_source_rank", "result",
              "synchronize", "get_future_result", "block_current_stream"):
    setattr(RecordedWork, _name, _forward(_name))
del _name


class _AllOf(dist.Work):
    """One Work for several (a coalesced operation issued per tensor pair)."""

    def __init__(self, works: list):
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self):
        return torch.futures.collect_all([work.get_future() for work in self._works])


class RecordingProcessGroup(_PG):
    """A gloo process group whose collectives are recorded (see the module docstring). The
    shapes recorded are the operator's tensor arguments in the order of its c10d schema
    (outputs before inputs), as earlier dumps and tests/data/doctor have them.

    Each override must be named as the method it overrides and call the base method with
    `self` (pybind recognises the overriding frame by both and then runs the C++ base)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)  # the (store, rank, size) form makes no Python subclass
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
        gloo._set_sequence_number_for_group()  # what init_process_group does for gloo
        backend = gloo
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            # What init_process_group does for gloo groups in this mode (and skips for Python
            # process groups): check every collective's shapes across ranks first, so that a
            # mismatch is an error rather than gloo aborting the process. The store is
            # already this group's own prefix store.
            from torch.distributed.distributed_c10d import _create_process_group_wrapper

            backend = _create_process_group_wrapper(gloo, "meshtron", store, rank, size,
                                                    timeout)
        self._set_default_backend(_PG.BackendType.GLOO)
        self._register_backend(torch.device("cpu"), _PG.BackendType.GLOO, backend)
        self._backend = backend
        self._coll_seq = itertools.count(1)
        self._p2p_seq: dict[tuple[str, int], Any] = {}
        self._ranks: list[int] | None = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def global_ranks(self) -> list[int]:
        """The group's members as global ranks (looked up once the group is registered)."""
        if self._ranks is None:
            self._ranks = list(dist.get_process_group_ranks(self))
        return self._ranks

    def _begin(self, op: str, tensors, peer: int | None = None):
        """Number the operation; record it when a recorder is attached. Returns the record."""
        if peer is None:
            seq = next(self._coll_seq)
        else:
            counter = self._p2p_seq.get((op, peer))
            if counter is None:
                counter = self._p2p_seq.setdefault((op, peer), itertools.count(1))
            seq = next(counter)
        recorder = _recorder
        if recorder is None:
            return None
        return recorder.issue(self, op, seq, tensors, peer)

    def _end(self, rec, work, outputs):
        if _allow_inflight():  # as the base class does (compiled graphs that take in-flight
            for tensor in outputs:  # collectives' outputs as inputs wait on them)
                _register_work(tensor, work)
        if rec is None:
            return work
        recorder = _recorder
        if recorder is None:
            return work
        recorder.started(rec)
        recorder.pending(rec, work)
        return RecordedWork(work, rec, recorder)

    # -- collectives: record, then the gloo backend's ------------------------------------------
    # The backend is called through its own bindings, which release the GIL while gloo works.
    # Not through the base class (`ProcessGroup.allreduce(self, ...)`): pybind's trampoline
    # runs that with the GIL held, and gloo's worker thread, which frees finished work under
    # its queue lock, needs the GIL to drop tensors' Python objects: a deadlock (seen in
    # bench/recorder_overhead.py --per-call). It is the call the base class makes (the c10d
    # operator's CPU kernel calls the backend). The two coalesced operations have no backend
    # binding: gloo runs them as one operation per tensor pair (its `_reduce_scatter_base` is
    # the coalesced call with one pair; each pair reduced apart), so they are issued per pair
    # here, the same arithmetic, under one Work.
    def allreduce(self, tensors, opts):
        rec = self._begin("all_reduce", tensors)
        return self._end(rec, self._backend.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts):
        rec = self._begin("all_reduce_coalesced", tensors)
        return self._end(rec, self._backend.allreduce_coalesced(tensors, opts), tensors)

    def allgather(self, output_tensors, input_tensors, opts):
        rec = self._begin("all_gather", [output_tensors, input_tensors])
        return self._end(rec, self._backend.allgather(output_tensors, input_tensors, opts),
                         [t for ts in output_tensors for t in ts])

    def all_gather_single(self, output, input, opts):
        rec = self._begin("all_gather_into_tensor", [output, input])
        return self._end(rec, self._backend._allgather_base(output, input, opts), [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return self._per_pair("all_gather_coalesced", self._backend._allgather_base, outputs,
                              inputs, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        rec = self._begin("reduce_scatter", [output_tensors, input_tensors])
        return self._end(rec, self._backend.reduce_scatter(output_tensors, input_tensors, opts),
                         output_tensors)

    def reduce_scatter_single(self, output, input, opts):
        rec = self._begin("reduce_scatter_tensor", [output, input])
        return self._end(rec, self._backend._reduce_scatter_base(output, input, opts), [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._per_pair("reduce_scatter_coalesced", self._backend._reduce_scatter_base,
                              outputs, inputs, opts)

    def _per_pair(self, op: str, base, outputs, inputs, opts):
        """A coalesced operation without a backend binding: `base` per (output, input) pair,
        recorded once as `op`, under one Work."""
        rec = self._begin(op, [outputs, inputs])
        return self._end(rec, _AllOf([base(o, i, opts) for o, i in zip(outputs, inputs)]),
                         outputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        # (the analysis lets the members of an all-to-all differ: uneven splits)
        rec = self._begin("all_to_all_single", [output, input])
        return self._end(rec, self._backend.alltoall_base(output, input, output_splits,
                                                          input_splits, opts), [output])

    def broadcast(self, tensors, opts):
        rec = self._begin("broadcast", tensors)
        return self._end(rec, self._backend.broadcast(tensors, opts), tensors)

    def barrier(self, opts):
        rec = self._begin("barrier", [])
        return self._end(rec, self._backend.barrier(opts), [])

    def send(self, tensors, dst: int, tag: int):
        rec = self._begin("send", tensors, peer=dst)
        return self._end(rec, self._backend.send(tensors, dst, tag), [])

    def recv(self, tensors, src: int, tag: int):
        rec = self._begin("recv", tensors, peer=src)
        return self._end(rec, self._backend.recv(tensors, src, tag), tensors)

    # -- torch 2.11's names of five of them (`_OLDER`): the same operations, recorded alike.
    # 2.13 calls only its own names (its trampoline falls back to these only where a subclass
    # lacks the new one). 2.11's functional all-gather and reduce-scatter of one tensor arrive
    # as a coalesced call with one pair: recorded under the single operation's name, as 2.13
    # records them, so that both torches' records of one step read alike.
    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts or dist.AllgatherOptions())

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts or dist.ReduceScatterOptions())

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        return self.all_to_all_single(output, input, output_splits, input_splits,
                                      opts or dist.AllToAllOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        if len(outputs) == 1:
            return self.all_gather_single(outputs[0], inputs[0], opts)
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        if len(outputs) == 1:
            return self.reduce_scatter_single(outputs[0], inputs[0], opts)
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def start_coalescing(self, device) -> None:
        self._backend._start_coalescing(device)

    def end_coalescing(self, device):
        return self._backend._end_coalescing(device)
