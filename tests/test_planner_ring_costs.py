"""What FlashAttention-2 stacks run around the attention kernel (issue 30, item 3): torchtitan's
repeat_kv copies, context parallelism's flash calls as they are called, and torch's ring
attention's fp32 merges, copies and collectives (planner/elementwise.py gqa_repeat_bytes,
planner/ring_attention.py ring_core_time, torch_ring_bytes, torch_ring_exposed). Torch-free, fast."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import comm, ring_attention as R
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions, cp_group, layer_cost
from meshtron.planner.elementwise import gqa_repeat_bytes
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.gemm import cluster_gemm_time, membound_bytes_per_s
from meshtron.planner.plan import Plan

H100 = resolve_cluster("dgx-h100:1")
L8 = PRESETS["llama3-8b"]
TT = preset("torchtitan@2025").kernel


def test_repeat_kv_copies_are_priced_where_the_model_repeats():
    """torchtitan's repeat_kv (expand + reshape before SDPA) copies K and V to every query
    head and its backward sums them back: with gqa_repeat the layer is slower by exactly
    those bytes at the stack's memory-bound rate; a model without GQA pays nothing; under
    per-block compile K's copy rides in the rotary kernel (fewer bytes than eager)."""
    seq, tp = 8192, 2
    bw = membound_bytes_per_s(H100, TT.stack)
    base = layer_cost(L8, H100, tp, 1, seq, False, TT)
    rep = layer_cost(L8, H100, tp, 1, seq, False, TT, gqa_repeat=True)
    f, b = gqa_repeat_bytes(L8, tp, TT.stack)
    h, kv = L8.hidden, L8.kv_dim
    assert f == b == 4.0 * (h + kv) / tp
    assert rep.fwd - base.fwd == pytest.approx(seq * f / bw, rel=1e-9)
    assert rep.bwd - base.bwd == pytest.approx(seq * b / bw, rel=1e-9)
    assert gqa_repeat_bytes(L8, tp, "compiled")[0] == 4.0 * h / tp < f
    mha = PRESETS["llama2-13b"]
    assert gqa_repeat_bytes(mha, tp, "eager") == (0.0, 0.0)


def test_megatron_does_not_repeat_kv_and_torchtitan_does():
    """The Evaluator prices the copies from the stack's memory options (gqa_copies), except
    Megatron's, whose TE fused attention takes the K/V groups as they are."""
    cl = resolve_cluster("dgx-h100:2")
    plan = Plan(tp=1, pp=1, dp=16, zero=3, micro_batch=1, recompute="none", sp=False,
                dtype="bf16")

    def step(fw_name: str, gqa: bool) -> float:
        fw = preset(fw_name)
        mem = dataclasses.replace(fw.memory, gqa_copies=gqa)
        return Evaluator(L8, cl, 64, 8192, fw.kernel, mem=mem).evaluate(
            plan, exact_memory=False).step_time_s

    assert step("torchtitan@2025", True) > step("torchtitan@2025", False)
    assert step("megatron@2024", True) == step("megatron@2024", False)


