"""What MLA left open in the planner (docs/measurements.md #mla, 2026-12-05 addition): the
attention core's V width as a fact of the stack (KernelOptions.v_width), and MLA's replicated
down-projections in the mixture-of-experts parameter count under tensor parallelism."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.mla_shapes import mla_replicated_params
from meshtron.model.spec import preset
from meshtron.planner import moe_memory
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import layer_cost, recompute_flops_per_token
from meshtron.planner.elementwise import kernels_per_layer
from meshtron.planner.frameworks import PRESETS
from meshtron.planner.gemm import cluster_gemm_time
from meshtron.planner.kernel_options import KernelOptions
from meshtron.errors import UserError

DSV3 = preset("deepseek-v3")
H100 = preset_cluster("dgx-h100", 1)


def _opts(**kw) -> KernelOptions:
    return dataclasses.replace(PRESETS["meshtron@2026"].kernel, **kw)


def test_each_preset_says_how_its_kernel_runs_mla_v():
    # meshtron's model pads V for SDPA's flash kernels, Hugging Face's pads for flash-attn 2;
    # TE's fused attention (Megatron-Core), torchtitan's unpadded SDPA / flex and the unfused
    # cores take V at its own width
    got = {name: fw.kernel.v_width for name, fw in PRESETS.items()}
    assert got == {"meshtron@2026": "padded", "torchtitan@2025": "native",
                   "megatron@2021": "native", "megatron@2024": "native",
                   "deepspeed@2021": "native", "deepspeed@2024": "padded",
                   "torchtitan@2024": "native", "megatron-bridge@2025": "native",
                   "gpt-neox@2022": "native",  # deepspeed@2021's unfused core
                   # Hugging Face models under flash-attn 2 (nemo-automodel), MPT's flash-attn
                   "nemo-automodel@2025": "padded", "llm-foundry@2023": "padded",
                   "llm-foundry@2024": "padded",
                   # OLMo-core v1.5 has no MLA model; its SDPA would take one head size
                   "olmo-core@2024": "padded"}
    with pytest.raises(UserError, match="v_width='wide'"):
        KernelOptions(v_width="wide")


@pytest.mark.parametrize("cp", [1, 2])
def test_native_v_prices_pv_at_128_and_the_backward_at_its_flops(cp):
    seq, mb = 4096, 1
    padded = layer_cost(DSV3, H100, 1, mb, seq, False, _opts(), cp=cp)
    native = layer_cost(DSV3, H100, 1, mb, seq, False, _opts(v_width="native"), cp=cp)
    # backward over forward: QK^T again, dQ, dK at 192; dP, dV at 128 (against 2.5 padded)
    assert padded.parts[1][2] / padded.parts[1][1] == pytest.approx(2.5)
    assert native.parts[1][2] / native.parts[1][1] == pytest.approx((3 * 192 + 2 * 128) / 320)
    assert native.core_fwd < padded.core_fwd
    if cp == 1:  # forward: exactly PV's GEMM at 128 instead of 192, over half the square
        bh, q = mb * DSV3.heads, seq
        pv = cluster_gemm_time(q, 192, seq, H100) - cluster_gemm_time(q, 128, seq, H100)
        assert padded.core_fwd - native.core_fwd == pytest.approx(0.5 * bh * pv, rel=1e-9)
    # no padding copies either (the runtime's pad and cut), and two kernels fewer in eager
    assert native.parts[2][1] < padded.parts[2][1]
    assert kernels_per_layer(DSV3, _opts()) - kernels_per_layer(DSV3, _opts(v_width="native")) \
        == 2


def test_v_width_changes_nothing_where_v_is_as_wide_as_q():
    llama = preset("llama3-8b")
    a = layer_cost(llama, H100, 2, 1, 8192, True, _opts())
    b = layer_cost(llama, H100, 2, 1, 8192, True, _opts(v_width="native"))
    assert a == b


def test_recompute_flops_count_pv_at_the_stacks_v_width():
    seq = 4096
    qk, v, heads, layers = 192, 128, DSV3.heads, DSV3.layers
    assert recompute_flops_per_token(DSV3, seq, "selective", "unfused") == \
        2.0 * layers * heads * (qk + qk) * seq
    assert recompute_flops_per_token(DSV3, seq, "selective", "unfused", v_native=True) == \
        2.0 * layers * heads * (qk + v) * seq
    full_p = recompute_flops_per_token(DSV3, seq, "full", "flash")
    full_n = recompute_flops_per_token(DSV3, seq, "full", "flash", v_native=True)
    # flash recomputes only the causal half of the square (compute_flops.executed_square_share)
    assert full_p - full_n == pytest.approx(0.5 * 2.0 * layers * heads * (qk - v) * seq)


def test_moe_block_under_tp_keeps_mla_down_projections_whole():
    # Megatron-Core shards MLA's up-projections and wo by heads, duplicates the
    # down-projections and latent norms: tp divides only the rest
    rep = mla_replicated_params(DSV3)
    assert rep == 7168 * 1536 + 1536 + 7168 * 576 + 512
    moe_i = DSV3.layers - 1
    shared = DSV3.mlp_params(DSV3.moe_shared_experts * DSV3.moe_ffn_hidden)
    for fw in ("megatron", "fsdp2"):
        one = moe_memory._block(DSV3, moe_i, 1, 8, fw)[0]
        two = moe_memory._block(DSV3, moe_i, 2, 8, fw)[0]
        shared_cut = shared / 2 if fw == "megatron" else 0.0
        assert one - two == pytest.approx((DSV3.attention_params() - rep) / 2 + shared_cut)
    dense_one = moe_memory._block(DSV3, 0, 1, 8, "megatron")[0]
    dense_two = moe_memory._block(DSV3, 0, 2, 8, "megatron")[0]
    assert dense_one - dense_two == pytest.approx(
        (DSV3.attention_params() - rep + DSV3.mlp_params()) / 2)


# ---- zero bubble's B..W window on MLA against `meshtron rehearse` (fake tensors, CPU) --------
ZB_KINDS = {
    "pp zb": dict(schedule="zb"),
    "pp zbv": dict(schedule="zbv"),
    "pp zb, full recompute": dict(schedule="zb", recompute="full"),
    "pp zbv, full recompute": dict(schedule="zbv", recompute="full"),
}


# test_rehearse.py's 'mid' sizes (hidden 2048, 16 heads, ffn 5632, vocab 32000, 2048 tokens)
# with DeepSeek's head sizes and latents at its ratios, 6 blocks on pp 2
MID_MLA6 = dict(name="mid-mla6", layers=6, hidden=2048, heads=16, kv_heads=16, ffn_hidden=5632,
                vocab=32000, max_seq=4096, q_lora_rank=768, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@pytest.mark.slow
def test_zero_bubble_memory_of_mla_agrees_with_rehearsal():
    """Within 5% per kind (testkit.rehearsal.check_totals). Measured 2026-12-05: zb -2.4%,
    zbv +1.0%, zb full -0.2%, zbv full +2.3%; before MLA's W groups (GQA-shaped: 9 groups
    against MLA's 12, so W's peak counted 9 recomputed copies of 12): -2.9%, +0.5%, -22.9%,
    -19.4%."""
    from testkit.rehearsal import check_totals, run_kinds
    from tests.test_mla import RUN_KINDS

    base = dict(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute="none", sp=False,
                dtype="bf16", global_batch=32, seq_len=2048)
    results = run_kinds(RUN_KINDS, [MID_MLA6, base, ZB_KINDS])
    check_totals(results, "MLA zero-bubble rehearsal", digits=4)


@pytest.mark.parametrize("q_lora_rank", [48, 0])
def test_mla_w_groups_capture_what_torchs_split_backward_captures(q_lora_rank):
    """Two MLA blocks as a middle stage through torch's stage_backward_input (fp32): the
    gradients it captures for W are exactly zb_recompute.mla_groups' (the latents' whole
    width, the up-projections' heads, wo's hidden), one group per parameterized op."""
    from meshtron.model.spec import ModelSpec, PRESETS as MODELS
    from meshtron.planner import memory_zb
    from meshtron.planner.zb_recompute import block_groups, weight_groups
    import tests.test_memory_zb as zb

    spec = ModelSpec(name="zb-mla", layers=2, hidden=128, heads=4, kv_heads=4, ffn_hidden=344,
                     vocab=512, max_seq=256, q_lora_rank=q_lora_rank, kv_lora_rank=32,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)
    assert len(block_groups(spec, 1, False, 4.0, False)) == weight_groups(spec)
    MODELS["zb-mla"] = spec
    try:
        _, total, after_b, captured, seq = zb._saved_run("zb-mla")
    finally:
        del MODELS["zb-mla"]
    assert after_b == total
    assert captured == 2 * memory_zb.captured_grad_bytes(spec, 1, False, seq, 4.0)
