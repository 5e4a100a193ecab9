"""The planner's memory model of Megatron-Core pipelines and MoE layers, term by term, against
what Megatron-Core's and Transformer Engine's code keeps (memory_acts.py, moe_memory.py,
memory_pipeline.py; issue 30). Each test isolates one term by differencing two plans that
differ only in it, so a double count or a term priced at the wrong width fails."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner import memory, memory_pipeline, moe_memory, pipeline
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.plan import Plan

DENSE = ModelSpec(name="dense", layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                  vocab=32000, max_seq=8192)
TE = KernelOptions(stack="fused", sharding="zero", fp8_filter="all", fp8_scaling="te-current")
MEGATRON_FP8 = MemoryOptions(dtype="fp8", framework="megatron")
MEGATRON = MemoryOptions(dtype="bf16", framework="megatron")


def _act(spec, tp, sp, mb, seq, opts, mem, recompute="none"):
    return memory.activation_bytes(spec, tp, sp, mb, seq, recompute, opts, mem)


def test_korthikanti_list_is_34_sbh_plus_5_as2_for_gpt():
    """Korthikanti et al. 2022 eq. 1: a GPT block (MHA, GeLU 4h, dropout, unfused softmax)
    without parallelism keeps sbh (34 + 5 a s / h) bytes in 16-bit training."""
    gpt = ModelSpec(name="gpt", layers=2, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                    vocab=32000, max_seq=2048, mlp="gelu", norm="layernorm")
    opts = KernelOptions(attention="unfused", dropout=True, stack="fused", sharding="zero")
    s, b, h, a = 2048, 2, 2048, 16
    got = _act(gpt, 1, False, b, s, opts, MEGATRON)
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)


def test_te_fp8_saves_the_gemm_inputs_at_one_byte():
    """Transformer Engine's FP8 Linears save the quantised (columnwise) input: QKV's and fc1's
    inputs (h each, sequence-sharded with SP) and fc2's (f / t) at 1 byte instead of 2; the
    out-projection saves an FP8 copy (q / t) beside FlashAttention's bf16 output."""
    tp, mb, seq = 4, 1, 4096
    bf16_saved = dataclasses.replace(TE, fp8_scaling="torchao")  # not TE: GEMM inputs at 2
    h, f, q = DENSE.hidden, DENSE.ffn_hidden, DENSE.heads * DENSE.head_dim
    diff = (_act(DENSE, tp, True, mb, seq, bf16_saved, MEGATRON_FP8)
            - _act(DENSE, tp, True, mb, seq, TE, MEGATRON_FP8))
    want = mb * seq * (2 * h * 1.0 / tp + f * 1.0 / tp - q * 1.0 / tp)
    assert diff == pytest.approx(want, rel=1e-12)
    # without FP8 the list is the bf16 one, whatever the scaling option says
    assert (_act(DENSE, tp, True, mb, seq, TE, MEGATRON)
            == _act(DENSE, tp, True, mb, seq, bf16_saved, MEGATRON_FP8))


def test_query_and_attention_output_are_heads_times_head_dim_wide():
    """Qwen3's attention is 32 x 128 = 4096 wide over a 2048 hidden: Q and the attention
    output (2 bytes each, / t) at that width, not the hidden size."""
    narrow = dataclasses.replace(DENSE, hidden=2048)
    wide = dataclasses.replace(narrow, head_size=128)  # 32 heads x 128 = 4096
    opts = KernelOptions(stack="fused", sharding="zero")
    tp, mb, seq = 2, 1, 4096
    diff = _act(wide, tp, True, mb, seq, opts, MEGATRON) - _act(narrow, tp, True, mb, seq,
                                                                opts, MEGATRON)
    q_wide, q_narrow = 32 * 128, 32 * 64
    kv = 2.0 * 2 * 8 * (128 - 64)  # K and V follow the head size too (kv_dim)
    assert diff == pytest.approx(mb * seq * (2 * 2.0 * (q_wide - q_narrow) + kv) / tp,
                                 rel=1e-12)


QWEN = preset("qwen3-30b-a3b")


def _routed(**kw):
    args = dict(model=QWEN, tokens=8192, tp=1, ep=8, imbalance=1.0, cb=2.0,
                saved="korthikanti")
    args.update(kw)
    return moe_memory.routed_saved_bytes(**args)


def test_moe_fc2_input_is_fp8_under_fp8_grouped_gemms():
    """GroupedLinear saves fc2's quantised input [R, fe] (1 byte) as well as fc1's [R, h];
    SwiGLU's input (fc1's output [R, 2 fe]) stays bf16."""
    rows = 8192 * QWEN.moe_top_k
    h, fe = QWEN.hidden, QWEN.moe_ffn_hidden
    assert _routed() - _routed(expert_bytes=1.0) == pytest.approx(rows * (h + fe), rel=1e-12)


