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
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, path)


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
