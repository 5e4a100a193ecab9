"""meshtron: plan, run, protect and explain LLM training across many GPUs.

    import meshtron
    mesh = meshtron.build_mesh(plan)               # after torch.distributed.init_process_group
    pm = meshtron.parallelize(model, plan, mesh)   # tensor/sequence, recompute, ZeRO, pipeline

Heavy submodules (torch) load on first use, so `meshtron plan` stays fast.
"""

__version__ = "0.1.0"

_LAZY = {
    "parallelize": "meshtron.parallel",
    "build_mesh": "meshtron.parallel",
    "build_optimizer": "meshtron.parallel",
    "search_plans": "meshtron.planner.search",
    "evaluate_plan": "meshtron.planner.search",
    "load_plan": "meshtron.planner.plan",
    "Plan": "meshtron.planner.plan",
    "ModelSpec": "meshtron.model.spec",
    "Transformer": "meshtron.model.transformer",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshtron' has no attribute {name!r}")
