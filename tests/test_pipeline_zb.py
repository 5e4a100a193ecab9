"""Pipeline schedules priced as torch.distributed.pipelining runs them: the orders meshtron
re-derives (planner/pipeline_zb.py, simulate/schedule.py) are the lists torch 2.13 builds, and
the planner's bubble (planner/pipeline.py `bubble_time`) is the makespan of an event walk of
those lists, on a grid of (p, v, m) and forward / input-gradient / weight-gradient ratios.

How the walk compares: every operation starts when its rank is free and its input exists
(torch's runtime posts receives early and waits on its sends only at the step's end), with
no transfer time: the planner charges the transfers apart (pipeline.p2p_time, every
steady-state one on the critical stage), so the bubble is compared with transfers at zero.
"""

from __future__ import annotations

import functools
import random
from unittest import mock

import pytest

from meshtron.planner import pipeline, pipeline_zb
from meshtron.simulate.schedule import device_of, device_orders
from testkit.pipeline_walk import event_walk

S = pytest.importorskip("torch.distributed.pipelining.schedules")

_KIND = {"F": "F", "I": "B", "W": "W", "B": "B"}


def _torch_orders(cls, p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """The compute actions torch's schedule class lists per rank for p ranks of v stages and
    m micro-batches, Nones dropped (the runtime skips them). Built as torch's own
    `_schedule_visualizer.get_schedule_ops` builds a schedule without processes: a stand-in
    for the stage objects, which only the schedule's constructor reads (group size, stage
    count); no process group is involved."""
    order = cls([_stage_stand_in(cls, p, v)] * v, m).pipeline_order
    return [[(_KIND[a.computation_type.value], a.stage_index, a.microbatch_index)
             for a in order[r] if a is not None and a.computation_type.value in _KIND]
            for r in range(p)]


@functools.cache
def _stage_stand_in(cls, p: int, v: int):
    """The PipelineStage stand-in of `_torch_orders`, made once per schedule class and (p, v)
    (its m values reuse it): `mock.create_autospec` of the class took 13 of the 17 s
    test_zero_bubble_orders_are_torchs spent (247 stand-ins)."""
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * v
    return stage


def _grid(vs):
    for p in (2, 3, 4, 5, 8):
        for v in vs:
            for m in range(1, 3 * p + 3):
                yield p, v, m


def _runs(v: int, p: int, m: int, looped: bool) -> bool:
    """Micro-batch counts torch's looped schedules accept (plan_rules_pipeline
    `microbatch_problem` refuses the others)."""
    return not looped or m % max(1, m // p) == 0


# ---- zero bubble ----------------------------------------------------------------------------
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_zero_bubble_orders_are_torchs(v):
    cls = S.ScheduleZBVZeroBubble if v == 2 else S.ScheduleInterleavedZeroBubble
    for p, _, m in _grid([v]):
        if not _runs(v, p, m, v != 2):
            continue
        assert pipeline_zb.orders(p, v, m) == _torch_orders(cls, p, v, m), (p, v, m)
        assert device_orders("zb", p, v, m) == pipeline_zb.orders(p, v, m)
    if v == 2:  # the V: rank r holds stages r and 2p - 1 - r (torch's style='v' mapping)
        assert [pipeline_zb.stage_rank(4, 2, s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


RATIOS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.0, 2.0), (0.4, 1.7, 1.6), (1.6, 0.2, 1.0)]


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_zero_bubble_is_the_walk_of_torchs_order(v):
    """The planner's zero-bubble bubble is the walk's to 1e-9 relative, for m below, at and
    above p (and ZB-V's 2p - 1), m not a multiple of p included, at fixed and random
    forward / input-gradient / weight-gradient ratios. The paper's (p-1)(F+B-W), which the
    planner priced before, is short by (p-1)(W - min(F, B)) when W is longer, by
    (p-m) min(F, B, W) when m < p, and ignored v."""
    rng = random.Random(v)
    ratios = RATIOS + [tuple(rng.uniform(0.1, 2.0) for _ in range(3)) for _ in range(3)]
    for p, _, m in _grid([v]):
        if not _runs(v, p, m, v != 2):
            continue
        orders = pipeline_zb.orders(p, v, m)
        for f, b, w in ratios:
            span = event_walk(orders, p * v, lambda kind, _: {"F": f, "B": b, "W": w}[kind],
                              lambda s: pipeline_zb.stage_rank(p, v, s))
            t = v * (f + b + w)
            got = pipeline.bubble_time("zb", v, [t] * p, [v * w] * p, m, [v * f] * p)
            assert m * t + got == pytest.approx(span, rel=1e-9, abs=1e-12), (p, v, m, f, b, w)
            # the product's own walk (pipeline_zb.walk) agrees with this one
            n = p * v
            assert pipeline_zb.walk(p, v, m, [f] * n, [b] * n, [w] * n) == \
                pytest.approx(span, rel=1e-12)


def test_zero_bubble_one_stage_per_rank_before_and_after():
    """ZB1P at p = 4, F = B = 1: with W = 1 torch's order meets the paper's (p-1)(F+B-W) = 3;
    with W = 2 it idles 3, not 0; with m = 2 < p it idles 3 + 2 min(F, B, W) = 5."""
    t = [4.0] * 4
    assert pipeline.bubble_time("zb", 1, [3.0] * 4, [1.0] * 4, 8, [1.0] * 4) == 3.0
    assert pipeline.bubble_time("zb", 1, t, [2.0] * 4, 8, [1.0] * 4) == 3.0
    assert pipeline.bubble_time("zb", 1, [3.0] * 4, [1.0] * 4, 2, [1.0] * 4) == 5.0


def test_zero_bubble_v_is_counted_per_chunk():
    """ZB-V at p = 8, chunk F = B = W = 1 (rank: 6 per micro-batch), m = 16: rank 7 cannot start
    before the first micro-batch's 7 forwards, and torch's V makes up none of it: bubble 7,
    half of the one-stage-per-rank schedule's 14 on the same layers (what the planner
    charged before, whatever v)."""
    assert pipeline.bubble_time("zb", 2, [6.0] * 8, [2.0] * 8, 16, [2.0] * 8) == \
        pytest.approx(7.0)
    assert pipeline.bubble_time("zb", 1, [6.0] * 8, [2.0] * 8, 16, [2.0] * 8) == \
        pytest.approx(14.0)


# ---- 1F1B, interleaved 1F1B, GPipe and looped BFS -------------------------------------------
@pytest.mark.parametrize("schedule,v,cls", [("interleaved", 2, "ScheduleInterleaved1F1B"),
                                            ("interleaved", 3, "ScheduleInterleaved1F1B"),
                                            ("gpipe", 2, "ScheduleLoopedBFS")])
def test_looped_orders_are_torchs(schedule, v, cls):
    """The simulator's interleaved order is torch's ScheduleInterleaved1F1B's (rounds of
    m // max(1, m // p), also when m is not a multiple of p); looped BFS runs each chunk's
    backwards in reverse micro-batch order, which the simulator's GPipe order does not:
    checked as the same multiset per rank, and the same makespan below."""
    for p, _, m in _grid([v]):
        if not _runs(v, p, m, True):
            continue
        ours = device_orders(schedule, p, v, m)
        theirs = _torch_orders(getattr(S, cls), p, v, m)
        if schedule == "interleaved":
            assert ours == theirs, (p, v, m)
        else:
            assert [sorted(o) for o in ours] == [sorted(o) for o in theirs], (p, v, m)


@pytest.mark.parametrize("schedule,vs", [("1f1b", [1]), ("interleaved", [2, 3, 4]),
                                         ("gpipe", [1, 2, 3])])
def test_1f1b_interleaved_and_gpipe_bubbles_are_the_walk(schedule, vs):
    """`bubble_time` against the walk of the simulator's orders (torch's, test above; 1F1B's
    single-stage order is Schedule1F1B._step_microbatches': min(m, p - s) forwards, then
    backward and forward alternating), forward f and whole backward b per chunk, for every
    m torch's schedule accepts."""
    for p, v, m in _grid(vs):
        looped = schedule == "interleaved"
        if not _runs(v, p, m, looped) or (schedule == "1f1b" and m < p):
            continue  # Schedule1F1B refuses m < p (plan_rules_pipeline too)
        for f, b in ((1.0, 2.0), (1.0, 1.0), (0.3, 1.7)):
            span = event_walk(device_orders(schedule, p, v, m), p * v,
                              lambda kind, _: {"F": f, "B": b}[kind],
                              lambda s: device_of(schedule, p, v, s))
            t = v * (f + b)
            got = pipeline.bubble_time(schedule, v, [t] * p, [0.0] * p, m)
            assert m * t + got == pytest.approx(span, rel=1e-9), (schedule, p, v, m, f, b)


@pytest.mark.parametrize("v", [1, 2, 3])
def test_unequal_ranks_are_priced_on_the_walk_of_every_micro_batch(v):
    """Ranks of unequal work (the end ranks' embedding and head; here random within +-30%):
    `pipeline_zb.stage_bubble` walks only until the ranks' slack settles; that is the walk of
    all m micro-batches to 1e-9 of the step."""
    rng = random.Random(10 + v)
    for _ in range(12):
        p = rng.choice([2, 3, 4, 6])
        f = [rng.uniform(0.7, 1.3) for _ in range(p)]
        b = [rng.uniform(0.8, 1.6) for _ in range(p)]
        w = [rng.uniform(0.3, 1.5) for _ in range(p)]
        where = [pipeline_zb.stage_rank(p, v, s) for s in range(p * v)]
        worst = max(x + y + z for x, y, z in zip(f, b, w))
        for m in range(1, 5 * p + 1):
            if not _runs(v, p, m, v != 2):
                continue
            full = pipeline_zb.walk(p, v, m, [f[r] / v for r in where],
                                    [b[r] / v for r in where], [w[r] / v for r in where])
            got = pipeline_zb.stage_bubble(v, m, tuple(f), tuple(b), tuple(w))
            assert m * worst + got == pytest.approx(max(full, m * worst), rel=1e-9), (p, m)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 10), (4, 3, 8), (4, 2, 2),
                                   (3, 2, 6), (8, 2, 16), (4, 4, 12)])
