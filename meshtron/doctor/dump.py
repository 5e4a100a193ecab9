"""What a rank writes to RUN_DIR/trace/: its hello file (who and where it is, written at start,
so that a rank that later dies or freezes without dumping is still known), and its dump
(rank_N.json: recorder, Python stacks of all threads, step times, peers' process states).

Format "meshtron-trace/1"; `meshtron doctor` reads it (`meshtron/diagnose/analyze.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

FORMAT = "meshtron-trace/1"
ABORT_FILE = "ABORT.json"
FIRST_STEP_FLOOR_S = 120.0
"""The watchdog's least allowance before a rank's first step (joining the process group,
building the model, the first step's compilation): max(4 x its timeout, this)."""


def clear_trace(run_dir: Path) -> None:
    """Remove an earlier run's trace (a stale ABORT.json would stop the new run at once), its
    restarted attempts' folders (trace/attempt_N) included."""
    tdir = Path(run_dir) / "trace"
    if tdir.is_dir():
        for path in tdir.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)
            elif path.is_dir() and path.name.startswith("attempt_"):
                shutil.rmtree(path, ignore_errors=True)


def dump_path(trace_dir: Path, rank: int) -> Path:
    return trace_dir / f"rank_{rank}.json"


def hello_path(trace_dir: Path, rank: int) -> Path:
    return trace_dir / f"rank_{rank}.hello.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, default=str))
        os.replace(tmp, path)
    except OSError:  # a full disk: no partial file left to take the space or be read
        tmp.unlink(missing_ok=True)
        raise


def write_hello(trace_dir: Path, rank: int, world_size: int) -> None:
    write_json_atomic(hello_path(trace_dir, rank), {
        "format": FORMAT, "rank": rank, "world_size": world_size, "pid": os.getpid(),
        "host": socket.gethostname(), "start_t": time.time()})


def note_in_hello(trace_dir: Path, rank: int, **fields: Any) -> None:
    """Add `fields` to this rank's hello file (how it ended, when it leaves without a dump)."""
    path = hello_path(trace_dir, rank)
    try:
        hello = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    write_json_atomic(path, {**hello, **fields})


def thread_stacks() -> list[dict[str, Any]]:
    """Every thread's Python stack (innermost frame last, as tracebacks print)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name,
                   "code": (f.line or "").strip()} for f in traceback.extract_stack(frame)]
        out.append({"thread": names.get(ident, str(ident)), "main": ident == main_id,
                    "frames": frames})
    out.sort(key=lambda t: not t["main"])
    return out


def run_queue_wait_s(tid: int) -> float | None:
    """Seconds this process's thread `tid` (threading.get_native_id()) has spent runnable but
    waiting for a CPU (another thread had it), since it started; None without Linux
    schedstats (`schedstat_s`)."""
    stat = schedstat_s(tid)
    return stat[1] if stat else None


def schedstat_s(tid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of this process's thread `tid`
    since it started; None without Linux schedstats. The first two fields of
    /proc/self/task/TID/schedstat, in nanoseconds (Linux Documentation/scheduler/
    sched-stats.rst, "/proc/<pid>/schedstat": time on the cpu, time waiting on a runqueue,
    timeslices run). A stopped (SIGSTOP) or sleeping thread is not runnable: that time is not
    counted."""
    try:
        fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


TRANSPORT_THREADS = ("pt_gloo", "gloo_")
"""Name prefixes (/proc/self/task/TID/comm) of the threads that carry gloo's collectives:
ProcessGroupGloo's workers ("pt_gloo_runloop", named by torch) and gloo's TCP event loop
("gloo_tcp_loop"), as torch 2.13 names them; beside them and the training thread, a rank's
threads that ran were the doctor's own (measured, /proc/self/task/*/comm)."""


CHECKPOINT_THREADS = ("meshtron-ckpt", "meshtron-stage", "meshtron-snapshot", "AsyncCheckpoint")
"""Name prefixes (Python thread names: `TransportThreads._name`) of the threads that write
checkpoints in the background: the checkpointer's commit ("meshtron-ckpt"), its staging copy
and in-memory snapshots (checkpoint/checkpointer.py, staging.py, snapshot.py) and torch DCP's
`async_save` executor ("AsyncCheckpointExecutor",
torch/distributed/checkpoint/_async_thread_executor.py).
Their work is the run's: rank 0's is the larger (it alone commits the metadata)."""


class _EndedThreads:
    """The CPU time of the threads that ended between two readings, whole: the process's CPU
    time (CLOCK_PROCESS_CPUTIME_ID, which keeps an ended thread's time) less its live
    threads' (one clock read each) is what every ended thread used; its growth since the last
    reading is what the threads that ended since used, whole lives. A thread's own clock
    cannot be read once it ended, so its last reading misses what it did after it: a
    checkpoint's commit thread that starts as a step starts and ends before the step's beat
    was counted 0 s, and its CPU time, 0.05 s in a healthy 2-rank run's step, was taken for
    the rank's own (docs/measurements.md#straggler-ended-threads)."""

    def __init__(self) -> None:
        self._tids: set[int] = set()
        self._dead = 0.0

    def since_last(self, tids: set[int], counted: set[int]) -> float | None:
        """Seconds the threads that ended since the last call used, whole lives; None on the
        first call or when one of them was not a `counted` thread (its time is not ours to
        give). A thread that started and ended between two calls is never listed: its time
        is in the sum too (a checkpoint's own helper threads, in meshtron's loop)."""
        total = 0.0
        for tid in tids:
            try:
                total += time.clock_gettime((~tid << 3) | 6)
            except OSError:  # ended since the listing: the process's clock still has it
                pass
        dead = time.process_time() - total
        gone, first = self._tids - tids, not self._tids
        grew, self._dead, self._tids = dead - self._dead, dead, tids
        if first or any(t not in counted for t in gone):
            return None
        return max(0.0, grew)