def test_ring_core_is_the_calls_it_makes():
    """A load-balanced cp core is one causal square of the rank's s/cp tokens plus cp - 1
    unmasked chunk-pair calls (s/cp x s/2cp), each call's QK^T and PV timed by the GEMM model
    at its own shape: the same FLOPs as the rank's causal share of the whole sequence, and
    the layer's core is that sum, not the whole-sequence GEMMs halved."""
    seq, cp, bh, hd = 16384, 8, 32, 128
    sl = seq / cp

    def pair(q: float, k: float) -> float:  # QK^T then PV of one head
        return cluster_gemm_time(q, k, hd, H100) + cluster_gemm_time(q, hd, k, H100)

    fwd, bwd, first_f, first_b = R.ring_core_time(H100, bh, sl, cp, hd)
    assert first_f == pytest.approx(0.5 * bh * pair(sl, sl), rel=1e-12)
    assert first_b == pytest.approx(2.5 * first_f, rel=1e-12)
    assert fwd - first_f == pytest.approx((cp - 1) * bh * pair(sl, sl / 2), rel=1e-12)
    assert bwd == pytest.approx(2.5 * fwd, rel=1e-12)
    # FLOPs: the causal diagonal plus cp - 1 full pairs = half of s_local x seq
    diag, pairs = 0.5 * 4 * sl * sl * hd, (cp - 1) * 4 * sl * (sl / 2) * hd
    assert diag + pairs == 0.5 * 4 * sl * seq * hd
    whole = 0.5 * bh * pair(sl, seq)  # one causal call over the whole sequence
    assert fwd > whole  # the shorter calls saturate the GPU less
    lc = layer_cost(L8, H100, 1, 1, seq, False, KernelOptions(), cp)
    assert lc.core_fwd == pytest.approx(R.ring_core_time(H100, L8.heads, sl, cp,
                                                         L8.head_dim)[0], rel=1e-12)


def test_torch_ring_adds_its_merges_and_copies():
    """torch's ring attention (torch_ring) adds, per layer, the HBM bytes of its fp32 merges,
    K/V copies and dk/dv accumulation (ring_attention.torch_ring_bytes) to the layer, which
    grow with cp at the same local length."""
    seq, cp = 131072, 4
    cl = resolve_cluster("dgx-h100:1")
    off = dataclasses.replace(TT, torch_ring=False, cp_overlap=False)  # the plain exchange
    base = layer_cost(L8, cl, 1, 1, seq, False, off, cp, gqa_repeat=True)
    ring = layer_cost(L8, cl, 1, 1, seq, False, TT, cp, gqa_repeat=True)
    tokens = seq / cp
    e = k = tokens * L8.hidden  # K/V repeated to every query head
    f, b = R.torch_ring_bytes(e, k, cp)
    bw = membound_bytes_per_s(cl, TT.stack)
    assert ring.fwd - base.fwd == pytest.approx(f / bw, rel=1e-9)
    assert ring.bwd - base.bwd == pytest.approx(b / bw, rel=1e-9)
    assert R.torch_ring_bytes(e, k, 8)[0] > f and R.torch_ring_bytes(e, k, 8)[1] > b
    # one call (cp = 1) has no ring
    assert layer_cost(L8, cl, 1, 1, 32768, False, TT) == layer_cost(L8, cl, 1, 1, 32768,
                                                                    False, off)


def test_compiled_torch_ring_adds_inductors_fused_bytes():
    """Under torch.compile the block's graph holds the ring (torchtitan compiles each block with
    fullgraph=True): its merges, casts and dk/dv accumulations are priced as inductor's fused
    kernels (ring_attention.torch_ring_bytes_compiled) at the compiled stack's rate, fewer
    bytes than the eager ops at every cp; at cp 2 the forward is one K/V cat and one merge
    that reads both calls' bf16 outputs and writes the bf16 result."""
    seq, cp = 65536, 2
    cl = resolve_cluster("dgx-h100:1")
    comp = dataclasses.replace(TT, stack="compiled")
    off = dataclasses.replace(comp, torch_ring=False, cp_overlap=False)
    base = layer_cost(L8, cl, 1, 1, seq, False, off, cp, gqa_repeat=True)
    ring = layer_cost(L8, cl, 1, 1, seq, False, comp, cp, gqa_repeat=True)
    e = k = seq / cp * L8.hidden
    f, b = R.torch_ring_bytes_compiled(e, k, cp)
    assert f == pytest.approx(8.0 * k + 6.0 * e)
    bw = membound_bytes_per_s(cl, "compiled")
    assert ring.fwd - base.fwd == pytest.approx(f / bw, rel=1e-9)
    assert ring.bwd - base.bwd == pytest.approx(b / bw, rel=1e-9)
    for n in (2, 3, 4, 8):
        fc, bc = R.torch_ring_bytes_compiled(e, k, n)
        fe, be = R.torch_ring_bytes(e, k, n)
        assert 0 < fc < fe and 0 < bc < be
        assert R.torch_ring_bytes_compiled(e, k, n + 1)[0] > fc  # one more merge per call


