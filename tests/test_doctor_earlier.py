"""A manual `--resume` keeps the evidence of the launch it follows (meshtron/train/earlier.py).

- Through the `meshtron` command, real processes: a 2-rank run whose rank 1 is SIGKILLed after
  its first checkpoint; `--resume` moves trace/ and attempts/ into RUN/earlier/1 before its
  ranks start and completes the run; `meshtron doctor RUN` judges the resumed launch (healthy,
  exit 0) and says in one line that launch 1 is kept and how to read it; `meshtron doctor RUN
  --earlier 1` gives the first launch's verdict (rank 1 killed by SIGKILL, the checkpoint the
  resume continued from, exit 3).
- The archive itself on real files: the next free N, renames only, nothing kept when nothing
  was left, a later resume never overwriting an earlier archive.
- `--earlier N` that is not there: one line, exit 2.
- A one-process `--overwrite` over that folder takes its trace and earlier launches with it:
  the doctor says it is a one-process run instead of judging the old 2-rank run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshtron.checkpoint import store
from meshtron.train import earlier
from testkit.cli_inproc import meshtron_main
from testkit.procs import rank_pids, records

TRAIN = [sys.executable, "-m", "meshtron", "train", "--nproc", "2", "--plan", "dp=2",
         "--model", "debug", "--seq-len", "32", "--global-batch", "8", "--eval-every", "0",
         "--warmup-steps", "200"]
"""Every step of the run inside the learning-rate warm-up: its rate does not depend on
train.steps, so the resume may end the run sooner than the killed launch would have
(meshtron/checkpoint/extend.py) wherever the kill landed."""
ONE_PROCESS = ["train", "--model", "debug", "--seq-len", "32", "--global-batch", "8",
               "--eval-every", "0", "--steps", "2"]
"""A one-process run, in this process (testkit/cli_inproc.py: no child's torch import)."""
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", "doctor", *args],
                          capture_output=True, text=True, timeout=60)


