"""torchao's float8 rowwise recipe priced as it runs (branch rowwise), one test per mechanism,
each from the code or the published microbenchmark it comes from (no published row's figure):

* tensor parallelism gathers bf16 and casts after the gather (torchtitan parallelize_llama.py:
  Float8ColwiseParallel for tensorwise only; docs/float8.md "for float8 with rowwise scaling,
  all distributed communication is done in high precision");
* PyTorch's async TP fuses a collective only with the mm / _scaled_mm right beside it
  (micro_pipeline_tp.py `_find_consumer_matmuls`, `_find_producer_matmul`): rowwise's casts
  after the gathers and its rescale of the input gradient leave those collectives whole;
* what the compiled rowwise casts cost beyond torchao's roofline, from torchao's own rowwise
  table (bench/fp8_rowwise_vs_published.py)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.fp8_rowwise_vs_published import cells, layer_times
from meshtron.model.spec import PRESETS
from meshtron.planner import compute as C
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.fp8 import ROWWISE_COMPILED_EXCESS, async_tp_unfused, cast_bytes
from meshtron.planner.frameworks import preset

H100 = resolve_cluster("dgx-h100:1")
L70 = PRESETS["llama3-70b"]
TITAN = dataclasses.replace(preset("torchtitan@2025").kernel, stack="compiled")


def _layer(dtype: str, scaling: str = "torchao-rowwise", async_tp: bool = False) -> C.LayerCost:
    opts = dataclasses.replace(TITAN, fp8_scaling=scaling, async_tp=async_tp)
    return C.layer_cost(L70, H100, 8, 2, 8192, True, opts, 1, dtype)


def test_rowwise_tensor_parallel_gathers_bf16():
    # vanilla TP: the forward's two all-gathers move what bf16 moves under rowwise, 1 byte per
    # element under tensorwise (cast on the shard, then gathered)
    bf16 = _layer("bf16")
    assert _layer("fp8").tp_fwd == pytest.approx(bf16.tp_fwd, rel=1e-12)
    assert _layer("fp8", "torchao-tensorwise").tp_fwd < 0.9 * bf16.tp_fwd


def test_async_tp_fuses_only_what_sits_beside_a_gemm():
    rowwise = cast_bytes("torchao-rowwise", compiled=True)
    assert async_tp_unfused(rowwise) == {"ag_in", "ag", "red"}
    assert async_tp_unfused(cast_bytes("torchao-tensorwise", compiled=True)) == frozenset()
    assert async_tp_unfused(cast_bytes("te-current")) == frozenset()
    assert async_tp_unfused(None) == frozenset()  # bf16
    vanilla, fused = _layer("fp8"), _layer("fp8", async_tp=True)
    # backward: the gathered output gradient is cast before its GEMM, the input gradient
    # rescaled after its GEMM: nothing of the backward fuses
    assert fused.tp_bwd == pytest.approx(vanilla.tp_bwd, rel=1e-12)
    # forward: the reduce-scatters after the row-parallel GEMMs fuse, the gathers do not
    assert fused.tp_fwd < vanilla.tp_fwd
    tw_vanilla = _layer("fp8", "torchao-tensorwise")
    tw_fused = _layer("fp8", "torchao-tensorwise", async_tp=True)
    assert tw_fused.tp_bwd < tw_vanilla.tp_bwd
    bf16_gain = _layer("bf16").tp_fwd - _layer("bf16", async_tp=True).tp_fwd
    assert vanilla.tp_fwd - fused.tp_fwd < 0.75 * bf16_gain


def test_rowwise_casts_cost_what_torchaos_table_measures():
    # the constant is the median the published table implies (M >= 8192, rounded)
    implied = []
    for m, k, n, published in cells():
        bf16, fp8, bw = layer_times(m, k, n)
        if m >= 8192:
            implied.append((bf16 / published - fp8) * bw / (m * k))
    implied.sort()
    median = (implied[len(implied) // 2 - 1] + implied[len(implied) // 2]) / 2
    assert ROWWISE_COMPILED_EXCESS == pytest.approx(median, abs=0.5)

    # and what it changes: the table's narrow Linears (N = 1024) run slower than bf16, which
    # the roofline alone priced faster; wide ones stay faster
    def speedup(m: int, k: int, n: int, excess: float) -> float:
        bf16, fp8, bw = layer_times(m, k, n)
        return bf16 / (fp8 + excess * m * k / bw)

    assert speedup(16384, 8192, 1024, 0.0) > 1.0 > speedup(16384, 8192, 1024,
                                                            ROWWISE_COMPILED_EXCESS)
    assert speedup(16384, 8192, 16384, ROWWISE_COMPILED_EXCESS) > 1.2
    # charged to the input's backward cast, once per distinct input, compiled rowwise only
    assert cast_bytes("torchao", "rowwise", compiled=True).input_bwd == \
        5.0 + ROWWISE_COMPILED_EXCESS
    assert cast_bytes("torchao", "tensorwise", compiled=True).input_bwd == 0.0
    assert not cast_bytes("torchao", "rowwise", compiled=True).per_linear


def test_async_tp_fuses_a_group_without_fp8_linears():
    # torchao's own filter keeps every Linear of Llama-3-8B at tp 8 in bf16 under rowwise
    # (fp8._ROWWISE_SKIP): nothing sits between a collective and its mm, async TP fuses all
    opts = dataclasses.replace(TITAN, fp8_scaling="torchao-rowwise", async_tp=True,
                               fp8_filter="torchao")
    l8 = PRESETS["llama3-8b"]
    fp8 = C.layer_cost(l8, H100, 8, 2, 8192, True, opts, 1, "fp8")
    bf16 = C.layer_cost(l8, H100, 8, 2, 8192, True, opts, 1, "bf16")
    assert (fp8.tp_fwd, fp8.tp_bwd) == pytest.approx((bf16.tp_fwd, bf16.tp_bwd), rel=1e-12)
    every = C.layer_cost(l8, H100, 8, 2, 8192, True,
                         dataclasses.replace(opts, fp8_filter="all"), 1, "fp8")
    assert every.tp_bwd > bf16.tp_bwd
