"""`--resume` of an int8-compressed run through the `meshtron` command, with real ranks and
files (meshtron/compress/runtime.py, meshtron/checkpoint/rank_entries.py):

- on the same layout (dp=2 ZeRO-0, DiLoCo H=3 with int8 outer gradients saved inside a round;
  slow: ZeRO-2 and ZeRO-1 over dp=4 compressed across 2 "nodes" of 2 ranks) the resumed
  run is the uninterrupted run: every rank restores its own
  error-feedback residual, so losses, final parameters and optimizer state are equal bit for
  bit (they differed by 2.0e-5 at ZeRO-0 and 5.5e-6 at ZeRO-2 while the checkpoint held only
  the group's mean residual);
- on another layout (dp=2 -> 4) every rank restarts from the group's mean residual, and the
  resume says so in one line.
"""

import shutil

import pytest
import torch

from meshtron.checkpoint import load_full_state_dict, store

from test_resume_config import RUN, _losses, _run

INT8 = ["--grad-compression", "int8", "--checkpoint-every", "4"]
DP2 = ["--nproc", "2", "--plan", "dp=2"]
MEAN_LINE = "every rank restarts from its data-parallel group's mean residual"


def _cut(ref, run_dir, step):
    """`run_dir` = `ref` as a run stopped after `step` leaves it (later checkpoints gone)."""
    shutil.copytree(ref, run_dir)
    for s, path in store.committed(store.checkpoint_root(run_dir)):
        if s > step:
            shutil.rmtree(path)


def _reference(tmp_path, zero, layout, flags=()):
    ref = tmp_path / f"ref-zero{zero}"
    code, _, err = _run("train", *RUN, *INT8, *layout, "--zero", str(zero), *flags,
                        "--run-dir", str(ref))
    assert code == 0, err[-2000:]
    return ref


def _assert_same_run(ref, run_dir):
    assert _losses(run_dir) == _losses(ref)
    want = load_full_state_dict(ref, optimizer=True)
    got = load_full_state_dict(run_dir, optimizer=True)
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


HIER = ["--nproc", "4", "--plan", "dp=4", "--compress-scope", "inter_node",
        "--ranks-per-node", "2"]


@pytest.mark.parametrize("zero, layout, flags", [
    (0, DP2, ()),
    # slow (suite time, a 2-rank resume each): zero0 above keeps the command's same-layout
    # resume of every rank's own residual by default; ZeRO-2's per-FSDP-unit residuals
    # round-trip through state_dict and DCP in tests/test_compress_dist.py::
    # test_compression_and_diloco_on_gloo ("zero2", "zero2_tp_mean_err")
    pytest.param(2, DP2, (), marks=pytest.mark.slow),
    # DiLoCo's replica states (moments apart, parameters apart inside a round) resumed to the
    # same run: the default suite's only DiLoCo resume (test_resume_world's run is pp=2 now)
    (0, DP2, ("--diloco", "3")),
    pytest.param(1, HIER, (), marks=pytest.mark.slow)],  # 4 ranks; suite time
    ids=["zero0", "zero2", "diloco3", "zero1-inter-node"])
def test_int8_resume_on_the_same_layout_is_the_same_run(tmp_path, int8_run, zero, layout,
                                                       flags):
    # dp=2: the session's run of these flags (conftest.py int8_run, also read by
    # tests/test_compress_priced.py), resumed from a copy; the 4-rank case trains its own
    ref = int8_run(zero, *flags) if layout == DP2 else _reference(tmp_path, zero, layout, flags)
    assert sorted(_losses(ref)) == list(range(1, 9))
    run_dir = tmp_path / f"resumed-zero{zero}"
    _cut(ref, run_dir, 4)
    # the layout restated: a --resume without it re-plans (and may pick another), and
    # --ranks-per-node follows the machines resumed on (checkpoint/resume_fields.py)
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", *layout[2:])
    assert code == 0, err[-2000:]
    _assert_same_run(ref, run_dir)
    assert "resumed from" in err and MEAN_LINE not in err, err[-2000:]
    if zero == 0 and not flags and layout == DP2:
        _resharded(ref, tmp_path / "resharded")


