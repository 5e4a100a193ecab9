"""A `meshtron train --replica-ft` run folder holds what every run's does (run.toml, config.json,
metrics.jsonl as steps commit, summary.json), and the commands that read a run folder answer
for it: through the `meshtron` command, real replica-group processes and a real SIGKILL of the
launcher. A finished run's final state is a committed checkpoint that `meshtron export` reads."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtron.cli import main
from meshtron.config import config_from_dict, load_toml
from meshtron.train.loop import train

RUN = ["--model", "tiny", "--global-batch", "4", "--seq-len", "32", "--eval-every", "0",
       "--replica-ft", "2"]
LOOP_FIELDS = {"step", "loss", "lr", "step_time_s", "tokens_per_s", "grad_norm"}
"""What the single-process loop writes per logged step (meshtron/train/loop.py; clipping on)."""


def _meshtron(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _train_here(monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """`meshtron train ARGS` through `meshtron.cli.main` in this process (testkit/cli_inproc.py:
    the test reads only its exit code, output and files; suite time, session 57: the launcher
    imports torch and torchft, ~3 CPU s a child, which this process holds already). The groups
    are processes of their own as in every run; the launcher's RUST_LOG is put back after."""
    from testkit.cli_inproc import meshtron_main

    monkeypatch.setenv("RUST_LOG", os.environ.get("RUST_LOG", "error"))
    code, out, err = meshtron_main("train", *args)
    return subprocess.CompletedProcess(["meshtron", "train", *args], code, out, err)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in \
        Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _refused(capsys, argv: list[str], needle: str) -> None:
    """`meshtron ARGV` (in this process: torch is imported once) refuses in one line, exit 2."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_a_finished_replica_ft_run_folder_holds_what_every_run_writes(tmp_path, capsys,
                                                                       monkeypatch):
    """A short run (3 steps, 2 groups; about 15 s idle): metrics with the loop's fields and
    its evaluation, summary.json, run.toml, the final checkpoint that export reads; a rerun
    needs --overwrite and --resume is refused. The killed runs are `slow`."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    done = _train_here(monkeypatch, *RUN, "--steps", "3", "--eval-every", "3",
                       "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    records = _lines(metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    # the loop's evaluation, on the whole held-out set: the single-process run's eval_loss
    # (float tolerance: the mean of two half-batch gradients)
    ref = train(config_from_dict({"model": "tiny", "data": {"global_batch": 4, "seq_len": 32},
                                  "train": {"steps": 3, "eval_every": 3,
                                            "run_dir": str(tmp_path / "ref")}}),
                show_progress=False).records
    assert records[-1]["eval_loss"] == pytest.approx(ref[-1]["eval_loss"], rel=1e-5)
    assert records[-1].keys() - {"participants"} == ref[-1].keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_loss"] == records[-1]["loss"]
    assert summary["replica_groups"] == 2 and summary["degraded_steps"] == 0
    assert summary["tokens"] == 3 * 4 * 32 and summary["tokens_per_s"] > 0
    assert config_from_dict(load_toml(run_dir / "run.toml")).train.steps == 3
    # its final state is a committed checkpoint (the groups' final weights, bit for bit), which
    # export reads; --resume is still refused
    from meshtron.checkpoint.export import load_checkpoint

    saved = load_checkpoint(run_dir / "checkpoints" / "step_00000003")
    final = torch.load(run_dir / "replica_ft" / "group0_final.pt")
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in final)
    assert main(["export", str(run_dir), "--to", str(tmp_path / "hf")]) == 0
    assert "exported step 3" in capsys.readouterr().out
    _refused(capsys, ["train", "--resume", "--run-dir", str(run_dir)], "does not resume")
    _refused(capsys, ["train", *RUN, "--steps", "3", "--run-dir", str(run_dir)],
             "holds a run")


