"""Memory under torch's zero-bubble schedules (planner/memory_zb.py): what torch's split
backward keeps between B and W, measured on meshtron's own blocks, and the walk of torch's
per-rank lists against the planner's in-flight count."""

from __future__ import annotations

import gc
import weakref
from functools import lru_cache

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import memory_zb, pipeline
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan

torch = pytest.importorskip("torch")
from torch.distributed.pipelining._backward import (  # noqa: E402
    stage_backward_input, stage_backward_weight)


def _saved_run(spec_name: str):
    """Two of meshtron's blocks as a middle stage: forward with every saved tensor recorded,
    then torch's input backward; (saved bytes, alive after B, captured gradient bytes,
    alive after W, tokens)."""
    from meshtron.model.transformer import Transformer

    spec = PRESETS[spec_name]
    model = Transformer(spec, init_seed=0)
    blocks = [model.layers["0"], model.layers["1"]]
    params = [p for b in blocks for p in b.parameters()]
    seq = 16
    saved = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.dim():
            saved.append((weakref.ref(t), t.numel() * t.element_size()))
        return t

    def alive():
        gc.collect()
        return sum(n for r, n in saved if r() is not None)

    x = torch.randn(1, seq, spec.hidden, requires_grad=True)
    rope = model.rope_for(seq)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x
        for b in blocks:
            y = b(y, rope)
    total = alive()
    _, groups = stage_backward_input([y], [torch.randn_like(y)], [x], iter(params))
    del y
    after_b = alive()
    captured = sum(g.numel() * g.element_size() for grp in groups for gs in grp["grads"]
                   for g in gs if g is not None)
    stage_backward_weight(iter(params), groups)
    return spec, total, after_b, captured, seq


@pytest.mark.parametrize("name", ["debug", "tiny"])
def test_split_backward_keeps_every_saved_tensor_and_the_gemm_output_gradients(name):
    spec, total, after_b, captured, seq = _saved_run(name)
    assert total > 0
    assert after_b == total  # retain_graph=True: all of the forward's saved tensors
    # what the planner charges for the B..W window: each weight GEMM's and norm's output
    # gradient, per block (fp32 here: 4 bytes)
    assert captured == pytest.approx(
        2 * memory_zb.captured_grad_bytes(spec, 1, False, seq, 4.0), rel=1e-12)


def _torch_held(cls, p: int, v: int, m: int) -> list[int]:
    """Most chunk-micro-batches each rank holds between F and W in torch's own lists."""
    from tests.test_pipeline_zb import _torch_orders

    out = []
    for order in _torch_orders(cls, p, v, m):
        now = best = 0
        for kind, _, _ in order:
            now += {"F": 1, "B": 0, "W": -1}[kind]
            best = max(best, now)
        out.append(best)
    return out


@pytest.mark.parametrize("p,v,m", [(2, 1, 4), (4, 1, 8), (4, 1, 3), (4, 2, 8), (4, 2, 16),
                                   (3, 2, 2), (4, 3, 8), (8, 1, 32)])
def test_walk_counts_torch_lists(p, v, m):
    S = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = S.ScheduleZBVZeroBubble if v == 2 else S.ScheduleInterleavedZeroBubble
    want = _torch_held(cls, p, v, m)
    layers = (1,) * (p * v)
    mult, other = memory_zb.in_flight(p, v, m, layers, 1.0, 0.0, 0.0, 0.0)
    assert [k * v for k in mult] == pytest.approx(want)
    assert other == [0.0] * p
    if m >= p:  # every rank p micro-batches: 1F1B's p - i undercounts all but the first
        assert mult == pytest.approx([float(p)] * p)
        assert all(pipeline.in_flight("1f1b", p, v, m, i) < p for i in range(1, p))


