"""The launcher with real processes and real signals: ranks die with `meshtron train`, a live run
folder is refused by a lock that dies with its holders, Ctrl-C on ranks reads as in one process,
and torchrun gets only the flags its own parser knows.

The two end-to-end cases run the command as a user does (2 ranks, dp=2, the defaults); the
rest use small Python processes (no torch import) so that they take about a second each.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from meshtron.errors import RunFailed, UserError
from meshtron.launch import (PARENT_ENV, accepts, launch_local, supported_argv, torchrun_args,
                             warn_unsupported)
from meshtron.train import run_lock

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--model", "debug", "--steps", "100000", "--seq-len", "32", "--global-batch",
         "8", "--eval-every", "0", "--nproc", "2", "--plan", "dp=2"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _default_sigint():
    # A shell's background job inherits SIGINT ignored (and Python keeps it ignored): give
    # the command the disposition of a foreground terminal job, where Ctrl-C lands.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_procs(run_dir: Path) -> set[int]:
    """torchrun's agent and the ranks working on `run_dir` (their environment names it)."""
    found = set()
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if d.name.isdigit() and b"MESHTRON_RANK_ARGV" in env and str(run_dir).encode() in env:
            found.add(int(d.name))
    return found


def _start_run(run_dir: Path, until: str = "training") -> subprocess.Popen:
    """The run, once it trains (a metrics record), or once its ranks exist ('starting')."""
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", *TRAIN, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), preexec_fn=_default_sigint)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300

    def ready():
        if until == "starting":
            return len(_run_procs(run_dir)) == 3
        return metrics.exists() and metrics.read_text().strip()

    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the run did not start training: {err[-2000:]}")
        time.sleep(0.2)
    return proc


def _reap(pids) -> None:
    for pid in pids:  # only if the test failed: never leave its processes behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_of_the_launcher_ends_every_rank_and_the_folder_is_free(tmp_path, capsys):
    """`timeout -s KILL ... meshtron train --nproc 2`: torchrun and both ranks end with the
    launcher (the kernel's parent-death signal), nothing is written afterwards, and the run
    folder's lock is gone with them. Before the fix they trained on to the end."""
    run_dir = tmp_path / "run"
    proc = _start_run(run_dir)
    procs = _run_procs(run_dir)
    try:
        assert len(procs) == 3, procs  # torchrun's agent + 2 ranks
        # A second `meshtron train` on the live folder, through the command's entry point in
        # this process (another process than the run's, which is what the lock is about; a
        # child would only add a torch import)
        from meshtron.cli import main

        capsys.readouterr()
        code = main([*TRAIN, "--steps", "2", "--run-dir", str(run_dir), "--overwrite"])
        line = capsys.readouterr().err.strip()
        assert code == 2, line
        assert len(line.splitlines()) == 1 and "a live run (pid" in line \
            and str(run_dir) in line, line
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        while _run_procs(run_dir) and time.monotonic() - killed < 30:
            time.sleep(0.01)
        gone_s = time.monotonic() - killed
        assert not _run_procs(run_dir), f"left running {gone_s:.1f} s after the SIGKILL"
        print(f"last process of the run gone {gone_s:.3f} s after SIGKILL of the launcher")
        files = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
        size = (run_dir / "metrics.jsonl").stat().st_size
        time.sleep(2)
        assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == files
        assert (run_dir / "metrics.jsonl").stat().st_size == size
        assert not (run_dir / "summary.json").exists()
        run_lock.check_free(run_dir)  # the lock died with its holders
    finally:
        _reap(procs | _run_procs(run_dir))


@pytest.mark.parametrize("moment", ["training", pytest.param("starting",
                                                              marks=pytest.mark.slow)])
