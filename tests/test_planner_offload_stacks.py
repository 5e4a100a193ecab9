"""Host offload per priced stack (plan_rules_offload.STACK_OFFLOADS): the search tries only the
kinds the stack's code runs, and an explicit one it does not run is refused in one line naming
the stack (exit 2), through `meshtron plan` as a user types it."""

from __future__ import annotations

import json

import pytest

from meshtron.planner.frameworks import PRESETS
from meshtron.planner.offload import device_states
from meshtron.planner.plan_rules import offload_kinds, offload_problem
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

# the lead's command: Megatron-LM 2021 had no host offload, yet 'full' was chosen as faster
LEAD_405B = ["--model", "llama3-405b", "--cluster", "dgx-h100:64", "--global-batch", "512",
             "--seq-len", "8192", "--framework", "megatron@2021", "--layout", "tp=8,pp=8,dp=8"]
# llama3-70b on one 8-GPU node: its 16 bytes per parameter of states exceed 640 GB of HBM
ONE_NODE_70B = ["--model", "llama3-70b", "--cluster", "dgx-h100:1", "--global-batch", "64",
                "--seq-len", "4096"]
SMALL = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
         "--seq-len", "4096"]


def _best(out: str) -> dict:
    doc = json.loads(out)
    assert doc["plans"], doc
    return doc["plans"][0] | {"notes": doc["notes"]}


def test_presets_name_the_offload_their_code_runs():
    kinds = {key: offload_kinds(fw.memory.host_offload) for key, fw in PRESETS.items()}
    assert kinds == {"meshtron@2026": ("full",), "torchtitan@2025": ("full",),
                     "megatron@2021": (), "megatron@2024": ("optimizer",),
                     "deepspeed@2021": ("optimizer", "full"),
                     "deepspeed@2024": ("optimizer", "full"), "torchtitan@2024": ("full",),
                     "megatron-bridge@2025": ("optimizer",), "nemo-automodel@2025": ("full",),
                     "gpt-neox@2022": ("optimizer", "full"), "llm-foundry@2023": (),
                     "llm-foundry@2024": (), "olmo-core@2024": ()}
    assert offload_kinds(None) == ("optimizer", "full")  # no stack named: every kind priced


def test_lead_command_megatron2021_no_longer_chooses_offload(plan_cli):
    rc, out, err = plan_cli(*LEAD_405B, "--json")
    assert rc == 0, err
    best = _best(out)
    assert best["offload"] == "none"
    assert not any("offload=" in n for n in best["notes"]), best["notes"]


@pytest.mark.parametrize("fw,off,zero,says", [
    ("megatron@2021", "full", None, "Megatron-LM 2021 (megatron@2021) has no host offload"),
    ("megatron@2021", "optimizer", None, "megatron@2021"),
    ("megatron@2024", "full", None, "runs only optimizer offload, from 0.12"),
    ("megatron@2024", "optimizer", "0", "distributed optimizer"),
    # HybridDeviceOptimizer over Megatron-FSDP's DTensor parameters (NVIDIA/Megatron-LM #1986)
    ("megatron@2024", "optimizer", "2", "not with Megatron-FSDP, zero 2-3"),
    ("megatron-bridge@2025", "optimizer", "3", "use zero 1 or less"),
    ("torchtitan", "optimizer", None, "torchtitan run only FSDP2's CPUOffloadPolicy"),
    ("deepspeed@2021", "optimizer", "1", "stage 1's takes none"),
    ("deepspeed@2024", "full", "2", "offload_param with ZeRO-3 only")])
def test_offload_the_stack_does_not_run_is_one_line_exit_2(plan_cli, fw, off, zero, says):
    extra = ["--zero", zero] if zero is not None else []
    rc, out, err = plan_cli(*SMALL, "--framework", fw, "--offload", off, *extra)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"plan.offload={off!r}" in lines[0] and says in lines[0], lines[0]


@pytest.mark.parametrize("fw,off,zero", [
    ("meshtron", "full", None), ("torchtitan", "full", None),
    ("megatron@2024", "optimizer", "1"), ("deepspeed@2021", "optimizer", "2"),
    ("deepspeed@2021", "full", "3"), ("deepspeed@2024", "optimizer", "1"),
    ("deepspeed@2024", "full", None)])
def test_offload_the_stack_runs_is_priced(plan_cli, fw, off, zero):
    extra = ["--zero", zero] if zero is not None else []
    rc, out, err = plan_cli(*SMALL, "--framework", fw, "--offload", off, *extra, "--json")
    assert rc == 0, err
    best = _best(out)
    assert best["offload"] == off
    if off == "full" and fw.startswith("deepspeed"):
        assert best["zero"] == 3  # ZeRO-Infinity's parameter offload is ZeRO-3's


@pytest.mark.parametrize("fw,kind", [("megatron@2024", "optimizer"),
                                     ("deepspeed@2021", "optimizer"),
                                     ("torchtitan", "full"), ("meshtron", "full")])
def test_nothing_fits_without_offload_tries_what_the_stack_runs(plan_cli, fw, kind):
    rc, out, err = plan_cli(*ONE_NODE_70B, "--framework", fw, "--json")
    assert rc == 0, err
    best = _best(out)
    assert best["offload"] == kind
    if fw == "megatron@2024":  # --optimizer-cpu-offload needs the distributed optimizer,
        assert best["zero"] == 1  # and does not run under Megatron-FSDP (zero 2-3)


def test_megatron2021_without_offload_says_nothing_fits(plan_cli):
    # no host offload to fall back on: the answer is the device-memory refusal, not a plan
    rc, out, err = plan_cli(*ONE_NODE_70B, "--framework", "megatron@2021")
    assert rc == 2 and "Nothing fits" in out
    assert len(err.strip().splitlines()) == 1, err
    assert "fits on no layout of dgx-h100:1" in err and "offload" not in err, err


def test_megatron_core_optimizer_offload_keeps_its_grad_buffer_on_the_device():
    states = (2.0, 4.0, 12.0)
    assert device_states("optimizer", states) == (2.0, 0.0, 0.0)  # ZeRO-Offload
    assert device_states("optimizer", states, "zero-offload") == (2.0, 0.0, 0.0)
    assert device_states("optimizer", states, "mcore-optimizer") == (2.0, 4.0, 0.0)
    assert device_states("full", states, "fsdp2") == (0.0, 0.0, 0.0)


def test_offload_problem_is_none_where_the_stack_runs_it():
    assert offload_problem("zero-offload-2021", "full", 3) is None
    assert offload_problem("zero-offload-2021", "optimizer", 2) is None
    assert offload_problem("none", "none", 0) is None
    assert offload_problem(None, "optimizer", 0) is None  # no stack named
    assert "allowed: none" in offload_problem("none", "full")
