"""GPipe's memory (planner/memory_gpipe.py, estimate_gpipe.py): every forward before any
backward, so FSDP2's accumulated gradients do not exist at the fullest moment, and the last
stage keeps every micro-batch's loss tensors. Checked against a walk of the schedule made here
block by block, and against the breakdown of each moment priced directly (gradients left out,
not converted into an in-flight multiplier as the code under test does). The rehearsal rows
are tests/test_rehearse.py's GPIPE_STAGES (fast) and GPIPE_SLOW."""

from __future__ import annotations

import itertools

import pytest

from meshtron.model.spec import ModelSpec
from meshtron.planner import memory, memory_gpipe
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan

MID = ModelSpec(name="mid", layers=10, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
                vocab=32000, max_seq=4096)


def _walk(m: int, k: int, act: float, grad: float) -> float:
    """Most bytes of stored activations and accumulated gradients a GPipe stage of k blocks
    holds at the start of a block's backward: all m forwards, then backwards 0 .. m - 1, each
    from block k - 1 down, freeing its activations; a block's gradient accumulator appears at
    its first backward's end (FSDP2's post-backward)."""
    now = m * k * act
    best = now
    for mb in range(m):
        for _ in range(k):
            best = max(best, now)
            now += grad if mb == 0 else 0.0
            now -= act
    return best


def test_moments_cover_every_moment_of_the_walk():
    """The largest held of gpipe_moments (a stage with neither the loss nor the embedding) is
    the walk's most, over regimes where the activations outweigh the gradients and the
    reverse; no moment holds all m micro-batches beside the gradients."""
    for m, k, act, grad in itertools.product((1, 2, 4, 7), (1, 3, 6), (1.0, 5.0),
                                             (0.5, 3.0, 9.0)):
        moments = memory_gpipe.gpipe_moments(m, k, k * act, k * grad, 0.0, 0.0, False, False)
        assert max(h for h, _ in moments) == pytest.approx(_walk(m, k, act, grad)), \
            (m, k, act, grad)
        assert all(h < m * k * act + k * grad for h, _ in moments)


def test_last_stage_holds_the_other_micro_batches_loss_tensors():
    """At the first backward's loss the other m - 1 micro-batches keep their loss tensors and
    no gradient exists; at its first block the head's has been made."""
    got = dict((moment, held) for held, moment in memory_gpipe.gpipe_moments(
        4, 5, 10.0, 7.0, 2.0, 3.0, True, False))
    assert got == {"loss": 40.0 + 3 * 3.0, "block": 40.0 + 3 * 3.0 + 2.0,
                   None: 30.0 + 7.0 + 2.0 + 2 * 3.0}


def _evaluator(seq: int, batch: int = 32) -> Evaluator:
    return Evaluator(MID, preset_cluster("dgx-h100", 1), batch, seq)


PLAN = Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute="none", schedule="gpipe",
            dtype="bf16")


def _moment(ev: Evaluator, rank: int, in_flight: float, with_grads: bool, outputs: float,
            moment: str | None) -> float:
    """Pipeline rank `rank`'s tensors (GiB) at a moment holding `in_flight` micro-batches
    and, `with_grads`, every accumulated gradient; priced by memory.breakdown directly."""
    w = ev._inputs(PLAN)
    ev._states(w)
    ev._memory_model(w)
    ev._split(w, True, False)
    accum = w.accum if with_grads else 0.0
    return memory.breakdown(
        w.mem_opts, w.zero, w.shard_dp, w.states, w.n[rank], w.p_layer, w.roots[rank],
        w.largest, w.act, in_flight, w.work, w.logits if rank == w.head_rank else 0.0,
        ev.capacity, rank, ev.grad_bytes, w.keep, accum, w.p_exp, w.e_states,
        w.root_units[rank], w.reduce_bytes, 0.0, outputs, 0.0, accum, moment,
        buffers=w.buffers).allocated


@pytest.mark.parametrize("seq,peak", [(2048, "first backward"), (64, "second backward")])
def test_first_stage_is_its_fullest_moment(seq, peak):
    """The first stage priced at the larger of (A) all m micro-batches with no gradient and
    (B) m - 1 beside every gradient (one stage output fewer in torch's cache), each priced
    here with memory.breakdown. Long sequences peak at A, short ones (a block's fp32
    gradient above its activations) at B; both below the linear model (all of each)."""
    ev = _evaluator(seq)
    est = ev.evaluate(PLAN, stage=0)
    w = ev._inputs(PLAN)
    ev._states(w)
    ev._memory_model(w)
    m, out = w.m, w.outputs[0]
    first = _moment(ev, 0, m, False, out, "block")
    second = _moment(ev, 0, m - 1, True, out - w.out_bytes, None)
    linear = _moment(ev, 0, m, True, out, None)
    assert est.memory.allocated == pytest.approx(max(first, second), rel=1e-9)
    assert (first > second) == (peak == "first backward")
    assert est.memory.allocated < linear


