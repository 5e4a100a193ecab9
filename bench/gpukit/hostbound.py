"""Whose fault is the idle between kernels: was the host late, or did the device wait on
something else? (issue 31: the first H200 run showed 26-46 ms of idle per micro-batch of the
eager dense step that no host sync explains.)

For every idle gap of the compute stream (timeline.gap_list), the launch call of the kernel
after it either came AFTER the gap started (the host was late: it was still issuing, or blocked
in a call such as cudaFree / cudaMalloc, which synchronise the device) or before it (the kernel
was queued in time and waited on something else: another stream, an event, a copy engine).
Summed over the window, per micro-batch, with what the launching thread was doing when each
late gap began (the innermost host event then: an operator or a runtime call such as cudaFree;
none means Python or the autograd engine between operators). A kernel whose launch call the
trace lacks is late when the operator that launched it began after the gap did, else `unknown`;
when unknown idle is most of it, the verdict says it cannot decide.

Beside it, per step: the host's issue time (the window's first host operator to the last
kernel launch) against the GPU's busy time (the union of every stream's kernels), the number
of kernels and host operators per micro-batch, and the runtime calls that allocate, free or
synchronise (cudaMalloc, cudaFree, cuMemMap, cudaStreamSynchronize, ...: counts and time).

Works on timeline `Rec`s (unit tests hand it synthetic ones). On CPU (dry run) the leaf
operators of the busiest thread stand in for kernels, each launched as it starts (lead 0):
every gap is host time there, as it is.
"""

from __future__ import annotations

import bisect
from typing import Any

from gpukit.events import is_call
from gpukit.timeline import Rec, gap_list, timeline_of

ALLOC_CALLS = ("cudaMalloc", "cudaFree", "cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemRelease",
               "cuMemSetAccess", "cuMemAddressReserve", "cuMemAddressFree", "cudaMallocAsync",
               "cudaFreeAsync")
"""Device memory calls: the caching allocator's cudaMalloc / cudaFree (a cudaFree, and the
cache flush after a failed cudaMalloc, synchronise the device) and expandable segments'
cuMem* driver calls. Kineto records CUDA runtime calls but a blocklist (cudaGetDevice,
cudaEventRecord, cudaEventSynchronize, ...) and, of the driver calls, only those it registers
(the kernel launches: its CuptiActivityProfiler::handleDriverActivity), so the cuMem* rows are
normally absent: under expandable segments the allocator's counters (allocator.py,
num_device_alloc / num_device_free) are the record."""
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpy2D", "cudaMemset", "cudaStreamQuery", "cudaEventQuery")
"""Runtime calls that wait for the device (cudaMemcpy / cudaMemset without Async do too), and
the polls that do not but show a host asking."""
BETWEEN_OPS = "(between operators: Python, autograd engine)"
TOP = 8


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals, sorted."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in _merged(intervals))


class _Coverage:
    """How much of [lo, hi) a set of intervals covers, in O(log n) per question (a window has
    thousands of gaps and of other streams' kernels)."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.iv = _merged(intervals)
        self.starts = [s for s, _ in self.iv]
        self.before = [0.0]  # covered length of the intervals before index i
        for s, e in self.iv:
            self.before.append(self.before[-1] + e - s)

    def _upto(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t)
        if i == 0:
            return 0.0
        s, e = self.iv[i - 1]
        return self.before[i - 1] + min(e, t) - s

    def __call__(self, lo: float, hi: float) -> float:
        return max(0.0, self._upto(hi) - self._upto(lo))


def _calls(recs: list[Rec]) -> dict[int, Rec]:
    """corr -> the runtime call (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync) that
    enqueued the device event of that correlation id."""
    return {r.corr: r for r in recs if r.kind == "runtime" and r.corr}


def _innermost_at(events: list[Rec], times: list[tuple[float, int]]) -> dict[int, str]:
    """For each (t, thread) query, the name of the innermost host event running on that thread
    at t (events nest on one thread: a sweep in time order keeps the open ones on a stack, the
    top is the innermost); the query's index -> name (absent: nothing ran then)."""
    by_lane: dict[int, list[Rec]] = {}
    for e in events:
        by_lane.setdefault(e.lane, []).append(e)
    asked: dict[int, list[tuple[float, int]]] = {}
    for i, (t, lane) in enumerate(times):
        asked.setdefault(lane, []).append((t, i))
    out: dict[int, str] = {}
    for lane, queries in asked.items():
        evs = sorted(by_lane.get(lane, []), key=lambda e: (e.start, -e.end))
        stack: list[Rec] = []
        j = 0
        for t, i in sorted(queries):
            while j < len(evs) and evs[j].start <= t:
                while stack and stack[-1].end <= evs[j].start:
                    stack.pop()
                stack.append(evs[j])
                j += 1
            while stack and stack[-1].end <= t:
                stack.pop()
            if stack:
                out[i] = stack[-1].name[:80]
    return out


def _runtime_table(recs: list[Rec], per: float) -> dict[str, Any]:
    """The allocating and synchronising runtime calls of the window, by name: count and
    microseconds (any recorded kind: a call made outside an operator carries no link)."""
    rows: dict[str, list] = {}
    for r in recs:
        if r.kind == "kernel" or not is_call(r.name):
            continue
        base = r.name.split("_v")[0]  # cudaMalloc_v2 style suffixes of driver calls
        if base in ALLOC_CALLS or base in SYNC_CALLS:
            row = rows.setdefault(base, [0, 0.0])
            row[0] += 1
            row[1] += r.end - r.start
    table = {k: {"calls": v[0], "us": v[1]} for k, v in sorted(rows.items(),
                                                                  key=lambda kv: -kv[1][1])}
    alloc = [v for k, v in table.items() if k in ALLOC_CALLS]
    return {"calls": table,
            "alloc_calls_per_micro_batch": sum(v["calls"] for v in alloc) / per,
            "alloc_us_per_micro_batch": sum(v["us"] for v in alloc) / per,
            "sync_calls_per_micro_batch": sum(v["calls"] for k, v in table.items()
                                              if k in SYNC_CALLS) / per}


