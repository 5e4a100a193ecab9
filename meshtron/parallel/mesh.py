"""Device mesh from a plan: the planner's placement, built as a real DeviceMesh.

Mesh axes, outermost to innermost (meshtron.planner.placement.MESH_AXES; the last axis varies
fastest with the global rank):

    ("pp", "dp_replicate", "dp_shard", "tp")

    rank = ((r_pp * dp_replicate + r_dp_replicate) * dp_shard + r_dp_shard) * tp + r_tp

so a tensor-parallel group is `tp` consecutive ranks (the same node when tp divides the GPUs
per node and ranks are numbered node by node, as torchrun does), data-parallel groups are the
next closest, and pipeline neighbours are the farthest (Megatron-LM's and torchtitan's order;
the cost model costs exactly this placement). Size-1 axes are kept, so code can always ask for
`mesh["tp"]` etc. A flattened axis "dp" = ("dp_replicate", "dp_shard") is added for data
loading, loss averaging and ZeRO-1.

With context parallelism (plan.cp > 1) the mesh has torchtitan's five axes
("pp", "dp_replicate", "dp_shard", "cp", "tp") (placement.MESH_AXES_CP) and two more flattened
axes, as torchtitan builds them: "dp_shard_cp" = ("dp_shard", "cp"), which FSDP2 shards over
(cp ranks hold different tokens of the same sequences, so their gradients are averaged like
data-parallel ones), and "dp_cp" = ("dp_replicate", "dp_shard", "cp") for the loss mean.

The data-parallel degree `dp` is split between the two data axes by ZeRO stage: zero 0 and 1
put all of it on "dp_replicate" (parameters and gradients replicated); zero 2 and 3 put it on
"dp_shard" (FSDP2 shards over it), except that `dp_replicate = r > 1` with zero 2/3 asks for
HSDP: replicate over r groups, shard inside each.

A plan is a `meshtron.planner.plan.Plan`, a saved plan file, or a dict of Plan fields
(`meshtron.planner.plan.as_plan`); it is validated by the planner's own rules
(`Plan.validate`) against the world size and the model.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.errors import UserError
from meshtron.planner.placement import MESH_AXES, MESH_AXES_CP, placement
from meshtron.planner.plan import Plan, as_plan

MESH_DIMS = MESH_AXES


def mesh_axes(plan: Plan) -> tuple[str, ...]:
    """The named axes of the plan's mesh (the placement's): MESH_AXES, or MESH_AXES_CP with
    context parallelism."""
    return MESH_AXES_CP if plan.cp > 1 else MESH_AXES


def resolve_plan(plan: Any, world_size: int | None = None, spec: Any = None) -> Plan:
    """The plan (Plan, plan file or dict of fields) as a Plan, checked against `world_size` and
    `spec` (a ModelSpec) when given. Bad input: UserError naming the field."""
    return as_plan(plan).validate(world_size, spec)


def stage_layer_counts(plan: Plan, num_layers: int) -> list[int]:
    """Layers per (virtual) stage: the plan's `stage_layers`, or an even split."""
    n = plan.num_stages
    if plan.stage_layers:
        counts = list(plan.stage_layers)
        if sum(counts) != num_layers:
            raise UserError(f"plan.stage_layers={counts}: sums to {sum(counts)}, the model has "
                             f"{num_layers} layers")
        return counts
    if n > num_layers:
        raise UserError(f"plan.pp*virtual_stages={n}: more pipeline stages than model layers "
                         f"({num_layers})")
    base, extra = divmod(num_layers, n)
    # Remainder layers go to the middle stages first: the first and last carry embedding/head.
    order = sorted(range(n), key=lambda i: (i in (0, n - 1), abs(i - (n - 1) / 2)))
    counts = [base] * n
    for i in order[:extra]:
        counts[i] += 1
    return counts


def _gpus_per_node(world_size: int) -> int:
    """Ranks per node of this launch (torchrun's LOCAL_WORLD_SIZE), for the placement's view of
    which groups cross nodes; the rank grid itself does not depend on it."""
    import os

    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return world_size