def test_moe_router_input_is_bf16_where_the_dense_equivalent_priced_an_fp8_fc1_input():
    tokens, tp = 8192, 2
    got = _routed(tp=tp, expert_bytes=1.0, dense_fp8=True) - _routed(tp=tp, expert_bytes=1.0)
    assert got == pytest.approx(tokens * QWEN.hidden * 1.0 / tp, rel=1e-12)


def test_weighted_swiglu_saves_probs_not_the_combines_expert_outputs():
    """Megatron-Core >= 0.13: the unpermute takes no probabilities, so the [T k, h] expert
    outputs are not saved; the weighted SwiGLU saves the permuted fp32 probabilities."""
    slots = 8192 * QWEN.moe_top_k
    diff = _routed() - _routed(weighted_act=True)
    assert diff == pytest.approx(slots * QWEN.hidden * 2.0 + slots * 4.0 - slots * 4.0,
                                 rel=1e-12)


def _megatron_peak_held(p: int, v: int, m: int, s: int, group: int, extra: int = 0) -> int:
    """Chunk-micro-batches rank s holds at most under Megatron-Core's interleaved schedule,
    walked as schedules.py runs it: forwards in get_schedule_table's order, the warm-up
    count of get_pp_rank_microbatches (+ `extra`: overlap_moe_expert_parallel_comm), then one
    forward and one backward per steady step, each backward freeing one held micro-batch."""
    total = m * v
    warm = min(total, (p - s - 1) * 2 + (v - 1) * group + extra)
    held = best = 0
    for k in range(total):
        held += 1
        best = max(best, held)
        if k >= warm:
            held -= 1
    return best


@pytest.mark.parametrize("p,v,m", [(16, 6, 32), (2, 24, 32), (4, 2, 8), (8, 3, 24)])
def test_interleaved_in_flight_is_megatrons_warm_up_plus_one(p, v, m):
    for s in range(p):
        assert pipeline.in_flight("interleaved", p, v, m, s) * v == pytest.approx(
            _megatron_peak_held(p, v, m, s, group=p))
    overlapped = memory_pipeline.a2a_overlap_in_flight(
        [pipeline.in_flight("interleaved", p, v, m, s) for s in range(p)], v, m)
    for s in range(p):
        assert overlapped[s] * v == pytest.approx(
            _megatron_peak_held(p, v, m, s, group=p, extra=1))


def test_a2a_overlap_adds_one_chunk_micro_batch_through_the_evaluator():
    """A Megatron interleaved MoE plan with ep_overlap holds one more chunk-micro-batch of
    activations on its fullest rank (1/v of its layers' per-micro-batch bytes)."""
    cluster = preset_cluster("dgx-h100", 2)
    plan = Plan(1, 2, 8, 1, 2, "none", False, "interleaved", 24, dtype="fp8", ep=8)
    base = dataclasses.replace(TE, expert_imbalance=1.0)

    def est(ep_overlap: bool):
        ev = Evaluator(QWEN, cluster, 512, 4096, opts=dataclasses.replace(
            base, ep_overlap=ep_overlap), mem=MEGATRON_FP8)
        return ev, ev.evaluate(plan, keep_infeasible=True)

    ev, off = est(False)
    _, on = est(True)
    stage = off.memory.stage
    assert on.memory.stage == stage
    act = ev._memory_pieces(1, 2, False, "none", "fp8", 1, 8, 2).activations
    layers = sum(off.stage_layers[c * 2 + stage] for c in range(24))  # the rank's chunks
    grown = (on.memory.activations + on.memory.in_flight - off.memory.activations
             - off.memory.in_flight) * memory.GIB
    assert grown == pytest.approx(layers * act / 24, rel=1e-6)


def test_whole_vocabulary_embedding_gradient_is_dtensors_only():
    """DTensor's embedding backward makes the gradient whole over the vocabulary; Megatron's
    VocabParallelEmbedding makes the local shard only: no embedding moment."""
    assert memory.embedding_moment(MEGATRON, 1e9, 0.0, 1e8, 0.0) == 0.0
    assert memory.embedding_moment(MemoryOptions(), 1e9, 0.0, 1e8, 0.0) == 1e9 + 2e8


