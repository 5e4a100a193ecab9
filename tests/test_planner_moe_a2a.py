"""The expert all-to-alls' element size (planner/moe_cost.py `a2a_dtype_bytes`): DeepSeek-V3's
FP8 dispatch with BF16 combines (report section 3.3.3; DeepEP docs/legacy.md, "FP8 dispatching
and BF16 combining"). Torch-free."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import preset
from meshtron.planner import comm, moe_cost, placement
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import PRESETS
from meshtron.planner.plan import Plan
from testkit.plan_cli import options_refusal, plan_cli  # noqa: F401 (fixture)

TOKENS = 4096.0  # DeepEP's V3 pre-training setting: 4,096 tokens per batch


def _layer(dtype: str, dispatch: str, ep: int = 64):
    model, cl = preset("deepseek-v3"), resolve_cluster("dgx-h100:16")
    group = placement.ep_group(1, ep, cl.gpus_per_node)
    cost = moe_cost.moe_layer_cost(model, cl, TOKENS, ep, group, dtype, 1.0, False, 4, "fused",
                                   ep_dispatch=dispatch)
    return cost, model, cl, group


def test_fp8_dispatch_sends_fp8_rows_with_block_scales_toward_the_experts_only():
    bf16, model, cl, group = _layer("fp8", "bf16")
    fp8, *_ = _layer("fp8", "fp8")
    fab = comm.Fabric.of(cl)
    nbytes = moe_cost.a2a_bytes(TOKENS, model.moe_top_k, model.hidden, 2.0, 64)

    def call(n):
        return moe_cost.a2a_time(n, group, fab, model.moe_top_k, 4)

    # the forward: dispatch at 1 + 4/128 bytes per element, combine in bf16; the backward the
    # same (the combine's twin carries the gradient toward the down-projection in FP8)
    assert fp8.a2a_fwd == pytest.approx(call(nbytes * (1 + 4 / 128) / 2) + call(nbytes))
    assert fp8.a2a_bwd == pytest.approx(fp8.a2a_fwd)
    assert bf16.a2a_fwd == pytest.approx(2 * call(nbytes))
    # cross-node bound at ep 64: the FP8 call takes about half the bf16 one's time
    assert 0.7 < fp8.a2a_fwd / bf16.a2a_fwd < 0.8
    assert fp8.compute_fwd == bf16.compute_fwd  # the experts' GEMMs are not what moved


def test_bf16_experts_take_bf16_rows_whatever_the_option():
    plain, *_ = _layer("bf16", "bf16")
    asked, *_ = _layer("bf16", "fp8")
    assert asked.a2a_fwd == plain.a2a_fwd and asked.a2a_bwd == plain.a2a_bwd


def test_a2a_dtype_bytes():
    assert moe_cost.a2a_dtype_bytes(2.0, True, "fp8") == (1.03125, 2.0)
    assert moe_cost.a2a_dtype_bytes(2.0, True, "bf16") == (2.0, 2.0)
    assert moe_cost.a2a_dtype_bytes(2.0, False, "fp8") == (2.0, 2.0)


def test_unknown_dispatch_is_refused_naming_the_field():
    with pytest.raises(UserError, match=r"ep_dispatch='int8': allowed values are bf16, fp8"):
        KernelOptions(ep_dispatch="int8")


def test_fp8_dispatch_shortens_exposed_expert_comm_through_the_evaluator():
    """Through `evaluate`, an exposed all-to-all (no overlap) on 2 nodes: the step's ep_comm
    falls with the FP8 dispatch; its compute falls a little too, since rows arriving quantised
    skip Transformer Engine's padding copies (moe_fp8.fp8_pad_passes), and nothing else of
    the step changes."""
    mcore = PRESETS["megatron@2024"]
    plan = Plan.trusted(1, 1, 16, 1, 1, "full", False, None, 1, "fp8", 1, 1, "fp32", False, 16)

    def time(dispatch):
        opts = dataclasses.replace(mcore.kernel, ep_dispatch=dispatch)
        ev = Evaluator(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:2"), 64, 4096, opts,
                       mem=mcore.memory)
        return ev.evaluate(plan, keep_infeasible=True).time

    bf16, fp8 = time("bf16"), time("fp8")
    assert fp8.ep_comm < 0.85 * bf16.ep_comm
    assert 0.97 * bf16.compute < fp8.compute < bf16.compute
    for piece in ("tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer"):
        assert getattr(fp8, piece) == pytest.approx(getattr(bf16, piece), rel=1e-6), piece


def test_unknown_dispatch_in_an_options_file_is_one_line_exit_2(plan_cli, tmp_path):
    err = options_refusal(plan_cli, tmp_path, 'ep_dispatch = "fp4"', "--model",
                          "mixtral-8x7b", "--cluster", "dgx-h100:2", "--global-batch", "64",
                          "--seq-len", "4096", "--framework", "megatron@2024")
    assert "ep_dispatch='fp4': allowed values are bf16, fp8" in err


def test_hybridep_is_deepeps_rows_plus_a_routing_map_gather_before_each_forward():
    """HybridEP (Megatron-Core's flex dispatcher, backend 'hybridep') sends DeepEP's
    deduplicated rows, and before each forward dispatch all-gathers the [tokens, experts]
    boolean routing map over the ep group (DeepEP branch hybrid-ep, Executor::
    allgather_routing_map); the backward reuses the forward's handle. Qwen3-30B-A3B at ep 16
    on two DGX-H100 nodes, the MB26.04.01 layout."""
    from meshtron.planner.moe_deepep import hybridep_map_gather_time

    model, cl = preset("qwen3-30b-a3b"), resolve_cluster("dgx-h100:2")
    group = placement.ep_group(1, 16, cl.gpus_per_node)

    def layer(dispatch):
        return moe_cost.moe_layer_cost(model, cl, TOKENS, 16, group, "fp8", 1.0, False, 0,
                                       "fused", ep_dispatch=dispatch)

    deepep, hybrid = layer("deepep"), layer("hybridep")
    gather = hybridep_map_gather_time(TOKENS, model.moe_experts, group, comm.Fabric.of(cl))
    # 16 ranks x 4,096 tokens x 128 experts of one byte: 8 MiB gathered, across both nodes
    assert gather == pytest.approx(comm.all_gather(16 * TOKENS * 128, group,
                                                   comm.Fabric.of(cl)))
    assert gather > 0
    assert hybrid.a2a_fwd == pytest.approx(deepep.a2a_fwd + gather, rel=1e-12)
    assert hybrid.a2a_bwd == deepep.a2a_bwd
    assert hybrid.compute_fwd == deepep.compute_fwd and hybrid.compute_bwd == deepep.compute_bwd
    # one rank alone gathers nothing
    assert hybridep_map_gather_time(TOKENS, 128, placement.ep_group(1, 1, 8),
                                    comm.Fabric.of(cl)) == 0.0
