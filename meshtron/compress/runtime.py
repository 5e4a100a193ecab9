"""Compressed gradient reduction attached to a `ParallelModel`, per ZeRO stage.

- ZeRO-0/1 (replicated parameters and gradients): FSDP2 is not applied over the data axis
  (`parallel.data_parallel.replaces_fsdp_reduction`), so every rank keeps its own gradients after backward;
  `GradCompression.sync` then all-reduces them, one flat bucket per model part, with the codec
  (and the hierarchical split with compress_scope='inter_node'), and divides by dp. ZeRO-1's
  sharded optimizer is unchanged (it reads the reduced gradients).
- ZeRO-2/3 (FSDP2 sharding over "dp_shard", dp_replicate = 1): every FSDP unit's reduce-scatter
  is replaced by the compressed one (`FSDPModule.set_custom_reduce_scatter`), with FSDP told to
  SUM (`set_force_sum_reduction_for_comms`) and divide afterwards, as it does for its own. The
  all-gathers of parameters stay full precision (ZeRO++'s qwZ is not done here).
- HSDP (dp_replicate > 1 with zero 2/3) without DiLoCo is refused by the plan rules: FSDP2's
  replica all-reduce is internal.

The residuals of error feedback are checkpointed through `state_dict()` (a Stateful: pass it to
`torch.distributed.checkpoint` beside the model and optimizer), twice:
- each rank's own residual per bucket, under a key only that rank writes
  (meshtron/checkpoint/rank_entries.py): a resume on the same layout restores every rank's own
  residual and continues bit for bit with the uninterrupted run. The price: each rank writes
  4 bytes per parameter of its stage (its whole bucket), so a checkpoint grows by dp x 4 bytes
  per parameter. DeepSpeed's 1-bit Adam chose the other way and resets the compression errors
  on load rather than store O(num_gpu x model_size) (microsoft/DeepSpeed
  deepspeed/runtime/fp16/onebit/adam.py `OnebitAdam.load_state_dict`, commit b54cd03);
- the data-parallel group's mean residual, for a resume on another layout (the checkpointer
  then leaves the own entries out of its load template). ZeRO-0/1: one entry per parameter, in
  the parameter's own layout (a DTensor under tensor parallelism), so it reshards across dp and
  tp like the parameter (what the group owes is kept exactly; which rank owes it is not).
  ZeRO-2/3: one entry per FSDP unit in FSDP2's flat reduce-scatter layout, which reloads on the
  same dp and tp. Under tensor parallelism its key names the tp rank (`_mean_key`): DCP keeps
  one copy of a plain tensor that several ranks save under one key, so tp rank 1 used to load
  tp rank 0's mean (a silently wrong residual wherever the mean is loaded: a
  `--checkpoint-residuals mean` resume).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtron.checkpoint.rank_entries import MEAN_PREFIX as RESIDUAL_PREFIX
from meshtron.compress.collectives import Reducer, Topology, build_topology
from meshtron.compress.quant import Codec


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _as_param_layout(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """`local` (shaped like p's local shard) as a tensor laid out like `p` (DCP reshards it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local


def axis_groups(mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Global ranks of every group along `axes` of a `build_mesh` mesh (each in group order)."""
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh
    order = [i for i, n in enumerate(names) if n not in axes] + [names.index(a) for a in axes]
    size = 1
    for a in axes:
        size *= mesh.size(names.index(a))
    return grid.permute(order).reshape(-1, size).tolist()


def topology(mesh, axis: str, plan) -> Topology:
    """The Topology of this rank's group along mesh `axis`; with compress_scope='inter_node',
    split into nodes of plan.ranks_per_node (default: torchrun's LOCAL_WORLD_SIZE) ranks."""
    import os

    group = mesh[axis].get_group()
    rpn = None
    if plan.compress_scope == "inter_node":
        rpn = plan.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE",
                                                        dist.get_world_size()))
    return build_topology(group, axis_groups(mesh, (axis,)), rpn)


class _CompressedReduceScatter:
    """FSDP2 custom reduce-scatter (the `ReduceScatter` comm interface) through a Reducer."""

    def __init__(self, reducer: Reducer, key: str):
        self.reducer = reducer
        self.key = key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 op=None, async_op: bool = False):
        if dist.get_world_size(group) != self.reducer.topo.size:
            raise RuntimeError(f"compressed reduce-scatter: FSDP group of "
                               f"{dist.get_world_size(group)} ranks, expected "
                               f"{self.reducer.topo.size}")
        self.reducer.reduce_scatter(output_tensor, input_tensor, self.key)
        return None


