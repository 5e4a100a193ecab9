"""What gradient compression and DiLoCo cost and save, for the planner (planner/estimate.py).

Bytes on the wire per gradient element: int8 1 + 4/block (the fp32 scale of each block), bf16
2, none: the estimator's gradient size (4 with fp32 reduction, 2 in bf16). The compressed
all-reduce is an all-to-all then an all-gather (collectives.py); per rank they move the same
(n-1)/n of the buffer each way as a ring all-reduce (ZeRO++, Wang et al. 2023, section 4.2),
so it is costed as NCCL's all-reduce of the compressed bytes (comm.py). With
compress_scope='inter_node' the fp32 reduce-scatter and all-gather stay inside the node and
only 1/local of the buffer crosses nodes, compressed (comm.py's two-level scheme).

Quantization work is memory-bound: per gradient element on each rank, the absmax pass reads 4
bytes, scaling reads 4 and writes 1; error feedback reads and writes the fp32 residual (8) and
the decoded copy it subtracts (4); the receiver reads 1 and accumulates into fp32 (8); the
all-gather's decode reads 1 and writes 4: about CODEC_BYTES_PER_ELEMENT bytes of HBM traffic
(bf16 is within a few bytes of it), at the estimator's achieved HBM bandwidth.

meshtron's compressed ZeRO-0/1 reduce once per step after the backward (not overlapped);
ZeRO-2/3 compress FSDP2's per-unit reduce-scatters, which keep their overlap. DiLoCo
(Douillard et al. 2023) replaces the per-step gradient reduction by one all-reduce of the
parameters every H steps (the replicas wait for it) plus the outer Nesterov update (read theta,
the replica's copy and the momentum, write theta, momentum and the copy: OUTER_BYTES_PER_PARAM).
The model costs time per step only: DiLoCo's loss per step differs from data parallelism's
(the paper: close for H up to ~500 at 8 replicas), which the planner does not predict.
"""

from __future__ import annotations

from typing import Any

from meshtron.planner import comm


PAPER_H = 500
"""The inner-step count the paper tuned outer lr 0.7 / Nesterov 0.9 for (Douillard et al. 2023)."""


def outer_settings(plan: Any) -> tuple[float, float]:
    """DiLoCo's (outer lr, outer momentum): the plan's, where it sets them, else chosen by H
    (compress/diloco.py module doc: parameter averaging below the paper's H, the paper's values
    from there). Here, without torch, for the planner's memory (no momentum buffer at 0) and the
    runtime alike."""
    lr, momentum = (0.7, 0.9) if plan.diloco >= PAPER_H else (1.0, 0.0)
    return (lr if plan.outer_lr is None else float(plan.outer_lr),
            momentum if plan.outer_momentum is None else float(plan.outer_momentum))

CODEC_BYTES_PER_ELEMENT = 35.0
"""HBM bytes per gradient element of quantize + error feedback + decode-and-sum (module doc)."""
OUTER_BYTES_PER_PARAM = 24.0
"""HBM bytes per parameter of DiLoCo's outer step (three fp32 reads, three fp32 writes)."""


def compresses(plan, group: comm.Group) -> bool:
    """The codec runs on `group`'s reduction: bf16 or int8, except under
    compress_scope='inter_node' on a group inside one node, where meshtron's Reducer sends
    fp32 on every hop and keeps no residual (compress/collectives.py `Reducer`: Codec('none');
    such a run ends 'not compressed', audit s55). Priced compressed, a one-node int8 plan of
    that scope was faster than its bf16 twin and held a residual the run never allocates.
    A plan's own `ranks_per_node` (nodes simulated on one machine) sets the runtime's nodes,
    not the cluster's: such a plan is priced compressed, as before."""
    return plan.grad_compression != "none" and not (
        plan.compress_scope == "inter_node" and group.nodes <= 1
        and getattr(plan, "ranks_per_node", None) is None)


def extra_state_bytes(plan, compressed: bool = True) -> float:
    """Bytes per parameter a rank keeps for compression or DiLoCo, beyond the optimizer's:
    the fp32 error-feedback residual (whole local gradients: ZeRO-2/3's reduce-scatter input
    is the unsharded unit; none where the codec does not run: `compressed`, `compresses`), and
    DiLoCo's fp32 outer parameters and, with outer momentum > 0, its momentum (sharded like the
    parameters inside a replica; compress/diloco.py allocates no momentum at 0)."""
    extra = 4.0 if plan.grad_compression != "none" and compressed else 0.0
    if plan.diloco > 0:
        extra = (4.0 * outer_copies(plan) + extra) / plan.dp_shard
    return extra


def outer_copies(plan: Any) -> int:
    """fp32 copies of the local parameters DiLoCo keeps: theta_global, and the momentum where
    there is one (compress/diloco.py allocates none at 0); 0 without DiLoCo."""
    if not plan.diloco:
        return 0
    return 1 + (outer_settings(plan)[1] > 0)


def with_state_bytes(plan, states: tuple[float, float, float],
                     compressed: bool = True) -> tuple[float, float, float]:
    """memory.state_bytes' (weights, gradients, optimizer) with `extra_state_bytes` counted as
    optimizer state."""
    w, g, o = states
    return w, g, o + extra_state_bytes(plan, compressed)


def changes_dp(plan) -> bool:
    """The plan's data-parallel traffic differs from the uncompressed default."""
    return plan.grad_compression != "none" or plan.diloco > 0


