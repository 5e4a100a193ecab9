"""`meshtron train --resume --steps N` with another N, and the run's id, through the `meshtron`
command in real processes and real files (meshtron/checkpoint/extend.py, run_id.py):

- a finished run extended where every step it took had the same learning rate under both
  train.steps (constant after warm-up; inside the warm-up) continues exactly as a run started
  with the larger N: the losses of metrics.jsonl are equal, on one process and on 2 ranks; the
  line it prints says so;
- where a step taken had another rate (the cosine decay had begun) it is refused in one line
  naming that step, exit 2, nothing written;
- run.toml's `train.run_id`: drawn for a new run, kept by --resume, new after --overwrite.

Suite time: the refusals and every one-process run go in-process through `meshtron.cli.main`
(the same argv, the same one-line / exit-2 / nothing-written checks; testkit/cli_inproc.py);
the 2-rank runs (`--resume` of a pp=2 run without a layout; slow) are the command in real processes.
The 7-step straight run is trained once for the module (`constant7`) and read by the extension
test and, copied, by the --overwrite test.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.config import OptimConfig
from testkit.cli_inproc import meshtron_main

RUN = ["--model", "debug", "--seq-len", "32", "--global-batch", "8", "--eval-every", "0"]
# every step after the 2-step warm-up at the peak rate: extending never changes a taken step
CONSTANT = [*RUN, "--warmup-steps", "2", "--set", "optim.min_lr_ratio=1.0"]


def _run(*argv, timeout=600):
    """`meshtron ARGV`: a 2-rank run (`--nproc`) through the command in its own processes; a
    one-process run in this one (testkit/cli_inproc.py: the same argv, exit code, lines and
    files, without a child's torch import)."""
    if "--nproc" not in argv:
        return meshtron_main(*argv)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshtron", *argv], capture_output=True,
                          text=True, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "event" not in r}


def _run_id(run_dir):
    return tomllib.loads((Path(run_dir) / "run.toml").read_text())["train"]["run_id"]


