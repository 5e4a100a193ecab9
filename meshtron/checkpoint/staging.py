"""The wait for a state copy to host memory, shared by disk checkpoints
(meshtron/checkpoint/checkpointer.py) and in-memory snapshots (meshtron/heal/snapshot.py):
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
    by the copy stream: no host synchronisation on the training thread). Built only from public
    API: torch's `DefaultStager` does the copies synchronously (its cached, pinned host buffers
    are reused from one save to the next), this class supplies the thread and the ordering.

    `streams`: the device's stream API (`torch.cuda` on CUDA, None on the CPU, where copies
    need no ordering); injectable so the ordering is tested on a CPU machine.
    `staging_thread` False: copy on the calling thread inside `stage` (bench/checkpoint_save.py
    compares)."""

    # dcp.async_save must not wait for the copy: the next optimizer step does (wait_staging).
    _synchronize_after_execute = False

    def __init__(self, staging_thread: bool = True, streams: Any = None):
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._streams = streams
        pinned = streams is not None
        # Blocking copies: each waits for its own stream only (a non-blocking copy would make
        # DefaultStager synchronise the whole device afterwards).
        self._copier = DefaultStager(StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=False))
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="meshtron-stage")
                          if staging_thread else None)
        # Made on the training thread, after its default stream exists (as DefaultStager does).
        self._stream = streams.Stream() if pinned and staging_thread else None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        """A Future of the host copy of `state_dict` (the copy itself without a thread)."""
        if self._executor is None:
            return self._copier.stage(state_dict)  # in order on the current stream
        ready = None
        if self._stream is not None:
            ready = self._streams.Event()
            ready.record(self._streams.current_stream())
        return self._executor.submit(self._copy, state_dict, ready)

    def _copy(self, state_dict: Any, ready: Any) -> Any:
        if ready is None:
            return self._copier.stage(state_dict)
        self._stream.wait_event(ready)
        with self._streams.stream(self._stream):
            return self._copier.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing: callers wait on the Future `stage` returned (AsyncSaveResponse)."""

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._copier.close()


def device_streams() -> Any:
    """The stream API staging copies are ordered with: `torch.cuda` when CUDA is available."""
    import torch

    return torch.cuda if torch.cuda.is_available() else None