def wire_bytes(plan, gsize: float) -> float:
    """Bytes per gradient element on the wire (gsize: the uncompressed gradient's)."""
    if plan.grad_compression == "int8":
        return 1.0 + 4.0 / plan.grad_compression_block
    if plan.grad_compression == "bf16":
        return 2.0
    return gsize


def _hierarchical(plan, group: comm.Group) -> bool:
    return plan.compress_scope == "inter_node" and group.nodes > 1 and group.local > 1


def hierarchy(plan, group: comm.Group) -> int:
    """Ranks per node of the hierarchical form meshtron's Reducer runs on `group` (1: flat)."""
    return group.local if _hierarchical(plan, group) and compresses(plan, group) else 1


def reduce_scatter_s(elems: float, gsize: float, shard: comm.Group, fab: comm.Fabric,
                     split: int = 1) -> float:
    """One reduce-scatter of `elems` gradient elements over `shard`, `gsize` bytes each on the
    wire. `split` > 1 (compress_scope='inter_node' across nodes): compress/collectives.py
    `Reducer.reduce_scatter`'s hierarchical form, fp32 among the node's `split` ranks, then the
    compressed 1/split each of them holds across the nodes (one rank per node)."""
    if split <= 1:
        return comm.reduce_scatter(gsize * elems, shard, fab)
    inner, outer = comm.Group(split, split), comm.Group(shard.size // split, 1)
    return (comm.reduce_scatter(4.0 * elems, inner, fab)
            + comm.reduce_scatter(gsize * elems / split, outer, fab))


def reduce_time(plan, params: float, group: comm.Group, fab: comm.Fabric, hbm: float,
                gsize: float) -> float:
    """One all-reduce of `params` gradients over `group` as meshtron.compress runs it, with the
    codec's memory-bound work."""
    if group.size <= 1:
        return 0.0
    if not compresses(plan, group):  # fp32 on the wire, no codec (and no plan compression)
        return comm.all_reduce(gsize * params, group, fab)
    wire = wire_bytes(plan, gsize)
    if _hierarchical(plan, group):
        k = group.local
        inner, outer = comm.Group(k, k), comm.Group(group.nodes, 1)
        t = (comm.reduce_scatter(gsize * params, inner, fab)
             + comm.all_reduce(wire * params / k, outer, fab)
             + comm.all_gather(gsize * params, inner, fab))
        work = params / k
    else:
        t = comm.all_reduce(wire * params, group, fab)
        work = params
    if plan.grad_compression != "none":
        t += CODEC_BYTES_PER_ELEMENT * work / hbm
    return t


def dp_time(est: Any, plan, params: float, groups: dict[str, Any], m: int, fwd: float,
            bwd: float, layers: int, regather: bool, units: int | None = None,
            kept: float = 0.0) -> float:
    """Exposed data-parallel time per step of a stage with `params` parameters, for a plan
    with compression or DiLoCo (`est`: the planner's Estimator, for its fabric, HBM bandwidth,
    gradient size and the FSDP per-unit model; `units`: the stage's FSDP units)."""
    flags = est.dp_flags(plan)
    gsize = flags["gsize"]
    fab, hbm = est.fab, est.hbm
    if plan.diloco > 0:
        rep = groups["dp_replicate"]
        # each rank syncs the parameters it holds: a 1/dp_shard shard under ZeRO-2/3
        local = params / groups["dp_shard"].size if plan.zero >= 2 else params
        sync = (reduce_time(plan, local, rep, fab, hbm, 4.0)
                + OUTER_BYTES_PER_PARAM * local / hbm)
        inner = 0.0
        if plan.zero >= 2:  # FSDP2 inside each replica, over its dp_shard ranks only
            one = comm.Group(1, 1)
            inner = est._dp_time(params, plan.zero, {**groups, "dp": groups["dp_shard"],
                                                     "dp_replicate": one}, m, fwd, bwd, layers,
                                 regather, units=units, kept=kept, **flags)
        return inner + sync / plan.diloco
    group = groups["dp"]
    if plan.zero >= 2:
        on = compresses(plan, group)
        wire = wire_bytes(plan, gsize) if on else gsize
        split = hierarchy(plan, groups["dp_shard"])
        # the codec runs on every unit's reduce-scatter input, each micro-batch; hierarchical:
        # on the 1/split of it that crosses nodes
        rs_elems = params / split
        reduces = 1 if flags["reduce_once"] else m
        return (est._dp_time(params, plan.zero, groups, m, fwd, bwd, layers, regather,
                             wire=wire, units=units, kept=kept, split=split, **flags)
                + (reduces * CODEC_BYTES_PER_ELEMENT * rs_elems / hbm if on else 0.0))
    # compress/runtime.py: one flat fp32 bucket per model part, compressed on the wire
    t = reduce_time(plan, params, group, fab, hbm, 4.0)
    if plan.zero == 1:
        # parallel/data_parallel.py `zero1_optimizer` (compressed ZeRO-1 keeps FSDP2 off the
        # data axis): each of the n owners broadcasts its fp32 parameters after the step, n
        # broadcasts of params/n; a pipelined broadcast delivers its whole buffer to every rank
        n = group.size
        t += n * _broadcast(4.0 * params / n, group, fab)
    return t


def _broadcast(nbytes: float, group: comm.Group, fab: comm.Fabric) -> float:
    """NCCL's pipelined ring broadcast: the chain's n-1 step latencies, then the whole buffer
    at the ring's bus bandwidth (every member receives all of it)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return comm.ring_latency(group, fab) + nbytes / comm.ring_bus_bw(group, fab)
