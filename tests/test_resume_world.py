"""`--resume` on the run's own world, or on another one, through the `meshtron` command with
real ranks and files:
- without `--nproc` a resume runs on the recorded number of ranks (a 2-rank DiLoCo run used to
  drop to one process and fail naming neither --resume nor --nproc), and without a layout on the
  checkpoint's plan (a pp=2 run, where the planner would pick dp=2 for 2 ranks: a new search
  would reshard it silently); another --nproc is said in one line;
- an int8-compressed ZeRO-1 run resumed on fewer ranks keeps ZeRO-0/1 (the re-plan switched to
  ZeRO-2, whose error-feedback residuals are laid out per FSDP unit: a DCP traceback on every
  rank, after plan.toml was rewritten); a --zero of the other family is refused in one line
  before anything is written.
"""

import shutil
import tomllib

import pytest

from meshtron.checkpoint import store

from test_resume_config import RUN, _losses, _run
from testkit import no_torch


def _drop_last(ref, run_dir, steps):
    shutil.copytree(ref, run_dir)
    for step in steps:
        shutil.rmtree(store.checkpoint_root(run_dir) / store.step_name(step))


def _plan(run_dir):
    return tomllib.loads((run_dir / "plan.toml").read_text())


def test_resume_without_nproc_runs_on_the_recorded_ranks(tmp_path, pp2_run):
    """`--resume` alone (no --nproc, no layout) of a 2-rank pp=2 run: it continues on 2 ranks
    and on the checkpoint's pp=2 plan (the planner picks dp=2 for this model on 2 ranks), bit
    for bit the run never interrupted. Both launchers (the plan, checkpoints, --resume's checks)
    run without torch on this GPU-less node (testkit/no_torch.py). Session 56: one pair of
    launches for what this test (a DiLoCo run, searched) and test_resume_extend.py's
    test_resume_without_a_layout_continues_on_the_runs_plan (now slow) each launched; a 2-rank
    DiLoCo run resumed: tests/test_compress_resume.py::test_int8_resume_on_the_same_layout_is_the_same_run[diloco3].
    Session 57: the run is conftest.py `pp2_run` (5 steps, checkpoints every 2; its launcher
    under testkit.no_torch too), which tests/test_doctor_timeline.py reads: one 2-rank launch
    for both files. Resumed here from its step 2."""
    ref = pp2_run
    run_dir = tmp_path / "resumed"
    _drop_last(ref, run_dir, [s for s, _ in store.committed(store.checkpoint_root(ref)) if s > 2])
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", command=no_torch.COMMAND)
    assert code == 0, err[-2000:]
    assert "resuming on" not in err and "resumed from" in err, err[-2000:]
    assert "--resume: continuing on the checkpoint's plan (tp=1,pp=2,dp=1 " in err, err[-2000:]
    assert _plan(run_dir)["gpus"] == 2 and _plan(run_dir)["pp"] == 2
    assert _losses(run_dir) == _losses(ref)


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_compressed_zero1_run_resumes_on_fewer_ranks(tmp_path):
    ref = tmp_path / "ref"
    code, _, err = _run("train", *RUN, "--nproc", "4", "--plan", "dp=4", "--zero", "1",
                        "--grad-compression", "int8", "--compress-scope", "inter_node",
                        "--ranks-per-node", "2", "--checkpoint-every", "2",
                        "--run-dir", str(ref))
    assert code == 0, err[-2000:]
    run_dir = tmp_path / "resumed"
    _drop_last(ref, run_dir, (8,))
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", "--nproc", "2",
                        "--zero", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "plan.zero=2" in err and "--zero 0 or 1" in err, err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", "--nproc", "2")
    assert code == 0, err[-2000:]
    assert "resuming on 2 ranks (the run used 4)" in err, err[-2000:]
    plan = _plan(run_dir)
    assert (plan["dp"], plan["zero"], plan["grad_compression"]) == (2, 1, "int8")
    want, got = _losses(ref), _losses(run_dir)
    assert set(got) == set(want) and all(got[s] == want[s] for s in range(1, 7))
    # steps 7-8 on 2 ranks: the same trajectory up to the summation order of 2 vs 4 ranks
    assert all(abs(got[s] - want[s]) < 1e-4 * abs(want[s]) for s in (7, 8)), (got, want)
