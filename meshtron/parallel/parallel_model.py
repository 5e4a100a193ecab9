"""ParallelModel: a model parallelized over a mesh (built by `parallelize`,
meshtron/parallel/api.py), its training step, gradient clipping over every shard (`grad_norm`)
and its checkpoint state.

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
from meshtron.model.loss import release_anchors
from meshtron.parallel.context import shard_batch
from meshtron.parallel.data_parallel import set_microbatch_policy
from meshtron.parallel.mesh import data_mesh
from meshtron.parallel.offload import activation_offload
from meshtron.parallel.pipeline import (
    build_schedule,
    pipeline_stage,
    splits_backward,
    step_options,
)
from meshtron.planner.plan import Plan, microbatch_problem
from meshtron.runtime import batch_to_device


def default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from meshtron.model.transformer import cross_entropy_loss

    return cross_entropy_loss(logits, targets)


def stage_loss(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function when the last stage returns its loss itself (the model's
    chunked loss, `ParallelModel._stage_computes_loss`): that loss, as it is."""
    return loss


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

    @property
    def _stage_computes_loss(self) -> bool:
        """The last stage returns the model's own loss (`model(h, targets)`: chunked over tokens
        in the compute dtype with an fp32 softmax and fp32 weight-gradient sum, meshtron/model/
        loss.py), exactly what one process computes, instead of logits for the schedule's
        loss function: with the default loss and no tensor parallelism (whose vocabulary-
        sharded head keeps the whole-logits loss in both, model/transformer.py `loss`). The
        whole-logits loss is another computation in bf16 (whole bf16 logits, the head's
        weight gradient from one bf16 GEMM where the chunked loss sums it in fp32): a bf16
        1F1B run was 8.7e-6 off one process's gradient norm at step 1 (user audit,
        2026-12-05); with this, 0."""
        return self.loss_fn is default_loss and self.layout.tp == 1

    def _schedule(self, n_micro: int):
        if n_micro not in self._schedules:
            if self._stages is None:
                pp_group = self.mesh.get_group("pp")
                self._stages = [pipeline_stage(m, s, self.layout, pp_group, self.device)
                                for s, m in zip(self.stage_ids, self.model_parts)]
                if self._stage_computes_loss and splits_backward(self.layout):
                    for part in self.model_parts:
                        if part.output is not None:
                            part.output.split_backward = True
            loss_fn = stage_loss if self._stage_computes_loss else self.loss_fn
            self._schedules[n_micro] = build_schedule(self._stages, self.layout, n_micro,
                                                      loss_fn)
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
        if self.is_pipelined:
            # torch 2.11's first stage checks each micro-batch's strides against the
            # contiguous ones it inferred at the first step (pipelining/stage.py
            # `_validate_fwd_input`): a slice of a [batch, seq + 1] token buffer, strides
            # (seq + 1, 1), raised PipeliningShapeError there (tests/test_parallel.py; 2.13
            # took it). No copy when contiguous already, as meshtron's own data is.
            inputs, targets = inputs.contiguous(), targets.contiguous()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        # MoE auxiliary losses weighted like their micro-batch's loss (1/M; the pipeline
        # schedules scale every gradient by 1/M themselves), as one process does.
        for part in self.model_parts:
            _set_aux_weight(part, 1.0 if self.is_pipelined else 1.0 / n_micro)
        with self._loss_context():
            if self.is_pipelined:
                sched = self._schedule(n_micro)
                for part in self.model_parts:  # the last step's zero-bubble loss nodes
                    if part.output is not None:
                        release_anchors(part.output)
                run = sched.step if backward else sched.eval
                losses: list[torch.Tensor] = []
                args = (inputs,) if self.has_first_stage else ()
                if self.has_last_stage:
                    # the targets also as the stages' keyword: torch passes kwargs to every
                    # stage of this rank; only the one with the output head uses them
                    given = {"targets": targets} if self._stage_computes_loss else {}
                    run(*args, target=targets, losses=losses, **given, **step_options(sched))
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
                        loss = (model(x, y) if self.loss_fn is default_loss
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