def test_ctrl_c_on_two_ranks_is_one_line_and_exit_130(tmp_path, moment):
    """SIGINT to the launcher (a terminal's Ctrl-C) with two ranks reads as in one process:
    "interrupted", exit code 130; no torchrun or rank lines, no rank left. While training, and
    while the ranks still import torch (before any handler of torchrun's or ours)."""
    run_dir = tmp_path / "run"
    proc = _start_run(run_dir, moment)
    procs = _run_procs(run_dir)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err[-3000:]
        assert err.strip().splitlines()[-1] == "meshtron train: interrupted", err[-3000:]
        for noise in ("torchrun", "failed", "Traceback", "rank 0", "rank 1", "SIGINT"):
            assert noise not in err, err[-3000:]
        deadline = time.monotonic() + 30
        while _run_procs(run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _run_procs(run_dir)
        if moment == "training":  # the ranks' doctor sessions exist: doctor says interrupted
            _doctor_says_interrupted(run_dir)
    finally:
        _reap(procs | _run_procs(run_dir))


def _doctor_says_interrupted(run_dir: Path) -> None:
    """`meshtron doctor RUN` after Ctrl-C: no dump to judge (exit 4), said as an interruption,
    not as a kill from outside (the ranks' hello files record the SIGINT)."""
    doctor = subprocess.run([sys.executable, "-m", "meshtron", "doctor", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60, env=_env())
    assert doctor.returncode == 4, doctor.stdout + doctor.stderr
    doc = json.loads(doctor.stdout)
    assert doc["verdict"].startswith("no rank has dumped: the run was interrupted (SIGINT, e.g. "
                                     "Ctrl-C; ranks 0, 1 left at once"), doc
    assert "killed" not in doc["verdict"], doc
    assert doc["evidence"] == ["rank 0: no dump; interrupted (SIGINT)",
                               "rank 1: no dump; interrupted (SIGINT)"], doc


_HOLDER = textwrap.dedent("""
    import sys, time
    from meshtron.train import run_lock
    getattr(run_lock, sys.argv[1])(sys.argv[2])
    print("held", flush=True)
    time.sleep(300)
""")


def _holder(how: str, run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, how, str(run_dir)],
                            stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_the_run_folder_lock_lives_as_long_as_any_holder(tmp_path):
    """A launcher's claim refuses a second run naming its pid; a rank that joined keeps the
    folder held after its launcher is SIGKILLed; the lock goes with the last holder."""
    run_dir = tmp_path / "run"
    launcher = _holder("claim", run_dir)
    rank = _holder("join", run_dir)
    try:
        for attempt in (run_lock.check_free, run_lock.claim):
            with pytest.raises(UserError, match=rf"a live run \(pid {launcher.pid}\)"):
                attempt(run_dir)
        launcher.kill()
        launcher.wait()
        with pytest.raises(UserError, match="a live run"):
            run_lock.check_free(run_dir)
        rank.kill()
        rank.wait()
        run_lock.check_free(run_dir)
    finally:
        launcher.kill()
        rank.kill()


def test_a_claim_given_up_on_bad_input_leaves_nothing(tmp_path):
    run_dir = tmp_path / "new"
    run_lock.claim(run_dir)
    assert (run_dir / run_lock.LOCK_NAME).is_file()
    run_lock.abandon(run_dir)
    assert not run_dir.exists()


_CHILD = textwrap.dedent("""
    import os, sys, time
    from meshtron.launch import bind_to_parent
    print(bind_to_parent(int(sys.argv[1]), use_prctl=sys.argv[2] == "prctl"), os.getpid(),
          flush=True)
    time.sleep(300)
""")
_PARENT = textwrap.dedent("""
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
    child.wait()
""")


@pytest.mark.parametrize("mode", ["prctl", "watch"])
def test_a_launched_process_dies_with_its_parent(mode):
    """The kernel's parent-death signal (Linux) and the portable pid watch: SIGKILL the parent,
    the child is gone within a second."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, mode],
                              stdout=subprocess.PIPE, text=True, env=_env())
    got, pid = parent.stdout.readline().split()
    assert got == mode
    child = int(pid)
    killed = time.monotonic()
    parent.kill()
    parent.wait()
    try:
        while Path(f"/proc/{child}").exists() and time.monotonic() - killed < 5:
            status = Path(f"/proc/{child}/status").read_text() if Path(
                f"/proc/{child}").exists() else ""
            if "zombie" in status:  # dead, waiting for init to reap it
                break
            time.sleep(0.01)
        status = Path(f"/proc/{child}/status").read_text() if Path(
            f"/proc/{child}").exists() else "gone"
        assert status == "gone" or "zombie" in status, status
        assert time.monotonic() - killed < 2
    finally:
        _reap([child])


def test_torchrun_argv_parses_with_torchruns_own_parser():
    """The argv `launch_local` builds (standalone and elastic rendezvous), as the agent passes
    it on (`torchrun_main`: `supported_argv`, which leaves out what this torchrun lacks), is
    what the installed torchrun's own parser reads back (on torch 2.11 too, whose parser
    refused the argv with --shutdown-timeout in it: this test did not model the agent)."""
    from torch.distributed.run import get_args_parser

    from meshtron.train.elastic import ElasticConfig

    elastic = ElasticConfig(min_nodes=1, max_nodes=2, nproc_per_node=2, endpoint="h:29400",
                            run_id="job")
    for rendezvous in (None, elastic.torchrun_args()):
        parser = get_args_parser()
        argv = supported_argv(torchrun_args(2, 3, 30.0, rendezvous), parser) + ["-m", "meshtron"]
        args = parser.parse_args(argv)
        assert (args.nproc_per_node, args.max_restarts, args.module) == ("2", 3, True)
        assert (args.training_script, args.training_script_args) == ("meshtron", [])
        assert args.standalone == (rendezvous is None)
        if accepts(get_args_parser(), "--shutdown-timeout=1"):  # torch > 2.11
            assert args.shutdown_timeout == 40  # grace + the exit margin


def test_a_flag_this_torchrun_lacks_is_left_out_and_said_once(capsys):
    """torch 2.11's torchrun has no --shutdown-timeout: a parser of its flags (argparse, as
    torchrun builds it) gets the argv without it, and the launcher says what that costs."""
    import argparse

    old = argparse.ArgumentParser()
    old.add_argument("--standalone", action="store_true")
    old.add_argument("--nproc-per-node", "--nproc_per_node")
    old.add_argument("--max-restarts", "--max_restarts", type=int)
    old.add_argument("-m", "--module", action="store_true")
    old.add_argument("training_script")
    old.add_argument("training_script_args", nargs=argparse.REMAINDER)
    argv = torchrun_args(2, 0, 30.0, parser=old)
    assert not any(a.startswith("--shutdown-timeout") for a in argv)
    assert old.parse_args(argv + ["-m", "meshtron"]).nproc_per_node == "2"
    warn_unsupported(argv, 30.0)  # the default --preempt-grace fits torchrun's fixed 30 s
    assert capsys.readouterr().err == ""
    warn_unsupported(argv, 45.0)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no --shutdown-timeout" in err and "45 s" in err
    from torch.distributed.run import get_args_parser

    # the agent's filter (the launcher gives every flag and imports no torch): the same
    assert supported_argv(torchrun_args(2, 0, 30.0), old) == argv
    assert capsys.readouterr().err == ""
    assert supported_argv(torchrun_args(2, 0, 45.0), old) == torchrun_args(2, 0, 45.0, parser=old)
    assert "45 s asked" in capsys.readouterr().err
    kept = supported_argv(torchrun_args(2, 0, 45.0), get_args_parser())  # this torch's torchrun
    said = "no --shutdown-timeout" in capsys.readouterr().err
    assert said != accepts(get_args_parser(), "--shutdown-timeout=1")
    assert said != any(a.startswith("--shutdown-timeout=") for a in kept)


def test_a_torchrun_failure_before_any_rank_is_named_as_such(capfd):
    """torchrun refusing its command line is the launcher's failure, not "the ranks failed"."""
    env_before = os.environ.get(PARENT_ENV)
    with pytest.raises(RunFailed, match="torchrun could not run the ranks"):
        launch_local(1, ["train"], rendezvous=["--standalone", "--no-such-flag=1"])
    err = capfd.readouterr().err
    assert "does not know --no-such-flag=1; no rank started" in err, err
    assert "ranks failed" not in err
    assert os.environ.get(PARENT_ENV) == env_before  # set for the child only


