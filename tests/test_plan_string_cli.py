"""User audit 2026-12-05 (session 43), through the `meshtron` command where it was seen: HSDP's
replicate axis in a `--plan` / `--layout` string, `nominal-cpu:N` as a `--cluster` value (the
name runs print), and a hand-written plan.toml without [predicted] ('not priced', never nan).

Suite time: the 4-rank HSDP run from the plan string is `slow`. Default: `train --plan` reads
the replicate axis (its refusal below, in this process), `plan --layout` saves it, HSDP trains
as one process does (tests/test_parallel.py, dp=4 zero=3 dp_replicate=2), and a run prints a
cluster name `plan --cluster` takes (tests/test_run_folder.py, nominal-cpu:2)."""

from __future__ import annotations

import tomllib

import pytest

from tests.test_cli_issue28 import SMALL, meshtron, meshtron_main, one_line

PLAN = ["plan", "--model", "debug", "--global-batch", "8", "--seq-len", "16"]


def test_the_layout_string_names_the_replicate_axis(tmp_path, capsys):
    saved = tmp_path / "hsdp.toml"
    proc = meshtron_main(capsys, *PLAN, "--cluster", "nominal-cpu:4",
                         "--layout", "dp=4,dp_replicate=2", "--save", saved)
    assert proc.returncode == 0, proc.stderr
    plan = tomllib.loads(saved.read_text())
    assert (plan["dp"], plan["dp_replicate"], plan["zero"] >= 2) == (4, 2, True)
    assert plan["cluster"] == "nominal-cpu:4"


def test_a_wrong_layout_string_lists_the_replicate_axis_and_the_rule_names_it(capsys):
    bad = meshtron_main(capsys, *PLAN, "--cluster", "nominal-cpu:4", "--layout", "dp=4,dpr=2")
    assert bad.returncode == 2
    assert "dp_replicate=N" in one_line(bad) and "'dp=4,dpr=2'" in one_line(bad)
    odd = meshtron_main(capsys, *PLAN, "--cluster", "nominal-cpu:4",
                        "--layout", "dp=4,dp_replicate=3")
    assert odd.returncode == 2 and "plan.dp_replicate=3: must divide plan.dp=4" in one_line(odd)
    twice = meshtron_main(capsys, *PLAN, "--cluster", "nominal-cpu:4",
                          "--layout", "dp=4,dp_replicate=2", "--dp-replicate", "4")
    assert twice.returncode == 2 and "--dp-replicate=4" in one_line(twice)


def test_an_unknown_cluster_preset_lists_nominal_cpu(capsys):
    proc = meshtron_main(capsys, *PLAN, "--cluster", "nominal-gpu:4")
    assert proc.returncode == 2 and "nominal-cpu:N" in one_line(proc)


def test_train_reads_the_replicate_axis_of_its_plan_string(capsys, tmp_path):
    """In this process: refused by the plan's rule on that axis before any rank starts."""
    proc = meshtron_main(capsys, "train", *SMALL, "--nproc", "4", "--plan",
                         "dp=4,dp_replicate=3", "--steps", "1", "--run-dir", tmp_path / "r")
    assert proc.returncode == 2, proc.stderr
    assert "plan.dp_replicate=3: must divide plan.dp=4" in one_line(proc)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # a 4-rank launch (suite time); default coverage: the module doc
def test_train_runs_hsdp_from_the_plan_string_and_says_so(tmp_path):
    run = tmp_path / "hsdp"
    proc = meshtron("train", *SMALL, "--nproc", "4", "--plan", "dp=4,dp_replicate=2",
                    "--steps", "1", "--run-dir", run)
    assert proc.returncode == 0, proc.stderr
    assert "plan tp=1,pp=1,dp=4,dp_replicate=2 " in proc.stdout
    plan = tomllib.loads((run / "plan.toml").read_text())
    assert plan["dp_replicate"] == 2
    # the cluster a run prints is one `meshtron plan --cluster` accepts
    assert "on nominal-cpu:4;" in proc.stdout


def test_a_plan_file_without_predicted_is_not_priced_never_nan(tmp_path):
    """A planned launch of the plan's one rank (torchrun, the planned path's printing), in
    this process (testkit/cli_inproc.py; suite time: was a 2-rank launch as a child, the same
    lines)."""
    plan = tmp_path / "hand.toml"
    plan.write_text('format = "meshtron-plan/2"\nmodel = "debug"\ngpus = 1\n'
                    'global_batch = 8\nseq_len = 16\ntp = 1\npp = 1\ndp = 1\nzero = 1\n'
                    'micro_batch = 4\n')
    from testkit.cli_inproc import meshtron_main as in_process

    code, out, err = in_process("train", *SMALL, "--plan", plan, "--steps", "1",
                                "--run-dir", tmp_path / "run")
    assert code == 0, err
    assert "nan" not in out
    assert "; not priced (the plan file has no predicted table);" in out, out
