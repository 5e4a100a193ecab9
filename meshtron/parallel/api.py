"""`parallelize(model, plan, mesh)`: 3-D parallelism for users with their own training loop.

    mesh = build_mesh(plan)                      # after init_process_group
    pm = parallelize(Transformer(spec), plan, mesh)
    opt = build_optimizer(pm, lr=3e-4)
    for inputs, targets in batches:              # this data-parallel rank's rows
        loss = pm.forward_backward(inputs, targets)  # global-batch mean, same on every rank
        pm.clip_grad_norm_(1.0)
        opt.step(); opt.zero_grad()

Order of application (fixed): pipeline split -> expert parallel (ep > 1: routed experts
sharded over the ep ranks, tokens exchanged by all-to-all, meshtron/parallel/expert.py) ->
tensor/sequence parallel -> activation checkpointing -> context parallel (cp > 1) -> per-block
torch.compile (plan.compile, meshtron/parallel/compile.py) -> data
parallel (FSDP2 per ZeRO stage; over dp_shard x cp with context parallelism; the routed experts
over what ep leaves of it) -> pipeline stages and schedule.

With plan.cp > 1 `forward_backward` still takes whole sequences (every rank of a cp group the
same rows) and keeps this rank's two chunks of each (meshtron/parallel/context.py).

The parallelized model: meshtron/parallel/parallel_model.py; its optimizer:
meshtron/parallel/optimizer.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from meshtron.errors import UserError
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.data_parallel import apply_data_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.mesh import expert_meshes, mesh_axes, resolve_plan
from meshtron.parallel.parallel_model import ParallelModel, default_loss
from meshtron.parallel.pipeline import split_model
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.planner.placement import axis_sizes
from meshtron.planner.plan import as_plan


def _mesh_device(mesh) -> torch.device:
    dtype = mesh.device_type
    if dtype == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, dtype, None)
    if mod is not None and hasattr(mod, "current_device"):
        return torch.device(dtype, mod.current_device())
    return torch.device(dtype)


def parallelize(model: nn.Module, plan: Any, mesh, loss_fn: Callable | None = None,
                fill: Callable[[list[nn.Module]], None] | None = None,
                allocate: bool = True) -> ParallelModel:
    """Apply the plan's pipeline, tensor/sequence, recompute and data parallelism to `model`.

    `model` is a `meshtron.model.Transformer` (or follows its conventions), built identically on
    every rank (same seed); it is consumed (its modules are sharded and moved into the stages).
    `mesh` comes from `build_mesh(plan)`. `loss_fn(logits, targets)` defaults to the model's
    mean cross-entropy; under tp>1 it runs inside `loss_parallel()` on vocabulary-sharded logits.

    A model built on the meta device (`with torch.device("meta"): Transformer(spec)`) is sharded
    while still on meta; then only this rank's shards are allocated and filled: by
    `fill(model_parts)` when given (e.g. `meshtron.hf.load_into`), else with the model's
    deterministic initialization, equal to the single-process one (meshtron/model/init.py).
    `allocate=False` leaves a meta-built model's shards on meta: the caller materializes them
    (`meshtron rehearse` does, under FakeTensorMode, after sharding outside it: DeviceMesh and
    DTensor need real tensors while they shard).
    """
    spec = getattr(model, "spec", None)
    lay = resolve_plan(as_plan(plan), mesh.size(), spec)
    sizes = axis_sizes(lay)
    axes = mesh_axes(lay)
    want = tuple(sizes[a] for a in axes)
    if tuple(mesh.mesh_dim_names or ()) != axes or tuple(mesh.shape) != want:
        raise UserError(f"mesh {tuple(mesh.mesh_dim_names or ())} {tuple(mesh.shape)}: does not "
                         f"match the plan's {axes} {want}; build it with build_mesh(plan)")
    device = _mesh_device(mesh)
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model.to(device)  # offload='full': fully_shard moves the shards to the host
    if lay.pp > 1:
        pieces = split_model(model, lay, mesh.get_local_rank("pp"))
    else:
        pieces = [(0, model)]
    tp_mesh = mesh["tp"]
    experts = expert_meshes(mesh) if lay.ep > 1 else None
    if lay.ep > 1 and experts is None:
        raise UserError(f"plan.ep={lay.ep}: the mesh has no expert axis; build it with "
                         "build_mesh(plan)")
    if lay.async_tp:  # before anything compiles: the inductor pass must see every block
        from meshtron.parallel.compile import enable_async_tp

        enable_async_tp(tp_mesh)
    parts = []
    fp8_gather = False
    for _, part in pieces:
        if experts is not None:  # before TP: the experts are DTensors on the ep mesh
            apply_expert_parallel(part, experts.ep, global_counts=False)
        if lay.dtype == "fp8":  # before TP, recompute and FSDP2 (torchtitan's order)
            from meshtron.parallel.fp8 import convert_to_fp8, fp8_all_gather

            fp8_gather = fp8_all_gather(lay.fp8_recipe, device, lay.dp_shard * lay.cp)
            convert_to_fp8(part, lay.fp8_recipe, device, all_gather=fp8_gather)
        apply_tensor_parallel(part, tp_mesh, sp=lay.sp)
        apply_recompute(part, lay.recompute)
        if lay.cp > 1:  # after TP and recompute, before FSDP (torchtitan's order)
            apply_context_parallel(part, mesh["cp"].get_group())
        if lay.compile:  # per block, after TP and recompute, before FSDP (torchtitan's order)
            from meshtron.parallel.compile import apply_compile

            # Under TP a compiled region that holds the checkpoint fails on torch 2.13 (AOT
            # autograd is handed the DeviceMesh to save); the checkpoint then runs eagerly
            # around the compiled block (selective recompute + TP + compile: refused,
            # plan_rules.compile_runtime_problem).
            apply_compile(part, inside_checkpoint=lay.tp > 1 and lay.recompute != "none")
        apply_data_parallel(part, mesh, lay)
        parts.append(part)
    if on_meta and allocate:
        from meshtron.model.init import materialize

        materialize(parts, device, fill=fill,
                    param_device=torch.device("cpu") if lay.offload == "full" else None)
    elif fill is not None:
        fill(parts)
    pm = ParallelModel(parts, [s for s, _ in pieces], lay, mesh, loss_fn or default_loss,
                       device)
    pm.fp8_all_gather = fp8_gather
    from meshtron.compress.runtime import attach

    pm.grad_sync = attach(pm, lay)
    return pm
