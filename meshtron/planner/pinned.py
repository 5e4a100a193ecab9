"""A layout the user pinned is answered even when it is predicted not to fit (issue 30).

A published run's layout is a fact about that run; the planner's memory model is a prediction
about meshtron's runtime (within 5% of a rehearsal of it), not about another stack's private
savings (Meta deallocates pipeline stage inputs and outputs for Llama 3 405B). Refusing such a
layout answers nothing, so when the knobs leave the search exactly one (tp, cp, pp, dp, ep)
layout and no candidate of it fits, `meshtron plan` prices the leanest candidate (the search's
near miss) the way it prices every candidate (`SearchResult.near_miss_priced`: the
time-balanced layer split, not the memory-minimising one, which can be far slower), marks it
fits false, and names the cheapest change of the knobs the user fixed that would fit
(`answer_pinned`). A search with more than one layout open keeps its refusal: there the
planner chose the layout. A pinned layout the priced stack's layer-to-stage rule cannot split
is answered in the same spirit, inside the search (search_space.SplitFallback).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from meshtron.errors import UserError
from meshtron.planner.estimate import Estimate
from meshtron.planner.plan import Plan
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.search import SearchResult, search_plans, split_comm

FIT_KNOBS = ("recompute", "zero", "micro_batch", "sp", "schedule", "offload")
"""Knobs that trade memory for time on a fixed layout: the ones the user fixed are freed one at
a time (then all together) to find the cheapest change that fits a pinned layout."""

CHANGE_KNOBS = ("recompute", "zero", "micro_batch", "sp", "schedule", "virtual_stages",
                "offload")
"""What a change that fits may differ in (the schedule's virtual stages apart from its name:
`--schedule interleaved` fixes the one, not the other)."""


@dataclass
class FitChange:
    """The fastest plan of a pinned layout that fits, and what differs from the pinned plan."""

    estimate: Estimate
    fixed: dict[str, tuple[Any, Any]]
    """Knobs the user fixed that change: name -> (pinned value, value that fits)."""
    searched: dict[str, tuple[Any, Any]]
    """Knobs the user left to the search that change with them."""

    @property
    def label(self) -> str:
        """'recompute=full (fixed: none); with virtual_stages=6 (searched: 4)'."""
        def values(d: dict[str, tuple[Any, Any]], how: str) -> str:
            return ", ".join(f"{k}={_show(b)} ({how}: {_show(a)})" for k, (a, b) in d.items())

        parts = [values(self.fixed, "fixed")] if self.fixed else []
        if self.searched:
            parts.append(("with " if parts else "") + values(self.searched, "searched"))
        return "; ".join(parts) or "a different layer split"

    def to_dict(self, tokens: float, gpus: int, price: float | None) -> dict[str, Any]:
        return {"change": self.label,
                "fixed_changed": {k: list(v) for k, v in self.fixed.items()},
                "searched_changed": {k: list(v) for k, v in self.searched.items()},
                **self.estimate.to_dict(tokens, gpus, price)}


def _show(value: Any) -> Any:
    return "on" if value is True else "off" if value is False else value


def layout_pinned(result: SearchResult) -> bool:
    """The knobs leave the search exactly one (tp, cp, pp, dp, ep) layout, however they were
    typed: `--layout pp=8` on 8 GPUs, tp=8,pp=16 with dp then forced by the GPU count, a
    mixture of experts whose dp x cp = 1 leaves ep = 1 (`SearchResult.layouts`)."""
    return len(result.layouts) == 1


def answer_pinned(result: SearchResult, fixed: Knobs | dict[str, Any] | None,
                  framework: Any = None) -> SearchResult:
    """`result` of search_plans(..., fixed, framework=framework): when nothing fits and its
    layout is pinned, the near miss priced as a candidate becomes the one plan (fits False,
    `pinned`) and `fit_change` the cheapest change that fits; otherwise `result` unchanged."""
    if result.plans or result.near_miss_priced is None or not layout_pinned(result):
        return result
    t0 = time.perf_counter()
    result.plans, result.pinned = [result.near_miss_priced], True
    knobs, traffic = split_comm(fixed)  # `plan --layout dp=8 --grad-compression int8`
    result.fit_change = cheapest_fit(result, Knobs.of(knobs), framework, traffic)
    result.seconds += time.perf_counter() - t0
    return result


def cheapest_fit(result: SearchResult, knobs: Knobs, framework: Any = None,
                 traffic: dict[str, Any] | None = None) -> FitChange | None:
    """The fastest plan of the pinned layout that fits when one fixed knob of FIT_KNOBS is left
    to the search, else when all of them are; None when neither fits (or none is fixed: the
    search already tried every value). `traffic`: the data-parallel traffic knobs priced
    (gradient compression, DiLoCo). Its evaluations count in `result.evaluated`."""
    fixed = [k for k in FIT_KNOBS if getattr(knobs, k) is not None]
    best: Estimate | None = None
    for names in [[k] for k in fixed] + ([fixed] if len(fixed) > 1 else []):
        if best is not None and len(names) > 1:
            break  # a single change fits: freeing everything is not the cheapest
        free: dict[str, Any] = {k: None for k in names}
        if "schedule" in names:
            free["virtual_stages"] = None
        try:
            found = search_plans(result.model, result.cluster, result.global_batch,
                                 result.seq_len,
                                 {**dataclasses.replace(knobs, **free).to_dict(),
                                  **(traffic or {})}, top_k=1,
                                 explain=False, framework=framework)
        except UserError:
            continue  # e.g. the freed knob leaves no valid value on this layout
        result.evaluated += found.evaluated
        if found.fits and (best is None or found.best.step_time_s < best.step_time_s):
            best = found.best
    if best is None:
        return None
    return change_of(result.plans[0].config, best, knobs)


def change_of(old: Plan, new: Estimate, knobs: Knobs) -> FitChange:
    """What differs between the pinned plan `old` and `new`, split by whether `knobs` fixed
    it (a fixed schedule fixes its virtual stages only when they were given)."""
    fixed: dict[str, tuple[Any, Any]] = {}
    searched: dict[str, tuple[Any, Any]] = {}
    for name in CHANGE_KNOBS:
        a, b = getattr(old, name), getattr(new.config, name)
        if a != b:
            (fixed if getattr(knobs, name) is not None else searched)[name] = (a, b)
    return FitChange(new, fixed, searched)


__all__ = ["FIT_KNOBS", "CHANGE_KNOBS", "FitChange", "layout_pinned", "answer_pinned",
           "cheapest_fit", "change_of"]