def test_planner_charges_the_walk_for_a_zb_plan():
    """A zb plan's rank holds what the walk of torch's order says (1F1B's p - i before)."""
    from meshtron.planner import memory_pipeline

    ev = Evaluator(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:4"), 64, 4096)
    base = dict(tp=2, pp=4, dp=4, zero=1, micro_batch=1, recompute="none", sp=True,
                dtype="bf16")
    zb = ev.evaluate(Plan(**base, schedule="zb"), stage=2)
    one = ev.evaluate(Plan(**base, schedule="1f1b"), stage=2)
    act, block_work = ev._memory_pieces(2, 1, True, "none", "bf16", 1, 1, 4)[1:3]
    grad = memory_zb.captured_grad_bytes(ev.model, 2, True, 4096, 2.0)
    out = memory_pipeline.stage_output_bytes(ev.model.hidden, 2, True, 1, 4096, 2.0)
    head = memory_zb.head_grad_bytes(ev.model, 2, 4096, 2.0)
    from meshtron.planner.memory_states import layer_params_local

    # the W's bf16 gradients wait for the next B (FSDP2 folds them into its fp32 accumulator)
    pending = 2.0 * layer_params_local(ev.model, 2, 1)
    work = memory_zb.input_backward_bytes(ev.model, 2, True, 4096, 2.0)
    # meshtron's runtime folds them at W's end, so no B holds them, nor the gradient unit
    # and the whole backward's working set the stage memory counts (rank 2: a block's)
    idle = [(pending, block_work)] * 4
    mults, other = memory_zb.in_flight(4, 1, zb.num_microbatches, tuple(zb.stage_layers), act,
                                       grad, out, head, 0.0, pending, work, folds=True,
                                       idle=idle)
    mult, n = mults[2], zb.stage_layers[2]
    assert mult > 4.0  # p micro-batches from F to W, and the captured gradients beside them
    # the breakdown's in-flight term: the micro-batches beyond the running one, and the
    # outputs and received gradients kept (1F1B's rank 2: p - 2 = 2, one beyond)
    # and torch's receive buffers, one per micro-batch for the input and the output gradient
    # (memory_pipeline.receive_buffers), less those in flight (the fused norm saves its input)
    # by the even split's walk, the count the planner takes them from
    even = memory_zb.in_flight(4, 1, zb.num_microbatches, (ev.model.layers / 4,) * 4, act,
                               grad, out, head, 0.0, pending, work, folds=True, idle=idle)[0]
    recv = memory_pipeline.receive_buffers(4, 1, zb.num_microbatches, "zb", even, True,
                                           [0.0] * 4)[2]
    assert recv > 2 * zb.num_microbatches - 8  # 32 buffers, about 6 of them in flight
    assert zb.memory.in_flight * 2**30 == pytest.approx(
        n * act * (mult - 1.0) + other[2] + recv * out, rel=1e-9)
    # (1F1B: its outputs, and at most 2 m receive buffers)
    assert one.memory.in_flight * 2**30 < (n * act * 1.01 + 3 * out
                                           + 2 * one.num_microbatches * out)
    assert zb.memory.total > one.memory.total


def test_v_places_a_ranks_chunks_at_stages_r_and_2p_minus_1_minus_r():
    """The saved plan's stage_layers under torch's V (one placement: pipeline.stages_of_rank):
    rank 0 holds the first and the last stage (the head), rank 1 the middle two."""
    assert pipeline.split_virtual([3, 5], 2, "zb") == [2, 3, 2, 1]
    assert pipeline.split_virtual([3, 5], 2, "interleaved") == [2, 3, 1, 2]
    assert pipeline.head_rank(2, 2, "zb") == 0
    assert pipeline.head_rank(2, 2, "interleaved") == 1
    assert pipeline.head_rank(4, 1, "zb") == 3


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_moments_of_more_microbatches_are_those_of_4p(p):
    """memory_zb.held walks 4p micro-batches for ZB1P and the V however many the step has:
    the steady state repeats (a test, not an assumption)."""
    from meshtron.planner.memory_zb import _moments

    for v in (1, 2):
        for m in (4 * p + 1, 5 * p + 2, 8 * p, 8 * p + 3):
            assert all(_moments(p, v, m, r) == _moments(p, v, 4 * p, r) for r in range(p))


def _input_backward_peak(ffn: int, tokens: int = 64):
    """Two meshtron blocks in bf16 on the CPU (composite RMSNorm) as a middle stage: torch's
    input backward under torch's memory tracker; (spec, bytes above B's end at its peak,
    captured gradient bytes)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    from meshtron.model.spec import ModelSpec
    from meshtron.model.transformer import Transformer

    spec = ModelSpec(name="b", layers=2, hidden=256, heads=4, kv_heads=1, ffn_hidden=ffn,
                     vocab=512, max_seq=tokens)
    with torch.device("meta"):
        model = Transformer(spec)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    blocks = [model.layers["0"], model.layers["1"]]
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(1, tokens, spec.hidden, dtype=torch.bfloat16, requires_grad=True,
                    generator=torch.Generator().manual_seed(1))
    y = x
    for b in blocks:
        y = b(y, model.rope_for(tokens))
    tracker = MemTracker()
    with tracker:
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter(params))
        gc.collect()

    def total(kind):
        return sum(d[_TOTAL_KEY] for d in tracker.get_tracker_snapshot(kind).values())

    captured = sum(g.numel() * g.element_size() for grp in groups for gs in grp["grads"]
                   for g in gs if g is not None)
    return spec, total("peak") - total("current"), captured


@pytest.mark.parametrize("ffn", [256, 704])
def test_input_backward_working_set_is_the_composite_norms(ffn):
    """B frees nothing (retain_graph), so its temporaries add to what it holds: at its last
    op, the first norm's backward, five fp32 [tokens, hidden] tensors less the input gradient
    they become (memory_zb.input_backward_bytes), exactly, whatever the MLP's width; and the
    norms' captured gradients are fp32 there (the composite norm's weight product)."""
    spec, above, captured = _input_backward_peak(ffn)
    assert above == memory_zb.input_backward_bytes(spec, 1, False, 64, 2.0, fused_norm=False)
    assert above == 64 * spec.hidden * 18  # the norm's, not the MLP's
    assert captured == 2 * memory_zb.captured_grad_bytes(spec, 1, False, 64, 2.0,
                                                         fused_norm=False)
    assert captured > 2 * memory_zb.captured_grad_bytes(spec, 1, False, 64, 2.0)


def test_input_backward_working_set_of_a_wide_mlp_is_bounded():
    """At ffn = 8 hidden the SwiGLU's two [tokens, ffn] gradients are the larger candidate:
    an upper bound of what B holds above its end (measured below it, never above)."""
    spec, above, _ = _input_backward_peak(2048)
    bound = memory_zb.input_backward_bytes(spec, 1, False, 64, 2.0, fused_norm=False)
    assert bound > 64 * spec.hidden * 18  # the MLP's candidate, not the norm's
    assert above <= bound


def test_w_gradients_wait_for_the_next_b():
    """The walk's pending weight gradients (set by a stage's W, folded by its next B): the
    V's middle rank runs W1,0 then B2,1 W2,1 before stage 1's next B, so both its stages hold
    theirs at once; a ZB1P first stage never does (its W is a whole backward)."""
    one = (1,) * 4
    assert memory_zb.held(2, 2, 4, 1, one, 0.0, 0.0, 0.0, 0.0, pending=1.0) == (2.0, 0.0)
    assert memory_zb.held(2, 1, 4, 0, (1, 1), 0.0, 0.0, 0.0, 0.0, pending=1.0) == (0.0, 0.0)
    assert memory_zb.held(2, 1, 4, 1, (1, 1), 0.0, 0.0, 0.0, 0.0, pending=1.0) == (1.0, 0.0)
    # B's working set: only where a B runs (not the first stage's)
    assert memory_zb.held(2, 1, 4, 0, (1, 1), 0.0, 0.0, 0.0, 0.0, work=1.0) == (0.0, 0.0)
    assert memory_zb.held(2, 1, 4, 1, (1, 1), 0.0, 0.0, 0.0, 0.0, work=1.0) == (0.0, 1.0)



def test_folded_w_gradients_live_only_to_ws_end():
    """A stack that folds W's gradients into FSDP2's accumulator at W's end (meshtron's
    runtime, MemoryOptions.fold_after_weight_pass) holds one stage's at a time, at that W's
    end: the V's middle rank no longer holds both stages' at once, nor one stage's beside the
    other stage's B (its working set). A ZB1P stage holds them at its W's end either way (its
    own next B folds them before it can peak)."""
    one = (1,) * 4
    assert memory_zb.held(2, 2, 4, 1, one, 0.0, 0.0, 0.0, 0.0, pending=1.0,
                          folds=True) == (1.0, 0.0)
    assert memory_zb.held(2, 2, 4, 1, one, 0.0, 0.0, 0.0, 0.0, pending=1.0,
                          work=2.0) == (1.0, 2.0)
    assert memory_zb.held(2, 2, 4, 1, one, 0.0, 0.0, 0.0, 0.0, pending=1.0,
                          work=2.0, folds=True) == (0.0, 2.0)
    for folds in (False, True):
        assert memory_zb.held(2, 1, 4, 1, (1, 1), 0.0, 0.0, 0.0, 0.0, pending=1.0,
                              folds=folds) == (1.0, 0.0)


@lru_cache(maxsize=2)  # two tests read the same two runs
def _live_through_w(mode: str) -> dict[str, float]:
    """Two of meshtron's 'debug' blocks as a middle stage under recompute `mode`: bytes of the
    live storages every op made (a dispatch mode holding weak references), after F, after B
    and after each of W's parameter groups (one `autograd.grad` each, _backward.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtron.model.transformer import Transformer
    from meshtron.parallel.recompute import apply_recompute

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made: dict[int, tuple] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    known = self.made.get(st.data_ptr())
                    if known is None or known[0]() is None:
                        self.made[st.data_ptr()] = (weakref.ref(st), st.nbytes())
            if self.watch:  # after every op: what W holds at its peak (no cycles to collect)
                self.peak = max(self.peak, sum(n for r, n in self.made.values()
                                               if r() is not None))
            return out

        watch, peak = False, 0.0

        def bytes(self) -> float:
            gc.collect()
            return float(sum(n for r, n in self.made.values() if r() is not None))

    spec = PRESETS["debug"]
    model = Transformer(spec, init_seed=0)
    if mode != "none":
        apply_recompute(model, mode)
    blocks = [model.layers["0"], model.layers["1"]]
    params = [p for b in blocks for p in b.parameters()]
    seq = 64
    x = torch.randn(1, seq, spec.hidden, requires_grad=True,
                    generator=torch.Generator().manual_seed(0))
    rope = model.rope_for(seq)
    live = Live()
    grad, after_groups = torch.autograd.grad, []

    def counted_grad(*args, **kwargs):
        out = grad(*args, **kwargs)
        after_groups.append(live.bytes())
        return out

    with live:
        y = x
        for b in blocks:
            y = b(y, rope)
        after_f = live.bytes()
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter(params))
        del y
        after_b = live.bytes()
        torch.autograd.grad = counted_grad  # W's own calls, counted one by one
        live.watch = True
        try:
            stage_backward_weight(iter(params), groups)
        finally:
            torch.autograd.grad = grad
            live.watch = False
    return {"f": after_f, "b": after_b, "w": max(after_groups), "groups": len(after_groups),
            "w_peak": live.peak, "layer_params": sum(p.numel() for p in params) / 2}


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_full_recompute_w_keeps_each_groups_recomputation_until_w_ends():
    """Why zero bubble + full recomputation holds more than no recomputation (fitsweep's 8B
    zb row, 2026-12-05): torch's non-reentrant checkpoint keeps a graph task's recomputed
    tensors (torch/utils/checkpoint.py, `frame.recomputed[gid]`, keyed by a handle each saved
    tensor's holder drops only when that task unpacks it) as long as the holders live, i.e.
    as long as the graph. B unpacks all of them (its recomputation leaves nothing: B adds
    the same bytes with and without recomputation), but each W group (its own
    `autograd.grad`, its own task id) recomputes the whole block and unpacks only its one
    op's saved tensors (W runs with retain_graph=False, so the nodes it ran release their
    holders in every task): what the nodes W never runs saved (rope'd q and k, v, the
    attention output, the residual, w1's and w3's outputs, the SiLU output) stays, once per
    group, until W's graph dies. Measured here: W's live bytes climb by about 0.7 of a
    block's recomputable tensors per group (5.9 stages' worth of them over 18 groups), which
    memory_zb.weight_recompute_kept_bytes prices (docs/measurements.md #zb-full-recompute)."""
    none, full = _live_through_w("none"), _live_through_w("full")
    assert none["groups"] == full["groups"] == 18  # 9 per block, two blocks
    recomputable = none["f"] - full["f"]  # what the two blocks save beyond their inputs
    assert recomputable > 0
    assert full["b"] - full["f"] == pytest.approx(none["b"] - none["f"], rel=1e-9)
    grown_full, grown_none = full["w"] - full["b"], none["w"] - none["b"]
    assert grown_full - grown_none > 4 * recomputable  # measured 5.9
    # the planner's copies (18 groups, fp32, fused-norm count: the upcast is the input here)
    spec = PRESETS["debug"]
    priced = 2 * memory_zb.weight_recompute_kept_bytes(spec, 1, False, 64, 4.0)
    assert grown_full == pytest.approx(priced, rel=0.05)  # measured 224 vs 220.5 units


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_full_recompute_w_peaks_in_the_last_blocks_recomputation():
    """Where W's live bytes peak under full recomputation (zb_recompute.WeightPass, traced
    on the 'mid' model's V, docs/measurements.md #zbv-full-recompute): inside a group of the
    stage's last block, while it recomputes the block, beside the earlier groups' copies
    (the last block's still holding the tensors only its later groups' ops saved: w2's
    input, the MLP norm's output), less the captured gradients W has freed, plus the weight
    gradients it has made. Its end (every copy, no recomputation running) is lower: pricing
    every group's copy there and the recomputation on top counted one copy and the captured
    gradients too many (+7.0% on the V's rank 1, test_rehearse.py; here, at 64 tokens of
    a 64-wide block, the weight gradients W makes about offset that). Measured: 240.7
    [tokens, hidden] fp32 units above B's end, priced 220.1 + 19.1 recomputed."""
    none, full = _live_through_w("none"), _live_through_w("full")
    spec = PRESETS["debug"]
    recomputation = (none["f"] - full["f"]) / 2  # one block's saved tensors, recomputed
    # fp32 on the CPU: the composite norm; the weight gradients are new storages here
    priced = memory_zb.weight_pass(spec, 1, False, 64, 4.0, False, 1,
                                   4.0 * full["layer_params"]).peak(2)
    grown = full["w_peak"] - full["b"]
    assert grown == pytest.approx(priced + recomputation, rel=0.05)
    assert full["w_peak"] - full["w"] > 0.5 * recomputation  # inside a group, not after


