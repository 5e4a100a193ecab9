"""Real processes of a `meshtron train` run, for tests and benches that kill them.

`rank_pids(run_dir)`: {rank: pid} of the torchrun workers training into `run_dir`, read from
/proc (their environment carries the rank argv, meshtron/launch.py MESHTRON_RANK_ARGV, which
names the run folder, and torchrun's RANK); `run_processes(run_dir)`: the same with torchrun's
agent. `records(run_dir)`: the run's metrics.jsonl records so far ([] before the first)."""

from __future__ import annotations

import json
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
