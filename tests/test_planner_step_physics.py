"""Step-time physics of issue 30 (item 3), each effect pinned from first principles: what
per-block torch.compile can save, the optimizer and gradient-accumulation passes, tensor-parallel
collectives paired with the GEMM that can hide each (Transformer Engine userbuffers, PyTorch
async TP, Megatron's linears), FP8 gathers, the SM margin. No figure of a published row."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import compute as C
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.elementwise import elementwise_bytes
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset, with_options
from meshtron.planner.plan import Plan
from meshtron.planner.search import search_plans

H100 = resolve_cluster("dgx-h100:1")
L8 = PRESETS["llama3-8b"]


def _layer(opts: C.KernelOptions, tp: int = 1, tokens: int = 4096, sp: bool = False,
           dtype: str = "bf16", model=L8, cluster=H100) -> C.LayerCost:
    return C.layer_cost(model, cluster, tp, 1, tokens, sp, opts, 1, dtype)


def _elementwise_s(opts: C.KernelOptions, tokens: int = 4096) -> float:
    return tokens * elementwise_bytes(L8, 1, False, opts) / C.membound_bytes_per_s(
        H100, opts.stack)


# ---- torch.compile ------------------------------------------------------------------------------
def test_compile_saves_at_most_the_blocks_elementwise_work():
    """Per-block compile fuses memory-bound work inside the blocks and issues fewer kernels;
    the GEMMs and the attention kernel are untouched, so a layer's forward can shrink by no
    more than its eager element-wise time."""
    eager = C.KernelOptions()
    comp = C.compiled(eager)
    assert comp.stack == "compiled" and C.compiled(comp) == comp
    e, c = _layer(eager), _layer(comp)
    saved = e.fwd - c.fwd
    assert 0 < saved <= _elementwise_s(eager) - _elementwise_s(comp) + 1e-12
    assert e.wgrad == c.wgrad and e.core_fwd == c.core_fwd  # GEMMs, attention: the same
    # a stack that fuses already (Megatron / TE) is not changed by compiling
    assert C.compiled(C.KernelOptions(stack="fused")).stack == "fused"


def test_compile_leaves_head_loss_and_optimizer_eager():
    """meshtron and torchtitan compile each block: the final norm, head and loss, the
    optimizer step and the gradient accumulation run as in eager."""
    assert C.compiled(C.KernelOptions()).head_stack == "eager"
    assert C.KernelOptions(stack="fused").head_stack == "fused"
    cl = dataclasses.replace(resolve_cluster("dgx-h200:1"), gpus_per_node=1)  # one H200
    knobs = {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 1, "recompute": "full",
             "dtype": "bf16"}
    spec = L8.replace(layers=16)
    e = search_plans(spec, cl, 8, 4096, knobs, top_k=1, explain=False).best
    c = search_plans(spec, cl, 8, 4096, {**knobs, "compile": True}, top_k=1,
                     explain=False).best
    assert c.time.optimizer == e.time.optimizer
    gain = 1 - c.step_time_s / e.step_time_s
    # bounded by the element-wise share of the step: per micro-batch and block, forward,
    # recomputed forward and backward (2x) move 4x the forward's element-wise bytes
    m = e.num_microbatches
    share = 4 * m * spec.layers * _elementwise_s(C.KernelOptions()) / e.step_time_s
    assert 0 < gain < share


def test_recomputed_forward_is_compiled_too():
    """Full recomputation replays the forward inside the backward; the replay runs the
    compiled block, so compile saves more per micro-batch with it than without."""
    eager, comp = _layer(C.KernelOptions()), _layer(C.compiled(C.KernelOptions()))
    with_rec = (eager.per_microbatch("full", "flash")[0]
                - comp.per_microbatch("full", "flash")[0])
    without = (eager.per_microbatch("none", "flash")[0]
               - comp.per_microbatch("none", "flash")[0])
    assert with_rec == pytest.approx(without + (eager.fwd - comp.fwd))


def test_eager_rmsnorm_through_aten_moves_what_a_fused_one_does():
    """torch.nn.RMSNorm runs ATen's fused kernel on CUDA (PyTorch >= 2.8); the Llama reference
    module's five kernels move 36 bytes per element instead of 4."""
    aten = elementwise_bytes(L8, 1, False, C.KernelOptions(eager_norm="aten"))
    python = elementwise_bytes(L8, 1, False, C.KernelOptions(eager_norm="python"))
    assert python - aten == pytest.approx(2 * (36 - 4) * L8.hidden)
    assert (C.kernels_per_layer(L8, C.KernelOptions(eager_norm="python"))
            - C.kernels_per_layer(L8, C.KernelOptions())) == 2 * (6 - 1)


