"""Host offload in the search: tried when nothing fits in device memory, and priced against the
plans that fit when it could make them faster (planner/offload.py has its costs)."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.plan_rules import offload_kinds
from meshtron.planner.search_explain import loss_reason, search_and_explain
from meshtron.planner.search_result import Alternative, SearchResult
from meshtron.planner.search_space import SearchSpace


def with_offload(ev: Evaluator, result: SearchResult, model: ModelSpec, cluster: ClusterSpec,
                 global_batch: int, seq_len: int, knobs: Knobs, opts: KernelOptions,
                 runtime: bool, top_k: int, explain: bool,
                 framework: Any = None) -> SearchResult:
    """Nothing fits in device memory: search again with host offload, the kinds the priced
    stack runs (`_kinds`: meshtron 'full'; else 'optimizer' first, which moves less). Host offload
    is only chosen here: it only adds host-link traffic and a slower optimizer step
    (planner/offload.py), so a plan that fits without it is never slower with it at the same
    knobs."""
    host_bound = None
    for off in _kinds(ev, runtime):
        k = dataclasses.replace(knobs, offload=off)
        try:
            space = SearchSpace(model, cluster, global_batch, seq_len, k, opts, ev.mem,
                                runtime, framework, ev.traffic_knobs)
            found = search_and_explain(ev, space, top_k, explain)
        except UserError:
            continue
        if found.plans:
            found.notes.append(f"offload={off!r}: chosen because no plan fits in device "
                               "memory without host offload")
            return found
        nm = found.near_miss
        if nm is not None and nm.memory.total <= nm.memory.capacity \
                and not nm.memory.host_fits:
            host_bound = found  # offload would fit the devices but not the hosts: say so
    return host_bound if host_bound is not None else result


def offload_if_faster(ev: Evaluator, result: SearchResult, space: SearchSpace, knobs: Knobs,
                      runtime: bool, top_k: int) -> SearchResult:
    """Plans fit without host offload: price the offloaded ones too, bounded by the best plan's
    step time (only an offloaded config whose lower bound beats it is evaluated, so this costs
    little where offload cannot win), and keep one if it is faster. It can be: offload frees
    the device memory of the states, which can buy a larger micro-batch, no recomputation or
    less tensor parallelism, and on a fast host link (GH200 NVLink-C2C) that can outweigh the
    copies and the host's optimizer step."""
    best = result.plans[0]
    for off in _kinds(ev, runtime):
        k = dataclasses.replace(knobs, offload=off)
        try:
            sub = SearchSpace(ev.model, ev.cluster, ev.global_batch, ev.seq, k, ev.opts,
                              ev.mem, runtime, space.framework, ev.traffic_knobs)
            found = search_and_explain(ev, sub, top_k, False, cutoff=best.step_time_s)
        except UserError:  # the knobs leave no offloaded plan (e.g. a pipeline): nothing to add
            continue
        result.evaluated += found.evaluated
        result.enumerated += found.enumerated
        result.offload_compared = True
        cand = found.best
        if cand is None or cand.step_time_s >= best.step_time_s:
            continue
        if result.offload_best is None or cand.step_time_s < result.offload_best.step_time_s:
            result.offload_best = cand
    win = result.offload_best
    if win is not None:
        plans = sorted(result.plans + [win], key=lambda e: e.step_time_s)[:top_k]
        result.notes.append(
            f"offload={win.config.offload!r}: chosen because faster ({win.step_time_s:.4g} s "
            f"per step vs {best.step_time_s:.4g} s without host offload)")
        # the other families' reasons, now against the offloaded winner
        others = [Alternative(a.label, a.estimate, loss_reason(win, a.estimate))
                  if a.estimate is not None else a for a in result.alternatives]
        result.alternatives = [Alternative("best plan without host offload", best,
                                           loss_reason(win, best))] + others
        result.plans = plans
    return result


def _kinds(ev: Evaluator, runtime: bool) -> tuple[str, ...]:
    """The host offload kinds to try: those the priced stack's code runs (its preset's
    MemoryOptions.host_offload, plan_rules_offload.STACK_OFFLOADS), and of meshtron's runtime
    only 'full' ('optimizer' is planned only: plan.offload_runtime_problem). None on a CPU
    cluster: the ranks' memory is the host's, offload would copy the states to the same RAM."""
    if ev.cluster.cpu:
        return ()
    kinds = offload_kinds(ev.mem.host_offload)
    return tuple(k for k in kinds if k == "full") if runtime else kinds


__all__ = ["with_offload", "offload_if_faster"]
