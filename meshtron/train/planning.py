"""Plan resolution: from a ParallelRequest and the run config to one validated Plan.

Runs before any rank starts, so a plan that does not fit the world size or the model fails
with one line and no process left behind. Takes typed values only (no argparse objects).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from meshtron.config import RunConfig
from meshtron.errors import UserError
from meshtron.train.job import ParallelRequest


def local_cluster(world_size: int, cluster: str | None):
    """The cluster to plan for (`choose_cluster` on this node)."""
    return cluster_choice(world_size, cluster).cluster


def cluster_choice(world_size: int, cluster: str | None):
    """`choose_cluster` for this node's device (imports torch unless `cluster` is given)."""
    from meshtron.calibrate.cli import default_cluster_path
    from meshtron.calibrate.device import NodeDevice, this_node

    node = NodeDevice("cpu", "cpu") if cluster else this_node()
    return choose_cluster(world_size, cluster, node, default_cluster_path(world_size))


def _noted(cluster, source: str):
    """A chosen cluster whose source also says when its calibration was noisy."""
    from meshtron.calibrate.saved import Chosen

    note = cluster.noise_note()
    return Chosen(cluster, f"{source}; {note}" if note else source)


def choose_cluster(world_size: int, cluster: str | None, node, calibration: Path):
    """The cluster for `world_size` local ranks on `node` (a calibrate.device.NodeDevice) and
    where its figures come from (a `Chosen`): `cluster` as given; else the calibration file
    `calibration` when it was measured on this node's device; else, on a GPU node, the
    catalogue's figures for the detected GPU (its own memory); else the nominal CPU figures
    (CPU only; flagged by their name). A calibration of another device is not used, and the
    source says so."""
    from meshtron.calibrate.saved import Chosen, applies, describe, measured_on
    from meshtron.planner.cluster import nominal_cpu_cluster, resolve_cluster

    if cluster:
        return _noted(resolve_cluster(cluster), f"--cluster {cluster}")
    ignored = ""
    if calibration.is_file():
        record = measured_on(calibration)
        if applies(record, node):
            measured = resolve_cluster(str(calibration))
            if node.kind == "cpu":  # a calibration written before `cpu = true` was recorded
                measured = dataclasses.replace(measured, cpu=True)
            return _noted(measured, f"{describe(record)} ({calibration})")
        ignored = f"; {calibration} is {describe(record)}, not this node's {node.name}: not used"
    if node.kind == "cuda":
        from meshtron.calibrate.device import detected_cluster

        clus = detected_cluster(node.name, node.memory_bytes or 0, world_size,
                                node.local_ranks or world_size)
        return Chosen(clus, f"catalogue figures for the detected {node.name} (not calibrated: "
                            f"`meshtron calibrate` measures it){ignored}")
    return Chosen(nominal_cpu_cluster(world_size),
                  "nominal CPU figures (not calibrated: `meshtron calibrate` measures this "
                  f"machine){ignored}")


def is_plan_file(text: str | None) -> bool:
    """`--plan` names a saved plan (not 'auto' or a layout)."""
    return bool(text) and text != "auto" and (text.endswith(".toml") or Path(text).is_file())


def requested_compression(request: ParallelRequest | None) -> str:
    """The gradient compression a run will use: a saved plan's, else --grad-compression (or
    the resumed run's, in `request.comm`); one process compresses nothing. The search never
    chooses it (Knobs carries no traffic knob)."""
    if request is None:
        return "none"
    if is_plan_file(request.plan):
        from meshtron.planner.plan import load_plan

        return load_plan(request.plan).grad_compression
    return request.comm.get("grad_compression", "none")


def local_world_size(request: ParallelRequest) -> int:
    """Local ranks to start: --nproc, else the size of a saved plan (a plan for 8 ranks runs on
    8 without restating it; an explicit --nproc that contradicts it fails in
    `resolve_run_plan`), else 1."""
    if request.nproc is not None:
        return request.nproc
    if is_plan_file(request.plan):
        from meshtron.planner.plan import load_plan

        return load_plan(request.plan).gpus
    return 1


def check_local_plan_size(request: ParallelRequest, nproc: int) -> None:
    """A saved plan given without --nproc starts its own size here (`local_world_size`): one
    larger than this machine is named as the plan's, not as an --nproc the user never typed
    (a user audit: `train --plan p70.toml` said '--nproc=128: allowed 1..32')."""
    from meshtron.launch import max_local_ranks

    limit = max_local_ranks()
    if request.nproc is None and is_plan_file(request.plan) and nproc > limit:
        raise UserError(f"--plan {request.plan}: the plan is for {nproc} ranks (plan.gpus) and "
                        f"this machine starts at most {limit} local ranks; run it on its "
                        "cluster (torchrun or srun starting `meshtron train --plan` on every "
                        "node) or plan for this machine")


