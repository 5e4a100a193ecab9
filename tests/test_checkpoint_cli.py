"""`meshtron train` surviving real failures end to end (slow: torchrun, 2 and 4 ranks).

- SIGKILL one rank of a 4-rank hybrid run (dp=2 x tp=2) at a random step, `--max-restarts 2`:
  torchrun restarts every rank from the last complete checkpoint; per-step losses and final
  parameters equal an uninterrupted run's exactly; metrics.jsonl holds a `restart` record.
  Again with ZeRO-2 and an evaluation on every checkpoint step (the save state that crashed,
  issue 23), where the saves after the restart must commit too and summary.json's tokens/s
  covers every step once.
- SIGTERM to the launcher: every rank finishes its step, checkpoints, exit code 75; `--resume`
  continues exactly.
- SIGKILL while an asynchronous save is in flight (writes slowed by tests/checkpoint_faults):
  the unfinished save is never loaded; the resume is exact.
- Layout changes on the command line: dp=4 -> tp=2 x dp=2, and 4 ranks -> 2 ranks.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint import EXIT_PREEMPTED, load_full_state_dict, store
from meshtron.config import config_from_dict
from meshtron.train.loop import train
from testkit.procs import rank_pids as _rank_pids

pytestmark = pytest.mark.slow

FAULTS = str(Path(__file__).parent / "checkpoint_faults")
STEPS = 8
RUN = ["--model", "debug", "--steps", str(STEPS), "--seq-len", "32", "--global-batch", "8",
       "--eval-every", "0"]
HYBRID = ["--nproc", "4", "--plan", "tp=2,dp=2", "--zero", "3"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([FAULTS, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _start(run_dir, *argv, **env):
    return subprocess.Popen([sys.executable, "-m", "meshtron", "train", *RUN, "--run-dir",
                             str(run_dir), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(**env),
                            start_new_session=True)


def _run(run_dir, *argv, timeout=600, **env):
    proc = _start(run_dir, *argv, **env)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in _records(run_dir) if "event" not in r]


def _wait_for_step(run_dir, step, proc, timeout=600):
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and any(r.get("step") == step for r in _records(run_dir)):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} never logged (exit code {proc.poll()})")


def _same_final_state(a, b):
    want, got = (load_full_state_dict(d, optimizer=True) for d in (a, b))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ckpt-cli") / "uninterrupted"
    code, out = _run(run_dir, *HYBRID, "--checkpoint-every", "2")
    assert code == 0, out[-3000:]
    return run_dir


def test_sigkill_one_rank_with_max_restarts_is_exact(tmp_path, uninterrupted):
    kill_after = random.Random().randint(3, 6)
    run_dir = tmp_path / "killed"
    proc = _start(run_dir, *HYBRID, "--checkpoint-every", "2", "--max-restarts", "2")
    _wait_for_step(run_dir, kill_after, proc)
    victim = random.Random().choice(sorted(_rank_pids(run_dir).items()))
    os.kill(victim[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, (kill_after, victim, out[-4000:])
    assert _losses(run_dir) == _losses(uninterrupted), kill_after
    _same_final_state(uninterrupted, run_dir)
    restart, = [r for r in _records(run_dir) if r.get("event") == "restart"]
    assert restart["attempt"] == 1 and str(victim[0]) in restart["cause"], restart
    assert restart["resumed_from_step"] % 2 == 0 and restart["lost_steps"] >= 0
    assert "restart 1 (torchrun)" in out


def test_restart_with_evaluation_on_checkpoint_steps_zero2(tmp_path):
    argv = ["--nproc", "4", "--plan", "tp=2,dp=2", "--zero", "2", "--checkpoint-every", "2",
            "--eval-every", "2"]
    ref = tmp_path / "ref"
    code, out = _run(ref, *argv)
    assert code == 0, out[-3000:]
    run_dir = tmp_path / "killed"
    proc = _start(run_dir, *argv, "--max-restarts", "1")
    _wait_for_step(run_dir, 5, proc)
    os.kill(_rank_pids(run_dir)[3], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    want = [(r["step"], r["loss"], r.get("eval_loss")) for r in _records(ref) if "event" not in r]
    got = [(r["step"], r["loss"], r.get("eval_loss")) for r in _records(run_dir)
           if "event" not in r]
    assert got == want and sum(e is not None for *_, e in got) == STEPS // 2
    restart, = [r for r in _records(run_dir) if r.get("event") == "restart"]
    root = store.checkpoint_root(run_dir)
    assert [s for s, _ in store.committed(root)] == [8, 6, 4]
    assert all(store.verify(p) is None for _, p in store.committed(root))
    _same_final_state(ref, run_dir)
    # tokens/s: steps 1..8 once, timed by the attempt that was kept; the first step of each
    # attempt is warm-up.
    summary = json.loads((run_dir / "summary.json").read_text())
    times = {r["step"]: r["step_time_s"] for r in _records(run_dir) if "event" not in r}
    steady = [s for s in times if s not in (1, restart["resumed_from_step"] + 1)]
    tokens = 8 * 32
    assert summary["tokens"] == STEPS * tokens
    assert summary["resumed_from_step"] == restart["resumed_from_step"]
    want_tps = len(steady) * tokens / sum(times[s] for s in steady)
    assert abs(summary["tokens_per_s"] - want_tps) <= 1e-9 * want_tps


def test_sigterm_to_the_launcher_checkpoints_exits_75_and_resumes_exactly(tmp_path,
                                                                          uninterrupted):
    run_dir = tmp_path / "preempted"
    proc = _start(run_dir, *HYBRID, "--checkpoint-every", "100")
    _wait_for_step(run_dir, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    step = json.loads((store.checkpoint_root(run_dir) / store.PREEMPTED).read_text())["step"]
    assert 3 <= step < STEPS and "continue with --resume" in out
    code, out = _run(run_dir, *HYBRID, "--checkpoint-every", "2", "--resume")
    assert code == 0, out[-4000:]
    assert _losses(run_dir) == _losses(uninterrupted)
    _same_final_state(uninterrupted, run_dir)


def test_kill_during_an_async_save_never_loads_it(tmp_path):
    """One process, writes slowed to 2 s: SIGKILL while step 4's save is in flight."""
    ref = tmp_path / "ref"
    code, out = _run(ref, "--checkpoint-every", "2")
    assert code == 0, out[-3000:]
    run_dir = tmp_path / "inflight"
    proc = _start(run_dir, "--checkpoint-every", "2", MESHTRON_TEST_SLOW_WRITE_S="2")
    tmp = store.checkpoint_root(run_dir) / (store.TMP_PREFIX + "step_00000004")
    deadline = time.monotonic() + 300
    while not tmp.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert tmp.exists(), proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (store.checkpoint_root(run_dir) / "step_00000004").exists()
    code, out = _run(run_dir, "--checkpoint-every", "2", "--resume")
    assert code == 0, out[-3000:]
    assert "resumed from" in out and "step_00000004" not in out.split("resumed from")[1][:80]
    assert _losses(run_dir) == _losses(ref)
    _same_final_state(ref, run_dir)


