"""Real processes of a `meshtron train` run, for tests and benches that kill them.

`rank_pids(run_dir)`: {rank: pid} of the torchrun workers training into `run_dir`, read from
/proc (their environment carries the rank argv, meshtron/launch.py MESHTRON_RANK_ARGV, which
names the run folder, and torchrun's RANK); `run_processes(run_dir)`: the same with torchrun's
agent; `left_after(run_dir, timeout_s)`: those still there once each has ended or the time is
up. `records(run_dir)`: the run's metrics.jsonl records so far ([] before the first)."""

from __future__ import annotations

import json
import os
import select
import time
from pathlib import Path


def run_processes(run_dir: Path | str) -> dict[int, str]:
    """{pid: "agent" or "rank N"} of the processes working on `run_dir` now: torchrun's agent
    carries the rank argv too, but no RANK."""
    out = {}
    marker = str(run_dir).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0")
                       if b"=" in x)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in env.get(b"MESHTRON_RANK_ARGV", b""):
            rank = env.get(b"RANK")
            out[int(d.name)] = f"rank {int(rank)}" if rank else "agent"
    return out


def left_after(run_dir: Path | str, timeout_s: float) -> dict[int, str]:
    """Wait until every process of `run_dir` (run_processes) has ended, at most `timeout_s`
    in all; returns those still running. Waits on each process's pidfd (they are not this
    process's children: waitpid cannot see them), so no polling interval decides the end."""
    deadline = time.monotonic() + timeout_s
    for pid in run_processes(run_dir):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    return run_processes(run_dir)


def rank_pids(run_dir: Path | str) -> dict[int, int]:
    """{rank: pid} of the ranks working on `run_dir` now."""
    return {int(who.split()[1]): pid for pid, who in run_processes(run_dir).items()
            if who != "agent"}


def records(run_dir: Path) -> list[dict]:
    """The metrics records written so far (complete lines only)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
