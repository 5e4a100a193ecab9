"""Where the unpriced time of a profiler window goes: the idle gaps between consecutive kernels
on the compute stream (the N largest, each with the kernels around it, the host operator that
launched the kernel after it and how far ahead of it that launch came), a histogram of gap
lengths (launch-bound idle shows as many small gaps, host syncs as a few large ones), and the
achieved TFLOP/s of the GEMMs per distinct shape (the launching operator's input shapes).

The analysis works on plain `Rec`s, so a unit test can hand it a synthetic timeline;
gpukit/events.py reads them from a profiler window (its raw Kineto events or its Chrome trace).
On CPU (dry run) there are no kernels: the same analysis
runs on the leaf operators of the busiest host thread, the enclosing operator standing in for
the launcher and each launched as it starts (launch lead 0), so every field is exercised.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

BINS = (("lt_10us", 10.0), ("10_100us", 100.0), ("100us_1ms", 1000.0), ("ge_1ms", float("inf")))
"""Gap-length histogram bins (upper bounds, microseconds)."""
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


@dataclasses.dataclass(frozen=True)
class Rec:
    """One profiler event. kind: "kernel" (device), "runtime" (a host runtime call such as
    cudaLaunchKernel) or "op" (a host operator or annotation). lane: the stream of a kernel,
    the thread of a host event. Times in microseconds."""

    name: str
    kind: str
    start: float
    end: float
    lane: int = 0
    corr: int = 0
    linked: int = 0
    shapes: tuple = ()


def _plain(x: Any) -> Any:
    return [_plain(v) for v in x] if isinstance(x, tuple) else x


def _busiest(recs: Iterable[Rec], by_count: bool = False) -> int | None:
    """The lane with the most time (or, `by_count`, the most events: the compute stream
    launches by far the most kernels, a communication stream runs a few long ones)."""
    total: dict[int, float] = {}
    for r in recs:
        total[r.lane] = total.get(r.lane, 0.0) + (1 if by_count else r.end - r.start)
    return max(total, key=total.get) if total else None


def _innermost(ops: list[Rec]) -> dict[int, Rec | None]:
    """id(op) -> the operator that encloses it most closely on its thread (ops sorted by start,
    ties: the longer first)."""
    parent: dict[int, Rec | None] = {}
    stack: list[Rec] = []
    for op in ops:
        if stack and stack[-1].lane != op.lane:
            stack = []  # another thread: nothing of the last one encloses it
        while stack and stack[-1].end <= op.start:
            stack.pop()
        parent[id(op)] = stack[-1] if stack else None
        stack.append(op)
    return parent


def _host_stack(ops: list[Rec], t: float, lane: int, depth: int = 4) -> list[str]:
    """The host operators running on thread `lane` at time `t`, outermost first (the deepest
    `depth`): what the host was doing when the device ran dry."""
    around = [o for o in ops if o.lane == lane and o.start <= t < o.end]
    return [o.name[:80] for o in sorted(around, key=lambda o: (o.start, -o.end))][-depth:]


def _overlap(recs: Iterable[Rec], lo: float, hi: float) -> float:
    return sum(max(0.0, min(r.end, hi) - max(r.start, lo)) for r in recs)


def timeline_of(recs: list[Rec]):
    """(source, lane, units, launcher-of, lead-of, ops): the units whose gaps are measured
    (kernels of the stream that ran the most; on CPU the leaf operators of the busiest
    thread), the operator that launched each, and how long before its start it was
    launched."""
    ops = sorted((r for r in recs if r.kind == "op"), key=lambda r: (r.lane, r.start, -r.end))
    kernels = [r for r in recs if r.kind == "kernel"]
    if kernels:
        lane = _busiest(kernels, by_count=True)
        units = sorted((k for k in kernels if k.lane == lane), key=lambda r: r.start)
        by_corr = {o.corr: o for o in ops if o.corr}
        calls = {r.corr: r for r in recs if r.kind == "runtime" and r.corr}
        launcher = {id(k): by_corr.get(k.linked) for k in units}
        lead = {id(k): (k.start - calls[k.corr].start if k.corr in calls else None)
                for k in units}
        return "cuda kernels", lane, units, launcher, lead, ops
    parent = _innermost(ops)
    has_child = {id(p) for p in parent.values() if p is not None}
    lane = _busiest(o for o in ops if id(o) not in has_child)
    units = sorted((o for o in ops if o.lane == lane and id(o) not in has_child),
                   key=lambda r: r.start)
    # a CPU operator starts when its thread issues it: launch lead 0 (the host is the device)
    return ("cpu leaf ops (dry run)", lane, units, {id(u): parent[id(u)] for u in units},
            {id(u): 0.0 for u in units}, ops)


def gap_list(units: list[Rec]) -> list[tuple[float, Rec, Rec]]:
    """(length, unit before, unit after) of every idle gap between `units` (sorted by start;
    a unit overlapping a longer one before it closes no gap)."""
    found, last = [], units[0]
    for u in units[1:]:
        if u.start > last.end:
            found.append((u.start - last.end, last, u))
        if u.end > last.end:
            last = u
    return found


def gaps(recs: list[Rec], top: int = 10) -> dict[str, Any]:
    """The idle gaps between consecutive units of the compute stream (module docstring)."""
    source, lane, units, launcher, lead, ops = timeline_of(recs)
    if not units:
        return {"source": source, "units": 0, "reason": "no kernels or operators in the window"}
    others = [r for r in recs if r.kind == "kernel" and r.lane != lane]
    t0, found = units[0].start, gap_list(units)
    hist = {name: {"count": 0, "us": 0.0} for name, _ in BINS}
    by_launcher: dict[str, list] = {}
    for length, _, after in found:
        name = next(n for n, hi in BINS if length < hi)
        hist[name]["count"] += 1
        hist[name]["us"] += length
        op = launcher[id(after)]
        row = by_launcher.setdefault(op.name if op else "?", [0, 0.0])
        row[0] += 1
        row[1] += length
    largest = []
    for length, before, after in sorted(found, key=lambda g: -g[0])[:top]:
        op = launcher[id(after)]
        largest.append({
            "start_us": before.end - t0, "us": length, "before": before.name[:120],
            "after": after.name[:120], "launcher": op.name[:120] if op else None,
            "launcher_shapes": _plain(op.shapes) if op and op.shapes else None,
            # small: the host launched the kernel just in time (host-bound); large: it waited
            # on the device (another stream, an event) although launched long before
            "launch_lead_us": lead[id(after)],
            "host_at_gap_start": _host_stack(ops, before.end, op.lane if op else after.lane),
            "other_streams_busy_us": _overlap(others, before.end, after.start)})
    busy = sum(u.end - u.start for u in units)
    return {"source": source, "lane": lane, "units": len(units),
            "span_us": max(u.end for u in units) - t0, "busy_us": busy,
            "gaps": len(found), "idle_in_gaps_us": sum(g[0] for g in found),
            "histogram": hist, "largest": largest,
            "by_launcher": [{"launcher": k[:120], "gaps": v[0], "us": v[1]} for k, v in
                            sorted(by_launcher.items(), key=lambda kv: -kv[1][1])[:top]]}


def gemm_flops(op: str, shapes: Iterable) -> tuple[float, list[int]] | None:
    """(FLOPs, [batch, m, n, k]) of one call of a GEMM operator from its input shapes, or None
    for an operator or shape this does not know."""
    s = [list(x) for x in shapes]
    try:
        if op in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = s[0], s[1]
            b = 1
        elif op == "aten::addmm":
            (m, k), (_, n) = s[1], s[2]
            b = 1
        elif op == "aten::bmm":
            (b, m, k), (_, _, n) = s[0], s[1]
        elif op == "aten::baddbmm":
            (b, m, k), (_, _, n) = s[1], s[2]
        else:
            return None
    except (IndexError, ValueError, TypeError):
        return None
    return 2.0 * b * m * n * k, [b, m, n, k]


def gemm_shapes(recs: list[Rec], is_gemm: Callable[[str], bool],
                top: int = 12) -> dict[str, Any]:
    """Per distinct (operator, input shapes) of the GEMMs: calls, kernels (those `is_gemm`
    by name: a GEMM operator may also launch a copy or a split-K reduction), device
    microseconds (on CPU: the operator's own span) and achieved TFLOP/s, most time first (the
    `top`); `total`: every GEMM of the window together."""
    ops = {o.corr: o for o in recs if o.kind == "op" and o.name in GEMM_OPS and o.corr}
    kernels = [r for r in recs if r.kind == "kernel"]
    acc: dict[tuple, dict[str, Any]] = {}

    def add(op: Rec, us: float, kernel: str | None, call: bool) -> None:
        key = (op.name, op.shapes)
        row = acc.setdefault(key, {"op": op.name, "shapes": _plain(op.shapes),
                                   "calls": 0, "kernels": 0, "us": 0.0, "kernel_names": {}})
        row["calls"] += call
        row["us"] += us
        if kernel is not None:
            row["kernels"] += 1
            row["kernel_names"][kernel] = row["kernel_names"].get(kernel, 0.0) + us

    if kernels:
        seen: set[int] = set()
        for k in kernels:
            op = ops.get(k.linked)
            if op is not None and is_gemm(k.name):
                add(op, k.end - k.start, k.name, k.linked not in seen)
                seen.add(k.linked)
    else:
        for op in ops.values():
            add(op, op.end - op.start, None, True)
    rows, total = [], {"calls": 0, "us": 0.0, "flops": 0.0, "us_unknown_shape": 0.0}
    for row in sorted(acc.values(), key=lambda r: -r["us"]):
        got = gemm_flops(row["op"], row["shapes"])
        names = row.pop("kernel_names")
        row["kernel"] = max(names, key=names.get)[:120] if names else None
        row["bmnk"] = got[1] if got else None
        row["tflops"] = got[0] * row["calls"] / (row["us"] * 1e6) if got and row["us"] else None
        total["calls"] += row["calls"]
        total["us" if got else "us_unknown_shape"] += row["us"]
        total["flops"] += got[0] * row["calls"] if got else 0.0
        rows.append(row)
    total["tflops"] = total["flops"] / (total["us"] * 1e6) if total["us"] else None
    return {"source": "cuda kernels" if kernels else "cpu ops (dry run)", "total": total,
            "distinct_shapes": len(rows), "rows": rows[:top]}


def share_over(recs: list[Rec], keep: Callable[[str], bool],
               edges_us: list[float]) -> list[float | None]:
    """For each interval between consecutive `edges_us` (the profiler's clock), the share of it
    that kernels whose name `keep` covered: the GEMM load a clock sample saw, to tell a clock
    that drops as GEMMs fill the window (power) from one that does not."""
    ks = sorted((r.start, r.end) for r in recs if r.kind == "kernel" and keep(r.name))
    out: list[float | None] = []
    first = 0
    for lo, hi in zip(edges_us, edges_us[1:]):
        while first < len(ks) and ks[first][1] <= lo:
            first += 1
        covered, i = 0.0, first
        while i < len(ks) and ks[i][0] < hi:
            covered += max(0.0, min(ks[i][1], hi) - max(ks[i][0], lo))
            i += 1
        out.append(covered / (hi - lo) if hi > lo else None)
    return out
