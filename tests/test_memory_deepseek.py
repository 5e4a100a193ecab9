"""DeepSeek-V3's memory savings as facts of its stack (MemoryOptions, report sections 3.2.3 and
3.3.3) and its multi-token prediction module (ModelSpec.mtp_depth, section 2.2; planner/mtp.py):
each saving removes exactly the tensors the report says are recomputed or stored smaller, the
MTP module costs one block, one head and a projection per micro-batch beside the head, and
meshtron's runtime refuses what it does not build."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner import compute, memory, memory_states, moe_memory, mtp, pipeline
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.memory_options import E5M6_TILE_BYTES, FP8_TILE_BYTES, MemoryOptions
from meshtron.planner.plan import Plan, plan_problems
from meshtron.planner.step_categories import step_categories

MCORE = preset("megatron@2024")
SEQ = 4096


def _act(model, mem: MemoryOptions, dtype: str = "bf16") -> float:
    """Bytes per block and micro-batch (one sequence), Megatron-Core's list, tp = 1."""
    mem = dataclasses.replace(mem, dtype=dtype)
    return memory.activation_bytes(model, 1, False, 1, SEQ, "selective", MCORE.kernel, mem)


def test_each_recomputation_drops_exactly_what_it_rebuilds():
    model = PRESETS["llama3-8b"]
    base = MemoryOptions(framework="megatron")
    h, f, q, kv = model.hidden, model.ffn_hidden, model.heads * model.head_dim, model.kv_dim
    # 3.2.3: the RMSNorm outputs (the QKV and fc1 inputs, bf16 here) are not kept
    norms = _act(model, base) - _act(model, dataclasses.replace(base, recompute_norms=True))
    assert norms == pytest.approx(SEQ * 2 * 2.0 * h)
    # 3.2.3 (MLA up-projections, on the GQA stand-in): Q, K and V are not kept
    up = _act(model, base) - _act(model, dataclasses.replace(base, recompute_up_proj=True))
    assert up == pytest.approx(SEQ * 2.0 * (q + 2 * kv))
    # 3.3.3: SwiGLU's [2f] input in FP8 with 1x128 scales, fc2's [f] input recomputed:
    # 2f x 2 + f x 2 bytes -> 2f x (1 + 4/128)
    swiglu = _act(model, base) - _act(model, dataclasses.replace(base, swiglu_recompute=True))
    assert swiglu == pytest.approx(SEQ * (6.0 * f - 2.0 * FP8_TILE_BYTES * f))
    assert FP8_TILE_BYTES == 1.0 + 4.0 / 128


def test_routed_experts_keep_an_fp8_swiglu_input_and_no_fc2_input():
    model = PRESETS["deepseek-v3"]
    tokens, ep, imb, cb = 4096.0, 64, 1.25, 2.0
    args = (model, tokens, 1, ep, imb, cb, "korthikanti", 1.0, "selective")
    kept = moe_memory.routed_saved_bytes(*args)
    saved = moe_memory.routed_saved_bytes(
        *args, mem=MemoryOptions(framework="megatron", swiglu_recompute=True))
    rows = tokens * model.moe_top_k * imb
    fe = model.moe_ffn_hidden
    # fc1's bf16 output [2 fe] and fc2's FP8 input [fe] -> the FP8 SwiGLU input [2 fe]
    assert kept - saved == pytest.approx(rows * fe * (2 * cb + 1.0 - 2 * FP8_TILE_BYTES))


def test_the_attention_output_is_cached_once_in_e5m6_under_fp8():
    model = PRESETS["deepseek-v3"]
    q = model.out_width  # MLA: heads x v_head_dim (128 x 128), not heads x (nope + rope)
    base = MemoryOptions(framework="megatron")
    e5m6 = dataclasses.replace(base, attn_out_e5m6=True)
    # 3.3.3 (1): one E5M6 copy with 1x128 scales serves the out-projection's and the
    # attention core's backward, in place of TE's FP8 copy beside FlashAttention's bf16 output
    saved = _act(model, base, "fp8") - _act(model, e5m6, "fp8")
    assert saved == pytest.approx(SEQ * q * (1.0 + 2.0 - E5M6_TILE_BYTES))
    assert E5M6_TILE_BYTES == 1.5 + 4.0 / 128
    # a bf16 run already keeps one bf16 copy for both: nothing moves
    assert _act(model, e5m6) == _act(model, base)
    with pytest.raises(UserError, match=r"^memory.attn_out_e5m6=true: priced on the "
                                        r"'korthikanti' saved-tensor list"):
        MemoryOptions(framework="fsdp2", attn_out_e5m6=True)


