"""The checkpoint stager (issue 31, item 3): it used to read DefaultStager's private
`_staging_stream` and silently skip the stream wait when the attribute was absent, so a staged
copy could race the last optimizer step's kernels. `OrderedStager` uses public API only and
orders its copies itself; the CUDA stream calls are injected here and recorded in order."""

from __future__ import annotations

import threading

import torch

from meshtron.checkpoint.staging import OrderedStager


class RecordingStreams:
    """The slice of `torch.cuda`'s stream API the stager uses, recording each call with the
    thread it came from (CPU tensors are copied for real)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.main = "compute"

    def _log(self, what):
        self.calls.append((what, threading.current_thread().name))

    def current_stream(self):
        return self.main

    def Stream(self):
        streams = self

        class S:
            def wait_event(self, event):
                streams._log(f"wait {event.recorded_on}")

        self._log("new stream")
        return S()

    def Event(self):
        streams = self

        class E:
            recorded_on = None

            def record(self, stream):
                self.recorded_on = stream
                streams._log(f"record on {stream}")

        return E()

    def stream(self, s):
        streams = self

        class Ctx:
            def __enter__(self):
                streams._log("enter copy stream")

            def __exit__(self, *exc):
                streams._log("leave copy stream")

        return Ctx()


def _state():
    return {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": torch.tensor(3)}


def test_staged_copy_is_a_snapshot_taken_off_the_training_thread():
    stager = OrderedStager(staging_thread=True, streams=None)
    state = _state()
    try:
        staged = stager.stage(state).result(timeout=60)
        state["model"]["w"].add_(100.0)  # the next optimizer step writes in place
        assert torch.equal(staged["model"]["w"], torch.arange(12.0).reshape(3, 4))
        assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
        assert not stager.should_synchronize_after_execute
    finally:
        stager.close()


def test_copies_wait_for_the_compute_stream_before_copying():
    streams = RecordingStreams()
    stager = OrderedStager(staging_thread=True, streams=streams)
    main = threading.current_thread().name
    try:
        future = stager.stage(_state())
        # Recorded on the training thread, on its current stream, before stage returns.
        assert streams.calls[:2] == [("new stream", main), ("record on compute", main)]
        staged = future.result(timeout=60)
    finally:
        stager.close()
    worker = [(what, thread) for what, thread in streams.calls[2:]]
    assert [w for w, _ in worker] == ["wait compute", "enter copy stream", "leave copy stream"]
    assert all(thread != main for _, thread in worker)
    assert torch.equal(staged["model"]["w"], _state()["model"]["w"])


def test_without_a_thread_the_copy_is_in_order_on_the_caller():
    stager = OrderedStager(staging_thread=False, streams=None)
    try:
        staged = stager.stage(_state())  # a state dict, not a Future
        assert torch.equal(staged["model"]["w"], _state()["model"]["w"])
    finally:
        stager.close()


def test_checkpointer_uses_no_private_stager_attribute():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "meshtron" / "checkpoint"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "_staging_stream":
                raise AssertionError(f"{path.name}:{node.lineno} reads _staging_stream")


def test_a_closed_stager_stages_again_and_keeps_every_leaf():
    """Some torch releases' dcp.async_save close the stager they were given after each save;
    the next checkpoint must still stage. Non-tensor leaves (ints, strings, classes, named
    tuples) come through (torch 2.11's DefaultStager raised KeyError: <class 'type'> in its
    deep copy on CUDA, on the H200)."""
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    stager = OrderedStager(staging_thread=True, streams=None)
    state = {"w": torch.ones(3), "meta": {"kind": torch.Tensor, "name": "x", "n": 2},
             "pair": Pair(torch.zeros(2), 5), "items": [torch.arange(3), None]}
    try:
        first = stager.stage(state).result(timeout=60)
        stager.close()
        state["w"].add_(1.0)
        second = stager.stage(state).result(timeout=60)
    finally:
        stager.close()
    assert torch.equal(first["w"], torch.ones(3)) and torch.equal(second["w"], torch.full((3,), 2.0))
    assert second["meta"] == {"kind": torch.Tensor, "name": "x", "n": 2}
    assert isinstance(second["pair"], Pair) and second["pair"].b == 5
    assert torch.equal(second["items"][0], torch.arange(3)) and second["items"][1] is None


def test_page_locked_buffers_are_made_once_and_reused():
    """The CUDA path's host buffers (page-locked there), run on CPU with the allocator
    injected beside the stream API: one buffer per tensor leaf at the first save, the same
    buffers at the next save of the same shapes (no allocation per checkpoint), a new one
    only where a shape changed; each save's values are its own state's."""
    made = []

    def host_empty(shape, dtype):
        made.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    stager = OrderedStager(staging_thread=True, streams=RecordingStreams(), host_empty=host_empty)
    state = _state()
    try:
        first = stager.stage(state).result(timeout=60)
        assert sorted(made) == [((), torch.int64), ((3, 4), torch.float32)]
        state["model"]["w"].add_(1.0)
        second = stager.stage(state).result(timeout=60)
        assert len(made) == 2 and second["model"]["w"] is first["model"]["w"]
        assert torch.equal(second["model"]["w"], torch.arange(12.0).reshape(3, 4) + 1)
        state["model"]["w"] = torch.zeros(2, 2)
        third = stager.stage(state).result(timeout=60)
        assert made[2:] == [((2, 2), torch.float32)] and torch.equal(third["step"], torch.tensor(3))
    finally:
        stager.close()