def test_interleaved_order_is_torchs(p, v, m):
    assert pipeline_zb.interleaved_orders(p, v, m) == _torch_orders(
        S.ScheduleInterleaved1F1B, p, v, m)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 2, 16), (4, 3, 12), (8, 2, 8)])
def test_interleaved_walk_is_the_formula_for_equal_chunks(p, v, m):
    f, b = (1.0,) * (p * v), (2.3,) * (p * v)
    want = pipeline.bubble_time("interleaved", v, [3.3 * v] * p, [0.0] * p, m)
    assert pipeline_zb.interleaved_bubble(m, f, b, p) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("batch", [8, 16])
def test_planner_walks_unequal_interleaved_chunks(batch):
    """meshtron's own split of Llama-3-8B at tp=2, pp=4, interleaved:2 gives a rank chunks of
    different layer counts: the planner's bubble is the walk of torch's own lists with the
    simulator's per-stage pieces (before: (sum t - max t) / v, 0.082 s against the walk's
    0.098 s)."""
    from meshtron.model.spec import resolve_model
    from meshtron.planner import resolve_cluster, search_plans
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.frameworks import preset
    from meshtron.planner.step_pieces import step_pieces

    fw = preset("meshtron")
    model, cluster = resolve_model("llama3-8b"), resolve_cluster("dgx-h100:1")
    fixed = dict(tp=2, pp=4, dp=1, schedule="interleaved", virtual_stages=2, micro_batch=1)
    est = search_plans(model, cluster, batch, 4096, fixed, top_k=1, explain=False,
                       framework=fw).best
    chunks = est.stage_layers
    assert any(chunks[r] != chunks[r + 4] for r in range(4))
    pieces = step_pieces(Evaluator(model, cluster, batch, 4096, fw.kernel, mem=fw.memory), est)
    m, nv = est.num_microbatches, len(chunks)
    orders = _torch_orders(S.ScheduleInterleaved1F1B, 4, 2, m)
    span = event_walk(orders, nv,  # bwd: the whole backward
                      lambda kind, s: (pieces.fwd if kind == "F" else pieces.bwd)[s])
    work = max(sum(pieces.fwd[s] + pieces.bwd[s] for s in range(r, nv, 4)) for r in range(4))
    assert est.time.bubble == pytest.approx(span - m * work, rel=1e-9)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_many_micro_batches_are_priced_from_a_few_rounds(v):
    """Chunks of unequal work, one to three of them 2-6x the others (as the embedding's and the
    head's chunks; with several chunks per rank the idle then often grows by the same every
    round: a dependency chain across ranks is slower than any rank's own work; one stage per
    rank settles): 'zb' and interleaved 1F1B over up to 40 rounds of p
    are priced from walks of a few rounds (`_long_idle`) and equal the walk of every
    micro-batch to 1e-9 of the step."""
    rng = random.Random(540 + v)
    grew = 0
    for _ in range(16):
        p = rng.choice([2, 3, 4, 8])
        n = p * v
        f = [rng.uniform(0.8, 1.2) for _ in range(n)]
        for _ in range(rng.randint(1, 3)):
            f[rng.randrange(n)] *= rng.choice([2.0, 3.0, 6.0])
        b = [2.0 * x * rng.uniform(0.9, 1.1) for x in f]
        w = [rng.uniform(0.3, 1.0) * x for x in f]
        m = p * rng.randint(12, 40) + (rng.randrange(p) if v <= 2 else 0)
        walked = pipeline_zb.walk(p, v, m, f, b, w)
        got = pipeline_zb.chunk_bubble(v, m, tuple(f), tuple(b), tuple(w))
        ranks = [sum(x[s] for s in range(n) if pipeline_zb.stage_rank(p, v, s) == r)
                 for x in (f, b, w) for r in range(p)]
        worst = max(ranks[r] + ranks[p + r] + ranks[2 * p + r] for r in range(p))
        assert m * worst + got == pytest.approx(max(walked, m * worst), rel=1e-9), (p, m)
        grew += got > 2 * p * worst
        m -= m % p  # interleaved 1F1B: whole rounds of p
        if v >= 2:
            walked = pipeline_zb.walk(p, v, m, f, b, [0.0] * n, schedule="interleaved")
            got = pipeline_zb.interleaved_bubble(m, tuple(f), tuple(b), p)
            worst = max(sum(f[s] + b[s] for s in range(r, n, p)) for r in range(p))
            assert m * worst + got == pytest.approx(max(walked, m * worst), rel=1e-9), (p, m)
            grew += got > 2 * p * worst
    assert grew or v == 1  # some idle grew with m: the carried growth was priced


