"""The training loop's hooks for mixtures of experts (meshtron/model/moe.py).

* The auxiliary loss of each micro-batch is weighted like its loss (`set_accum_scale`: 1/M for
  M accumulated micro-batches; pipeline schedules scale every gradient by 1/M themselves).
* DeepSeek-V3's bias balancing moves the sigmoid routers' bias once per optimizer step on the
  load counted since the last step, summed over the data-parallel ranks so every rank applies
  the same update (`update_bias`; DeepSeek-V3 report, section 2.1.2).
* Router statistics for metrics.jsonl at logging points (`router_record`): the imbalance
  (max / mean load over the experts of a layer, on the data-parallel ranks' summed load) as the
  max and the mean over the MoE layers, the load per expert (`moe_load`: each expert's share
  of the routed slots, over all MoE layers), dropped tokens (0: dropless routing) and the mean
  auxiliary loss. They describe the step's last micro-batch; curves.png draws them.

Everything stays on the device except `router_record`'s one read at a logging point.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist


def moe_layers(parts: Iterable[torch.nn.Module]) -> list[Any]:
    """The MoE feed-forward modules of the model parts, in module order."""
    from meshtron.model.moe import MoE

    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def set_accum_scale(layers: list[Any], scale: float) -> None:
    for m in layers:
        m.accum_scale = scale


def update_bias(parts: list[torch.nn.Module], group=None,
                compute: list[torch.nn.Module] | None = None) -> None:
    """After the optimizer step: the balancing bias update of every sigmoid router, its load
    summed over `group` (the data-parallel ranks; None: one process). `compute`: the bf16
    compute copy of `parts` (meshtron/train/precision.py) whose forwards counted the load; the
    fp32 bias of `parts` moves and is copied into it (as FSDP2 casts the fp32 bias each step)."""
    from meshtron.model.moe import update_router_bias

    masters = moe_layers(parts)
    copies = moe_layers(compute) if compute is not None else []
    for master, copy in zip(masters, copies):
        master.load_since_update = copy.load_since_update
    reduce = (lambda t: dist.all_reduce(t, group=group)) if group is not None else None
    for part in parts:
        update_router_bias(part, reduce=reduce)
    with torch.no_grad():
        for master, copy in zip(masters, copies):
            if master.router.expert_bias is not None:
                copy.router.expert_bias.copy_(master.router.expert_bias)


def router_record(layers: list[Any], spec: Any, device: torch.device, dp_group=None,
                  dp: int = 1, pp_group=None) -> dict[str, float]:
    """moe_imbalance_max / _mean, moe_dropped, moe_aux_loss (module docstring) over every MoE
    layer of the model (`spec`: its ModelSpec): loads summed over `dp_group`, layers gathered
    over `pp_group`. A collective on every rank of those groups; one host read."""
    f64 = torch.float64
    stats = [m.last_stats for m in layers if m.last_stats]
    aux_on = spec.moe_aux_loss > 0
    load = torch.zeros(0, spec.moe_experts, dtype=f64, device=device)
    aux = torch.zeros(0, dtype=f64, device=device)
    dropped = torch.zeros(1, dtype=f64, device=device)
    if stats:  # (none: a pipeline stage of dense blocks only)
        load = torch.stack([s["load"] for s in stats]).to(f64)
        dropped = torch.stack([s["dropped"] for s in stats]).to(f64).sum().reshape(1)
        if aux_on:
            aux = torch.stack([s["aux_loss"] for s in stats]).to(f64)
    if dp_group is not None and dp > 1 and stats:
        dist.all_reduce(load, group=dp_group)
        dist.all_reduce(dropped, group=dp_group)
        if aux_on:
            dist.all_reduce(aux, group=dp_group)
            aux = aux / dp
    if stats:
        imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
        sums = torch.stack([imbalance.sum(), imbalance.new_tensor(float(len(stats))),
                            aux.sum(), dropped[0]])
        sums = torch.cat([sums, load.sum(dim=0)])  # + tokens per expert over the layers
        top = imbalance.max().reshape(1)
    else:
        sums = torch.zeros(4 + spec.moe_experts, dtype=f64, device=device)
        top = torch.zeros(1, dtype=f64, device=device)
    if pp_group is not None:
        dist.all_reduce(sums, group=pp_group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=pp_group)
    values = torch.cat([sums, top]).tolist()
    imb_sum, n, aux_sum, dropped_n = values[:4]
    per_expert, imb_max = values[4:-1], values[-1]
    if n == 0:
        return {}
    total = sum(per_expert) or 1.0
    out = {"moe_imbalance_max": imb_max, "moe_imbalance_mean": imb_sum / n,
           "moe_dropped": int(dropped_n),
           # share of the routed slots each expert received, summed over the MoE layers
           "moe_load": [round(x / total, 6) for x in per_expert]}
    if aux_on:
        out["moe_aux_loss"] = aux_sum / n
    return out