def test_te_ring_adds_its_corrections_and_accumulations():
    """Transformer Engine's p2p ring (cp_overlap without torch's ring: the Megatron presets)
    adds its memory-bound ops (ring_attention.te_ring_bytes, counted from
    AttnFuncWithCPAndKVP2P): at cp 2 on the last rank, forward the K/V cat (8 K), the bf16
    `out` zeroed (2 E) and two fused output corrections (6 E each); backward the K/V copy
    (8 K), dq's copy and add (4 E + 6 E), the dk/dv cats (4 K half, 8 K whole) and dkv's copy
    and add (4 K, 12 K). Nothing is added without cp, with torch's ring, or in fp32."""
    seq, cp = 8192, 2
    mc = preset("megatron@2024").kernel
    plain = dataclasses.replace(mc, cp_overlap=False)
    te = layer_cost(L8, H100, 1, 1, seq, False, mc, cp)
    base = layer_cost(L8, H100, 1, 1, seq, False, plain, cp)
    tokens = seq / cp
    e, k = tokens * L8.hidden, tokens * L8.kv_dim
    f, b = R.te_ring_bytes(e, e, k, cp)
    assert (f, b) == (8 * k + 14 * e, 10 * e + 36 * k)
    bw = membound_bytes_per_s(H100, mc.stack)
    assert te.fwd - base.fwd == pytest.approx(f / bw, rel=1e-9)
    assert te.bwd - base.bwd == pytest.approx(b / bw, rel=1e-9)
    # every later step adds a correction, a dq add and a half-key cat and add
    f4, b4 = R.te_ring_bytes(e, e, k, 4)
    assert (f4 - f, b4 - b) == (12 * e, 12 * e + 20 * k)
    # MLA (q / k head 192, V 128): `out` is zeroed at q's shape (TE v2.2 attention.py
    # `torch.zeros_like(q)`), the corrections run at the output's
    e_q, e_o = tokens * 192 * 128, tokens * 128 * 128
    f_mla, _ = R.te_ring_bytes(e_q, e_o, k, cp)
    assert f_mla == 8 * k + 2 * e_q + 12 * e_o
    assert layer_cost(L8, H100, 1, 1, seq, False, mc) == layer_cost(L8, H100, 1, 1, seq,
                                                                    False, plain)
    fp32 = layer_cost(L8, H100, 1, 1, seq, False, mc, cp, "fp32")
    assert fp32.fwd == layer_cost(L8, H100, 1, 1, seq, False, plain, cp, "fp32").fwd


def test_te_ring_backward_sends_kv_again_beside_dkv():
    """Transformer Engine's ring keeps no gathered K/V: its backward sends the K/V chunks
    again beside the dK/dV sums, twice the forward's bytes, where the all-gather design
    (cp_overlap False) only reduce-scatters the gradients (exposed, nothing to hide behind
    here: a zero-length core)."""
    from meshtron.planner.compute_core import cp_exposed

    cl = resolve_cluster("dgx-h100:2")
    fab, cp, kv = comm.Fabric.of(cl), 2, 4096 * L8.kv_dim
    mc = preset("megatron@2024").kernel
    group = cp_group(8, cp, cl.gpus_per_node)  # tp 8: the cp pair on two nodes
    gather = comm.all_gather(2 * 2 * kv * cp, group, fab)
    scatter = comm.reduce_scatter(2 * 2 * kv * cp, group, fab)
    te_f, te_b = cp_exposed(cl, fab, mc, "bf16", 8, cp, kv, 0.0, 0.0, None)
    ag_f, ag_b = cp_exposed(cl, fab, dataclasses.replace(mc, cp_overlap=False), "bf16", 8,
                            cp, kv, 0.0, 0.0, None)
    assert (ag_f, ag_b) == (gather, scatter)
    assert te_f == pytest.approx(gather, rel=1e-9)
    assert te_b == pytest.approx(gather + scatter, rel=1e-9)