def test_the_dsv3_row_keeps_no_expert_outputs_for_the_deepep_combine():
    """DeepEP's combine sums the expert ranks' rows unweighted and its backward is a dispatch
    by the handle (deepseek-ai/DeepEP README combine_forward / combine_backward;
    tests/legacy/test_intranode.py: combined_x / ranks reached == x): the routing weights
    travel with the dispatch and are applied on the expert side, as Megatron-Core's DeepEP
    path does (token_dispatcher.py _DeepepManager: unpermute without probs, permuted probs to
    the experts' weighted SwiGLU). So the row's combine keeps the permuted probabilities
    only, not the [T k, h] expert outputs Megatron-Core <= 0.12's unpermute saved."""
    from bench.published.runs import published_runs

    run = next(r for r in published_runs() if r.name == "DSV3 671B 2048xH800")
    model, mem = run.model, run.memory
    tokens, imb, cb = 4096.0, run.opts.expert_imbalance, 2.0
    args = (model, tokens, 1, run.ep, imb, cb, "korthikanti", 1.0, "selective")
    row = moe_memory.routed_saved_bytes(*args, weighted_act=mem.moe_weighted_act, mem=mem)
    unpermute = moe_memory.routed_saved_bytes(*args, weighted_act=False, mem=mem)
    slots = tokens * model.moe_top_k
    assert unpermute - row == pytest.approx(slots * (model.hidden * cb + 4.0)
                                            - slots * imb * 4.0)


def test_bf16_moments_keep_eight_optimizer_bytes_per_parameter():
    fp32 = MemoryOptions(framework="megatron", dtype="bf16")
    bf16 = dataclasses.replace(fp32, bf16_moments=True)
    assert memory_states.state_bytes(1, 128, 4.0, fp32) == (2.0, 4.0, 12.0 / 128)
    assert memory_states.state_bytes(1, 128, 4.0, bf16) == (2.0, 4.0, 8.0 / 128)


def test_a_saving_that_is_not_a_boolean_or_not_priced_is_one_line():
    with pytest.raises(UserError, match=r"^memory.swiglu_recompute='yes': allowed values are "
                                        r"true, false$"):
        MemoryOptions(swiglu_recompute="yes")
    # meshtron's eager list and FSDP2's fp32 states would ignore them: refused, not silent
    with pytest.raises(UserError, match=r"^memory.recompute_norms=true: priced on the "
                                        r"'korthikanti' saved-tensor list"):
        MemoryOptions(framework="fsdp2", recompute_norms=True)
    with pytest.raises(UserError, match=r"^memory.bf16_moments=true: priced for the "
                                        r"mixed-precision ZeRO frameworks"):
        MemoryOptions(framework="fsdp2", bf16_moments=True)


def _mtp_pair(depth: int):
    model = PRESETS["llama3-8b"].replace(layers=4, mtp_depth=depth)
    ev = Evaluator(model, resolve_cluster("dgx-h100:1"), 16, 2048, MCORE.kernel,
                   mem=MCORE.memory)
    plan = Plan(tp=1, pp=1, dp=8, zero=1, micro_batch=1, recompute="none", dtype="bf16")
    return ev, ev.evaluate(plan)


