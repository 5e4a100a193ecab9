"""`--resume` keeps the run's own settings, and a damaged checkpoint skipped is always said.

Through the `meshtron` command, in real processes, with real files and signals:
- a run SIGTERM'ed (checkpoint every 2 steps), then `meshtron train --run-dir R --resume` and
  nothing else: the recorded settings (model, batch, steps, checkpoint interval) are used, the
  rest of the run equals an uninterrupted one and its last step is saved; run.toml and
  config.json say the same;
- a DiLoCo run on 2 ranks resumed without `--diloco` continues as DiLoCo (it used to switch to
  plain data parallelism), exactly; another `--diloco` is refused in one line;
- `meshtron export` and `meshtron merge` say which damaged checkpoint they skipped; merge.json
  records each branch's step.
The refusals of contradicted settings on one process: tests/test_checkpoint.py.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from meshtron.checkpoint import resume_fields, store
from meshtron.checkpoint.config import CheckpointConfig
from meshtron.config import DataConfig, OptimConfig, TrainConfig
from meshtron.planner.plan import Plan

RUN = ["--model", "debug", "--seq-len", "32", "--global-batch", "8", "--eval-every", "0",
       "--steps", "8"]


def test_every_setting_has_a_resume_decision():
    """A new field of the run config, the checkpoint flags or the plan fails here until
    resume_fields.FIELDS says what --resume does with it (and a removed one until dropped)."""
    fields = {"model"}
    for section, cls in (("data", DataConfig), ("optim", OptimConfig), ("train", TrainConfig),
                         ("checkpoint", CheckpointConfig), ("plan", Plan)):
        fields |= {f"{section}.{f.name}" for f in dataclasses.fields(cls)}
    assert set(resume_fields.FIELDS) == fields, set(resume_fields.FIELDS) ^ fields
    allowed = {resume_fields.KEEP, resume_fields.FOLLOW, resume_fields.EXTEND,
               resume_fields.LAYOUT, resume_fields.ARG}
    assert all(d in allowed and why for d, why in resume_fields.FIELDS.values())


def _meshtron(*argv, command=(sys.executable, "-m", "meshtron"), **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([*command, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def _run(*argv, timeout=600, command=(sys.executable, "-m", "meshtron")):
    """`command` testkit.no_torch.COMMAND: the launcher may not import torch."""
    proc = _meshtron(*argv, command=command)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "event" not in r}


def _stop_after(run_dir, step, proc, timeout=300):
    path, deadline = Path(run_dir) / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and step in _losses(run_dir):
            proc.send_signal(signal.SIGTERM)
            return proc.communicate(timeout=timeout)
        time.sleep(0.02)
    raise AssertionError(f"step {step} never logged: {proc.communicate()}")


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_preempted_run_resumes_with_its_own_settings(tmp_path):
    ref = tmp_path / "ref"
    code, _, err = _run("train", *RUN, "--checkpoint-every", "2", "--run-dir", str(ref))
    assert code == 0, err[-2000:]
    run_dir = tmp_path / "preempted"
    proc = _meshtron("train", *RUN, "--checkpoint-every", "2", "--run-dir", str(run_dir))
    _, err = _stop_after(run_dir, 3, proc)
    assert proc.returncode == 75 and "continue with --resume" in err, err[-2000:]
    # exactly what the message says, and a setting that may change (the metrics period)
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", "--log-every", "2")
    assert code == 0, err[-2000:]
    root = store.checkpoint_root(run_dir)
    assert store.committed(root)[0][0] == 8  # saved every 2 steps as recorded (was: nothing)
    meta = store.read_meta(root / store.step_name(8))
    assert meta["checkpoint"]["every"] == 2 and meta["config"]["data"]["global_batch"] == 8
    want, got = _losses(ref), _losses(run_dir)
    assert set(got) >= {2, 4, 6, 8} and all(got[s] == want[s] for s in got), (got, want)
    # the run folder agrees with itself: run.toml and config.json are the resumed run's
    run_toml = tomllib.loads((run_dir / "run.toml").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    for section in ("data", "optim", "train"):
        assert {k: v for k, v in config[section].items() if v is not None} == \
            run_toml[section], section
    assert run_toml["train"]["log_every"] == 2 and run_toml["model"]["name"] == "debug"


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_diloco_run_resumed_without_its_flag_stays_diloco(tmp_path):
    layout = ["--nproc", "2", "--plan", "dp=2", "--steps", "6"]
    ref = tmp_path / "ref"
    code, _, err = _run("train", *RUN, *layout, "--diloco", "4", "--checkpoint-every", "2",
                        "--run-dir", str(ref))
    assert code == 0, err[-2000:]
    run_dir = tmp_path / "resumed"
    shutil.copytree(ref, run_dir)
    for step in (6, 4):  # resume inside the first DiLoCo round (replicas apart)
        shutil.rmtree(store.checkpoint_root(run_dir) / store.step_name(step))
    code, _, err = _run("train", *RUN, *layout, "--run-dir", str(run_dir), "--resume")
    assert code == 0, err[-2000:]
    assert "inside a DiLoCo round" not in err and "resumed from" in err
    assert _losses(run_dir) == _losses(ref)
    assert "diloco = 4" in (run_dir / "plan.toml").read_text()
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    code, _, err = _run("train", *RUN, *layout, "--run-dir", str(run_dir), "--resume",
                        "--diloco", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "plan.diloco=2" in err and "plan.diloco=4" in err and "--diloco 4" in err, err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_export_and_merge_say_the_damaged_checkpoint_they_skip(tmp_path):
    for name, lr in (("a", "0.001"), ("b", "0.002")):
        code, _, err = _run("train", *RUN, "--steps", "4", "--lr", lr, "--checkpoint-every",
                            "2", "--run-dir", str(tmp_path / name))
        assert code == 0, err[-2000:]
    shard = sorted((store.checkpoint_root(tmp_path / "a") / "step_00000004").glob("*.distcp"))[0]
    os.truncate(shard, 100)
    code, out, err = _run("export", str(tmp_path / "a"), "--to", str(tmp_path / "x"))
    assert code == 0 and "exported step 2" in out, err
    line, = err.strip().splitlines()
    assert line.startswith("meshtron export: checkpoint step_00000004 is damaged") \
        and "truncated" in line and "using step_00000002" in line, line
    code, out, err = _run("merge", "--experts", str(tmp_path / "a"), str(tmp_path / "b"),
                          "--to", str(tmp_path / "m"))
    assert code == 0, err
    line, = err.strip().splitlines()
    assert line.startswith(f"meshtron merge: {tmp_path / 'a'}: checkpoint step_00000004 is "
                           "damaged") and "using step_00000002" in line, line
    branches = json.loads((tmp_path / "m" / "merge.json").read_text())["branches"]
    assert [(b["step"], b["checkpoint"]) for b in branches] == [(2, "step_00000002"),
                                                                 (4, "step_00000004")]