def test_every_rank_group_is_made_in_one_place():
    """One process-group init path for every mode: restart mode (--max-restarts) made its own
    group (plain `nccl`, no device_id, before the NCCL environment was set). Now only
    `runtime.init_rank` calls init_process_group, with the backend of the rank's device
    (injected here: the CUDA branch is checked on CPU)."""
    import ast

    from meshtron.backend import backend_for

    callers = []
    for path in sorted((ROOT / "meshtron").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name == "init_process_group":
                    callers.append(path.relative_to(ROOT).as_posix())
    # rehearse/rank.py joins torch's single-process "fake" group (one rank of a plan
    # rehearsed alone, meshtron rehearse): not a training rank's group
    assert callers == ["meshtron/rehearse/rank.py", "meshtron/runtime.py"], callers
    assert backend_for("cuda") == "cuda:nccl,cpu:gloo"
    assert backend_for("cpu") == "gloo"

    # the CUDA branch of that one call, run with the device injected: NCCL for CUDA tensors,
    # gloo for CPU ones, bound to the rank's GPU in every mode (torchrun, restarts' own store,
    # Slurm's rendezvous URL); CPU ranks: gloo, never a device_id
    import torch
    import torch.distributed as dist

    from meshtron.launch import World
    from meshtron.runtime import group_init_args

    gpu = torch.device("cuda", 3)
    store = dist.HashStore()
    modes = {"torchrun": (World(5, 3, 8, "torchrun", 4), None, {}),
             "restart": (World(5, 3, 8, "torchrun", 4), store,
                         {"store": store, "rank": 5, "world_size": 8}),
             "slurm": (World(5, 3, 8, "slurm", 4, "tcp://n0:29500"), None,
                       {"init_method": "tcp://n0:29500", "rank": 5, "world_size": 8})}
    for mode, (world, st, where) in modes.items():
        backend, kwargs = group_init_args(world, gpu, 60.0, st)
        assert backend == "cuda:nccl,cpu:gloo", mode
        assert kwargs == {"timeout": timedelta(seconds=60), "device_id": gpu, **where}, mode
        backend, kwargs = group_init_args(world, torch.device("cpu"), 60.0, st)
        assert backend == "gloo" and "device_id" not in kwargs, mode


class _Gpus:
    """`torch.cuda`'s device API on a node with `count` visible GPUs (injected: the CUDA
    branch of `local_device` runs on this CPU machine); records the devices made current."""

    def __init__(self, count: int):
        self.count, self.current = count, []

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def set_device(self, device):
        self.current.append(device)


def test_a_rank_takes_its_local_gpu_and_makes_it_current(monkeypatch):
    """A rank's device on a GPU node: cuda:LOCAL_RANK, modulo the GPUs it sees (Slurm may show
    each task only its own), made current before its group binds to it (`device_id`); the
    CPU where no GPU is visible; the caller's current GPU outside a per-GPU launch."""
    import torch

    from meshtron.runtime import local_device

    gpus = _Gpus(4)
    assert [local_device(r, gpus) for r in (0, 3, 5)] == \
        [torch.device("cuda", 0), torch.device("cuda", 3), torch.device("cuda", 1)]
    assert gpus.current == [torch.device("cuda", 0), torch.device("cuda", 3),
                            torch.device("cuda", 1)]
    one = _Gpus(1)  # Slurm: one GPU per task
    assert local_device(6, one) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert local_device(None, gpus) == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert local_device(None, gpus) == torch.device("cuda", 0)
    assert local_device(1, _Gpus(0)) == torch.device("cpu")