# ---- optimizer and gradient accumulation ---------------------------------------------------------
def _ev(fw: str, batch: int = 64, model=L8, cluster="dgx-h100:8", **opts) -> Evaluator:
    f = with_options(preset(fw), opts) if opts else preset(fw)
    return Evaluator(model, resolve_cluster(cluster), batch, 4096, f.kernel, mem=f.memory)


def test_optimizer_bytes_follow_the_implementation_not_the_kernels():
    fused = _ev("meshtron")
    foreach = _ev("meshtron", optimizer="foreach")
    compiled = Evaluator(L8, resolve_cluster("dgx-h100:8"), 64, 4096,
                         C.compiled(preset("meshtron").kernel))
    assert foreach.opt_bytes / fused.opt_bytes == pytest.approx(86 / 28)
    assert compiled.opt_bytes == fused.opt_bytes
    with pytest.raises(Exception, match="optimizer='adam'"):
        C.KernelOptions(optimizer="adam")


def test_simulator_prices_the_for_loop_optimizer_as_the_planner():
    """The per-tensor loop ('for-loop', planner/optimizer_loop.py) is priced once, by
    Evaluator.optimizer_step_s, for the planner's step and the simulator's pieces alike: on a
    2-stage plan what the loop adds to the first stage's piece (the pieces also carry the
    accumulation passes, which the planner counts in compute) is what it adds to the
    planner's optimizer term (the first stage, with the embedding, is the slowest); at 32
    ranks of an 8B model it adds half again to the same bytes stepped by foreach."""
    from meshtron.planner.step_pieces import step_pieces

    piece, planner = {}, {}
    for kind in ("for-loop", "foreach"):
        ev = _ev("meshtron", batch=32, cluster="dgx-h100:8", optimizer=kind)
        est = ev.evaluate(Plan(1, 2, 32, 3, 1, "none", False, "1f1b", 1, dtype="bf16"))
        piece[kind] = step_pieces(ev, est).optimizer_s[0]
        planner[kind] = est.time.optimizer
    added = planner["for-loop"] - planner["foreach"]
    assert piece["for-loop"] - piece["foreach"] == pytest.approx(added, rel=1e-9)
    assert _ev("meshtron", optimizer="for-loop").opt_bytes == _ev(
        "meshtron", optimizer="foreach").opt_bytes
    assert planner["for-loop"] > 1.4 * planner["foreach"]


def test_unfused_gradient_accumulation_costs_a_pass_per_micro_batch():
    """meshtron's ZeRO-0 adds each micro-batch's bf16 gradient into the fp32 accumulator:
    2 + 4 + 4 bytes per local parameter per micro-batch after the first, an add across dtypes
    (C.cast_add_bytes_per_s); the first casts: 2 + 4, streaming; Megatron's
    gradient-accumulation fusion does it inside the wgrad GEMM."""
    plan = Plan(tp=1, pp=1, dp=8, zero=0, micro_batch=1, dtype="bf16")
    ev = _ev("meshtron")
    params = ev._stage_params(plan, L8.layers, 0)
    add_bw = C.cast_add_bytes_per_s(ev.cluster)
    for m in (1, 4, 16):
        got = ev.accumulation_s(plan, L8.layers, 0, m, ev.dp_flags(plan))
        assert got == pytest.approx((m - 1) * 10 * params / add_bw + 6 * params / ev.hbm)
    mc = _ev("megatron@2024")
    assert mc.accumulation_s(plan, L8.layers, 0, 16, mc.dp_flags(plan)) == 0.0
    # ZeRO-3 reducing every micro-batch accumulates the reduced shard only
    z3 = plan.replace(zero=3)
    shard = ev.accumulation_s(z3, L8.layers, 0, 16, ev.dp_flags(z3))
    assert shard == pytest.approx(15 * 3 * 4.0 * params / 8 / ev.hbm)


