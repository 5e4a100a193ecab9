"""Enumerate the search space, prune, rank, and explain why other families of plans lose.

Search space: tp (divides gpus_per_node, heads and kv_heads) x pp (<= layers) x dp (the rest;
must divide the global batch) x ep (mixtures of experts on a stack with expert parallelism:
divisors of the experts dividing dp/dp_replicate*cp, folded over those ranks) x micro-batch
(divides the per-replica batch) x recomputation x sequence parallelism (tp > 1) x schedule
(pp > 1: 1F1B, interleaved with v = 2, 3, 4, 6, 8 virtual stages, zero-bubble ZB-H1; GPipe only
when asked for) x ZeRO stage (dp > 1). With FlashAttention, a 'selective' recomputation that
keeps what 'none' keeps (Megatron-Core's checkpointed core in bf16: search_space.
selective_is_none) is only evaluated when fixed.

Pruning: a layout (tp, pp) whose model states cannot fit even fully sharded is evaluated once, at
its leanest setting, for the "needs X GiB" explanation; a config whose busiest rank alone, on
the split of blocks to ranks that makes it least busy (estimate_stage.busiest_rank_floor: no
bubble, no pipeline or data-parallel time; `half`'s odd parts saved only where a rank's own
count allows), is slower than both the current k-th best plan and its family's best is skipped.
The layer-cost pieces and that floor are cached per (tp, micro-batch, sp, recompute) and the
time-optimal layer split per (pp, v, layer time), so each further config costs a few dozen
float operations.

The pieces, each importing only those below it:
- search.py: `search_plans` and `evaluate_plan`, the entry points (this module);
- search_offload.py: host offload, when nothing fits or when it could be faster;
- search_explain.py: why the other families and knob values lose;
- search_bound.py: branch and bound over one space;
- search_result.py: `SearchResult` and `Alternative`;
- search_space.py: the knob values open to the search (`SearchSpace`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions, compiled
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.frameworks import for_model, for_plan, preset
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.plan import Plan
from meshtron.planner.plan_rules_fields import COMM_DEFAULTS
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.search_explain import loss_reason, search_and_explain
from meshtron.planner.search_offload import offload_if_faster, with_offload
from meshtron.planner.search_result import Alternative, SearchResult
from meshtron.planner.search_space import (DEFAULT_DTYPE, FAMILIES, MIN_CP_TOKENS,
                                           VIRTUAL_STAGES, SearchSpace, family_of, runs_ep,
                                           selective_is_none)


def search_plans(model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 fixed: Knobs | Plan | dict[str, Any] | None = None, top_k: int = 5,
                 options: KernelOptions | None = None, explain: bool = True,
                 mem: MemoryOptions | None = None, framework: Any = None) -> SearchResult:
    """Search every plan allowed by `fixed` and return the top_k fastest that fit. `framework`
    (frameworks.Framework) prices a software stack: its kernel and memory options and its
    gradient reduction dtype (unless `fixed` has one). Without it, `options` / `mem` override
    what is costed (memory.MemoryOptions; the dtype is the plan's); default meshtron's runtime,
    or for a saved Plan the stack and options it was priced with (Plan.framework). A saved
    Plan's grad_compression / diloco (or those keys of a dict) price every config the search
    evaluates (`_priced`)."""
    t0 = time.perf_counter()
    if (framework is None and options is None and mem is None and isinstance(fixed, Plan)
            and (fixed.framework is not None or fixed.framework_options)):
        framework = for_plan(fixed)
    fixed, comm = split_comm(fixed)
    knobs = Knobs.of(fixed)
    if framework is not None:
        framework = for_model(framework, model)  # the stack's MoE path (idempotent)
        options, mem = framework.kernel, framework.memory
        if knobs.reduce_dtype is None and framework.reduce_dtype != "fp32":
            knobs = dataclasses.replace(knobs, reduce_dtype=framework.reduce_dtype)
    # default: meshtron's runtime as its preset prices it (framework_presets._MESHTRON)
    opts = options or preset("meshtron").kernel
    if knobs.compile or knobs.async_tp:  # what --compile runs: compute.compiled
        opts = dataclasses.replace(compiled(opts), async_tp=opts.async_tp or bool(knobs.async_tp))
    ev = _priced(Evaluator(model, cluster, global_batch, seq_len, opts, mem=mem), comm)
    runtime = framework is None or framework.name == "meshtron"
    space = SearchSpace(model, cluster, global_batch, seq_len, knobs, opts, ev.mem, runtime,
                        framework, ev.traffic_knobs)
    if space.split_fallback is not None:  # a pinned layout the stack's rule cannot split
        ev = _priced(Evaluator(model, cluster, global_batch, seq_len, opts, mem=space.mem),
                     comm)
    result = search_and_explain(ev, space, top_k, explain)
    layouts = result.layouts  # the knobs' layouts, whichever search below answers
    if not result.plans and knobs.offload is None:
        result = with_offload(ev, result, model, cluster, global_batch, seq_len, knobs, opts,
                              runtime, top_k, explain, framework)
    elif knobs.offload is None and (cluster.gpu is not None
                                    or cluster.host_link_gb_per_s is not None):
        # a device with a host link to price (a catalogue GPU or a given link); a cluster of
        # bare numbers has no link to price: offload is only a last resort there (and never
        # on a CPU cluster: search_offload._kinds)
        result = offload_if_faster(ev, result, space, knobs, runtime, top_k)
    result.seconds = time.perf_counter() - t0
    result.framework = framework
    result.layouts = layouts
    result.split_fallback = space.split_fallback
    return result


def split_comm(fixed: Any) -> tuple[Any, dict[str, Any]]:
    """(`fixed` without, the data-parallel traffic knobs: Plan.comm_knobs of a saved plan, or
    the COMM_DEFAULTS keys of a dict). Knobs carries none (they change no layout): the
    Evaluator prices every config with them (`_priced`)."""
    if isinstance(fixed, Plan):
        return fixed, fixed.comm_knobs()
    if isinstance(fixed, dict) and any(k in COMM_DEFAULTS for k in fixed):
        comm = {k: v for k, v in fixed.items() if k in COMM_DEFAULTS}
        return {k: v for k, v in fixed.items() if k not in COMM_DEFAULTS}, comm
    return fixed, {}


def _priced(ev: Evaluator, comm: dict[str, Any]) -> Evaluator:
    """`ev` pricing every config with `comm` (gradient compression, DiLoCo: planner/
    compression.py prices their traffic and state), as `meshtron plan`'s compression note
    prices them (compression_advice.py). In the search, not after it: the search ranked the
    layouts without them and priced its top k alone, so `plan --grad-compression int8 --top 1`
    for llama3-8b on 8 H100 lost its one plan to the residuals' memory and said no layout was
    valid, where --top 5 found one (audit s55). The search's lower bound (compute only, no
    data-parallel traffic: estimate_stage.lower_bound_step) holds with them too. Only a
    block size, scope or outer settings: nothing to price."""
    if comm.get("grad_compression", "none") != "none" or comm.get("diloco"):
        ev.traffic_knobs = dict(comm)
    return ev


def evaluate_plan(model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                  fixed: Knobs | Plan | dict[str, Any], options: KernelOptions | None = None,
                  mem: MemoryOptions | None = None, framework: Any = None) -> Estimate:
    """Evaluate one plan. Knobs left open are searched (best value), so a fully fixed plan is
    evaluated as given; the result may not fit (check `.fits` and `.memory`)."""
    result = search_plans(model, cluster, global_batch, seq_len, fixed, top_k=1,
                          options=options, explain=False, mem=mem, framework=framework)
    # not fitting: priced on the split a fitting plan gets, not the memory-minimising one
    est = result.best or result.near_miss_priced
    if est is None:
        raise UserError(f"layout {Knobs.of(fixed).to_dict()}: no valid plan on "
                         f"{cluster.num_gpus} GPUs for global_batch={global_batch}")
    return est


__all__ = ["SearchResult", "Alternative", "search_plans", "evaluate_plan", "split_comm", "family_of",
           "loss_reason", "FAMILIES", "VIRTUAL_STAGES", "MIN_CP_TOKENS", "DEFAULT_DTYPE",
           "runs_ep", "selective_is_none"]