def test_last_stage_grows_by_each_micro_batch_loss_tensors():
    """Doubling the micro-batches (4 -> 8) adds to the last stage, at its first backward's
    loss, each new micro-batch's activations and loss tensors (meshtron's chunked loss, the
    last stage returning it: its fp32 [vocab, hidden] weight-gradient accumulator and bf16
    [tokens, hidden] input gradient, the final norm's saved input, no logits) and its receive
    buffer, nothing else."""
    small, large = (_evaluator(2048, b).evaluate(PLAN, stage=1).memory for b in (32, 64))
    ev = _evaluator(2048)
    w = ev._inputs(PLAN)
    ev._states(w)
    ev._memory_model(w)
    ev._split(w, True, False)
    k = w.n[1]  # the time-balanced split: the head's stage holds fewer blocks
    # the fp32 accumulator, the bf16 input gradient and the final (fused) norm's saved input
    saved = 4.0 * MID.vocab * MID.hidden + 2 * (2.0 * 2 * 2048 * MID.hidden)
    assert memory_gpipe.loss_saved_bytes(MID, 1, 2, 2048, w.mem_opts) == saved
    per_mb = k * w.act + saved
    grew = (large.allocated - small.allocated) * memory.GIB
    assert 4 * per_mb * (1 - 1e-12) <= grew <= 4 * (per_mb + w.out_bytes) + 1.0


def test_a_1f1b_rank_warming_up_every_micro_batch_is_priced_as_gpipe():
    """Schedule1F1B runs min(m, p - s) forwards before rank s's first backward: with m <= p - s
    every forward comes first, GPipe's order, so the rank holds what GPipe's does (the same
    moments, the same kept outputs); ranks with m > p - s keep the steady 1F1B figure, which
    holds every gradient beside its p - s micro-batches. Rehearsed, 'mid' pp 4, m 4, stage 0:
    +12.3% -> +0.2% (tests/test_rehearse.py GPIPE_SLOW)."""
    plan = PLAN.replace(pp=4, dp=2)
    ev = _evaluator(2048, 16)  # m = 4 micro-batches (dp 2, micro-batch 2) on 4 stages
    one = [ev.evaluate(plan.replace(schedule="1f1b"), stage=r) for r in range(4)]
    gp = [ev.evaluate(plan, stage=r) for r in range(4)]
    assert one[0].stage_layers == gp[0].stage_layers
    assert one[0].memory.allocated == pytest.approx(gp[0].memory.allocated, rel=1e-12)
    # rank 1 warms up 3 < 4: priced with 3 micro-batches beside every gradient, as before
    w = ev._inputs(plan.replace(schedule="1f1b"))
    ev._states(w)
    ev._memory_model(w)
    ev._split(w, True, False)
    assert w.inflight[1] == 3.0 and w.moments[1] is None
    assert w.inflight[0] < 4.0  # rank 0: gradients not made yet taken off its 4


def test_an_odd_half_stage_replays_after_its_stored_last_block():
    """Under `half` an odd stage's first backward starts on its stored last block: once that
    block's tensors are freed and its gradient made, the checkpointed block below is
    replayed beside the rest of all m micro-batches ("replay", priced with the replayed
    block's working set). Only with a stored last block and more than one block."""
    base = memory_gpipe.gpipe_moments(4, 5, 10.0, 7.0, 2.0, 0.0, False, False)
    got = memory_gpipe.gpipe_moments(4, 5, 10.0, 7.0, 2.0, 0.0, False, False, 1.5)
    assert got == base[:1] + [(40.0 - 1.5 + 7.0 / 5, "replay")] + base[1:]
    assert memory_gpipe.gpipe_moments(4, 1, 10.0, 7.0, 2.0, 0.0, False, False, 1.5) == \
        memory_gpipe.gpipe_moments(4, 1, 10.0, 7.0, 2.0, 0.0, False, False)