def test_hsdp_shards_the_optimizer_and_the_accumulated_shard_over_its_shard_group():
    """Under HSDP (dp_replicate > 1) ZeRO shards over dp / dp_replicate * cp ranks, not dp *
    cp (evaluate's shard_dp): the accumulated gradient shard of a ZeRO-3 run reduced every
    micro-batch is dp_replicate times the unreplicated one's, and the simulator's optimizer
    piece (step_pieces) steps the same local parameters as the planner's optimizer term."""
    from meshtron.planner.step_pieces import step_pieces

    ev = _ev("meshtron", batch=64, cluster="dgx-h100:16")
    flat = Plan(tp=1, pp=1, dp=16, zero=3, micro_batch=1, dtype="bf16")
    hsdp = flat.replace(dp_replicate=2)
    acc = {p.dp_replicate: ev.accumulation_s(p, L8.layers, 0, 4, ev.dp_flags(p))
           for p in (flat, hsdp)}
    assert acc[2] == pytest.approx(2 * acc[1])
    for plan in (flat, hsdp):
        est = ev.evaluate(plan)
        m = est.num_microbatches
        piece = step_pieces(ev, est).optimizer_s[0] - ev.accumulation_s(
            plan, L8.layers, 0, m, ev.dp_flags(plan))
        assert piece == pytest.approx(est.time.optimizer, rel=1e-9)


def test_zero3_accumulates_the_experts_shard_over_their_own_group():
    """A rank's E/ep experts shard over the dp*cp/ep ranks holding the same experts (as the
    optimizer step's `local` does), not over all dp*cp: a ZeRO-3 run reducing every
    micro-batch adds that larger expert shard, 3 x 4 bytes per element and micro-batch after
    the first."""
    from meshtron.planner import moe_cost

    model = PRESETS["mixtral-8x7b"]
    ev = _ev("meshtron", batch=64, model=model)
    plan = Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, dtype="bf16", ep=2)
    experts = model.layers * moe_cost.expert_params_local(model, 1, 2)
    dense = ev._stage_params(plan, model.layers, 0) - experts
    want = 3 * 4.0 * (dense / 8 + experts / 4) / ev.hbm
    assert ev.accumulation_s(plan, model.layers, 0, 2, ev.dp_flags(plan)) == pytest.approx(want)


def test_step_time_grows_with_micro_batches_by_the_accumulation_only():
    plan = Plan(tp=1, pp=1, dp=8, zero=0, micro_batch=1, dtype="bf16")
    few, many = _ev("meshtron", batch=64).evaluate(plan), _ev("meshtron", batch=128).evaluate(plan)
    ev = _ev("meshtron")
    acc = lambda m: ev.accumulation_s(plan, L8.layers, 0, m, ev.dp_flags(plan))  # noqa: E731
    assert many.time.compute - 2 * few.time.compute == pytest.approx(acc(16) - 2 * acc(8))


# ---- tensor-parallel collectives and the GEMMs that hide them -----------------------------------
COLLS = {"ag": 1.0, "ag_in": 1.0, "rs": 1.0, "ar": 2.0}


def _tp(gemm_s: float, tp: int = 8, **opts) -> tuple[float, float]:
    """tp_exposed with every GEMM group taking `gemm_s` (chunked GEMMs: same efficiency)."""
    gemms = dict.fromkeys(("qkv", "out", "up", "down"), gemm_s)
    return C.tp_exposed(COLLS, gemms, lambda g, rows=4096.0: gemm_s * rows / 4096.0, 4096.0,
                        tp, True, C.KernelOptions(**opts), 132)


def test_each_collective_hides_behind_its_own_gemm_only():
    plain = _tp(10.0)
    assert plain == (4.0, 4.0)  # AG + RS per pair of GEMMs, both passes, nothing hidden
    # TE userbuffers with GEMMs far longer than the collectives: the ring-exchange gathers
    # leave the interference, the pipelined scatters their last chunk and the SM margin
    ub_f, _ = _tp(10.0, tp_comm_overlap=True)
    margin = C.sm_margin(10.0, 132)
    ring = C.OVERLAP_INTERFERENCE * 1.0
    assert ub_f == pytest.approx(2 * (ring + 1.0 / C.TE_UB_PIPELINE_SPLITS + margin))
    # GEMMs much shorter than the collectives hide almost nothing
    tiny_f, _ = _tp(0.01, tp_comm_overlap=True)
    assert tiny_f > 0.9 * plain[0]
    assert C.sm_margin(1.0, 132, 16) == pytest.approx(16 / 116)