def test_resume_on_other_layouts_and_world_sizes(tmp_path):
    single = tmp_path / "single"
    train(config_from_dict({"model": "debug", "data": {"seq_len": 32, "global_batch": 8},
                            "train": {"steps": STEPS, "eval_every": 0,
                                      "run_dir": str(single)}}), show_progress=False)
    want = dict(_losses(single))
    dp4 = tmp_path / "dp4"
    code, out = _run(dp4, "--nproc", "4", "--plan", "dp=4", "--zero", "1",
                     "--checkpoint-every", "2")
    assert code == 0, out[-3000:]
    for name, argv in (("tp2dp2", ["--nproc", "4", "--plan", "tp=2,dp=2", "--zero", "3"]),
                       ("dp2", ["--nproc", "2", "--plan", "dp=2", "--zero", "2"])):
        run_dir = tmp_path / name
        shutil.copytree(dp4, run_dir)
        for step in (8, 6):
            shutil.rmtree(store.checkpoint_root(run_dir) / store.step_name(step))
        code, out = _run(run_dir, *argv, "--resume")
        assert code == 0, out[-3000:]
        assert "saved on 4 rank(s), layout tp=1 pp=1 dp=4 zero=1" in out
        got = _losses(run_dir)
        assert [s for s, _ in got] == list(range(1, STEPS + 1))
        for s, loss in got:
            assert abs(loss - want[s]) <= 1e-5 * abs(want[s]), (name, s, loss, want[s])
