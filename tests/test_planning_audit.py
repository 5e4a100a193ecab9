"""Defects a user's audit of the planning commands found (session 52), each run as the user
typed it, through `meshtron.cli.main` in this process (no command here trains): before the fix
each answered without complaint, or with a traceback, what the test now expects."""

from __future__ import annotations

import pytest

from meshtron.cli import main
from testkit.plan_cli import refused

SMALL = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
         "--seq-len", "4096"]


@pytest.fixture
def saved(tmp_path, capsys) -> str:
    """`meshtron plan ... --save plan.toml` for Llama-3-8B on one DGX H100 node."""
    path = tmp_path / "plan.toml"
    assert main(["plan", *SMALL, "--top", "1", "--save", str(path)]) == 0
    capsys.readouterr()
    return str(path)


@pytest.mark.parametrize("command", [["cost"], ["simulate", "--step"]])
@pytest.mark.parametrize("flag, value, saved_as", [("--global-batch", "32", "global_batch 64"),
                                                    ("--seq-len", "2048", "seq_len 4096")])
def test_a_batch_or_length_the_saved_plan_does_not_hold_is_refused(capsys, saved, command, flag,
                                                                    value, saved_as):
    """`cost --plan plan.toml --global-batch 32` priced a 32-sequence step under the plan's
    name (exit 0), and blamed the gap to the file's [predicted] on a missing --framework
    ("saved before plans recorded their stack?"); `rehearse --plan` refuses the same flag."""
    line = refused(capsys, *command, "--plan", saved, flag, value)
    assert f"{flag[2:]}={int(value)!r}: contradicts the plan" in line and saved_as in line, line


@pytest.mark.parametrize("command", [["cost"], ["simulate", "--step"]])
def test_restating_the_saved_batch_and_length_is_accepted(capsys, saved, command):
    assert main([*command, "--plan", saved, "--global-batch", "64", "--seq-len", "4096"]) == 0
    out, err = capsys.readouterr()
    assert "Plan: " in out and "re-priced" not in err, err