def _fsdp_units(part: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch.distributed.fsdp import FSDPModule

    # Units that hold parameters, once each: the root holds none when the embeddings and the
    # head are their own units, and [norm, output] are two modules of one unit
    # (meshtron/parallel/data_parallel.py).
    out, seen = [], set()
    for name, m in part.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if fsdp_param_groups(state) and id(state) not in seen:
                seen.add(id(state))
                out.append((name, m))
    return out


def fsdp_param_groups(state) -> list:
    """The parameter groups of one FSDP2 state: `_fsdp_param_groups`, a list, on torch 2.13;
    `_fsdp_param_group`, one or None, on torch 2.11 (the H200 image), which has no list.
    Feature-detected on the object."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [] if one is None else [one]


def _fsdp_input_numel(module) -> int:
    """Elements of the unit's reduce-scatter input (FSDP2's padded flat layout)."""
    group = fsdp_param_groups(module._get_fsdp_state())[0]
    n = group.mesh_info.shard_mesh_size
    return n * sum(fp.padded_sharded_param_size.numel() for fp in group.fsdp_params)


class GradCompression:
    """Compressed data-parallel gradient reduction of one ParallelModel (see module doc)."""

    name = "compress"
    """Its checkpoint key as an engine feature (meshtron/train/features.py)."""

    def __init__(self, pm, plan):
        from meshtron.model.init import clean_name

        self.pm = pm
        self.plan = plan
        self.fsdp = plan.zero >= 2
        axis = "dp_shard" if self.fsdp else "dp_replicate"
        self.codec = Codec(plan.grad_compression, plan.grad_compression_block)
        self.reducer = Reducer(topology(pm.mesh, axis, plan), self.codec)
        self._clean = clean_name
        self.units: list[tuple[str, nn.Module]] = []
        if self.fsdp:
            for i, part in enumerate(pm.model_parts):
                for name, unit in _fsdp_units(part):
                    key = f"{pm.stage_ids[i]}.{name or 'root'}"
                    unit.set_custom_reduce_scatter(_CompressedReduceScatter(self.reducer, key))
                    unit.set_force_sum_reduction_for_comms(True)
                    self.units.append((key, unit))

    def _params(self, i: int) -> list[tuple[str, nn.Parameter]]:
        return [(self._clean(n), p) for n, p in self.pm.model_parts[i].named_parameters()
                if p.requires_grad]

    @torch.no_grad()
    def sync(self) -> None:
        """ZeRO-0/1: average every gradient over the data axis, compressed (no-op for ZeRO-2/3,
        whose FSDP units reduced them during backward)."""
        if self.fsdp:
            return
        n = self.reducer.topo.size
        for i in range(len(self.pm.model_parts)):
            params = [p for _, p in self._params(i)]
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
                     for p in params]
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            flat = self.reducer.all_reduce(flat, key=f"part{self.pm.stage_ids[i]}")
            flat /= n
            offset = 0
            for p, g in zip(params, grads):
                new = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
                if p.grad is None:
                    p.grad = _as_param_layout(p, new)
                else:
                    g.copy_(new)

    def after_optimizer_step(self) -> None:
        """Nothing: the reduction ran after backward (`sync`, called by the ParallelModel)."""

    def release(self) -> None:
        """Destroy the hierarchical subgroups (before the mesh is released)."""
        self.reducer.topo.release()

    # ---- checkpoint ----------------------------------------------------------------------------
    def _buckets(self) -> list[tuple[str, int, str]]:
        """(key, input elements, layout) of every residual bucket of this rank's reductions."""
        if self.fsdp:
            return [(key, _fsdp_input_numel(unit), "reduce_scatter") for key, unit in self.units]
        return [(f"part{self.pm.stage_ids[i]}", sum(_local(p).numel() for _, p in self._params(i)),
                 "all_reduce") for i in range(len(self.pm.model_parts))]

    def state_dict(self) -> dict[str, Any]:
        """Each rank's own residual per bucket, and the mean residual per parameter (ZeRO-0/1)
        or per FSDP unit (ZeRO-2/3); see module doc. A collective over the data axis: every
        rank calls it."""
        out = own_entries(self.reducer, self._buckets(), self.pm.device)
        if self.fsdp:
            for key, numel, layout in self._buckets():
                out[self._mean_key(key)] = self.reducer.mean_residual(
                    key, numel, layout, self.pm.device)
            return out
        for i, (key, numel, layout) in enumerate(self._buckets()):
            mean = self.reducer.mean_residual(key, numel, layout, self.pm.device)
            offset = 0
            for name, p in self._params(i):
                local = _local(p)
                piece = mean[offset:offset + local.numel()].view(local.shape).clone()
                offset += local.numel()
                out[RESIDUAL_PREFIX + name] = _as_param_layout(p, piece.to(local.device))
        return out

    def _mean_key(self, key: str) -> str:
        """The key of a ZeRO-2/3 unit's mean residual: a plain tensor that differs between tp
        ranks, so their key differs (module doc); one key per unit without tensor parallelism
        (as checkpoints before the tp rank was named)."""
        mesh = self.pm.mesh
        if "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
            return RESIDUAL_PREFIX + key
        return f"{RESIDUAL_PREFIX}{key}.tp{mesh['tp'].get_local_rank()}"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Residuals from `state_dict()` (after `dcp.load` into it), for this layout: each
        rank's own when the template kept them (same layout), else the group's mean."""
        if load_own_entries(self.reducer, self._buckets(), state_dict):
            return
        if self.fsdp:
            for key, _ in self.units:
                if self._mean_key(key) in state_dict:
                    self.reducer.load_mean_residual(key, state_dict[self._mean_key(key)],
                                                    "reduce_scatter")
            return
        for i in range(len(self.pm.model_parts)):
            pieces = [_local(state_dict[RESIDUAL_PREFIX + name]).reshape(-1).float()
                      for name, _ in self._params(i)]
            self.reducer.load_mean_residual(f"part{self.pm.stage_ids[i]}", torch.cat(pieces),
                                            "all_reduce")


def own_entries(reducer: Reducer, buckets: list[tuple[str, int, str]], device
                ) -> dict[str, torch.Tensor]:
    """This rank's own residual of every bucket, keyed by `rank_entries.own_key` (none when
    error feedback keeps no residual here)."""
    from meshtron.checkpoint.rank_entries import own_key

    if not reducer.keeps_residuals:
        return {}
    rank = dist.get_rank()
    return {own_key(rank, key): reducer.own_residual(key, numel, layout, device)
            for key, numel, layout in buckets}


def load_own_entries(reducer: Reducer, buckets: list[tuple[str, int, str]],
                     state_dict: dict[str, Any]) -> bool:
    """Restore this rank's own residuals from `state_dict` when it holds every bucket's (the
    checkpointer kept them in its template: same layout); False, changing nothing, else."""
    from meshtron.checkpoint.rank_entries import own_key

    if not reducer.keeps_residuals:
        return False
    rank = dist.get_rank()
    found = {key: state_dict.get(own_key(rank, key)) for key, _, _ in buckets}
    if any(e is None for e in found.values()):
        return False
    for key, e in found.items():
        reducer.load_own_residual(key, e)
    return True


def attach(pm, plan) -> GradCompression | None:
    """Set up compressed reduction for `pm` when the plan asks for it (and not DiLoCo, which
    reduces outer gradients instead: meshtron.compress.diloco)."""
    if not plan.compressed or plan.diloco > 0:
        return None
    return GradCompression(pm, plan)
