"""Collectives over groups that span many nodes (issue 30 item 3): the per-step network
latency NCCL's tuning model charges since v2.18, and what it does to a 512-rank FSDP gather."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner.cluster import cluster_from_dict, resolve_cluster
from meshtron.planner.comm import Fabric, Group, all_gather, ring_latency


def test_network_ring_step_costs_nccls_simple_protocol_latency():
    # NVIDIA/nccl src/graph/tuning.cc, hwLat[NET][RING][SIMPLE]: 14.0 us since v2.18.1 (9.6
    # in v2.7-2.11 and v2.14-2.17, 28 in v2.12-2.13); NVLink's 3.4 us unchanged. Every preset
    # cluster carries them.
    for kind in ("dgx-a100", "dgx-h100", "dgx-h200"):
        cl = resolve_cluster(f"{kind}:64")
        assert cl.inter_node_latency_us == 14.0 and cl.intra_node_latency_us == 3.4
    fab = Fabric.of(resolve_cluster("dgx-h100:64"))
    # a 512-rank ring over 64 nodes: 448 NVLink steps and 63 network steps
    assert ring_latency(Group(512, 8), fab) == pytest.approx(
        (8.4 + 448 * 3.4 + 63 * 14.0) * 1e-6)


def test_a_cluster_file_states_the_latency_of_the_nccl_it_ran():
    # a 2021 run (NCCL 2.7-2.11) states 9.6; its 512-rank gathers are shorter by exactly the
    # 63 network steps' difference, whatever the bytes
    new = resolve_cluster("dgx-h100:64")
    old = dataclasses.replace(new, inter_node_latency_us=9.6)
    for nbytes in (1e6, 8e8):
        diff = all_gather(nbytes, Group(512, 8), Fabric.of(new)) \
            - all_gather(nbytes, Group(512, 8), Fabric.of(old))
        assert diff == pytest.approx(63 * (14.0 - 9.6) * 1e-6)
    # inside one node the network latency never enters
    assert all_gather(8e8, Group(8, 8), Fabric.of(new)) == pytest.approx(
        all_gather(8e8, Group(8, 8), Fabric.of(old)))
    # and from a TOML table, validated like any field
    fields = {k: v for k, v in new.to_dict().items() if k != "name"}
    assert cluster_from_dict({**fields, "inter_node_latency_us": 9.6}).inter_node_latency_us \
        == 9.6
    with pytest.raises(UserError, match="inter_node_latency_us"):
        cluster_from_dict({**fields, "inter_node_latency_us": -1.0})


# ---- fill and drain of FSDP's step-level gathers and reductions ---------------------------------
def test_unit_chain_exposes_one_unit_whatever_the_compute_beside_it():
    from meshtron.planner.dp_cost import unit_chain
    from meshtron.planner.overlap import overlapped

    # 34 units of 3 ms each beside 10 s of compute: one unit's collective stays exposed, the
    # other 33 hide and cost only their interference
    total, units = 34 * 3e-3, 34
    assert unit_chain(total, 10.0, units, 0.12) == pytest.approx(3e-3 + 0.12 * 33 * 3e-3)
    # a single unit has no compute beside it: all exposed
    assert unit_chain(5e-3, 10.0, 1, 0.12) == pytest.approx(5e-3)
    # the rest overlaps the other units' compute only: more than it can hide shows
    assert unit_chain(total, 0.05, units, 0.12) == pytest.approx(
        3e-3 + overlapped(33 * 3e-3, 0.05 * 33 / 34, 0.12))
    assert unit_chain(0.0, 1.0, units, 0.12) == 0.0


def _zero2_dp(gpus: int, latency_us: float | None = None, zero: int = 2) -> float:
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    cl = dataclasses.replace(resolve_cluster(f"dgx-h100:{gpus // 8}"), memory_gib=1e6)
    if latency_us is not None:
        cl = dataclasses.replace(cl, inter_node_latency_us=latency_us)
    # FSDP ZeRO-2 (SHARD_GRAD_OP): one gather and one reduce-scatter per unit per step, behind
    # a large micro-batch's compute
    ev = Evaluator(PRESETS["llama3-8b"], cl, 16 * gpus, 2048, KernelOptions(sharding="fsdp"))
    plan = Plan(1, 1, gpus, zero, 16, "none", False, None, 1, dtype="bf16")
    return ev.evaluate(plan).time.dp_comm


def test_fsdp_zero2_step_pays_the_first_gather_and_the_last_reduce_scatter():
    from meshtron.planner.memory import layer_params_local

    # the compute hides all but the fill and the drain; over 64 nodes both are ring-latency
    # bound, so the exposed time follows the network step latency: 2 x 63 network steps
    from meshtron.planner.host import sm_interference

    fast, slow = _zero2_dp(512, 9.6), _zero2_dp(512, 14.0)
    step = 63 * (14.0 - 9.6) * 1e-6  # what each collective gains
    nccl = sm_interference(resolve_cluster("dgx-h100:64"), True)
    # of 34 units' gathers and as many reduce-scatters, one of each pays the whole step
    # latency and the other 33 its interference (hidden, they would all pay interference)
    assert slow - fast == pytest.approx(2 * (1 + 33 * nccl) * step, rel=1e-3)
    # and it is at least one block's gather and one block's reduce-scatter
    fab = Fabric.of(resolve_cluster("dgx-h100:64"))
    block = layer_params_local(PRESETS["llama3-8b"], 1, 1)
    ag = all_gather(2.0 * block, Group(512, 8), fab)
    assert slow > 0.9 * 2 * ag  # fp32 reduce-scatter is costlier than the bf16 gather
    # more ranks, longer rings: the exposed ends grow
    assert _zero2_dp(512) > _zero2_dp(64)


def test_fsdp_zero1_per_unit_reductions_have_the_same_ends():
    from meshtron.planner.host import sm_interference

    # meshtron's runtime runs ZeRO-1 as one reduce-scatter and one all-gather per FSDP unit
    # once a step: the last unit's reduction and the first unit's gather stay exposed too
    fast, slow = _zero2_dp(512, 9.6, zero=1), _zero2_dp(512, 14.0, zero=1)
    step = 63 * (14.0 - 9.6) * 1e-6
    nccl = sm_interference(resolve_cluster("dgx-h100:64"), True)
    assert slow - fast == pytest.approx(2 * (1 + 33 * nccl) * step, rel=1e-3)


def test_published_rows_of_2021_carry_the_latency_of_their_nccl():
    # Selene's 2020-2021 runs (N21, MT-NLG) ran NCCL 2.7-2.11, whose tuning.cc charges a
    # network ring step 9.6 us; today's stacks (Megatron-Bridge, torchtitan) run >= 2.18
    from bench.published.runs import published_runs

    runs = published_runs()
    old = [r for r in runs if r.name.startswith(("N21 ", "MT-NLG "))]
    new = [r for r in runs if r.name.startswith(("MB2", "TT "))]
    assert len(old) == 15 and new
    assert {r.cluster.inter_node_latency_us for r in old} == {9.6}
    assert {r.cluster.inter_node_latency_us for r in new} == {14.0}
