"""One backend helper (issue 31, item 3): the group meshtron creates on CUDA has the backend
string "cuda:nccl,cpu:gloo", which `== "nccl"` never matched, so the doctor never used the
Flight Recorder on GPUs and async TP was refused at run time. The string is injected here, as
`dist.get_backend()` returns it on a GPU rank."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from meshtron import backend as mb

PACKAGE = Path(__file__).resolve().parents[1] / "meshtron"
GPU_GROUP = "cuda:nccl,cpu:gloo"


def test_backend_strings():
    assert mb.backend_for("cuda") == GPU_GROUP and mb.backend_for("cpu") == "gloo"
    assert mb.device_backends(GPU_GROUP) == {"cuda": "nccl", "cpu": "gloo"}
    assert mb.device_backends("cpu:gloo, cuda:nccl") == {"cuda": "nccl", "cpu": "gloo"}


@pytest.mark.parametrize("backend, nccl", [
    (GPU_GROUP, True), ("cpu:gloo,cuda:nccl", True), ("nccl", True), ("NCCL", True),
    ("gloo", False), ("cpu:gloo", False), ("cuda:gloo,cpu:gloo", False), ("mpi", False),
    (None, False)])
def test_is_nccl(backend, nccl):
    assert mb.is_nccl(backend) is nccl
    if backend is not None:
        assert mb.group_is_nccl(backend=backend) is nccl


def test_no_group_is_not_nccl():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert mb.group_backend() is None and not mb.group_is_nccl()


def test_async_tp_accepts_meshtrons_gpu_group():
    from meshtron.parallel.compile import async_tp_problem

    assert async_tp_problem("cuda", GPU_GROUP) is None
    assert async_tp_problem("cuda", "nccl") is None
    assert "backend 'gloo'" in async_tp_problem("cuda", "gloo")
    assert "device 'cpu'" in async_tp_problem("cpu", GPU_GROUP)


def test_doctor_reads_the_flight_recorder_on_meshtrons_gpu_group():
    from meshtron.doctor.flight import FlightRecorderSource
    from meshtron.doctor.recorder import CollectiveRecorder
    from meshtron.doctor.session import _recorder

    assert isinstance(_recorder(0, 16, backend=GPU_GROUP), FlightRecorderSource)
    assert isinstance(_recorder(0, 16, backend="gloo"), CollectiveRecorder)


def test_no_backend_compared_with_a_literal():
    """`dist.get_backend(...) == "nccl"` (or any literal) is the defect: ask meshtron.backend."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            calls = [s for s in sides if isinstance(s, ast.Call)
                     and isinstance(s.func, ast.Attribute) and s.func.attr == "get_backend"]
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str)
                          for s in sides)
            if calls and literal:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not problems, problems
