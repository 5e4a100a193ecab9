"""Device mesh from a plan, and the plan's validation against world size and model.

Mesh axes, outermost to innermost (the last axis varies fastest with the global rank):

    ("dp_replicate", "dp_shard", "pp", "tp")

    rank = ((r_dp_replicate * dp_shard + r_dp_shard) * pp + r_pp) * tp + r_tp

so a tensor-parallel group is `tp` consecutive ranks (the same node when tp <= GPUs per node
and ranks are numbered node by node, as torchrun does), the `pp` stages of one pipeline are the
next closest, and data parallelism spans the farthest ranks. Size-1 axes are kept, so code can
always ask for `mesh["tp"]` etc. A flattened axis "dp" = ("dp_replicate", "dp_shard") is added
for data loading and loss averaging.

How the plan's data-parallel degree `dp` is split between the two data axes depends on ZeRO:
zero 0 and 1 put all of it on "dp_replicate" (parameters and gradients replicated); zero 2 and 3
put it on "dp_shard" (FSDP2 shards over it), except that `plan.dp_replicate = r > 1` with zero
2/3 asks for HSDP: replicate over r groups, shard inside each.

Plan attributes read (duck-typed, with defaults): tp=1, pp=1, dp=1, zero=0, micro_batch=1,
recompute='none', sp=False, schedule='1f1b', virtual_stages=1, stage_layers=[],
dp_replicate=1, precision='fp32' (or `mixed_precision`/`dtype`: 'bf16' enables bf16 compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from meshtron.errors import UserError

MESH_DIMS = ("dp_replicate", "dp_shard", "pp", "tp")

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """A plan resolved and validated: every knob the runtime uses, with defaults filled in."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    dp_replicate: int = 1
    dp_shard: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] = field(default_factory=tuple)
    precision: str = "fp32"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.pp, self.tp)


def _int(plan: Any, name: str, default: int, minimum: int = 1) -> int:
    value = getattr(plan, name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"plan.{name}={value!r}: must be an integer >= {minimum}")
    return value


def resolve_plan(plan: Any, world_size: int | None = None, spec: Any = None) -> Layout:
    """Read a plan (any object with the attributes above) into a validated Layout.

    `world_size` and `spec` (a ModelSpec) are checked when given. Errors are one-line
    ValueErrors that name the offending knob.
    """
    if isinstance(plan, Layout):
        layout = plan
    else:
        tp = _int(plan, "tp", 1)
        pp = _int(plan, "pp", 1)
        dp = _int(plan, "dp", 1)
        zero = _int(plan, "zero", 0, minimum=0)
        if zero > 3:
            raise UserError(f"plan.zero={zero}: allowed values are 0, 1, 2, 3")
        micro_batch = _int(plan, "micro_batch", 1)
        recompute = getattr(plan, "recompute", "none") or "none"
        if recompute not in RECOMPUTE:
            raise UserError(f"plan.recompute={recompute!r}: allowed values are "
                             f"{', '.join(RECOMPUTE)}")
        sp = bool(getattr(plan, "sp", False))
        schedule = str(getattr(plan, "schedule", "1f1b") or "1f1b").lower()
        if schedule not in SCHEDULES:
            raise UserError(f"plan.schedule={schedule!r}: allowed values are "
                             f"{', '.join(SCHEDULES)}")
        virtual_stages = _int(plan, "virtual_stages", 1)
        stage_layers = tuple(getattr(plan, "stage_layers", None) or ())
        if schedule == "zbv":  # zero bubble on a V of two stages per rank
            schedule = "zb"
            if pp > 1 and virtual_stages == 1 and len(stage_layers) != pp:
                virtual_stages = 2
        precision = str(getattr(plan, "precision", None) or getattr(plan, "mixed_precision", None)
                        or getattr(plan, "dtype", None) or "fp32").lower()
        precision = {"bfloat16": "bf16", "float32": "fp32", "true": "bf16",
                     "false": "fp32"}.get(precision, precision)
        if precision not in ("fp32", "bf16"):
            raise UserError(f"plan.precision={precision!r}: allowed values are fp32, bf16")
        r = _int(plan, "dp_replicate", 1)
        if zero >= 2:
            if dp % r:
                raise UserError(f"plan.dp_replicate={r}: must divide plan.dp={dp}")
            dp_replicate, dp_shard = r, dp // r
        else:
            dp_replicate, dp_shard = dp, 1
        layout = Layout(tp=tp, pp=pp, dp=dp, zero=zero, dp_replicate=dp_replicate,
                        dp_shard=dp_shard, micro_batch=micro_batch, recompute=recompute, sp=sp,
                        schedule=schedule, virtual_stages=virtual_stages,
                        stage_layers=stage_layers, precision=precision)
    _validate(layout, world_size, spec)
    return layout


