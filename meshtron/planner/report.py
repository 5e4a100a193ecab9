"""Human (rich) and machine (JSON) output of a plan search: the JSON and its schema here, the
table and `render` in planner/report_table.py, the warnings of a pinned layout and the
explanation of a model that fits nowhere in planner/report_warnings.py, number formatting and
the lines they share in planner/report_format.py (all re-exported below: callers' one import).

The table fits 100 columns by default (`render(..., wide=False)`): layout, knobs, memory of
the fullest GPU against capacity, step time, tokens/s, MFU and days; the best plan's time and
memory breakdown follow on their own lines. `wide=True` (`meshtron plan --wide`) adds the
breakdowns per plan, hardware FLOP/s and GPU-hours. Numbers are never cut short: columns wrap
rather than end in an ellipsis. Every output states the cost model's options (all fields of
KernelOptions, e.g. the attention kernel and the software stack) and the run precision.

JSON schema "meshtron-plan-search/3" (`meshtron plan --json`)::

    {
      "schema": "meshtron-plan-search/3",
      "model": {"name": str, "params": int, "layers": int, "hidden": int, "heads": int,
                "kv_heads": int, "vocab": int},
      "cluster": {ClusterSpec fields..., "num_gpus": int},
      "global_batch": int, "seq_len": int, "tokens": float,      # tokens = training budget
      "options": {every KernelOptions field: "attention", "dropout", ..., "dtype": str},
      "framework": {"name", "era", "models", "source", "reduce_dtype", "overrides": {...},
                    "kernel": {KernelOptions}, "memory": {MemoryOptions but dtype}},
      "fits": bool,                                               # the best plan fits
      "pinned": bool,             # the knobs leave one layout and nothing of it fits: plans
                                  # = [its leanest candidate priced as candidates are (the
                                  # time-balanced layer split), "fits": false]
      "fit_change": {"change": str,                               # pinned: the fastest plan
                     "fixed_changed": {knob: [pinned, fits]},     # of the layout that fits
                     "searched_changed": {knob: [pinned, fits]},  # with one fixed knob freed
                     plan object} | null,                         # (else all of them)
      "warnings": [str],          # "... cannot split this pinned layout ...: priced instead
                                  # on ...", "predicted not to fit: ..."
      "memory_checked": str|null, # what the stack's memory figure was checked against
                                  # (report.memory_check; null: nothing)
      "evaluated": int,           # full evaluations, the searches for fit_change included
      "feasible": int, "search_time_s": float,
      "notes": [str],                                             # knob families left out, why
      "conventions": [str],       # how to read a number as the stack means it (the MFU
                                  # column's full attention square; Megatron-Core's zero 2-3 =
                                  # Megatron-FSDP): report_table.convention_notes
      "plans": [                  # best first, at most --top; every one fits unless "pinned"
        {"rank": int, "tp": int, "pp": int, "dp": int, "ep": int, "zero": int, "micro_batch": int,
         "num_microbatches": int, "recompute": str, "sp": bool,
         "schedule": str|null,                                    # null when pp = 1
         "virtual_stages": int, "dp_replicate": int, "dtype": str,
         "pipeline_runs": int,                                    # only when > 1
         "stage_layers": [int],
         "split": {"layers_per_stage": [int], "even": bool,      # pp > 1 only: the layers per
                   "why": str},                                 # rank and why (the plan's
                                                                # own, the stack's rule, or
                                                                # memory: split_text)
         "fits": bool,                                            # memory <= capacity (and
                                                                  # the host's, with offload)
         "memory_gib": {"params", "grads", "optimizer", "activations", "logits",
                        "workspace", "total", "capacity": float, "stage": int,
                        "host": float,                            # per node, host offload
                        "host_capacity": float|null},             # usable; null: unknown
         "time_s": {"compute", "tp_comm", "pp_comm", "dp_comm_exposed", "bubble",
                    "optimizer", "ep_comm": float,                # exact 0.0 when absent
                    "offload", "step_host", "fp8_sync": float},   # only when > 0
                    # (step_host: Composer's train-metric sync, planner/composer_metrics.py;
                    # fp8_sync: delayed scaling's amax all-reduces, planner/fp8_amax.py)
         "step_time_s": float, "tokens_per_s": float,
         "model_tflops_per_gpu": float, "hardware_tflops_per_gpu": float,
         "mfu": float, "hfu": float,                              # fractions of peak
         "days": float, "gpu_hours": float, "cost": float|null}   # for `tokens`
      ],
      "alternatives": [{"family": str, "reason": str, "fits": bool, "layout": str|null,
                        "step_time_s": float|null, "memory_gib": float|null}],
      "near_miss": plan object (as above, fits = false) | null    # only when nothing fits:
                                  # the least memory any candidate needs, on the layer split
                                  # that minimises it ("needs at least")
    }

Version 3 also carries `conventions` (added 2026-12-06; readers of version 3 ignore it).
Version 3 (was 2): a pinned layout that does not fit is answered (`plans` holds it with
"fits": false; top-level "fits" is false), and `pinned`, `fit_change` and `warnings` are new.
Version 2 (was 1): `schedule` is null without a pipeline, plans carry `dtype` and
`dp_replicate`, `options` carries `dtype`, and `notes` is new.
"""

