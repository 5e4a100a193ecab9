"""Fine-grained recomputation costs time, not only memory (MemoryOptions recompute_norms,
recompute_up_proj, swiglu_recompute: DeepSeek-V3 report 3.2.3 / 3.3.3, Megatron-Core's
recompute_modules "layernorm", "mla_up_proj", "moe_act"): the backward runs the dropped forward
pieces again, so each option lengthens the step by exactly that piece's forward time, the step's
kinds (step_categories) still add up, and recomputed up-projection GEMMs count as hardware FLOPs.
Planner only, no torch; every expected figure is rebuilt here from the bytes or GEMM shapes."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.mla_shapes import mla_projections
from meshtron.model.spec import PRESETS
from meshtron.planner import compute as C
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.memory_options import MemoryOptions
from meshtron.planner.plan import Plan
from meshtron.planner.step_categories import step_categories

# a dense model with multi-head latent attention at DeepSeek-V3's attention widths (2 blocks)
MLA = PRESETS["deepseek-v3"].replace(
    layers=2, moe_experts=0, moe_top_k=0, moe_ffn_hidden=0, moe_shared_experts=0,
    moe_dense_layers=0, moe_groups=1, moe_topk_groups=1, moe_route_scale=1.0,
    moe_bias_update=0.0, ffn_hidden=4096, vocab=1024, mtp_depth=0)
H100 = dataclasses.replace(resolve_cluster("dgx-h100:1"), gpus_per_node=1)
KERNEL = preset("megatron@2024").kernel
SEQ, MB, BATCH = 4096, 2, 4


def _run(mem: MemoryOptions, recompute: str = "none"):
    ev = Evaluator(MLA, H100, BATCH, SEQ, KERNEL, mem=mem)
    est = ev.evaluate(Plan(tp=1, pp=1, dp=1, zero=1, micro_batch=MB, recompute=recompute,
                           dtype="bf16"))
    return ev, est


def _grown(option: str, recompute: str = "none") -> tuple[float, dict, dict]:
    """(step growth s, categories without, categories with) of one option."""
    base = MemoryOptions(framework="megatron")
    ev0, est0 = _run(base, recompute)
    ev1, est1 = _run(dataclasses.replace(base, **{option: True}), recompute)
    return (est1.time.total - est0.time.total, step_categories(ev0, est0),
            step_categories(ev1, est1))


def _membound_s(bytes_per_token: float) -> float:
    return MB * SEQ * bytes_per_token / C.membound_bytes_per_s(H100.at_dtype("bf16"), "fused")


def _steps() -> float:
    """Micro-batches x layers of the single-stage step."""
    return BATCH // MB * MLA.layers


def test_recomputed_norms_cost_the_block_and_latent_norms_again():
    grown, before, after = _grown("recompute_norms")
    # fused RMSNorm: 4 bytes per element (elementwise.NORM_BYTES); the input and pre-MLP
    # norms over hidden, MLA's two latent norms over q_lora_rank + kv_lora_rank
    norm = C.NORM_BYTES[("fused", "rmsnorm")]
    per_layer = _membound_s(norm * (2 * MLA.hidden + MLA.q_lora_rank + MLA.kv_lora_rank))
    assert per_layer > 0
    assert grown == pytest.approx(_steps() * per_layer, rel=1e-6)
    assert after["elementwise"] - before["elementwise"] == pytest.approx(grown, rel=1e-6)


def test_recomputed_up_projections_cost_their_gemms_and_rope_again():
    grown, before, after = _grown("recompute_up_proj")
    cl = H100.at_dtype("bf16")
    tokens = MB * SEQ
    gemms = sum(C.cluster_gemm_time(tokens, n, k, cl)
                for name, n, k, _ in mla_projections(MLA, 1) if name in ("wq_b", "wkv_b"))
    assert after["gemm"] - before["gemm"] == pytest.approx(_steps() * gemms, rel=1e-6)
    # beside the GEMMs: the latent norms, the rotary parts (fused: 4 bytes per element) and
    # the queries' and keys' concatenations (8 bytes per element of heads x qk head size)
    heads, rope = MLA.heads, MLA.qk_rope_head_dim
    qk = MLA.qk_nope_head_dim + rope
    elem = (C.NORM_BYTES[("fused", "rmsnorm")] * (MLA.q_lora_rank + MLA.kv_lora_rank)
            + 4.0 * rope + 4.0 * heads * rope + 8.0 * heads * qk)
    assert after["elementwise"] - before["elementwise"] == pytest.approx(
        _steps() * _membound_s(elem), rel=1e-6)
    assert grown == pytest.approx(_steps() * (gemms + _membound_s(elem)), rel=1e-6)
    # hardware FLOPs: the two up-projections' forward GEMMs again, model FLOPs unchanged
    _, e0 = _run(MemoryOptions(framework="megatron"))
    _, e1 = _run(MemoryOptions(framework="megatron", recompute_up_proj=True))
    per_token = 2.0 * MLA.layers * sum(n * k for name, n, k, _ in mla_projections(MLA, 1)
                                       if name in ("wq_b", "wkv_b"))
    def per_token_flops(tflops_per_gpu: float, est) -> float:  # one GPU: the step's tokens
        return tflops_per_gpu * 1e12 / est.tokens_per_s

    assert per_token_flops(e1.model_tflops_per_gpu, e1) == pytest.approx(
        per_token_flops(e0.model_tflops_per_gpu, e0), rel=1e-9)
    assert per_token_flops(e1.hardware_tflops_per_gpu, e1) - per_token_flops(
        e0.hardware_tflops_per_gpu, e0) == pytest.approx(per_token, rel=1e-6)


def test_recomputed_swiglu_costs_its_activation_again():
    grown, before, after = _grown("swiglu_recompute")
    # fused SwiGLU: reads the [2f] input and writes [f] (6 bytes per ffn element)
    per_layer = _membound_s(6.0 * MLA.ffn_hidden)
    assert grown == pytest.approx(_steps() * per_layer, rel=1e-6)
    assert after["elementwise"] - before["elementwise"] == pytest.approx(grown, rel=1e-6)


@pytest.mark.parametrize("option", ["recompute_norms", "recompute_up_proj", "swiglu_recompute"])
def test_whole_block_replays_run_them_already(option):
    # full: every block's forward runs again anyway; half: every second block's
    assert _grown(option, "full")[0] == pytest.approx(0.0, abs=1e-12)
    assert _grown(option, "half")[0] == pytest.approx(0.5 * _grown(option)[0], rel=1e-6)