def test_te_caches_fp8_weights_rowwise_and_columnwise_over_the_step():
    """Megatron-Core FP8 without fp8_param_gather: Transformer Engine keeps each block GEMM
    weight's FP8 copy and its transpose (2 bytes per element) from the first micro-batch to
    the last, counted with the parameters; none with fp8_param_gather (the parameter is the
    FP8 copy), none in bf16 and none for meshtron's runtime (torchao casts per micro-batch)."""
    assert memory.te_weight_cache_bytes(TE, MEGATRON_FP8) == 2.0
    assert memory.te_weight_cache_bytes(dataclasses.replace(TE, fp8_param_gather=True),
                                        MEGATRON_FP8) == 0.0
    assert memory.te_weight_cache_bytes(TE, MEGATRON) == 0.0
    assert memory.te_weight_cache_bytes(TE, MemoryOptions(dtype="fp8")) == 0.0
    cluster = preset_cluster("dgx-h100", 1)
    plan = Plan(2, 2, 2, 1, 1, "none", True, "1f1b", 1, dtype="fp8")

    def params(opts):
        ev = Evaluator(DENSE, cluster, 64, 4096, opts=opts, mem=MEGATRON_FP8)
        est = ev.evaluate(plan, keep_infeasible=True)
        return est.memory, est.stage_layers

    cached, layers = params(TE)
    plain, _ = params(dataclasses.replace(TE, fp8_param_gather=True))
    gemm = (DENSE.attention_params() + DENSE.mlp_params()) / 2  # one block's GEMMs at tp=2
    assert (cached.params - plain.params) * memory.GIB == pytest.approx(
        2.0 * gemm * layers[cached.stage], rel=1e-9)


def test_a_non_boolean_memory_switch_is_refused_by_name():
    from meshtron.errors import UserError

    with pytest.raises(UserError, match="memory.moe_weighted_act='yes': allowed values are "
                                        "true, false"):
        MemoryOptions(framework="megatron", moe_weighted_act="yes")


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_eager_list_prices_a_query_wider_than_the_hidden_size(recompute):
    """meshtron's own model with heads x head_size = 2 x hidden (as Qwen3's): Q, SDPA's output
    and wq's output are that wide (read off autograd with the profiler, as test_memory does
    for the presets; the list had them at the hidden size: -7% and -8%)."""
    from tests.test_memory import _measured_block_bytes

    tiny = preset("tiny")
    spec = dataclasses.replace(tiny, head_size=2 * tiny.head_dim)
    assert spec.heads * spec.head_dim == 2 * spec.hidden
    mem = MemoryOptions(dtype="bf16", fused_norm=False)  # CPU: the composite rms_norm
    measured = _measured_block_bytes(spec, "bf16", recompute, 2, 64)
    predicted = memory.activation_bytes(spec, 1, False, 2, 64, recompute, KernelOptions(), mem)
    assert measured == pytest.approx(predicted, rel=2e-3)


def _megatron_peak_layers(p: int, v: int, m: int, s: int, layers: list[int],
                          at_loss: bool = False) -> int:
    """Layer-micro-batches rank s holds at most under Megatron-Core's interleaved schedule
    with its chunks' own layer counts (`layers[c]`: chunk c of the rank): the order of
    schedules.py get_schedule_table (groups of microbatch_group_size_per_vp_stage = p
    micro-batches, each visiting the chunks in order; backwards the chunks reversed), the
    warm-up of get_pp_rank_microbatches, then one forward and one backward per step.
    `at_loss`: at most at the start of a backward of the rank's chunk v - 1 (on the last
    rank, the loss's)."""
    table = [(mb, c) for g in range(0, m, p) for c in range(v) for mb in range(g, min(g + p, m))]
    warm = min(len(table), (p - s - 1) * 2 + (v - 1) * p)
    held = best = loss = 0
    for k in range(len(table) + warm):
        if k < len(table):
            held += layers[table[k][1]]
            best = max(best, held)
        if 0 <= k - warm < len(table):
            if table[k - warm][1] == 0:  # backward of chunk v - 1
                loss = max(loss, held)
            held -= layers[v - 1 - table[k - warm][1]]
    return loss if at_loss else best