def _validate(lay: Layout, world_size: int | None, spec: Any) -> None:
    if world_size is not None and lay.world_size != world_size:
        raise UserError(f"plan.dp*tp*pp={lay.dp}*{lay.tp}*{lay.pp}={lay.world_size}: must equal "
                         f"the world size {world_size}")
    if lay.pp == 1 and lay.virtual_stages != 1:
        raise UserError(f"plan.virtual_stages={lay.virtual_stages}: needs plan.pp > 1")
    if lay.schedule == "zb" and lay.pp > 1 and lay.zero == 3:
        # Measured: zero-bubble schedules + FSDP2 reshard_after_forward=True silently drift.
        raise UserError("plan.schedule='zb' with plan.zero=3: zero-bubble schedules give wrong "
                         "gradients with FSDP2 resharding after forward on torch 2.13; use zero=2 "
                         "or another schedule")
    if lay.stage_layers and len(lay.stage_layers) != lay.num_stages:
        raise UserError(f"plan.stage_layers has {len(lay.stage_layers)} entries: must be "
                         f"pp*virtual_stages={lay.num_stages}")
    if spec is None:
        return
    if spec.heads % lay.tp:
        raise UserError(f"plan.tp={lay.tp}: must divide model.heads={spec.heads}")
    if spec.kv_heads % lay.tp:
        raise UserError(f"plan.tp={lay.tp}: must divide model.kv_heads={spec.kv_heads} "
                         "(key/value heads are not replicated across tensor-parallel ranks)")
    if spec.ffn_hidden % lay.tp:
        raise UserError(f"plan.tp={lay.tp}: must divide model.ffn_hidden={spec.ffn_hidden}")
    if lay.pp > 1 and getattr(spec, "tied_embeddings", False):
        raise UserError("plan.pp>1 with model.tied_embeddings: tied input/output embeddings "
                         "across pipeline stages are not supported")
    if lay.num_stages > 1:
        stage_layer_counts(lay, spec.layers)


def stage_layer_counts(lay: Layout, num_layers: int) -> list[int]:
    """Layers per (virtual) stage: the plan's `stage_layers`, or an even split."""
    n = lay.num_stages
    if lay.stage_layers:
        counts = list(lay.stage_layers)
        if any((not isinstance(c, int)) or c < 0 for c in counts):
            raise UserError(f"plan.stage_layers={counts}: entries must be integers >= 0")
        if sum(counts) != num_layers:
            raise UserError(f"plan.stage_layers={counts}: sums to {sum(counts)}, the model has "
                             f"{num_layers} layers")
        for i, c in enumerate(counts):
            if c == 0 and 0 < i < n - 1:
                raise UserError(f"plan.stage_layers={counts}: middle stage {i} has no layers")
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


def build_mesh(plan: Any, world_size: int | None = None, device_type: str | None = None,
               spec: Any = None):
    """A DeviceMesh with axes ("dp_replicate", "dp_shard", "pp", "tp") (+ flattened "dp").

    Needs the default process group to be initialised (torchrun / init_process_group).
    `device_type` defaults to "cuda" when CUDA is available, else "cpu".
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh: torch.distributed is not initialised "
                           "(call init_process_group first)")
    if world_size is None:
        world_size = dist.get_world_size()
    lay = resolve_plan(plan, world_size, spec)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, lay.mesh_shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def data_mesh(mesh):
    """The flattened data axis "dp" = ("dp_replicate", "dp_shard") of a `build_mesh` mesh.

    Asked of the 2-D data submesh rather than sliced from the root (`mesh["dp"]`), which torch
    2.13 warns about on every call; `_flatten` returns the mesh `build_mesh` already made, and
    creates no new process group."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


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
    for sub in [mesh[name] for name in MESH_DIMS] + [data_mesh(mesh)]:
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
    return {name: mesh.get_local_rank(name) for name in MESH_DIMS}
