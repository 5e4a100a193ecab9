"""The attention core and context parallelism of one layer on one GPU: the core's forward and
backward seconds (`core_time`), the K/V exchange context parallelism exposes (`cp_exposed`) over
its group (`cp_group`), and the host launches torch's ring attention adds (`ring_issue`);
planner/compute.py `layer_cost` adds them to the layer.

Attention core: 'flash' (FlashAttention-2, Dao 2023) skips the masked half of a causal square,
keeps no s x s matrix in memory, and its backward executes 2.5x the forward's matmul FLOPs (5
GEMMs instead of 2); its GEMMs are head_dim wide, timed by the same efficiency model; with
context parallelism, at the shapes of the calls the stack makes (ring_attention.py
`ring_core_time`); a kernel compiled to Ampere's mma.sync (KernelOptions.flash_isa
'sm80') at the peak those instructions reach on the GPU (planner/flash_isa.py). 'unfused'
(Megatron-LM 2019-2022, used by the calibration runs) computes the full square with two batched
GEMMs and moves the a*s^2 score matrix through softmax (and dropout) in HBM.
"""

from __future__ import annotations

from meshtron.model.cp_halo_plan import halo_rows, halo_traffic
from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, flash_isa, host
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.gemm import BF16, cluster_gemm_time
from meshtron.planner.kernel_options import KernelOptions
from meshtron.planner.overlap import overlapped
from meshtron.planner.ring_attention import (
    bwd_ratio, ring_core_time, torch_ring_exposed, torch_ring_launches)


def ring_issue(cp: int, per_op_s: float, issue_f: float, issue_b: float,
               launches=torch_ring_launches) -> tuple[float, float]:
    """Host issue seconds of a layer with a ring attention written in Python: the plain
    layer's plus the ring's own ops and collectives (`launches`: torch's ring,
    ring_attention.torch_ring_launches, or Transformer Engine's, te_ring_launches), each at a
    forward op's cost: either ring's backward runs as Python, not in autograd's C++ engine."""
    ops_f, ops_b, coll_f, coll_b = launches(cp)
    return issue_f + (ops_f + coll_f) * per_op_s, issue_b + (ops_b + coll_b) * per_op_s


def cp_halo_rows(model: ModelSpec, seq: int, cp: int) -> int | None:
    """Rows of K/V before a query that a sliding block's band reaches under meshtron's context
    parallelism (window - 1), fetched from the ranks holding them instead of all-gathering the
    sequence where that moves fewer rows (the runtime's own rule, model/cp_halo_plan.py
    `halo_rows`); None where the whole sequence is gathered (no sliding block, a sequence
    within the window, or a window so long that the halo would move as much)."""
    w = model.sliding_window
    if cp == 1 or not (w and model.sliding_blocks and seq > w):
        return None
    return halo_rows(seq, cp, w)


def sliding_share(model: ModelSpec) -> float:
    """The share of the blocks that slide (Gemma 3: 5 of 6)."""
    return model.sliding_blocks / model.layers


