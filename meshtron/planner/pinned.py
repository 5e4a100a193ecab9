"""A layout the user pinned is answered even when it is predicted not to fit (issue 30).

A published run's layout is a fact about that run; the planner's memory model is a prediction
about meshtron's runtime (within 5% of a rehearsal of it), not about another stack's private
savings (Meta deallocates pipeline stage inputs and outputs for Llama 3 405B). Refusing such a
layout answers nothing, so when the user pins every mesh axis and no candidate of it fits,
`meshtron plan` prices the leanest candidate (the search's near miss), marks it fits false, and
names the cheapest change of the knobs the user fixed that would fit (`answer_pinned`). A
search with any mesh axis left open keeps its refusal: there the planner chose the layout.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.estimate import Estimate
from meshtron.planner.plan import Plan
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.search import SearchResult, runs_ep, search_plans

FIT_KNOBS = ("recompute", "zero", "micro_batch", "sp", "schedule", "offload")
"""Knobs that trade memory for time on a fixed layout: the ones the user fixed are freed one at
a time (then all together) to find the cheapest change that fits a pinned layout."""


def layout_pinned(knobs: Knobs, model: ModelSpec, framework: Any = None) -> bool:
    """The knobs fix every mesh axis: tp, pp and dp, the context-parallel degree then being the
    rest of the GPU count (gpus / (tp*pp*dp)), and, for a mixture of experts on a stack that
    runs expert parallelism, ep too (it folds over dp x cp: the GPU count does not fix it)."""
    if not (knobs.tp and knobs.pp and knobs.dp):
        return False
    return bool(knobs.ep) or not (model.is_moe and runs_ep(framework))


def answer_pinned(result: SearchResult, fixed: Knobs | dict[str, Any] | None,
                  framework: Any = None) -> SearchResult:
    """`result` of search_plans(..., fixed, framework=framework): when nothing fits and `fixed`
    pins the layout, its near miss becomes the one plan (fits False, `pinned`) and
    `fit_change` the cheapest change that fits; otherwise `result` unchanged."""
    knobs = Knobs.of(fixed)
    if result.plans or result.near_miss is None or not layout_pinned(knobs, result.model,
                                                                     framework):
        return result
    t0 = time.perf_counter()
    result.plans, result.pinned = [result.near_miss], True
    result.fit_change = cheapest_fit(result, knobs, framework)
    result.seconds += time.perf_counter() - t0
    return result


def cheapest_fit(result: SearchResult, knobs: Knobs,
                 framework: Any = None) -> tuple[str, Estimate] | None:
    """(what changed, the plan): the fastest plan of the pinned layout that fits when one
    fixed knob of FIT_KNOBS is left to the search, else when all of them are; None when
    neither fits (or none is fixed: the search already tried every value)."""
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
                                 result.seq_len, dataclasses.replace(knobs, **free), top_k=1,
                                 explain=False, framework=framework)
        except UserError:
            continue  # e.g. the freed knob leaves no valid value on this layout
        if found.fits and (best is None or found.best.step_time_s < best.step_time_s):
            best = found.best
    if best is None:
        return None
    return change_label(result.near_miss.config, best.config), best


def change_label(old: Plan, new: Plan) -> str:
    """'recompute=full, micro_batch=1': the knobs of FIT_KNOBS where `new` differs."""
    values = [("recompute", old.recompute, new.recompute), ("zero", old.zero, new.zero),
              ("micro_batch", old.micro_batch, new.micro_batch),
              ("sp", old.sp, new.sp), ("schedule", old.schedule_label(), new.schedule_label()),
              ("offload", old.offload, new.offload)]
    parts = [f"{k}={'on' if b is True else 'off' if b is False else b}"
             for k, a, b in values if a != b]
    return ", ".join(parts) or "a different layer split"


__all__ = ["FIT_KNOBS", "layout_pinned", "answer_pinned", "cheapest_fit", "change_label"]
