"""The GPU kit's budget (bench/gpu_check.py, bench/gpukit/runner.py): the default order's
expected seconds on the H200 fit the default `--budget`, and a group of cases really runs side
by side, each with its own cap and its own record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
from gpukit import runner  # noqa: E402


def test_the_default_order_is_expected_to_fit_the_default_budget():
    rows = gpu_check.chosen_cases(None)
    assert gpu_check.EXPECTED_WALL_S == runner.expected_wall(rows)
    assert gpu_check.EXPECTED_WALL_S <= gpu_check.EXPECTED_BUDGET_S, [
        ([r.name for r in b], runner.expected_wall(b)) for b in runner.batches(rows)]
    # every case of the kit runs by default but the optional ones, which a suite runs
    assert {r.name for r in rows} | set(gpu_check.OPTIONAL) == {c.name for c in gpu_check.CASES}
    for name in gpu_check.OPTIONAL:
        assert any(name in cases for cases in gpu_check.SUITES.values())
    # each cap leaves room for its estimate to be half as long again (never-run cases)
    assert [c.name for c in gpu_check.CASES if 1.5 * c.expected > c.cap] == []


def test_the_default_budget_is_the_one_the_order_was_sized_for(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(gpu_check, "drive", lambda args: seen.setdefault("budget", args.budget))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path / "x.json")])
    gpu_check.main()
    assert seen["budget"] == gpu_check.EXPECTED_BUDGET_S


def test_a_group_runs_at_once_and_only_consecutive_members_share_a_batch():
    C = gpu_check.Case
    rows = [C("a", "m:f", 9, 1, 5), C("b", "m:f", 9, 1, 4, "g"), C("c", "m:f", 9, 1, 8, "g"),
            C("d", "m:f", 9, 1, 2), C("e", "m:f", 9, 1, 3, "g")]
    assert [[r.name for r in b] for b in runner.batches(rows)] == [["a"], ["b", "c"], ["d"],
                                                                   ["e"]]
    assert runner.expected_wall(rows) == 5 + runner.CONTENTION * 8 + 2 + 3


def _case(tmp_path: Path, name: str, body: str, cap: float) -> runner.Running:
    out = tmp_path / f"{name}.json"
    code = (f"import json, time, sys\nstart = time.time()\n{body}\n"
            f"open({str(out)!r}, 'w').write(json.dumps({{'start': start, 'end': time.time()}}))")
    return runner.start(name, [sys.executable, "-c", code], {}, tmp_path, tmp_path, out, cap,
                        lambda line: None)


def test_side_by_side_cases_overlap_and_each_keeps_its_own_cap_and_record(tmp_path):
    """Three real processes started as one group: one waits until the other two have started
    (it would hang if they ran one after another), one fails, one outlives its cap."""
    flag = tmp_path / "started"
    runs = [
        _case(tmp_path, "waits", f"import os\nwhile not (os.path.exists({str(flag)!r} + '1') and "
              f"os.path.exists({str(flag)!r} + '2')):\n    time.sleep(0.05)", 120),
        _case(tmp_path, "fails", f"open({str(flag)!r} + '1', 'w').close()\nsys.exit(3)", 120),
        _case(tmp_path, "hangs", f"open({str(flag)!r} + '2', 'w').close()\ntime.sleep(600)", 3),
    ]
    got: dict = {}
    runner.wait_all(runs, lambda run, rec: got.setdefault(run.name, rec))
    assert got["waits"]["status"] == "ok" and got["waits"]["exit_code"] == 0
    assert got["fails"]["status"] == "error" and got["fails"]["exit_code"] == 3
    assert got["hangs"]["status"] == "timeout" and got["hangs"]["cap_s"] == 3
    result = got["waits"]["result"]
    assert result["end"] >= result["start"] and json.loads(
        (tmp_path / "waits.json").read_text()) == result
    assert all(run.proc.poll() is not None for run in runs)  # nothing left running
    # each its own CPU seconds (a Python start-up at least), read as each was reaped
    assert all(rec["cpu_s"] > 0 for rec in got.values()), got


def test_an_interrupt_stops_and_records_every_member_still_running(tmp_path):
    runs = [_case(tmp_path, "one", "time.sleep(600)", 600),
            _case(tmp_path, "two", "time.sleep(600)", 600)]
    got: dict = {}
    runner.interrupt(runs, runner.Interrupted("signal 15"), lambda r, rec: got.setdefault(r.name,
                                                                                          rec))
    assert set(got) == {"one", "two"}
    assert all(r["status"] == "interrupted" and "signal 15" in r["reason"] for r in got.values())
    assert all(run.proc.poll() is not None for run in runs)