def test_torch_ring_exposes_its_backward_sends_and_moves_every_head():
    """The ring's collectives: the K/V all-gather hides only behind the first call, the last
    fp32 dk/dv send behind nothing, so even a long core leaves the backward some exposed
    time; with repeat_kv the K/V moved are every query head's (8B: 4x its kv_dim)."""
    seq, cp = 262144, 8
    cl = resolve_cluster("dgx-h100:1")
    tokens = seq / cp
    rep = layer_cost(L8, cl, 1, 1, seq, False, TT, cp, gqa_repeat=True)
    native = layer_cost(L8, cl, 1, 1, seq, False, TT, cp)
    fab = comm.Fabric.of(cl)
    send = comm.send(8.0 * tokens * L8.hidden, False, fab)
    assert rep.tp_bwd > send > 0.0
    assert rep.tp_bwd > native.tp_bwd and rep.tp_fwd > native.tp_fwd
    # any stack that hands SDPA repeated K/V exchanges them at every head (here exposed)
    plain = dataclasses.replace(TT, torch_ring=False, cp_overlap=False)
    wide = layer_cost(L8, cl, 1, 1, seq, False, plain, cp, gqa_repeat=True)
    narrow = layer_cost(L8, cl, 1, 1, seq, False, plain, cp)
    assert wide.tp_fwd > 3.0 * narrow.tp_fwd  # 4x the bytes, the same latency
    group = cp_group(1, cp, cl.gpus_per_node)
    _, _, first_f, first_b = R.ring_core_time(cl, L8.heads, tokens, cp, L8.head_dim)
    gather = comm.all_gather(4.0 * tokens * L8.hidden * cp, group, fab)
    exp_f, _ = R.torch_ring_exposed(tokens * L8.hidden, cp, group, fab, first_f, first_b,
                                    1.0, 0.0)
    assert exp_f == pytest.approx(max(0.0, gather - first_f), rel=1e-9)


@pytest.mark.parametrize("stack", ["eager", "compiled"])
def test_no_layout_copy_after_a_flash_kernel(stack):
    """SDPA's flash/cuDNN output has the query's token-major strides, so torchtitan's (and
    meshtron's) `.transpose(1, 2).contiguous()` copies nothing; the unfused core's head-major
    AV product is copied back (2+2 bytes per element, one kernel)."""
    from meshtron.planner.elementwise import elementwise_bytes, kernels_per_layer

    flash = KernelOptions(stack=stack)
    unfused = KernelOptions(stack=stack, attention="unfused")
    tp = 2
    assert elementwise_bytes(L8, tp, False, unfused) - elementwise_bytes(L8, tp, False, flash) \
        == pytest.approx(4.0 * L8.hidden / tp)
    # the unfused core launches QK^T, softmax, AV (3 more than flash) plus the copy
    assert kernels_per_layer(L8, unfused) - kernels_per_layer(L8, flash) == 4


def test_complex_rope_keeps_its_eager_bytes_under_compile():
    """torchtitan's apply_rotary_emb multiplies complex numbers, for which inductor generates
    no code (ATen fallback): under per-block compile it still moves its eager 20 bytes per q/k
    element (2+4 upcast, 4+4 multiply, 4+2 cast back) in 3 kernels per tensor, where a real
    RoPE fuses to one 4-byte kernel; the eager bytes are the same either way."""
    from meshtron.planner.elementwise import elementwise_bytes, kernels_per_layer

    tp, h, kv = 2, L8.hidden, L8.kv_dim
    real = KernelOptions(stack="compiled")
    cplx = KernelOptions(stack="compiled", complex_rope=True)
    assert elementwise_bytes(L8, tp, False, cplx) - elementwise_bytes(L8, tp, False, real) \
        == pytest.approx(16.0 * (h + kv) / tp)
    assert kernels_per_layer(L8, cplx) - kernels_per_layer(L8, real) == 5
    eager = KernelOptions(stack="eager")
    assert elementwise_bytes(L8, tp, False, dataclasses.replace(eager, complex_rope=True)) \
        == elementwise_bytes(L8, tp, False, eager)
    assert TT.complex_rope and not preset("megatron@2024").kernel.complex_rope