def _resharded(ref, run_dir):
    """dp=2 -> 4: each rank's own residual means nothing on the new layout; the mean does.
    Saved on with --checkpoint-residuals mean: the new checkpoints hold the mean alone."""
    _cut(ref, run_dir, 4)
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", "--nproc", "4",
                        "--plan", "dp=4", "--checkpoint-residuals", "mean")
    assert code == 0, err[-2000:]
    assert f"the layout changed (world size 2 -> 4, dp 2 -> 4); {MEAN_LINE}" in err, \
        err[-2000:]
    want, got = _losses(ref), _losses(run_dir)
    assert sorted(got) == list(range(1, 9)) and all(got[s] == want[s] for s in range(1, 5))
    # steps 5-8 on 4 ranks: the same trajectory up to the summation order and the residual's
    # split over 4 ranks instead of 2
    assert all(abs(got[s] - want[s]) < 1e-3 * abs(want[s]) for s in range(5, 9)), (got, want)
    _holds_the_mean_alone(ref, run_dir)


def _holds_the_mean_alone(ref, run_dir):
    """The step-8 checkpoint of a --checkpoint-residuals mean run: no rank's own residual, the
    setting recorded for the next resume, and smaller by what the own residuals took (4 bytes
    per parameter per rank: planner/memory_compress.py checkpoint_extra_per_param)."""
    from meshtron.checkpoint.rank_entries import _saved_shapes

    mean_only = store.checkpoint_root(run_dir) / store.step_name(8)
    own = store.checkpoint_root(ref) / store.step_name(8)
    assert _saved_shapes(mean_only) == {} and _saved_shapes(own), _saved_shapes(own)
    assert store.read_meta(mean_only)["checkpoint"]["residuals"] == "mean"
    size = {p: sum(f.stat().st_size for f in p.iterdir() if f.name.endswith(".distcp"))
            for p in (own, mean_only)}
    params = sum(v.numel() for v in load_full_state_dict(ref).values())
    # dp=2 own residuals: 2 x 4 bytes per parameter, padded to the int8 block
    assert 8 * params <= size[own] - size[mean_only] < 8.1 * params, (size, params)


@pytest.mark.slow  # two 2-rank launches; suite time
def test_inter_node_run_resumed_on_one_node_says_what_it_drops(tmp_path):
    """int8 with compress_scope='inter_node' across 2 nodes of 1 rank, resumed on one node of 2
    ranks: nothing is compressed there, so error feedback is off and the residuals the
    checkpoint holds are not applied. The resume says so in one line (it dropped them without
    a word: the ranks keep no residual, so the checkpointer's per-rank check never ran)."""
    two_nodes = ["--compress-scope", "inter_node", "--ranks-per-node", "1"]
    ref = _reference(tmp_path, 0, DP2, two_nodes)
    run_dir = tmp_path / "one-node"
    _cut(ref, run_dir, 4)
    code, _, err = _run("train", "--run-dir", str(run_dir), "--resume", *DP2[2:],
                        "--ranks-per-node", "2")
    assert code == 0, err[-2000:]
    lines = [line for line in err.splitlines() if "error-feedback residuals" in line]
    assert lines == ["meshtron train: error-feedback residuals: dropped (compress_scope="
                     "'inter_node' and no data-parallel group of this run spans two nodes, so "
                     "nothing is compressed): the int8 residuals the checkpoint holds (gradient "
                     "the compressed reduction had not delivered yet) are not applied, so the "
                     "run continues close to, not bit for bit with, an uninterrupted one"], \
        err[-3000:]
    want, got = _losses(ref), _losses(run_dir)
    assert all(got[s] == want[s] for s in range(1, 5)) and sorted(got) == list(range(1, 9))
