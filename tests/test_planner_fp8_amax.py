"""Transformer Engine's FP8 amax all-reduces in the planner (planner/fp8_amax.py), each pinned
from the code it comes from: delayed scaling's two blocking reductions per micro-batch and
model chunk over a pipeline stage's dp x tp x cp ranks (Megatron-Core's amax reduction group),
current scaling's per-tensor reductions over tp before the FP8 gathers of sequence
parallelism, both at NCCL's LL-protocol latencies (tuning.cc). No published row's figure."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import comm
from meshtron.planner import compute as C
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.fp8_amax import (AMAX_BYTES, current_amax_tp_s, delayed_amax_step_s,
                                       mlp_amax_share, te_gemms_per_layer)
from meshtron.planner.frameworks import preset
from meshtron.planner.placement import groups_for_cost
from meshtron.planner.plan import Plan

H100 = resolve_cluster("dgx-h100:32")
FAB = comm.Fabric.of(H100)
L8 = PRESETS["llama3-8b"]
MCORE = preset("megatron@2024").kernel
US = 1e-6


def test_small_all_reduce_is_nccls_ll_tree_across_nodes_and_ll_ring_inside_one():
    # 256 ranks, 8 per node (32 nodes): the LL tree, baseLat 6.8 + 2 (7 x 0.6 + log2(32) x 5.0)
    lat = (6.8 + 2 * (7 * 0.6 + 5 * 5.0)) * US
    got = comm.small_all_reduce(64, comm.Group(256, 8), FAB)
    assert got == pytest.approx(lat, rel=1e-3)  # the bytes add well under 0.1%
    # one node of 8: the LL ring, 6.6 + 14 x 0.6, beats the tree's 6.8 + 14 x 0.6
    assert comm.small_all_reduce(4, comm.Group(8, 8), FAB) == pytest.approx(15.0 * US, rel=1e-3)
    # the Simple protocol's figures (comm.all_reduce) are several times slower at this size:
    # NCCL's tuner would not pick them
    assert comm.all_reduce(64, comm.Group(256, 8), FAB) > 2.5 * got
    # the tree's latency grows with log2 of the nodes, not with the ranks
    assert comm.small_all_reduce(64, comm.Group(512, 8), FAB) - got == pytest.approx(
        2 * 5.0 * US, rel=1e-2)
    assert comm.small_all_reduce(64, comm.Group(1, 1), FAB) == 0.0
    # one rank per node (NCCL v2.23+): the ring's network steps at the tree's 5.0 us, so two
    # nodes cost 6.6 + 2 x 5.0 (not 2 x 2.7), just under the tree's 6.8 + 2 x 5.0
    assert comm.small_all_reduce(4, comm.Group(2, 1), FAB) == pytest.approx(16.6 * US, rel=1e-3)


def test_amax_group_is_every_rank_of_a_pipeline_stage():
    # Megatron-Core's get_amax_reduction_group(with_context_parallel=True): tp x dp x cp
    plan = Plan(tp=4, pp=4, dp=64, zero=1, sp=True, dtype="fp8", cp=2)
    assert groups_for_cost(plan, 8)["amax"] == comm.Group(4 * 64 * 2, 8)
    assert groups_for_cost(Plan(tp=8, pp=2, dp=1), 8)["amax"] == comm.Group(8, 8)


def test_delayed_scaling_reduces_twice_per_micro_batch_and_chunk():
    group = comm.Group(256, 8)
    gemms = 3 * te_gemms_per_layer(L8)
    assert te_gemms_per_layer(L8) == 4  # fused QKV, output projection, fc1, fc2
    one = (comm.small_all_reduce(3 * AMAX_BYTES * gemms, group, FAB)
           + comm.small_all_reduce(2 * AMAX_BYTES * gemms, group, FAB))
    got = delayed_amax_step_s(MCORE, "fp8", 16, 5, 3, L8, 1, group, FAB)
    assert got == pytest.approx(16 * 5 * one)
    # only delayed scaling keeps a global amax buffer; bf16 runs none; one rank reduces nothing
    for scaling in ("te-current", "torchao", "torchao-tensorwise"):
        opts = dataclasses.replace(MCORE, fp8_scaling=scaling)
        assert delayed_amax_step_s(opts, "fp8", 16, 5, 3, L8, 1, group, FAB) == 0.0
    assert delayed_amax_step_s(MCORE, "bf16", 16, 5, 3, L8, 1, group, FAB) == 0.0
    assert delayed_amax_step_s(MCORE, "fp8", 16, 5, 3, L8, 1, comm.Group(1, 1), FAB) == 0.0
    # DeepSeek-V3's block scales are computed online per tile: no reduction
    block = dataclasses.replace(MCORE, fp8_gemm="blockwise")
    assert delayed_amax_step_s(block, "fp8", 16, 5, 3, L8, 1, group, FAB) == 0.0
    # more data-parallel ranks at the same micro-batches per rank: more to wait for
    assert delayed_amax_step_s(MCORE, "fp8", 16, 5, 3, L8, 1, comm.Group(2048, 8), FAB) > got


def test_evaluator_books_the_delayed_reductions_as_fp8_sync_not_data_parallel_time():
    """Without data parallelism the stage's amax reductions run over its tensor-parallel
    ranks: 2 per micro-batch per model chunk, the whole of TimeBreakdown.fp8_sync; dp_comm
    stays 0 (no data-parallel traffic: compression_advice must not count them), and the part
    is in the step total, the --json time_s and the step categories' communication."""
    from meshtron.planner.step_categories import step_categories

    small = dataclasses.replace(L8, layers=4)
    cl = resolve_cluster("dgx-h100:1")
    fab = comm.Fabric.of(cl)
    plan = Plan(tp=4, pp=2, dp=1, zero=1, micro_batch=1, sp=True, schedule="interleaved",
                virtual_stages=2, dtype="fp8")
    ev = Evaluator(small, cl, 8, 4096, MCORE)
    t = ev.evaluate(plan).time
    per_rank_layers = small.layers // 2
    assert t.fp8_sync == pytest.approx(delayed_amax_step_s(
        MCORE, "fp8", 8, 2, per_rank_layers, small, 1, comm.Group(4, 4), fab))
    assert t.fp8_sync > 0 and t.dp_comm == 0.0
    assert t.to_dict()["fp8_sync"] == t.fp8_sync and "fp8_sync" in t.to_dict()
    current = Evaluator(small, cl, 8, 4096, dataclasses.replace(MCORE, fp8_scaling="te-current"))
    assert current.evaluate(plan).time.fp8_sync == 0.0
    bf16 = ev.evaluate(dataclasses.replace(plan, dtype="bf16")).time
    assert bf16.fp8_sync == 0.0 and "fp8_sync" not in bf16.to_dict()
    # no pipeline: the step categories add up with the part in 'communication'
    flat = Plan(tp=4, pp=1, dp=2, zero=1, micro_batch=1, sp=True, dtype="fp8")
    est = ev.evaluate(flat)
    assert est.time.fp8_sync > 0
    cats = step_categories(ev, est)
    assert cats["communication"] == pytest.approx(
        est.time.tp_comm + est.time.dp_comm + est.time.fp8_sync)
    # the report's step line names it apart from data-parallel time; the sweep has a column
    from meshtron.planner.report import breakdown_line, fmt_s
    from meshtron.simulate.why import PARTS

    line = breakdown_line(est)
    assert f"FP8 amax all-reduces {fmt_s(est.time.fp8_sync)}" in line
    assert "FP8 amax" not in breakdown_line(ev.evaluate(dataclasses.replace(flat, dtype="bf16")))
    assert "fp8_sync" in PARTS