def _input(op: tuple[str, int, int], nv: int) -> tuple[str, int, int] | None:
    kind, s, mb = op  # F needs F of s - 1, B needs B of s + 1 (the last stage its F), W its B
    if kind == "F":
        return ("F", s - 1, mb) if s else None
    if kind == "B":
        return ("B", s + 1, mb) if s < nv - 1 else ("F", s, mb)
    return ("B", s, mb)


@pytest.mark.parametrize("schedule,v", [("zb", 1), ("zb", 2), ("zb", 3), ("zb", 4),
                                        ("interleaved", 2), ("interleaved", 3)])
def test_the_round_shift_reads_rounds_before_every_ranks_drain(schedule, v):
    """What carries `_long_idle`'s shift to m, read from the orders (not from times), for the
    walks it reads (the first, doubled, and one to p - 1 micro-batches more where the order
    repeats every micro-batch), D = `_drain_rounds` rounds of P operations: the order of p
    micro-batches more is this one up to its last D rounds on each rank and this one's rest
    a round later from there (a round inserted before the drain); the three rounds
    `_round_shift` compares repeat the round before them; every input of an operation after
    them lies in them or after; no operation before the last D rounds waits on one in
    them. The V's rank 0 drains 7p - 5 operations, over a round of 6p from p = 6: with one
    round kept off the end its walks never found a shift and walked all m."""
    for p in range(2, 13):
        nv, d = p * v, pipeline_zb._drain_rounds(p, v, schedule)
        per = (2 if schedule == "interleaved" else 3) * v * p
        first = (5 + d) * p
        runs = [first, 2 * first] + ([first + r for r in range(1, p)]
                                     if schedule == "zb" and v <= 2 else [])
        for m in runs:
            now = pipeline_zb.cached_orders(p, v, m, schedule)
            more = pipeline_zb.cached_orders(p, v, m + p, schedule)
            at = {op: (r, k) for r, ops in enumerate(now) for k, op in enumerate(ops)}
            ends = [len(ops) for ops in now]
            assert min(ends) >= (5 + d) * per, (p, m)
            later = lambda op: (op[0], op[1], op[2] + p)  # noqa: E731 - its namesake a round on
            for r, (ops, ops2) in enumerate(zip(now, more)):
                n, cut = ends[r], ends[r] - d * per
                assert ops2[:cut] == ops[:cut], (p, m, r)
                assert ops2[cut:] == tuple(later(op) for op in ops[cut - per:]), (p, m, r)
                assert all(ops[k] == later(ops[k - per]) for k in range(cut - 3 * per, cut))
                for k, op in enumerate(ops):
                    need = _input(op, nv)
                    if need is None:
                        continue
                    r2, q = at[need]
                    if k >= cut - per:  # after the compared rounds: its input in them or after
                        assert q >= ends[r2] - (d + 4) * per, (p, m, r, op)
                    else:  # before the drain: its input too
                        assert q < ends[r2] - d * per, (p, m, r, op)


