"""Exact bytes of the gradient-compression and DiLoCo state on every rank of a meshtron run, from
the plan alone (no torch): memory.json's "compress" bytes, predicted as meshtron/compress/
allocates them, so the run's measured bytes (ParallelEngine.memory_bytes) match byte for byte.

What meshtron/compress/ holds per rank (the planner's per-parameter view of the same state is
compression.extra_state_bytes: 4 B per element of error feedback, 4 or 8 B of DiLoCo):

* error feedback (collectives.py `Reducer`, grad_compression bf16 or int8, a group of more than
  one rank whose reduction crosses nodes): one fp32 residual per bucket, the size of the
  padded buffer the codec encodes. Compressed ZeRO-0/1 (runtime.py `GradCompression.sync`):
  one all-reduce bucket per model part over "dp_replicate", n rows of
  padded_len(ceil(P / n), block) for P local gradient elements (`Reducer._all_reduce_flat`);
  ZeRO-2/3: one reduce-scatter bucket per FSDP2 unit over "dp_shard", n rows of
  padded_len(S, block) for the unit's padded shard of S elements (`Reducer.reduce_scatter`);
  with compress_scope='inter_node' only the inter-node hop keeps one (nodes rows, of the
  1/per_node slice for an all-reduce);
* DiLoCo (diloco.py `DiLoCo`): theta_global and, with outer momentum > 0 (the paper's 0.9 from
  H = 500; none below), the momentum, fp32 copies of the rank's local parameters (4 or 8 B per
  element), and with compression the outer all-reduce's residual
  over "dp_replicate" (one bucket of all local parameters).
"""

from __future__ import annotations

import math
from typing import Any

from meshtron.model.spec import ModelSpec
from meshtron.planner.compression import outer_copies
from meshtron.planner.memory_ranks import (FP32, FROZEN, _stage_ranges, local_shape,
                                           param_shapes, stages_of_rank)

_EMBEDDINGS = ("tok_embeddings.", "pos_embeddings.")
"""The first stage's FSDP2 unit before the blocks (parallel/data_parallel.py `_shard_part`)."""


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple  # compress/quant.py padded_len


def _group(place: Any, rank: int, axis: str) -> list[int]:
    """Global ranks of `rank`'s group along mesh `axis`, in group order."""
    mine = place.coords(rank)
    members = [r for r in range(place.world_size)
               if all(v == mine[k] for k, v in place.coords(r).items() if k != axis)]
    return sorted(members, key=lambda r: place.coords(r)[axis])


