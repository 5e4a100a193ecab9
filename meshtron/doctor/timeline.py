"""Per-rank timelines: when each rank's main thread computed, communicated or sat idle.

Inside a rank (`TimelineCapture`, started by the doctor session with the recorder): the
recorder already keeps every collective and p2p operation with its enqueue time; the capture
adds the intervals in which the main thread is blocked waiting on communication: every wait on
a recorded collective's Work, `Work.wait()` (the torch.distributed API, FSDP2 and the pipeline
schedules wait through it) and the functional `wait_tensor` (DTensor), which the recording
process group's Work wrapper reports (backend.py). At the end of the run it
writes RUN_DIR/trace/timeline_rank_N.json: the step boundaries of a window of steady steps
(`WINDOW_STEPS` last steps, step 1 left out), those blocked intervals and the op records.

The analysis (`rank_phases`) splits each rank's window into three kinds of time:

* communication: the main thread is blocked in a wait (or inside the call of a blocking op)
  after every peer has entered the operation: transfer and reduction time;
* idle: blocked before the last peer entered. For a collective that is the latest enqueue time
  of the same (group, sequence number) over its members; for a receive, the enqueue time of the
  peer's matching send (the k-th send to us); for a send, the peer's matching receive. With
  pipeline parallelism this is the bubble: a stage waits for its neighbour's activations;
* compute: everything else (CPU time between waits, the optimizer, logging).

What gloo lets us tell apart, honestly: gloo runs collectives on its own threads and exposes
no start/end of the transfer itself, so "communication" is measured as main-thread blocking,
not wire time; communication overlapped with compute (FSDP2 prefetch) shows as compute. The
idle/communication split compares `time.time()` across processes: exact on one host, off by
the clock skew (NTP: about a millisecond) across hosts. A wait that overlaps several
outstanding operations is charged idle up to the latest peer entry among them.

On NCCL nothing runs per collective: the host does not block in `Work.wait` there (it only makes the
compute stream wait), so the blocked intervals are the GPU's instead: each collective's
[start, start + duration] from the Flight Recorder, whose duration comes from the CUDA events
ProcessGroupNCCL puts around the kernel (TORCH_NCCL_ENABLE_TIMING=1, set by `prepare_env`).
(Written as PyTorch documents it; not yet run on a GPU.) Times are kept on the monotonic clock
and turned into wall time when the document is written.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

from meshtron.intervals import merge_intervals

FORMAT = "meshtron-timeline/1"
WINDOW_STEPS = 4
MAX_WAITS = 20000


def timeline_path(trace_dir: Path, rank: int) -> Path:
    return Path(trace_dir) / f"timeline_rank_{rank}.json"


class TimelineCapture:
    """Collects the main thread's waits on collectives: the recorder's Work wrappers report
    every wait (backend.py), from Python (`Work.wait()`: the torch.distributed API, FSDP2, the
    pipeline schedules) or from C++ (the functional collectives' `wait_tensor`: DTensor)."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.waits: collections.deque = collections.deque(maxlen=MAX_WAITS)
        self._on = False

    def install(self) -> "TimelineCapture":
        if not hasattr(self.recorder, "waited"):
            return self  # NCCL (Flight Recorder source): GPU times, nothing to collect
        self.recorder.waits = self.waits
        self._on = True
        return self

    def uninstall(self) -> None:
        if self._on:
            self.recorder.waits = None
            self._on = False

    def document(self, session, window_steps: int = WINDOW_STEPS) -> dict[str, Any] | None:
        """The rank's timeline of its last `window_steps` steady steps; None without steps."""
        steps = step_spans(list(session.step_times), session._started_t)
        first = steps[0]["step"] if steps else None  # this launch's: step 1, or a resume's
        records = session.recorder.snapshot()
        oldest = min((r["enqueue_t"] for r in records), default=None)
        full = len(records) >= (session.recorder.records.maxlen or 0)
        # Steps older than the ring buffer's oldest record would look like pure compute.
        steps = [s for s in steps if not (full and oldest is not None and s["start_t"] < oldest)]
        if len(steps) > 1:  # start-up (and a resume's checkpoint load): not a steady step
            steps = [s for s in steps if s["step"] != first]
        steps = steps[-window_steps:]
        if not steps:
            return None
        t0, t1 = steps[0]["start_t"], steps[-1]["end_t"]
        wall = self.recorder.wall
        if self._on or self.waits:
            waits = [(wall(a), wall(b)) for a, b in list(self.waits)]
        else:  # Flight Recorder: the collectives' GPU intervals
            waits = [(r["start_t"], r["start_t"] + r["gpu_s"]) for r in records
                     if r.get("start_t") and r.get("gpu_s")]
        return {"format": FORMAT, "rank": session.rank, "world_size": session.world_size,
                "mesh": session.mesh, "groups": session.recorder.group_table(),
                "window": [t0, t1], "steps": steps,
                "launch_first_step": first,  # kept above only when it is the only step
                "waits": [list(w) for w in waits if w[1] >= t0 and w[0] <= t1],
                # Operations still outstanding at the window's start count too: a wait in
                # the window may be for one of them.
                "records": [r for r in records
                            if r["enqueue_t"] <= t1 and (r["end_t"] or t1) >= t0]}


def step_spans(step_times: list, first_start: float) -> list[dict[str, Any]]:
    """Beats (step, end time, seconds, run-queue wait) -> [{step, start_t, end_t}]: a step
    starts where the previous one ended (the loop's logging belongs to the step before)."""
    out, prev = [], first_start
    for step, end_t, *_ in step_times:
        out.append({"step": step, "start_t": prev, "end_t": end_t})
        prev = end_t
    return out


# ---- analysis (no torch) ----------------------------------------------------------------------

def entry_times(docs: dict[int, dict[str, Any]]) -> dict[tuple, list[float]]:
    """(group, seq) of collectives and (group, src, dst, k) of p2p pairs -> enqueue times of
    every rank's record of it (each rank's own part)."""
    out: dict[tuple, list[float]] = collections.defaultdict(list)
    for rank, doc in docs.items():
        for r in doc["records"]:
            key = op_key(rank, r)
            if key is not None:
                out[key].append(r["enqueue_t"])
    return out


def op_key(rank: int, r: dict[str, Any]) -> tuple | None:
    if r["op"] == "send":
        return ("p2p", r["group"], rank, r.get("peer"), r["seq"])
    if r["op"] == "recv":
        return ("p2p", r["group"], r.get("peer"), rank, r["seq"])
    return ("coll", r["group"], r["seq"])


def rank_phases(rank: int, doc: dict[str, Any], entries: dict[tuple, list[float]],
                group_sizes: dict[str, int]) -> dict[str, Any]:
    """Split the rank's window into compute / communication / idle segments (see module doc).
    Returns {"segments": [(kind, t0, t1)], "compute", "comm", "idle", "p2p_idle", "window"}."""
    w0, w1 = doc["window"]
    blocked = [(a, b) for a, b in doc["waits"]]
    blocked += [(r["enqueue_t"], r["start_t"]) for r in doc["records"] if r.get("start_t")]
    blocked = [(max(a, w0), min(b, w1)) for a, b in merge_intervals(blocked) if b > w0 and a < w1]
    # The last peer's entry of every op this rank had outstanding, with whether it is p2p.
    ops = []
    for r in doc["records"]:
        key = op_key(rank, r)
        times = entries.get(key, [])
        want = 2 if key[0] == "p2p" else group_sizes.get(r["group"], 1)
        if len(times) < want:  # a member's record fell out of its ring buffer: unknown
            continue
        ops.append((r["enqueue_t"], r["end_t"], max(times), key[0] == "p2p"))
    segments, totals = [], {"compute": 0.0, "comm": 0.0, "idle": 0.0, "p2p_idle": 0.0}
    cursor = w0
    for a, b in blocked:
        if a > cursor:
            segments.append(("compute", cursor, a))
        last, p2p = a, False
        for enq, end, entered, is_p2p in ops:
            if enq <= b and (end is None or end >= a) and entered > last:
                last, p2p = entered, is_p2p
        idle_end = min(b, last)
        if idle_end > a:
            segments.append(("idle", a, idle_end))
            totals["idle"] += idle_end - a
            if p2p:
                totals["p2p_idle"] += idle_end - a
        if b > idle_end:
            segments.append(("comm", max(a, idle_end), b))
            totals["comm"] += b - max(a, idle_end)
        cursor = b
    if w1 > cursor:
        segments.append(("compute", cursor, w1))
    span = w1 - w0
    totals["compute"] = span - totals["comm"] - totals["idle"]
    return {"segments": segments, "window": [w0, w1], "span": span, **totals}
