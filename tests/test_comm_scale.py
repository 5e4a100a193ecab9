"""Collectives over groups that span many nodes (issue 30 item 3): the per-step network
latency NCCL's tuning model charges since v2.18, and what it does to a 512-rank FSDP gather."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.planner.cluster import cluster_from_dict, resolve_cluster
from meshtron.planner.comm import Fabric, Group, all_gather, ring_latency


def test_network_ring_step_costs_nccls_simple_protocol_latency():
    # NVIDIA/nccl src/graph/tuning.cc, hwLat[NET][RING][SIMPLE]: 14.0 us since v2.18.1 (9.6
    # in v2.8-2.16); NVLink's 3.4 us unchanged. Every preset cluster carries them.
    for kind in ("dgx-a100", "dgx-h100", "dgx-h200"):
        cl = resolve_cluster(f"{kind}:64")
        assert cl.inter_node_latency_us == 14.0 and cl.intra_node_latency_us == 3.4
    fab = Fabric.of(resolve_cluster("dgx-h100:64"))
    # a 512-rank ring over 64 nodes: 448 NVLink steps and 63 network steps
    assert ring_latency(Group(512, 8), fab) == pytest.approx(
        (8.4 + 448 * 3.4 + 63 * 14.0) * 1e-6)


def test_a_cluster_file_states_the_latency_of_the_nccl_it_ran():
    # a 2021 run (NCCL 2.8-2.9) states 9.6; its 512-rank gathers are shorter by exactly the
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