def _topology(plan: Any, members: list[int]) -> tuple[int, int, bool]:
    """(per_node, nodes, compressed) of a reduction over `members` (collectives.build_topology;
    ranks_per_node unset: one machine, torchrun's LOCAL_WORLD_SIZE = the world)."""
    if plan.compress_scope != "inter_node":
        return 1, 1, len(members) > 1
    rpn = plan.ranks_per_node or (plan.tp * (plan.cp or 1) * plan.pp * plan.dp)
    nodes = len({r // rpn for r in members})
    return len(members) // nodes, nodes, nodes > 1


def _residual(plan: Any, members: list[int], numel: int, layout: str) -> int:
    """fp32 elements of one bucket's residual (collectives.Reducer._geometry)."""
    per_node, nodes, compressed = _topology(plan, members)
    if plan.grad_compression == "none" or not compressed:
        return 0
    mult = plan.grad_compression_block if plan.grad_compression == "int8" else 1
    hier = per_node > 1 and nodes > 1
    n = nodes if hier else len(members)
    if layout == "reduce_scatter":  # numel: the unit's shard
        return n * _padded(numel, mult)
    length = -(-numel // per_node) if hier else numel
    return n * _padded(-(-length // n), mult)


def _units(names: list[str]) -> list[list[int]]:
    """Indices of a part's parameters per FSDP2 unit: embeddings, each block, the rest (final
    norm and head; parallel/data_parallel.py)."""
    units: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if name.startswith("layers."):
            key = "layers." + name.split(".")[1]
        else:
            key = "emb" if name.startswith(_EMBEDDINGS) else "head"
        units.setdefault(key, []).append(i)
    return list(units.values())


def compress_bytes(spec: ModelSpec, plan: Any, dtype: str = "fp32") -> list[int]:
    """Bytes of compression / DiLoCo state per global rank (module doc); zeros without them."""
    from meshtron.planner.placement import placement

    tp, pp, cp = plan.tp, plan.pp, plan.cp or 1
    v = plan.virtual_stages or 1
    place = placement(plan, tp * cp * pp * plan.dp)
    if plan.grad_compression == "none" and not plan.diloco:
        return [0] * place.world_size
    dp_shard = place.size("dp_shard") * cp
    fsdp = plan.dp * cp > 1 or dtype == "bf16"
    ranges = _stage_ranges(plan, spec.layers)
    out = []
    for rank in range(place.world_size):
        c = place.coords(rank)
        r_shard = c["dp_shard"] * cp + c.get("cp", 0)
        replicas = _group(place, rank, "dp_replicate")
        elements = total = 0
        for s in stages_of_rank(pp, v, plan.schedule or "1f1b", c["pp"]):
            shapes = [(n, sh) for n, sh in param_shapes(spec, ranges[s], s == 0, s == pp * v - 1)
                      if not n.endswith(FROZEN)]
            numels = [math.prod(local_shape(n, sh, tp, c["tp"], dp_shard, r_shard, fsdp))
                      for n, sh in shapes]
            total += sum(numels)
            if plan.diloco:
                continue
            if plan.zero <= 1:
                elements += _residual(plan, replicas, sum(numels), "all_reduce")
                continue
            shard = [math.prod(local_shape(n, sh, tp, c["tp"], dp_shard, 0, True))
                     for n, sh in shapes]  # FSDP2 pads every shard to the first's size
            for unit in _units([n for n, _ in shapes]):
                elements += _residual(plan, _group(place, rank, "dp_shard"),
                                      sum(shard[i] for i in unit), "reduce_scatter")
        if plan.diloco:  # theta_global, and the outer momentum where it is > 0
            elements = outer_copies(plan) * total + _residual(plan, replicas, total,
                                                              "all_reduce")
        out.append(FP32 * elements)
    return out


def snapshot_extra_bytes(spec: ModelSpec, plan: Any, dtype: str = "fp32") -> list[int]:
    """Bytes per global rank that compression / DiLoCo add to a snapshot or checkpoint shard
    (the checkpointer's EngineState extras, meshtron/checkpoint/snapshot.py): the state
    `compress_bytes` counts, plus what `state_dict` adds to it. Compressed reduction
    (compress/runtime.py GradCompression.state_dict): each rank's own residual per bucket
    (rank_entries.own_key) and the group's mean residual, per local parameter (ZeRO-0/1) or,
    ZeRO-2/3, per FSDP2 unit over the whole unsharded reduce-scatter input
    (Reducer.mean_residual: `numel` elements, dp_shard padded shards). DiLoCo (compress/
    diloco.py DiLoCo.state_dict): theta_global, momentum, own residual, a mean residual per
    local parameter (zeros when uncompressed) and its int64 step counter."""
    from meshtron.planner.placement import placement

    state = compress_bytes(spec, plan, dtype)
    if plan.grad_compression == "none" and not plan.diloco:
        return state
    tp, pp, cp = plan.tp, plan.pp, plan.cp or 1
    v = plan.virtual_stages or 1
    place = placement(plan, tp * cp * pp * plan.dp)
    dp_shard = place.size("dp_shard") * cp
    fsdp = plan.dp * cp > 1 or dtype == "bf16"
    ranges = _stage_ranges(plan, spec.layers)
    out = []
    for rank, own in enumerate(state):
        c = place.coords(rank)
        r_shard = c["dp_shard"] * cp + c.get("cp", 0)
        mean = 0
        for s in stages_of_rank(pp, v, plan.schedule or "1f1b", c["pp"]):
            shapes = [(n, sh) for n, sh in param_shapes(spec, ranges[s], s == 0, s == pp * v - 1)
                      if not n.endswith(FROZEN)]
            if plan.diloco or plan.zero <= 1:  # one mean residual per local parameter
                mean += sum(math.prod(local_shape(n, sh, tp, c["tp"], dp_shard, r_shard, fsdp))
                            for n, sh in shapes)
                continue
            shard = [math.prod(local_shape(n, sh, tp, c["tp"], dp_shard, 0, True))
                     for n, sh in shapes]
            mean += dp_shard * sum(shard)  # every unit's whole padded input
        out.append(own + FP32 * mean + (8 if plan.diloco else 0))
    return out


def checkpoint_extra_per_param(plan: Any, ranks_per_node: int | None = None
                               ) -> tuple[float, str]:
    """(bytes per model parameter, what they are) that compression / DiLoCo add to one disk
    checkpoint of the whole job, beyond the model and AdamW's 12: DCP writes an entry that
    every data-parallel rank holds alike once, an entry under a rank's own key once per rank.
    The group's mean residual (4 B; saved by DiLoCo also uncompressed), DiLoCo's theta_global
    and outer momentum (8 B; 4 without momentum), and every rank's own error-feedback residual
    (rank_entries.own_key: 4 B per parameter of its stage; with compress_scope='inter_node' across several ranks of a
    node, 1/per_node of it: Reducer._geometry): 4 B x the ranks holding one per parameter, the
    data-parallel group's size (its nodes for the hierarchical split). What a resume needs to
    continue bit for bit (compress/runtime.py); `ranks_per_node`: the machines' node size when
    the plan sets none."""
    from meshtron.planner.placement import placement

    if plan.grad_compression == "none" and not plan.diloco:
        return 0.0, ""
    world = plan.tp * (plan.cp or 1) * plan.pp * plan.dp
    axis = "dp_replicate" if plan.diloco or plan.zero <= 1 else "dp_shard"
    members = _group(placement(plan, world), 0, axis)
    if ranks_per_node and not plan.ranks_per_node:
        plan = plan.replace(ranks_per_node=ranks_per_node)
    per_node, nodes, compressed = _topology(plan, members)
    holders = 0 if plan.grad_compression == "none" or not compressed else \
        nodes if per_node > 1 and nodes > 1 else len(members)
    outer = 4.0 * outer_copies(plan)
    parts = ["4 the group's mean residual"] + (
        [f"{outer:g} DiLoCo's outer copy" + (" and momentum" if outer > 4 else "")]
        if plan.diloco else [])
    if holders:
        parts.append(f"{4 * holders} the own error-feedback residual of each of {holders} "
                     f"{'nodes' if holders == nodes and per_node > 1 else 'ranks'}")
    return 4.0 + outer + 4.0 * holders, ", ".join(parts)
