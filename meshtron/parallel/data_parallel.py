"""Data parallelism mapped from the plan's ZeRO stage to real PyTorch mechanisms.

ZeRO stage -> mechanism (Rajbhandari et al. 2020 for the stages):

- zero 3: FSDP2 `fully_shard` per block and on the model (part) root, over the "dp_shard" axis,
  `reshard_after_forward=True`: parameters, gradients and optimizer states sharded; parameters
  all-gathered for forward and again for backward.
- zero 2: the same with `reshard_after_forward=False`: parameters stay unsharded from forward to
  backward (no second all-gather); gradients reduce-scattered and optimizer states sharded.
  (FSDP2 frees the unsharded parameters after backward, so between steps parameters are
  sharded too: ZeRO-2 communication volume and peak, plus sharded parameters at rest.)
- zero 1: parameters and gradients replicated over the "dp_replicate" axis (FSDP2 on a
  (dp_replicate=dp, dp_shard=1) mesh: its replicate path all-reduces gradients, like DDP), and
  the optimizer sharded across the data axis: each data-parallel rank owns whole parameters
  (greedy balance by size), keeps AdamW state for those only, updates them and broadcasts them
  to the other data-parallel ranks (`build_optimizer` does this; the idea of PyTorch's
  ZeroRedundancyOptimizer, written so that it also works on DTensor (tensor-parallel) parameters
  by broadcasting each rank's local shard inside its data-parallel group).
- zero 0: replicated data parallelism: FSDP2 on the (dp_replicate=dp, dp_shard=1) mesh, i.e.
  gradients all-reduced and every rank runs the full optimizer (what DDP does; FSDP2's replicate
  path is used because DDP does not compose with DTensor tensor parallelism).
- with plan.dp_replicate = r > 1 and zero 2/3: HSDP (replicate over r, shard over dp/r).

Gradients are averaged over the data-parallel ranks (FSDP2's default), so with a per-rank mean
loss they equal the single-process gradient of the global-batch mean.

Mixed precision (plan.dtype='bf16'): FSDP2 MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32): bf16 compute, fp32 master parameters, gradients and optimizer states. With
dp=1 and bf16 FSDP2 is still applied (on the size-1 data axis) to get that policy.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from meshtron.errors import UserError


def data_parallel_mesh(mesh, lay):
    """The mesh FSDP2 runs on: 1-D "dp_shard" or 2-D ("dp_replicate", "dp_shard") for HSDP."""
    if lay.replicas > 1:  # the mesh's "dp_replicate" axis (all of dp for zero 0/1)
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def apply_data_parallel(model: nn.Module, mesh, lay, reshard_root: bool | None = None) -> nn.Module:
    """Apply FSDP2 to `model` (a Transformer or pipeline chunk) per the layout's ZeRO stage.

    With compressed ZeRO-0/1 or DiLoCo, meshtron.compress reduces the "dp_replicate" axis
    itself: FSDP2 then runs on "dp_shard" only (size 1 for zero 0/1, kept for the bf16 policy)."""
    from meshtron.compress.runtime import replaces_fsdp_reduction

    own_reduction = replaces_fsdp_reduction(lay)
    if (lay.dp == 1 or (own_reduction and lay.dp_shard == 1)) and lay.dtype == "fp32":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh["dp_shard"] if own_reduction else data_parallel_mesh(mesh, lay)
    if lay.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    reshard = lay.zero == 3 and lay.dp_shard > 1
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root (embeddings, final norm, head) is needed again right at the start of backward.
    fully_shard(model, mesh=dp_mesh,
                reshard_after_forward=reshard if reshard_root is None else reshard_root,
                mp_policy=mp)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _partition(params: list[nn.Parameter], n: int) -> list[int]:
    """Owner (0..n-1) of each parameter: largest first onto the least-loaded owner."""
    load = [0] * n
    owner = [0] * len(params)
    order = sorted(range(len(params)), key=lambda i: (-_local(params[i]).numel(), i))
    for i in order:
        j = min(range(n), key=lambda k: (load[k], k))
        owner[i] = j
        load[j] += _local(params[i]).numel()
    return owner


def zero1_optimizer(params: Iterable[nn.Parameter], dp_group, optimizer_cls=torch.optim.AdamW,
                    **optim_kwargs: Any) -> tuple[torch.optim.Optimizer, list[int]]:
    """ZeRO-1: an optimizer over the parameters this data-parallel rank owns, plus a post-step
    hook that broadcasts every owner's updated parameters over `dp_group` and drops the
    gradients of the parameters owned elsewhere. Returns (optimizer, owner of each parameter).

    The optimizer is a plain `optimizer_cls` instance (its `state_dict()` holds this rank's
    shard only), so DCP's get/set_optimizer_state_dict work on it.
    """
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    params = [p for p in params if p.requires_grad]
    n = dist.get_world_size(dp_group)
    me = dist.get_rank(dp_group)
    owner = _partition(params, n)
    mine = [p for p, o in zip(params, owner) if o == me]
    if not mine:
        raise UserError(f"plan.zero=1: data-parallel rank {me} owns no parameters "
                         f"({len(params)} parameters over {n} ranks)")
    opt = optimizer_cls(mine, **optim_kwargs)
    by_owner = [[p for p, o in zip(params, owner) if o == j] for j in range(n)]

    @torch.no_grad()
    def _broadcast_updates(optimizer, args, kwargs):
        for j, group_params in enumerate(by_owner):
            if not group_params:
                continue
            locals_ = [_local(p) for p in group_params]
            if j == me:
                flat = _flatten_dense_tensors(locals_)
            else:
                flat = torch.empty(sum(t.numel() for t in locals_), dtype=locals_[0].dtype,
                                   device=locals_[0].device)
            dist.broadcast(flat, src=dist.get_global_rank(dp_group, j), group=dp_group)
            if j != me:
                for t, new in zip(locals_, _unflatten_dense_tensors(flat, locals_)):
                    t.copy_(new)
        for p, o in zip(params, owner):
            if o != me:
                p.grad = None

    opt.register_step_post_hook(_broadcast_updates)
    return opt, owner
