"""A profiler window's events as timeline `Rec`s, on the torch a GPU image carries (2.11-2.13).

`records` reads the `Rec`s of gpukit/timeline.py from a finished `torch.profiler.profile`
through the raw Kineto events (`prof.profiler.kineto_results.events()`): a device kernel's
`linked_correlation_id()` is the `correlation_id()` of the CPU operator that launched it (what
torch's own `_parse_kineto_results` joins on), and the runtime call (cudaLaunchKernel) carries
the kernel's own `correlation_id()`. Two id spaces meet there: operators count their own ids
and CUPTI counts its, both from small numbers, so a CUDA call is told from an operator by its
link or its name (cudaDeviceSynchronize outside any operator has no link), and only operators'
ids name launchers; a linked call is put on its operator's thread, as torch's parser does.
What torch's parser drops is dropped (`is_hidden_event` where the event has it, the
record_function plumbing). `from_trace` reads the same from the Chrome trace the profiler
exports (profile.py falls back to it when the raw events cannot be read): "External id" links
a kernel to its operator, "correlation" (or the "ac2g" flow) to its launch call, whether
cudaLaunchKernel, cudaLaunchKernelExC (cuBLAS) or cuLaunchKernel (triton, a driver call).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from gpukit.timeline import Rec

HIDDEN_OPS = frozenset(("profiler::_record_function_enter", "profiler::_record_function_enter_new",
                        "profiler::_record_function_exit", "[memory]", "[OutOfMemory]"))
"""Utility events torch's own `_parse_kineto_results` drops (its `_filter_name`): the
record_function plumbing would otherwise stand in as leaf operators."""
HOST_CALLS = frozenset(("cuda_runtime", "cuda_driver"))
"""Chrome-trace categories of the host's CUDA calls."""
DEVICE_SKIP = frozenset(("gpu_user_annotation", "cuda_sync", "cuda_profiler_range"))
"""Device-timeline activity types that are no kernel: annotation ranges spanning the kernels
they launched, and CUDA sync records (kineto's optional `enable_cuda_sync_events`)."""


def records(prof) -> list[Rec] | None:
    """The window's events as `Rec`s, or None where this torch's profiler does not expose the
    raw Kineto events (feature-detected, never assumed)."""
    res = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if res is None or not hasattr(res, "events"):
        return None
    return from_kineto(res.events())


def from_kineto(events: Iterable) -> list[Rec]:
    """`Rec`s of raw `_KinetoEvent`s (or objects with their methods: a test injects them);
    a method this torch's event lacks reads as its default."""
    from torch.autograd import DeviceType

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    out = []
    for e in events:
        name = e.name()
        if name in HIDDEN_OPS or _call(e, "is_hidden_event", False):
            continue  # what torch's own parser leaves out
        dev = e.device_type()
        if dev == cuda:
            if "#" in name or _call(e, "is_user_annotation", False) or \
                    _call(e, "activity_type", None) in DEVICE_SKIP:
                continue  # annotation ranges spanning the kernels they launched
            linked = e.linked_correlation_id()
            kind, lane = "kernel", e.device_resource_id()
        elif dev == cpu:
            # a CUDA call is linked to its operator, an operator to nothing; a call made
            # outside any operator (a sync between steps) is unlinked but still a call: its
            # correlation id is CUPTI's, which would collide with an operator's id
            linked = e.linked_correlation_id()
            call = linked > 0 or is_call(name)
            kind, lane = ("runtime" if call else "op"), e.start_thread_id()
        else:
            continue
        start = e.start_ns() / 1e3
        shapes = _frozen(_call(e, "shapes", [])) if kind == "op" else ()
        out.append(Rec(name, kind, start, start + e.duration_ns() / 1e3, lane,
                       e.correlation_id(), linked, shapes))
    return _on_launcher_threads(out)


def _on_launcher_threads(recs: list[Rec]) -> list[Rec]:
    """Each linked CUDA call on its operator's thread: torch's own parser does the same
    ("make sure that 'thread' of a CPU Kineto (e.g. Device Runtime) event is associated with
    the 'thread' of the corresponding linked PyTorch event", torch/autograd/profiler.py),
    since a call's own thread id need not be the operator's (CUPTI's system thread id)."""
    lane_of = {r.corr: r.lane for r in recs if r.kind == "op" and r.corr}
    return [dataclasses.replace(r, lane=lane_of[r.linked])
            if r.kind == "runtime" and r.linked in lane_of and lane_of[r.linked] != r.lane
            else r for r in recs]


TRACE_KERNELS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
TRACE_OPS = frozenset(("cpu_op", "user_annotation", "operator"))


def from_trace(trace: dict | list) -> list[Rec]:
    """`Rec`s of a Chrome trace as `prof.export_chrome_trace` writes it (the reader when the
    raw events cannot be read): complete events ("ph": "X") by category: kernels (args
    "stream", "correlation", "External id" = the launching operator's), CUDA calls
    ("cuda_runtime" / "cuda_driver": cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernel,
    args "correlation", "External id") and operators (args "External id", "Input Dims").
    A kernel without a "correlation" arg takes it from its "ac2g" flow: the flow starts ("s")
    on the launch call and ends ("f") on the kernel, with the correlation id as its id."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    flows = {(ev.get("tid"), _us(ev.get("ts"))): ev.get("id") for ev in events
             if ev.get("ph") == "f" and ev.get("cat") == "ac2g"}
    out = []
    for ev in events:
        cat, args = str(ev.get("cat", "")).lower(), ev.get("args") or {}
        if ev.get("ph") != "X" or ev.get("name") in HIDDEN_OPS:
            continue
        start = _us(ev.get("ts"))
        rec = dict(name=ev.get("name", ""), start=start, end=start + _us(ev.get("dur")))
        ext = _int(args.get("External id"))
        if cat in TRACE_KERNELS:
            corr = _int(args.get("correlation")) or _int(flows.get((ev.get("tid"), start)))
            out.append(Rec(kind="kernel", lane=_int(args.get("stream", ev.get("tid"))),
                           corr=corr, linked=ext, **rec))
        elif cat in HOST_CALLS:
            out.append(Rec(kind="runtime", lane=_int(ev.get("tid")),
                           corr=_int(args.get("correlation")), linked=ext, **rec))
        elif cat in TRACE_OPS:
            out.append(Rec(kind="op", lane=_int(ev.get("tid")), corr=ext,
                           shapes=_frozen(args.get("Input Dims") or []), **rec))
    return _on_launcher_threads(out)


def _us(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return 0.0


def _int(x: Any) -> int:
    """An id of the trace (an int, or a thread id such as "stream 7" / a string)."""
    if isinstance(x, int):
        return x
    digits = "".join(ch for ch in str(x or "") if ch.isdigit())
    return int(digits) if digits else 0


def is_call(name: str) -> bool:
    """A CUDA runtime or driver call (cudaFree, cudaLaunchKernelExC, cuLaunchKernel), not an
    operator."""
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def _call(event, method: str, default: Any) -> Any:
    """`event.method()`, or `default` where this torch's KinetoEvent lacks the method."""
    fn = getattr(event, method, None)
    return fn() if fn is not None else default


def _frozen(x: Any) -> Any:
    """Nested lists (input shapes, tensor lists among them) as nested tuples: hashable."""
    return tuple(_frozen(v) for v in x) if isinstance(x, (list, tuple)) else x
