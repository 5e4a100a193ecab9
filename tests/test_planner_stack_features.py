"""What a priced stack's code had, through `meshtron plan` (plan_rules_stack.STACK_LAYOUTS):
context parallelism, sequence parallelism and selective recomputation before their code
existed, DeepSpeed's AutoTP with ZeRO 3 or sequence parallelism, and `half` recomputation on
Megatron's one-layer model chunks are refused in one line naming the stack and the feature
(exit 2), and an open search never proposes them."""

from __future__ import annotations

import json

import pytest

from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

SMALL = ["--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch", "32",
         "--seq-len", "8192"]
BIG = ["--model", "llama3-405b", "--cluster", "dgx-h100:2048", "--global-batch", "2048",
       "--seq-len", "8192"]


def _refusal(rc: int, out: str, err: str) -> str:
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fw", ["megatron@2021", "deepspeed@2021", "gpt-neox@2022"])
@pytest.mark.parametrize("forced,field", [(["--layout", "tp=4,cp=2,pp=1,dp=4"], "plan.cp=2"),
                                          (["--layout", "tp=8", "--sp", "on"], "plan.sp=true"),
                                          (["--recompute", "selective"],
                                           "plan.recompute='selective'")])
def test_stacks_before_2022_refuse_cp_sp_and_selective(plan_cli, tmp_path, fw, forced, field):
    saved = tmp_path / "plan.toml"
    line = _refusal(*plan_cli(*SMALL, "--framework", fw, *forced, "--save", str(saved)))
    assert line.startswith(f"meshtron plan: error: {field} on {fw}: "), line
    assert "allowed: " in line
    assert not saved.exists()


@pytest.mark.parametrize("fw", ["megatron@2021", "deepspeed@2021", "gpt-neox@2022"])
def test_open_search_before_2022_offers_no_cp_sp_or_selective(plan_cli, fw):
    rc, out, err = plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:4",
                            "--global-batch", "16", "--seq-len", "32768", "--framework", fw,
                            "--json", "--top", "40")
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert plans
    assert all(p["cp"] == 1 and not p["sp"] and p["recompute"] != "selective" for p in plans)


def test_open_search_megatron_2024_still_offers_cp_and_sp(plan_cli):
    # the control: same question, a stack whose code has both
    rc, out, err = plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:4",
                            "--global-batch", "16", "--seq-len", "32768", "--framework",
                            "megatron@2024", "--json", "--top", "40")
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert any(p["cp"] > 1 for p in plans) and any(p["sp"] for p in plans)


@pytest.mark.parametrize("forced,field", [(["--zero", "3"], "plan.zero=3 with plan.tp=8"),
                                          (["--sp", "on"], "plan.sp=true")])
def test_deepspeed_2024_autotp_refuses_zero3_and_sp(plan_cli, forced, field):
    line = _refusal(*plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:4",
                              "--global-batch", "64", "--seq-len", "8192", "--framework",
                              "deepspeed@2024", "--layout", "tp=8,dp=4", *forced))
    assert line.startswith(f"meshtron plan: error: {field} on deepspeed@2024: "), line
    assert "AutoTP" in line


def test_deepspeed_2024_search_has_no_tp_with_zero3_or_sp(plan_cli):
    rc, out, err = plan_cli("--model", "llama3-70b", "--cluster", "dgx-h100:8",
                            "--global-batch", "64", "--seq-len", "8192", "--framework",
                            "deepspeed@2024", "--json", "--top", "40")
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert any(p["tp"] > 1 for p in plans), plans  # tp stays offered, with ZeRO 0-2
    assert all(not p["sp"] and (p["tp"] == 1 or p["zero"] <= 2) for p in plans), plans


def test_megatron_half_on_one_layer_chunks_is_refused(plan_cli):
    line = _refusal(*plan_cli(*BIG, "--framework", "megatron@2024", "--layout",
                              "tp=8,pp=16,dp=128", "--recompute", "half", "--schedule",
                              "interleaved:8"))
    assert line.startswith("meshtron plan: error: plan.recompute='half' on megatron@2024 with "
                           "1 layer per model chunk: "), line
    assert "transformer_block.py" in line


def test_megatron_search_offers_half_only_on_chunks_it_can_split(plan_cli):
    rc, out, err = plan_cli(*BIG, "--framework", "megatron@2024", "--layout",
                            "tp=8,pp=16,dp=128", "--json", "--top", "40")
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    halves = [p for p in plans if p["recompute"] == "half"]
    # 126 layers over 16 x v chunks: v = 8 leaves one layer per chunk, v <= 4 two or more
    assert halves and all(p["virtual_stages"] <= 4 for p in halves), halves
    assert any(p["virtual_stages"] == 8 for p in plans)  # v = 8 stays, with none / full


def test_meshtron_runtime_keeps_half_on_one_layer_chunks(plan_cli):
    # meshtron's runtime checkpoints every second block of each part: priced, not refused
    rc, out, err = plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch",
                            "64", "--seq-len", "4096", "--layout", "tp=4,pp=8,dp=1",
                            "--recompute", "half", "--schedule", "interleaved:4", "--json")
    assert rc == 0, err
    assert json.loads(out)["plans"][0]["recompute"] == "half"


def test_world_size_is_checked_before_the_batch(plan_cli):
    line = _refusal(*plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:8",
                              "--global-batch", "64", "--seq-len", "8192", "--layout",
                              "tp=8,dp=9"))
    assert line == ("meshtron plan: error: plan.tp*dp=8*9=72: must divide the world size 64 "
                    "(GPUs; cp*pp takes the rest)"), line


def test_no_plan_names_the_commonest_refusals(plan_cli):
    # 4 sequences over 64 GPUs: every layout needs a pipeline with fewer micro-batches than
    # stages; the refusal says so, with counts, instead of "no layout is valid"
    rc, out, err = plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:8",
                            "--global-batch", "4", "--seq-len", "4096")
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("meshtron plan: error: no plan: every schedule / knob point of the "
                           ), line
    assert "micro-batches per step, schedule '1f1b' needs at least pp=" in line, line
    assert "commonest first: " in line and "x plan.micro_batch: " in line, line
