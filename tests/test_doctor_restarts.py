"""meshtron doctor across torchrun restarts and at the edges of a run: real `meshtron train`
ranks, real signals.

- A rank that hangs in every attempt (`--max-restarts 1 --watchdog-timeout 4`): each attempt's
  dumps are kept (trace/, trace/attempt_1), the restart record names the watchdog abort,
  `meshtron doctor` names the culprit of each attempt (exit 3), and the launcher says the
  restart budget is used up and the step to resume from (a `failed` record in metrics.jsonl).
- No rank has dumped: a rank that never joins (named once rank 0 dumps on demand), a run still
  going, dumped on demand while healthy (`none`), then its launcher SIGKILLed (exit 4).
- A straggler late by a lot in one step of three (its median lateness is 0).
- SIGTERM after a peer ended (torchrun's teardown): no checkpoint promised, exit 143.
- Options that need another one: one line, exit 2.
Slow: the audit's cases as they were found: rank 1 SIGSTOPped (the restart record names the
watchdog abort and the frozen rank; doctor names it in attempt 0), and rank 1 SIGKILLed twice
(the cause names rank 1 only, no checkpoint is promised, the budget is said to be used up).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtron.diagnose.analyze import diagnose
from meshtron.diagnose.cli import EXIT_FOUND, EXIT_NO_DUMP
from meshtron.diagnose.trace import load_trace
from meshtron.doctor.dump import process_state
from testkit.multiproc import RankError, run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import doctor_faults  # noqa: E402

FAULTS = str(Path(__file__).parent / "faults")
TRAIN = [sys.executable, "-m", "meshtron", "train", "--nproc", "2", "--plan", "dp=2",
         "--model", "debug", "--seq-len", "32", "--global-batch", "8", "--eval-every", "0"]


def _doctor(run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", "doctor", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=60)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_hang_in_every_attempt_keeps_each_attempts_dumps(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([FAULTS, os.environ["PYTHONPATH"]]),
               MESHTRON_TEST_HANG_AT="3", MESHTRON_TEST_HANG_RANK="1")
    proc = subprocess.run([*TRAIN, "--steps", "20", "--checkpoint-every", "2",
                           "--max-restarts", "1", "--watchdog-timeout", "4",
                           "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300, env=env)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    restart, failed = [r for r in _records(run_dir) if "event" in r]
    # attempt 0 hangs at its 3rd batch (step 3), attempt 1 resumes from step 2 and hangs at
    # step 5: the watchdog ends both, and the record says so (not "killed by a signal").
    assert restart["event"] == "restart" and restart["resumed_from_step"] == 2, restart
    # the first rank to time out is named: either (rank 1 stalls outside any collective)
    assert re.fullmatch(r"watchdog abort: no progress for 4\.0 s at step 2 \(seen by rank "
                        r"[01]\)", restart["cause"]), restart
    assert failed["event"] == "failed" and failed["attempt"] == 1, failed
    assert failed["cause"].startswith("watchdog abort: no progress for 4.0 s at step 4"), failed
    assert failed["resume_from_step"] == 4 and failed["max_restarts"] == 1, failed
    assert ("the restart budget is used up (1 of --max-restarts 1 done); the last attempt "
            "ended: watchdog abort" in err), err[-3000:]
    assert "continue from step 4 with --resume" in err, err[-3000:]
    for folder in (run_dir / "trace", run_dir / "trace" / "attempt_1"):
        assert sorted(p.name for p in folder.glob("rank_?.json")) == \
            ["rank_0.json", "rank_1.json"], folder
        assert (folder / "ABORT.json").is_file(), folder
    out = _doctor(run_dir, "--json")
    assert out.returncode == EXIT_FOUND, out.stderr
    doc = json.loads(out.stdout)
    assert doc["attempt"] == 1 and [a["attempt"] for a in doc["attempts"]] == [0, 1], doc
    for attempt in doc["attempts"]:
        assert attempt["kind"] == "never_entered" and attempt["culprit_ranks"] == [1], attempt
    text = _doctor(run_dir).stdout
    assert text.startswith("attempt 0 (ended; torchrun restarted the ranks):\n  rank 1 (dp=1) "
                           "never entered"), text
    assert "\nattempt 1 (latest):\n  rank 1 (dp=1) never entered" in text, text


def _wait(predicate, proc, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()  # a hung run would keep its output open: fail, never hang
            raise AssertionError(proc.communicate(timeout=60)[0][-3000:])
        time.sleep(0.1)


def test_no_dump_is_said_not_judged(tmp_path):
    """One run, as a user meets it. Rank 1 stopped as its process starts (before anything of
    meshtron runs): rank 0 waits in the process group's rendezvous; its hello file is there at
    once (doctor: still going, exit 4), SIGUSR1 dumps it without ending it, and doctor names
    rank 1 as never joined (exit 3). Rank 1 continued, the run trains: no rank dumped, no
    verdict (exit 4); both ranks dumped on demand, as that verdict says (`kill -USR1`): a
    healthy run, `none` (each rank is where the signal found it). Then its launcher SIGKILLed:
    no dump after that either (exit 4)."""
    from testkit.procs import rank_pids

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, "--steps", "100000", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1",
                                     PYTHONPATH=os.pathsep.join([FAULTS,
                                                                 os.environ["PYTHONPATH"]]),
                                     MESHTRON_TEST_STOP_RANK="1"))
    trace = run_dir / "trace"
    dumps = [trace / f"rank_{r}.json" for r in (0, 1)]
    try:
        _wait((trace / "rank_0.hello.json").is_file, proc)
        joining = _doctor(run_dir)
        assert joining.returncode == EXIT_NO_DUMP, joining.stdout + joining.stderr
        assert joining.stdout.startswith("no rank has dumped: the run is still going (rank 0 "
                                         "running)"), joining.stdout
        assert "Rank 1 wrote no hello file: not started yet, or stopped" in joining.stdout
        pid0 = json.loads((trace / "rank_0.hello.json").read_text())["pid"]
        os.kill(pid0, signal.SIGUSR1)
        _wait(dumps[0].is_file, proc)
        found = _doctor(run_dir, "--json")
        doc = json.loads(found.stdout)
        assert found.returncode == EXIT_FOUND, found.stdout + found.stderr
        assert doc["kind"] == "never_joined" and doc["culprit_ranks"] == [1], doc
        assert doc["verdict"].startswith("rank 1 never joined: it wrote no hello file"), doc
        assert " s for it to join the process group (at " in doc["verdict"], doc
        dumps[0].rename(tmp_path / "joining.json")
        # a SIGCONT before rank 1 has stopped itself is lost (a loaded host can start its
        # interpreter late): it would stay stopped
        _wait(lambda: process_state(rank_pids(run_dir).get(1, -1)) == "stopped", proc)
        os.kill(rank_pids(run_dir)[1], signal.SIGCONT)

        _wait(lambda: (run_dir / "metrics.jsonl").is_file(), proc)
        live = _doctor(run_dir)
        pids = [json.loads((trace / f"rank_{r}.hello.json").read_text())["pid"]
                for r in (0, 1)]
        assert pids[0] == pid0  # the SIGUSR1 dump did not end it
        assert live.returncode == EXIT_NO_DUMP, live.stdout + live.stderr
        assert live.stdout.startswith("no rank has dumped: the run is still going (ranks 0, 1 "
                                      f"running); `kill -USR1 {pids[0]} {pids[1]}`"), live.stdout
        assert "kind: no_dump" in live.stdout and "no divergence" not in live.stdout
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        _wait(lambda: all(d.is_file() for d in dumps), proc)
        on_demand = _doctor(run_dir, "--json")
        doc = json.loads(on_demand.stdout)
        assert on_demand.returncode == 0 and doc["kind"] == "none", doc
        assert doc["verdict"].startswith("dumped on demand (SIGUSR1) while running: no rank "
                                         "is behind a peer by more than the longest step"), doc
        for d in dumps:  # what follows is a run that never dumped
            d.rename(tmp_path / d.name)
    finally:
        for pid in rank_pids(run_dir).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a stopped rank 1 ends with its launcher too
        proc.kill()  # the launcher only: its ranks end with it (their parent-death signal)
        out = proc.communicate(timeout=60)[0]
    # one line per dump on the run's output, not every thread's stack between the step lines
    assert out.count("SIGUSR1: trace written to") == 3, out[-3000:]
    assert "most recent call first" not in out, out[-3000:]
    deadline = time.monotonic() + 60
    while any(process_state(p) != "gone" for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = _doctor(run_dir, "--json")
    assert killed.returncode == EXIT_NO_DUMP, killed.stderr
    doc = json.loads(killed.stdout)
    assert doc["kind"] == "no_dump" and doc["culprit_ranks"] == [], doc
    assert doc["verdict"].startswith("no rank has dumped: the ranks ended without a dump"), doc
    assert doc["evidence"] == ["rank 0: no dump", "rank 1: no dump"], doc


def test_periodic_straggler_is_named(tmp_path):
    """Rank 1 stalls 0.3 s in one step of three: its median lateness is 0, its total is not."""
    run_on_ranks(doctor_faults.faulty_loop, 2, str(tmp_path), "periodic_straggler", (1, 2),
                 ("dp", "tp"), steps=9, timeout=90, backend="recorded")
    trace = load_trace(tmp_path)
    first = {}
    for rank, d in trace.dumps.items():
        for rec in d["records"]:
            first.setdefault((rec["group"], rec["seq"]), {})[rank] = rec["enqueue_t"]
    late = [t[1] - min(t.values()) for t in first.values() if len(t) == 2]
    assert statistics.median(late) < 0.02, late  # what the median statistic saw: nothing
    d = diagnose(trace)
    assert d.kind == "straggler" and d.culprit_ranks == [1], d.to_dict()
    assert d.verdict.startswith("rank 1 (tp=1) is a straggler: the other ranks waited for it "), \
        d.verdict


def test_sigterm_after_a_peer_ended_promises_no_checkpoint(tmp_path):
    with pytest.raises(RankError) as failure:
        run_on_ranks(doctor_faults.torn_down_after_peer, 2, str(tmp_path), timeout=90,
                     backend="recorded")
    message = str(failure.value)
    assert sorted(failure.value.failed_ranks) == [0, 1], message
    assert "rank 0 died with exit code 143" in message, message
    assert "SIGTERM after rank 1 ended: no checkpoint can be taken" in message, message
    assert "then checkpointing" not in message, message
    dump = json.loads((tmp_path / "rank_0.json").read_text())
    assert dump["reason"] == "SIGTERM: stopped by SIGTERM after rank 1 ended (torchrun " \
                             "stopping the ranks)", dump["reason"]
    note = json.loads((tmp_path / "note_0.json").read_text())
    assert note["kind"] == "teardown", note


def test_options_without_their_mode_are_refused(tmp_path, capsys):
    from meshtron.cli import main

    assert main(["doctor", str(tmp_path), "--tp", "2"]) == 2
    assert main(["doctor", str(tmp_path), "--no-png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "--tp=2: only with --nccl-log" in err[0] and "--no-png: only with --timeline" in err[1]


def _start(run_dir: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, "--steps", "400", "--checkpoint-every", "3",
                             "--max-restarts", "1", "--run-dir", str(run_dir), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _steps(run_dir: Path) -> list[int]:
    from testkit.procs import records

    return [r["step"] for r in records(run_dir) if "step" in r]


def _restarted(run_dir: Path) -> bool:
    from testkit.procs import records

    return any(r.get("event") == "restart" for r in records(run_dir))


@pytest.mark.slow
def test_sigstopped_rank_restart_names_the_frozen_rank(tmp_path):
    """The audit's case: SIGSTOP rank 1; the watchdog ends the attempt, torchrun restarts."""
    from testkit.procs import rank_pids

    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--watchdog-timeout", "4")
    _wait(lambda: max(_steps(run_dir), default=0) >= 5, proc)
    os.kill(rank_pids(run_dir)[1], signal.SIGSTOP)
    _wait(lambda: _restarted(run_dir), proc, 180)
    proc.terminate()  # a preemption notice: the restarted attempt checkpoints and stops
    proc.communicate(timeout=180)
    restart = next(r for r in _records(run_dir) if r.get("event") == "restart")
    assert restart["cause"].startswith("watchdog abort: no progress for 4.0 s"), restart
    assert "rank 1 frozen (its process is stopped" in restart["cause"], restart
    doc = json.loads(_doctor(run_dir, "--json").stdout)
    first = doc["attempts"][0]
    assert first["kind"] == "frozen_rank" and first["culprit_ranks"] == [1], first


@pytest.mark.slow
def test_rank_killed_twice_uses_up_the_restarts(tmp_path):
    from testkit.procs import rank_pids

    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait(lambda: max(_steps(run_dir), default=0) >= 5, proc)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    _wait(lambda: _restarted(run_dir) and max(_steps(run_dir), default=0) >= 7
          and len(rank_pids(run_dir)) == 2, proc, 180)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out[-3000:]
    assert "then checkpointing" not in out, out[-3000:]
    restart, failed = [r for r in _records(run_dir) if "event" in r]
    for record in (restart, failed):  # the signal, where torchrun's agent logged rank 1 first
        assert record["cause"].startswith("rank 1 ") and "Python error" in record["cause"], record
    assert failed["event"] == "failed" and failed["resume_from_step"] % 3 == 0, failed
    assert (f"the restart budget is used up (1 of --max-restarts 1 done); the last attempt "
            f"ended: {failed['cause']}") in out, out[-3000:]
    assert f"continue from step {failed['resume_from_step']} with --resume" in out