def test_async_tp_pays_for_its_chunked_gemms():
    """PyTorch's fused all-gather/matmul runs tp chunks of tokens/tp rows one after another;
    less efficient chunks cost time that TE's multi-stream ring exchange does not pay."""
    cl = resolve_cluster("dgx-h100:8")
    model = PRESETS["llama3-70b"]
    base = dict(stack="compiled")
    atp = _layer(C.KernelOptions(async_tp=True, **base), tp=8, sp=True, model=model, cluster=cl)
    ub = _layer(C.KernelOptions(tp_comm_overlap=True, **base), tp=8, sp=True, model=model,
                cluster=cl)
    off = _layer(C.KernelOptions(**base), tp=8, sp=True, model=model, cluster=cl)
    assert ub.tp_fwd < atp.tp_fwd < off.tp_fwd
    chunk = 4096 / 8
    n, k = model.hidden, model.hidden / 8  # the output projection
    assert (8 * C.cluster_gemm_time(chunk, n, k, cl)) > C.cluster_gemm_time(4096, n, k, cl)


def test_megatron_linear_regathers_the_sequence_parallel_input():
    """Megatron's column-parallel backward all-gathers the saved sequence shard again for the
    weight gradient (beside the input-gradient GEMM) and reduces the input gradient beside the
    weight-gradient GEMM; autograd's conjugate collectives run exposed."""
    conj = _tp(0.0)[1]
    meg = _tp(0.0, megatron_linear=True)[1]
    assert meg - conj == pytest.approx(2 * (1.0 + C.OVERLAP_INTERFERENCE * 0.0))  # 2 AG more
    hidden = _tp(10.0, megatron_linear=True)[1]
    assert hidden < conj  # long GEMMs hide the re-gather and the reduction


def test_fp8_gathers_the_cast_input_at_one_byte():
    cl = resolve_cluster("dgx-h100:8")
    opts = C.KernelOptions(fp8_filter="all", fp8_scaling="torchao-tensorwise")
    bf16 = _layer(opts, tp=8, sp=True, cluster=cl)
    fp8 = _layer(opts, tp=8, sp=True, dtype="fp8", cluster=cl)
    # forward: two gathers (now half the bytes) and two bf16 scatters; backward the same: the
    # row-parallel output gradients cast on the shard and gathered in FP8 (torchao v0.6.1
    # Float8RowwiseParallel), the input gradients reduce-scattered in bf16
    assert fp8.tp_fwd < bf16.tp_fwd and fp8.tp_bwd < bf16.tp_bwd
    assert fp8.tp_bwd == pytest.approx(fp8.tp_fwd)
    # torchao rowwise gathers bf16 and casts after (fp8.CastBytes.gathers_fp8; branch
    # rowwise, tests/test_planner_fp8_rowwise.py)
    rowwise = _layer(dataclasses.replace(opts, fp8_scaling="torchao-rowwise"), tp=8, sp=True,
                     dtype="fp8", cluster=cl)
    assert rowwise.tp_fwd == pytest.approx(bf16.tp_fwd)
    assert rowwise.tp_bwd == pytest.approx(bf16.tp_bwd)


def test_catalogue_knows_sm_counts():
    from meshtron.planner.cluster import GPU_CATALOGUE

    assert {g.sms for g in GPU_CATALOGUE.values()} >= {80, 108, 132}
    assert C.sm_count(resolve_cluster("dgx-h100:1")) == 132
    bare = dataclasses.replace(resolve_cluster("dgx-a100:1"), gpu=None)
    assert C.sm_count(bare) == C.DEFAULT_SMS


# ---- pipeline transfers ---------------------------------------------------------------------------
def test_pipeline_transfers_fill_chain_and_steady_state():
    from meshtron.planner.pipeline import p2p_time

    hop, p, v, m = 1.0, 8, 4, 32
    # without overlap every boundary crossing waits: m*v per direction, plus the fill chain
    # of the first micro-batch through all p*v virtual stages
    assert p2p_time(hop, p, v, m) == 2 * (m * v + p * v - 1)
    assert p2p_time(hop, p, 1, m) == 2 * (m + p - 1)
    assert p2p_time(hop, p, v, m, blocking=True) == 2 * p2p_time(hop, p, v, m)
    # Megatron-Core's overlap_p2p_comm hides the steady state, never the fill and drain
    over = p2p_time(hop, p, v, m, overlap=True)
    assert 2 * (p * v - 1) < over < p2p_time(hop, p, v, m)
    assert p2p_time(hop, 1, v, m) == 0.0