def _straight(run_dir, settings, steps, layout=()):
    code, _, err = _run("train", *settings, *layout, "--steps", str(steps), "--run-dir",
                        str(run_dir))
    assert code == 0, err[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def constant7(tmp_path_factory):
    """A straight 7-step CONSTANT run on one process (read only: copy it to change it)."""
    return _straight(tmp_path_factory.mktemp("constant") / "straight", CONSTANT, 7)


def _extend_equals_straight(tmp_path, settings, short, long, layout=(), resume_layout=None,
                            ref=None):
    """A `short`-step run resumed with --steps `long` (with `resume_layout`, default `layout`)
    against a straight `long`-step run (both on `layout`; `ref` if given, else trained here);
    the resume's stderr."""
    run_dir = tmp_path / "extended"
    ref = ref or _straight(tmp_path / "straight", settings, long, layout)
    code, _, err = _run("train", *settings, *layout, "--steps", str(short),
                        "--checkpoint-every", str(short), "--run-dir", str(run_dir))
    assert code == 0, err[-2000:]
    first_id = _run_id(run_dir)
    resume_layout = layout if resume_layout is None else resume_layout
    code, _, err = _run("train", *resume_layout, "--run-dir", str(run_dir), "--resume",
                        "--steps", str(long))
    assert code == 0, err[-2000:]
    want, got = _losses(ref), _losses(run_dir)
    assert sorted(got) == list(range(1, long + 1)), got
    assert got == want, (got, want)  # bit for bit: the same floats
    assert _run_id(run_dir) == first_id != _run_id(ref)  # kept by --resume; each run its own
    assert tomllib.loads((run_dir / "run.toml").read_text())["train"]["steps"] == long
    return err


def test_constant_after_warmup_extends_exactly_on_one_process(tmp_path, constant7):
    err = _extend_equals_straight(tmp_path, CONSTANT, 4, 7, ref=constant7)
    assert ("--resume: extending the run from train.steps=4 to 7: its 4 steps taken had the "
            "same learning rate under both, so steps 5-7 continue exactly as in a run started "
            "with --steps 7") in err, err


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_warmup_run_extends_exactly_on_two_ranks(tmp_path):
    """4 warm-up steps taken, then 2 of the longer run's cosine decay: the resumed ranks follow
    the new schedule (the old one ended at step 4), as the straight run does."""
    settings = [*RUN, "--warmup-steps", "4"]
    err = _extend_equals_straight(tmp_path, settings, 4, 6, ["--nproc", "2", "--plan", "dp=2"])
    assert "extending the run from train.steps=4 to 6" in err, err


# Slow (suite time, session 56: three 2-rank launches): tests/test_resume_world.py::
# test_resume_without_nproc_runs_on_the_recorded_ranks resumes a pp=2 run without a layout (and
# without --nproc) on the checkpoint's plan, bit for bit; the extension itself is
# test_constant_after_warmup_extends_exactly_on_one_process's.
@pytest.mark.slow
def test_resume_without_a_layout_continues_on_the_runs_plan(tmp_path):
    """A pp=2 run (the planner picks dp=2 for this model on 2 ranks) resumed with only
    `--nproc 2`: it continues on the checkpoint's plan, not on a new search (which would reshard to
    dp=2 silently), and equals the straight pp=2 run bit for bit."""
    run_dir = tmp_path / "extended"
    err = _extend_equals_straight(tmp_path, CONSTANT, 2, 4, ["--nproc", "2", "--plan", "pp=2"],
                                  ["--nproc", "2"])
    assert "--resume: continuing on the checkpoint's plan (tp=1,pp=2,dp=1 " in err, err
    assert tomllib.loads((run_dir / "plan.toml").read_text())["pp"] == 2


def _refused(capsys, *argv):
    """`meshtron ARGV` in this process: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_extending_past_the_decays_start_is_one_line_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "cosine"
    code, _, err = _run("train", *RUN, "--warmup-steps", "1", "--steps", "4",
                        "--checkpoint-every", "2", "--run-dir", str(run_dir))
    assert code == 0, err[-2000:]
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    code, out, err = _refused(capsys, "train", "--run-dir", str(run_dir), "--resume", "--steps",
                              "8")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    # steps 1 (warm-up) and 2 (the peak) agree; step 3 is the first the cosine moved
    lr3 = [2e-3 * OptimConfig(warmup_steps=1).lr_factor(2, n) for n in (4, 8)]
    assert ("--resume: train.steps=8: the checkpoint step_00000004 was saved at step 4 of a "
            "run with train.steps=4; the learning rate of its step 3 was "
            f"{lr3[0]:.4g} under train.steps=4 and {lr3[1]:.4g} under train.steps=8") in err
    assert "allowed: train.steps=4, --override-lr-schedule (step 5 on takes" in err, err
    assert "--init-from DIR --steps 8" in err and "Traceback" not in err, err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    # while a live run holds the folder, that is said first (session-52 user audit: the
    # schedule's refusal came instead); the holder claims it as a run does (train/run_lock.py)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from meshtron.train import "
                               f"run_lock; run_lock.claim({str(run_dir)!r}); print('held', "
                               "flush=True); sys.stdin.read()"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code, out, err = _refused(capsys, "train", "--run-dir", str(run_dir), "--resume",
                                  "--steps", "8")
    finally:
        holder.communicate("", timeout=60)
    assert code == 2 and err.strip().splitlines() == [
        f"meshtron train: error: train.run_dir={str(run_dir)!r}: a live run (pid {holder.pid}) "
        "is using it; wait for it to end or stop it, or choose another --run-dir"], err
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    code, _, err = _refused(capsys, "train", "--run-dir", str(run_dir), "--override-lr-schedule")
    assert code == 2 and "--override-lr-schedule: allowed only with --resume" in err, err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    # explicit: steps 5-8 on the 8-step schedule (Megatron-LM's --override-opt_param-scheduler)
    losses = _losses(run_dir)
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", "--steps", "8",
                        "--override-lr-schedule")
    assert code == 0, err[-2000:]
    assert ("extending the run from train.steps=4 to 8: --override-lr-schedule: steps 5-8 "
            "take the new schedule's rates (step 5: ") in err, err
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in lines if "event" not in r}
    assert sorted(lr) == list(range(1, 9)) and {s: _losses(run_dir)[s] for s in losses} == losses
    for step in (5, 8):
        assert lr[step] == pytest.approx(2e-3 * OptimConfig(warmup_steps=1).lr_factor(step - 1, 8),
                                         rel=1e-12), lr


def test_overwrite_draws_a_new_run_id(tmp_path, constant7):
    """The first run is a copy of the module's finished run (a new run drew its id), the second
    a --overwrite launch over it."""
    run_dir = tmp_path / "r"
    shutil.copytree(constant7, run_dir)
    ids = []
    for extra in (None, ["--overwrite"]):
        if extra:
            code, _, err = _run("train", *RUN, "--steps", "1", "--run-dir", str(run_dir),
                                *extra)
            assert code == 0, err[-2000:]
        ids.append(_run_id(run_dir))
        config = json.loads((run_dir / "config.json").read_text())
        assert config["train"]["run_id"] == ids[-1]  # the folder agrees with itself
    assert tomllib.loads((run_dir / "run.toml").read_text())["train"]["steps"] == 1
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids), ids


def test_a_refused_extension_shows_rates_that_differ(tmp_path, capsys):
    """Session-52 user audit: a run resumed with another --steps just after its warm-up was
    refused because "the learning rate of its step 22 was 0.002 under train.steps=400 and 0.002
    under train.steps=150": the rates differed past the 4 digits shown. Here a cosine that decays
    by 1e-4 of the peak (the same closeness, 4 steps trained in this process)."""
    run_dir = tmp_path / "flat"
    assert main(["train", *RUN, "--warmup-steps", "1", "--set", "optim.min_lr_ratio=0.9999",
                 "--steps", "4", "--checkpoint-every", "4", "--run-dir", str(run_dir)]) == 0
    code, out, err = _refused(capsys, "train", "--run-dir", str(run_dir), "--resume", "--steps",
                              "8")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    optim = OptimConfig(warmup_steps=1, min_lr_ratio=0.9999)
    lr3 = [2e-3 * optim.lr_factor(2, n) for n in (4, 8)]
    assert f"{lr3[0]:.4g}" == f"{lr3[1]:.4g}"  # what the line showed: the same number twice
    shown = re.search(r"its step 3 was (\S+) under train.steps=4 and (\S+) under "
                      r"train.steps=8", err)
    assert shown and shown[1] != shown[2], err
    assert [float(x) for x in shown.groups()] == pytest.approx(lr3, rel=1e-6), (shown, lr3)