def test_an_mtp_module_costs_a_block_a_head_and_a_projection_per_micro_batch():
    ev0, none = _mtp_pair(0)
    ev1, one = _mtp_pair(1)
    c_l, tpc_l, f_l, w_l, _, head, *_ = ev0._micro(1, 1, False, "none", 1, "bf16", 1,
                                                   "rowwise")
    cl = ev0.cluster.at_dtype("bf16")
    proj = compute.cluster_gemm_time(2048, 4096, 8192, cl)
    m = none.num_microbatches
    assert proj > 0 and m == 2
    assert one.time.compute - none.time.compute == pytest.approx(
        m * (c_l + tpc_l + head.compute + 3 * proj), rel=1e-9)
    # the step's categories still add up to the step (the module's parts carry kinds)
    cats = step_categories(ev1, one)
    assert sum(cats.values()) == pytest.approx(one.time.total)
    assert cats["moe"] - step_categories(ev0, none)["moe"] == pytest.approx(
        m * (c_l + tpc_l))


def test_with_mtp_zero_depth_is_the_head_itself():
    head = compute.EdgeCost(compute=1.0, tp=0.0, fwd=0.4, wgrad=0.3, parts=(("gemm", 1.0),))
    assert mtp.with_mtp(head, 0, (5.0, 0.0, 2.0, 1.0), 0.1) is head
    two = mtp.with_mtp(head, 2, (5.0, 0.5, 2.0, 1.0), 0.1)
    assert two.compute == pytest.approx(1.0 + 2 * (5.5 + 1.0 + 0.3))
    assert sum(t for _, t in two.parts) == pytest.approx(two.compute)


def test_the_runtime_refuses_mtp_modules_and_a_negative_depth():
    model = PRESETS["llama3-8b"].replace(mtp_depth=1)
    k = {"tp": 1, "pp": 1, "dp": 8}
    problems = plan_problems(k, 8, model)
    assert problems and problems[0].startswith("model.mtp_depth=1: meshtron's runtime builds no")
    assert plan_problems(k, 8, model, runtime=False) == []
    with pytest.raises(UserError, match=r"^model.mtp_depth=-1: must be a non-negative integer$"):
        PRESETS["llama3-8b"].replace(mtp_depth=-1)


def test_an_mtp_module_holds_a_block_and_a_projection_and_one_micro_batch_beside_the_head():
    """Megatron-Core's states at ZeRO-1 over dp = 8 (bf16 weights 2, fp32 gradients 4, 12/8
    optimizer bytes per parameter): the module adds one block and the 2h x h projection to
    the head's rank, and one micro-batch of the block's activations."""
    ev0, none = _mtp_pair(0)
    ev1, one = _mtp_pair(1)
    model = ev0.model
    h = model.hidden
    block = memory_states.layer_params_local(model, 1)
    added = block + 2 * h * h
    gib = 2.0 ** 30
    assert one.memory.params - none.memory.params == pytest.approx(2.0 * added / gib, rel=1e-6)
    assert one.memory.grads - none.memory.grads == pytest.approx(4.0 * added / gib, rel=1e-6)
    act = ev0._memory_pieces(1, 1, False, "none", "bf16")[1]
    assert act > 0
    assert (one.memory.activations + one.memory.in_flight) - (
        none.memory.activations + none.memory.in_flight) == pytest.approx(act / gib, rel=1e-6)


def test_an_mtp_modules_activations_survive_torchs_zero_bubble_walk():
    """Under torch's zero bubble (torchtitan's FSDP2 stack) the split backward's walk
    (estimate_walks._zb_memory) reprices the held outputs after the memory model: the MTP
    module's micro-batch of block activations is added there again, on the head's rank."""
    fw = preset("torchtitan@2025")
    plan = Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=1, recompute="none", dtype="bf16",
                schedule="zb", stage_layers=(2, 2))

    def held(depth: int):
        model = PRESETS["llama3-8b"].replace(layers=4, mtp_depth=depth)
        ev = Evaluator(model, resolve_cluster("dgx-h100:1"), 16, 2048, fw.kernel,
                       mem=fw.memory)
        est = ev.evaluate(plan, stage=pipeline.head_rank(2, 1, "zb"))
        return ev, est.memory.activations + est.memory.in_flight

    ev0, none = held(0)
    _, one = held(1)
    act = ev0._memory_pieces(1, 1, False, "none", "bf16")[1]
    assert act > 0
    assert one - none == pytest.approx(act / 2.0 ** 30, rel=1e-6)
