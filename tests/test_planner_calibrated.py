"""The planner reads what `meshtron calibrate` measures: GEMM efficiency by shape, eager
element-wise bandwidth, eager per-kernel overhead and the collective base latency; without
those fields it computes exactly what it did before."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import comm, host
from meshtron.planner.cluster import GemmPoint, resolve_cluster
from meshtron.planner.compute import KernelOptions, head_cost, kernels_per_layer, layer_cost
from meshtron.planner.elementwise import elementwise_bytes
from meshtron.planner.gemm import (BF16, DISPATCH_S, HBM_EFFICIENCY, cluster_gemm_time,
                                   gemm_efficiency, gemm_time, measured_gemm_efficiency)

H100 = resolve_cluster("dgx-h100:1")
MODEL = PRESETS["llama3-8b"]
EAGER = KernelOptions(stack="eager")
FUSED = KernelOptions(stack="fused")


def _flop_time(m: float, n: float, k: float, eff: float) -> float:
    return 2.0 * m * n * k / (H100.peak_flops * eff)


def test_measured_gemm_table_sets_the_time_of_a_measured_shape_exactly():
    table = (GemmPoint(8192, 4096, 4096, 0.55), GemmPoint(8192, 512, 4096, 0.31),
             GemmPoint(8192, 14336, 4096, 0.62))
    cl = dataclasses.replace(H100, gemm_efficiency=table)
    for g in table:
        assert cluster_gemm_time(g.m, g.n, g.k, cl) == _flop_time(g.m, g.n, g.k, g.efficiency)
        assert gemm_efficiency(g.m, g.n, g.k, cl) == pytest.approx(g.efficiency, rel=1e-12)
    # a 1024-wide shard is nearer (in ratio) to the 512-wide measurement than to the 4096 one
    assert measured_gemm_efficiency(8192, 1024, 4096, cl) == 0.31
    assert measured_gemm_efficiency(8192, 3000, 4096, cl) == 0.55
    # the bandwidth bound still holds for a shape far less intense than any measured one
    m, n, k = 8192, 1, 4096
    assert cluster_gemm_time(m, n, k, cl) == BF16 * (m * k + k * n + m * n) / H100.hbm_bytes_per_s
    # without a table: the analytical roofline, unchanged
    peak = H100.peak_flops * H100.matmul_ceiling
    assert cluster_gemm_time(8192, 512, 4096, H100) == gemm_time(8192, 512, 4096, peak,
                                                                 H100.hbm_bytes_per_s)


def test_measured_gemm_table_drives_the_layer_and_head_gemms():
    """One measured point: every GEMM of the layer gets its efficiency, so the weight-gradient
    part (= the forward's four linears) is their FLOPs at that efficiency."""
    cl = dataclasses.replace(H100, gemm_efficiency=(GemmPoint(4096, 4096, 4096, 0.4),))
    tokens, h, kv, f = 4096, MODEL.hidden, MODEL.kv_dim, MODEL.ffn_hidden
    lc = layer_cost(MODEL, cl, 1, 1, tokens, False, EAGER)
    shapes = [(tokens, h + 2 * kv, h), (tokens, h, h), (tokens, 2 * f, h), (tokens, h, f)]
    assert lc.wgrad == pytest.approx(sum(_flop_time(*s, 0.4) for s in shapes), rel=1e-12)
    assert lc.wgrad > layer_cost(MODEL, H100, 1, 1, tokens, False, EAGER).wgrad
    head = head_cost(MODEL, cl, 1, 1, tokens, False, "eager")
    assert head.wgrad == pytest.approx(_flop_time(tokens, MODEL.vocab, h, 0.4), rel=1e-12)


def test_elementwise_bandwidth_prices_the_eager_stacks_memory_bound_work():
    tokens = 4096
    bw_gb = 1000.0
    cl = dataclasses.replace(H100, elementwise_gb_per_s=bw_gb)
    base, cal = (layer_cost(MODEL, c, 2, 1, tokens, True, EAGER) for c in (H100, cl))
    ew_bytes = tokens * elementwise_bytes(MODEL, 2, True, EAGER)
    # same GEMMs and attention; only the element-wise term changes, from HBM x 0.8 to measured
    assert (cal.wgrad, cal.core_fwd) == (base.wgrad, base.core_fwd)
    assert cal.fwd - base.fwd == pytest.approx(
        ew_bytes / (bw_gb * 1e9) - ew_bytes / (H100.hbm_bytes_per_s * HBM_EFFICIENCY), rel=1e-9)
    # the fused stack's kernels are not what calibrate timed: unchanged
    assert layer_cost(MODEL, cl, 2, 1, tokens, True, FUSED) == \
        layer_cost(MODEL, H100, 2, 1, tokens, True, FUSED)
    assert head_cost(MODEL, cl, 2, 1, tokens, True, "eager").compute > \
        head_cost(MODEL, H100, 2, 1, tokens, True, "eager").compute


def test_eager_kernel_overhead_replaces_the_dispatch_constant():
    """A tiny layer is dispatch-bound: its forward is kernels x per-kernel overhead."""
    tiny = PRESETS["tiny"]
    n_kernels = kernels_per_layer(tiny, EAGER)
    base = layer_cost(tiny, H100, 1, 1, 16, False, EAGER)
    assert base.fwd == pytest.approx(n_kernels * DISPATCH_S, rel=1e-12)
    cl = dataclasses.replace(H100, eager_kernel_overhead_us=37.0)
    lc = layer_cost(tiny, cl, 1, 1, 16, False, EAGER)
    # calibrate times a no-grad op; a training forward also records autograd's graph
    per = 37e-6 * host.AUTOGRAD_RECORD
    assert lc.fwd == pytest.approx(n_kernels * per, rel=1e-12)
    assert lc.bwd == pytest.approx(host.BACKWARD_LAUNCHES * host.BACKWARD_HOST_FRACTION
                                   * n_kernels * per, rel=1e-12)


def test_collective_base_latency_is_read_from_the_cluster():
    assert comm.Fabric.of(H100).base_latency == comm.BASE_LATENCY_S
    cl = dataclasses.replace(H100, collective_base_latency_us=25.0)
    fab, ref = comm.Fabric.of(cl), comm.Fabric.of(H100)
    assert fab.base_latency == pytest.approx(25e-6)
    g = comm.Group(8, 8)
    assert comm.all_reduce(4096, g, fab) - comm.all_reduce(4096, g, ref) == \
        pytest.approx(25e-6 - comm.BASE_LATENCY_S, rel=1e-9)


def test_level_terms_are_the_planners_formulas():
    """comm.level_terms (what calibrate fits) reproduces the collective functions on groups of
    one fabric level, ring and tree alike."""
    cl = resolve_cluster("dgx-h100:16")
    fab = comm.Fabric.of(cl)
    for group, alpha, bw in ((comm.Group(8, 8), fab.intra_alpha, fab.intra_bw),
                             (comm.Group(16, 1), fab.inter_alpha, fab.inter_bw)):
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for nbytes in (4096, 2**20, 2**28):
                terms = comm.level_terms(op, nbytes, group)
                best = min(c0 * fab.base_latency + c1 * alpha + c2 / bw for c0, c1, c2 in terms)
                assert best == pytest.approx(getattr(comm, op)(nbytes, group, fab), rel=1e-12)
