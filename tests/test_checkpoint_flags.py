"""Checkpoint flags that tune a feature the run does not use are refused in one line (audit s54,
finding 3): `--keep` without `--checkpoint-every` and `--checkpoint-residuals` without gradient
compression (or without checkpoints) trained as if not given, a 2-rank run started. Through
`meshtron train` as typed, in this process: the refusal comes before any rank or file."""

from __future__ import annotations

import pytest

from testkit.plan_cli import refused

RUN = ["train", "--model", "debug", "--seq-len", "32", "--global-batch", "8", "--steps", "1"]
DP2 = ["--nproc", "2", "--plan", "dp=2"]


@pytest.mark.parametrize("flags, want", [
    (["--keep", "2"], "--keep=2: only with --checkpoint-every N or auto"),
    (["--keep", "2", "--checkpoint-every", "0", *DP2], "--keep=2: only with --checkpoint-every"),
    (["--checkpoint-residuals", "mean", "--checkpoint-every", "1", *DP2],
     "--checkpoint-residuals=mean: only with --grad-compression bf16 or int8"),
    (["--checkpoint-residuals", "own", "--checkpoint-every", "1"],  # one process: no reduction
     "--checkpoint-residuals=own: only with --grad-compression"),
    (["--checkpoint-residuals", "mean", "--grad-compression", "int8", *DP2],
     "--checkpoint-residuals=mean: only with --checkpoint-every N or auto"),
    # audit s55: Daly's MTBF given to a run of fixed (or no) interval trained as if not given
    (["--mtbf-hours", "4"], "--mtbf-hours=4: only with --checkpoint-every auto"),
    (["--mtbf-hours", "4", "--checkpoint-every", "10"], "--mtbf-hours=4: only with "
                                                        "--checkpoint-every auto"),
    # and the SIGTERM grace of a run that does not intercept SIGTERM
    (["--preempt-grace", "5"], "--preempt-grace=5: only with --checkpoint-every, --resume or "
                               "--max-restarts"),
])
def test_a_checkpoint_flag_that_reads_nothing_is_refused(capsys, tmp_path, flags, want):
    line = refused(capsys, *RUN, "--run-dir", tmp_path / "r", *flags)
    assert want in line, line
    assert not (tmp_path / "r").exists()


def test_a_saved_plan_decides_whether_residuals_mean_anything(capsys, tmp_path):
    """The compression a saved plan states is the run's: residuals of a plan without it are
    refused; the same flags with a compressed plan pass this check (refused later only for
    what else they ask)."""
    from testkit.cli_inproc import meshtron_main

    plans = {}
    for name, extra in (("plain", []), ("int8", ["--grad-compression", "int8"])):
        plans[name] = tmp_path / f"{name}.toml"
        rc, _, err = meshtron_main("plan", "--model", "debug", "--cluster", "nominal-cpu:2",
                                   "--global-batch", "8", "--seq-len", "32", "--layout", "dp=2",
                                   "--save", plans[name], *extra)
        assert rc == 0, err
    line = refused(capsys, *RUN, "--run-dir", tmp_path / "r", "--plan", plans["plain"],
                   "--checkpoint-every", "1", "--checkpoint-residuals", "mean")
    assert "--checkpoint-residuals=mean: only with --grad-compression" in line, line
    from meshtron.train.cli import job_from_args
    from meshtron.cli import build_parser

    args = build_parser().parse_args([*RUN, "--run-dir", str(tmp_path / "r"), "--plan",
                                      str(plans["int8"]), "--checkpoint-every", "1",
                                      "--checkpoint-residuals", "mean"])
    job = job_from_args(args)  # validated, nothing started
    assert job.checkpoint.residuals == "mean" and job.checkpoint.every == 1