def test_an_embedding_only_first_chunk_holds_what_megatrons_order_holds():
    """Megatron-Core's account_for_embedding/loss_in_pipeline_split (the Llama 3 paper's
    405B layout, section 3.3.2: pp 16, one layer per chunk, the very first chunk only the
    embedding, the very last only the loss; 32 micro-batches): the first rank's empty chunk is
    the one holding the most micro-batches, so it holds 112 layer-micro-batches, not the even
    spread's 143 x 7 / 8 = 125.1 (6.5 GiB of 405B activations over-charged), and the last
    rank 113, not 98.9. Through the evaluator (framework megatron, whose walk was skipped):
    the last rank priced at its loss moment (the 405B's logits outweigh one layer's
    activations), where it holds 112."""
    p, v, m = 16, 8, 32
    chunk_layers = [0] + [1] * (p * v - 2) + [0]
    even = [pipeline.in_flight("interleaved", p, v, m, s) for s in range(p)]
    walked = memory_pipeline.weighted_in_flight(p, v, m, chunk_layers, even)
    for s in range(p):
        layers = [chunk_layers[c * p + s] for c in range(v)]
        assert walked[s] * sum(layers) == pytest.approx(
            _megatron_peak_layers(p, v, m, s, layers))
    assert walked[0] * 7 == pytest.approx(112) and even[0] * 7 == pytest.approx(125.125)
    assert walked[15] * 7 == pytest.approx(113) and walked[1] == even[1]
    assert _megatron_peak_layers(p, v, m, 15, [1] * 7 + [0], at_loss=True) == 112

    model = preset("llama3-405b")
    mem = MemoryOptions(dtype="bf16", framework="megatron", pipeline_split="megatron-ends")
    opts = KernelOptions(stack="fused", sharding="zero")
    ev = Evaluator(model, preset_cluster("dgx-h100", 1024), 2048, 8192, opts, mem=mem)
    plan = Plan(tp=8, pp=16, dp=64, zero=1, micro_batch=1, recompute="none", sp=True,
                schedule="interleaved", virtual_stages=8, dtype="bf16")
    act = ev._memory_pieces(8, 1, True, "none", "bf16", 1, 1, 16).activations
    for s, held in ((0, 112), (15, 112), (1, 141)):
        bd = ev.evaluate(plan, keep_infeasible=True, stage=s).memory
        assert (bd.logits > 0) == (s == 15)
        assert (bd.activations + bd.in_flight) * memory.GIB == pytest.approx(held * act,
                                                                             rel=1e-9)


def test_the_last_ranks_loss_moments_are_megatrons():
    """memory_pipeline.last_rank_moments' two walks against Megatron-Core's own table
    (`_megatron_peak_layers`, written from schedules.py): the last rank's fullest moment and
    its loss moments (the starts of its chunk v - 1's backwards), in layer-micro-batches, on
    every uneven chunk layout of a few schedules (m a multiple of p, as Megatron requires
    below p micro-batches per group)."""
    for p, v, m in ((2, 2, 12), (4, 2, 8), (4, 3, 16), (8, 4, 16), (3, 5, 9)):
        for layers in itertools.product((0, 1, 2), repeat=v):
            (full, _), (loss, _) = memory_pipeline.last_rank_moments(p, v, m, list(layers),
                                                                     1.0, 0.0, 0.0)
            assert full == _megatron_peak_layers(p, v, m, p - 1, list(layers))
            assert loss == _megatron_peak_layers(p, v, m, p - 1, list(layers), at_loss=True)


def test_distributed_optimizer_keeps_a_whole_gradient_buffer_in_the_reduce_dtype():
    """Megatron-Core's distributed optimizer and Apex's DistributedFusedAdam (NeMo 1.0, the
    NM24.07 rows) shard only the master weights and moments (12 B over dp here; NeMo's Apex
    keeps int16 remainders instead of an fp32 copy: MemoryOptions.master_weights); the gradient
    buffer every backward accumulates into is whole-size in the reduce dtype (Apex
    distributed_fused_adam.py `_init_grad_buffer`: torch.zeros([buffer_size],
    dtype=grad_sync_dtype); Megatron-Core param_and_grad_buffer.py grad_data in fp32 under
    grad_reduce_in_fp32): 4 B per parameter with an fp32 reduction, 2 with NeMo 24.07's
    grad_sync_dtype bf16, on every data-parallel rank (branch nemomem, docs/measurements.md
    #nemo-fp8-memory)."""
    cluster = preset_cluster("dgx-h100", 1)
    plan = Plan(1, 1, 8, 1, 1, "none", False, "1f1b", 1, dtype="fp8")

    def breakdown(fp32):
        opts = dataclasses.replace(TE, fp32_grad_reduce=fp32)
        est = Evaluator(DENSE, cluster, 64, 4096, opts=opts, mem=MEGATRON_FP8).evaluate(
            plan, keep_infeasible=True)
        return est.memory

    fp32, bf16 = breakdown(True), breakdown(False)
    params = DENSE.num_params()
    assert fp32.grads * memory.GIB == pytest.approx(4.0 * params, rel=1e-9)
    assert bf16.grads * memory.GIB == pytest.approx(2.0 * params, rel=1e-9)
    assert bf16.optimizer == fp32.optimizer == pytest.approx(12.0 * params / 8 / memory.GIB)
