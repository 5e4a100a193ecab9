"""A saved plan (`meshtron plan --save`, then `meshtron train --plan FILE`) is checked against
the run before its size starts anything: a plan for another model is named as that.

Through `meshtron.cli.main` in this process: every refusal here comes before any rank starts.
"""

from __future__ import annotations

from meshtron.cli import main
from testkit.plan_cli import refused


def test_a_plan_for_another_model_is_named_before_its_rank_count(capsys, tmp_path):
    """A user audit: a 64-GPU plan for Llama 3 70B given with --model llama3-8b was told only
    "--nproc=64: allowed 1..32 local ranks on this machine" (the plan's size was checked
    first), which sends the user after the wrong field."""
    plan = tmp_path / "p70.toml"
    assert main(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100:8", "--top", "1",
                 "--layout", "tp=8,pp=1,dp=8", "--save", str(plan)]) == 0
    run = tmp_path / "run"
    line = refused(capsys, "train", "--model", "llama3-8b", "--plan", plan, "--steps", "1",
                   "--run-dir", run)
    assert "plan.model='llama3-70b'" in line and "llama3-8b" in line, line
    assert not run.exists()
    # The plan's own model: the rank count is then the first thing wrong on this machine,
    # named as the plan's (the user typed no --nproc; it read "--nproc=64: allowed 1..32").
    line = refused(capsys, "train", "--plan", plan, "--steps", "1", "--run-dir", run)
    assert f"error: --plan {plan}: the plan is for 64 ranks (plan.gpus)" in line, line
    assert "--nproc" not in line, line
    assert not run.exists()
    line = refused(capsys, "train", "--plan", plan, "--nproc", "64", "--steps", "1",
                   "--run-dir", run)  # typed: named as typed
    assert "error: --nproc=64: allowed 1.." in line, line
