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

`forward_backward` hides pipeline vs no pipeline: it takes this data-parallel rank's local batch
(`inputs`, `targets` of shape [global_batch/dp, seq]; every rank of a tp/pp group passes the
same rows; stages that do not need them ignore them), splits it into micro-batches of
`plan.micro_batch` sequences (gradient accumulation, or pipeline micro-batches), runs forward
and backward, and returns the loss as a 0-d tensor on the mesh's device: the mean over the
global batch, identical on all ranks (no host synchronisation: call `float()` on it when the
number is needed, e.g. only on logging steps). Gradients equal those of that global mean. (Exact when every micro-batch holds the same
number of loss tokens, i.e. no padding/ignore_index.)

State for checkpointing: `pm.model_parts` (the modules this rank owns, parameter names are the
plain model's names), `pm.state_dict()` / `pm.load_state_dict()` (DCP-ready, reshardable),
and the optimizer's `state_dict()` / `load_state_dict()` (via DCP's get/set_optimizer_state_dict).
All communication runs on the named process groups of `mesh`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from meshtron.errors import UserError
from meshtron.model.init import clean_name
from meshtron.parallel.data_parallel import (
    apply_data_parallel,
    replaces_fsdp_reduction,
    set_microbatch_policy,
    zero1_optimizer,
)
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.mesh import data_mesh, expert_meshes, mesh_axes, resolve_plan
from meshtron.planner.placement import axis_sizes
from meshtron.planner.plan import Plan, as_plan, microbatch_problem
from meshtron.runtime import batch_to_device
from meshtron.parallel.context import apply_context_parallel, shard_batch
from meshtron.parallel.pipeline import build_schedule, pipeline_stage, split_model
from meshtron.parallel.offload import activation_offload
from meshtron.parallel.recompute import apply_recompute
from meshtron.parallel.tensor import apply_tensor_parallel


def _default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from meshtron.model.transformer import cross_entropy_loss

    return cross_entropy_loss(logits, targets)