def test_current_scaling_reduces_each_gathered_tensors_amax_over_tp():
    """te-current and te-delayed gather the same FP8 tensors: their layers' tensor-parallel
    time differs by current scaling's four one-float all-reduces (QKV and fc1 inputs forward,
    the output projection's and fc2's output gradients backward)."""
    cl = resolve_cluster("dgx-h100:1")
    opts = {s: dataclasses.replace(MCORE, fp8_scaling=s) for s in ("te-delayed", "te-current")}
    cost = {s: C.layer_cost(L8, cl, 8, 1, 4096, True, o, 1, "fp8") for s, o in opts.items()}
    one = comm.small_all_reduce(AMAX_BYTES, comm.Group(8, 8), comm.Fabric.of(cl))
    assert cost["te-current"].tp_fwd - cost["te-delayed"].tp_fwd == pytest.approx(2 * one)
    assert cost["te-current"].tp_bwd - cost["te-delayed"].tp_bwd == pytest.approx(2 * one)
    # without sequence parallelism nothing is gathered in FP8: no reduction
    frac = dict.fromkeys(("qkv", "out", "up", "down"), 1.0)
    assert current_amax_tp_s(opts["te-current"], False, frac, comm.Group(8, 8), FAB) == \
        (0.0, 0.0)
    assert current_amax_tp_s(opts["te-delayed"], True, frac, comm.Group(8, 8), FAB) == \
        (0.0, 0.0)
    # a group without FP8 Linears casts nothing, so reduces nothing
    bf16_mlp = {**frac, "up": 0.0, "down": 0.0}
    assert current_amax_tp_s(opts["te-current"], True, bf16_mlp, comm.Group(8, 8), FAB) == \
        pytest.approx((one, one))


