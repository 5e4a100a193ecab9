"""Shared pieces of the rehearsal-vs-planner table tests (tests/test_rehearse.py,
tests/test_rehearse_moe.py): run a script of rehearsals in a fresh process (`run_kinds`), or
several such scripts in one (`run_jobs`: a test file's default tables behind one torch import),
and hold every layout kind's planner total within 5% of its rehearsal."""

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


JOBS_DRIVER = """
import contextlib, io, json, sys, traceback
import torch
jobs = json.loads(sys.stdin.read())
out = {}
for name, (script, arg) in jobs.items():
    sys.argv = ["-c", json.dumps(arg)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "<job " + name + ">", "exec"), {"__name__": "__main__"})
        line = [x for x in printed.getvalue().splitlines() if x.startswith("RESULT")][-1]
        out[name] = {"result": json.loads(line[len("RESULT"):])}
    except BaseException:
        out[name] = {"error": traceback.format_exc()[-3000:]}
    finally:
        torch.set_default_dtype(torch.float32)  # a job's own setting ends with it
print("JOBS" + json.dumps(out))
"""


def run_jobs(jobs: dict[str, tuple[str, list]]) -> dict[str, dict]:
    """Run several `run_kinds` scripts (name: (script, arg)) one after another in ONE fresh
    process: the child's torch import and the rehearsal's first-call setup (~5-8 CPU s on
    the CI box) are paid once per test file, not once per test. Each job runs as it would
    alone (its own globals, `sys.argv[1]` its JSON arg); a job that raises is recorded with
    its traceback and the others still run. {name: {"result": ...} or {"error": text}}."""
    proc = subprocess.run([sys.executable, "-c", JOBS_DRIVER], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("JOBS")][-1]
    return json.loads(line[len("JOBS"):])


def job_result(results: dict[str, dict], name: str):
    """One job's JSON from `run_jobs`; its traceback as the failure when it raised."""
    got = results[name]
    assert "error" not in got, f"{name}:\n{got['error']}"
    return got["result"]
