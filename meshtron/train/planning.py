"""From `--plan auto | tp=..,pp=..,dp=.. | plan.toml` and the run config to one validated Plan.

Runs before any rank starts, so a plan that does not fit the world size or the model fails
with one line and no process left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtron.config import RunConfig
from meshtron.errors import UserError

# Used only to fill knobs a user left open when this machine has not been calibrated yet;
# reports then say the prediction is nominal. Figures: one CPU core's fp32 GEMM rate and
# loopback gloo, the order of magnitude `meshtron calibrate` measures on a 2-core VM.
NOMINAL_CPU_CLUSTER = {"name": "nominal-cpu", "peak_tflops": 0.05, "matmul_efficiency": 1.0,
                       "memory_gib": 4.0, "hbm_gb_per_s": 10.0, "intra_node_gb_per_s": 1.0,
                       "inter_node_gb_per_s": 1.0, "intra_node_latency_us": 500.0,
                       "inter_node_latency_us": 500.0, "bandwidth_efficiency": 1.0, "nodes": 1}


def local_cluster(world_size: int, cluster: str | None):
    """The cluster to plan for: `--cluster`, else this machine's calibration file, else the
    nominal CPU figures (flagged by their name)."""
    from meshtron.calibrate.cli import default_cluster_path
    from meshtron.planner.cluster import cluster_from_dict, resolve_cluster

    if cluster:
        return resolve_cluster(cluster)
    path = default_cluster_path(world_size)
    if path.is_file():
        return resolve_cluster(str(path))
    return cluster_from_dict({**NOMINAL_CPU_CLUSTER, "gpus_per_node": world_size})


def knobs_from_args(args: Any, cfg: RunConfig) -> dict[str, Any]:
    """Knobs the user fixed on the command line (the rest are left to the planner)."""
    from meshtron.planner.plan import fixed_knobs

    plan_arg = getattr(args, "plan", None)
    layout = plan_arg if plan_arg and plan_arg != "auto" and not _is_file_arg(plan_arg) else None
    return fixed_knobs(layout, args.zero, args.recompute, args.sp, cfg.data.micro_batch,
                       args.schedule)


def _is_file_arg(text: str) -> bool:
    return text.endswith(".toml") or Path(text).is_file()


def resolve_run_plan(cfg: RunConfig, plan_arg: str, world_size: int, knobs: dict[str, Any],
                     cluster_arg: str | None):
    """Returns (Plan, ClusterSpec): a saved plan checked against this run, or the planner's
    best plan for this world with the fixed knobs."""
    from meshtron.parallel import resolve_plan
    from meshtron.planner.plan import load_plan
    from meshtron.planner.search import search_plans

    cluster = local_cluster(world_size, cluster_arg)
    if _is_file_arg(plan_arg):
        plan = load_plan(plan_arg)
        for field, want in (("global_batch", cfg.data.global_batch), ("seq_len", cfg.data.seq_len)):
            if getattr(plan, field) != want:
                raise UserError(f"plan.{field}={getattr(plan, field)}: the run uses {want}; "
                                 f"pass --{field.replace('_', '-')} {getattr(plan, field)}")
        if plan.model != cfg.model.name and Path(plan.model).name != cfg.model.name:
            raise UserError(f"plan.model={plan.model!r}: the run trains {cfg.model.name!r}")
        for knob, value in knobs.items():  # flags may restate the saved plan, not change it
            if getattr(plan, knob) != value:
                raise UserError(f"--{knob.replace('_', '-')}={value}: the saved plan has "
                                 f"{knob}={getattr(plan, knob)}; edit the plan or drop the flag")
    else:
        for axis in ("tp", "pp", "dp"):
            if axis in knobs and world_size % knobs[axis]:
                raise UserError(f"plan {axis}={knobs[axis]}: must divide the world size "
                                 f"{world_size}")
        given = [knobs.get(a) for a in ("tp", "pp", "dp")]
        if all(given) and given[0] * given[1] * given[2] != world_size:
            raise UserError(f"plan dp*tp*pp={given[2]}*{given[0]}*{given[1]}="
                             f"{given[0] * given[1] * given[2]}: must equal the world size "
                             f"{world_size}")
        sized = sized_cluster(cluster, world_size)
        if sized.num_gpus != world_size:
            raise UserError(f"cluster {cluster.name}: has {cluster.num_gpus} devices, the run "
                             f"has {world_size} ranks")
        result = search_plans(cfg.model, sized, cfg.data.global_batch, cfg.data.seq_len,
                              _runnable(knobs, cfg), top_k=1, explain=False)
        best = result.best
        if best is None:
            near = result.near_miss
            need = f"; the leanest plan needs {near.memory.total:.2f} GiB per rank" if near else ""
            raise UserError(f"plan={plan_arg!r}: no plan fits {world_size} ranks of "
                             f"{sized.memory_gib:.1f} GiB for model {cfg.model.name}{need}")
        plan = best.to_plan(cfg.model.name, cluster.name, world_size, cfg.data.global_batch,
                            cfg.data.seq_len, attention=result.options.attention)
    # The runtime's own checks (world size, heads, kv_heads, layers, schedule traps).
    resolve_plan(plan, world_size, cfg.model)
    return plan, cluster


def sized_cluster(cluster, world_size: int):
    """A one-node view of a cluster file written for exactly this many ranks; otherwise the
    cluster as given (the caller checks the device count)."""
    return cluster.with_nodes(1) if cluster.num_gpus == world_size else cluster


def _runnable(knobs: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """Restrict the search to what the runtime executes for this model."""
    knobs = dict(knobs)
    if cfg.model.tied_embeddings and "pp" not in knobs:
        knobs["pp"] = 1  # tied embeddings across pipeline stages are not supported
    return knobs