def test_deep_pipeline_pays_more_for_p2p_latency():
    """A deeper pipeline's fill chain crosses more boundaries: the same per-hop latency costs
    a pp=32 plan more than a pp=4 one, and its share of the step grows with the latency."""
    model = PRESETS["llama3-70b"].replace(layers=64)
    share = {}
    for lat in (5.0, 50.0):
        for pp in (4, 32):
            cl = dataclasses.replace(resolve_cluster(f"dgx-h100:{pp}"),
                                     inter_node_latency_us=lat)
            plan = Plan(tp=8, pp=pp, dp=1, zero=1, micro_batch=1, sp=True, dtype="bf16",
                        schedule="1f1b")
            est = Evaluator(model, cl, 64, 4096, preset("megatron@2024").kernel,
                            mem=preset("megatron@2024").memory).evaluate(plan)
            share[lat, pp] = est.time.pp_comm / est.step_time_s
    assert share[50.0, 32] > share[5.0, 32] and share[50.0, 32] > share[50.0, 4]


# ---- meshtron's chunked cross-entropy -------------------------------------------------------------
def test_fused_loss_accumulates_the_weight_gradient_per_chunk_and_replays_nothing():
    """meshtron/model/loss.py computes every gradient in the loss's forward over
    ceil(vocab/hidden) chunks: each chunk's weight-gradient GEMM reads and writes the fp32
    [vocab, hidden] accumulator (8 bytes per element per chunk), and every chunk's GEMMs read
    the whole head weight again; the backward replays no head GEMM. The extra is at least the
    accumulator's traffic less head_cost's three whole GEMMs, and at most that traffic plus
    the chunks' forward and input-gradient GEMMs (no replayed third) and a few passes over
    the accumulator (the backward's scale and cast)."""
    cl = resolve_cluster("dgx-h100:1")
    parts = dict(C.chunked_loss_parts(L8, cl, 1, 4096))
    extra = C.chunked_loss_extra(L8, cl, 1, 4096)
    assert extra == pytest.approx(parts["gemm"] + parts["elementwise"])
    chunks = -(-L8.vocab // L8.hidden)  # 32: 4096 tokens in chunks of 128
    acc = chunks * 8.0 * L8.vocab * L8.hidden / cl.hbm_bytes_per_s
    whole = C.cluster_gemm_time(4096, L8.vocab, L8.hidden, cl)
    chunked = chunks * C.cluster_gemm_time(4096 // chunks, L8.vocab, L8.hidden, cl)
    passes = 3 * 8.0 * L8.vocab * L8.hidden / cl.hbm_bytes_per_s
    assert acc - 3 * whole < extra < acc + 2 * chunked + passes
    # fp32 plans: no casts, but the same accumulator traffic
    assert C.chunked_loss_extra(L8, cl, 1, 4096, dtype="fp32") > acc
    # the plan pays it only where the runtime chunks: meshtron's loss, tp = 1, a pipeline's
    # last stage too (parallel/parallel_model.py `_stage_computes_loss`)
    plan = Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, dtype="bf16")
    ev = _ev("meshtron")
    head = ev._micro(1, 1, False, "none")[5]
    assert ev.head_for(plan, head).compute == pytest.approx(head.compute + extra)
    piped = plan.replace(pp=2, dp=4, zero=1)
    assert ev.head_for(piped, head).compute == pytest.approx(head.compute + extra)
    assert ev.head_for(plan.replace(tp=2, dp=4, sp=True), head) is head
    tt = _ev("torchtitan")  # torch's loss on whole fp32 logits
    assert tt.head_for(plan, head) is head


def test_fused_loss_makes_its_gradients_in_the_forward_pass():
    """The pipelined last stage's passes as meshtron/model/loss.py runs them: the loss's
    forward runs the head GEMM, the input- and weight-gradient GEMMs and the loss over every
    chunk; its backward only scales the gradients and casts the accumulator (zero bubble's
    weight pass of the loss then returns them: no work). head_cost prices an unfused loss's
    passes (two GEMMs and a loss pass in backward, one GEMM the weight gradient): with the
    chunked loss the forward holds all three GEMMs, the weight pass none, and the backward
    what is left is at most the scaling, the final norm's backward and the head's input
    traffic."""
    cl = resolve_cluster("dgx-h100:1")
    ev = _ev("meshtron")
    head = ev._micro(1, 1, False, "none")[5]
    piped = Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=1, dtype="bf16", schedule="zb")
    chunked = ev.head_for(piped, head)
    whole = C.cluster_gemm_time(4096, L8.vocab, L8.hidden, cl)
    assert chunked.wgrad == 0.0 < head.wgrad
    assert chunked.fwd > head.fwd + 2 * whole
    backward = chunked.compute + chunked.tp - chunked.fwd
    accumulator = 8.0 * L8.vocab * L8.hidden / cl.hbm_bytes_per_s  # its scaling: read, write
    assert 0.0 < backward < 2 * accumulator + (head.compute + head.tp - head.fwd) - 2 * whole


