"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from meshtron.config import OptimConfig


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices (embeddings and projections); leave norms and biases alone, as in GPT-2/3
    and Llama training recipes."""
    decay, no_decay, seen = [], [], set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return _split_plain_from_dtensors(groups)


def _split_plain_from_dtensors(groups: list[dict]) -> list[dict]:
    """Fused and foreach AdamW take one kind of tensor per group: where DTensors and plain
    tensors mix (tensor parallelism without FSDP on a mixture of experts, whose experts stay
    plain: parallel/tensor.py's `_moe_plan`) each group is split in two; otherwise unchanged."""
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for g in groups for p in g["params"]}
    if len(kinds) < 2:
        return groups
    split = [dict(g, params=[p for p in g["params"] if isinstance(p, DTensor) == kind])
             for g in groups for kind in (True, False)]
    # no empty halves: torch's distributed checkpoint (set_optimizer_state_dict) loads at most
    # one group without parameters
    return [g for g in split if g["params"]]


def adamw_kernel(device_type: str) -> dict[str, bool]:
    """The fastest AdamW implementation for the device: `fused` (one kernel over all
    parameters) on CPU and CUDA, `foreach` (batched per-op kernels) elsewhere. Element-wise, so
    the update of a parameter shard equals the update of those elements of the whole tensor:
    every layout, and the single-process reference, use the same choice and stay comparable."""
    return {"fused": True} if device_type in ("cpu", "cuda") else {"foreach": True}


def build_adamw(modules: Iterable[nn.Module], cfg: OptimConfig,
                device_type: str = "cpu") -> torch.optim.AdamW:
    params = (p for module in modules for p in module.parameters())
    return torch.optim.AdamW(param_groups(params, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **adamw_kernel(device_type))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR so the schedule's position is a state dict like every other piece."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cfg.lr_factor(step, total_steps))