def test_weight_pass_peak_grows_by_a_finished_block():
    """zb_recompute.WeightPass on the 'mid' block (bf16, 4096 tokens, CPU norms): a stage one
    checkpointed block longer peaks one finished block higher (its groups' copies, less its
    captured gradients, plus its weight gradients); under `half` a stage of one block has no
    checkpointed block (meshtron wraps blocks 1, 3, ...): no W peak, and a stored block before
    the checkpointed one frees what only W's nodes saved."""
    from meshtron.model.spec import ModelSpec

    mid = ModelSpec(name="mid", layers=6, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
                    vocab=32000, max_seq=4096)
    full = memory_zb.weight_pass(mid, 1, False, 4096, 2.0, False, 1, 1e8)
    captured = memory_zb.captured_grad_bytes(mid, 1, False, 4096, 2.0, False)
    copies = memory_zb.weight_recompute_kept_bytes(mid, 1, False, 4096, 2.0, False)
    block = copies - captured + 1e8
    assert full.peak(3) - full.peak(2) == pytest.approx(block)
    assert full.peak(2.5) == pytest.approx((full.peak(2) + full.peak(3)) / 2)
    # the traced V rank 1 (docs/measurements.md #zbv-full-recompute): 4.262 GiB measured
    # above W's start with 0.383 of recomputation; the walk's `pending` there: 0.084 GiB
    traced = memory_zb.weight_pass(mid, 1, False, 4096, 2.0, False, 1, 0.08399 * 2**30)
    assert traced.peak(2) / 2**30 == pytest.approx(4.262 - 0.383, abs=0.03)
    half = memory_zb.weight_pass(mid, 1, False, 4096, 2.0, False, 2, 1e8)
    assert half.peak(1) == 0.0
    freed = sum(g.last_holder for g in half.groups)
    assert half.peak(2) - half.peak(3) == pytest.approx(0.0)  # block 2 stored, after the peak
    assert half.peak(2) == pytest.approx(full.peak(1) - captured + 1e8 - freed)


