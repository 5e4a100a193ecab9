"""A launch with no meshtron parent (the user's own torchrun or srun, how multi-node jobs run)
sets the earlier launch's evidence aside as meshtron's launcher does (train/earlier.py
`set_aside_in_place`): before, a reused run folder kept the earlier launch's ABORT.json and
dumps in trace/, and `meshtron doctor` printed the earlier watchdog's line for the new launch.

- Through torchrun as a user types it, real processes: rank 1 hangs at step 3 (the faults
  folder's sitecustomize), the watchdog (4 s) ends the launch with ABORT.json and dumps; the
  `--resume` launch finishes; its trace holds nothing of the first launch, which is kept in
  RUN/earlier/1 and judged there (rank 1 never entered its collective).
- The file rule on real files: this launch's hello files and newer files stay, older ones move
  (--resume) or go (a fresh run), attempts/ with them.

Suite time: the torchrun scenario (two 2-rank torchrun launches and a 4 s watchdog, ~33 s) is
`slow`. Default: the file rule above on real files (`set_aside_in_place`, the function such a
launch's rank 0 calls), the meshtron launcher's `--resume` keeping the killed launch and doctor
reading it (tests/test_doctor_earlier.py::test_resume_keeps_the_killed_launch_for_doctor), and
a launch under the user's own torchrun whose rank 0 removes what a killed launch left
(tests/test_train_launch.py::test_inside_an_existing_torchrun_world: a fresh run; the
--resume archive under torchrun is this file's only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtron.train import earlier

FAULTS = str(Path(__file__).parent / "faults")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
            "meshtron", "train", "--model", "debug", "--steps", "6", "--seq-len", "32",
            "--global-batch", "8", "--eval-every", "0", "--plan", "dp=2",
            "--watchdog-timeout", "4", "--checkpoint-every", "2"]


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", "doctor", *args, "--json"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # suite time: two torchrun launches, one hung to its watchdog (module doc)
def test_outside_torchrun_resume_sets_the_hung_launch_aside(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
               MESHTRON_TEST_HANG_AT="3", MESHTRON_TEST_HANG_RANK="1")
    hung = subprocess.run([*TORCHRUN, "--run-dir", str(run)], capture_output=True, text=True,
                          env=env, timeout=240)
    assert hung.returncode != 0 and (run / "trace" / "ABORT.json").is_file(), hung.stderr[-3000:]
    abort = json.loads((run / "trace" / "ABORT.json").read_text())

    env = dict(os.environ, OMP_NUM_THREADS="1")
    resumed = subprocess.run([*TORCHRUN, "--run-dir", str(run), "--resume"], capture_output=True,
                             text=True, env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    kept = run / "earlier" / "1"
    assert f"kept in {kept}" in resumed.stdout, resumed.stdout[-3000:]
    assert not (run / "trace" / "ABORT.json").exists()
    assert json.loads((kept / "trace" / "ABORT.json").read_text()) == abort
    assert earlier.resumed_step(kept) == 2

    # The resumed launch finished: no hang in it (its verdict may name a straggler on a
    # loaded machine: four steps), and the first launch's watchdog is not reported as its own.
    doc = json.loads(_doctor(str(run)).stdout)
    assert doc["kind"] in ("none", "straggler") and doc["hang_to_dump_s"] is None, doc
    assert "watchdog" not in json.dumps(doc), doc
    then = json.loads(_doctor(str(run), "--earlier", "1").stdout)
    assert then["kind"] == "never_entered" and then["culprit_ranks"] == [1], then


def _write(path: Path, text: str, age_s: float = 0.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))


def _folder(run: Path) -> None:
    """An earlier 4-rank launch's files, then a 2-rank launch's hello files and one new dump."""
    tdir = run / "trace"
    for name in ("ABORT.json", "rank_0.json", "rank_3.json", "rank_3.hello.json",
                 "attempt_1/rank_0.json"):
        _write(tdir / name, "old", age_s=600)
    then = time.time() - 600
    os.utime(tdir / "attempt_1", (then, then))  # a folder's time: its last entry's change
    _write(run / "attempts" / "attempt_0" / "exits.json", "old", age_s=600)
    for rank in (0, 1):
        _write(tdir / f"rank_{rank}.hello.json", json.dumps({"start_t": time.time() - 1}))
    _write(tdir / "rank_1.json", "new")


def test_only_earlier_files_are_set_aside(tmp_path):
    run = tmp_path / "run"
    _folder(run)
    kept = earlier.set_aside_in_place(run, 2, resume=True, resumed_from=4)
    assert kept == run / "earlier" / "1" and earlier.resumed_step(kept) == 4
    assert sorted(p.name for p in (run / "trace").iterdir()) == [
        "rank_0.hello.json", "rank_1.hello.json", "rank_1.json"]
    assert sorted(p.name for p in (kept / "trace").iterdir()) == [
        "ABORT.json", "attempt_1", "rank_0.json", "rank_3.hello.json", "rank_3.json"]
    assert (kept / "attempts" / "attempt_0" / "exits.json").read_text() == "old"
    assert not (run / "attempts").exists()
    assert earlier.set_aside_in_place(run, 2, resume=True, resumed_from=6) is None  # nothing left

    fresh = tmp_path / "fresh"
    _folder(fresh)
    (fresh / "earlier" / "1").mkdir(parents=True)  # an old run's earlier launch goes with it
    assert earlier.set_aside_in_place(fresh, 2, resume=False, resumed_from=None) is None
    assert sorted(p.name for p in (fresh / "trace").iterdir()) == [
        "rank_0.hello.json", "rank_1.hello.json", "rank_1.json"]
    assert not (fresh / "attempts").exists() and not earlier.root(fresh).exists()
