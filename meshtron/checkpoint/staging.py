"""The wait for a state copy to host memory, shared by disk checkpoints
(meshtron/checkpoint/checkpointer.py) and in-memory snapshots (meshtron/checkpoint/snapshot.py):
both copy on a background thread and hold back the next optimizer step, the first write to
the tensors being copied, until the copy is done (torchtitan's `maybe_wait_for_staging`)."""

from __future__ import annotations

import time
from typing import Any


def wait_staging(owner: Any) -> float:
    """Block until `owner._staging` (a Future, or None when nothing is in flight) is done,
    raising its error; returns the seconds blocked, added to the newest of `owner.stalls_s`
    (that save's stall)."""
    if owner._staging is None:
        return 0.0
    t0 = time.perf_counter()
    staging, owner._staging = owner._staging, None
    staging.result()
    waited = time.perf_counter() - t0
    if owner.stalls_s:
        owner.stalls_s[-1] += waited
    return waited


class OrderedStager:
    """A DCP stager (torch's public `AsyncStager` protocol, for `dcp.async_save`) that copies
    the state to host memory on its own thread and, on CUDA, on its own stream ordered after
    the kernels the training thread has queued so far (an event recorded at `stage`, waited on
    by the copy stream: no host synchronisation on the training thread).

    The copy is meshtron's own walk over the state (dicts, lists, tuples, tensors, DTensors;
    other leaves deep-copied) into host buffers kept from one save to the next (pinned on
    CUDA), not torch's `DefaultStager`: on torch 2.11 (the H200 image) that stager failed on
    CUDA with `KeyError: <class 'type'>` inside its private deep copy, on the first
    checkpoint of every `meshtron train --checkpoint-every` run. Built from public tensor API
    only, it behaves the same on every torch meshtron supports. Buffers are reused because the
    checkpointer keeps one save in flight (it waits for the previous one before the next).

    `streams`: the device's stream API (`torch.cuda` on CUDA, None on the CPU, where copies
    need no ordering); injectable so the ordering is tested on a CPU machine.
    `staging_thread` False: copy on the calling thread inside `stage` (bench/checkpoint_save.py
    compares). `host_empty(shape, dtype)`: the allocator of the host buffers (default:
    page-locked when `streams` is given and CUDA is available, else pageable); injectable so
    that the page-locked path (allocated once per leaf, reused by later saves) runs on a CPU
    machine, whose torch has no page-locked allocator."""

    # dcp.async_save must not wait for the copy: the next optimizer step does (wait_staging).
    _synchronize_after_execute = False

    def __init__(self, staging_thread: bool = True, streams: Any = None, host_empty: Any = None):
        import torch

        self._streams = streams
        if host_empty is None:
            pin = streams is not None and torch.cuda.is_available()

            def host_empty(shape, dtype):
                return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
        self._host_empty = host_empty
        self._staging_thread = staging_thread
        self._executor = None
        self._buffers: dict[tuple, Any] = {}
        """Host copies by their path in the state, reused by the next save of the same shape."""
        # Made on the training thread, after its default stream exists.
        self._stream = streams.Stream() if streams is not None and staging_thread else None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        """A Future of the host copy of `state_dict` (the copy itself without a thread)."""
        if not self._staging_thread:
            return self._copy_tree(state_dict, ())  # in order on the current stream
        if self._executor is None:  # first save, or after a close() (see close)
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="meshtron-stage")
        ready = None
        if self._stream is not None:
            ready = self._streams.Event()
            ready.record(self._streams.current_stream())
        return self._executor.submit(self._copy, state_dict, ready)

    def _copy(self, state_dict: Any, ready: Any) -> Any:
        if ready is None:
            return self._copy_tree(state_dict, ())
        self._stream.wait_event(ready)
        with self._streams.stream(self._stream):
            return self._copy_tree(state_dict, ())

    def _copy_tree(self, obj: Any, path: tuple) -> Any:
        import copy

        import torch
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            local = self._host(path, obj.to_local())
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._host(path, obj)
        if isinstance(obj, dict):
            return {k: self._copy_tree(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy_tree(v, (*path, i)) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return items
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)

    def _host(self, path: tuple, tensor: Any) -> Any:
        """`tensor`'s value in this path's host buffer. A blocking copy: on CUDA it waits for
        the copy stream only (a non-blocking one would need a device-wide sync after)."""
        buf = self._buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self._host_empty(tensor.shape, tensor.dtype)
            self._buffers[path] = buf
        buf.copy_(tensor.detach())
        return buf

    def synchronize_staging(self) -> None:
        """Nothing: callers wait on the Future `stage` returned (AsyncSaveResponse)."""

    def close(self) -> None:
        """Release the thread and the host buffers. Not final: a later `stage` starts again,
        because some torch releases' `dcp.async_save` closes the stager it was given after each
        save (newer ones leave a caller's stager to the caller)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._buffers.clear()


def device_streams() -> Any:
    """The stream API staging copies are ordered with: `torch.cuda` when CUDA is available."""
    import torch

    return torch.cuda if torch.cuda.is_available() else None
