"""meshtron's planner: find the fastest hybrid-parallel plan that fits, and explain the choice.

Python API (no torch import)::

    from meshtron.planner import search_plans, evaluate_plan, resolve_cluster, load_plan
    result = search_plans(model_spec, resolve_cluster("dgx-h100:16"), global_batch=1024,
                          seq_len=8192, fixed={"tp": 8}, top_k=5)
    best = result.best                      # Estimate: .step_time_s, .memory, .time, .mfu ...
    plan = best.to_plan("llama3-70b", "dgx-h100:16", 128, 1024, 8192, "flash")
    plan.save("plan.toml"); load_plan("plan.toml")
    est = evaluate_plan(model_spec, cluster, 1024, 8192, plan_knobs(plan))

Modules: cluster (GPU catalogue, ClusterSpec), compute (FLOPs, GEMM efficiency), memory
(ZeRO states, activations), comm (alpha-beta collectives), pipeline (schedules, layer
partition), estimate (one plan's cost), search (enumeration, ranking, explanations), plan (the
saved Plan and fixed Knobs), report (table and JSON), cli (`meshtron plan`).
"""

from meshtron.planner.cluster import GPU_CATALOGUE, ClusterSpec, resolve_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.plan import Knobs, Plan, load_plan
from meshtron.planner.search import SearchResult, evaluate_plan, search_plans


def plan_knobs(plan: Plan) -> Knobs:
    """The fixed knobs that reproduce a saved plan (layer split aside) in `evaluate_plan`."""
    return Knobs.of(plan)


__all__ = ["ClusterSpec", "Estimate", "Evaluator", "GPU_CATALOGUE", "KernelOptions",
           "Knobs", "Plan", "SearchResult", "evaluate_plan", "load_plan", "plan_knobs",
           "resolve_cluster", "search_plans"]
