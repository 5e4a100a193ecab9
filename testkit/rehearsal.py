"""Shared pieces of the rehearsal-vs-planner table tests (tests/test_rehearse.py,
tests/test_rehearse_moe.py): run a script of rehearsals in a fresh process, and hold every
layout kind's planner total within 5% of its rehearsal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_kinds(script: str, arg: list) -> dict:
    """Run `script` (which prints one line "RESULT" + JSON {kind: {row: [rehearsed GiB,
    planned GiB]}}) with `arg` as JSON in its argv, in a fresh process; the JSON."""
    out = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], capture_output=True,
                         text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def check_totals(results: dict, what: str, digits: int = 3) -> None:
    """Every kind's planner total within 5% of its rehearsal; the optimizer row (AdamW's
    states of the rank's own shards, exact on both sides) within 5% as a sanity check."""
    off = {}
    for name, rows in results.items():
        rehearsed, planned = rows["total"]
        assert rows["optimizer"][0] == pytest.approx(rows["optimizer"][1], rel=0.05), name
        if abs(planned / rehearsed - 1) > 0.05:
            off[name] = (round(rehearsed, digits), round(planned, digits))
    assert not off, f"planner vs {what} beyond 5% (GiB rehearsed, planned): {off}"