def test_current_scaling_skips_the_routed_experts_amax_over_tp():
    """Megatron-Core's routed experts (TEGroupedLinear with explicit_expert_comm: TE's
    parallel_mode None) reduce no amax over tp; dense blocks and shared experts do. A mixture
    without shared experts pays fc1 / fc2 only on its dense blocks, one with them on every
    block."""
    dsv3 = PRESETS["deepseek-v3"]
    assert dsv3.moe_shared_experts and dsv3.moe_layers < dsv3.layers
    assert mlp_amax_share(dsv3) == 1.0
    routed_only = dataclasses.replace(dsv3, moe_shared_experts=0)
    dense = (dsv3.layers - dsv3.moe_layers) / dsv3.layers
    assert mlp_amax_share(routed_only) == pytest.approx(dense)
    assert mlp_amax_share(L8) == 1.0
    cur = dataclasses.replace(MCORE, fp8_scaling="te-current")
    frac = dict.fromkeys(("qkv", "out", "up", "down"), 1.0)
    group = comm.Group(8, 8)
    one = comm.small_all_reduce(AMAX_BYTES, group, FAB)
    assert current_amax_tp_s(cur, True, frac, group, FAB, mlp_amax_share(routed_only)) == \
        pytest.approx((one * (1 + dense), one * (1 + dense)))
    # through the evaluator: a routed-only mixture's layer pays (1 - dense share) fewer fc1 /
    # fc2 reductions than the same active layer priced as dense
    small = dataclasses.replace(routed_only, layers=4, moe_dense_layers=1)
    assert mlp_amax_share(small) == pytest.approx(0.25)
    cl = resolve_cluster("dgx-h100:1")
    plan = Plan(tp=8, pp=1, dp=1, ep=1, zero=1, micro_batch=1, sp=True, dtype="fp8")
    ev = Evaluator(small, cl, 8, 4096, cur)
    ev.evaluate(plan)
    priced = next(v for k, v in ev._cache.items() if k[0] == "layer")
    frac = tuple(_fractions(ev, plan))
    as_dense = C.layer_cost(ev.active, cl, 8, 1, 4096, True, cur, 1, "fp8", frac, "rowwise")
    one = comm.small_all_reduce(AMAX_BYTES, comm.Group(8, 8), comm.Fabric.of(cl))
    assert as_dense.tp_fwd - priced.tp_fwd == pytest.approx(0.75 * one)
    assert as_dense.tp_bwd - priced.tp_bwd == pytest.approx(0.75 * one)


def _fractions(ev, plan):
    from meshtron.planner.fp8 import fp8_fractions

    return fp8_fractions(ev.model, plan.tp, plan.fp8_recipe, ev.opts.fp8_filter).values()