def test_one_step_moments_free_each_unit_after_its_backward():
    """One micro-batch without a pipeline (estimate_gpipe._gpipe_ranks at pp 1): each unit's
    compute copy is freed once its backward ran (ZeRO-0/1/2; ZeRO-3 regathers, a pipeline or
    m 2 keeps them: memory_gpipe.resharded_after_backward), the embedding's gradient is made
    after every block's (`one_step`: the head's moments hold the head's gradient alone) and
    the head's first block runs beside no previous reduce-scatter input (`first_block`)."""
    assert memory_gpipe.resharded_after_backward(1, 1, 1, True, 2.0, 3.0, 5.0) == (6.0, 10.0)
    for m, pp, zero, fsdp_all in ((2, 1, 1, True), (1, 2, 1, True), (1, 1, 3, True),
                                  (1, 1, 1, False)):
        assert memory_gpipe.resharded_after_backward(m, pp, zero, fsdp_all, 2.0, 3.0,
                                                     5.0) == (0.0, 0.0)
    # 4 blocks, one micro-batch of 40 bytes, 8 bytes of block gradients, roots 3 (head 1)
    base = memory_gpipe.gpipe_moments(1, 4, 40.0, 8.0, 3.0, 0.0, True, False, head_grads=1.0)
    got = memory_gpipe.gpipe_moments(1, 4, 40.0, 8.0, 3.0, 0.0, True, False, head_grads=1.0,
                                     resharded=(6.0, 10.0), first_block=2.0, one_step=True)
    assert [m for _, m in base] == ["loss", "block", "block"]
    assert [m for _, m in got] == ["loss", "block", "block", "block"]
    assert got[0] == base[0] == (41.0, "loss")  # nothing freed before the head's backward
    assert got[1][0] == base[1][0] - 2.0 - 6.0 - 2.0  # the embedding's 2, the head's copy
    # the second block: beside the first's reduce-scatter input (the linear block moment's),
    # the first's gradient made and its copy freed
    assert got[2][0] == base[1][0] - 2.0 - 6.0 + 8.0 / 4 - 10.0
    # the last block: three blocks' copies and the head's freed, the embedding's gradient not
    # made yet
    assert got[3][0] == base[2][0] - 2.0 - 6.0 - 3 * 10.0
    # two blocks: the second is the last
    assert len(memory_gpipe.gpipe_moments(1, 2, 40.0, 8.0, 3.0, 0.0, True, False,
                                          head_grads=1.0, first_block=2.0,
                                          one_step=True)) == 3
    # the embedding's moment (tp > 1) after every block's backward: every copy but its own
    emb = memory_gpipe.gpipe_moments(1, 4, 40.0, 8.0, 3.0, 0.0, True, True, head_grads=1.0,
                                     resharded=(6.0, 10.0), one_step=True)
    assert dict((m, h) for h, m in emb)["embedding"] == 40.0 + 8.0 + 1.0 - 6.0 - 40.0


def test_one_microbatch_sharded_gradients_are_made_unit_by_unit():
    """'mid' (2 layers) dp 8, one micro-batch per step: under ZeRO-1 and ZeRO-3 the plan is
    priced at its moments (the blocks' gradient shards absent at the loss), below the linear
    figure main priced (every shard at the loss, every unit gathered at the last block's
    backward: rehearsed +5.0% / +20.3%, tests/test_rehearse.py ONE_MB) and below two
    micro-batches' figure; the rehearsal's totals (GiB) within 2%."""
    mid = ModelSpec(
        name="mid", layers=2, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
        vocab=32000, max_seq=4096)
    # rehearsed again after the fused loss (branch flce: its fp32 weight-gradient accumulator
    # and input gradient held from the loss's forward); onembz's figures before it were 1.9389,
    # 1.2467, 1.6488, 1.2467
    rehearsed = {(1, "none"): 1.9717, (1, "full"): 1.2681, (3, "none"): 1.6817,
                 (3, "full"): 1.2467}
    cluster = preset_cluster("dgx-h100", 1)
    mem = memory.MemoryOptions(dtype="bf16", framework="fsdp2", fused_norm=False)
    for (zero, rec), want in rehearsed.items():
        cfg = Plan(tp=1, pp=1, dp=8, zero=zero, micro_batch=2, recompute=rec, dtype="bf16")
        one = Evaluator(mid, cluster, 16, 2048, mem=mem).evaluate(cfg, keep_infeasible=True)
        two = Evaluator(mid, cluster, 32, 2048, mem=mem).evaluate(cfg, keep_infeasible=True)
        assert one.memory.allocated < two.memory.allocated
        assert one.memory.allocated == pytest.approx(want, rel=0.02), (zero, rec)


def test_a_pipeline_last_stage_prices_the_chunked_loss_not_whole_logits():
    """At tp = 1 meshtron's pipelined last stage returns its chunked loss (parallel/
    parallel_model.py `_stage_computes_loss`): the loss's working set is the fused loss's, as
    without a pipeline, far below whole logits kept as the stage output; a tensor-parallel head
    keeps the whole-logits loss in both."""
    mem = memory.DEFAULT
    chunked = memory.chunked_loss_bytes(MID, 2 * 2048, mem)
    assert memory.logits_bytes(MID, 1, 2, 2048, mem, pipelined=True) == chunked
    assert chunked < 2 * 2048 * MID.vocab * 6.0
    assert memory.logits_bytes(MID, 2, 2, 2048, mem, pipelined=True) > chunked
