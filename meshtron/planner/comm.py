"""Costs of the collectives hybrid parallelism issues, as NCCL runs them.

Model: NCCL's own tuning model (NVIDIA/nccl, src/graph/tuning.cc, `ncclTopoTuneModel` and
`ncclTopoGetAlgoTime`): the time of one collective is a latency plus bytes over an algorithm
bandwidth,

    t = latency + B_alg / bw_alg,

with, for a ring of n ranks spread over N nodes (nsteps = n-1 for reduce-scatter and all-gather,
2(n-1) for all-reduce; nInterSteps = N-1 resp. 2(N-1)):

* latency = baseLat + (nsteps - nInterSteps) * hwLat_NVLink + nInterSteps * hwLat_NET. NCCL's
  table for the Simple protocol (used for the large buffers of training): baseLat(ring) 8.4 us,
  hwLat_NVLink(ring) 3.4 us, hwLat_NET(ring) 14 us per step since NCCL 2.18 (9.6 in 2.7-2.11
  and 2.14-2.17, 28 in 2.12-2.13). The per-step hardware latencies are the cluster's
  `intra_node_latency_us` / `inter_node_latency_us`; baseLat is its
  `collective_base_latency_us` (`meshtron calibrate` fits all three), `BASE_LATENCY_S` if unset.
  Latency therefore grows linearly with the ranks in the ring: a 1,536-rank ring pays over 1,500
  step latencies per collective, whatever its size.
* bandwidth: the ring's bus bandwidth is nChannels x per-channel speed; across nodes NCCL lays
  one channel per NIC (rail-aligned), so a flat ring whose members fill `local` GPUs of each node
  drives `local` NICs per node and reaches min(NVLink, local x NIC) per rank (a data-parallel
  group with one member per node, as under tp=8, runs at one NIC's rate). Ring all-gather and
  reduce-scatter move (n-1)/n of the buffer per rank; all-reduce twice that.
* all-reduce may also run as NCCL's double binary tree: latency baseLat + 2((n/N - 1) hwLat_NVLink
  + log2(N) hwLat_NET), bandwidth 0.9 of the ring's (tuning.cc's tree refinements); NCCL picks
  the faster, so do we.

The size dependence of achieved bandwidth follows from the latency term: a ring step moves a
per-rank chunk B/n, so busbw = ((n-1)/n) B / t falls well below link speed when B/n is a few
hundred kB (e.g. ZeRO-3's per-layer all-gathers over hundreds of ranks). `bus_bandwidth` reports it.

Groups are flat rings over all their members (NCCL's default, one communicator per group).
HSDP's two levels are two real groups (shard, then replica), costed as such in estimate.py;
`hierarchical=True` gives the two-level scheme (reduce-scatter inside the node, collective of
the 1/g shard across nodes, all-gather inside) for a runtime that splits one group that way.

Achieved link rates: NCCL's all-reduce bus bandwidth on DGX nodes is about 80% of NVLink's
per-direction figure (NCCL caps A100 rings at 235 of 300 GB/s in tuning.cc; ~360 of 450 on H100
in nccl-tests) and about 90% of the NIC line rate across nodes. A cluster file may override both
with `bandwidth_efficiency` (e.g. 1.0 for measured figures).

Which ranks form each group, and so how many nodes it spans and how many members share a node,
comes from placement.py (the same placement the runtime's mesh is built from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.planner.cluster import ClusterSpec

NVLINK_EFFICIENCY = 0.8
"""Fraction of NVLink's per-direction bandwidth a ring collective reaches (nccl-tests busbw)."""
NETWORK_EFFICIENCY = 0.9
"""Fraction of the per-GPU NIC line rate a ring collective reaches (nccl-tests busbw)."""
BASE_LATENCY_S = 8.4e-6
"""NCCL's base latency of a ring collective with the Simple protocol (tuning.cc baseLat)."""
TREE_BW_FACTOR = 0.9
"""NCCL's tree all-reduce reaches 0.9 of the ring's bus bandwidth (tuning.cc)."""


@dataclass(frozen=True)
class Fabric:
    """Effective link figures used by the collective formulas."""

    intra_bw: float
    """Achieved intra-node bandwidth, bytes/s per GPU per direction."""
    inter_bw: float
    """Achieved inter-node bandwidth, bytes/s per GPU (one NIC) per direction."""
    intra_alpha: float
    """Per-step latency of a ring step over NVLink, seconds (NCCL hwLat NVLink)."""
    inter_alpha: float
    """Per-step latency of a ring step across nodes, seconds (NCCL hwLat NET)."""
    gpus_per_node: int
    """GPUs per node, to place groups."""
    base_latency: float = BASE_LATENCY_S
    """Fixed latency of one collective launch, seconds (NCCL baseLat)."""

    @classmethod
    def of(cls, cluster: ClusterSpec) -> "Fabric":
        e_intra = cluster.bandwidth_efficiency or NVLINK_EFFICIENCY
        e_inter = cluster.bandwidth_efficiency or NETWORK_EFFICIENCY
        base = cluster.collective_base_latency_us
        # A single-node cluster never uses the network; keep the numbers anyway.
        return cls(intra_bw=cluster.intra_node_gb_per_s * 1e9 * e_intra,
                   inter_bw=cluster.inter_node_gb_per_s * 1e9 * e_inter,
                   intra_alpha=cluster.intra_node_latency_us * 1e-6,
                   inter_alpha=cluster.inter_node_latency_us * 1e-6,
                   gpus_per_node=cluster.gpus_per_node,
                   base_latency=BASE_LATENCY_S if base is None else base * 1e-6)


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


