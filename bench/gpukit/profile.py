"""Where a step's GPU time goes: a short torch.profiler window, its device kernels put into
categories (GEMM, attention, element-wise, optimizer, copies, communication) and the idle
time (window wall time the device had no kernel running), so that one lent GPU tells the
next optimisation where to look.

The window also records what the categories cannot say: the SM clock and power meanwhile
(clocks.py: is a GEMM rate below the datasheet's a power-limited clock?), the idle gaps of the
compute stream with the host operator behind each (timeline.py: launch-bound or a sync?), and,
in one more step with input shapes recorded, the GEMMs' achieved TFLOP/s per shape.

On CPU (dry run) there are no device kernels: the same categories are applied to the CPU
operators' self time, the gaps are those between the leaf operators of the busiest thread, no
clock is sampled, and the JSON says so (`source`, `reason`).
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any, Callable, Iterable

CATEGORIES = ("gemm", "attention", "elementwise", "optimizer", "copies", "communication")
# First match wins, so the order matters: an NCCL kernel is communication whatever else its
# name says; a flash-attention kernel is attention although it does GEMMs inside.
_RULES = (
    ("communication", re.compile(r"nccl|c10d::|gloo|all_?reduce|all_?gather|reduce_?scatter"
                                 r"|broadcast|alltoall")),
    ("copies", re.compile(r"^memcpy|^memset|aten::copy_|aten::_to_copy|aten::to$"
                          r"|aten::contiguous|aten::clone")),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|flex")),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|_foreach_|optimizer|lamb|sgd")),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm\d\d_|_mm\b|_mm_|::mm$|::bmm$"
                        r"|::addmm$|::matmul$|scaled_mm|::linear$|triton_tem|wgmma|hgmma")),
)


def category(name: str) -> str:
    """The category of a kernel or operator name; element-wise is the rest (triton pointwise
    and reductions, norms, activations, casts inside kernels, softmax, loss)."""
    low = name.lower()
    for cat, rule in _RULES:
        if rule.search(low):
            return cat
    return "elementwise"


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) intervals (kernels on several
    streams overlap: communication under compute counts once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(rows: list[tuple[str, float, float, float]], wall_us: float,
              source: str) -> dict[str, Any]:
    """rows: (name, self_us, start_us, end_us). Per category: microseconds and share of the
    window; the top kernels; idle = wall minus the union of busy intervals."""
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, float] = {}
    for name, self_us, _, _ in rows:
        by_cat[category(name)] += self_us
        by_name[name] = by_name.get(name, 0.0) + self_us
    busy = busy_us((s, e) for _, _, s, e in rows) if source == "cuda kernels" else \
        sum(by_cat.values())
    idle = max(0.0, wall_us - busy)
    out: dict[str, Any] = {"source": source, "window_us": wall_us, "busy_us": busy,
                           "idle_us": idle, "us": {**by_cat, "idle": idle}}
    out["share"] = {k: v / wall_us for k, v in out["us"].items()} if wall_us > 0 else {}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    out["top"] = [{"name": n[:120], "us": us, "category": category(n)} for n, us in top]
    return out


def rows_of(events, cuda: bool) -> list[tuple[str, float, float, float]]:
    """(name, self_us, start_us, end_us) of the device kernels (CUDA) or CPU operators. On
    CUDA the profiler also puts record_function ranges on the device timeline (user
    annotations such as 'Optimizer.step#AdamW.step', spanning the kernels they launched):
    those are left out, or every kernel inside would count twice."""
    from torch.autograd import DeviceType

    rows = []
    for ev in events:
        on_device = ev.device_type == DeviceType.CUDA
        if on_device != cuda:
            continue
        if on_device and (getattr(ev, "is_user_annotation", False) or "#" in ev.name):
            continue
        tr = ev.time_range
        dur = float(tr.end - tr.start) if on_device else float(ev.self_cpu_time_total)
        rows.append((ev.name, dur, float(tr.start), float(tr.end)))
    return rows


def _profiled(step: Callable[[], Any], dev, steps: int, record_shapes: bool):
    """(profiler, wall microseconds, clock record, timeline records or why there are none) of
    `steps` calls of `step`, the GPU's clock sampled on a background thread meanwhile
    (gpukit/clocks.py), each sample with the share of the interval before it that GEMM kernels
    ran (`gemm_share`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpukit import clocks

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sampler, why = clocks.sampler(dev)
    if cuda:
        torch.cuda.synchronize(dev)
    with sampler or contextlib.nullcontext(), profile(activities=acts,
                                                      record_shapes=record_shapes) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(dev)
        wall_us = (time.perf_counter() - t0) * 1e6
    recs = _records(prof)
    if sampler is None:
        return prof, wall_us, clocks.unavailable(why), recs
    if isinstance(recs, list):
        _gemm_load(recs, sampler)
    return prof, wall_us, sampler.summary(), recs


def _records(prof) -> list | dict[str, Any]:
    """The window's timeline records (gpukit/timeline.py), or a record of why there are none:
    reading them on a torch the kit never ran on may fail, and that is never fatal. The raw
    Kineto events first; where this torch's profiler does not expose them, or reading them
    fails, the Chrome trace the profiler exports (the same events, documented format)."""
    from gpukit import events

    why = "this torch's profiler exposes no kineto_results"
    try:
        recs = events.records(prof)
        if recs is not None:
            return recs
    except Exception as exc:  # noqa: BLE001
        why = f"kineto_results: {type(exc).__name__}: {exc}"[:300]
    try:
        return events.from_trace(_exported(prof))
    except Exception as exc:  # noqa: BLE001
        return {"source": None, "error": f"{why}; chrome trace: {type(exc).__name__}: "
                                         f"{exc}"[:300]}


def _exported(prof) -> dict:
    """The window's Chrome trace (`export_chrome_trace`), read back."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _gemm_load(recs: list, sampler) -> None:
    """Put on each clock sample the share of the interval before it that GEMM kernels ran."""
    from gpukit import timeline

    if not sampler.samples or sampler.t0_unix_ns is None:
        return
    edges = [sampler.t0_unix_ns / 1e3 + s["t_s"] * 1e6 for s in sampler.samples]
    spans = [(r.start, r.end) for r in recs if r.kind == "kernel"]
    if not spans or edges[-1] <= min(s for s, _ in spans) or edges[0] >= max(e for _, e in
                                                                            spans):
        # the kernels' clock is not the sampler's Unix clock on this torch (or the trace's
        # times are relative): no share rather than a share of zero
        sampler.static["gemm_share"] = "not computed: the samples and kernels share no time"
        return
    for s, share in zip(sampler.samples[1:], timeline.share_over(
            recs, lambda n: category(n) == "gemm", edges)):
        s["gemm_share"] = share


def window(step: Callable[[], Any], dev, steps: int = 1, micro_batches: int = 1,
           shapes: bool = True) -> dict[str, Any]:
    """Profile `steps` calls of `step` (already warm, `micro_batches` micro-batches each) and
    summarize them: categories, the clock during the window, the idle gaps of the compute
    stream, whether the host was late for them (hostbound.py) and what the caching allocator
    did meanwhile (allocator.py); then one more step with input shapes recorded for the GEMMs'
    TFLOP/s per shape (a window of its own: recording shapes adds host time per operator,
    which would lengthen the launch-bound gaps). `shapes` False: no such step (an engine whose
    GEMM shapes another engine of the kit already measured; a step of the budget each)."""
    from gpukit import allocator, hostbound, timeline

    cuda = dev.type == "cuda"
    got: list = []
    alloc = allocator.measured(
        allocator.cuda_reader(dev),
        lambda: got.append(_profiled(step, dev, steps, record_shapes=False)),
        "dry run: CPU tensors have no caching allocator")
    prof, wall_us, clock, recs = got[0]
    recs = kernels_or_why(recs, cuda)
    rows = rows_of(prof.events(), cuda)
    if cuda and rows:  # the kernels' own span: the host's launch lead is not device idle
        wall_us = max(wall_us, max(r[3] for r in rows) - min(r[2] for r in rows))
    out = summarize(rows, wall_us, "cuda kernels" if cuda else "cpu ops (dry run)")
    if cuda and not rows:
        out["reason"] = "the profiler recorded no CUDA kernel: idle is the whole window"
    out["steps"] = steps
    out["clocks"] = clock
    out["gaps"] = _analysed(recs, timeline.gaps)
    out["micro_batches"] = micro_batches
    out["host"] = _analysed(recs, lambda r: hostbound.analyse(r, steps, micro_batches))
    out["allocator"] = alloc
    del prof, recs, got
    if not shapes:
        return out
    _, wall_us, clock, recs = _profiled(step, dev, 1, record_shapes=True)
    recs = kernels_or_why(recs, cuda)
    out["gemm_shapes"] = {"steps": 1, "window_us": wall_us, "clocks": clock, **_analysed(
        recs, lambda r: timeline.gemm_shapes(r, lambda name: category(name) == "gemm"))}
    return out


def kernels_or_why(recs: list | dict, cuda: bool) -> list | dict[str, Any]:
    """The records, unless a CUDA window recorded no kernel (CUPTI unavailable or not
    permitted in the container): the gap analyses would then fall back to the host operators
    as on a dry run and call every gap host time, a verdict about nothing."""
    if cuda and isinstance(recs, list) and not any(r.kind == "kernel" for r in recs):
        return {"source": None, "reason": "the profiler recorded no CUDA kernel (CUPTI "
                                          "unavailable or not permitted?)"}
    return recs


def _analysed(recs: list | dict, analyse: Callable[[list], dict[str, Any]]) -> dict[str, Any]:
    """`analyse` of the window's records; one that fails on a torch it was never run on is
    recorded (`error`), never fatal: the case's measurements stand."""
    if not isinstance(recs, list):
        return recs
    try:
        return analyse(recs)
    except Exception as exc:  # noqa: BLE001
        return {"source": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