def _kill_rank_1_after_first_checkpoint(run_dir: Path) -> None:
    proc = subprocess.Popen([*TRAIN, "--steps", "200", "--checkpoint-every", "3", "--run-dir",
                             str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    deadline = time.monotonic() + 150
    while not ((run_dir / "checkpoints" / "step_00000003").is_dir()
               and len(rank_pids(run_dir)) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode != 0, out[-3000:]


def test_resume_keeps_the_killed_launch_for_doctor(tmp_path):
    run_dir = tmp_path / "run"
    _kill_rank_1_after_first_checkpoint(run_dir)
    first_hello = json.loads((run_dir / "trace" / "rank_1.hello.json").read_text())
    before = _doctor(str(run_dir), "--json")
    assert before.returncode == 3, before.stdout + before.stderr

    # 3 steps after the checkpoint it continues from, without a save every 3 steps (test time:
    # the 197 steps left of 200 cost ~13 CPU s on 2 ranks; the interval follows the command)
    last = max(step for step, _ in store.committed(store.checkpoint_root(run_dir)))
    resumed = subprocess.run([*TRAIN, "--steps", str(last + 3), "--run-dir", str(run_dir),
                              "--resume", "--checkpoint-every", "1000"],
                             capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    kept = run_dir / "earlier" / "1"
    assert f"kept in {kept}" in resumed.stdout, resumed.stdout[-3000:]
    # the first launch's files, as they were: its hello files and torchrun's view of its end
    assert json.loads((kept / "trace" / "rank_1.hello.json").read_text()) == first_hello
    assert (kept / "attempts" / "attempt_0" / "exits.json").is_file()
    new_hello = json.loads((run_dir / "trace" / "rank_1.hello.json").read_text())
    assert new_hello["pid"] != first_hello["pid"]
    resume = next(r for r in records(run_dir) if r.get("event") == "resume")
    assert resume["resumed_from_step"] == last
    assert [r["step"] for r in records(run_dir) if "loss" in r][-1] == last + 3
    assert json.loads((kept / "resumed.json").read_text()) == {
        "resumed_from_step": resume["resumed_from_step"]}

    now = _doctor(str(run_dir))  # the current launch: finished, healthy
    assert now.returncode == 0, now.stdout + now.stderr
    assert now.stdout.splitlines()[-1] == (
        f"earlier launches (before a --resume): 1, kept in {run_dir / 'earlier'}; the one just "
        f"before this: meshtron doctor {run_dir} --earlier 1"), now.stdout
    doc = json.loads(_doctor(str(run_dir), "--json").stdout)
    assert doc["kind"] == "none" and doc["earlier"] == {"1": str(kept)}, doc

    then = _doctor(str(run_dir), "--earlier", "1", "--json")
    first = json.loads(then.stdout)
    assert then.returncode == 3 and first["kind"] == "dead_rank", first
    # "killed by SIGKILL" when torchrun's agent logged rank 1's end first, else "its process is
    # gone" (test_survive_causes.py: the agent logs one failure per attempt)
    assert first["culprit_ranks"] == [1] and first["verdict"].startswith("rank 1 "), first
    assert f"the last complete checkpoint is step {resume['resumed_from_step']}" \
        in first["verdict"], first
    assert first["verdict"] == json.loads(before.stdout)["verdict"]

    # A one-process run started over the folder (--overwrite) replaces that run whole: its
    # trace and earlier launches went with it, where the doctor judged the old 2-rank run as
    # this one ("exit at step 200", exit 0; session-52 user audit).
    code, out, err = meshtron_main(*ONE_PROCESS, "--run-dir", str(run_dir), "--overwrite")
    assert code == 0, out[-3000:] + err[-3000:]
    assert not earlier.root(run_dir).exists()
    assert not any((run_dir / "trace").glob("rank_*")) and not (run_dir / "attempts").exists()
    after = _doctor(str(run_dir))
    assert after.returncode == 2 and not after.stdout, after.stdout + after.stderr
    assert after.stderr.strip().splitlines() == [
        f"meshtron doctor: error: RUN_DIR={str(run_dir)!r}: a one-process run (trained without "
        "--nproc or --plan): it has no ranks and records no collectives, so there is no trace "
        "to read; its metrics are in metrics.jsonl (`meshtron train --nproc N` runs ranks the "
        "doctor can read)"], after.stderr


def _launch_folders(run_dir: Path, tag: str) -> None:
    (run_dir / "trace" / "attempt_1").mkdir(parents=True)
    (run_dir / "trace" / "rank_0.hello.json").write_text(tag)
    (run_dir / "trace" / "attempt_1" / "rank_0.json").write_text(tag)
    (run_dir / "attempts" / "attempt_0").mkdir(parents=True)
    (run_dir / "attempts" / "attempt_0" / "exits.json").write_text(tag)


def test_each_resume_keeps_its_own_launch(tmp_path):
    run_dir = tmp_path / "run"
    assert earlier.keep_previous(run_dir, None) is None  # nothing left: nothing kept
    (run_dir / "trace").mkdir(parents=True)
    assert earlier.keep_previous(run_dir, None) is None and not earlier.root(run_dir).exists()
    for n, step in ((1, 3), (2, None)):
        _launch_folders(run_dir, f"launch {n}")
        inode = (run_dir / "trace").stat().st_ino
        kept = earlier.keep_previous(run_dir, step)
        assert kept == run_dir / "earlier" / str(n)
        assert (kept / "trace").stat().st_ino == inode  # renamed, not copied
        assert not (run_dir / "trace").exists() and not (run_dir / "attempts").exists()
        assert earlier.resumed_step(kept) == step
    for n in (1, 2):
        kept = run_dir / "earlier" / str(n)
        assert (kept / "trace" / "attempt_1" / "rank_0.json").read_text() == f"launch {n}"
        assert (kept / "attempts" / "attempt_0" / "exits.json").read_text() == f"launch {n}"
    assert list(earlier.launches(run_dir)) == [1, 2]


def test_earlier_launch_not_kept_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    _launch_folders(run_dir, "{}")
    proc = _doctor(str(run_dir), "--earlier", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"meshtron doctor: error: --earlier=1: no earlier launch 1 in {run_dir / 'earlier'}; "
        "it keeps none (only a --resume of a launch that left a trace keeps one)"], proc.stderr
    proc = _doctor(str(run_dir), "--earlier", "1", "--timeline")
    assert proc.returncode == 2 and "not with --timeline" in proc.stderr, proc.stderr


def test_nothing_to_judge_now_still_names_the_earlier_launch(tmp_path):
    """A resume that failed before its ranks wrote anything: the refusal says where the launch
    before it is (its evidence is not lost behind a bare 'no trace')."""
    run_dir = tmp_path / "run"
    _launch_folders(run_dir, "{}")
    earlier.keep_previous(run_dir, 3)
    proc = _doctor(str(run_dir))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith(f"earlier launches (before a --resume): 1, kept in "
                         f"{run_dir / 'earlier'}; the one just before this: meshtron doctor "
                         f"{run_dir} --earlier 1"), line
