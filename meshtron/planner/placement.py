"""Rank placement: which global ranks form each tp / pp / dp group, and where those groups sit.

One function, `place(plan, gpus_per_node)`, used by both the runtime's mesh (parallel/mesh.py
builds its DeviceMesh from `Placement.rank_grid()`) and the cost model (estimate.py asks it
for each axis's `Group`: members, nodes spanned, members per node). Torch-free.

Rank order (`MESH_AXES`, outermost to innermost; the last axis varies fastest with the rank):

    ("pp", "dp_replicate", "dp_shard", "tp")

    rank = ((r_pp * dp_replicate + r_dp_replicate) * dp_shard + r_dp_shard) * tp + r_tp

Ranks are numbered node by node (torchrun and Slurm do: node = rank // gpus_per_node). So a
tensor-parallel group is tp consecutive ranks (inside one node when tp divides the node), a
data-parallel group has stride tp and is the next closest (gpus_per_node / tp members in each
node it touches), and pipeline neighbours are tp * dp ranks apart, the farthest. This is the
order of Megatron-LM (tp, then dp, then pp: Narayanan et al. 2021, section 3.3) and torchtitan
(mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp")): data-parallel traffic (gradients, ZeRO
all-gathers: the whole model's size every step) is far larger than pipeline traffic (one
activation per micro-batch boundary), so it gets the faster links. `bench/rank_order.py`
compares this order with pipeline-inside-data-parallel under the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.planner.comm import Group

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Mesh axes, outermost to innermost."""
MESH_AXES_CP = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh axes of a plan with context parallelism (cp > 1), torchtitan's order: the cp group is
tp consecutive ranks apart, next closest after tp (ring attention's K/V traffic is per layer)."""


def axis_sizes(plan: Any) -> dict[str, int]:
    """Sizes of the mesh axes for a plan (dp split by ZeRO stage: zero 0/1 replicate over all of
    dp; zero 2/3 shard over dp / dp_replicate, HSDP when dp_replicate > 1)."""
    if plan.zero >= 2:
        rep, shard = plan.dp_replicate, plan.dp // plan.dp_replicate
    else:
        rep, shard = plan.dp, 1
    return {"pp": plan.pp, "dp_replicate": rep, "dp_shard": shard,
            "cp": getattr(plan, "cp", 1), "tp": plan.tp}


@dataclass(frozen=True)
class Placement:
    """Ranks of a mesh with axes `axes` (outermost first) and `shape`, numbered node by node."""

    axes: tuple[str, ...]
    """Axis names, outermost first."""
    shape: tuple[int, ...]
    """Size of each axis."""
    gpus_per_node: int
    """Ranks per node (node of rank r = r // gpus_per_node)."""

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(axis)]

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours on `axis` (product of the inner axes' sizes)."""
        s = 1
        for a, n in zip(reversed(self.axes), reversed(self.shape)):
            if a == axis:
                return s
            s *= n
        raise KeyError(axis)

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for a, n in zip(self.axes, self.shape):
            r = r * n + coords[a]
        return r

    def coords(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for a, n in zip(reversed(self.axes), reversed(self.shape)):
            rank, out[a] = divmod(rank, n)
        return out

    def rank_grid(self) -> list:
        """Nested lists of ranks in mesh shape (what a DeviceMesh is built from)."""
        flat = list(range(self.world_size))

        def nest(items: list[int], dims: tuple[int, ...]) -> list:
            if len(dims) == 1:
                return items
            step = len(items) // dims[0]
            return [nest(items[i * step:(i + 1) * step], dims[1:]) for i in range(dims[0])]

        return nest(flat, self.shape)

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group along `axes` (several axes: their flattened product, in mesh order), each
        a list of global ranks in axis order."""
        inner = [a for a in self.axes if a in axes]
        outer = [a for a in self.axes if a not in axes]
        out = []
        for o in _product([self.size(a) for a in outer]):
            base = dict(zip(outer, o))
            out.append([self.rank({**base, **dict(zip(inner, i))})
                        for i in _product([self.size(a) for a in inner])])
        return out

    def group(self, *axes: str) -> Group:
        """Where the groups along `axes` sit, as the collective formulas take it: members and
        members per node of the group spanning the most nodes (the slowest: all groups of an
        axis communicate at once). Groups that split unevenly over nodes (a node size that the
        strides do not divide) report their average members per node, rounded down."""
        sizes = [self.size(a) for a in axes]
        n = 1
        for s in sizes:
            n *= s
        if n == 1:
            return Group(1, 1)
        live = [a for a in self.axes if a in axes and self.size(a) > 1]
        idx = [self.axes.index(a) for a in live]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            # adjacent axes flatten to one strided group (stride of the innermost)
            fast = _strided(n, self.stride(live[-1]), self.gpus_per_node)
            if fast is not None:
                return fast
        nodes = max(len({r // self.gpus_per_node for r in members})
                    for members in self.groups(*axes))
        return Group(n, max(1, n // nodes))

    def hop_crosses_nodes(self, axis: str = "pp", wrap: bool = False) -> bool:
        """Whether some pair of neighbours on `axis` (and, with `wrap`, last -> first, as the
        interleaved schedule's loop sends) sit on different nodes."""
        n, s, g = self.size(axis), self.stride(axis), self.gpus_per_node
        if n == 1:
            return False
        fast = _strided(n, s, g)
        if fast is not None:
            return fast.nodes > 1  # a strided group spanning nodes has a hop across a boundary
        for members in self.groups(axis):
            pairs = list(zip(members, members[1:])) + ([(members[-1], members[0])] if wrap else [])
            if any(a // g != b // g for a, b in pairs):
                return True
        return False


def _product(sizes: list[int]):
    if not sizes:
        yield ()
        return
    for i in range(sizes[0]):
        for rest in _product(sizes[1:]):
            yield (i, *rest)


def _strided(n: int, stride: int, g: int) -> Group | None:
    """Closed form for a group of n members `stride` ranks apart when it aligns with nodes:
    None when it does not (the caller enumerates the groups)."""
    span = n * stride
    if span <= g and g % span == 0:
        return Group(n, n)  # every group inside one node
    if stride % g == 0:
        return Group(n, 1)  # one member per node
    if g % stride == 0 and span % g == 0:
        return Group(n, g // stride)  # g/stride members in each of span/g nodes
    return None


def placement(plan: Any, gpus_per_node: int) -> Placement:
    """THE placement of a plan's ranks on nodes of `gpus_per_node` GPUs (module docstring)."""
    sizes = axis_sizes(plan)
    axes = MESH_AXES_CP if sizes["cp"] > 1 else MESH_AXES
    return Placement(axes, tuple(sizes[a] for a in axes), gpus_per_node)


def tp_group(tp: int, gpus_per_node: int) -> Group:
    """The tensor-parallel Group: tp is the innermost axis, so it does not depend on the other
    degrees."""
    return Placement(MESH_AXES, (1, 1, 1, tp), gpus_per_node).group("tp")


def groups_for_cost(plan: Any, gpus_per_node: int) -> dict[str, Any]:
    """The cost model's view: a Group for "tp", "pp", "dp" (all data-parallel ranks) and its two
    parts, "amax" (all ranks of a pipeline stage), and whether a pipeline hop crosses nodes."""
    p = placement(plan, gpus_per_node)
    # gradients and ZeRO shards span the context ranks too (they hold different tokens of the
    # same sequences): FSDP shards over dp_shard x cp (torchtitan's "dp_shard_cp" mesh)
    cp = ("cp",) if "cp" in p.axes else ()
    return {"tp": p.group("tp"), "pp": p.group("pp"),
            "dp": p.group("dp_replicate", "dp_shard", *cp),
            "dp_replicate": p.group("dp_replicate"), "dp_shard": p.group("dp_shard", *cp),
            "cp": p.group("cp") if cp else Group(1, 1),
            # Megatron-Core's FP8 amax reduction group: a stage's tp x dp x cp ranks
            # (parallel_state.get_amax_reduction_group(with_context_parallel=True); fp8_amax.py)
            "amax": p.group("dp_replicate", "dp_shard", *cp, "tp"),
            "pp_hop_crosses_nodes": p.hop_crosses_nodes("pp", wrap=plan.virtual_stages > 1)}


EXPERT_AXES = ("pp", "edp", "ep", "etp")
"""Axes of the experts' own rank grid under Megatron-Core's folding (plan.etp set), outermost
first: parallel_state.initialize_model_parallel's expert RankGenerator, order "tp-ep-dp-pp"
(innermost first) with tp = expert_tensor_parallel_size, over the same ranks of a pipeline
stage as the dense grid (the pp stride is tp*cp*dp = etp*ep*edp in both)."""


def expert_stride(plan: Any) -> int:
    """Rank distance between neighbours of an ep group: etp under Megatron-Core's folding
    (plan.etp set), else tp (ep consecutive data ranks, `ep_group`)."""
    etp = getattr(plan, "etp", None)
    return plan.tp if etp is None else etp


def expert_placement(plan: Any, gpus_per_node: int) -> Placement:
    """The experts' rank grid of a folded plan (plan.etp set; EXPERT_AXES): etp consecutive
    ranks share each expert's GEMMs, ep groups of them (etp apart) hold different experts, the
    expert data-parallel groups (edp = tp*cp*dp / (ep*etp)) are etp*ep apart. Numbered node by
    node like `placement`, whose dense grid covers the same ranks."""
    etp = getattr(plan, "etp", None)
    if etp is None:
        raise ValueError("expert_placement: the plan folds ep over the data ranks (etp unset)")
    stage = plan.tp * getattr(plan, "cp", 1) * plan.dp
    return Placement(EXPERT_AXES, (plan.pp, stage // (plan.ep * etp), plan.ep, etp),
                     gpus_per_node)


def ep_group(tp: int, ep: int, gpus_per_node: int) -> Group:
    """The expert-parallel Group: ep ranks `tp` apart (`expert_stride`: tp where ep is folded
    over the data ranks, the runtime unflattening the FSDP shard axis into
    ("dp_shard_mod_ep", "ep") with ep innermost, torchtitan's ParallelDims; etp under
    Megatron-Core's folding, `expert_placement`). Inside a node when tp * ep divides it."""
    if ep <= 1:
        return Group(1, 1)
    fast = _strided(ep, tp, gpus_per_node)
    if fast is not None:
        return fast
    span = ep * tp
    nodes = -(-span // gpus_per_node)
    return Group(ep, max(1, ep // nodes))


def expert_groups(plan: Any, gpus_per_node: int, groups: dict[str, Any]) -> dict[str, Any]:
    """The data-parallel groups of the routed experts under expert parallelism (cost model's
    view, keys as `groups_for_cost`): the experts of one ep rank are replicated (ZeRO-0/1) or
    sharded (ZeRO-2/3, "dp_shard_mod_ep") over the dp*cp/ep ranks holding the same experts,
    stride tp*ep; the HSDP replica group is the dense units' own."""
    ep = getattr(plan, "ep", 1)
    if ep <= 1:
        return dict(groups)
    stride = expert_stride(plan) * ep

    def strided(n: int) -> Group:
        if n <= 1:
            return Group(1, 1)
        fast = _strided(n, stride, gpus_per_node)
        if fast is not None:
            return fast
        nodes = -(-(n * stride) // gpus_per_node)
        return Group(n, max(1, n // nodes))

    cp = getattr(plan, "cp", 1)
    out = dict(groups)
    if getattr(plan, "etp", None) is not None:
        # Megatron-Core's expert data-parallel group: world / (pp * ep * etp) ranks
        out["dp"] = out["dp_shard"] = strided(expert_placement(plan, 1).size("edp"))
        return out
    if plan.zero >= 2:
        shard = plan.dp // plan.dp_replicate * cp // ep
        out["dp_shard"] = strided(shard)
        out["dp"] = strided(plan.dp * cp // ep)
    else:
        out["dp"] = strided(plan.dp * cp // ep)
        out["dp_shard"] = out["dp"]
    return out


__all__ = ["EXPERT_AXES", "ep_group", "expert_groups", "expert_placement", "expert_stride", "MESH_AXES", "MESH_AXES_CP", "Placement", "axis_sizes", "groups_for_cost", "placement", "tp_group"]
