"""The default suite's inputs come from the tests, not from the machine that runs them.

Two kinds of outside state changed results before this file:

* the current directory: `meshtron train` (and every rank that plans in-process) reads
  `runs/calibration/local-N.toml` relative to it (meshtron/calibrate/cli.py DEFAULT_DIR, read by
  meshtron/train/planning.py `cluster_choice`), and writes `runs/default` / `runs/demo` there
  when no --run-dir is given (meshtron/config.py, meshtron/train/demo.py). Each test runs in a
  fresh empty directory of its own (session and module fixtures in one for the session), so a
  calibration or run folder left in the checkout is never seen; tests that start `meshtron` in
  a subprocess leave it that directory (no `cwd=ROOT`). Subprocesses inherit that directory; `testkit` and `tests` stay importable through
  PYTHONPATH (they are not installed; `meshtron` is, editable).
* the environment: meshtron reads MESHTRON_* (launch.py, doctor/recorder.py,
  checkpoint/snapshot_files.py), torchrun's RANK / WORLD_SIZE / LOCAL_WORLD_SIZE /
  GROUP_WORLD_SIZE / TORCHELASTIC_RUN_ID (launch.py, checkpoint/snapshot.py, parallel/mesh.py,
  train/elastic.py), TORCH_FR_BUFFER_SIZE (doctor/flight.py); torch reads TORCH_* /
  TORCHDYNAMO_* / TORCHINDUCTOR_* switches (TORCH_LOGS, TORCH_DISTRIBUTED_DEBUG, ...) and the
  thread counts. They are removed once, before any test imports torch. Kept: the harness switch
  MESHTRON_TEST_FRESH_RANKS (testkit/multiproc.py) and where torch keeps its compile caches
  (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR: content-addressed, they change speed, not results).
  CUDA_VISIBLE_DEVICES is set empty: the default suite is the CPU suite (a test that needs a
  GPU is outside it), and a visible GPU changes what `meshtron train` plans for
  (calibrate/device.py `this_node`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_KEPT = {"MESHTRON_TEST_FRESH_RANKS", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
_PREFIXES = ("MESHTRON_", "TORCH_", "TORCHELASTIC_", "TORCHDYNAMO_", "TORCHINDUCTOR_",
             "TORCHFT_")
_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
          "MASTER_PORT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
          "CUDA_LAUNCH_BLOCKING"}


def outside_env(environ) -> list[str]:
    """The names in `environ` that would steer meshtron or torch from outside a test."""
    return sorted(k for k in environ
                  if k not in _KEPT and (k in _NAMES or k.startswith(_PREFIXES)))


def _clean_environment() -> None:
    for name in outside_env(os.environ):
        del os.environ[name]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(p for p in paths
                                                             if p != str(ROOT))])


_clean_environment()  # at import: before any test module imports torch


@pytest.fixture(scope="session", autouse=True)
def _session_cwd(tmp_path_factory):
    """Session and module fixtures (set up before any test's own directory) run in an empty
    directory too."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("session-cwd"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def _own_cwd(tmp_path_factory, monkeypatch):
    """Each test starts in an empty directory of its own (see the module docstring)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _shared_dir(config, tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this test run sees (the workers' base folders are
    siblings in the run's own), or the run's base folder without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


@pytest.fixture(scope="session")
def int8_run(request, tmp_path_factory):
    """`int8_run(zero, *flags)`: the folder of one finished 2-rank int8-compressed run
    (`meshtron train --model debug --seq-len 32 --global-batch 8 --steps 8 --grad-compression
    int8 --checkpoint-every 4 --nproc 2 --plan dp=2 --zero ZERO FLAGS`), trained once for the
    test run, whichever xdist worker asks first (the others wait on a file lock): tests/
    test_compress_resume.py resumes copies of it, tests/test_compress_priced.py reads its
    memory.json and plan.toml (one 2-rank launch each, ~10 s of CPU, instead of its own). Read
    only: a test that changes a run copies it first."""
    import fcntl
    import shutil
    import subprocess
    import sys

    root = _shared_dir(request.config, tmp_path_factory) / "int8-runs"
    root.mkdir(exist_ok=True)

    def run(zero: int, *flags: str) -> Path:
        path = root / "-".join([f"ref-zero{zero}", *(f.lstrip("-") for f in flags)])
        with open(root / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            done = root / f"{path.name}.done"
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)  # a worker that failed half-way
                from testkit import no_torch  # the launcher of a compressed run: no torch

                proc = subprocess.run(
                    [*no_torch.COMMAND, "train", "--model", "debug", "--seq-len",
                     "32", "--global-batch", "8", "--eval-every", "0", "--steps", "8",
                     "--grad-compression", "int8", "--checkpoint-every", "4", "--nproc", "2",
                     "--plan", "dp=2", "--zero", str(zero), *flags, "--run-dir", str(path)],
                    capture_output=True, text=True, timeout=600,
                    env=dict(os.environ, OMP_NUM_THREADS="1"))
                assert proc.returncode == 0, proc.stderr[-2000:]
                done.write_text("")
        return path
    return run


RESUMED_LAUNCH = ["train", "--model", "debug", "--seq-len", "32", "--global-batch", "4",
                  "--eval-every", "0", "--warmup-steps", "2", "--zero", "1"]
"""A planned one-rank run (`--zero 1`: a torchrun launch of 1 rank, not the one-process path)."""


@pytest.fixture(scope="session")
def resumed_launch(request, tmp_path_factory):
    """(run folder, what the resume printed): `meshtron train RESUMED_LAUNCH --steps 3
    --checkpoint-every 3`, then the same with `--steps 6 --resume`, each through
    `meshtron.cli.main` in the asking worker's process (testkit/cli_inproc.py), trained once
    for the test run, whichever xdist worker asks first (the others wait on a file lock):
    tests/test_train_outputs.py reads the resumed launch's closing line and summary.json,
    tests/test_doctor_timeline.py its timeline (two 1-rank launches each, ~13 CPU s, typed
    the same in both files before), tests/test_saved_plan_checks.py prices its plan.toml as
    the debug preset's run. Read only."""
    import fcntl

    from testkit.cli_inproc import meshtron_main

    root = _shared_dir(request.config, tmp_path_factory) / "resumed-launch"
    root.mkdir(exist_ok=True)
    run, said = root / "run", root / "resume.out"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "done").exists():
            import shutil

            shutil.rmtree(run, ignore_errors=True)  # a worker that failed half-way
            rc, _, err = meshtron_main(*RESUMED_LAUNCH, "--run-dir", run, "--steps", "3",
                                       "--checkpoint-every", "3")
            assert rc == 0, err
            rc, out, err = meshtron_main(*RESUMED_LAUNCH, "--run-dir", run, "--steps", "6",
                                         "--resume")
            assert rc == 0, err
            said.write_text(out + err)
            (root / "done").write_text("")
    return run, said.read_text()


