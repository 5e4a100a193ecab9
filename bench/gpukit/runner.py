"""How the driver (bench/gpu_check.py) runs cases: each in its own process with its own time
cap, alone or, for a group of consecutive cases whose figures do not need the GPU to
themselves (the CLI smoke, the device checks, the CPU tests), at the same time.

Why groups: on the H200 every case process paid ~7 s of torch import and CUDA start-up and
every `meshtron` command as much again (bench/results/gpu_check_h200_2026-12-04.json: env 8 s
for a 0.1 s matmul loop, `meshtron train --model debug` 15 s for 2.6 s of training), so the
smoke's ten processes in a row cost ~250 s of a 480 s budget; side by side they cost about the
longest of them. The throughput, memory and checkpoint cases stay alone: their figures are
timings.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

GRACE_S = 20.0  # SIGTERM to SIGKILL: a CLI case stops its torchrun ranks in between
TERM_GRACE_S = 8.0
"""The kit itself told to stop (the device call's own time limit sends SIGTERM): the running
case gets this long to record what it measured (a CLI case stops its command in 5 s)."""
CONTENTION = 1.5
"""A group's expected wall time over its longest member's alone (processes importing torch
side by side on one node; `expected_wall`)."""


class Interrupted(Exception):
    """SIGTERM to the kit: record the running cases as interrupted, write the JSON, stop."""


@dataclasses.dataclass
class Running:
    """A case process started by `start`."""

    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    tail: collections.deque
    case_out: Path
    t0: float
    deadline: float
    cap: float
    cpu_s: float = 0.0
    """CPU seconds of the case and every process it waited for (`_reaped`)."""
    stopped: str = "ended"
    """How it ended: "timeout" once stopped at its deadline (`finish`'s status)."""


def _pump(stream, name: str, log: Path, tail: collections.deque,
          say: Callable[[str], None]) -> None:
    """Copy the case's output to our stdout (prefixed, flushed) and to its log file."""
    with open(log, "w") as f:
        for line in stream:
            f.write(line)
            f.flush()
            tail.append(line.rstrip("\n"))
            say(f"  [{name}] {line.rstrip()}")


def children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _reaped(run: Running, reap: Callable[[], object]) -> object:
    """`reap()` (which waits for `run`'s process), noting the CPU seconds it added to this
    process's children's: the case's own and every process it waited for, side by side with
    others or not (a child's time is added when it is reaped, one at a time here). On a
    shared machine the wall time follows the load, this does not."""
    c0 = children_cpu_s()
    got = reap()
    run.cpu_s += children_cpu_s() - c0
    return got


def start(name: str, argv: list[str], env: dict, work: Path, logs: Path, case_out: Path,
          cap: float, say: Callable[[str], None]) -> Running:
    """Start case `name`'s process (`argv`), its output pumped to `say` and its log."""
    tail: collections.deque = collections.deque(maxlen=40)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=work, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, name, logs / f"{name}.log", tail,
                                                say), daemon=True)
    pump.start()
    return Running(name, proc, pump, tail, case_out, t0, t0 + cap, cap)


def finish(run: Running, status: str, reason: str | None = None) -> dict:
    """The record of a case whose process has ended (`status`: ok/error from its exit code
    unless timeout or interrupted)."""
    rec: dict = {"cap_s": round(run.cap, 1), "exit_code": run.proc.returncode}
    rec["status"] = status if status in ("timeout", "interrupted") else (
        "ok" if run.proc.returncode == 0 else "error")
    if reason:
        rec["reason"] = reason
    run.pump.join(timeout=5)
    rec["seconds"] = round(time.perf_counter() - run.t0, 2)
    rec["cpu_s"] = round(run.cpu_s, 2)
    try:
        rec["result"] = json.loads(run.case_out.read_text())
    except (OSError, ValueError):
        rec["result"] = {}
    if rec["status"] == "ok" and "skipped" in rec["result"]:
        rec.update(status="skipped", reason=rec["result"]["skipped"])
    if rec["status"] != "ok":
        rec["output_tail"] = list(run.tail)[-25:]
    return rec


def wait_all(runs: list[Running], done: Callable[[Running, dict], None]) -> None:
    """Wait for every run, each stopped at its own deadline; `done(run, record)` as each
    ends (in the order they end). Runs overdue together are stopped together (`stop_all`):
    one grace for a group cut at the budget's end, not one per member. A run leaves `left`
    only once its record is made, so SIGTERM to the kit (Interrupted) while one is being
    recorded still records it (`interrupt`: as it ended); those still running are stopped
    and recorded as interrupted, then it re-raises."""
    left = list(runs)
    try:
        while left:
            ended = [r for r in left if _reaped(r, r.proc.poll) is not None]
            now = time.perf_counter()
            overdue = [r for r in left if r not in ended and now >= r.deadline]
            for run in overdue:
                run.stopped = "timeout"
            stop_all(overdue, GRACE_S, 10.0)
            for run in ended + overdue:
                rec = finish(run, run.stopped)
                left.remove(run)
                done(run, rec)
            if left:
                time.sleep(0.1)
    except Interrupted as exc:
        interrupt(left, exc, done)
        raise


def _signal_group(run: Running, sig: int) -> None:
    try:
        os.killpg(run.proc.pid, sig)  # its own session (`start`): the case and its children
    except ProcessLookupError:
        pass


def stop_all(runs: list[Running], grace_s: float, kill_wait_s: float) -> None:
    """Stop `runs` at once: SIGTERM to every one's process group, SIGKILL to those still
    running `grace_s` seconds later, then at most `kill_wait_s` more for them; each reaped
    on its own (`_reaped`: its CPU seconds). common.stop_group one after another would cost
    a grace per run (a CLI case takes ~5 s to stop its command, a hung one the whole 20 s)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        live = [r for r in runs if r.proc.returncode is None]
        for run in live:
            _signal_group(run, sig)
        until = time.perf_counter() + wait
        for run in live:
            try:
                _reaped(run, lambda run=run: run.proc.wait(
                    timeout=max(0.0, until - time.perf_counter())))
            except subprocess.TimeoutExpired:
                continue


def interrupt(runs: list[Running], exc: Exception, done: Callable[[Running, dict], None]) -> None:
    """SIGTERM to the kit while `runs` ran: stop those still running, all at once (each
    records what it has on SIGTERM; the device call's limit leaves only seconds), and
    `done(run, record)` with each, as interrupted, or as it ended where it had ended."""
    running = [r for r in runs if _reaped(r, r.proc.poll) is None]
    stop_all(running, TERM_GRACE_S, 3.0)
    for run in runs:
        done(run, finish(run, "interrupted", f"the kit was stopped ({exc}) while this case ran")
             if run in running else finish(run, run.stopped))


def batches(rows: list) -> list[list]:
    """`rows` (CASES rows: .group) cut into what runs at once: a group's consecutive rows
    together, every other row alone."""
    out: list[list] = []
    for row in rows:
        if out and row.group is not None and out[-1][-1].group == row.group:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def expected_wall(rows: list) -> float:
    """Seconds `rows` are expected to take on the GPU (rows' `expected`): alone, the sum;
    a group, its longest member times CONTENTION."""
    return sum(b[0].expected if len(b) == 1 else CONTENTION * max(r.expected for r in b)
               for b in batches(rows))
