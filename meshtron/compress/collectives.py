"""Compressed reductions over a data-parallel process group, with error feedback.

Reduce-scatter (ZeRO++ qgZ, Wang et al. 2023, section 4.2): each rank encodes its input once
(row j = the chunk destined for rank j), one all-to-all moves the encoded rows, and the receiver
decodes and sums them in fp32. So each value is quantized exactly once on its way, and the sum
never happens in int8 (gloo has no int8 SUM anyway; NCCL's would overflow). All-reduce is that
reduce-scatter, then the owner re-encodes its fp32 sum and an all-gather returns every chunk:
per rank (n-1)/n of the payload goes each way, as in a ring all-reduce, at 1 + 4/block bytes per
element instead of 4.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD"): a rank adds its residual
(what quantization dropped last time) to its next input, and keeps the new drop as its residual;
the owner of a chunk also keeps the error of its re-encoding. So the sum of everything delivered
over T steps equals the sum of the true inputs minus the residuals now held: the error does not
grow with T (tests/test_compress.py checks this over many steps).

Hierarchical (`Topology` with nodes): full precision where the hop stays inside a node (fp32
reduce-scatter over the node's ranks), compressed only across nodes (the same local rank on every
node: rail-aligned), then an fp32 all-gather inside the node.

All sums are SUMs: the caller divides by the group size (gloo rejects integer AVG).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.compress.quant import Codec, padded_len
from meshtron.torch_compat import all_gather_into, reduce_scatter_into


@dataclass
class Topology:
    """A data-parallel group and, for the hierarchical reduction, its intra-/inter-node split."""

    group: object
    """The whole data-parallel process group."""
    size: int
    """Ranks in `group`."""
    rank: int
    """This rank's index in `group`."""
    intra: object = None
    """This rank's node's members of `group` (None: no hierarchy)."""
    inter: object = None
    """The members of `group` with this rank's local index, one per node (None: no hierarchy)."""
    per_node: int = 1
    """Members of `group` per node (k)."""
    nodes: int = 1
    """Nodes `group` spans (m); size = nodes * per_node."""
    crosses_nodes: bool = True
    """False when compression is asked for the inter-node hop only and the group sits in one
    node: nothing is compressed then."""

    @property
    def hierarchical(self) -> bool:
        return self.intra is not None

    @property
    def local(self) -> int:
        """Index inside the node (l); the node is rank // per_node."""
        return self.rank % self.per_node

    def release(self) -> None:
        """Destroy the intra-/inter-node subgroups this topology created (not `group`, which
        belongs to the mesh)."""
        for g in (self.intra, self.inter):
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self.intra = self.inter = None