def test_the_v_of_many_ranks_is_priced_from_a_few_rounds():
    """ZB-V (v = 2) at p = 8, chunks of unequal work: a walk of a few rounds finds the shift
    (`_drain_rounds`: the V's drain is over a round from p = 6 on) and the carried idle equals
    the walk of all m micro-batches."""
    rng = random.Random(5408)
    p, v = 8, 2
    f = [rng.uniform(0.8, 1.2) for _ in range(p * v)]
    f[3] *= 3.0
    b = [2.0 * x * rng.uniform(0.9, 1.1) for x in f]
    w = [rng.uniform(0.3, 1.0) * x for x in f]
    per = (tuple(f), tuple(b), tuple(w))
    m = 40 * p + 5
    assert any(pipeline_zb._span_and_shift(p, v, runs, "zb", per)[1] is not None
               for runs in (7 * p, 14 * p, 28 * p))
    ranks = [[s for s in range(p * v) if pipeline_zb.stage_rank(p, v, s) == r] for r in range(p)]
    worst = max(sum(f[s] + b[s] + w[s] for s in mine) for mine in ranks)
    want = pipeline_zb.walk(p, v, m, f, b, w) - m * worst
    assert pipeline_zb.chunk_bubble(v, m, *per) == pytest.approx(want, rel=1e-12, abs=1e-9)


def test_ranks_of_nearly_equal_work_are_not_carried_by_a_gap_the_tolerance_hides():
    """One stage per rank, rank 2's forward 2e-9 longer and its input gradient 1.3e-9
    shorter (its work 7e-10 less than the others'): it is not yet held by the slowest
    chain, its operations shift by its own work, 2.7e-9 a round less than the others'. A
    tolerance of 1e-12 of the step accepted that at 192 rounds and carried the gap over
    every later one (the idle 5e-6 short at 8000 micro-batches); to rounding, the walk
    goes on and the idle is the walk of all m."""
    f, b, w = (1.0, 1.0, 1.0 + 2e-9, 1.0), (2.0, 2.0, 2.0 - 4e-9 / 3, 2.0), (0.5,) * 4
    m = 8000
    worst = max(x + y + z for x, y, z in zip(f, b, w))
    want = pipeline_zb.walk(4, 1, m, list(f), list(b), list(w)) - m * worst
    assert pipeline_zb.stage_bubble(1, m, f, b, w) == pytest.approx(want, rel=1e-9)
