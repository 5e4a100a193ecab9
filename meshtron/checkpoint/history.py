"""metrics.jsonl across restarts: one record per step, never two.

A resumed run trains the steps after its checkpoint again, so their records from the interrupted
attempt are removed before it appends. Event records (`restart`, `resume`, `preempted`) carry an
"event" key and no "step", and are kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill mid-write
    return out


def truncate(path: Path, step: int) -> tuple[list[dict[str, Any]], int | None]:
    """Keep the step records up to `step` and every event record (rewritten atomically);
    returns (the step records kept, the last step logged before the cut)."""
    records = _records(path)
    logged = [r["step"] for r in records if _is_step(r)]
    kept = [r for r in records if not _is_step(r) or r["step"] <= step]
    tmp = path.with_name(path.name + ".part")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return [r for r in kept if _is_step(r)], (max(logged) if logged else None)


def step_records(path: Path) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl in their order (event records left out)."""
    return [r for r in _records(path) if _is_step(r)]


def _is_step(record: dict[str, Any]) -> bool:
    return "event" not in record and isinstance(record.get("step"), int)


def append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def past_intervals(path: Path) -> list[tuple[int, int, float, bool]]:
    """The training intervals of the step records kept in metrics.jsonl, as the step clock
    (meshtron/train/metrics.py) recorded them: (last step, steps, seconds, steady). An interval
    starts after the previous record, or at its attempt's first step (a `resume` / `restart`
    record's resumed_from_step + 1) when that comes later; the first step of every attempt is
    warm-up (not steady), as it is for the clock of a fresh run."""
    records = _records(path)
    starts = sorted({1} | {r["resumed_from_step"] + 1 for r in records
                           if r.get("event") in ("resume", "restart")
                           and isinstance(r.get("resumed_from_step"), int)})
    out, previous = [], 0
    for r in sorted((r for r in records if _is_step(r)), key=lambda r: r["step"]):
        step = r["step"]
        begin = max([previous + 1] + [s for s in starts if s <= step])
        n = step - begin + 1
        if n >= 1 and isinstance(r.get("step_time_s"), (int, float)):
            out.append((step, n, r["step_time_s"] * n, begin not in starts))
        previous = step
    return out