from __future__ import annotations

from typing import Any

from meshtron.planner.estimate import Estimate
from meshtron.planner.report_format import (  # noqa: F401  (re-exported for callers)
    HEADLINE_OPTIONS, breakdown_line, fmt_count, fmt_days, fmt_s, fmt_tokens, framework_of,
    host_text, layers_per_gpu, memory_line, options_dict, options_line)
from meshtron.planner.report_table import (  # noqa: F401  (re-exported for callers)
    ATTENTION_SHARE_NOTED, convention_notes, header, mfu_note, render, table_notes, tight_note)
from meshtron.planner.report_warnings import (  # noqa: F401  (re-exported for callers)
    memory_check, need_text, pinned_warning, render_no_fit, split_warning, trust_text,
    warnings)
from meshtron.planner.search import SearchResult
from meshtron.planner.search_explain import split_text

SCHEMA = "meshtron-plan-search/3"


def to_json(result: SearchResult, tokens: float) -> dict[str, Any]:
    n = result.cluster.num_gpus
    price = result.cluster.price_per_gpu_hour
    m = result.model
    plans = []
    for i, est in enumerate(result.plans, 1):
        plans.append({"rank": i, **est.to_dict(tokens, n, price), **split_json(est)})
    return {
        "schema": SCHEMA,
        "model": {"name": m.name, "params": m.num_params(), "layers": m.layers,
                  "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "vocab": m.vocab,
                  **({"active_params": m.num_params(active=True)} if m.is_moe else {})},
        "cluster": {**result.cluster.to_dict(), "num_gpus": n},
        "global_batch": result.global_batch, "seq_len": result.seq_len, "tokens": tokens,
        "options": {**options_dict(result.options), "dtype": result.dtype},
        "framework": framework_of(result).to_dict(),
        "fits": result.fits, "pinned": result.pinned,
        "fit_change": (result.fit_change.to_dict(tokens, n, price)
                       if result.fit_change is not None else None),
        "warnings": warnings(result),
        "memory_checked": memory_check(result.framework),
        "evaluated": result.evaluated, "feasible": result.feasible,
        "search_time_s": result.seconds,
        "notes": list(result.notes),
        "conventions": convention_notes(result),
        "plans": plans,
        "alternatives": [a.to_dict() for a in result.alternatives],
        "near_miss": (result.near_miss.to_dict(tokens, n, price)
                      if result.near_miss is not None else None),
    }


def split_json(est: Estimate) -> dict[str, Any]:
    """{"split": ...} for a pipelined plan (search_explain.split_text), else {}."""
    why = split_text(est)
    if why is None:
        return {}
    per_gpu = layers_per_gpu(est)
    return {"split": {"layers_per_stage": per_gpu, "even": len(set(per_gpu)) == 1,
                      "why": why}}