def test_ring_launches_are_counted_per_step_from_the_code():
    """torch's ring issues, per extra step, forward: a K/V cat, one more flash call, the
    call's two fp32 casts and the merge's 8 ops; backward: a K/V cat, one more flash
    backward, dk/dv `_partial_update` (2 + 2) and dq's add, and an fp32 dk/dv cat before its
    send; plus a fixed set per layer (copies, zeros, the first call's casts/adds, the casts
    back) and one K/V all-gather per pass and one dk/dv send per step in the backward."""
    f2, b2, cf2, cb2 = R.torch_ring_launches(2)
    for cp in (3, 4, 8):
        f, b, cf, cb = R.torch_ring_launches(cp)
        assert f - f2 == 12 * (cp - 2) and b - b2 == 8 * (cp - 2)
        assert cf == 1 and cb == 1 + cp
    # cp 2 tallied op by op: forward copies 2, cat 1, second call 1, casts 2 x 2, merge 8,
    # cast back 1; backward zeros 3, copies 2, cat 1, second call 1, first adds 3, partial
    # updates and dq add 5, fp32 cats before the 2 sends 2, casts back 3
    assert (f2, b2) == (2 + 1 + 1 + 4 + 8 + 1, 3 + 2 + 1 + 1 + 3 + 5 + 2 + 3)


def test_te_ring_launches_are_counted_from_the_code():
    """Transformer Engine's ring issues at cp 2, forward: the K/V cat, the second call,
    `out`'s zeros with the lse clone and cast, the lse cast back and two output corrections
    (8) and one p2p exchange; backward: the K/V copy, the second call and per step dq's
    update, the dk/dv cat and dkv's update (8) and two exchanges. Each later step adds a
    call, an lse and an output correction (3) forward and a call and three updates (4)
    backward. On a host-bound layer (8B at 2,048 tokens over tp 8 and cp 8) they are the
    difference from the plain exchange's two collectives."""
    from meshtron.planner import host
    from meshtron.planner.elementwise import kernels_per_layer
    from meshtron.planner.gemm import dispatch_s

    assert R.te_ring_launches(2) == (1 + 1 + 3 + 0 + 1 + 2, 1 + 1 + 6, 1, 2)
    for cp in (3, 4, 8):
        f, b, cf, cb = R.te_ring_launches(cp)
        assert (f - 8, b - 8, cf, cb) == (3 * (cp - 2), 4 * (cp - 2), cp - 1, cp)
    mc = preset("megatron@2024").kernel
    tp, cp, per = 8, 8, dispatch_s(H100)
    lc = layer_cost(L8, H100, tp, 1, 2048, True, mc, cp=cp)
    issue_f = host.layer_issue(kernels_per_layer(L8, mc), host.tp_collectives(tp, True),
                               per)[0]
    ops_f, _, coll_f, _ = R.te_ring_launches(cp)
    assert lc.fwd + lc.tp_fwd == pytest.approx(issue_f + (ops_f + coll_f) * per, rel=1e-9)


