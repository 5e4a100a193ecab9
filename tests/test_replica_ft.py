"""Replica fault tolerance (meshtron/train/replica.py, torchft) with real processes and a real
SIGKILL, and the goodput arithmetic of meshtron/reliability/goodput.py."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.errors import UserError
from meshtron.reliability import expected_wall_s, first_order_overhead_fraction
from meshtron.reliability.goodput import (RECOVERY_FILE, RecoveryTimes, checkpoint_goodput,
                                          goodput_table, load_recovery_times, replica_goodput,
                                          update_recovery_file)

RUN = ["--model", "tiny", "--global-batch", "4", "--seq-len", "32", "--eval-every", "0"]
STEPS = 120  # long enough for the replacement to rejoin before the survivor finishes


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _start_replica_run(run_dir: Path, steps: int) -> subprocess.Popen:
    """`meshtron train --replica-ft 2 --max-restarts 1` on the tiny model, output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "meshtron", "train", *RUN, "--steps", str(steps),
         "--replica-ft", "2", "--max-restarts", "1", "--run-dir", str(run_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def _kill_group1_after(run_dir: Path, steps: int, what: str) -> None:
    """SIGKILL replica group 1 once its first attempt has logged `steps` steps."""
    g1 = run_dir / "replica_ft" / "group1_0.jsonl"
    _wait(lambda: g1.exists() and len(g1.read_text().splitlines()) >= steps, 240, what)
    pid = json.loads((run_dir / "replica_ft" / "pids.json").read_text())["1"]
    os.kill(pid, signal.SIGKILL)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow  # ~30 s idle, 409 s under load: a real torchft Lighthouse + SIGKILL
def test_replica_ft_steps_through_a_killed_group_and_the_rejoined_weights_are_equal(tmp_path):
    """Two replica groups; group 1 is SIGKILLed after step 3. Group 0 keeps stepping (alone)
    with no restart, a replacement for group 1 copies the live state and rejoins, and at the
    end both groups hold bit-identical weights. The steps both groups ran before the kill
    match the single-process run on the same seed and global batch (float tolerance: the mean
    of two half-batch gradients)."""
    import torch

    from meshtron.config import config_from_dict
    from meshtron.train.loop import train

    run_dir = tmp_path / "run"
    proc = _start_replica_run(run_dir, STEPS)
    try:
        _kill_group1_after(run_dir, 3, "group 1's third step")
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    events = _records(run_dir / "replica_ft" / "events.jsonl")
    assert {"event": "exit", "group": 1, "attempt": 0, "rc": -signal.SIGKILL}.items() <= \
        next(e for e in events if e["event"] == "exit" and e["group"] == 1).items()
    survivor = _records(run_dir / "replica_ft" / "group0_0.jsonl")
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1))  # no step lost or redone
    parts = [r["participants"] for r in survivor]
    assert 1 in parts, "group 0 never stepped alone: the kill was not survived"
    rejoined = _records(run_dir / "replica_ft" / "group1_1.jsonl")
    assert rejoined and rejoined[0]["step"] > 3, rejoined[:1]
    assert all(r["participants"] == 2 for r in rejoined)
    assert parts[-1] == 2
    a = torch.load(run_dir / "replica_ft" / "group0_final.pt")
    b = torch.load(run_dir / "replica_ft" / "group1_final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    full = [r for r in survivor if r["participants"] == 2 and r["step"] <= 3]
    assert [r["step"] for r in full] == [1, 2, 3]
    cfg = config_from_dict({"model": "tiny", "data": {"global_batch": 4, "seq_len": 32},
                            "train": {"steps": 3, "eval_every": 0,
                                      "run_dir": str(tmp_path / "ref")}})
    ref = train(cfg, show_progress=False).records
    for got, want in zip(full, ref):
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-5), (got, want)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["degraded_steps"] == parts.count(1) > 0
    # metrics.jsonl went on through the kill: every step once, the survivor's losses and quorum
    metrics = _records(run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["participants"]) for r in metrics] == \
        [(r["step"], r["loss"], r["participants"]) for r in survivor]
    assert summary["final_loss"] == metrics[-1]["loss"] and summary["steps"] == STEPS


