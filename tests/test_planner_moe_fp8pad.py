"""Megatron-Core's FP8 experts pad each expert's rows to 16 (Transformer Engine's Fp8Padding /
Fp8Unpadding in TEGroupedMLP): a copy of the routed rows before fc1 and after fc2, forward and
backward, unless every split is aligned already (planner/moe_fp8.py `fp8_pad_passes`).
Planner-only, no torch."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import preset
from meshtron.planner import compute, moe_cost, placement
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions
from testkit.plan_cli import options_refusal, plan_cli  # noqa: F401 (fixture)

TOKENS = 4096.0


def test_dropless_te_experts_copy_their_rows_twice_per_direction():
    # Qwen3-30B-A3B: 128 experts, top 8, at ep 16 the alltoall and DeepEP dispatchers
    for dispatch in ("bf16", "deepep"):
        assert moe_cost.fp8_pad_passes(True, dispatch, 0.0, TOKENS, 8, 128, 16, 1, True) == 2.0


def test_no_copy_where_the_splits_arrive_aligned_or_the_gemms_are_not_te():
    # HybridEP pads in its permute; an FP8 dispatch feeds another stack's grouped GEMMs;
    # meshtron / torchtitan issue one torch._grouped_mm (per_expert False)
    assert moe_cost.fp8_pad_passes(True, "hybridep", 0.0, TOKENS, 8, 128, 16, 1, True) == 0.0
    assert moe_cost.fp8_pad_passes(True, "fp8", 0.0, TOKENS, 8, 128, 16, 1, True) == 0.0
    assert moe_cost.fp8_pad_passes(False, "bf16", 0.0, TOKENS, 8, 128, 16, 1, True) == 0.0


def test_token_drop_copies_only_when_the_capacity_is_not_a_multiple_of_16():
    # capacity 1.0: ceil(4096 * 8 / 128) = 256 rows per expert from each of 16 ranks: aligned
    assert moe_cost.fp8_pad_passes(True, "bf16", 1.0, TOKENS, 8, 128, 16, 1, True) == 0.0
    # 1000 tokens, top 2, 64 experts, ep 1: ceil(31.25) = 32 -> aligned; ep 1 with 999 tokens
    # at capacity 1.1: ceil(34.33) = 35 rows -> a copy
    assert moe_cost.fp8_pad_passes(True, "bf16", 1.0, 1000.0, 2, 64, 1, 1, False) == 0.0
    assert moe_cost.fp8_pad_passes(True, "bf16", 1.1, 999.0, 2, 64, 1, 1, False) == 2.0


def _layer(capacity: float, dtype: str = "fp8"):
    model, cl = preset("qwen3-30b-a3b"), resolve_cluster("dgx-h100:2")
    group = placement.ep_group(1, 16, cl.gpus_per_node)
    return moe_cost.moe_layer_cost(model, cl, TOKENS, 16, group, dtype, 1.0, False, 0, "fused",
                                   1, 1, per_expert=True, fp8_scaling="te-current",
                                   folded=True, capacity=capacity), model, cl


def test_the_copy_costs_four_passes_over_the_routed_rows_in_a_step():
    dropless, model, cl = _layer(0.0)
    aligned, _, _ = _layer(1.0)
    rows_bytes = TOKENS * model.moe_top_k * model.hidden * compute.BF16
    bw = compute.membound_bytes_per_s(cl.at_dtype("bf16"), "fused")
    per_direction = 2 * 2 * rows_bytes / bw  # two copies, each a read and a write
    assert dropless.compute_fwd - aligned.compute_fwd == pytest.approx(per_direction)
    assert dropless.compute_bwd - aligned.compute_bwd == pytest.approx(per_direction)
    assert dropless.a2a_fwd == aligned.a2a_fwd


def test_bf16_experts_never_pad():
    assert _layer(0.0, "bf16")[0] == _layer(1.0, "bf16")[0]


def test_a_bad_capacity_is_refused_naming_the_field():
    with pytest.raises(UserError, match=r"expert_capacity=-1: must be a number from 0"):
        KernelOptions(expert_capacity=-1)
    with pytest.raises(UserError, match=r"expert_capacity=True"):
        dataclasses.replace(KernelOptions(), expert_capacity=True)


def test_a_bad_capacity_in_an_options_file_is_one_line_exit_2(plan_cli, tmp_path):
    err = options_refusal(plan_cli, tmp_path, "expert_capacity = -0.5", "--model",
                          "qwen3-30b-a3b", "--cluster", "dgx-h100:2", "--global-batch", "64",
                          "--seq-len", "4096", "--framework", "megatron@2024")
    assert "expert_capacity=-0.5: must be a number from 0 (dropless) to 64" in err