def test_ring_launches_bound_a_layer_of_small_chunks():
    """At small per-rank chunks (8B, 2,048 tokens over cp 8 and tp 8: 256 tokens a rank,
    calls of 256 x 128) the layer's device work is shorter than its launches: the GPU waits
    on the host, so the layer's forward plus its exposed communication is the issue time,
    which now includes the ring's own ops and collectives at a forward op's cost; at 256k
    tokens (the torchtitan 8B cp 8 row) the same launches hide behind the calls."""
    from meshtron.planner import host
    from meshtron.planner.elementwise import kernels_per_layer
    from meshtron.planner.gemm import dispatch_s

    tp, cp, per = 8, 8, dispatch_s(H100)
    lc = layer_cost(L8, H100, tp, 1, 2048, True, TT, cp=cp, gqa_repeat=True)
    issue_f = host.layer_issue(kernels_per_layer(L8, TT), host.tp_collectives(tp, True),
                               per)[0]
    ops_f, _, coll_f, _ = R.torch_ring_launches(cp)
    assert lc.fwd + lc.tp_fwd == pytest.approx(issue_f + (ops_f + coll_f) * per, rel=1e-9)
    plain = layer_cost(L8, H100, tp, 1, 2048, True,
                       dataclasses.replace(TT, torch_ring=False, cp_overlap=False),
                       cp=cp, gqa_repeat=True)
    assert lc.fwd + lc.tp_fwd > plain.fwd + plain.tp_fwd + 50 * per  # 90 launches, 0.9 ms
    long = layer_cost(L8, H100, 1, 1, 262144, False, TT, cp=cp, gqa_repeat=True)
    assert (ops_f + coll_f) * per < 0.01 * long.fwd


def test_torch_ring_keeps_no_gathered_kv_for_backward():
    """torch's ring attention all-gathers K/V inside the forward call and again in its backward
    (_templated_ring_attention_backward's own rotater): nothing gathered is saved, whatever
    cp_overlap says; meshtron's all-gather design keeps the whole sequence's K/V."""
    from meshtron.planner import memory
    from meshtron.planner.memory_acts import gathered_kv_bytes

    model = PRESETS["llama3-8b"]
    mem = memory.options_for(KernelOptions())
    kept = gathered_kv_bytes(model, 1, 1, 65536, 4, "selective", KernelOptions(), mem)
    assert kept == 2.0 * 65536 * model.kv_dim * 2.0
    assert gathered_kv_bytes(model, 1, 1, 65536, 4, "selective",
                             KernelOptions(torch_ring=True), mem) == 0.0


def test_sliding_blocks_under_meshtron_cp_move_and_keep_only_their_halos():
    """meshtron's runtime at cp > 1 (parallel/cp_halo.py `attend_halo`): a sliding block
    exchanges and keeps only the window - 1 rows before each local chunk, within a chunk
    (seq / 2cp) or over two; its global blocks, a window so long that the halo would move as
    much as the gather, and the overlapped ring keep the whole sequence's pricing. Gemma 3's
    pattern (5 of 6 blocks slide, 1024 tokens) on Llama 3 8B's shapes at 131072 tokens,
    cp 8, without recomputation (under selective recomputation a sliding block keeps only
    the rows it received: tests/test_cp_halo_plan.py)."""
    from meshtron.planner import memory
    from meshtron.planner.memory_acts import gathered_kv_bytes

    seq, cp, w = 131072, 8, 1024
    gemma = L8.replace(sliding_window=w, window_every=6)  # 27 of 32 blocks slide
    share = gemma.sliding_blocks / gemma.layers
    opts = KernelOptions()
    mem = memory.options_for(opts)
    whole = gathered_kv_bytes(L8, 1, 1, seq, cp, "none", opts, mem)
    kept = gathered_kv_bytes(gemma, 1, 1, seq, cp, "none", opts, mem)
    rows = (1 - share) * seq + share * (seq / cp + 2 * (w - 1))  # [halo, chunk] x 2 per rank
    assert kept == pytest.approx(whole * rows / seq, rel=1e-12)
    assert kept < 0.3 * whole
    # a window longer than a chunk of 8192 tokens: 8193 rows before each chunk, over two
    # chunks of two ranks (ranks 1..6: 2 x 8193 received, none of them their own rows)
    long = L8.replace(sliding_window=8194, window_every=6)
    rows = (1 - share) * seq + share * (seq / cp + 2 * 8193)
    assert gathered_kv_bytes(long, 1, 1, seq, cp, "none", opts, mem) == pytest.approx(
        whole * rows / seq, rel=1e-12)
    # the fullest rank receives fewer rows than the gather's 7/8 x seq = 114688 up to a window
    # of 114688 (rank 0: the 114687 rows before its chunk 15, chunks 1..14 but one row); from
    # 114689 it would receive as many: the whole sequence gathered
    for w_long, gathered in ((114688, False), (114689, True)):
        longer = L8.replace(sliding_window=w_long, window_every=6)
        kept_long = gathered_kv_bytes(longer, 1, 1, seq, cp, "none", opts, mem)
        assert (kept_long == whole) == gathered, w_long
    # the exchange's exposed time: the global blocks' all-gather, the sliding ones' halo sends
    base = layer_cost(L8, H100, 1, 1, seq, False, opts, cp=cp)
    got = layer_cost(gemma, H100, 1, 1, seq, False, opts, cp=cp)
    halo_bytes = 2.0 * 2 * (w - 1) * L8.kv_dim * 2  # K and V of 2(w - 1) rows, bf16
    halo_s = comm.send(halo_bytes, cp_group(1, cp, H100.gpus_per_node).nodes > 1,
                       comm.Fabric.of(H100))
    assert got.tp_fwd == pytest.approx((1 - share) * base.tp_fwd + share * halo_s, rel=1e-9)
    assert got.tp_fwd < 0.3 * base.tp_fwd
    ring = dataclasses.replace(opts, cp_overlap=True)
    assert (gathered_kv_bytes(gemma, 1, 1, seq, cp, "selective", ring, mem)
            == gathered_kv_bytes(L8, 1, 1, seq, cp, "selective", ring, mem) == 0.0)