@pytest.mark.parametrize("argv,needle", [
    (["train", *RUN, "--replica-ft", "1"], "train.replica_ft=1"),
    (["train", *RUN, "--replica-ft", "3"], "train.replica_ft=3: must divide"),
    (["train", *RUN, "--replica-ft", "2", "--nproc", "2"], "train.replica_ft=2: runs one"),
    # user audit: both flags were accepted and no checkpoint was ever written
    (["train", *RUN, "--replica-ft", "2", "--checkpoint-every", "5"],
     "train.replica_ft=2: keeps no disk checkpoint"),
    (["train", *RUN, "--replica-ft", "2", "--snapshot-every", "2"], "drop --snapshot-every=2"),
    (["cost", "--model", "llama3-8b", "--cluster", "dgx-h100:8", "--global-batch", "64",
      "--seq-len", "4096", "--replica-groups", "65"], "replica-groups=65"),
    # audit s54: 3 replica groups of a plan's dp (1, 2, 4 or 8 on 8 GPUs) is no layout,
    # and was priced as one
    (["cost", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
      "--seq-len", "4096", "--replica-groups", "3"], "ranks cannot form 3 replica groups"),
    (["simulate", "--step", "--model", "llama3-8b", "--cluster", "dgx-h100:1",
      "--global-batch", "64", "--seq-len", "4096", "--replica-groups", "3"],
     "ranks cannot form 3 replica groups"),
    (["simulate", "--model", "llama3-8b", "--global-batch", "64", "--seq-len", "4096",
      "--mtbf-hours", "2"], "mtbf-hours=2.0: applies to --step only"),
    (["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100:8", "--global-batch", "64",
      "--seq-len", "4096", "--step", "--mtbf-hours", "-1"], "--mtbf-hours: '-1'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle, tmp_path):
    code = main([*argv, "--run-dir", str(tmp_path / "r")] if argv[0] == "train" else argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


TIMES = RecoveryTimes(restart_from_disk_s=30.0, in_memory_s=6.0, replica_stall_s=2.0,
                      replica_rejoin_s=20.0, source="test")


def test_replica_goodput_is_the_lost_seconds_per_failure_over_the_mtbf():
    # L = stall + step/2 + rejoin/G = 2 + 0.5 + 20/4 = 7.5 s per failure; M = 3600 s
    g, lost = replica_goodput(step_s=1.0, mtbf_s=3600.0, groups=4, stall_s=2.0, rejoin_s=20.0)
    assert lost == 7.5 and g == pytest.approx(1 - 7.5 / 3600, rel=1e-12)
    assert replica_goodput(1.0, 5.0, 2, 10.0, 10.0)[0] == 0.0  # never negative


def test_checkpoint_goodput_is_daly_and_matches_the_first_order_terms_at_low_rates():
    g, tau = checkpoint_goodput(step_s=2.0, mtbf_s=1e6, save_s=10.0, recovery_s=60.0)
    assert g == pytest.approx(1 / expected_wall_s(1.0, tau, 10.0, 1e6, 60.0), rel=1e-12)
    first = first_order_overhead_fraction(tau, 10.0, 1e6, 60.0)
    assert 1 / g - 1 == pytest.approx(first, rel=0.02)
    g0, tau0 = checkpoint_goodput(step_s=2.0, mtbf_s=1e6, save_s=0.0, recovery_s=60.0)
    assert tau0 == 2.0 and g0 > g  # a free snapshot every step beats the disk checkpoint


def test_goodput_table_orders_the_strategies_and_counts_the_state_transfer():
    rows = goodput_table(step_s=5.0, mtbf_s=3 * 3600, params=70e9, gpus=1024, save_s=8.4,
                         replica_groups=8, times=TIMES, peer_gb_per_s=25.0)
    by = {r.name: r for r in rows}
    assert list(by) == ["restart_from_disk", "in_memory", "replica_ft"]
    assert by["restart_from_disk"].recovery_s == pytest.approx(30.0 + 8.4)
    # 12 bytes x 70e9 / 1024 GPUs at 25 GB/s = 0.0328 s per GPU shard
    assert by["in_memory"].recovery_s == pytest.approx(6.0 + 12 * 70e9 / 1024 / 25e9)
    assert by["replica_ft"].recovery_s == pytest.approx(20.0 + 12 * 70e9 * 8 / 1024 / 25e9)
    assert by["restart_from_disk"].goodput < by["in_memory"].goodput < by["replica_ft"].goodput
    one = goodput_table(5.0, 3 * 3600, 70e9, 1024, 8.4, 1, TIMES)[2]
    assert one.goodput is None and "replica groups" in one.note


def test_recovery_times_file_is_packaged_and_checked(tmp_path):
    times = load_recovery_times()
    assert times.restart_from_disk_s > 0 and times.source
    # every packaged value says which bench measured it (not an assumption)
    for name, bench in (("restart_from_disk_s", "bench/recovery.py"),
                        ("in_memory_s", "bench/recovery.py"),
                        ("replica_stall_s", "bench/chaos.py"),
                        ("replica_rejoin_s", "bench/chaos.py")):
        assert times.sources[name].startswith(bench), (name, times.sources[name])
    mine = tmp_path / "mine.toml"
    mine.write_text(RECOVERY_FILE.read_text())
    update_recovery_file(mine, {"in_memory_s": (1.25, 'bench "x" today')})
    again = load_recovery_times(mine)
    assert again.in_memory_s == 1.25 and again.sources["in_memory_s"] == "bench 'x' today"
    assert again.restart_from_disk_s == times.restart_from_disk_s
    assert again.sources["replica_rejoin_s"] == times.sources["replica_rejoin_s"]
    bad = tmp_path / "r.toml"
    bad.write_text("restart_from_disk_s = -1\nin_memory_s = 1\nreplica_stall_s = 1\n"
                   "replica_rejoin_s = 1\n")
    with pytest.raises(UserError, match="restart_from_disk_s=-1"):
        load_recovery_times(bad)


def test_cost_reports_goodput_for_the_three_strategies(capsys):
    code = main(["cost", "--model", "llama3-8b", "--cluster", "dgx-h100:64",
                 "--global-batch", "512", "--seq-len", "8192", "--tokens", "1T", "--runs",
                 "100", "--mtbf-hours", "2", "--replica-groups", "4", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["goodput"]["strategies"]
    assert doc["goodput"]["mtbf_s"] == pytest.approx(7200.0)
    assert set(s) == {"restart_from_disk", "in_memory", "replica_ft"}
    assert all(0 < s[k]["goodput"] < 1 for k in s)


@pytest.mark.slow  # a real torchft Lighthouse + SIGKILL, as above
def test_a_replacement_that_never_rejoined_is_reported_in_one_line(tmp_path):
    """Group 1 is SIGKILLed two steps before the end (user audit: 30 steps, killed at 10 of a
    fast run): its replacement finds no live peer left and exits NO_PEER_EXIT. The run still
    finishes on group 0, and its output says in one line that the replacement never rejoined
    (before: silence; only events.jsonl had rc 3)."""
    from meshtron.train.replica import NO_PEER_EXIT

    steps = 12
    run_dir = tmp_path / "run"
    proc = _start_replica_run(run_dir, steps)
    try:
        _kill_group1_after(run_dir, steps - 2, "group 1's step before the last two")
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    exits = [e for e in _records(run_dir / "replica_ft" / "events.jsonl")
             if e["event"] == "exit" and e["group"] == 1]
    if exits[-1]["rc"] != NO_PEER_EXIT:
        pytest.skip(f"the replacement rejoined in time under this load: {exits}")
    lines = [x for x in out.splitlines() if "never rejoined" in x]
    assert lines == [f"replica-ft: group 1's replacement (attempt 1) never rejoined: the other "
                     f"groups had finished, leaving no live state to copy (exit {NO_PEER_EXIT}); "
                     "the run's steps after its failure were taken without it"], out[-2000:]
