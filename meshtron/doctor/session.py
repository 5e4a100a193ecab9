"""One rank's doctor: the collective recorder, the watchdog and the dumps.

    session = DoctorSession(trace_dir, rank, world_size, watchdog_timeout_s=60).start()
    session.watch_mesh(mesh)          # name groups by their mesh axis
    ... session.beat(step) after every step ...
    session.close()                   # a last dump (step times, for stragglers), then off

Dumps (`dump.py`) go to TRACE_DIR/rank_N.json on: a watchdog timeout (this rank's or another
rank's), an exception (`dump_exception`), SIGTERM, SIGUSR1, and `dump()` on demand. A SIGTERM
while a peer's process is gone (torchrun stopping the survivors of a failure; `end_on_teardown`)
dumps and ends the rank at once: no checkpoint can be taken without that peer.

Signals: a rank hung in a collective sits in C++ with the GIL released, where Python never runs
its signal handlers. So the handlers installed here only chain to the handler that was there
before (e.g. a preemption checkpoint handler); the dump itself is done by the watcher thread,
woken through `signal.set_wakeup_fd`, which the C-level handler writes immediately (also when a
handler installed later replaced ours). A SIGTERM that had the default action, and still has
ours, keeps its meaning: after the dump the process exits with 128+15.

Watchdog: progress is a finished step or a collective issued. With none for `timeout` seconds
(`first_step_timeout` to join the process group when started `joining`, and again before
the first step: start-up, compilation, first all-gathers), the
rank announces the timeout out of band, never through the possibly hung process groups: a file
TRACE_DIR/ABORT.json (and, when there is one, a key in the job's c10d store, polled by a thread
of its own so that a frozen store host cannot block the watchdog). Every rank's watcher polls
for it, dumps, waits up to `GRACE_S` for the others' dumps, and exits with `EXIT_WATCHDOG`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from meshtron.doctor import dump as dumpfile
from meshtron.doctor.recorder import CollectiveRecorder

EXIT_WATCHDOG = 3
GRACE_S = 5.0
POLL_S = 0.2
STORE_KEY = "meshtron/doctor/abort"
STEP_TIMES_KEPT = 500


def _recorder(rank: int, capacity: int, backend: str | None = None):
    """On NCCL PyTorch's Flight Recorder (nothing in Python per collective; flight.py);
    elsewhere meshtron's recorder (gloo's Flight Recorder has no times, states or p2p), which
    records what the recording process groups run (backend.py: `runtime.init_rank(record=True)`
    makes a CPU rank's groups recording ones; on plain gloo groups it records nothing).
    `backend`: the default group's backend string (asked from torch when None)."""
    from meshtron.backend import group_is_nccl

    if group_is_nccl(backend=backend):
        from meshtron.doctor.flight import FlightRecorderSource

        return FlightRecorderSource(rank)
    return CollectiveRecorder(rank, capacity)


RUN_WORK_FIELDS = ("seconds", "run_queue_s", "other_threads_cpu_s", "cpu_s", "blocked_s",
                   "transport_cpu_s", "checkpoint_threads_cpu_s")
"""`run_work`'s totals, in `_readings`' order (a beat's fields; "seconds": the wall time)."""


class DoctorSession:
    """See the module docstring. `recorder=False` keeps the watchdog and dumps without
    recording collectives. `timeline`: also time the main thread's waits and write
    timeline_rank_N.json at the end (timeline.py; needs the recorder)."""

    def __init__(self, trace_dir: Path | str, rank: int, world_size: int,
                 watchdog_timeout_s: float | None = None,
                 first_step_timeout_s: float | None = None, capacity: int = 2000,
                 recorder: bool = True, exit_on_timeout: bool = True, timeline: bool = True):
        self.trace_dir = Path(trace_dir)
        self.rank, self.world_size = rank, world_size
        self.timeout_s = watchdog_timeout_s
        self.first_step_timeout_s = first_step_timeout_s or (
            max(4 * watchdog_timeout_s, dumpfile.FIRST_STEP_FLOOR_S) if watchdog_timeout_s
            else None)
        self.exit_on_timeout = exit_on_timeout
        self.recorder = None  # made by `joined()`: on NCCL it reads the process group
        self._record, self._capacity = recorder, capacity
        self.joined_t: float | None = None
        """When this rank's process group was ready (None while it joins: `start(joining=True)`)."""
        self.mesh: dict[str, Any] | None = None
        self.step = 0
        self.step_times: collections.deque = collections.deque(maxlen=STEP_TIMES_KEPT)
        self.run_work = dict.fromkeys(RUN_WORK_FIELDS, 0.0)
        """Totals over the times between a step's beat and the next step's start (`step_starts`):
        the loop's logging, evaluation and checkpoints, work the run gives the rank (rank 0
        alone writes the records and commits a checkpoint's metadata), not a straggler's stall:
        the seconds and the beat's readings' growth in them."""
        self._beat_readings: tuple | None = None
        self._transport = dumpfile.TransportThreads()
        self._writers = dumpfile.TransportThreads(dumpfile.CHECKPOINT_THREADS, short_lived=True)
        self.exception: str | None = None
        self._exception_reason: str | None = None
        self.timed_out: dict[str, Any] | None = None
        self._started_t = self._last_progress = self._last_step_t = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store_abort = threading.Event()
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._installed = False
        self._dumps: list[dict[str, Any]] = []
        self.timeline = timeline and recorder
        self._timeline = None
        self.on_fatal: Callable[[str, str], None] | None = None
        """Called with (one line of cause, kind: "watchdog" or "teardown") before this session
        ends the process: the trainer leaves it for the restarted attempt's `restart` record
        (meshtron/checkpoint/restart.py)."""
        self.end_on_teardown = False
        """A SIGTERM while a peer's process is gone is torchrun stopping the survivors of a
        failure: dump and end at once (`_torn_down`). Off where ranks outlive peers by design
        (elastic rounds, replica groups); `meshtron train` turns it on for fixed worlds."""

    # -- life cycle ----------------------------------------------------------------------------
    def start(self, joining: bool = False) -> "DoctorSession":
        """`joining`: started before the process group exists (hello file, signal handlers and
        watchdog cover the rendezvous, where a rank that never comes hangs the others); call
        `joined()` once it exists."""
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        dumpfile.write_hello(self.trace_dir, self.rank, self.world_size)
        if not joining:
            self.joined()
        self._install_signals()
        self._thread = threading.Thread(target=self._watch, name="meshtron-doctor",
                                        daemon=True)
        self._thread.start()
        if self.timeout_s:
            threading.Thread(target=self._poll_store, name="meshtron-doctor-store",
                             daemon=True).start()
        return self

    def joined(self) -> None:
        """The process group exists: record its collectives; the first step's watchdog limit
        counts from here (joining had one of its own)."""
        if self.joined_t is not None:
            return
        if self._record:
            self.recorder = _recorder(self.rank, self._capacity)
            self.recorder.install()
            self._installed = True
            if self.timeline:
                from meshtron.doctor.timeline import TimelineCapture

                self._timeline = TimelineCapture(self.recorder).install()
        self.joined_t = self._last_progress = time.time()

    def close(self, final_dump: bool = True) -> None:
        """Stop watching; `final_dump`: write the end-of-run dump (step times and the last
        collectives, which `meshtron doctor` uses to find stragglers)."""
        if final_dump:
            self.dump("exit")
            self._write_timeline()
        if self._timeline is not None:
            self._timeline.uninstall()
            self._timeline = None
        self._stop.set()
        self._wake_watcher()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S + 1.0)
        if self._installed and self.recorder is not None:
            self.recorder.uninstall()
            self._installed = False
        self._restore_signals()

    def __enter__(self) -> "DoctorSession":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.dump_exception(exc)
        self.close(final_dump=exc is None)

    # -- what the trainer tells it -------------------------------------------------------------
    def watch_mesh(self, mesh, extra: dict[str, Any] | None = None) -> None:
        """Name the mesh's process groups by axis in the records, and keep the mesh's rank grid
        (every rank's coordinates, for ranks that cannot dump). `extra`: more named submeshes
        (e.g. a flattened data axis)."""
        names = list(mesh.mesh_dim_names or [])
        self.mesh = {"axes": names, "grid": mesh.mesh.tolist()}
        subs = {name: mesh[name] for name in names}
        subs.update(extra or {})
        if self.recorder is None:
            return
        for name, sub in subs.items():
            self.recorder.name_axis(sub.get_group(), name)

    def beat(self, step: int) -> None:
        """A step finished (the watchdog's progress signal; per-rank step times)."""
        readings = self._readings()
        now = readings[0]
        self.step_times.append((step, now, now - self._last_step_t, *readings[1:],
                                dict(self.run_work)))
        self._last_step_t = self._last_progress = now
        self._beat_readings = readings
        self.step = step

    def _readings(self) -> tuple:
        """(time, run-queue wait, other threads' CPU, CPU, blocked, transport threads' CPU,
        checkpoint writer threads' CPU): `RUN_WORK_FIELDS`' order.

        The training thread's CPU time and run-queue wait so far (one /proc read), the CPU
        time of the process's other threads, and the seconds the training thread has been
        blocked in waits on collectives (the recorder's counter): `meshtron doctor` tells a
        rank the host's CPU load slowed (waiting for a core other processes held) from one
        that stalled (stopped, sleeping outside the collectives) or starved itself
        (diagnose/straggler.py). One /proc read, two /proc listings and a clock read per
        thread (the writers' `_EndedThreads`: 25 threads, +0.11 ms a reading, measured on a
        loaded 2-core host: 0.2 ms a step, two readings);
        no device sync."""
        now = time.time()
        sched = dumpfile.schedstat_s(threading.get_native_id())
        cpu, wait = sched if sched else (None, None)
        others = time.process_time() - cpu if sched else None
        blocked = getattr(self.recorder, "blocked_s", None)
        # Of the other threads' CPU time, gloo's transport threads' (blocked is None on NCCL,
        # whose ranks the rule times without these readings: not read there).
        transport = self._transport.cpu_s() if sched and blocked is not None else None
        writers = self._writers.cpu_s() if transport is not None else None
        return now, wait, others, cpu, blocked, transport, writers

    def step_starts(self) -> None:
        """The loop starts a step: what this rank did since the last beat (logging, evaluation,
        a checkpoint) was the run's work, added to `run_work` (straggler.py keeps it out of the
        rank's own time). The same readings as a beat."""
        if self._beat_readings is None:
            return
        now = self._readings()
        for key, a, b in zip(RUN_WORK_FIELDS, self._beat_readings, now):
            if key in self.run_work:
                if a is None or b is None:
                    del self.run_work[key]  # a reading missing once: the total is unknown
                else:
                    self.run_work[key] += b - a
        self._beat_readings = None

    def _progress(self) -> None:
        self._last_progress = time.time()

    # -- dumps ---------------------------------------------------------------------------------
    def dump_exception(self, exc: BaseException, cause: str | None = None) -> Path | None:
        """Dump for `exc`; `cause` ('Type: message') names what it wraps when the caller knows
        better than its type (DCP's CheckpointException around each rank's OSError)."""
        import traceback

        if self.timed_out is not None:  # the hang's dump says more than its aftermath
            return dumpfile.dump_path(self.trace_dir, self.rank)
        self.exception = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._exception_reason = f"exception: {cause or f'{type(exc).__name__}: {exc}'}"
        return self.dump(self._exception_reason)

    def dump(self, reason: str) -> Path | None:
        """Write TRACE_DIR/rank_N.json now (any thread); returns its path, or None when it could
        not be written (one line on stderr). Never raises OSError: a dump is written on the
        failure path, often onto the disk that failed (a full run folder), and its own error
        must not replace the failure it records (rank.py classifies that after dumping)."""
        try:
            return self._write_dump(reason)
        except OSError as exc:
            print(f"[rank {self.rank}] could not write the doctor's trace to {self.trace_dir} "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            return None

    def _write_dump(self, reason: str) -> Path:
        with self._lock:
            doc = {
                "format": dumpfile.FORMAT, "rank": self.rank, "world_size": self.world_size,
                "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
                "time": time.time(), "step": self.step, "joined_t": self.joined_t,
                "last_progress_t": self._progress_t(),
                "watchdog": {"timeout_s": self.timeout_s,
                             "first_step_timeout_s": self.first_step_timeout_s,
                             "fired": self.timed_out},
                "exception": self.exception,
                "earlier_dumps": list(self._dumps),
                "mesh": self.mesh,
                "groups": self.recorder.group_table() if self.recorder else {},
                "records": self.recorder.snapshot() if self.recorder else [],
                "step_times": [{"step": s, "end_t": t, "seconds": d, "run_queue_s": q,
                                "other_threads_cpu_s": o, "cpu_s": c, "blocked_s": b,
                                "transport_cpu_s": g, "checkpoint_threads_cpu_s": k,
                                "run_work": w}
                               for s, t, d, q, o, c, b, g, k, w in list(self.step_times)],
                "stacks": dumpfile.thread_stacks(),
                "peers": dumpfile.peer_states(self.trace_dir, self.world_size, self.rank),
            }
            fr = dumpfile.flight_recorder_trace()
            if fr is not None:
                doc["flight_recorder"] = fr
            path = dumpfile.dump_path(self.trace_dir, self.rank)
            dumpfile.write_json_atomic(path, doc)
            self._dumps.append({"reason": reason, "time": doc["time"]})
            return path

    def _write_timeline(self) -> None:
        """TRACE_DIR/timeline_rank_N.json at the end of a run (`meshtron doctor --timeline`)."""
        if self._timeline is None:
            return
        from meshtron.doctor.timeline import timeline_path

        doc = self._timeline.document(self)
        if doc is not None:
            dumpfile.write_json_atomic(timeline_path(self.trace_dir, self.rank), doc)

    # -- signals -------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        try:
            old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:
            r.close()
            w.close()
            return
        if old != -1:  # someone else's wakeup fd (an event loop): leave theirs in place
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        self._wakeup = (r, w)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._chain)

    def _chain(self, signum, frame) -> None:
        """Main-thread part of a signal: only the previous Python handler (the watcher thread
        dumps)."""
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._wakeup is None:
            return
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._chain:
                signal.signal(sig, handler)
        signal.set_wakeup_fd(-1)
        for s in self._wakeup:
            s.close()
        self._wakeup = None

    def _signals_received(self) -> list[int]:
        if self._wakeup is None:
            return []
        try:
            data = self._wakeup[0].recv(64)
        except (BlockingIOError, OSError):
            return []
        return [signum for signum in data if signum]  # 0: `_wake_watcher`, no signal

    def _wake_watcher(self) -> None:
        """End the watcher's wait now, not at its next poll: `close` joins the thread, and every
        rank's exit waited up to POLL_S for it (a zero byte on the wakeup socket, which no signal
        writes; without one the watcher waits on `_stop`)."""
        if self._wakeup is not None:
            # OSError: full (signals pending: it wakes anyway) or closed
            with contextlib.suppress(OSError):
                self._wakeup[1].send(b"\0")

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum not in (signal.SIGTERM, signal.SIGUSR1):
            return
        gone = self.peers_gone() if signum == signal.SIGTERM and self.end_on_teardown else []
        if gone:
            self._torn_down(gone)
        # A SIGTERM after this rank raised is the launcher stopping it afterwards (after the
        # rank's own storage-error stop too): the dump keeps the exception as its reason (a
        # SIGTERM dump over it read as a preemption of every rank). Written again, not
        # skipped: the exception's own dump may still be in progress on the main thread (the
        # lock waits for it) when this exits the process.
        again = signum == signal.SIGTERM and self._exception_reason is not None
        path = self.dump(self._exception_reason if again else name)
        if signum == signal.SIGUSR1 and path is not None:  # the stacks are in the dump
            print(f"[rank {self.rank}] SIGUSR1: trace written to {path}", file=sys.stderr,
                  flush=True)
        elif (self._previous.get(signum) == signal.SIG_DFL
              and signal.getsignal(signum) == self._chain):
            # Nobody else handles SIGTERM (a handler installed after ours, e.g. a graceful
            # preemption checkpoint, replaces _chain and then owns the exit): keep SIGTERM's
            # default meaning, ending the process, now that the trace is written.
            print(f"[rank {self.rank}] SIGTERM: trace written to {self.trace_dir}",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def peers_gone(self) -> list[int]:
        """The other ranks whose processes have ended (same host, from their hello files)."""
        peers = dumpfile.peer_states(self.trace_dir, self.world_size, self.rank)
        return sorted(int(r) for r, p in peers.items() if p["state"] == "gone")

    def _torn_down(self, gone: list[int]) -> None:
        """SIGTERM while a peer's process is gone: torchrun stopping the ranks after one failed,
        not a preemption. No checkpoint can be taken (its collectives need the peer): dump,
        say so, and end now (128+15, SIGTERM's default meaning)."""
        who = ", ".join(map(str, gone))
        cause = f"stopped by SIGTERM after rank {who} ended (torchrun stopping the ranks)"
        self.dump(f"SIGTERM: {cause}")
        self._fatal(cause, "teardown")
        print(f"meshtron train (rank {self.rank}): SIGTERM after rank {who} ended: no "
              "checkpoint can be taken (a peer is gone); stopping", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    def _fatal(self, cause: str, kind: str) -> None:
        if self.on_fatal is not None:
            try:
                self.on_fatal(cause, kind)
            except OSError:
                # The note is a file written for the next attempt (`meshtron train`'s callback:
                # checkpoint/restart.py note_failure): a full disk or a removed run folder must
                # not stop the exit that follows. Anything else is a bug in the callback and
                # shows with its traceback instead of being swallowed.
                pass

    # -- the watcher thread --------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._wakeup is not None:
                try:
                    select.select([self._wakeup[0]], [], [], POLL_S)
                except (OSError, ValueError):  # closed by close(): we are done
                    return
                for signum in self._signals_received():
                    self._on_signal(signum)
            elif self._stop.wait(POLL_S):
                return
            if self._stop.is_set() or not self.timeout_s:
                continue
            other = self._abort_announced()
            if other is not None:
                self._fire(other)
            elif time.time() - self._progress_t() > self._limit():
                self._fire(self._announce())

    def _progress_t(self) -> float:
        """Wall time of the latest progress: a step, or a collective issued (the recorder
        keeps that time itself; no call per collective)."""
        rec = self.recorder
        last = rec.last_issue_t if rec is not None else 0.0
        return max(self._last_progress, rec.wall(last) if last else 0.0)

    def _limit(self) -> float:
        return self.timeout_s if self.step > 0 else self.first_step_timeout_s

    def _announce(self) -> dict[str, Any]:
        """Tell every rank, out of band, that this one saw no progress."""
        info = {"rank": self.rank, "step": self.step, "time": time.time(),
                "limit_s": self._limit(), "idle_s": time.time() - self._progress_t()}
        path = self.trace_dir / dumpfile.ABORT_FILE
        try:  # the first rank to time out is the one named
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
        except FileExistsError:
            pass
        threading.Thread(target=self._store_set, args=(json.dumps(info),), daemon=True).start()
        return info

    def _abort_announced(self) -> dict[str, Any] | None:
        path = self.trace_dir / dumpfile.ABORT_FILE
        if path.exists():
            try:
                info = json.loads(path.read_text())
            except ValueError:  # being written: read it at the next poll
                return None
            # An earlier run's file (a run folder reused outside `meshtron train --nproc`,
            # which clears it): every rank starts before any rank can time out.
            if info.get("time", 0) >= self._started_t:
                return info
        if self._store_abort.is_set():
            return {"rank": None, "via": "store"}
        return None

    def _fire(self, info: dict[str, Any]) -> None:
        self.timed_out = info
        who = "this rank" if info.get("rank") == self.rank else f"rank {info.get('rank')}"
        self.dump(f"watchdog: {who} saw no progress for {info.get('limit_s')} s")
        self._fatal(self._watchdog_cause(info), "watchdog")
        if not self.exit_on_timeout:
            self._stop.set()
            return
        deadline = time.time() + GRACE_S
        while time.time() < deadline and not self._all_dumped():
            time.sleep(POLL_S)
        run_dir = self.trace_dir.parent if self.trace_dir.name == "trace" else self.trace_dir
        print(f"meshtron train (rank {self.rank}): watchdog: no progress for "
              f"{info.get('limit_s')} s (first seen by {who}); trace written to "
              f"{self.trace_dir}; run `meshtron doctor {run_dir}`",
              file=sys.stderr, flush=True)
        os._exit(EXIT_WATCHDOG)

    def _watchdog_cause(self, info: dict[str, Any]) -> str:
        """'watchdog abort: no progress for 8.0 s at step 23 (seen by rank 0); rank 1 frozen
        (its process is stopped)': the abort and the peers that could not dump."""
        text = (f"watchdog abort: no progress for {info.get('limit_s')} s at step "
                f"{info.get('step', self.step)} (seen by rank {info.get('rank')})")
        peers = dumpfile.peer_states(self.trace_dir, self.world_size, self.rank)
        states = {"stopped": "frozen (its process is stopped, e.g. SIGSTOP)",
                  "gone": "gone (its process ended)"}
        for r, p in sorted(peers.items(), key=lambda kv: int(kv[0])):
            if p["state"] in states:
                text += f"; rank {r} {states[p['state']]}"
        return text

    def _all_dumped(self) -> bool:
        """Every rank has dumped, or cannot (its process is gone or stopped)."""
        peers = dumpfile.peer_states(self.trace_dir, self.world_size, self.rank)
        return all(p.get("dumped") or p["state"] in ("gone", "stopped", "never_started")
                   for p in peers.values())

    # -- the store channel ---------------------------------------------------------------------
    def _default_store(self):
        try:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store() if dist.is_initialized() else None
        except (RuntimeError, ValueError):
            return None

    def _store_set(self, value: str) -> None:
        store = self._default_store()
        if store is not None:
            try:
                store.set(STORE_KEY, value)
            except Exception:  # noqa: BLE001 - the file channel still works
                pass

    def _poll_store(self) -> None:
        while not self._stop.wait(1.0):
            store = self._default_store()
            if store is None:
                continue
            try:
                if store.check([STORE_KEY]):
                    self._store_abort.set()
                    return
            except Exception:  # noqa: BLE001 - a store that went away: the file still works
                return
