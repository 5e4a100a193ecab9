"""`meshtron calibrate`: node detection, per-level groups, the least-squares fit, the cluster
fields it writes, and a real run that spans two (emulated) nodes."""

from __future__ import annotations

import pytest

from meshtron.calibrate.measure import fit_alpha_beta, fit_p2p, level_groups, node_of_ranks
from meshtron.errors import UserError
from meshtron.planner.cluster import GemmPoint, cluster_from_dict


def test_nodes_come_from_hostnames_and_local_world_size():
    assert node_of_ranks(["a"] * 4, 4) == [0, 0, 0, 0]
    assert node_of_ranks(["a"] * 4, 2) == [0, 0, 1, 1]        # one host, LOCAL_WORLD_SIZE=2
    assert node_of_ranks(["a", "a", "b", "b"], 4) == [0, 0, 1, 1]
    intra, inter = level_groups([0, 0, 1, 1])
    assert intra == [[0, 1], [2, 3]] and inter == [[0, 2], [1, 3]]  # rail-aligned
    assert level_groups([0, 0, 0, 1])[1] == []  # unequal nodes: no inter groups


def test_fit_recovers_the_ring_model_parameters():
    alpha, bw, n = 20e-6, 5e9, 4
    samples = {}
    for name, (steps, factor) in {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
                                  "all_gather": (n - 1, (n - 1) / n),
                                  "reduce_scatter": (n - 1, (n - 1) / n)}.items():
        samples[name] = [(b, steps * alpha + factor * b / bw) for b in (4096, 65536, 2**20, 2**24)]
    a, b = fit_alpha_beta(samples, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    a, b = fit_p2p([(s, 7e-6 + s / 2e9) for s in (4096, 2**20, 2**24)])
    assert a == pytest.approx(7e-6, rel=1e-6) and b == pytest.approx(2e9, rel=1e-6)


BASE = {"peak_tflops": 100.0, "memory_gib": 16, "gpus_per_node": 2, "nodes": 1,
        "intra_node_gb_per_s": 10.0, "inter_node_gb_per_s": 1.0}


def test_cluster_accepts_and_validates_the_calibrated_fields():
    cl = cluster_from_dict({**BASE, "elementwise_gb_per_s": 900.0, "eager_kernel_overhead_us": 5,
                            "gemm_efficiency": [{"m": 8, "n": 16, "k": 32, "efficiency": 0.5}]})
    assert cl.gemm_efficiency == (GemmPoint(8, 16, 32, 0.5),)
    assert cl.to_dict()["gemm_efficiency"] == [{"m": 8, "n": 16, "k": 32, "efficiency": 0.5}]
    assert cluster_from_dict(cl.to_dict()) == cl
    bad = [("elementwise_gb_per_s", 0), ("eager_kernel_overhead_us", -1),
           ("gemm_efficiency", []), ("gemm_efficiency", [{"m": 8, "n": 16, "k": 32}]),
           ("gemm_efficiency", [{"m": 8, "n": 16, "k": 0, "efficiency": 0.5}]),
           ("gemm_efficiency", [{"m": 8, "n": 16, "k": 32, "efficiency": 1.5}])]
    for key, value in bad:
        with pytest.raises(UserError, match=f"cluster.{key}"):
            cluster_from_dict({**BASE, key: value})


def calibrate_two_nodes_rank_fn() -> dict:
    """4 ranks, LOCAL_WORLD_SIZE=2: two emulated nodes of 2, so both levels are measured."""
    import os

    import torch

    from meshtron.calibrate.measure import calibrate

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    cal = calibrate(torch.device("cpu"), sizes=[4096, 65536, 2**20])
    return cal.cluster_dict(name="two-nodes") | {"inter_size": cal.inter.group_size,
                                                  "intra_size": cal.intra.group_size}


def test_calibration_spanning_two_nodes_fits_both_levels():
    from meshtron.planner.cluster import cluster_from_dict as build
    from meshtron.testing.multiproc import run_on_ranks

    results = run_on_ranks(calibrate_two_nodes_rank_fn, 4, timeout=300)
    assert all(r == results[0] for r in results)  # the same cluster on every rank
    r = dict(results[0])
    assert (r.pop("intra_size"), r.pop("inter_size")) == (2, 2)
    cl = build(r)
    assert (cl.nodes, cl.gpus_per_node) == (2, 2)
    assert cl.intra_node_gb_per_s > 0 and cl.inter_node_gb_per_s > 0
    assert cl.elementwise_gb_per_s > 0 and cl.eager_kernel_overhead_us > 0
    assert len(cl.gemm_efficiency) == 5