def node_groups(member_lists: list[list[int]], ranks_per_node: int) -> tuple[list, list, int, int]:
    """Intra-node and inter-node rank lists of every data-parallel group (global ranks, each
    group's members in group order), for `dist.new_subgroups_by_enumeration`. Returns (intra,
    inter, per_node, nodes); raises ValueError when a group puts different numbers of members on
    its nodes (the plan's placement never does)."""
    intra, inter = [], []
    per_node = nodes = 1
    for members in member_lists:
        by_node: dict[int, list[int]] = {}
        for r in members:
            by_node.setdefault(r // ranks_per_node, []).append(r)
        sizes = {len(v) for v in by_node.values()}
        if len(sizes) != 1:
            raise ValueError(f"data-parallel group {members}: uneven members per node "
                             f"({ranks_per_node} ranks per node)")
        per_node, nodes = sizes.pop(), len(by_node)
        rows = list(by_node.values())
        intra.extend(rows)
        inter.extend([row[j] for row in rows] for j in range(per_node))
    return intra, inter, per_node, nodes


def build_topology(group, member_lists: list[list[int]], ranks_per_node: int | None
                   ) -> Topology:
    """Topology of `group` (whose members are one of `member_lists`, the data-parallel groups
    of the whole world, each in group order). With `ranks_per_node`, and a group that spans
    several nodes with several members each, creates the intra/inter subgroups: a collective,
    every rank of the world calls it with the same lists."""
    topo = Topology(group, dist.get_world_size(group), dist.get_rank(group))
    if not ranks_per_node:
        return topo
    intra, inter, per_node, nodes = node_groups(member_lists, ranks_per_node)
    topo.per_node, topo.nodes = per_node, nodes
    topo.crosses_nodes = nodes > 1
    if per_node > 1 and nodes > 1:
        topo.intra, _ = dist.new_subgroups_by_enumeration(intra)
        topo.inter, _ = dist.new_subgroups_by_enumeration(inter)
    return topo


def _exchange(payload: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of a packed [n, bytes] tensor (row j goes to rank j)."""
    out = torch.empty_like(payload)
    dist.all_to_all_single(out, payload.contiguous(), group=group)
    return out


def _gather(payload: torch.Tensor, group, n: int) -> torch.Tensor:
    """All-gather of a packed [1, bytes] tensor into [n, bytes]."""
    out = torch.empty((n, *payload.shape[1:]), dtype=payload.dtype, device=payload.device)
    all_gather_into(out, payload.contiguous(), group=group)
    return out


class Reducer:
    """Compressed SUM reductions over one `Topology`, keeping one residual per `key` (a bucket:
    a model part's gradients, an FSDP unit, DiLoCo's outer gradient).

    Residuals are in the sum domain of this rank's own input: `residuals[key]` is what this rank
    still owes the group's sum."""

    def __init__(self, topo: Topology, codec: Codec, error_feedback: bool = True):
        self.topo = topo
        # compress_scope='inter_node' on a group inside one node: every hop stays in the node
        self.codec = codec if topo.crosses_nodes else Codec("none", codec.block)
        codec = self.codec
        self.error_feedback = error_feedback and codec.mode != "none"
        self.residuals: dict[str, torch.Tensor] = {}
        self.bytes_sent = 0
        """Bytes this rank put on the wire (payload it sent to other ranks), for benchmarks."""

    # ---- error feedback ----------------------------------------------------------------------
    def _with_residual(self, key: str, x: torch.Tensor) -> torch.Tensor:
        e = self.residuals.get(key)
        if self.error_feedback and e is not None and e.shape == x.shape:
            return x + e
        return x

    def _keep(self, key: str, x: torch.Tensor, delivered: torch.Tensor) -> None:
        if self.error_feedback:
            self.residuals[key] = x - delivered

    # ---- the compressed core -----------------------------------------------------------------
    def _reduce_scatter_rows(self, x: torch.Tensor, group, n: int, key: str) -> torch.Tensor:
        """Row `me` of the SUM over ranks of `x` [n, C] (C a multiple of the codec's row
        multiple), fp32; error feedback on `x` under `key`."""
        x = self._with_residual(key, x)
        wire = self.codec.encode(x)
        self._keep(key, x, self.codec.decode(wire))
        payload = self.codec.pack(wire)
        self._count(payload, (n - 1) / n)
        return self.codec.decode(self.codec.unpack(_exchange(payload, group))).sum(dim=0)

    def _count(self, payload: torch.Tensor, fraction: float) -> None:
        self.bytes_sent += int(payload.numel() * payload.element_size() * fraction)

    def _all_reduce_flat(self, flat: torch.Tensor, group, n: int, me: int, key: str
                         ) -> torch.Tensor:
        """SUM over the group of `flat` (1-D fp32), compressed both ways."""
        numel = flat.numel()
        cols = padded_len(-(-numel // n), self.codec.row_multiple)
        buf = torch.zeros(n * cols, dtype=torch.float32, device=flat.device)
        buf[:numel] = flat
        mine = self._reduce_scatter_rows(buf.view(n, cols), group, n, key)
        wire = self.codec.encode(mine[None])
        if self.error_feedback:  # the owner keeps the error of re-encoding its sum
            self.residuals[key].view(n, cols)[me] += mine - self.codec.decode(wire)[0]
        payload = self.codec.pack(wire)
        self._count(payload, n - 1)
        full = self.codec.decode(self.codec.unpack(_gather(payload, group, n)))
        return full.reshape(-1)[:numel]

    # ---- public reductions ---------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, key: str) -> torch.Tensor:
        """SUM of `flat` (1-D fp32) over the data-parallel group; hierarchical when the topology
        has nodes (fp32 inside the node, compressed across)."""
        t = self.topo
        if t.size == 1:
            return flat.clone()
        if not t.hierarchical:
            return self._all_reduce_flat(flat, t.group, t.size, t.rank, key)
        k, numel = t.per_node, flat.numel()
        cols = -(-numel // k)
        buf = torch.zeros(k * cols, dtype=torch.float32, device=flat.device)
        buf[:numel] = flat
        part = torch.empty(cols, dtype=torch.float32, device=flat.device)
        reduce_scatter_into(part, buf, group=t.intra)
        self.bytes_sent += 4 * cols * (k - 1)
        part = self._all_reduce_flat(part, t.inter, t.nodes, t.rank // k, key)
        full = torch.empty(k * cols, dtype=torch.float32, device=flat.device)
        all_gather_into(full, part, group=t.intra)
        self.bytes_sent += 4 * cols * (k - 1)
        return full[:numel]

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, key: str) -> None:
        """`out` (S,) = this rank's chunk of the SUM of `inp` (n*S,) over the group (FSDP2's
        reduce-scatter layout: chunk j for data-parallel rank j)."""
        t = self.topo
        n = t.size
        size = out.numel()
        cols = padded_len(size, self.codec.row_multiple)
        rows = inp.reshape(n, size).float()
        if not t.hierarchical:
            x = torch.zeros(n, cols, dtype=torch.float32, device=inp.device)
            x[:, :size] = rows
            out.copy_(self._reduce_scatter_rows(x, t.group, n, key)[:size])
            return
        k, m = t.per_node, t.nodes
        # Chunk of rank (node a, local l) is row a*k + l: local rank l first collects, in fp32,
        # its node's sum of the rows {a*k + l : every node a}, then the nodes exchange them.
        by_local = rows.reshape(m, k, size).transpose(0, 1).contiguous()
        part = torch.empty(m * size, dtype=torch.float32, device=inp.device)
        reduce_scatter_into(part, by_local.reshape(-1), group=t.intra)
        self.bytes_sent += 4 * m * size * (k - 1)
        x = torch.zeros(m, cols, dtype=torch.float32, device=inp.device)
        x[:, :size] = part.view(m, size)
        out.copy_(self._reduce_scatter_rows(x, t.inter, m, key)[:size])

    # ---- checkpoint form -------------------------------------------------------------------------
    @property
    def keeps_residuals(self) -> bool:
        """Error feedback holds residuals on this rank (compressed, more than one rank)."""
        return self.error_feedback and self.topo.size > 1

    def own_residual(self, key: str, numel: int, layout: str, device=None) -> torch.Tensor:
        """This rank's own residual of bucket `key` (not the group's mean: a resume on the same
        layout restores it and continues bit for bit). Before the bucket's first reduction,
        zeros shaped as it will be (what a checkpoint load fills in place). The tensor itself,
        not a copy: a reduction replaces a residual (`_keep`) and writes only into the one it
        just made, so a background checkpoint copy of this one reads it unchanged."""
        e = self.residuals.get(key)
        if e is not None:
            return e
        rows, cols, _ = self._geometry(numel, layout)
        return torch.zeros(rows, cols, dtype=torch.float32, device=device)

    def load_own_residual(self, key: str, e: torch.Tensor) -> None:
        """Set this rank's residual of `key` to `e`, one `own_residual` returned on the same
        layout."""
        self.residuals[key] = e.float()

    def mean_residual(self, key: str, numel: int, layout: str, device=None) -> torch.Tensor:
        """The group's mean untransmitted input of bucket `key` over its first `numel` input
        elements (one all-reduce; identical on every rank): what error feedback still owes the
        average. `layout`: 'all_reduce' or 'reduce_scatter' (how the bucket is reduced)."""
        t = self.topo
        dom = self._domain(numel, layout)
        full = torch.zeros(dom, dtype=torch.float32, device=device)
        e = self.residuals.get(key)
        if e is not None and t.size > 1:
            self._place(full, e, numel, layout, scale=1.0)
        dist.all_reduce(full, group=t.group)
        return (full / t.size)[:numel]

    def load_mean_residual(self, key: str, mean: torch.Tensor, layout: str) -> None:
        """Set this rank's residual so that the group's total equals size * `mean` (the inverse
        of `mean_residual`, for any group size: resharding keeps what is owed, not who owes
        it)."""
        t = self.topo
        if not self.error_feedback or t.size == 1:
            return
        numel = mean.numel()
        full = torch.zeros(self._domain(numel, layout), dtype=torch.float32, device=mean.device)
        full[:numel] = mean.reshape(-1).float()
        self.residuals[key] = self._take(full, numel, layout)

    def _domain(self, numel: int, layout: str) -> int:
        """Length of the padded input domain the residual lives in."""
        t = self.topo
        if layout == "reduce_scatter":
            return numel
        k = t.per_node if t.hierarchical else 1
        return k * -(-numel // k) if t.hierarchical else numel

    def _geometry(self, numel: int, layout: str) -> tuple[int, int, int]:
        """(rows, cols, size) of this rank's residual tensor for an input of `numel`."""
        t = self.topo
        mult = self.codec.row_multiple
        if layout == "reduce_scatter":
            size = numel // t.size
            rows = t.nodes if t.hierarchical else t.size
            return rows, padded_len(size, mult), size
        n = t.nodes if t.hierarchical else t.size
        length = -(-numel // t.per_node) if t.hierarchical else numel
        return n, padded_len(-(-length // n), mult), length

    def _place(self, full: torch.Tensor, e: torch.Tensor, numel: int, layout: str,
               scale: float) -> None:
        """Add residual `e` into the input domain `full` at the elements it covers."""
        t = self.topo
        rows, cols, size = self._geometry(numel, layout)
        e = e.reshape(rows, cols)
        if layout == "reduce_scatter":
            if t.hierarchical:  # rows are chunks a*k + l
                full.view(t.nodes, t.per_node, size)[:, t.local] += scale * e[:, :size]
            else:
                full.view(t.size, size).add_(scale * e[:, :size])
            return
        flat = e.reshape(-1)[:size]
        if t.hierarchical:
            full.view(t.per_node, size)[t.local] += scale * flat
        else:
            full[:size] += scale * flat

    def _take(self, full: torch.Tensor, numel: int, layout: str) -> torch.Tensor:
        """This rank's residual whose group total is size * full (inverse of `_place`)."""
        t = self.topo
        rows, cols, size = self._geometry(numel, layout)
        e = torch.zeros(rows, cols, dtype=torch.float32, device=full.device)
        k = t.per_node if t.hierarchical else 1
        # Each covered element is shared by size / k ranks (the other nodes' same local rank
        # cover it too); each takes k times the mean so the group total is size times it.
        if layout == "reduce_scatter":
            if t.hierarchical:
                e[:, :size] = k * full.view(t.nodes, t.per_node, size)[:, t.local]
            else:
                e[:, :size] = full.view(t.size, size)
            return e
        flat = e.view(-1)
        flat[:size] = k * (full.view(t.per_node, size)[t.local] if t.hierarchical
                           else full[:size])
        return e
