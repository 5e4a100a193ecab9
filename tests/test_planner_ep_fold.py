"""Expert parallelism folded over the tensor ranks, as Megatron-Core >= 0.10 runs it ("MoE
parallel folding": Plan.etp, plan_rules_fields.EP_FOLDS): the one validity function accepts
Megatron-Bridge's Qwen3-235B-A22B layout (tp 2 x dp 16 x pp 8, ep 32, etp 1) for megatron@2024
through `meshtron plan`, and refuses it, in one line, for stacks that fold ep over the data
ranks only and for meshtron's runtime; the experts' rank grid (placement.expert_placement)
matches parallel_state.py's expert RankGenerator; the folded layout's memory and all-to-alls
follow the expert grid (moe_memory.py, moe_cost.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.cli import main
from meshtron.model.spec import PRESETS
from meshtron.planner import comm, memory, moe_cost, moe_memory
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.comm import Group
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.placement import ep_group, expert_groups, expert_placement, \
    groups_for_cost
from meshtron.planner.plan import Plan
from meshtron.planner.plan_rules import plan_problems

QWEN = PRESETS["qwen3-235b-a22b"]
ARGS = ["plan", "--model", "qwen3-235b-a22b", "--cluster", "dgx-h100:32", "--global-batch",
        "2048", "--seq-len", "4096", "--micro-batch", "1", "--zero", "1", "--sp", "on",
        "--recompute", "none", "--top", "1"]
FOLDED = "tp=2,pp=8,dp=16,ep=32,etp=1"
KNOBS = {"tp": 2, "pp": 8, "dp": 16, "ep": 32, "etp": 1, "zero": 1, "micro_batch": 1,
         "global_batch": 2048, "seq_len": 4096}


def _refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def test_megatron_takes_the_folded_layout_through_the_cli(capsys):
    assert main(ARGS + ["--framework", "megatron@2024", "--layout", FOLDED, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["ep"], plan["etp"]) == (2, 8, 16, 32, 1)
    assert plan["step_time_s"] > 0


def test_folding_refused_where_the_code_does_not_fold(capsys):
    # Megatron-Core's default etp = tp: ep*etp = 64 does not divide tp*dp = 32 (its own
    # initialize_model_parallel raises on world % (etp*ep*pp))
    line = _refusal(capsys, ARGS + ["--framework", "megatron@2024", "--layout",
                                    "tp=2,pp=8,dp=16,ep=32"])
    assert "plan.ep=32" in line and "dp/dp_replicate*cp = 16" in line and "etp" in line
    line = _refusal(capsys, ARGS + ["--framework", "torchtitan", "--layout", FOLDED])
    assert line.startswith("meshtron plan: error: plan.etp=1: the priced stack folds")
    line = _refusal(capsys, ARGS + ["--layout", FOLDED])  # meshtron's runtime, the default
    assert "plan.etp=1: meshtron's runtime folds ep over the data x context ranks" in line
    line = _refusal(capsys, ARGS + ["--framework", "megatron@2024", "--layout",
                                    "tp=2,pp=8,dp=16,ep=32,etp=4"])
    assert "ep*etp = 128 must divide" in line and "tp*cp*dp = 32" in line
    line = _refusal(capsys, ARGS + ["--framework", "megatron@2024", "--layout",
                                    "tp=2,pp=8,dp=16,ep=32,etp=0"])
    assert "etp=0: must be a positive integer" in line
    # Megatron-Core's MoE under tp trains with sequence parallelism only (moe_layer.py)
    argv = [a if a != "on" else "off" for a in ARGS]
    line = _refusal(capsys, argv + ["--framework", "megatron@2024", "--layout", FOLDED])
    assert "plan.sp=false with plan.tp=2" in line


def test_the_validity_function_by_stack():
    assert plan_problems(KNOBS, 256, QWEN, runtime=False, ep_rule="tp") == []
    assert plan_problems(KNOBS, 256, QWEN, runtime=False, ep_rule="data")[0].startswith(
        "plan.etp=1: the priced stack")
    assert any("meshtron's runtime" in p for p in plan_problems(KNOBS, 256, QWEN))
    # the experts' width must split over etp (Qwen3-235B: moe_intermediate_size 1536)
    width = plan_problems({**KNOBS, "ep": 4, "etp": 7, "tp": 7, "dp": 4}, None, QWEN,
                          runtime=False, ep_rule="tp")
    assert any("must divide the experts' FFN width (1536" in p for p in width)
    # a Plan file keeps etp (saved, read back, validated like the other fields)
    p = Plan(2, 8, 16, 1, 1, "none", True, "interleaved", 4, ep=32, etp=1)
    assert Plan.from_toml(p.to_toml()).etp == 1 and "etp = 1" in p.to_toml()
    assert "etp" not in Plan(2, 8, 16, 1, 1, "none", True, None, 1, ep=16).to_toml()


def test_expert_grid_ranks_follow_megatron_core():
    # parallel_state.py's expert RankGenerator, order "tp-ep-dp-pp" with tp = etp
    grid = expert_placement(Plan(2, 8, 16, 1, 1, "none", True, None, 1, ep=32, etp=1), 8)
    assert grid.groups("ep")[0] == list(range(32))  # a stage's 32 ranks, 4 nodes
    assert grid.groups("ep")[-1] == list(range(224, 256))
    assert grid.size("edp") == 1 and grid.groups("etp")[5] == [5]
    assert ep_group(1, 32, 8) == Group(32, 8)  # 8 per node on 4 nodes
    grid = expert_placement(Plan(4, 2, 8, 1, 1, "none", True, None, 1, ep=4, etp=2), 8)
    assert grid.groups("etp")[0] == [0, 1]
    assert grid.groups("ep")[0] == [0, 2, 4, 6]
    assert grid.groups("edp")[0] == [0, 8, 16, 24]  # tp*dp / (ep*etp) = 4 apart by 8
    assert grid.groups("pp")[0] == [0, 32]  # the dense grid's pp stride tp*dp
    # the cost model's groups of the same plan: ep etp apart, expert dp etp*ep apart
    plan = Plan(4, 2, 8, 1, 1, "none", True, None, 1, ep=4, etp=2)
    groups = expert_groups(plan, 8, groups_for_cost(plan, 8))
    assert groups["dp"] == Group(4, 1) and ep_group(2, 4, 8) == Group(4, 4)


def test_folded_memory_per_category():
    # Qwen3-235B on 256 H100s, tp 2 pp 8 dp 16, ep 16: Megatron-Core's default etp (= tp = 2)
    # against etp 1 (valid for both: ep*etp divides tp*dp = 32)
    e, fe = QWEN.moe_experts, QWEN.moe_ffn_hidden
    per_expert = QWEN.mlp_params(fe)
    assert moe_memory.block_params(QWEN, 2, 8, 16, "megatron", 1)[1] == pytest.approx(
        e * per_expert / 16)
    assert moe_memory.block_params(QWEN, 2, 8, 16, "megatron")[1] == pytest.approx(
        e * per_expert / 32)
    split = (11, 12, 12, 12, 12, 12, 12, 11)  # the same blocks per stage in both
    one, dflt = (Plan(2, 8, 16, 1, 1, "none", True, None, 1, split, ep=16, etp=x,
                      dtype="bf16") for x in (1, None))
    assert moe_memory.expert_dp(one, 16) == 2 and moe_memory.expert_dp(dflt, 16) == 1
    fw = preset("megatron@2024")
    ev = Evaluator(QWEN, resolve_cluster("dgx-h100:32"), 2048, 4096, fw.kernel, mem=fw.memory)
    # the same pipeline rank (stage 3: 12 blocks, no embedding or head) in both
    a, b = ev.evaluate(one, stage=3).memory, ev.evaluate(dflt, stage=3).memory
    # the distributed optimizer's states: E/16 experts over edp 2 = E/32 over edp 1
    assert a.optimizer == pytest.approx(b.optimizer, rel=1e-9)
    # weights and main grads: E/16 experts of full width at etp 1 against E/32 (E/16 of half
    # width) at etp 2, on the fullest stage's layers, at the stack's bytes per parameter
    mem = dataclasses.replace(ev.mem, dtype="bf16")
    p_bytes, g_bytes, _ = memory.state_bytes(1, 16, ev.grad_bytes, mem)
    per_layer = e * per_expert * (1 / 16 - 1 / 32)
    layers = (a.params - b.params) * memory.GIB / (p_bytes * per_layer)
    assert layers == pytest.approx(12, rel=1e-9)
    assert (a.grads - b.grads) * memory.GIB == pytest.approx(layers * per_layer * g_bytes,
                                                             rel=1e-9)
    # the routed activations: T/tp rows of the full width (etp 1) against T rows of half
    # the width (etp 2): h + 3 fe/etp columns' bytes, 4096 + 4608 against 2 x (4096 + 2304)
    assert a.activations < b.activations


def test_folded_dispatch_sends_the_sequence_shard():
    cl = resolve_cluster("dgx-h100:32")
    t, k, h = 4096.0, QWEN.moe_top_k, QWEN.hidden
    args = (QWEN, cl, t, 32, Group(32, 8), "bf16", 1.0, False, 0, "fused", 2)
    folded = moe_cost.moe_layer_cost(*args, 1, folded=True)
    replicated = moe_cost.moe_layer_cost(*args, 1, folded=False)
    # each tp rank sends its own T/tp tokens (Megatron-Core's sequence-parallel MoE)
    assert folded.a2a_bytes == pytest.approx(moe_cost.a2a_bytes(t / 2, k, h, 2.0, 32))
    assert replicated.a2a_bytes == pytest.approx(moe_cost.a2a_bytes(t, k, h, 2.0, 32))
    # etp 2: the received rows all-gathered and the output reduce-scattered over the pair
    etp2 = moe_cost.moe_layer_cost(QWEN, cl, t, 16, Group(16, 4), "bf16", 1.0, False, 0,
                                   "fused", 2, 2, folded=True)
    fab = comm.Fabric.of(cl)
    pair = moe_cost.etp_collectives(t * k * h * 2.0, 2, cl, fab, True)
    assert pair[0] > 0 and pair[1] > 0
    no_pair = moe_cost.a2a_time(moe_cost.a2a_bytes(t / 2, k, h, 2.0, 16), Group(16, 4), fab)
    assert etp2.a2a_fwd == pytest.approx(2 * no_pair + sum(pair))


def test_megatron_default_etp_is_tp():
    # one description: etp unset on Megatron-Core is its default expert_tensor_parallel_size =
    # tp, so pricing it and pricing etp = tp give the same step and memory
    fw = preset("megatron@2024")
    ev = Evaluator(QWEN, resolve_cluster("dgx-h100:32"), 2048, 4096, fw.kernel, mem=fw.memory)
    a, b = (ev.evaluate(Plan(2, 8, 16, 1, 1, "none", True, None, 1, ep=16, etp=x,
                             dtype="bf16")) for x in (None, 2))
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.memory.total == pytest.approx(b.memory.total, rel=1e-12)