class TransportThreads:
    """CPU time of this process's collective-transport threads (`TRANSPORT_THREADS`) so far.
    Why apart from the other threads: their work is the collectives', the same on every rank,
    and grows on a rank whose peers are late (measured: 4.0% of the span outside the training
    thread's waits on the healthy peer of a rank SIGSTOPped 20% of the time, 0.6% on the
    stopped rank), so it is no evidence that the rank held the step up (diagnose/straggler.py).
    A thread is named once, when first seen (gloo names its threads as they start, at group
    creation, before the first step); one that ended keeps the CPU time last read."""

    def __init__(self, prefixes: tuple[str, ...] = TRANSPORT_THREADS,
                 short_lived: bool = False) -> None:
        self._prefixes = prefixes
        """Which threads are counted (`TRANSPORT_THREADS`; `CHECKPOINT_THREADS` alike)."""
        self._clocks: dict[int, int] = {}  # tid -> its CPU-time clock
        self._last: dict[int, float] = {}
        self._ended = 0.0
        self._not_transport: set[str] = set()
        self._dead = _EndedThreads() if short_lived else None
        """Threads that end between two readings (`_EndedThreads`): a checkpoint's commit
        thread starts as the step starts and ends before the step's beat."""

    def cpu_s(self) -> float | None:
        """Seconds; None without Linux /proc. One directory read (60 us on a loaded 2-core
        host, less than one schedstat read) and one 2 us clock read per transport thread."""
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return None
        for tid in tids:
            if tid not in self._not_transport and int(tid) not in self._clocks:
                self._name(tid)
        ended, counted = [], set(self._clocks)
        for tid, clock in list(self._clocks.items()):
            try:
                self._last[tid] = time.clock_gettime(clock)
            except OSError:  # the thread ended
                ended.append(self._last.pop(tid, 0.0))
                del self._clocks[tid]
        live = {int(t) for t in tids}
        final = self._dead.since_last(live, counted) if self._dead else None
        # The ended threads' CPU time: all of it when only counted threads ended since the
        # last reading (`_EndedThreads`), else what was last read of each.
        self._ended += final if final is not None and ended else sum(ended)
        self._not_transport &= {str(t) for t in live}
        return self._ended + sum(self._last.values())

    def _name(self, tid: str) -> None:
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text()
        except OSError:
            return
        # Python names its threads in `threading` only (3.11-3.13 set no comm): the name of
        # the Python thread of this id too (ThreadPoolExecutor's thread_name_prefix).
        py_name = next((t.name for t in threading.enumerate() if t.native_id == int(tid)), "")
        if name.startswith(self._prefixes) or py_name.startswith(self._prefixes):
            # The thread's CPU-time clock: Linux's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)
            # (include/linux/posix-timers_types.h; glibc's pthread_getcpuclockid builds the
            # same id), read with clock_gettime as time.thread_time reads the caller's.
            self._clocks[int(tid)] = (~int(tid) << 3) | 6
        else:
            self._not_transport.add(tid)


def process_state(pid: int) -> str:
    """'running', 'stopped' (SIGSTOP, a debugger), 'gone' (exited or a zombie) or 'unknown'
    (another host, no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "unknown"
    state = text.rsplit(")", 1)[-1].split()[0]
    if state in ("T", "t"):
        return "stopped"
    if state in ("Z", "X"):
        return "gone"
    return "running"


def peer_states(trace_dir: Path, world_size: int, rank: int) -> dict[str, dict[str, Any]]:
    """Each other rank's process as seen from here (same host only), from its hello file."""
    host = socket.gethostname()
    out = {}
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            hello = json.loads(hello_path(trace_dir, peer).read_text())
        except (OSError, ValueError):
            out[str(peer)] = {"state": "never_started"}
            continue
        state = process_state(hello["pid"]) if hello.get("host") == host else "unknown"
        out[str(peer)] = {"state": state, "pid": hello.get("pid"), "host": hello.get("host"),
                          "dumped": dump_path(trace_dir, peer).exists()}
    return out


def flight_recorder_trace() -> dict[str, Any] | None:
    """PyTorch's Flight Recorder trace on NCCL (real start/end states and times); None on other
    backends, where it records too little to add anything (shared notes)."""
    try:
        from meshtron.backend import group_is_nccl

        if not group_is_nccl():
            return None
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    except Exception as exc:  # noqa: BLE001 - a dump must never fail because of it
        return {"error": f"{type(exc).__name__}: {exc}"}