def test_meshtron_zero_0_and_1_pay_fsdp2_passes_once_a_step():
    """meshtron's ZeRO-1 is FSDP2 over the data axis and its ZeRO-0 FSDP2's replicate path
    with shards of one rank (parallel/data_parallel.py): once a step each unit is gathered
    (shard cast, copy-in, copy-out) and its accumulated gradient copied into the reduction.
    torchtitan's zero 0 is DDP, Megatron's buffers are its own: none of it."""
    ev = _ev("meshtron")
    p = 8e9
    one = ev.fsdp2_step_passes_s(p, 1, 8, 4, 1, 4.0, 2.0)
    assert one == pytest.approx(ev.copy_out_s(p, 2.0) + ev.gather_prep_s(p, 2.0, 8)
                                + ev.grad_prep_s(p, 4.0, 2.0, 8, accumulated=True))
    assert one == pytest.approx((4.0 + 10.0 / 8 + 8.0) * p / ev.hbm)
    # zero 0: the whole parameter cast and copied in, the gradient copied in and out
    assert ev.fsdp2_step_passes_s(p, 0, 8, 4, 1, 4.0, 2.0) == pytest.approx(
        (4.0 + 10.0 + 16.0) * p / ev.hbm)
    assert ev.fsdp2_step_passes_s(p, 2, 8, 4, 1, 4.0, 2.0) == 0.0  # priced per unit
    assert _ev("torchtitan").fsdp2_step_passes_s(p, 0, 8, 4, 1, 4.0, 2.0) == 0.0
    assert _ev("megatron@2024").fsdp2_step_passes_s(p, 1, 8, 4, 1, 4.0, 2.0) == 0.0


def test_fsdp2_copies_gathered_units_out_on_the_compute_stream():
    """FSDP2 copies each gathered unit out of the all-gather buffer on the compute stream
    (foreach_all_gather_copy_out): read and write of every gathered byte, which no prefetch
    hides; DeepSpeed and Megatron gather in place."""
    fsdp = _ev("meshtron")
    zero = Evaluator(L8, resolve_cluster("dgx-h100:8"), 64, 4096,
                     dataclasses.replace(preset("meshtron").kernel, sharding="zero"))
    assert fsdp.copy_out_s(1e9, 2.0) == pytest.approx(4e9 / fsdp.hbm)
    assert zero.copy_out_s(1e9, 2.0) == 0.0
    # with an infinitely fast network the per-micro-batch ZeRO-3 cost is the copies: the
    # forward's whole unit set and the backward's re-gather of all but the kept last unit
    fast = dataclasses.replace(resolve_cluster("dgx-h100:8"), intra_node_gb_per_s=1e9,
                               intra_node_latency_us=0.0, collective_base_latency_us=0.0)
    ev = Evaluator(L8, fast, 64, 4096, preset("meshtron").kernel)
    groups = ev._groups(Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, dtype="bf16"))
    got = ev._zero3_per_microbatch(8e9, groups, 32, 1.0, 2.0, units=34, kept=5e8,
                                   wsize=2.0, wire=4.0)
    # and, FSDP2's own passes (dp_cost.gather_prep_s, grad_prep_s), every gather's shard cast
    # and copied in, every reduction's gradients copied into the reduce-scatter input
    expect = (ev.copy_out_s(8e9, 2.0) + ev.copy_out_s(8e9 - 5e8, 2.0)
              + ev.gather_prep_s(8e9 + 8e9 - 5e8, 2.0, 8) + ev.grad_prep_s(8e9, 4.0, 2.0, 8))
    assert ev.gather_prep_s(8e9, 2.0, 8) > 0 and ev.grad_prep_s(8e9, 4.0, 2.0, 8) > 0
    assert expect <= got < expect * 1.01