PP2_RUN = ["train", "--nproc", "2", "--plan", "pp=2", "--model", "debug", "--seq-len", "32",
           "--global-batch", "16", "--eval-every", "0", "--steps", "5", "--checkpoint-every", "2",
           "--log-every", "1"]
"""A 2-rank pipelined run with checkpoints (steps 2 and 4, and the last if the run saves it)
and a metrics record every step."""


@pytest.fixture(scope="session")
def pp2_run(request, tmp_path_factory) -> Path:
    """The folder of `meshtron train PP2_RUN` (the launcher through testkit.no_torch: it may
    not import torch), trained once for the test run, whichever xdist worker asks first (the
    others wait on a file lock, as for `int8_run`): tests/test_doctor_timeline.py reads its
    timelines (from a copy: the doctor writes beside them), tests/test_resume_world.py resumes
    a copy of it, tests/test_doctor_straggler.py reads its ranks' beats (one 2-rank launch,
    ~11 CPU s, instead of one each; suite time, session 57). Read only."""
    import fcntl
    import shutil
    import subprocess

    from testkit import no_torch

    root = _shared_dir(request.config, tmp_path_factory) / "pp2-run"
    root.mkdir(exist_ok=True)
    run = root / "run"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "done").exists():
            shutil.rmtree(run, ignore_errors=True)  # a worker that failed half-way
            proc = subprocess.run([*no_torch.COMMAND, *PP2_RUN, "--run-dir", str(run)],
                                  capture_output=True, text=True, timeout=600,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            (root / "done").write_text("")
    return run
