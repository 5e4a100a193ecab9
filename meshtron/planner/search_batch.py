"""What a layout family refused for its global batch would accept: the smallest global batch
one of its layouts takes, computed by the validity function itself (plan_rules.plan_problems),
so the advice in "... layouts left out" names a batch that runs rather than the first layout
tried's data-parallel degree (the largest dp of the family, as divisors() counts pp up from 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

_BATCH_SUBJECTS = ("plan.global_batch=", "plan.micro_batch")
"""The reasons a larger global batch can cure: its divisibility by dp, a fixed micro-batch
dividing the per-replica batch, a schedule's count of micro-batches per step."""


def is_batch_reason(reason: str) -> bool:
    return reason.startswith(_BATCH_SUBJECTS)


def smallest_batch(refused: list[Mapping[str, Any]],
                   problems_of: Callable[[Mapping[str, Any]], list[str]]
                   ) -> tuple[int, Mapping[str, Any]] | None:
    """(the smallest global batch, the layout that takes it) over the `refused` layouts (the
    knob dicts the validity function refused, global_batch among them), or None when none of
    them runs at any batch tried. A layout's candidates are the multiples of dp x micro_batch
    (one sequence per micro-batch when it is searched), up to pp of them: 1F1B needs pp
    micro-batches per step (plan_rules_pipeline.microbatch_problem); a reason that is not about
    the batch ends the layout's candidates."""
    best: tuple[int, Mapping[str, Any]] | None = None
    for knobs in sorted(refused, key=lambda k: k["dp"]):
        step = knobs["dp"] * (knobs.get("micro_batch") or 1)
        for j in range(1, max(1, knobs["pp"]) + 1):
            batch = step * j
            if best is not None and batch >= best[0]:
                break
            problems = problems_of({**knobs, "global_batch": batch})
            if not problems:
                best = (batch, knobs)
                break
            if not all(is_batch_reason(p) for p in problems):
                break
    return best


def batch_advice(batch: int, reason: str, refused: list[Mapping[str, Any]],
                 problems_of: Callable[[Mapping[str, Any]], list[str]]) -> str | None:
    """The reason a family whose first layout's `reason` is its global batch is left out,
    naming the batch one of its layouts takes: None where `reason` says it already (one dp in
    the family: its "use a multiple of dp" is every layout's) or no batch tried runs one of
    them (the caller keeps `reason`)."""
    dps = sorted({k["dp"] for k in refused})
    found = smallest_batch(refused, problems_of) if len(dps) > 1 else None
    if found is None:
        return None
    least, knobs = found
    where = ", ".join(f"{n}={knobs[n]}" for n in ("tp", "cp", "pp", "dp")
                      if n != "cp" or (knobs.get("cp") or 1) > 1)
    if "must be divisible by plan.dp=" not in reason:  # a micro-batch's or a schedule's count
        return (f"{reason}; the smallest global batch one of these layouts takes is {least} "
                f"({where})")
    return (f"plan.global_batch={batch} (the global batch, sequences per step): must be "
            f"divisible by plan.dp ({dps[0]} to {dps[-1]} in these layouts), every "
            f"data-parallel rank takes global_batch/dp whole sequences; use a multiple of "
            f"{least} ({where}: the smallest global batch one of these layouts takes)")


__all__ = ["batch_advice", "is_batch_reason", "smallest_batch"]
