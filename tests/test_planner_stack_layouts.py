"""Parallelisms per priced stack (plan_rules_stack.STACK_LAYOUTS): a preset whose code at its
version has no tensor / pipeline parallelism or no mixture of experts is refused them in one
line (exit 2, nothing saved) and its search offers none; and NeMo AutoModel's dense path keeps
bf16 parameters (no fp32 master), through `meshtron plan` as a user types it."""

from __future__ import annotations

import json

import pytest

from meshtron.planner.frameworks import PRESETS
from meshtron.planner.plan_rules import STACK_LAYOUTS
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

SMALL = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
         "--seq-len", "4096"]
MOE = ["--model", "mixtral-8x7b", "--cluster", "dgx-h100:2", "--global-batch", "64",
       "--seq-len", "4096"]
NO_MOE = ["torchtitan@2024", "gpt-neox@2022", "llm-foundry@2023", "llm-foundry@2024",
          "megatron@2021", "deepspeed@2021", "olmo-core@2024"]


def _one_line_refusal(rc: int, out: str, err: str) -> str:
    assert rc == 2, (rc, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_presets_name_their_layout_rule():
    rules = {key: fw.memory.layouts for key, fw in PRESETS.items() if fw.memory.layouts}
    assert rules == {"torchtitan@2024": "torchtitan-2024", "gpt-neox@2022": "deepspeed-2021",
                     "llm-foundry@2023": "llm-foundry", "llm-foundry@2024": "llm-foundry",
                     "megatron@2021": "megatron-2021", "deepspeed@2021": "deepspeed-2021",
                     "olmo-core@2024": "olmo-core-2024", "megatron@2024": "megatron-core",
                     "megatron-bridge@2025": "megatron-core",
                     "deepspeed@2024": "deepspeed-2024"}
    assert set(rules.values()) == set(STACK_LAYOUTS)


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_olmo_core_refuses_tp_pp_and_cp(plan_cli, tmp_path, axis):
    saved = tmp_path / "plan.toml"
    line = _one_line_refusal(*plan_cli(*SMALL, "--framework", "olmo-core@2024", "--layout",
                                       f"{axis}=2", "--save", str(saved)))
    assert line.startswith(f"meshtron plan: error: plan.{axis}=2 on olmo-core@2024: "), line
    assert "OLMo-core v1.3-v1.5" in line and line.endswith(f"allowed: {axis}=1"), line
    assert not saved.exists()


def test_olmo_core_open_search_is_data_parallel_only(plan_cli):
    rc, out, err = plan_cli("--model", "llama3-70b", "--cluster", "dgx-h100:1",
                            "--global-batch", "64", "--seq-len", "4096", "--framework",
                            "olmo-core@2024", "--json", "--top", "40")
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert plans and all((p["tp"], p["pp"], p["cp"]) == (1, 1, 1) for p in plans), plans
    assert {p["zero"] for p in plans} <= {0, 3}, plans


@pytest.mark.parametrize("fw", ["llm-foundry@2023", "llm-foundry@2024"])
@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_llm_foundry_refuses_tp_and_pp(plan_cli, tmp_path, fw, axis):
    saved = tmp_path / "plan.toml"
    line = _one_line_refusal(*plan_cli(*SMALL, "--framework", fw, "--layout", f"{axis}=2",
                                       "--save", str(saved)))
    assert line.startswith(f"meshtron plan: error: plan.{axis}=2 on {fw}: "), line
    assert "Composer's PyTorch FSDP only" in line and line.endswith(f"allowed: {axis}=1")
    assert not saved.exists()


@pytest.mark.parametrize("fw", ["llm-foundry@2024", "torchtitan@2024"])
def test_open_search_offers_only_what_the_stack_runs(plan_cli, fw):
    # 8 GPUs, 70B: the search's top plans include tp / pp layouts where the stack runs them
    rc, out, err = plan_cli("--model", "llama3-70b", "--cluster", "dgx-h100:1",
                            "--global-batch", "64", "--seq-len", "4096", "--framework", fw,
                            "--json", "--top", "40")
    assert rc == 0, err
    doc = json.loads(out)
    split = {(p["tp"], p["pp"]) != (1, 1) for p in doc["plans"]}
    if fw.startswith("llm-foundry"):
        assert split == {False}, doc["plans"]
        assert any("layouts left out" in n and "Composer's PyTorch FSDP" in n
                   for n in doc["notes"]), doc["notes"]
    else:
        assert True in split  # the control: same command, a stack with tp and pp


@pytest.mark.parametrize("fw", NO_MOE)
def test_stacks_without_moe_refuse_moe_models(plan_cli, tmp_path, fw):
    saved = tmp_path / "plan.toml"
    line = _one_line_refusal(*plan_cli(*MOE, "--framework", fw, "--save", str(saved)))
    assert line.startswith(f"meshtron plan: error: --model mixtral-8x7b (a mixture of "
                           f"experts) on {fw}: "), line
    assert line.endswith("allowed: dense models"), line
    assert not saved.exists()


@pytest.mark.parametrize("fw", ["torchtitan@2025", "deepspeed@2024", "nemo-automodel"])
def test_stacks_with_moe_still_price_it(plan_cli, fw):
    rc, out, err = plan_cli(*MOE, "--framework", fw, "--json", "--top", "1")
    assert rc == 0, err
    assert json.loads(out)["plans"]


def test_automodel_dense_keeps_bf16_parameters(plan_cli, tmp_path):
    """v0.2.0 builds a Hugging Face model in bf16 (from_config: torch_dtype 'auto' ->
    bfloat16) and FSDP2 shards it as it is: parameters, gradients and Adam states in bf16."""
    pinned = [*SMALL, "--framework", "nemo-automodel", "--layout", "tp=1,pp=1,dp=8",
              "--zero", "3", "--recompute", "full", "--micro-batch", "1", "--json"]
    rc, out, err = plan_cli(*pinned)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["framework"]["memory"]["param_dtype"] == "bf16"
    fp32 = tmp_path / "fp32.toml"
    fp32.write_text('[options]\nparam_dtype = "fp32"\n')
    rc, out32, err = plan_cli(*pinned, "--options", str(fp32))
    assert rc == 0, err
    bf, f32 = doc["plans"][0]["memory_gib"], json.loads(out32)["plans"][0]["memory_gib"]
    # 8B parameters over 8 ranks: 2 + 2 + 4 bytes each in bf16, 4 + 4 + 8 with fp32 master
    assert bf["params"] == pytest.approx(f32["params"] / 2)
    assert bf["optimizer"] == pytest.approx(f32["optimizer"] / 2)


def test_layouts_option_any_prices_them_and_a_wrong_value_is_refused(plan_cli, tmp_path):
    opts = tmp_path / "any.toml"
    opts.write_text('[options]\nlayouts = "any"\n')
    rc, out, err = plan_cli(*SMALL, "--framework", "llm-foundry", "--layout", "tp=2",
                            "--options", str(opts), "--json", "--top", "1")
    assert rc == 0, err
    assert json.loads(out)["plans"][0]["tp"] == 2
    opts.write_text('[options]\nlayouts = "bogus"\n')
    line = _one_line_refusal(*plan_cli(*SMALL, "--framework", "llm-foundry", "--options",
                                       str(opts)))
    assert "memory.layouts='bogus': allowed values are any, llm-foundry" in line, line
