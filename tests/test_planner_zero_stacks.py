"""ZeRO stages per priced stack (plan_rules_zero.STACK_ZEROS): the search tries only the stages
the stack's code runs on each layout, and an explicit one it does not run is refused in one line
naming the stack (exit 2), through `meshtron plan` / `cost --plan` as a user types them."""

from __future__ import annotations

import json

import pytest

from meshtron.planner.frameworks import PRESETS
from meshtron.planner.plan_rules import STACK_ZEROS, zero_limit, zero_problem
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

# the lead's command: Megatron-LM 2021 had no ZeRO, yet zero=2 was chosen
LEAD_405B = ["--model", "llama3-405b", "--cluster", "dgx-h100:64", "--global-batch", "512",
             "--seq-len", "8192", "--framework", "megatron@2021", "--layout", "tp=8,pp=8,dp=8"]
SMALL = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
         "--seq-len", "4096"]
# llama3-70b pinned at tp=4,pp=2,dp=4 with zero 0 and no recomputation does not fit (181 GiB)
PINNED_70B = ["--model", "llama3-70b", "--cluster", "dgx-h100:4", "--global-batch", "64",
              "--seq-len", "4096", "--layout", "tp=4,pp=2,dp=4", "--zero", "0",
              "--recompute", "none", "--json"]


def _doc(out: str) -> dict:
    doc = json.loads(out)
    assert doc["plans"], doc
    return doc


def test_presets_name_the_zero_stages_their_code_runs():
    stages = {key: STACK_ZEROS[fw.memory.zero_stages][0] for key, fw in PRESETS.items()}
    assert stages == {"meshtron@2026": (0, 1, 2, 3), "torchtitan@2025": (0, 2, 3),
                      "megatron@2021": (0,), "megatron@2024": (0, 1, 2, 3),
                      "deepspeed@2021": (0, 1, 2, 3), "deepspeed@2024": (0, 1, 2, 3),
                      "torchtitan@2024": (0, 2, 3), "megatron-bridge@2025": (0, 1, 2, 3),
                      "nemo-automodel@2025": (0, 3), "gpt-neox@2022": (0, 1, 2, 3),
                      "llm-foundry@2023": (0, 2, 3), "llm-foundry@2024": (0, 2, 3),
                      "olmo-core@2024": (0, 3)}


def test_lead_command_megatron2021_picks_zero_0(plan_cli):
    rc, out, err = plan_cli(*LEAD_405B, "--json", "--top", "5")
    assert rc == 0, err
    doc = _doc(out)
    assert {p["zero"] for p in doc["plans"]} == {0}


@pytest.mark.parametrize("fw,zero,layout,says", [
    ("megatron@2021", "1", None, "Megatron-LM 2021 (megatron@2021) has no ZeRO"),
    ("megatron@2021", "3", "tp=2", "allowed: 0"),
    ("torchtitan", "1", None, "has no ZeRO-1"),
    ("torchtitan", "0", "tp=2", "DDP (zero 0) runs only without tensor"),
    ("deepspeed@2021", "2", "pp=2", "PipelineEngine asserts a ZeRO stage below 2"),
    ("deepspeed@2024", "3", "pp=2", "allowed: 0, 1"),
    # Megatron-FSDP (zero 2-3 on Megatron-Core) never ran with pipelines (issue #1455)
    ("megatron@2024", "2", "tp=2,pp=2", "not with pipeline parallelism"),
    ("megatron-bridge@2025", "3", "pp=2", "allowed: 0, 1")])
def test_zero_the_stack_does_not_run_is_one_line_exit_2(plan_cli, fw, zero, layout, says):
    extra = ["--layout", layout] if layout else []
    rc, out, err = plan_cli(*SMALL, "--framework", fw, "--zero", zero, *extra)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"plan.zero={zero}" in lines[0] and says in lines[0], lines[0]


@pytest.mark.parametrize("fw,zero,layout", [
    ("meshtron", "1", "tp=2,pp=2"), ("megatron@2021", "0", "tp=2,pp=2"),
    ("megatron@2024", "1", "tp=2,pp=2"), ("megatron@2024", "3", "tp=2"),
    ("megatron@2024", "2", "tp=2,pp=1"),
    ("deepspeed@2021", "3", "tp=1,pp=1"), ("deepspeed@2024", "1", "pp=2"),
    ("torchtitan", "0", "tp=1,pp=1"), ("torchtitan", "2", "tp=2")])
def test_zero_the_stack_runs_is_priced(plan_cli, fw, zero, layout):
    rc, out, err = plan_cli(*SMALL, "--framework", fw, "--zero", zero, "--layout", layout,
                            "--json")
    assert rc == 0, err
    assert _doc(out)["plans"][0]["zero"] == int(zero)


@pytest.mark.parametrize("fw", sorted(PRESETS))
def test_open_search_tries_only_what_the_stack_runs(plan_cli, fw):
    rc, out, err = plan_cli(*SMALL, "--framework", fw, "--json", "--top", "30")
    assert rc == 0, err
    rule = PRESETS[fw].memory.zero_stages
    for p in _doc(out)["plans"]:
        assert zero_limit(rule, p["zero"], p["dp"], p["tp"], p["pp"], p.get("cp", 1)) is None, p


def test_pinned_layout_change_proposes_only_a_stage_the_stack_runs(plan_cli, tmp_path):
    # DeepSpeed's pipeline engine: at most ZeRO-1 (without the rule the change was zero=2)
    rc, out, err = plan_cli(*PINNED_70B, "--framework", "deepspeed@2024")
    assert rc == 0, err
    change = json.loads(out)["fit_change"]
    assert change["fixed_changed"]["zero"] == [0, 1], change
    opts = tmp_path / "any.toml"
    opts.write_text('framework = "deepspeed@2024"\n[options]\nzero_stages = "any"\n')
    rc, out, err = plan_cli(*PINNED_70B, "--framework", "deepspeed@2024", "--options",
                            str(opts))
    assert rc == 0, err
    assert json.loads(out)["fit_change"]["fixed_changed"]["zero"][1] >= 2


def test_cost_plan_file_with_a_zero_the_stack_lacks_is_refused(plan_cli, tmp_path, capsys,
                                                                monkeypatch):
    import meshtron.cli as top

    plan = tmp_path / "z1.toml"
    rc, _, err = plan_cli(*SMALL, "--layout", "tp=2,pp=1", "--zero", "1", "--save", str(plan))
    assert rc == 0, err
    capsys.readouterr()
    monkeypatch.setattr(top, "COMMAND_MODULES", ["meshtron.cost.cli"])
    rc = top.main(["cost", "--plan", str(plan), "--framework", "megatron@2021"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "plan.zero=1" in lines[0] and "megatron@2021" in lines[0], lines


def test_zero_problem_is_none_where_the_stack_runs_it():
    assert zero_problem("all", 1, dp=8, tp=2, pp=2) is None  # meshtron: every stage
    assert zero_problem(None, 3, dp=8, pp=4) is None  # no stack named
    assert zero_problem("megatron-2021", 2, dp=1) is None  # one data rank shards nothing
    assert zero_problem("deepspeed", 3, dp=8, pp=None) is None  # pp not chosen yet
    assert "allowed: 0, 1" in zero_problem("deepspeed", 2, dp=8, pp=2)
