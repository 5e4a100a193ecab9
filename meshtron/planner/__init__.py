"""meshtron's planner: find the fastest hybrid-parallel plan that fits, and explain the choice.

Python API (no torch import)::

    from meshtron.planner import Plan, search_plans, evaluate_plan, resolve_cluster, load_plan
    result = search_plans(model_spec, resolve_cluster("dgx-h100:16"), global_batch=1024,
                          seq_len=8192, fixed={"tp": 8, "dtype": "bf16"}, top_k=5)
    best = result.best                      # Estimate: .config (a Plan), .step_time_s, .memory
    plan = best.to_plan("llama3-70b", "dgx-h100:16", 128, 1024, 8192, "flash")
    plan.save("plan.toml"); load_plan("plan.toml")
    est = evaluate_plan(model_spec, cluster, 1024, 8192, plan)   # a Plan fixes every knob
    from meshtron.planner.placement import placement       # (the module keeps its own name)
    placement(plan, gpus_per_node=8).groups("tp")                # which ranks form each group

    step_collectives(plan, model_spec, 1024, 8192)  # ZeRO / pipeline collectives per rank
    search_plans(..., framework=frameworks.preset("megatron@2024"))  # price another stack

Modules: frameworks, framework_presets (--framework), collectives (step_collectives),
compression (cost of gradient compression and DiLoCo), plan (the one Plan type, its validity rules `plan_problems`, fixed Knobs), placement
(ranks of every tp / pp / dp group, nodes spanned: shared with the runtime's mesh), cluster
(GPU catalogue, ClusterSpec), compute (FLOPs, GEMM efficiency), memory (ZeRO states,
activations), comm (alpha-beta collectives over placed groups), pipeline (schedules, layer
partition), estimate (one plan's cost), search (enumeration, ranking, explanations), report
(table and JSON), cli (`meshtron plan`).
"""

from meshtron.planner.cluster import GPU_CATALOGUE, ClusterSpec, resolve_cluster
from meshtron.planner.collectives import CollectiveCount, step_collectives
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.frameworks import Framework
from meshtron.planner.placement import Placement
from meshtron.planner.plan import Plan, as_plan, load_plan, plan_problems
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.search import SearchResult, evaluate_plan, search_plans


def plan_knobs(plan: Plan) -> Knobs:
    """The fixed knobs that reproduce a saved plan (layer split aside) in `evaluate_plan`."""
    return Knobs.of(plan)


__all__ = ["ClusterSpec", "CollectiveCount", "Estimate", "Evaluator", "Framework",
           "GPU_CATALOGUE", "KernelOptions", "step_collectives",
           "Knobs", "Placement", "Plan", "SearchResult", "as_plan", "evaluate_plan", "load_plan",
           "plan_knobs", "plan_problems",
           "resolve_cluster", "search_plans"]