def test_context_parallel_exchange_is_in_the_step_without_tensor_parallelism():
    """At tp = 1 and cp > 1 the layers' K/V exchange (compute.layer_cost's tp_fwd/tp_bwd: no
    tensor collectives then) is a part of the step, as at tp > 1: it was dropped with the tensor
    collectives' rounding guard, so tp=1 x cp plans were priced with free context parallelism.
    Llama 3 8B at 131072 tokens, cp 8 on one node of H100s."""
    seq = 131072
    ev = Evaluator(L8, resolve_cluster("dgx-h100:1"), 8, seq, KernelOptions())
    plan = Plan(tp=1, pp=1, dp=1, cp=8, zero=1, micro_batch=1, recompute="full", sp=False)
    est = ev.evaluate(plan)
    layer = layer_cost(L8, H100, 1, 1, seq, False, KernelOptions(), cp=8)
    assert layer.tp_fwd > 0.0
    # at least a layer's exchanges per micro-batch (8 micro-batches of 1) in every layer
    # (the step's walk adds the replays as it does at tp > 1)
    per_layer = layer.per_microbatch("full", KernelOptions().attention)[1]
    assert est.time.tp_comm >= 8 * L8.layers * per_layer > 0.0
    assert est.step_time_s == pytest.approx(est.time.total, rel=1e-12)
    no_cp = Evaluator(L8, resolve_cluster("dgx-h100:1"), 8, seq, KernelOptions()).evaluate(
        plan.replace(cp=1, dp=8))
    assert no_cp.time.tp_comm == 0.0


def test_a_context_parallel_alternative_is_not_called_pure_data_parallel():
    """`meshtron plan` explains why each other layout family loses; tp = pp = 1 with cp > 1
    (Llama 3 8B at 65536 tokens on 32 H100s) is data x context parallel, not "pure" data
    parallel."""
    from meshtron.planner.search import search_plans

    result = search_plans(L8, resolve_cluster("dgx-h100:4"), 32, 65536, top_k=1)
    names = [a.label for a in result.alternatives]
    cp_dp = [n for n in names if "cp=" in n and "tp=1," in n and ",pp=1," in n]
    assert cp_dp and all(n.startswith("ZeRO-") and "data x context parallel" in n
                         for n in cp_dp), names
    assert not any(n.startswith("pure") and "cp=" in n and "cp=1" not in n for n in names), names