@pytest.mark.slow  # 40-140 s under load: a streamed run, a real SIGKILL of its launcher
def test_a_killed_replica_ft_run_leaves_a_run_folder_and_every_command_answers(tmp_path,
                                                                                   capsys):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "meshtron", "train", *RUN, "--steps", "2000",
         "--run-dir", str(run_dir)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    try:
        # streamed: records while the run goes on, before any summary
        _wait(lambda: metrics.is_file() and len(_lines(metrics)) >= 3, 240, "3 metrics records")
        assert launcher.poll() is None and not (run_dir / "summary.json").exists()
        groups = json.loads((run_dir / "replica_ft" / "pids.json").read_text()).values()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    # no group outlives its launcher, so nothing writes the folder afterwards
    _wait(lambda: not any(_alive(pid) for pid in groups), 30, "the groups to die")
    records = _lines(metrics)
    time.sleep(0.5)
    assert _lines(metrics) == records
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert all(LOOP_FIELDS <= r.keys() and r["participants"] == 2 for r in records), records[0]
    # each record is a step some group committed (the quorum's all-reduced loss, any group's)
    logged = {(r["step"], r["loss"]) for path in (run_dir / "replica_ft").glob("group*.jsonl")
              for r in _lines(path)}
    assert {(r["step"], r["loss"]) for r in records} <= logged
    cfg = config_from_dict(load_toml(run_dir / "run.toml"))
    assert cfg.train.replica_ft == 2 and cfg.train.steps == 2000
    assert json.loads((run_dir / "config.json").read_text())["train"]["replica_ft"] == 2

    _refused(capsys, ["train", "--resume", "--run-dir", str(run_dir)],
             "holds a replica-FT run (train.replica_ft=2)")
    _refused(capsys, ["train", *RUN, "--steps", "3", "--resume", "--run-dir", str(run_dir)],
             "holds a replica-FT run")
    _refused(capsys, ["train", *RUN, "--steps", "3", "--run-dir", str(run_dir)],
             "holds a run (metrics.jsonl)")
    _refused(capsys, ["doctor", str(run_dir)], "no trace")
    _refused(capsys, ["export", str(run_dir), "--to", str(tmp_path / "hf")],
             "no complete checkpoint")
    _refused(capsys, ["merge", "--experts", str(run_dir), "--copies", "2", "--to",
                      str(tmp_path / "moe")], "the run saved no checkpoint")

    # the folder is free again (the lock died with the groups): a new run replaces the old
    done = _meshtron("train", *RUN, "--steps", "3", "--overwrite", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in _lines(metrics)] == [1, 2, 3]


@pytest.mark.slow  # 30-60 s under load: two replica groups SIGKILLed mid-run
def test_every_group_killed_ends_the_metrics_with_a_failed_record(tmp_path):
    """Both replica groups SIGKILLed (no restart budget): the launcher fails in one line, exit
    1, and metrics.jsonl keeps the committed steps, then a `failed` record; nothing of the
    run is left alive and the folder is free for the next run."""
    from meshtron.train import run_lock

    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "meshtron", "train", *RUN, "--steps", "2000",
         "--run-dir", str(run_dir)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait(lambda: metrics.is_file() and len(_lines(metrics)) >= 2, 240, "2 metrics records")
        for pid in json.loads((run_dir / "replica_ft" / "pids.json").read_text()).values():
            os.kill(pid, signal.SIGKILL)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 1, (out, err)
    assert "every replica group died" in err and "Traceback" not in err, err
    records = _lines(metrics)
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    assert records[-1]["event"] == "failed" and records[-1]["steps_committed"] == steps[-1]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "checkpoints").exists()
    run_lock.check_free(run_dir)  # raises while any process of the run holds the folder



def test_a_run_whose_final_checkpoint_was_not_committed_fails(tmp_path):
    """The group that claims the final checkpoint (the first to finish) is the only one that
    writes it: if it fails, the launcher's check finds no committed step_N and the run fails
    in one line instead of finishing without the checkpoint that export and merge read (a
    partial one, never committed, does not count)."""
    from meshtron.checkpoint import store
    from meshtron.errors import RunFailed
    from meshtron.train.replica_run import check_final_checkpoint

    run_dir = tmp_path / "run"
    cfg = config_from_dict({"model": "tiny", "train": {"steps": 3, "replica_ft": 2,
                                                        "run_dir": str(run_dir)}})
    root = store.checkpoint_root(run_dir)
    (root / (store.TMP_PREFIX + "step_00000003")).mkdir(parents=True)
    (root / "step_00000002").mkdir()
    with pytest.raises(RunFailed) as err:
        check_final_checkpoint(cfg, run_dir / "replica_ft")
    assert "checkpoints/step_00000003" in str(err.value) and "\n" not in str(err.value)
    (root / "step_00000003").mkdir()
    check_final_checkpoint(cfg, run_dir / "replica_ft")


def test_a_diverged_replica_ft_run_fails_as_the_loop_does(tmp_path, monkeypatch):
    """A NaN loss at a logging point: the loop's one line ("loss became nan at step N"), exit
    1, the groups stopped, metrics.jsonl without the NaN record and ending in a `failed`
    record, no summary.json or checkpoint (not a finished run of NaN weights). About 15 s."""
    from meshtron.train import run_lock

    run_dir = tmp_path / "run"
    # 500 steps: the groups are stopped long before the end (they would save a checkpoint)
    done = _train_here(monkeypatch, *RUN, "--steps", "500", "--log-every", "1", "--lr",
                       "1e30", "--run-dir", str(run_dir))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "loss became nan at step 3" in done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr
    records = _lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records[:-1]] == [1, 2], records
    assert records[-1]["event"] == "failed" and "loss became nan" in records[-1]["cause"]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "checkpoints").exists()
    run_lock.check_free(run_dir)
