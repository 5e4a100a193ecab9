"""The GPU kit's budget (bench/gpu_check.py, bench/gpukit/runner.py): the default order's
expected seconds on the H200 fit the default `--budget`, and a group of cases really runs side
by side, each with its own cap and its own record."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

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


def _waits_for_the_others_sigterm(tmp_path: Path, name: str, other: str) -> runner.Running:
    """A case that marks itself ready, then on SIGTERM marks that it got one and waits (up
    to 30 s) for `other`'s mark before it records whether it saw it and exits: it sees it
    only if both were told to stop at once."""
    out, mark = tmp_path / f"{name}.json", str(tmp_path / name)
    code = (
        "import json, os, signal, time\n"
        "def on_term(*_):\n"
        f"    open({mark!r} + '.term', 'w').close()\n"
        "    t = time.time()\n"
        f"    while not os.path.exists({str(tmp_path / other)!r} + '.term') "
        "and time.time() - t < 30:\n"
        "        time.sleep(0.05)\n"
        f"    seen = os.path.exists({str(tmp_path / other)!r} + '.term')\n"
        f"    open({str(out)!r}, 'w').write(json.dumps({{'saw_other': seen}}))\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        f"open({mark!r} + '.ready', 'w').close()\n"
        "time.sleep(600)\n")
    return runner.start(name, [sys.executable, "-c", code], {}, tmp_path, tmp_path, out, 600,
                        lambda line: None)


def _two_ready(tmp_path: Path) -> list[runner.Running]:
    runs = [_waits_for_the_others_sigterm(tmp_path, "a", "b"),
            _waits_for_the_others_sigterm(tmp_path, "b", "a")]
    t = time.time()
    while not all((tmp_path / f"{n}.ready").exists() for n in "ab"):
        assert time.time() - t < 120 and all(r.proc.poll() is None for r in runs)
        time.sleep(0.05)
    return runs


def test_members_overdue_together_are_stopped_together(tmp_path, monkeypatch):
    """A group cut at the budget's end: every overdue member is told to stop at once, not
    one grace after another (each CLI case takes ~5 s to stop, a hung one the whole grace:
    nine members one by one overran the 600 s call the budget was sized for). One by one,
    "a" would be killed at its grace without ever seeing "b" told."""
    monkeypatch.setattr(runner, "GRACE_S", 6.0)
    runs = _two_ready(tmp_path)
    for run in runs:
        run.deadline = time.perf_counter()  # both over their cap now
    got: dict = {}
    runner.wait_all(runs, lambda run, rec: got.setdefault(run.name, rec))
    assert {n: (r["status"], r["result"]) for n, r in got.items()} == {
        "a": ("timeout", {"saw_other": True}), "b": ("timeout", {"saw_other": True})}


def test_an_interrupt_stops_every_member_at_once(tmp_path, monkeypatch):
    """SIGTERM to the kit: the device call's limit leaves seconds, so the running members
    are told together and each records what it has (one by one, eight seconds each, a
    group's records came after the call was killed)."""
    monkeypatch.setattr(runner, "TERM_GRACE_S", 6.0)
    runs = _two_ready(tmp_path)
    got: dict = {}
    runner.interrupt(runs, runner.Interrupted("signal 15"), lambda r, rec: got.setdefault(
        r.name, rec))
    assert {n: (r["status"], r["result"]) for n, r in got.items()} == {
        "a": ("interrupted", {"saw_other": True}), "b": ("interrupted", {"saw_other": True})}


def test_sigterm_while_an_ended_case_is_recorded_keeps_its_record(tmp_path):
    """A real SIGTERM to this process (the kit's handler: Interrupted) while wait_all makes
    the record of a case that has ended (its output still open in a child it left: finish
    waits up to 5 s for it): the case is recorded as it ended, not dropped (it had left the
    runs still waited for before its record was made, and `drive` then called it never
    started)."""
    out = tmp_path / "left.json"
    code = ("import json, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(out)!r}, 'w').write(json.dumps({{'measured': 1}}))\n")
    run = runner.start("left", [sys.executable, "-c", code], {}, tmp_path, tmp_path, out, 600,
                       lambda line: None)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise runner.Interrupted(f"signal {signum}")

    main = threading.get_ident()

    def in_finish() -> bool:
        """The main thread's stack holds runner.finish (waiting for the left child's output)."""
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code is runner.finish.__code__:
                return True
            frame = frame.f_back
        return False

    def term_inside_finish():
        while not in_finish():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, on_term)
    got: dict = {}
    try:
        threading.Thread(target=term_inside_finish, daemon=True).start()
        with pytest.raises(runner.Interrupted):
            runner.wait_all([run], lambda r, rec: got.setdefault(r.name, rec))
    finally:
        signal.signal(signal.SIGTERM, old)
        try:
            os.killpg(run.proc.pid, signal.SIGKILL)  # the child it left
        except ProcessLookupError:
            pass
    assert got["left"]["status"] == "ok" and got["left"]["result"] == {"measured": 1}


@pytest.mark.parametrize("argv, field", [
    (["--caps", "env=0"], "--caps"), (["--caps", "env=-5"], "--caps"),
    (["--caps", "env=nan"], "--caps"), (["--budget", "0"], "--budget"),
    (["--budget", "-1"], "--budget")])
def test_a_cap_or_budget_of_no_time_is_refused(argv, field, monkeypatch, tmp_path, capsys):
    """A cap of 0 s or less made that case's floor 0 (`_limits`): it started with the budget
    spent (or past it), to be stopped at once; now one line naming the flag, exit 2."""
    monkeypatch.setattr(gpu_check, "drive", lambda args: pytest.fail("started"))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path / "x.json"),
                                      *argv])
    with pytest.raises(SystemExit) as stop:
        gpu_check.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert field in err and "positive number of seconds" in err
