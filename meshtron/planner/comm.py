"""Alpha-beta costs of the collectives hybrid parallelism uses, and which fabric a group crosses.

Model (Hockney's alpha-beta model; ring algorithms as analysed by Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH"): a message of B bytes over a link
of bandwidth bw takes alpha + B/bw. For a ring of n members, each holding B bytes:

* reduce-scatter and all-gather: (n-1) steps, each moving B/n bytes -> (n-1)*alpha + (n-1)/n * B/bw
* all-reduce = reduce-scatter + all-gather -> 2(n-1)*alpha + 2(n-1)/n * B/bw
* point-to-point: alpha + B/bw

Groups that span nodes run hierarchically (as NCCL's multi-ring / 2D algorithms do; Jia et al. 2018
"Highly scalable deep learning training system with mixed-precision", hierarchical all-reduce):
reduce-scatter inside the node over NVLink among the g local members, all-reduce of the 1/g shard
across the N nodes (every local member drives its own NIC, in parallel), all-gather inside the node.

Which ranks form each group, and so how many nodes it spans and how many members share a node,
comes from placement.py (the same placement the runtime's mesh is built from).

Achieved bandwidth is a fraction of the datasheet figure: NCCL's all-reduce bus bandwidth on DGX
nodes is about 80% of NVLink's per-direction figure (~230 of 300 GB/s on A100, ~360 of 450 on
H100) and about 90% of the NIC line rate across nodes (nccl-tests results published by NVIDIA).
A cluster file may override both with `bandwidth_efficiency` (e.g. 1.0 for measured figures).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.planner.cluster import ClusterSpec

NVLINK_EFFICIENCY = 0.8
"""Fraction of NVLink's per-direction bandwidth a ring collective reaches (nccl-tests busbw)."""
NETWORK_EFFICIENCY = 0.9
"""Fraction of the per-GPU NIC line rate a ring collective reaches (nccl-tests busbw)."""


@dataclass(frozen=True)
class Fabric:
    """Effective link figures used by the collective formulas."""

    intra_bw: float
    """Achieved intra-node bandwidth, bytes/s per GPU per direction."""
    inter_bw: float
    """Achieved inter-node bandwidth, bytes/s per GPU per direction."""
    intra_alpha: float
    """Per-step latency inside a node, seconds."""
    inter_alpha: float
    """Per-step latency across nodes, seconds."""
    gpus_per_node: int
    """GPUs per node, to place groups."""

    @classmethod
    def of(cls, cluster: ClusterSpec) -> "Fabric":
        e_intra = cluster.bandwidth_efficiency or NVLINK_EFFICIENCY
        e_inter = cluster.bandwidth_efficiency or NETWORK_EFFICIENCY
        # A single-node cluster never uses the network; keep the numbers anyway.
        return cls(intra_bw=cluster.intra_node_gb_per_s * 1e9 * e_intra,
                   inter_bw=cluster.inter_node_gb_per_s * 1e9 * e_inter,
                   intra_alpha=cluster.intra_node_latency_us * 1e-6,
                   inter_alpha=cluster.inter_node_latency_us * 1e-6,
                   gpus_per_node=cluster.gpus_per_node)


def ring_all_reduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Ring all-reduce of `nbytes` per member among n members: 2(n-1)a + 2(n-1)/n B/bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def ring_reduce_scatter(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Ring reduce-scatter of a full `nbytes` buffer: (n-1)a + (n-1)/n B/bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


ring_all_gather = ring_reduce_scatter
"""All-gather into a full `nbytes` buffer costs the same as reduce-scatter of it."""


def p2p(nbytes: float, bw: float, alpha: float) -> float:
    """Point-to-point send: a + B/bw."""
    return alpha + nbytes / bw if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Group:
    """Where the members of a communicating group sit (placement.py computes it)."""

    size: int
    """Members in the group."""
    local: int
    """Members sharing one node (the group spans size/local nodes)."""

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.local))


def all_reduce(nbytes: float, group: Group, fab: Fabric) -> float:
    """All-reduce over a group placed on one or more nodes (hierarchical when it spans nodes)."""
    if group.size <= 1:
        return 0.0
    if group.nodes <= 1:
        return ring_all_reduce(nbytes, group.size, fab.intra_bw, fab.intra_alpha)
    g = group.local
    t = ring_reduce_scatter(nbytes, g, fab.intra_bw, fab.intra_alpha)
    t += ring_all_reduce(nbytes / g, group.nodes, fab.inter_bw, fab.inter_alpha)
    t += ring_all_gather(nbytes, g, fab.intra_bw, fab.intra_alpha)
    return t


def reduce_scatter(nbytes: float, group: Group, fab: Fabric) -> float:
    """Reduce-scatter of a full `nbytes` buffer over a (possibly multi-node) group: intra-node
    reduce-scatter, then inter-node reduce-scatter of the 1/g shard."""
    if group.size <= 1:
        return 0.0
    if group.nodes <= 1:
        return ring_reduce_scatter(nbytes, group.size, fab.intra_bw, fab.intra_alpha)
    g = group.local
    return (ring_reduce_scatter(nbytes, g, fab.intra_bw, fab.intra_alpha)
            + ring_reduce_scatter(nbytes / g, group.nodes, fab.inter_bw, fab.inter_alpha))


def all_gather(nbytes: float, group: Group, fab: Fabric) -> float:
    """All-gather into a full `nbytes` buffer: the mirror image of reduce_scatter."""
    return reduce_scatter(nbytes, group, fab)


def send(nbytes: float, crosses_nodes: bool, fab: Fabric) -> float:
    """Point-to-point transfer between pipeline neighbours."""
    if crosses_nodes:
        return p2p(nbytes, fab.inter_bw, fab.inter_alpha)
    return p2p(nbytes, fab.intra_bw, fab.intra_alpha)