def check_saved_plan(cfg: RunConfig, request: ParallelRequest) -> None:
    """A saved plan (--plan FILE) checked against this run's model, batch, sequence and flags
    before its size starts anything: a plan for another model is named as that, not as a rank
    count this machine cannot start (a user audit: a 70B plan given with --model llama3-8b was
    told only that --nproc=64 exceeds the machine)."""
    if is_plan_file(request.plan) and request.resumed_plan is None:
        _saved_plan(cfg, request)


def fixed_knobs(plan: str | None, zero: int | None, recompute: str | None, sp: str | None,
                micro_batch: int | None, schedule: str | None) -> dict[str, Any]:
    """Knobs fixed by flags; a layout given as `plan` fixes its axes."""
    from meshtron.planner.plan import fixed_knobs as parse

    layout = plan if plan and plan != "auto" and not is_plan_file(plan) else None
    return parse(layout, zero, recompute, sp, micro_batch, schedule)


def same_model(plan_model: str, spec) -> bool:
    """A plan's `model` (a preset, a config.json path or a name) describes `spec`."""
    from meshtron.model.spec import resolve_model

    if plan_model == spec.name:
        return True
    try:
        other = resolve_model(plan_model)
    except UserError:
        return False
    same = {"name": "", "train_notes": ()}  # notes: a config.json's warnings, not the model
    return {**other.to_dict(), **same} == {**spec.to_dict(), **same}


def resolve_run_plan(cfg: RunConfig, request: ParallelRequest, world_size: int,
                     cluster=None):
    """Returns (Plan, ClusterSpec): a saved plan checked against this run, or the planner's
    best plan for this world with the fixed knobs, on `cluster` (None: `local_cluster`)."""
    cluster = cluster or local_cluster(world_size, request.cluster)
    from meshtron.compress.cli import apply as apply_comm

    kept = _resumed_plan(cfg, request, world_size)
    if kept is not None:
        plan = apply_comm(kept, request.comm, saved=True)
    elif is_plan_file(request.plan):
        plan = apply_comm(_saved_plan(cfg, request), request.comm, saved=True)
    else:
        from meshtron.planner.comm_flags import refuse_unread

        refuse_unread(request.comm)
        plan = apply_comm(_searched_plan(cfg, request, world_size, cluster), request.comm,
                          saved=False)
    if cfg.train.compile and not plan.compile:  # --compile on a saved eager plan: the plan
        plan = dataclasses.replace(plan, compile=True)  # the ranks run (and plan.toml) says so
    # The runtime's own checks (world size, heads, kv_heads, layers, schedule traps, what
    # compiles: plan.py `runtime_problem`); the planner's, which parallel.resolve_plan calls
    # too: the launcher imports no torch for them.
    plan.validate(world_size, cfg.model)
    if plan.async_tp:  # before any rank starts: the ranks pick the device the same way
        from meshtron.calibrate.device import cuda_available
        from meshtron.parallel.compile import async_tp_problem

        problem = async_tp_problem("cuda" if cuda_available() else "cpu")
        if problem:
            raise UserError(problem)
    return plan, cluster


def _resumed_plan(cfg: RunConfig, request: ParallelRequest, world_size: int):
    """The checkpoint's own plan when a `--resume` gives no layout (`request.resumed_plan`) and
    this world has the run's size, else None (the planner chooses; a line says why). The
    planner's answer may have moved since the run started (a calibration file, another
    meshtron): a silently different layout (pp=2 x dp=2 resumed as dp=4) is a resharded
    resume, not the same run; torchtitan and Megatron-LM resume on the job's own config."""
    import sys

    from meshtron.planner.plan import Plan

    if request.resumed_plan is None:
        return None
    plan = Plan.from_dict(request.resumed_plan)
    if plan.gpus != world_size:
        print(f"meshtron train: --resume: the checkpoint's plan is for {plan.gpus} ranks, this "
              f"launch has {world_size}: the planner chooses again (the checkpoint reshards)",
              file=sys.stderr)
        return None
    print(f"meshtron train: --resume: continuing on the checkpoint's plan ({plan.describe()}); "
          f"--plan LAYOUT chooses another", file=sys.stderr)
    return plan


def _saved_plan(cfg: RunConfig, request: ParallelRequest):
    from meshtron.planner.plan import load_plan

    plan = load_plan(request.plan)
    for name, want in (("global_batch", cfg.data.global_batch), ("seq_len", cfg.data.seq_len)):
        if getattr(plan, name) != want:
            raise UserError(f"data.{name}={want}: the saved plan {request.plan} has "
                            f"{name}={getattr(plan, name)}; drop the flag or edit the plan")
    if not same_model(plan.model, cfg.model):
        raise UserError(f"plan.model={plan.model!r}: the run trains {cfg.model.name!r}")
    for knob, value in request.knobs.items():  # flags may restate the saved plan, not change it
        if getattr(plan, knob) != value:
            raise UserError(f"--{knob.replace('_', '-')}={value}: the saved plan has "
                            f"{knob}={getattr(plan, knob)}; edit the plan or drop the flag")
    return plan


