"""The optimizer of a ParallelModel: one inner optimizer per model part (pipeline virtual stages),
stepped together, with a flat DCP state; `build_optimizer` picks AdamW (or another class) and
ZeRO-1 by whole parameters where meshtron.compress reduces the gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from meshtron.parallel.data_parallel import replaces_fsdp_reduction, zero1_optimizer
from meshtron.parallel.mesh import data_mesh

if TYPE_CHECKING:
    from meshtron.parallel.parallel_model import ParallelModel


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
            # a factory (train/parallel.py's) makes its own groups (train/optim.param_groups)
            groups = _one_kind_per_group(params) if isinstance(optimizer_cls, type) else params
            optimizers.append(optimizer_cls(groups, **opt_kwargs))
    return ParallelOptimizer(pm, optimizers, owners)


def _one_kind_per_group(params: list) -> list[dict[str, Any]]:
    """The parameters as one group, or two where DTensors and plain tensors mix (tensor
    parallelism without FSDP on a mixture of experts: the experts stay plain tensors,
    parallel/tensor.py `_moe_plan`), since fused and foreach AdamW refuse a group of both
    ("got mixed torch.Tensor and DTensor"); train/optim.param_groups splits the same way."""
    from torch.distributed.tensor import DTensor

    dist = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": g} for g in (dist, plain) if g] or [{"params": params}]
