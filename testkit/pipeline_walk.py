"""Independent walks of pipeline orders, for the tests that check the planner's bubbles and
walks against them (tests/test_pipeline_zb.py, test_pipeline_zb_walk.py,
test_pipeline_deepspeed.py). Torch-free: the orders come in as lists.

`drain` is the loop every walk shares: each rank's list runs in order, round robin, until no
rank can move; a list left unfinished is a deadlock. `event_walk` is the dependency walk of
torch's pipelining orders on top of it."""

from __future__ import annotations

from typing import Callable, Sequence

Op = tuple[str, int, int]
"""(kind, stage, micro-batch): kind F (forward), B (input gradient, or the whole backward
where there is no W), W (weight gradient)."""


def drain(streams: Sequence[Sequence], step: Callable[[int, object, list[int]], bool]) -> None:
    """Run each stream's operations in order until none can move. `step(r, op, pos)` runs
    `op` of stream r and returns True, or returns False when it must wait; it may advance
    another stream's position in `pos` (a rendezvous consumes its peer's matching op)."""
    pos = [0] * len(streams)
    moved = True
    while moved:
        moved = False
        for r, stream in enumerate(streams):
            while pos[r] < len(stream):
                if not step(r, stream[pos[r]], pos):
                    break
                pos[r] += 1
                moved = True
    assert pos == [len(s) for s in streams], "deadlock"


def event_walk(orders: Sequence[Sequence[Op]], nv: int, seconds: Callable[[str, int], float],
               where: Callable[[int], int] | None = None, hop: float = 0.0,
               stall: Callable[[int, Op], float] | None = None) -> float:
    """Makespan (the latest rank's clock, stalls included) of per-rank orders over `nv`
    virtual stages: an operation starts when its rank has ended the previous one and its
    input exists (F: the previous stage's F; B: the next stage's B or, on the last stage, its
    own F; W: its own B), `hop` later when that input ran on another rank. `seconds(kind, stage)`: the operation's duration; `where(stage)`:
    the rank that runs a stage (checked against the orders; needed for `hop`);
    `stall(rank, op)`: seconds the rank's stream stays blocked after `op` has produced its
    output (a collective it waits on), 0 where None."""
    end: dict[Op, float] = {}
    clock = [0.0] * len(orders)

    def step(r: int, op: Op, _pos: list[int]) -> bool:
        kind, s, j = op
        dep = {"F": ("F", s - 1, j) if s > 0 else None,
               "B": ("B", s + 1, j) if s < nv - 1 else ("F", s, j),
               "W": ("B", s, j)}[kind]
        if dep is not None and dep not in end:
            return False
        assert where is None or where(s) == r, (op, r)
        start = clock[r]
        if dep is not None:
            start = max(start, end[dep] + (hop if where and where(dep[1]) != r else 0.0))
        clock[r] = end[op] = start + seconds(kind, s)
        if stall is not None:
            clock[r] += stall(r, op)
        return True

    drain(orders, step)
    return max(clock)
