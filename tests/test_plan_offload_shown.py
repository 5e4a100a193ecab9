"""Host offload is part of the plan's one-line description (Plan.describe): the `plan` table's
zero cell and `simulate --step`'s plan field show it, so an offloaded plan never reads like
the same knobs without offload."""

from __future__ import annotations

import json

from testkit.plan_cli import commands_fixture, plan_cli  # noqa: F401  (fixture)

cli = commands_fixture("meshtron.planner.cli", "meshtron.simulate.cli")
ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
        "--seq-len", "4096", "--layout", "dp=8", "--zero", "2", "--micro-batch", "2",
        "--recompute", "none"]


def test_plan_table_shows_offload(plan_cli):
    rc, out, err = plan_cli(*ARGS, "--offload", "full", "--top", "1")
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert "2 offload=full" in row, row
    rc, out, err = plan_cli(*ARGS, "--offload", "none", "--top", "1")  # the control
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert "offload" not in row, row


def test_simulate_plan_field_shows_offload(cli, tmp_path):
    saved = tmp_path / "plan.toml"
    rc, _, err = cli("plan", *ARGS, "--offload", "full", "--save", str(saved))
    assert rc == 0, err
    rc, out, err = cli("simulate", "--step", "--plan", str(saved), "--json")
    assert rc == 0, err
    plan = json.loads(out)["plan"]
    assert plan.endswith(" offload=full") and "zero=2" in plan, plan
