"""An fp32 MoE router (KernelOptions.router_dtype, Megatron-Core's moe_router_dtype): its
gating GEMM's backward on TF32 and the casts between bf16 and fp32 (planner/moe_router.py).
Planner-only, no torch."""

from __future__ import annotations

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import preset
from meshtron.planner import compute, moe_cost, moe_router, placement
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions

TOKENS = 2048.0  # DeepSeek-V3 at tp 2 with sequence parallelism: the rank's half of 4096


def _layer(router_dtype: str, dtype: str = "fp8"):
    model, cl = preset("deepseek-v3"), resolve_cluster("dgx-h100:16")
    group = placement.ep_group(2, 64, cl.gpus_per_node)
    return moe_cost.moe_layer_cost(model, cl, 2 * TOKENS, 64, group, dtype, 1.0, False, 4,
                                   "fused", 2, 1, per_expert=True, fp8_scaling="te-current",
                                   ep_dispatch="deepep", folded=True,
                                   router_dtype=router_dtype), model, cl


def test_the_fp32_router_adds_its_backward_only():
    fp32, model, cl = _layer("fp32")
    bf16, _, _ = _layer("bf16")
    bw = compute.membound_bytes_per_s(cl.at_dtype("bf16"), "fused")
    extra = moe_router.fp32_router_extra(TOKENS, model.hidden, model.moe_experts, cl, bw)
    assert fp32.compute_fwd == bf16.compute_fwd
    assert fp32.compute_bwd - bf16.compute_bwd == pytest.approx(extra)
    assert fp32.a2a_fwd == bf16.a2a_fwd


def test_the_extra_is_two_casts_and_tf32_against_bf16_gemms():
    model, cl = preset("deepseek-v3"), resolve_cluster("dgx-h100:1")
    bw = compute.membound_bytes_per_s(cl.at_dtype("bf16"), "fused")
    h, e = model.hidden, model.moe_experts
    extra = moe_router.fp32_router_extra(TOKENS, h, e, cl, bw)
    casts = 2 * 6.0 * TOKENS * h / bw  # bf16 -> fp32 input, fp32 -> bf16 gradient
    # TF32 runs at half the bf16 peak on twice the operand bytes: the GEMMs cost more, at
    # most twice the bf16 ones
    gemms = extra - casts
    bf16 = (compute.cluster_gemm_time(TOKENS, h, e, cl.at_dtype("bf16"))
            + compute.cluster_gemm_time(e, h, TOKENS, cl.at_dtype("bf16")))
    assert 0.0 < gemms <= bf16 * (1 + 1e-9)
    # a few tenths of a millisecond per layer and micro-batch, not more (H100 SXM)
    assert 20e-6 < extra < 200e-6


def test_fp32_training_pays_nothing_more():
    assert _layer("fp32", "fp32")[0] == _layer("bf16", "fp32")[0]


def test_a_bad_router_dtype_is_refused_naming_the_field():
    with pytest.raises(UserError, match=r"router_dtype='fp64': allowed values are bf16, fp32"):
        KernelOptions(router_dtype="fp64")