def build_mesh(plan: Any, world_size: int | None = None, device_type: str | None = None,
               spec: Any = None):
    """A DeviceMesh with axes ("pp", "dp_replicate", "dp_shard", "tp") (+ flattened "dp"), or
    with cp > 1 ("pp", "dp_replicate", "dp_shard", "cp", "tp") (+ "dp", "dp_shard_cp",
    "dp_cp"), built from the planner's placement of this plan's ranks.

    Needs the default process group to be initialised (torchrun / init_process_group).
    `device_type` defaults to "cuda" when CUDA is available, else "cpu".
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    p = as_plan(plan)  # refuse what is not a plan before anything else
    if not dist.is_initialized():
        raise RuntimeError("build_mesh: torch.distributed is not initialised "
                           "(call init_process_group first)")
    if world_size is None:
        world_size = dist.get_world_size()
    p = p.validate(world_size, spec)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        # Python-API users who called init_process_group themselves: this rank's GPU is made
        # current before any group, FSDP2 or DTensor allocates on "cuda" (else all on GPU 0).
        from meshtron.runtime import local_device

        local_device()
    place = placement(p, _gpus_per_node(world_size))
    mesh = DeviceMesh(device_type, torch.tensor(place.rank_grid(), dtype=torch.int),
                      mesh_dim_names=place.axes)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if "cp" in place.axes:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    if p.ep > 1:
        mesh._meshtron_experts = _expert_meshes(mesh, p)
    return mesh


class ExpertMeshes:
    """The expert-parallel views of a `build_mesh` mesh (plan.ep > 1), torchtitan's
    ParallelDims layout: the data axis the dp ranks lie on is split into (outer, ep) with ep
    innermost. ZeRO-2/3: FSDP's shard axis (dp_shard x cp, size S) becomes
    ("dp_shard_mod_ep", ep), ep = dp_shard_in_ep x cp. ZeRO-0/1 (dp all on "dp_replicate",
    dp_shard = cp = 1): "dp_replicate" becomes ("dp_mod_ep", ep), Megatron-Core's expert data
    parallel group (the dp/ep ranks holding the same experts). The same ranks and root mesh as
    the placement's (`DeviceMesh._unflatten`), so an expert weight can be a DTensor on `ep` and
    FSDP2-sharded (or replicated) over `fsdp` at once."""

    def __init__(self, ep, fsdp, names: dict, data_axis: str):
        self.ep = ep
        """1-D mesh of the ep ranks that exchange tokens (all-to-all)."""
        self.fsdp = fsdp
        """Mesh FSDP2 runs the routed experts on: ZeRO-2/3 "dp_shard_mod_ep" (size S/ep), with
        "dp_replicate" in front for HSDP; ZeRO-1 "dp_mod_ep" (optimizer states and gradients
        sharded over the expert replicas, as the dense parts over "dp"); ZeRO-0
        ("dp_mod_ep", "dp_shard") (FSDP2's HSDP path with shards of one rank: one all-reduce
        per step, as the dense parts over ("dp_replicate", "dp_shard")); "dp_mod_ep" alone
        when ep = dp."""
        self.names = names
        """Axis name -> 1-D submesh (for the doctor's group names and `release_mesh`)."""
        self.data_axis = data_axis
        """Name of the 1-D axis of the ranks holding the same experts: "dp_shard_mod_ep"
        (ZeRO-2/3) or "dp_mod_ep" (ZeRO-0/1); the axis planner/collectives.py counts the
        experts' gradient and parameter collectives on."""

    @property
    def data(self):
        """1-D mesh of the ranks holding the same experts (`data_axis`)."""
        return self.names[self.data_axis]


def _expert_meshes(mesh, p: Plan) -> ExpertMeshes:
    """Build the ExpertMeshes of plan `p` on `mesh` (a collective: new process groups). The
    split is torch's private `DeviceMesh._unflatten` (not in every torch): a torch without it is
    refused in one line naming its version, before any group is made."""
    from meshtron.torch_compat import require

    require("torch.distributed.device_mesh.DeviceMesh._unflatten",
            f"plan.ep={p.ep} (the expert-parallel mesh)")
    cp = p.cp
    if p.zero < 2:  # dp on "dp_replicate" (cp > 1 needs ZeRO-2/3: plan_rules)
        split = _unflatten(mesh, "dp_replicate", (p.dp // p.ep, p.ep), ("dp_mod_ep", "ep"))
        names = {"ep": split["ep"], "dp_mod_ep": split["dp_mod_ep"]}
        # ZeRO-0: FSDP2's HSDP path with shards of one rank (one all-reduce per step); with
        # ep = dp there is no replica and the 1-D mesh of one rank issues no collective (the
        # HSDP path would still all-reduce on the one-rank group, measured on torch 2.13)
        two_d = p.zero == 0 and p.dp > p.ep
        fsdp = split["dp_mod_ep", "dp_shard"] if two_d else split["dp_mod_ep"]
        return ExpertMeshes(names["ep"], fsdp, names, "dp_mod_ep")
    mod = p.dp_shard * cp // p.ep
    if cp == 1:
        split = _unflatten(mesh, "dp_shard", (mod, p.ep), ("dp_shard_mod_ep", "ep"))
        ep = split["ep"]
        names = {"ep": ep}
    else:  # ep = (dp_shard_in_ep, cp): the cp ranks of a sequence route into the same experts
        inner = p.ep // cp
        split = _unflatten(mesh, "dp_shard", (mod, inner), ("dp_shard_mod_ep", "dp_shard_in_ep"))
        ep = split["dp_shard_in_ep", "cp"]._flatten("ep")
        names = {"ep": ep, "dp_shard_in_ep": split["dp_shard_in_ep"]}
    names["dp_shard_mod_ep"] = split["dp_shard_mod_ep"]
    fsdp = (split["dp_replicate", "dp_shard_mod_ep"] if p.replicas > 1
            else split["dp_shard_mod_ep"])
    return ExpertMeshes(ep, fsdp, names, "dp_shard_mod_ep")


def _unflatten(mesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """`mesh._unflatten` of the axis named `axis`, given by its index: torch 2.11's
    `DeviceMesh._unflatten` refuses every axis given by name (its check is inverted: "dim
    dp_shard specified in `_unflatten` is not in ('pp', 'dp_replicate', 'dp_shard', 'tp')"),
    which stopped every expert-parallel run on 2.11; 2.13 takes either."""
    return mesh._unflatten(list(mesh.mesh_dim_names).index(axis), sizes, names)


def expert_meshes(mesh) -> ExpertMeshes | None:
    """The ExpertMeshes `build_mesh` made for an ep > 1 plan, else None."""
    return getattr(mesh, "_meshtron_experts", None)


def data_mesh(mesh):
    """The flattened data axis "dp" = ("dp_replicate", "dp_shard") of a `build_mesh` mesh.

    Asked of the 2-D data submesh rather than sliced from the root (`mesh["dp"]`), which torch
    2.13 warns about on every call; `_flatten` returns the mesh `build_mesh` already made, and
    creates no new process group."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def named_submeshes(mesh) -> dict:
    """The 1-D submeshes of a `build_mesh` mesh that are no axis of it, by the name the doctor
    gives their process groups (`doctor.watch_mesh`): the flattened data axis "dp" and, with
    expert parallelism, the ExpertMeshes axes ("ep", ...)."""
    extra = {}
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names and "dp_shard" in names:
        extra["dp"] = data_mesh(mesh)
    experts = expert_meshes(mesh)
    if experts is not None:  # expert parallelism: the all-to-alls' group is named "ep"
        extra.update(experts.names)
    return extra


def release_mesh(mesh) -> None:
    """Destroy the process groups `build_mesh` created for `mesh`: one per axis and the
    flattened data axis (never the default group). Without this each mesh keeps its groups, and
    with them their backend threads and sockets, until the process exits: a process that builds
    one mesh after another (a sweep over layouts) accumulates hundreds of threads.

    Call it after the last collective on the mesh, once the models and optimizers built on it
    are no longer used (they keep references to the destroyed groups). Local: no collective.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    seen: set[int] = set()
    subs = [mesh[name] for name in mesh.mesh_dim_names] + [data_mesh(mesh)]
    if "cp" in mesh.mesh_dim_names:
        subs += [mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
                 mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")]
    experts = expert_meshes(mesh)
    if experts is not None:
        subs += list(experts.names.values())
    for sub in subs:
        group = sub.get_group()
        if group is dist.group.WORLD or id(group) in seen:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)
    # The root mesh keeps its groups in a registry; torch's caches (DTensor sharding
    # propagation) keep recent meshes alive, and a group's backend threads end only when the
    # group object is freed, not at destroy_process_group. Measured on torch 2.13 gloo: without
    # this the threads of the last two layouts stay.
    registry = getattr(mesh._get_root_mesh(), "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
    _forget_cached_meshes()


def _forget_cached_meshes() -> None:
    """Empty DTensor's caches that hold meshes. A DeviceMesh compares equal to any mesh of the
    same shape, ranks and names, so after a release those caches would hand the next, equal
    mesh's DTensors the released mesh (whose groups are gone: 'Could not resolve the process
    group registered under the name N', measured on torch 2.13). Clearing only costs
    recomputing sharding decisions. Private torch APIs, pinned version: checked by
    tests/test_parallel_release.py."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()


def mesh_coords(mesh) -> dict[str, int]:
    """This rank's coordinate on each named axis."""
    return {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}