def _one_process_hint(knobs: dict[str, Any], world_size: int) -> str:
    """What a user who gave a layout without --nproc needs to hear: the layout asks for more
    ranks than the one process `meshtron train` runs then (a user audit's `--plan dp=2` alone
    was told only "must divide the world size 1")."""
    if world_size != 1:
        return ""
    ranks = 1
    for axis in ("tp", "cp", "pp", "dp"):
        ranks *= knobs.get(axis) or 1
    return (f"; without --nproc (or a torchrun / srun world) one process runs: --nproc {ranks} "
            f"starts {ranks} local ranks")


def _searched_plan(cfg: RunConfig, request: ParallelRequest, world_size: int, cluster):
    from meshtron.planner.frameworks import preset
    from meshtron.planner.search import search_plans

    knobs = request.knobs
    for axis in ("tp", "cp", "pp", "dp"):
        if axis in knobs and world_size % knobs[axis]:
            raise UserError(f"plan {axis}={knobs[axis]}: must divide the world size {world_size}"
                            + _one_process_hint(knobs, world_size))
    given = [knobs.get(a) for a in ("tp", "pp", "dp")]
    cp = knobs.get("cp") or 1
    if all(given) and given[0] * given[1] * given[2] * cp != world_size:
        what = "dp*tp*pp" if cp == 1 else "dp*tp*cp*pp"
        sizes = [given[2], given[0]] + ([cp] if cp > 1 else []) + [given[1]]
        raise UserError(f"plan {what}={'*'.join(map(str, sizes))}="
                        f"{given[0] * given[1] * given[2] * cp}: must equal the world size "
                        f"{world_size}" + _one_process_hint(knobs, world_size))
    sized = sized_cluster(cluster, world_size)
    if sized.num_gpus != world_size:
        raise UserError(f"cluster {cluster.name}: has {cluster.num_gpus} devices, the run "
                        f"has {world_size} ranks")
    # The run's precision is not a knob to search: predict for the dtype the run uses (FP8
    # emulated on a device without an FP8 peak is planned as the bf16 it computes at).
    dtype = cfg.train.dtype
    fixed = {k: v for k, v in _runnable(knobs, cfg).items() if k != "offload_activations"}
    if dtype == "fp8":
        fixed["fp8_recipe"] = cfg.train.fp8_recipe
        from meshtron.planner.cluster import gpu_type

        if sized.gpu is None or gpu_type(sized.gpu).fp8_tflops is None:
            dtype = "bf16"
            fixed.pop("fp8_recipe")
    # the run's clipping decides whether the optimizer step pays the norm and scale passes
    options = dataclasses.replace(preset("meshtron").kernel, grad_clip=cfg.optim.grad_clip > 0)
    # the data-parallel traffic flags priced in the search (search.py `_priced`; top_k=1 kept
    # only plans without them before, audit s55): plan.toml's
    # [predicted] is the compressed / DiLoCo plan the ranks run
    result = search_plans(cfg.model, sized, cfg.data.global_batch, cfg.data.seq_len,
                          {**fixed, **request.comm, "dtype": dtype}, top_k=1, explain=False,
                          options=options)
    best = result.best
    if best is None:
        near = result.near_miss
        if near is None and result.refused:  # not memory: every point broke a rule (as
            # `meshtron plan` says, report_warnings.render_no_fit), e.g. pp=2 on one micro-batch
            raise UserError(f"plan={request.plan!r}: no plan of {world_size} ranks runs for "
                            f"model {cfg.model.name}: {result.refused}")
        need = f"; the leanest plan needs {near.memory.total:.2f} GiB per rank" if near else ""
        raise UserError(f"plan={request.plan!r}: no plan fits {world_size} ranks of "
                        f"{sized.memory_gib:.1f} GiB for model {cfg.model.name}{need}")
    # a cluster file by its path (a calibration's stem, e.g. 'local-1', resolves nowhere:
    # `cost --plan RUN/plan.toml` refused it)
    plan = best.to_plan(cfg.model.name, cluster.file or cluster.name, world_size,
                        cfg.data.global_batch, cfg.data.seq_len,
                        attention=result.options.attention)
    if plan.dtype != cfg.train.dtype:  # FP8 priced as bf16 above: the plan the ranks run (and
        # plan.toml) carries the precision the user asked for, as a one-process run trains it
        plan = dataclasses.replace(plan, dtype=cfg.train.dtype,
                                   fp8_recipe=cfg.train.fp8_recipe or plan.fp8_recipe)
    ep = knobs.get("ep") or 1
    if ep > 1 and plan.ep != ep:  # a search that does not place ep itself: the given ep
        plan = dataclasses.replace(plan, ep=ep)
    if knobs.get("offload_activations"):  # not a search knob: the runtime's choice
        plan = dataclasses.replace(plan, offload_activations=True)
    return plan


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
