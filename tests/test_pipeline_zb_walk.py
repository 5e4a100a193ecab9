"""The planner's walk of torch's pipeline orders (pipeline_zb.walk) against an independent
event walk of the same orders, and the interleaved idle floor the search prunes with
(pipeline_zb.interleaved_idle_floor) against the walk it stands in for. No torch needed:
tests/test_pipeline_zb.py checks the orders themselves against torch's."""

from __future__ import annotations

import random

import pytest

from meshtron.planner import pipeline_zb
from testkit.pipeline_walk import event_walk


def _reference_walk(p, v, m, f, b, w, hop, schedule):
    """Each rank runs its list in order; an operation starts when the rank's previous one
    has ended and its input has (F: the previous stage's F; B: the next stage's B, or its
    own F on the last stage; W: its own B), `hop` later when that input ran elsewhere
    (testkit.pipeline_walk.event_walk)."""
    nv = p * v
    orders = pipeline_zb.cached_orders(p, v, m, schedule)
    where = [s % p if schedule != "zb" else pipeline_zb.stage_rank(p, v, s) for s in range(nv)]
    dur = {"F": f, "B": b, "W": w}
    return event_walk(orders, nv, lambda kind, s: dur[kind][s], where.__getitem__, hop)


GRID = [(p, v, m, sched) for p in (2, 3, 4) for v in (1, 2, 3) for m in (1, p, 2 * p + 1, 4 * p)
        for sched in ("zb", "interleaved") if not (sched == "interleaved" and v == 1)]


def _torch_refuses(p: int, v: int, m: int, schedule: str) -> bool:
    """torch's looped schedules (Interleaved1F1B, InterleavedZeroBubble: v >= 2 resp. v >= 3)
    run m micro-batches in max(1, m // p) rounds of equal size and refuse any other m."""
    looped = v >= 2 if schedule == "interleaved" else v >= 3
    return looped and m % max(1, m // p) != 0


CASES = [c for c in GRID if not _torch_refuses(*c)]
REFUSED = [c for c in GRID if _torch_refuses(*c)]


@pytest.mark.parametrize("p,v,m,schedule", REFUSED)
def test_orders_torch_refuses_are_not_walked(p, v, m, schedule):
    nv = p * v
    with pytest.raises(RuntimeError, match="deadlocks"):
        pipeline_zb.walk(p, v, m, [1.0] * nv, [1.0] * nv, [1.0] * nv, schedule=schedule)


@pytest.mark.parametrize("p,v,m,schedule", CASES)
def test_walk_is_the_event_walk_of_the_orders(p, v, m, schedule):
    rng = random.Random(p * 1000 + v * 100 + m)
    nv = p * v
    for hop in (0.0, 0.25):
        f, b, w = ([rng.uniform(0.1, 2.0) for _ in range(nv)] for _ in range(3))
        got = pipeline_zb.walk(p, v, m, f, b, w, hop=hop, schedule=schedule)
        assert got == _reference_walk(p, v, m, f, b, w, hop, schedule)


@pytest.mark.parametrize("p,v", [(2, 2), (3, 3), (4, 2), (4, 4), (8, 3)])
def test_interleaved_idle_floor_never_above_the_walk(p, v):
    rng = random.Random(p * 10 + v)
    nv = p * v
    walked = 0
    for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p, 3 * p + 2, 5 * p} - {0}):
        try:
            pipeline_zb.interleaved_bubble(m, (1.0,) * nv, (1.0,) * nv, p)
        except RuntimeError:
            continue  # torch's order does not run these micro-batches
        walked += 1
        for r in range(p):  # the stage the floor's tail starts from is the order's last B
            last = pipeline_zb.cached_orders(p, v, m, "interleaved")[r][-1]
            assert last[:2] == ("B", pipeline_zb._last_backward(p, v, m, r))
        for spread in (0.0, 0.2, 1.0):
            f = tuple(1.0 + spread * rng.random() for _ in range(nv))
            b = tuple(2.0 + spread * rng.random() for _ in range(nv))
            floor = pipeline_zb.interleaved_idle_floor(m, f, b, p)
            assert 0.0 <= floor <= pipeline_zb.interleaved_bubble(m, f, b, p), (m, spread)
    assert walked >= 4


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 12), (8, 2, 16), (8, 4, 32)])
def test_interleaved_idle_floor_is_tight_for_equal_chunks(p, v, m):
    """Equal chunks: the last rank's head and tail are the whole bubble, (p - 1)(f + b), so
    the floor prunes every plan the walk would (a floor of 0 would prune nothing)."""
    f, b = (1.0,) * (p * v), (2.3,) * (p * v)
    walked = pipeline_zb.interleaved_bubble(m, f, b, p)
    assert walked == pytest.approx((p - 1) * 3.3, rel=1e-9)
    assert pipeline_zb.interleaved_idle_floor(m, f, b, p) == pytest.approx(walked, rel=1e-6)


@pytest.mark.parametrize("p,v", [(1, 2), (2, 2), (3, 3), (4, 2), (4, 6), (8, 3)])
def test_interleaved_numbering_is_the_orders_numbering(p, v):
    """The walk numbers torch's interleaved orders directly (no tuples): the same operations,
    in the same order, with the same inputs as numbering `interleaved_orders`' lists."""
    for m in range(1, 3 * p + 3):
        for r, order in enumerate(pipeline_zb.interleaved_orders(p, v, m)):
            assert pipeline_zb._interleaved_coded(p, v, m, r) == \
                pipeline_zb._coded(tuple(order), p * v, m)