# ---- primitive formulas --------------------------------------------------------------------
def ring_all_reduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Textbook ring all-reduce among n members of one link type: 2(n-1)a + 2(n-1)/n B/bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def ring_reduce_scatter(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Textbook ring reduce-scatter of a full `nbytes` buffer: (n-1)a + (n-1)/n B/bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


ring_all_gather = ring_reduce_scatter
"""All-gather into a full `nbytes` buffer costs the same as reduce-scatter of it."""


def p2p(nbytes: float, bw: float, alpha: float) -> float:
    """Point-to-point send: a + B/bw."""
    return alpha + nbytes / bw if nbytes > 0 else 0.0


# ---- NCCL's model ---------------------------------------------------------------------------
def ring_bus_bw(group: Group, fab: Fabric) -> float:
    """Bus bandwidth per rank of a flat ring: NVLink inside a node; across nodes one NIC per
    member of the node (rail-aligned channels), never more than NVLink carries."""
    if group.nodes <= 1:
        return fab.intra_bw
    return min(fab.intra_bw, max(1, group.local) * fab.inter_bw)


def ring_latency(group: Group, fab: Fabric, all_reduce: bool = False) -> float:
    """baseLat + (nsteps - nInterSteps) * hwLat_NVLink + nInterSteps * hwLat_NET."""
    k = 2 if all_reduce else 1
    steps = k * (group.size - 1)
    inter = k * (group.nodes - 1)
    return fab.base_latency + (steps - inter) * fab.intra_alpha + inter * fab.inter_alpha


def _ring(nbytes: float, group: Group, fab: Fabric, all_reduce: bool) -> float:
    n = group.size
    volume = (2.0 if all_reduce else 1.0) * (n - 1) / n * nbytes
    return ring_latency(group, fab, all_reduce) + volume / ring_bus_bw(group, fab)


def _tree_all_reduce(nbytes: float, group: Group, fab: Fabric) -> float:
    local = max(1, group.local)
    lat = fab.base_latency + 2 * ((local - 1) * fab.intra_alpha
                                  + math.log2(max(1, group.nodes)) * fab.inter_alpha)
    return lat + 2.0 * nbytes / (TREE_BW_FACTOR * ring_bus_bw(group, fab))


def all_reduce(nbytes: float, group: Group, fab: Fabric, hierarchical: bool = False) -> float:
    """All-reduce of `nbytes` per member: NCCL's faster of ring and tree (flat groups), or the
    two-level scheme (hierarchical=True)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if hierarchical and group.nodes > 1 and group.local > 1:
        g = group.local
        inner, outer = Group(g, g), Group(group.nodes, 1)
        return (reduce_scatter(nbytes, inner, fab) + all_reduce(nbytes / g, outer, fab)
                + all_gather(nbytes, inner, fab))
    ring = _ring(nbytes, group, fab, all_reduce=True)
    if group.nodes <= 1:
        return ring
    return min(ring, _tree_all_reduce(nbytes, group, fab))


# NCCL's low-latency protocol (LL): what its tuner picks for buffers of a few kilobytes, whose
# time is all latency. Its own figures and formulas (NVIDIA/nccl src/graph/tuning.cc
# ncclTopoTuneModel, the same in v2.23.4-1 and v2.26.2-1, the NCCLs of the 2025 NGC
# containers): baseLat tree 6.8 us, ring 6.6 us; hwLat over NVLink 0.6 us (tree and ring),
# over the network 5.0 us (tree) and 2.7 us (ring), the tree's 5.0 us for the ring too with
# one rank per node ("with ppn=1 latencies are fully exposed"); an all-reduce ring's
# 2(n - 1) steps of which 2(N - 1) cross nodes, its intra-node steps at least the network
# overhead getNetOverhead (1 us on Intel x86 and others, 2 us on AMD x86: the cluster does not
# say its CPU, 1 us priced); LL's bus bandwidth is the ring's x 0.5 (ring) and / 3.8 (tree).
# Older NCCLs differ: v2.18-v2.20 give the ring's LL a quarter of the bandwidth (busBw / 4 for
# an all-reduce) and v2.18-v2.22 count 2N inter-node steps (not 2(N - 1)) without the
# one-rank-per-node exception; the baseLat and hwLat figures are the same from v2.18.1-1.
# The cluster's latency fields are the Simple protocol's (above): they do not apply here.
LL_BASE_LATENCY_S = {"tree": 6.8e-6, "ring": 6.6e-6}
"""NCCL's baseLat of the LL protocol (tuning.cc)."""
LL_NVLINK_LATENCY_S = 0.6e-6
"""NCCL's hwLat of one LL step over NVLink, tree and ring (tuning.cc)."""
LL_NET_LATENCY_S = {"tree": 5.0e-6, "ring": 2.7e-6}
"""NCCL's hwLat of one LL step across nodes (tuning.cc); the ring takes the tree's with one
rank per node (v2.23+)."""
NET_OVERHEAD_S = 1.0e-6
"""NCCL's getNetOverhead on Intel x86 (tuning.cc; 2 us on AMD x86): the floor of an
inter-node ring's intra steps."""


def small_all_reduce(nbytes: float, group: Group, fab: Fabric) -> float:
    """All-reduce of a buffer of a few kilobytes (e.g. Transformer Engine's FP8 amaxes) as NCCL
    v2.23+ runs it, with its LL protocol: the faster of the tree, baseLat + 2((n/N - 1)
    hwLat_NVLink + log2(N) hwLat_NET), and the ring, baseLat + (2(n-1) - 2(N-1)) hwLat_intra +
    2(N-1) hwLat_NET (the tree's hwLat_NET with one rank per node), each plus the bytes at LL's
    share of the bus bandwidth (constants above)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    n, nodes, local = group.size, group.nodes, max(1, group.local)
    bus = ring_bus_bw(group, fab)
    tree = (LL_BASE_LATENCY_S["tree"]
            + 2 * ((local - 1) * LL_NVLINK_LATENCY_S
                   + math.floor(math.log2(nodes)) * LL_NET_LATENCY_S["tree"])
            + 2.0 * nbytes / (bus / 3.8))
    inter = 2 * (nodes - 1)
    intra_step = max(LL_NVLINK_LATENCY_S, NET_OVERHEAD_S) if nodes > 1 else LL_NVLINK_LATENCY_S
    net_step = LL_NET_LATENCY_S["tree" if n == nodes else "ring"]
    ring = (LL_BASE_LATENCY_S["ring"] + (2 * (n - 1) - inter) * intra_step
            + inter * net_step + 2.0 * (n - 1) / n * nbytes / (bus / 2.0))
    return min(tree, ring)


def reduce_scatter(nbytes: float, group: Group, fab: Fabric, hierarchical: bool = False) -> float:
    """Reduce-scatter of a full `nbytes` buffer (each member keeps nbytes/size): NCCL ring."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if hierarchical and group.nodes > 1 and group.local > 1:
        g = group.local
        return (reduce_scatter(nbytes, Group(g, g), fab)
                + reduce_scatter(nbytes / g, Group(group.nodes, 1), fab))
    return _ring(nbytes, group, fab, all_reduce=False)


def all_gather(nbytes: float, group: Group, fab: Fabric, hierarchical: bool = False) -> float:
    """All-gather into a full `nbytes` buffer: the mirror image of reduce_scatter."""
    return reduce_scatter(nbytes, group, fab, hierarchical)


def level_terms(op: str, nbytes: float, group: Group) -> list[tuple[float, float, float]]:
    """The formulas above as linear terms, for fitting measurements (`meshtron calibrate`).

    For a group on one fabric level (all members in one node, or one member per node as a
    rail-aligned data-parallel ring), every algorithm NCCL may pick for `op` ('all_reduce',
    'all_gather', 'reduce_scatter') costs  c_base * baseLat + c_step * hwLat + c_bytes / bw
    with the level's per-step latency hwLat and bus bandwidth bw (across nodes: the NIC's, which
    `ring_bus_bw` assumes no faster than NVLink). Returns (c_base, c_step, c_bytes) per algorithm
    (the ring, and for an all-reduce across nodes also the tree); the collective's time is the
    smallest of them, as in `all_reduce`.
    """
    if group.size <= 1 or nbytes <= 0:
        return [(0.0, 0.0, 0.0)]
    if group.nodes > 1 and group.local != 1:
        raise ValueError(f"level_terms: group {group} spans two fabric levels")
    k = 2.0 if op == "all_reduce" else 1.0
    out = [(1.0, k * (group.size - 1), k * (group.size - 1) / group.size * nbytes)]
    if op == "all_reduce" and group.nodes > 1:
        out.append((1.0, 2.0 * math.log2(group.nodes), 2.0 * nbytes / TREE_BW_FACTOR))
    return out


def bus_bandwidth(nbytes: float, group: Group, fab: Fabric) -> float:
    """Achieved bus bandwidth (nccl-tests' busbw) of an all-gather of `nbytes`: falls with the
    per-rank chunk nbytes/size as the step latencies dominate."""
    t = all_gather(nbytes, group, fab)
    return (group.size - 1) / group.size * nbytes / t if t > 0 else 0.0


def send(nbytes: float, crosses_nodes: bool, fab: Fabric) -> float:
    """Point-to-point transfer between pipeline neighbours (NCCL send/recv: baseLat-free p2p
    with one step's latency)."""
    if crosses_nodes:
        return p2p(nbytes, fab.inter_bw, fab.inter_alpha)
    return p2p(nbytes, fab.intra_bw, fab.intra_alpha)