def _mesh_device(mesh) -> torch.device:
    dtype = mesh.device_type
    if dtype == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, dtype, None)
    if mod is not None and hasattr(mod, "current_device"):
        return torch.device(dtype, mod.current_device())
    return torch.device(dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _set_aux_weight(model: nn.Module, scale: float) -> None:
    from meshtron.model.moe import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.accum_scale = scale


class ParallelModel:
    """A model parallelized over a mesh. Build with `parallelize`."""

    def __init__(self, model_parts: list[nn.Module], stage_ids: list[int], layout: Plan, mesh,
                 loss_fn: Callable, device: torch.device):
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.layout = layout
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.device = device
        self._schedules: dict[int, Any] = {}
        self._stages = None
        self.grad_sync = None
        """meshtron.compress.runtime.GradCompression when the plan compresses gradients."""
        self.fp8_all_gather = False
        """FSDP2 gathers FP8 weights (tensorwise FP8 on CUDA): call `after_optimizer_step`."""

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def is_pipelined(self) -> bool:
        return self.layout.pp > 1

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return (self.layout.num_stages - 1) in self.stage_ids if self.is_pipelined else True

    def _loss_context(self):
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _schedule(self, n_micro: int):
        if n_micro not in self._schedules:
            if self._stages is None:
                pp_group = self.mesh.get_group("pp")
                self._stages = [pipeline_stage(m, s, self.layout, pp_group, self.device)
                                for s, m in zip(self.stage_ids, self.model_parts)]
            self._schedules[n_micro] = build_schedule(self._stages, self.layout, n_micro,
                                                      self.loss_fn)
        return self._schedules[n_micro]

    # ---- training step ------------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward + backward on this data-parallel rank's rows; returns the global-mean loss
        (a detached 0-d tensor: reading it is the caller's host synchronisation)."""
        loss = self._run(inputs, targets, backward=True)
        self._align_grad_placements()
        if self.grad_sync is not None:
            self.grad_sync.sync()
        return loss

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only (the pipeline schedules' `eval`); returns the global-mean loss (0-d).
        Leaves the parameters sharded, as a training step does (see `reshard`)."""
        with torch.no_grad():
            loss = self._run(inputs, targets, backward=False)
        self.reshard()
        return loss

    def reshard(self) -> None:
        """Free every FSDP2 unit's unsharded parameters and register the sharded ones again.

        Units with `reshard_after_forward=False` (ZeRO-2 blocks, the root unit) are resharded
        by FSDP2 only at the end of backward. A forward-only pass has no backward, so it would
        leave them unsharded and *registered on the module*: `named_parameters()` would then
        yield the unsharded tensors instead of the sharded ones the optimizer holds (DCP's
        `get_optimizer_state_dict` fails with `KeyError` mapping optimizer ids to names) and
        the rank would keep full parameters in memory until the next backward. Idempotent: a
        no-op for units already sharded (ZeRO-3, or after a training step)."""
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, backward: bool) -> torch.Tensor:
        lay = self.layout
        local_batch = inputs.shape[0]
        if local_batch % lay.micro_batch:
            raise UserError(f"plan.micro_batch={lay.micro_batch}: must divide the per-rank batch "
                             f"{local_batch} (global batch / dp)")
        n_micro = local_batch // lay.micro_batch
        problem = microbatch_problem(lay.schedule, lay.pp, lay.virtual_stages, n_micro)
        if problem:
            raise UserError(problem)
        if lay.cp > 1:
            # Every rank of a cp group gets the same rows; it keeps its two chunks of each
            # sequence (head/tail load balancing, meshtron/parallel/context.py), sliced before
            # the copy to the device so only seq/cp tokens travel there.
            shard = shard_batch(inputs, targets, lay.cp, self.mesh.get_local_rank("cp"))
            inputs, targets = shard.tokens, shard.targets
        inputs = batch_to_device(inputs, self.device)  # no host wait (meshtron/runtime.py)
        targets = batch_to_device(targets, self.device)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        # MoE auxiliary losses weighted like their micro-batch's loss (1/M; the pipeline
        # schedules scale every gradient by 1/M themselves), as one process does.
        for part in self.model_parts:
            _set_aux_weight(part, 1.0 if self.is_pipelined else 1.0 / n_micro)
        with self._loss_context():
            if self.is_pipelined:
                sched = self._schedule(n_micro)
                run = sched.step if backward else sched.eval
                losses: list[torch.Tensor] = []
                args = (inputs,) if self.has_first_stage else ()
                if self.has_last_stage:
                    run(*args, target=targets, losses=losses)
                    total = torch.stack([_plain(l).detach().float() for l in losses]).mean()
                else:
                    run(*args)
            else:
                model = self.model_parts[0]
                for i, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
                    if backward:  # one reduction per step, or per micro-batch (ZeRO-2/3)
                        set_microbatch_policy(self.model_parts, lay, last=i == n_micro - 1)
                    # The default loss is the model's own, chunked over tokens (model/loss.py).
                    with activation_offload(lay.offload_activations and backward,
                                            self.device):
                        loss = (model(x, y) if self.loss_fn is _default_loss
                                else self.loss_fn(model(x), y))
                    if backward:
                        (loss / n_micro).backward()
                    total = total + _plain(loss).detach().float() / n_micro
        # Loss lives on the last pipeline stage: sum over pp (others add 0), mean over dp (and
        # cp: every cp rank holds seq/cp tokens of each row, so the mean of the ranks' means is
        # the global token mean).
        total = total.reshape(1).clone()
        if self.is_pipelined:
            dist.all_reduce(total, group=self.mesh.get_group("pp"))
        if lay.dp * lay.cp > 1:
            dist.all_reduce(total, group=self._loss_group())
            total /= lay.dp * lay.cp
        return total[0]

    def _loss_group(self):
        """`_loss_mesh`'s process group, looked up once: slicing a DeviceMesh builds a new one
        (host work on its rank tensor) on every call, i.e. every step."""
        if getattr(self, "_loss_pg", None) is None:
            self._loss_pg = self._loss_mesh().get_group()
        return self._loss_pg

    def _loss_mesh(self):
        """The ranks over which the loss is averaged: "dp", or "dp_cp" with context
        parallelism (build_mesh made both; `_flatten` returns them without a new group)."""
        if self.layout.cp > 1:
            return self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return data_mesh(self.mesh)

    @torch.no_grad()
    def _align_grad_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements. Under TP, DTensor leaves some
        gradients Partial (norm weights with sequence parallelism: one all-reduce pending) or
        Replicate on a Shard parameter (the vocabulary-parallel embedding); the optimizer,
        gradient clipping and checkpoints then all see gradients laid out like parameters."""
        from torch.distributed.tensor import DTensor

        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and (
                    tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh):
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def zero_grad(self) -> None:
        for part in self.model_parts:
            part.zero_grad(set_to_none=True)

    def parameters(self):
        for part in self.model_parts:
            yield from part.parameters()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their total norm over the whole model (all tp/pp/dp shards);
        returns the total norm (before clipping), identical on every rank."""
        total = grad_norm(self, norm_type)
        if max_norm is not None and max_norm > 0:
            # As torch.nn.utils.clip_grad_norm_: multiply by min(1, max_norm / (norm + 1e-6)),
            # a tensor, so the step needs no host synchronisation; one foreach kernel per
            # (device, dtype) on the local shards (scaling every shard scales the DTensor).
            coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
            by_kind: dict[tuple[Any, Any], list[torch.Tensor]] = {}
            for p in self.parameters():
                if p.grad is not None:
                    g = _local(p.grad)
                    by_kind.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), grads in by_kind.items():
                torch._foreach_mul_(grads, coef.to(device))
        return total

    def after_optimizer_step(self) -> None:
        """After every optimizer step: FP8 weight scales for the next all-gather (a no-op
        unless `fp8_all_gather`)."""
        if self.fp8_all_gather:
            from meshtron.parallel.fp8 import after_optimizer_step

            after_optimizer_step(self.model_parts)

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model state of the parts this rank owns, keyed by the plain model's names (DTensor
        values: pass to torch.distributed.checkpoint.save; reshardable on load)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        out: dict[str, Any] = {}
        for part in self.model_parts:
            out.update(get_model_state_dict(part))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of this rank's parameters, keyed by plain-model names. A collective
        over each parameter's mesh: every rank of the same pipeline stage must call it."""
        out = {}
        for part in self.model_parts:
            for name, p in part.named_parameters():
                out[clean_name(name)] = _plain(p).detach().clone()
        return out


@torch.no_grad()
def grad_norm(pm: ParallelModel, norm_type: float = 2.0) -> torch.Tensor:
    """Total gradient norm across every shard of the model (tp, dp shards and pp stages).

    Per parameter the local gradient contributes |g|^p once per distinct shard: local sums are
    grouped by DTensor mesh and placements, all-reduced over the mesh dims on which the gradient
    is sharded (Shard) and not over those where it is replicated; then summed over pp.
    Partial gradients are reduced first (forward_backward already aligns them)."""
    from torch.distributed.tensor import DTensor, Replicate

    inf = math.isinf(norm_type)
    groups: dict[Any, torch.Tensor] = {}
    plain_total = torch.zeros((), dtype=torch.float32, device=pm.device)
    for p in pm.parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl
                                                   for pl in g.placements])
            local = g.to_local().float()
            key = (id(g.device_mesh), tuple(g.placements))
            val = local.abs().max() if inf else local.norm(norm_type) ** norm_type
            val = val.to(pm.device, non_blocking=True)  # offload='full': host gradients
            if key not in groups:
                groups[key] = (g.device_mesh, g.placements, torch.zeros_like(val))
            mesh, placements, acc = groups[key]
            groups[key] = (mesh, placements, torch.maximum(acc, val) if inf else acc + val)
        else:
            local = g.float()
            val = local.abs().max() if inf else local.norm(norm_type) ** norm_type
            plain_total = torch.maximum(plain_total, val) if inf else plain_total + val
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = plain_total.reshape(1).clone()
    for mesh, placements, acc in groups.values():
        acc = acc.reshape(1).clone()
        for dim, pl in enumerate(placements):
            if not isinstance(pl, Replicate) and mesh.size(dim) > 1:
                dist.all_reduce(acc, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, acc) if inf else total + acc
    if pm.layout.pp > 1:
        # get_group("pp"), not mesh["pp"]: no submesh built per step
        dist.all_reduce(total, op=op, group=pm.mesh.get_group("pp"))
    return total[0] if inf else total[0] ** (1.0 / norm_type)


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
    pm = ParallelModel(parts, [s for s, _ in pieces], lay, mesh, loss_fn or _default_loss,
                       device)
    pm.fp8_all_gather = fp8_gather
    from meshtron.compress.runtime import attach

    pm.grad_sync = attach(pm, lay)
    return pm


class ParallelOptimizer(torch.optim.Optimizer):
    """One optimizer per model part (pipeline virtual stages), stepped together. A
    torch.optim.Optimizer, so LR schedulers work on it: its `param_groups` are the parts'
    (live: still the right dicts after `load_state_dict`).

    `zero1_owners[i][j]`: under compressed ZeRO-1 (meshtron.compress reduces the gradients),
    the data-parallel rank that owns (keeps the state of and updates) parameter j of model part
    i; empty otherwise (plain ZeRO-1 is FSDP2: the states are sharded with the parameters)."""

    def __init__(self, pm: ParallelModel, optimizers: list[torch.optim.Optimizer],
                 zero1_owners: list[list[int]] | None = None):
        self.pm = pm
        self.optimizers = list(optimizers)
        self.zero1_owners = zero1_owners or []
        # Optimizer.__init__ sets up the hooks and `state`; the groups it would build are the
        # inner optimizers' already (see `param_groups` and `add_param_group`).
        self._registering = True
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, dict(self.optimizers[0].defaults))
        self._registering = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizers' groups, read afresh on every access: their
        `load_state_dict` replaces the group dicts, and LR schedulers must keep writing to the
        live ones (a list captured at construction would go stale after a checkpoint load)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        if self._registering and not value:
            return  # Optimizer.__init__ starting its own list: the groups live in the parts
        live = self.param_groups
        if len(value) != len(live) or any(a is not b for a, b in zip(value, live)):
            raise AttributeError("ParallelOptimizer.param_groups are the inner optimizers' "
                                 "groups; change those (or their entries), not the list")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._registering:
            return  # Optimizer.__init__ registering a parameter an inner optimizer holds
        raise RuntimeError("ParallelOptimizer: add parameter groups to the inner "
                           "optimizers (`optimizers[i].add_param_group`)")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pm.zero_grad()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Flat DCP state: "state.<param fqn>.<name>" tensors and "param_groups.<param fqn>.<key>"
        hyper-parameters, one entry per parameter. Flat because ranks hold different
        parameters (pipeline stages, ZeRO-1 shards): a nested `param_groups` list is one
        non-tensor value that DCP would save from one rank only, and the others could not load
        it. Keys are plain-model names, so the state reshards across layouts."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        out: dict[str, Any] = {}
        for part, o in zip(self.pm.model_parts, self.optimizers):
            out.update(get_optimizer_state_dict(part, o, options=options))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state from `state_dict()` (after `dcp.load` into it). Each inner optimizer
        reads the entries of its own parameters. Nested (unflattened) states load too."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(strict=False, flatten_optimizer_state_dict=True)
        for part, o in zip(self.pm.model_parts, self.optimizers):
            set_optimizer_state_dict(part, o, state_dict, options=options)


def build_optimizer(pm: ParallelModel, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8, weight_decay: float = 0.0,
                    optimizer_cls: type = torch.optim.AdamW, **kwargs: Any) -> ParallelOptimizer:
    """AdamW (or `optimizer_cls`) over `pm.model_parts`. Under ZeRO-1/2/3 the parameters are
    FSDP2 shards, so the optimizer states are sharded with them; with compressed ZeRO-1 or
    DiLoCo (meshtron.compress reduces the replicated gradients) ZeRO-1 shards the optimizer by
    whole parameters (`zero1_optimizer`)."""
    opt_kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    lay = pm.layout
    optimizers, owners = [], []
    for part in pm.model_parts:
        params = [p for p in part.parameters() if p.requires_grad]
        if lay.zero == 1 and lay.dp > 1 and replaces_fsdp_reduction(lay):
            opt, owner = zero1_optimizer(params, data_mesh(pm.mesh).get_group(), optimizer_cls,
                                         **opt_kwargs)
            optimizers.append(opt)
            owners.append(owner)
        else:
            optimizers.append(optimizer_cls(params, **opt_kwargs))
    return ParallelOptimizer(pm, optimizers, owners)
