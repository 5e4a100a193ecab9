"""meshtron doctor on real faults: real gloo ranks, real signals, real hangs.

Default suite: a hung `meshtron train --nproc 2 --watchdog-timeout` (exits non-zero with every
rank's dump; doctor names the rank that never entered the collective), the analysis of dumps
that real fault runs left (tests/data/doctor/, rewritten by the slow live tests:
`REGENERATE=1 .venv/bin/python -m pytest -m slow tests/test_doctor.py -k live`), NCCL logs,
SIGTERM chaining in process. Slow: every fault kind live, a frozen rank with more checks, and
SIGUSR1/SIGTERM on real ranks (one blocked in a collective)."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.diagnose.analyze import diagnose
from meshtron.diagnose.trace import load_trace
from testkit.multiproc import RankError, RankTimeout, run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import doctor_faults  # noqa: E402

DATA = Path(__file__).parent / "data" / "doctor"
# Not a fault of SCENARIOS (every folder of DATA is one): both ranks of a healthy run, SIGUSR1.
ON_DEMAND = Path(__file__).parent / "data" / "doctor_on_demand"
FAULTS = str(Path(__file__).parent / "faults")
# fault -> (world size, mesh shape, env, expected culprits)
SCENARIOS = {
    "never_entered": (4, (2, 2), None, [3]),
    "mismatched_op": (3, (1, 3), None, [2]),
    "mismatched_shape": (3, (1, 3), {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, [2]),
    "dead_rank": (2, (2, 1), None, [1]),
    "frozen_rank": (2, (2, 1), None, [1]),
    "straggler": (3, (1, 3), None, [2]),
}


def _run_fault(fault: str, trace_dir: Path):
    world, shape, env, _ = SCENARIOS[fault]
    try:
        return run_on_ranks(doctor_faults.faulty_loop, world, str(trace_dir), fault, shape,
                            ("dp", "tp"), timeout=90, env=env, backend="recorded")
    except (RankError, RankTimeout) as exc:
        return exc


def _check(fault: str, trace_dir: Path):
    diagnosis = diagnose(load_trace(trace_dir))
    assert diagnosis.kind == fault, diagnosis.to_dict()
    assert diagnosis.culprit_ranks == SCENARIOS[fault][3], diagnosis.to_dict()
    return diagnosis


def _no_process_left(trace_dir: Path):
    from meshtron.doctor.dump import process_state

    for hello in trace_dir.glob("rank_*.hello.json"):
        assert process_state(json.loads(hello.read_text())["pid"]) == "gone", hello


@pytest.mark.slow
def test_frozen_rank_is_named_by_the_others(tmp_path):
    outcome = _run_fault("frozen_rank", tmp_path)
    assert isinstance(outcome, RankError), outcome  # the watchdog ended the run
    d = _check("frozen_rank", tmp_path)
    assert d.verdict.startswith("rank 1 (dp=1) is frozen (its process is stopped"), d.verdict
    assert "rank 0 waited" in d.verdict and "data-parallel group [0, 1]" in d.verdict
    dump = json.loads((tmp_path / "rank_0.json").read_text())
    assert dump["reason"].startswith("watchdog") and dump["peers"]["1"]["state"] == "stopped"
    assert not (tmp_path / "rank_1.json").exists()
    _no_process_left(tmp_path)


@pytest.mark.parametrize("fault", sorted(SCENARIOS))
def test_recorded_dumps_of_every_fault_kind(fault):
    """Dumps written by real runs of each fault (the slow test below rewrites them)."""
    d = _check(fault, DATA / fault)
    assert d.verdict.endswith(".") and "\n" not in d.verdict
    if fault == "never_entered":
        assert d.verdict.startswith("rank 3 (dp=1, tp=1) never entered all_reduce #3 on the "
                                    "tensor-parallel group [2, 3]; it is at "
                                    "doctor_faults.py:"), d.verdict
        assert "in load_batch; rank 2 has waited" in d.verdict, d.verdict
    if fault == "mismatched_op":
        assert "issued broadcast #3" in d.verdict and "issued all_reduce #3" in d.verdict
    if fault == "mismatched_shape":
        assert "[16] float32 where ranks 0, 1 used [8] float32" in d.verdict, d.verdict
    if fault == "dead_rank":
        assert d.verdict.startswith("rank 1 (dp=1) died"), d.verdict
        named = [int(re.match(r"rank (\d+)", line).group(1)) for line in d.evidence]
        assert named == [0, 1], d.evidence  # each rank once, in one format


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(SCENARIOS))
def test_every_fault_kind_live(fault, tmp_path):
    _run_fault(fault, tmp_path)
    _check(fault, tmp_path)
    _no_process_left(tmp_path)
    if os.environ.get("REGENERATE"):
        shutil.rmtree(DATA / fault, ignore_errors=True)
        shutil.copytree(tmp_path, DATA / fault)


def test_train_watchdog_ends_a_hang_and_doctor_names_the_rank(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([FAULTS, os.environ["PYTHONPATH"]]),
               MESHTRON_TEST_HANG_AT="3", MESHTRON_TEST_HANG_RANK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "meshtron", "train", "--nproc", "2", "--plan", "dp=2",
         "--watchdog-timeout", "4", "--model", "debug", "--steps", "8", "--seq-len", "32",
         "--global-batch", "8", "--eval-every", "0", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "watchdog: no progress for 4.0 s" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "trace").glob("rank_?.json")) == \
        ["rank_0.json", "rank_1.json"]
    _no_process_left(run_dir / "trace")
    out = subprocess.run([sys.executable, "-m", "meshtron", "doctor", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr  # a culprit named (meshtron/diagnose/cli.py)
    doc = json.loads(out.stdout)
    assert doc["kind"] == "never_entered" and doc["culprit_ranks"] == [1], doc
    # The first collective of the hung step: an all-reduce (ZeRO-0) or the next forward's
    # parameter all-gather (ZeRO-1/2/3 run as FSDP2), whichever stage the planner chose.
    assert re.match(r"rank 1 \(dp=1\) never entered (all_reduce|all_gather_into_tensor) #",
                    doc["verdict"]), doc
    assert "on the data-parallel group [0, 1]; it is at sitecustomize.py:" in doc["verdict"]
    assert "in load_batch; rank 0 has waited" in doc["verdict"], doc
    print(f"hang to dumps: {doc['hang_to_dump_s']:.1f} s (watchdog timeout 4 s)")
    text = subprocess.run([sys.executable, "-m", "meshtron", "doctor", str(run_dir)],
                          capture_output=True, text=True, timeout=60).stdout
    assert text.splitlines()[0] == doc["verdict"]


def test_doctor_bad_input_is_one_line(tmp_path, capsys):
    from meshtron.cli import main

    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert main(["doctor", str(tmp_path)]) == 2
    run = ["train", "--model", "debug", "--seq-len", "32", "--steps", "1", "--run-dir",
           str(tmp_path / "run")]
    assert main([*run, "--watchdog-timeout", "0.5"]) == 2
    assert main([*run, "--watchdog-timeout", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "missing': does not exist" in err[0] and "no trace" in err[1], err
    assert "--watchdog-timeout=0.5: allowed a finite number of seconds >= 1" in err[2], err
    assert "argument --watchdog-timeout: '0'" in err[3], err
    assert not (tmp_path / "run").exists()


def test_dumps_on_demand_of_a_healthy_run_name_no_rank(tmp_path, capsys):
    """Both ranks of a healthy `meshtron train --nproc 2` run dumped by `kill -USR1` (the
    dumps in tests/data/doctor_on_demand, cut to their last second): rank 0 had issued
    all_reduce #1234 and rank 1 not yet, 0.0 s apart. That is where the signal found them,
    not a hang (`none`, exit 0). The same dumps with rank 0 waiting in it for longer than the
    longest step they recorded are a hang: rank 1 named (exit 3)."""
    from meshtron.cli import main

    assert main(["doctor", str(ON_DEMAND)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dumped on demand (SIGUSR1) while running: no rank is behind a peer "
                          "by more than the longest step (0.1 s)"), out
    hung = tmp_path / "hung"
    shutil.copytree(ON_DEMAND, hung)
    dump = json.loads((hung / "rank_0.json").read_text())
    longest = max(s["seconds"] for d in (0, 1) for s in json.loads(
        (hung / f"rank_{d}.json").read_text())["step_times"])
    waiting = next(r for r in reversed(dump["records"]) if r["state"] != "completed")
    waiting["enqueue_t"] = dump["time"] - 2 * longest - 1.0
    (hung / "rank_0.json").write_text(json.dumps(dump))
    assert main(["doctor", str(hung), "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "never_entered" and doc["culprit_ranks"] == [1], doc


def test_unreadable_dump_is_said_and_the_rest_judged(tmp_path, capsys):
    """A dump cut short, or of another format version, is named on one line, never read as a
    rank that did not dump; the verdict comes from the files that can be read."""
    from meshtron.cli import main

    run = tmp_path / "run"
    shutil.copytree(DATA / "never_entered", run / "trace")  # rank 3 never entered (4 ranks)
    dump = run / "trace" / "rank_0.json"
    dump.write_bytes(dump.read_bytes()[: dump.stat().st_size // 2])
    other = json.loads((run / "trace" / "rank_1.json").read_text())
    (run / "trace" / "rank_1.json").write_text(json.dumps({**other,
                                                           "format": "meshtron-trace/2"}))
    assert main(["doctor", str(run), "--json"]) == 3
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["kind"] == "never_entered" and doc["culprit_ranks"] == [3], doc
    err = captured.err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].endswith("rank_0.json: truncated or damaged (not complete JSON); judged "
                           "from the other files"), err
    assert "rank_1.json: format 'meshtron-trace/2', written by another meshtron version; " \
           "this doctor reads 'meshtron-trace/1'" in err[1], err
    assert "rank 0 (dp=0, tp=0): dump unreadable (see above)" in doc["evidence"], doc
    # the audit's case: the only dump cut short; ABORT.json still says what happened
    only = tmp_path / "only"
    shutil.copytree(DATA / "frozen_rank", only / "trace")
    dump = only / "trace" / "rank_0.json"
    dump.write_bytes(dump.read_bytes()[:100])
    assert main(["doctor", str(only)]) == 4  # nothing to compare: nothing judged
    out = capsys.readouterr().out
    assert out.startswith("no readable dump: trace/rank_0.json (truncated or damaged (not "
                          "complete JSON)); the watchdog fired (rank "), out
    assert "rank 1 left no dump; there is nothing to compare." in out.splitlines()[0], out
    assert "the ranks ended without a dump" not in out, out


def test_run_whose_ranks_never_started_is_read_from_torchruns_word(tmp_path, capsys):
    """No trace at all (no rank reached meshtron's start), but torchrun's agent left how the
    ranks ended (attempts/attempt_0/exits.json, written by meshtron's launcher): that is read,
    nothing judged (exit 4), not refused as a folder without a trace (exit 2)."""
    from meshtron.cli import main

    run = tmp_path / "run"
    (run / "attempts" / "attempt_0").mkdir(parents=True)
    (run / "attempts" / "attempt_0" / "exits.json").write_text('{"1": -9}')
    assert main(["doctor", str(run)]) == 4
    out = capsys.readouterr().out
    assert out.startswith("no rank has dumped: no rank reached meshtron's start (no hello file "
                          "in trace/; stopped, stuck before it, or never spawned); torchrun's "
                          "agent saw rank 1 killed by SIGKILL"), out


NCCL = Path(__file__).parent / "data" / "nccl"


def _codes(report):
    return {f["code"] for f in report.flags}


def test_nccl_logs_healthy_and_broken():
    from meshtron.diagnose.nccl import analyze_files

    good = analyze_files([str(NCCL / "good_2x4_tp4.log")], tp=4)
    assert good.flags == [] and good.warnings == [] and good.timeouts == []
    d = good.to_dict()
    assert d["hosts"] == ["gpu-a01", "gpu-a02"] and d["processes"] == 8
    assert d["versions"] == {"2.21.5+cuda12.4": 8}
    sizes = sorted(c["nranks"] for c in d["communicators"])
    assert sizes == [2, 2, 2, 2, 4, 4, 8]
    tp_comms = [c for c in d["communicators"] if c["nranks"] == 4]
    assert all(len(c["hosts"]) == 1 and set(c["transports"]) == {"NVLink"} for c in tp_comms)
    world = d["communicators"][0]
    assert world["nranks"] == 8 and set(world["transports"]) == {"NVLink", "IB/GDRDMA"}

    bad_files = sorted(str(p) for p in NCCL.glob("bad_*.log"))
    bad = analyze_files(bad_files, tp=4)
    assert _codes(bad) == {"mixed_versions", "mixed_drivers", "intra_node_shm",
                           "socket_transport", "tp_crosses_nodes", "tp_over_sockets",
                           "timeout", "nccl_warn"}, bad.flags
    crossing = [f for f in bad.flags if f["code"] == "tp_crosses_nodes"]
    assert len(crossing) == 2 and "gpu-b01, gpu-b02" in crossing[0]["text"]
    assert {(t["rank"], t["seq"], t["op"]) for t in bad.timeouts} == {
        (2, 412, "ALLREDUCE"), (6, 412, "ALLREDUCE")}
    assert "tp_crosses_nodes" not in _codes(analyze_files(bad_files))  # tp unknown: not guessed

    one = analyze_files([str(NCCL / "one_node_p2p_off.log")])
    assert _codes(one) == {"intra_node_network", "no_gdr"}, one.flags


def test_nccl_log_cli(tmp_path, capsys):
    from meshtron.cli import main

    bad = sorted(str(p) for p in NCCL.glob("bad_*.log"))
    # errors found: exit code 3 (documented), with or without --json
    assert main(["doctor", "--nccl-log", *bad, "--tp", "4", "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert "tp_over_sockets" in {f["code"] for f in doc["flags"]}
    assert any(f["severity"] == "error" for f in doc["flags"])
    assert main(["doctor", "--nccl-log", *bad, "--tp", "4"]) == 3
    assert capsys.readouterr().out.split()[1] == "problem(s)"
    assert main(["doctor", "--nccl-log", str(NCCL / "good_2x4_tp4.log")]) == 0
    assert capsys.readouterr().out.startswith("no problem found in the NCCL logs of 8 processes")
    # a --tp that matches no communicator is said, not passed as checked (a warning: the rest
    # of the report stands)
    assert main(["doctor", "--nccl-log", str(NCCL / "good_2x4_tp4.log"), "--tp", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("0 problem(s) and 1 warning(s)"), out
    assert "WARNING: --tp=3: no communicator of 3 ranks in the logs (sizes seen: " in out, out
    empty = tmp_path / "empty.log"
    empty.write_text("hello\n")
    assert main(["doctor", "--nccl-log", str(empty)]) == 2
    assert main(["doctor", "--nccl-log", str(tmp_path / "nope.log")]) == 2
    assert main(["doctor", "--nccl-log", str(empty), "--tp", "0"]) == 2
    assert main(["doctor", "--nccl-log", str(tmp_path)]) == 2  # a folder, named as one
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and f"--nccl-log={str(empty)!r}: no NCCL log lines" in err[0], err
    assert f"--nccl-log={str(tmp_path / 'nope.log')!r}: file does not exist" in err[1], err
    assert "file does not exist" in err[1] and "is a folder" in err[3], err


@pytest.mark.slow
def test_signals_dump_a_blocked_rank_and_chain_to_the_previous_handler(tmp_path):
    """SIGUSR1 dumps a rank blocked in a collective (where Python runs no signal handler);
    SIGTERM dumps and calls the handler installed before (a preemption checkpoint's), without
    ending the process itself."""
    import signal
    import threading
    import time

    trace, marker = tmp_path / "trace", tmp_path / "marker"
    outcome: list = []
    runner = threading.Thread(target=lambda: outcome.append(run_on_ranks(
        doctor_faults.signalled_loop, 2, str(trace), str(marker), timeout=120,
        backend="recorded")))
    runner.start()

    def wait_for(path: Path):
        deadline = time.time() + 90
        while not path.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert path.exists(), path

    pids = {}
    for rank in (0, 1):
        wait_for(trace / f"rank_{rank}.hello.json")
        pids[rank] = json.loads((trace / f"rank_{rank}.hello.json").read_text())["pid"]
    deadline = time.time() + 60
    dump0, doc = trace / "rank_0.json", {}
    while not doc.get("records") and time.time() < deadline:  # until it sits in all_reduce
        os.kill(pids[0], signal.SIGUSR1)
        time.sleep(1.0)
        doc = json.loads(dump0.read_text()) if dump0.exists() else {}
    assert doc["reason"] == "SIGUSR1", doc["reason"]
    assert doc["records"] and doc["records"][-1]["op"] == "all_reduce"
    assert doc["records"][-1]["state"] != "completed"
    os.kill(pids[1], signal.SIGTERM)
    wait_for(marker)
    runner.join(120)
    assert outcome and outcome[0] == ["rank 0 done", "rank 1 done"], outcome
    assert marker.read_text() == "previous handler called 1 time(s)"
    last = json.loads((trace / "rank_1.json").read_text())
    assert last["reason"] == "exit" and [d["reason"] for d in last["earlier_dumps"]] == ["SIGTERM"]


def test_sigterm_handler_installed_later_owns_the_exit(tmp_path):
    """A handler installed after the session's (a graceful preemption checkpoint) replaces it:
    the session still dumps on SIGTERM but leaves the process alive for that handler."""
    import signal
    import time

    from meshtron.doctor import DoctorSession

    got: list = []
    session = DoctorSession(tmp_path, 0, 1, recorder=False).start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not (tmp_path / "rank_0.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert json.loads((tmp_path / "rank_0.json").read_text())["reason"] == "SIGTERM"
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
        session.close(final_dump=False)


@pytest.mark.slow
def test_frozen_rank_among_four_is_named(tmp_path):
    """The same on a 2 x 2 (dp, tp) mesh of 4 ranks: the last rank is SIGSTOPped."""
    try:
        run_on_ranks(doctor_faults.faulty_loop, 4, str(tmp_path), "frozen_rank", (2, 2),
                     ("dp", "tp"), timeout=90, backend="recorded")
    except (RankError, RankTimeout):
        pass
    d = diagnose(load_trace(tmp_path))
    assert (d.kind, d.culprit_ranks) == ("frozen_rank", [3]), d.to_dict()
    assert d.verdict.startswith("rank 3 (dp=1, tp=1) is frozen"), d.verdict
    _no_process_left(tmp_path)


def test_bare_version_banners_belong_to_their_own_nodes_log(tmp_path):
    """Audit s55: with NCCL_DEBUG=WARN (or VERSION) each node's rank prints a bare `NCCL
    version X` banner; the last file's banner was given to every process, so two nodes of
    NCCL 2.21.5 and 2.20.3 read as one version and no mismatch was flagged. Each node's log
    now dates its own processes; a merged log with two banners is flagged without names."""
    from testkit.cli_inproc import meshtron_main

    def node(host: str, pid: int, version: str, driver: str) -> str:
        edge = "via NET/Socket/0"
        return (f"[default0]:NCCL version {version}\n"
                f"[default0]:{host}:{pid}:{pid} [0] NCCL INFO cudaDriverVersion {driver}\n"
                f"[default0]:{host}:{pid}:{pid + 1} [0] NCCL INFO comm 0x1 rank "
                f"{pid % 2} nranks 2 cudaDev 0 busId 1000 commId 0xabc - Init START\n"
                f"[default0]:{host}:{pid}:{pid + 1} [0] NCCL INFO Channel 00/0 : 0[0] -> "
                f"1[0] [send] {edge}\n"
                f"[default0]:{host}:{pid}:{pid + 1} [0] NCCL INFO comm 0x1 rank {pid % 2} "
                "nranks 2 cudaDev 0 busId 1000 commId 0xabc - Init COMPLETE\n")

    a = tmp_path / "node-a.log"
    b = tmp_path / "node-b.log"
    a.write_text(node("node-a", 100, "2.21.5+cuda12.4", "12040"))
    b.write_text(node("node-b", 201, "2.20.3+cuda12.2", "12040"))
    rc, out, err = meshtron_main("doctor", "--nccl-log", a, b, "--json")
    assert rc == 3, err
    d = json.loads(out)
    assert d["versions"] == {"2.20.3+cuda12.2": 1, "2.21.5+cuda12.4": 1}, d["versions"]
    mixed = next(f["text"] for f in d["flags"] if f["code"] == "mixed_versions")
    assert "2.20.3+cuda12.2 on node-b:201; 2.21.5+cuda12.4 on node-a:100" in mixed, mixed
    merged = tmp_path / "merged.log"
    merged.write_text(a.read_text() + b.read_text())
    rc, out, _ = meshtron_main("doctor", "--nccl-log", merged)
    assert rc == 3 and "ranks run different NCCL versions" in out, out
    assert "NCCL versions: 2.20.3+cuda12.2 (a banner naming no process)" in out, out
    rc, out, _ = meshtron_main("doctor", "--nccl-log", a)  # one node, one banner: its own
    assert "NCCL versions: 2.21.5+cuda12.4 (1 process)" in out, out


def test_an_earlier_launch_is_not_judged_by_a_later_launchs_preemption(tmp_path):
    """Review s55: since `doctor --earlier N` reads the run's metrics.jsonl (8c3e4bd2), a
    launch every rank of which dumped for another reason (here an exception on both) took the
    `preempted` record of a later launch (signalled 100 s after it ended) as its own and read
    'preempted'. A record is this launch's when its signal (its time less
    seconds_after_signal) falls within the launch's dumps; its own still counts."""
    from meshtron.diagnose.endings import preempted
    from meshtron.diagnose.trace import Trace

    later = {"event": "preempted", "checkpoint_step": 40, "seconds_after_signal": 2.0,
             "grace_s": 30.0, "time": 1102.0}
    crashed = {r: {"time": 1000.0 + r, "reason": "exception: RuntimeError", "step": 12}
               for r in (0, 1)}
    trace = Trace(run_dir=tmp_path, world_size=2, dumps=crashed, hellos={}, abort=None,
                  metrics=[{"step": 12, "loss": 3.0}, later])
    assert preempted(trace) is None
    own = {"event": "preempted", "checkpoint_step": 12, "seconds_after_signal": 2.5,
           "grace_s": 30.0, "time": 1003.0}
    signalled = {r: {"time": 1000.0 + 0.2 * r, "reason": "SIGTERM", "step": 12} for r in (0, 1)}
    trace = Trace(run_dir=tmp_path, world_size=2, dumps=signalled, hellos={}, abort=None,
                  metrics=[own, later])
    ending = preempted(trace)
    assert ending is not None and "checkpoint of step 12 (2.5 s after" in ending.verdict, ending


def test_an_earlier_launch_reads_only_the_runs_preemptions(tmp_path):
    """Review s55: RUN/earlier/N holds no metrics.jsonl, and since 8c3e4bd2 it read all of the
    run's: later launches' steps (the straggler check's steady step times) and restarts (the
    attempt a restart resumed from) too. It reads only the `preempted` records, which
    endings.py matches to the launch by time."""
    from meshtron.diagnose.trace import _metrics

    run = tmp_path / "run"
    (run / "earlier" / "1").mkdir(parents=True)
    records = [{"step": 30, "loss": 3.1, "step_time_s": 0.5},
               {"event": "restart", "attempt": 1, "resumed_from_step": 20, "time": 900.0},
               {"event": "preempted", "checkpoint_step": 21, "seconds_after_signal": 1.0,
                "time": 800.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _metrics(run / "earlier" / "1") == [records[2]]
    assert _metrics(run) == records  # the run itself: everything