def analyse(recs: list[Rec], steps: int = 1, micro_batches: int = 1) -> dict[str, Any]:
    """The window's idle split into host-late and device-waiting, per micro-batch (`steps`
    steps of `micro_batches` each in the window), and the host's issue time per step against
    the GPU's busy time (module docstring)."""
    per = max(1, steps) * max(1, micro_batches)
    source, lane, units, launcher, lead, ops = timeline_of(recs)
    if not units:
        return {"source": source, "reason": "no kernels or operators in the window"}
    calls = _calls(recs)
    kernels = [r for r in recs if r.kind == "kernel"] or units
    others = _Coverage([(r.start, r.end) for r in recs if r.kind == "kernel" and r.lane != lane])
    late_us = early_us = unknown_us = 0.0
    early_other = 0.0
    late_n = early_n = unknown_n = 0
    queries: list[tuple[float, int]] = []
    late_len: list[float] = []
    for length, before, after in gap_list(units):
        lt = lead[id(after)]
        op = launcher[id(after)]
        if lt is None and op is not None and after.start - op.start < length:
            # no launch call recorded, but the operator that launched it began after the gap
            # did: the launch, inside it, was late whatever its exact time
            lt = after.start - op.start
        if lt is None:
            unknown_us, unknown_n = unknown_us + length, unknown_n + 1
        elif lt < length:  # the launch came after the gap began
            late_us, late_n = late_us + length, late_n + 1
            call = calls.get(after.corr)
            # the thread that launched it: its call's, else its operator's (never the stream)
            queries.append((before.end, call.lane if call else op.lane if op else after.lane))
            late_len.append(length)
        else:
            early_us, early_n = early_us + length, early_n + 1
            early_other += others(before.end, after.start)
    host = [r for r in recs if r.kind != "kernel"]
    doing = _innermost_at(host, queries)
    by_host: dict[str, list] = {}
    for i, length in enumerate(late_len):
        row = by_host.setdefault(doing.get(i, BETWEEN_OPS), [0, 0.0])
        row[0] += 1
        row[1] += length
    idle = late_us + early_us + unknown_us
    launches = [calls[k.corr].start for k in kernels if k.corr in calls] if calls else \
        [u.start for u in units]
    t_host0 = min((o.start for o in ops), default=units[0].start)
    issue = (max(launches) - t_host0) / max(1, steps) if launches else None
    busy = _union([(k.start, k.end) for k in kernels]) / max(1, steps)
    out = {
        "source": source, "micro_batches_in_window": per,
        "idle_us_per_micro_batch": idle / per,
        "host_late_us_per_micro_batch": late_us / per,
        "device_wait_us_per_micro_batch": early_us / per,
        "unknown_us_per_micro_batch": unknown_us / per,
        "gaps": {"host_late": late_n, "device_wait": early_n, "unknown": unknown_n},
        "host_late_share": late_us / idle if idle else None,
        # of the device-waiting idle, how much another stream (communication, a copy
        # engine) was running: the rest waited on an event or a host-device handshake
        "device_wait_other_streams_us_per_micro_batch": early_other / per,
        "late_by_host": [{"host": k, "gaps": v[0], "us_per_micro_batch": v[1] / per}
                         for k, v in sorted(by_host.items(), key=lambda kv: -kv[1][1])[:TOP]],
        "host_issue_us_per_step": issue, "gpu_busy_us_per_step": busy,
        "host_issue_over_gpu_busy": issue / busy if issue is not None and busy else None,
        "kernels_per_micro_batch": len(kernels) / per,
        # a runtime call made outside any operator has no link: recorded as an "op"
        "host_ops_per_micro_batch": sum(not is_call(o.name) for o in ops) / per,
        "runtime": _runtime_table(recs, per)}
    out["verdict"] = verdict(out)
    return out


def verdict(h: dict[str, Any]) -> str:
    """One line: how much of the idle had the host late, and what it was doing then."""
    if "idle_us_per_micro_batch" not in h:
        return f"no verdict: {h.get('reason') or h.get('error') or 'no analysis'}"
    late, idle = h["host_late_us_per_micro_batch"], h["idle_us_per_micro_batch"]
    share = h["host_late_share"]
    kind = "host-bound" if share is not None and share >= 0.5 else "not host-bound"
    if h["unknown_us_per_micro_batch"] > idle / 2:  # this torch's trace did not link launches
        kind = "undecided (most gaps' launch unrecorded)"
    line = (f"{kind}: {late / 1e3:.2f} ms of {idle / 1e3:.2f} ms idle per micro-batch had the "
            f"host late")
    if h["late_by_host"]:
        top = h["late_by_host"][0]
        line += f" (most in {top['host']}: {top['us_per_micro_batch'] / 1e3:.2f} ms)"
    if h["host_issue_over_gpu_busy"] is not None:
        line += (f"; host issued a step in {h['host_issue_us_per_step'] / 1e3:.1f} ms for "
                 f"{h['gpu_busy_us_per_step'] / 1e3:.1f} ms of device work")
    return line