@pytest.mark.parametrize("p", [2, 4])
def test_last_stage_keeps_each_chunked_loss_to_its_weight_pass(p):
    """meshtron's chunked loss keeps its accumulator, input gradient and the final norm's saved
    tensors from a micro-batch's F to its W (`saved`): at the last rank's peak the walk holds p
    of them (torch's zero bubble delays the last stage's W; rehearsed, Llama 3 8B pp 2 / 4: the
    planner +0.7% / +0.4%), whatever the micro-batch count, and nothing else moves."""
    args = (p, 1, 0, p - 1, tuple([4] * p), 1.0, 0.5, 0.3, 0.2, 0.0, 0.0, 0.1, None, 0.0)
    for m in (p, 2 * p, 4 * p):
        at = (*args[:2], m, *args[3:])
        without, with_saved = memory_zb.held(*at, 0.0), memory_zb.held(*at, 100.0)
        assert with_saved[0] == without[0]
        assert with_saved[1] - without[1] == pytest.approx(p * 100.0)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb1p_moments_of_more_rounds_are_those_of_5p(p):
    """ZB1P with v >= 3 runs rounds of p micro-batches once m is a multiple of p: memory_zb.held
    walks 5p of them however many the step has (the steady state repeats: a test, not an
    assumption)."""
    from meshtron.planner.memory_zb import _moments, _walked

    for v in (3, 4, 6):
        for m in (6 * p, 9 * p, 16 * p):
            assert _walked(p, v, m) == 5 * p
            for folds in (False, True):
                assert all(_moments(p, v, m, r, folds) == _moments(p, v, 5 * p, r, folds)
                           for r in range(p)), (p, v, m, folds)