def window_share(model: ModelSpec, seq: int) -> float:
    """The share of the causal square a flash kernel computes, averaged over the blocks, with
    sliding-window blocks (ModelSpec.sliding_window w, a query attending to itself and w - 1
    predecessors): FlashAttention's local attention (window_size, Dao 2023; FlexAttention's
    block mask alike) skips the tiles wholly outside the window, so a sliding block's core is
    sum_i min(i, w) of the causal square's s(s+1)/2 query-key pairs; or with chunked blocks
    (ModelSpec.attn_chunk c, Llama 4: transformers 5.25 masking_utils.chunked_overlay,
    kv_idx // c == q_idx // c under the causal mask), (s // c) causal squares of c(c+1)/2
    pairs and one of the remainder's. The tiles the window's or a chunk's edge cuts are not
    counted. 1.0 without either or where the sequence fits in one window or chunk."""
    full = seq * (seq + 1) / 2
    w, c = model.sliding_window, model.attn_chunk
    if w and seq > w and model.sliding_blocks:
        part, n = (w * (w + 1) / 2 + (seq - w) * w) / full, model.sliding_blocks
    elif c and seq > c and model.chunked_blocks:
        r = seq % c
        part, n = ((seq // c) * c * (c + 1) / 2 + r * (r + 1) / 2) / full, model.chunked_blocks
    else:
        return 1.0
    return (n * part + (model.layers - n)) / model.layers


def core_widths(model: ModelSpec, opts: KernelOptions) -> tuple[int, int]:
    """(q/k, v) head sizes the attention kernel runs at: V at its own width where the stack's
    kernel takes it (KernelOptions.v_width 'native'), else padded to the q/k head (MLA in
    meshtron's runtime: model/mla.py)."""
    return model.head_dim, model.v_dim if opts.v_width == "native" else model.head_dim


def core_time(cluster: ClusterSpec, opts: KernelOptions, batch_heads: float, q_len: float,
               seq: int, cp: int, hd: int, bw: float,
               hd_v: int | None = None) -> tuple[float, float,
                                                 tuple[float, float, float, float] | None]:
    """(forward, backward, ring) seconds of the attention core on one rank: `q_len` queries
    per head against the causal `seq`; `ring`: ring_core_time's four figures where a flash
    core runs with cp > 1, else None.

    Causal FlashAttention computes about half the square; per head: QK^T at the q/k head size
    `hd` and PV at V's `hd_v` (None: `hd`; core_widths), timed by the GEMM model (with context
    parallelism the load-balanced split gives every rank 1/cp of the square, in cp calls:
    ring_attention.ring_core_time). The unfused core computes the full square with two
    batched GEMMs and moves the scores through HBM."""
    hd_v = hd if hd_v is None else hd_v
    if opts.attention == "flash" and cp > 1:
        ring = ring_core_time(cluster, batch_heads, q_len, cp, hd, hd_v)
        return ring[0], ring[1], ring
    one = (cluster_gemm_time(q_len, seq, hd, cluster)
           + cluster_gemm_time(q_len, hd_v, seq, cluster))
    if opts.attention == "flash":
        if opts.flash_isa != "native":  # its GEMMs at the peak its instructions reach; the
            # tile model at a lower peak saturates sooner, so it could price short sequences
            # faster than the native kernel: a slower instruction never is
            sm = flash_isa.core_cluster(cluster, opts.flash_isa)
            one = max(one, cluster_gemm_time(q_len, seq, hd, sm)
                      + cluster_gemm_time(q_len, hd_v, seq, sm))
        core_fwd = 0.5 * batch_heads * one
        return core_fwd, bwd_ratio(hd, hd_v) * core_fwd, None
    core_fwd = batch_heads * one
    # Score matrix through the fused scale-mask-softmax kernel, per token and local head:
    # read + write 2s bytes each = 4s; with dropout a separate kernel reads the
    # probabilities, writes the dropped copy and a 1-byte mask: +5s (the tensors of
    # Korthikanti et al. 2022's activation list). Eager code masks in a kernel of its own
    # before the softmax: +4s. The GEMMs' own reads and writes of the scores are in their
    # roofline.
    per_score = (9 if opts.dropout else 4) + (4 if opts.stack == "eager" else 0)
    core_fwd += per_score * batch_heads * seq * q_len / bw  # q_len x seq scores per head
    core_bwd = 2.0 * core_fwd
    if opts.score_bias_copy:  # baddbmm(bias, ...): the bias copied in, read by the GEMM
        core_fwd += 4 * batch_heads * seq * q_len / bw
    return core_fwd, core_bwd, None


def cp_exposed(cluster: ClusterSpec, fab: comm.Fabric, opts: KernelOptions, dtype: str,
                tp: int, cp: int, kv_elems: float, core_fwd: float, core_bwd: float,
                ring: tuple[float, float, float, float] | None,
                halo: tuple[float, float] | None = None) -> tuple[float, float]:
    """(forward, backward) exposed seconds of context parallelism's K/V exchange for
    `kv_elems` K (= V) elements on this rank. K/V of the local tokens travel to the other
    cp-1 ranks (ring: cp-1 p2p steps of the local K/V chunk; all-gather: the same volume),
    their gradients come back in the backward (Liu et al. 2023 "Ring Attention";
    Megatron-Core context parallelism docs). `ring` (torch's ring attention, with its
    calls' times): its own collectives, ring_attention.py; else hidden behind the core
    where the stack overlaps them (`cp_overlap`), exposed otherwise. `halo` (meshtron's
    all-gather runtime with sliding blocks under the halo exchange, `cp_halo`): (share of the
    blocks that slide, halo rows over local rows); those blocks move the halos only."""
    kv_bytes = (4.0 if dtype == "fp32" else BF16) * 2 * kv_elems
    cpg = cp_group(tp, cp, cluster.gpus_per_node)
    nccl = host.sm_interference(cluster, cpg.nodes > 1)
    if ring is not None:
        return torch_ring_exposed(kv_elems, cp, cpg, fab, ring[2], ring[3],
                                  core_bwd - ring[3], nccl)
    cp_f = comm.all_gather(kv_bytes * cp, cpg, fab)
    cp_b = comm.reduce_scatter(kv_bytes * cp, cpg, fab)
    if opts.cp_overlap:
        # Transformer Engine's p2p ring keeps no gathered K/V: its backward sends the K/V
        # chunks around the ring again beside the dK/dV partial sums (AttnFuncWithCPAndKVP2P
        # backward, transformer_engine/pytorch/attention.py v1.11 / v2.1: the first step's
        # buffer holds K/V, the middle steps' both, the last step's dK/dV), twice the
        # forward's bytes per rank, each step's send beside that step's kernel
        cp_b += cp_f
        return overlapped(cp_f, core_fwd, nccl), overlapped(cp_b, core_bwd, nccl)
    if halo is not None:
        # parallel/cp_halo.py `exchange_halos`: each rank receives the rows before its chunks
        # that their windows reach from the ranks holding them (one all_to_all of K and V,
        # priced as a send of the busiest rank's rows, the most any rank sends or receives,
        # its sends and receives at once: 2(w-1) rows where the window fits in a chunk,
        # model/cp_halo_plan.py `halo_traffic`); backward moves the same rows' gradients
        # the other way (forward's busiest sender receives them)
        share, rows = halo
        moved = comm.send(kv_bytes * rows, cpg.nodes > 1, fab)
        cp_f = (1.0 - share) * cp_f + share * moved
        cp_b = (1.0 - share) * cp_b + share * moved
    return cp_f, cp_b


def cp_halo(model: ModelSpec, opts: KernelOptions, seq: int, cp: int) -> tuple[float, float] | None:
    """`cp_exposed`'s `halo` for meshtron's runtime (the all-gather design: neither
    `cp_overlap` nor `torch_ring`): (sliding share, the busiest rank's halo rows sent or
    received over the seq/cp local rows), or None where every block gathers the whole
    sequence."""
    halo = cp_halo_rows(model, seq, cp)
    if halo is None or opts.cp_overlap or opts.torch_ring:
        return None
    return sliding_share(model), halo_traffic(seq, cp, model.sliding_window)[0] / (seq / cp)


def cp_group(tp: int, cp: int, gpus_per_node: int) -> comm.Group:
    """The context-parallel Group: cp ranks tp apart (mesh order ..., "cp", "tp")."""
    from meshtron.planner.placement import MESH_AXES_CP, Placement

    return Placement(MESH_AXES_CP, (1, 1, 1, cp, tp), gpus_per_node).group("cp")
