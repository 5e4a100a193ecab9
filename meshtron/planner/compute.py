"""FLOPs and time of one transformer layer (and of the embedding and LM head) on one GPU.

Counting. Model FLOPs follow `ModelSpec.flops_per_token` (6N plus the attention square; Kaplan et
al. 2020; Narayanan et al. 2021, eq. 3). Hardware FLOPs add what recomputation executes again:
full recomputation repeats every layer's forward pass (Chen et al. 2016; Narayanan et al. 2021
count it as 4x forward instead of 3x), selective recomputation repeats only the attention core
QK^T / softmax / AV (Korthikanti et al. 2022, section 5). FlashAttention's own recomputation
inside its backward kernel is not counted as hardware FLOPs, as is customary.

Timing of each GEMM: planner/gemm.py (roofline with tile saturation, or a calibrated cluster's
measured efficiency); memory-bound kernels (norms, rotary embedding, activations, the loss) per
software stack: planner/elementwise.py; the software choices themselves: KernelOptions
(planner/kernel_options.py).

Tensor-parallel collectives (`tp_exposed`): each all-gather / reduce-scatter can hide only
behind the GEMM it feeds or follows (QKV, output projection, MLP-up, MLP-down), never behind
the layer's other GEMMs: Transformer Engine's userbuffers (ring exchange on the copy engines
for the gathers, a 4-chunk pipelined reduce-scatter on 16 SMs taken from its GEMM, 'bulk'
overlaps in the backward), PyTorch async TP (tp chunks run one after another), Megatron's
linears (the input gradient reduced beside the weight-gradient GEMM, the sequence-parallel
input re-gathered beside the input-gradient GEMM), or nothing (autograd's conjugates).

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

import math
from dataclasses import dataclass
from functools import lru_cache

from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, flash_isa, flash_unpad, host
from meshtron.planner.placement import tp_group
from meshtron.planner.ring_attention import (
    ring_core_time, torch_ring_bytes, torch_ring_exposed, torch_ring_launches)
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.elementwise import (  # noqa: F401  (kernels_per_layer re-exported)
    NORM_BYTES, NORM_KERNELS, elementwise_bytes, gqa_repeat_bytes, kernels_per_layer, norm_key)
from meshtron.planner.fp8 import (  # noqa: F401  (quantisation_bytes re-exported)
    GEMM_GROUPS, cast_bytes, fp8_fractions, fp8_input_casts, fp8_weight_elements,
    quantisation_bytes)
from meshtron.planner.gemm import (  # noqa: F401  (re-exported for callers)
    BF16, CAST_ADD_BYTES_PER_SM, DISPATCH_S, FP8, HBM_EFFICIENCY, cast_add_bytes_per_s,
    cluster_gemm_time, dispatch_s, fp8_tile_scale, gemm_efficiency, gemm_group,
    membound_bytes_per_s)
from meshtron.planner.kernel_options import (  # noqa: F401  (re-exported: callers' one import)
    DEFAULT_IMBALANCE, KernelOptions, compiled)
from meshtron.planner.overlap import (  # noqa: F401  (re-exported: one formula everywhere)
    DEFAULT_SMS, OVERLAP_INTERFERENCE, TE_UB_COMM_SMS, TE_UB_PIPELINE_SPLITS, overlapped,
    sm_count, sm_margin, tp_exposed)

PART_KINDS = ("gemm", "attention", "elementwise", "fp8_cast", "host_wait")
"""What a layer's or an edge's compute seconds are made of: GEMMs (block linears, the head),
the attention core, memory-bound kernels, FP8 quantisation, and the GPU waiting on the host's
launches (host.launch_bound) or its synchronisations."""


@dataclass(frozen=True)
class LayerCost:
    """Seconds one GPU spends on one transformer layer for one micro-batch."""

    fwd: float
    """Forward compute (GEMMs, attention core, memory-bound kernels)."""
    bwd: float
    """Backward compute (input and weight gradients)."""
    wgrad: float
    """Part of `bwd` that computes weight gradients (deferrable by zero-bubble schedules)."""
    linear_fwd: float
    """Part of `fwd` that runs the block GEMMs (what a selective policy that keeps matmul
    outputs does not run again). Equal to `wgrad` unless the backward GEMMs run another
    kernel than the forward one (FP8 without fast accumulation:
    KernelOptions.fp8_split_accum_bwd)."""
    core_fwd: float
    """Forward of the attention core alone (what selective recomputation repeats)."""
    tp_fwd: float
    """Tensor-parallel communication of the forward pass (2 all-reduces, or RS+AG with SP)."""
    tp_bwd: float
    """Tensor-parallel communication of the backward pass."""
    parts: tuple[tuple[str, float, float], ...] = ()
    """(kind, forward seconds, backward seconds) that `fwd` and `bwd` are the sums of, kind
    one of PART_KINDS: where the layer's time goes, for planner/step_categories.py."""

    def parts_per_microbatch(self, recompute: str, attention: str) -> dict[str, float]:
        """`parts` over one micro-batch's forward, backward and what recomputation repeats,
        by kind: they add up to `per_microbatch`'s compute."""
        share = {"full": 1.0, "half": 0.5}.get(recompute, 0.0)
        out = {kind: f * (1.0 + share) + b for kind, f, b in self.parts}
        if recompute == "selective" and attention == "unfused":
            out["attention"] = out.get("attention", 0.0) + self.core_fwd
        return out

    def per_microbatch(self, recompute: str, attention: str) -> tuple[float, float, float, float]:
        """(compute, tp comm, forward part, weight-grad part) of fwd+bwd with recomputation."""
        compute = self.fwd + self.bwd
        tpc = self.tp_fwd + self.tp_bwd
        if recompute in ("full", "half"):
            share = 1.0 if recompute == "full" else 0.5  # 'half': every second block
            compute += share * self.fwd
            tpc += share * self.tp_fwd
        elif recompute == "selective" and attention == "unfused":
            compute += self.core_fwd
        return compute, tpc, self.fwd + self.tp_fwd, self.wgrad


@dataclass(frozen=True)
class EdgeCost:
    """Seconds for the embedding (first stage) or the final norm + LM head + loss (last stage)."""

    compute: float
    """Forward + backward compute for one micro-batch."""
    tp: float
    """Tensor-parallel communication for one micro-batch."""
    fwd: float
    """Forward part (compute + comm) of the above."""
    wgrad: float
    """Weight-gradient part of `compute`."""
    parts: tuple[tuple[str, float], ...] = ()
    """(kind, seconds) that `compute` is the sum of, kind one of PART_KINDS."""


def compute_dtypes(dtype: str) -> tuple[str, str]:
    """(dtype of the blocks' linear GEMMs, dtype of everything else): FP8 recipes (Transformer
    Engine's fp8_autocast around the blocks' Linear layers, torchao float8 on nn.Linear in the
    blocks) keep the attention core, the output head and the small GEMMs in bf16."""
    if dtype == "fp8":
        return "fp8", "bf16"
    return dtype, dtype


def fp8_step_cast_s(model: ModelSpec, cluster: ClusterSpec, tp: int, opts: KernelOptions,
                    fp8_frac: tuple[float, ...], recipe: str = "rowwise") -> float:
    """Seconds per layer and optimizer step casting the FP8 weights once (Transformer Engine's
    weight cache, CastBytes.weight_step; zero for torchao, which casts every micro-batch)."""
    cb = cast_bytes(opts.fp8_scaling, recipe, opts.stack == "compiled")
    if not cb.weight_step:
        return 0.0
    frac = dict(zip(GEMM_GROUPS, fp8_frac))
    cl = cluster.at_dtype("bf16")
    return cb.weight_step * fp8_weight_elements(model, tp, frac) / membound_bytes_per_s(
        cl, opts.stack)


@lru_cache(maxsize=4096)
def layer_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
               sp: bool, opts: KernelOptions, cp: int = 1, dtype: str = "bf16",
               fp8_frac: tuple[float, ...] | None = None,
               fp8_recipe: str = "rowwise", gqa_repeat: bool = False) -> LayerCost:
    """Per-GPU time of one layer for one micro-batch of `micro_batch` sequences of `seq` tokens,
    a 1/cp slice of each sequence's tokens on this rank (context parallelism), GEMMs at the
    peak of `dtype` (cluster.at_dtype; fp8: the block GEMMs whose Linears pass the runtime's
    rule, planner/fp8.py `fp8_linear`, the rest in bf16, see compute_dtypes). `fp8_frac`: the
    FP8 share of each GEMM group (planner/fp8.py GEMM_GROUPS, `fp8_fractions` of the real
    model: `model` may be a mixture's active equivalent, whose averaged width is no Linear's);
    None: from `model` with torchao's thresholds (opts.fp8_filter). `fp8_recipe`: the plan's
    torchao recipe (what opts.fp8_scaling 'torchao' casts with). `gqa_repeat`: the model code
    copies K/V to every query head before SDPA (MemoryOptions.gqa_copies: elementwise.py
    `gqa_repeat_bytes`; context parallelism then moves K/V at every head)."""
    lin_dt, other_dt = compute_dtypes(dtype)
    lin_cl, cluster = cluster.at_dtype(lin_dt), cluster.at_dtype(other_dt)
    bw = membound_bytes_per_s(cluster, opts.stack)
    tokens = micro_batch * seq / cp
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    up = 2 * f if model.mlp == "swiglu" else f
    # Megatron tensor parallelism (Shoeybi et al. 2019): QKV and MLP-up split by columns,
    # attention output and MLP-down split by rows.
    frac = None
    if lin_dt == "fp8":
        frac = (dict(zip(GEMM_GROUPS, fp8_frac)) if fp8_frac is not None
                else fp8_fractions(model, tp, fp8_recipe, opts.fp8_filter))
    shapes = {"qkv": ((h + 2 * kv) / tp, h, True), "out": (h, h / tp, False),
              "up": (up / tp, h, True), "down": (h, f / tp, False)}

    # Separate Linears (torchtitan's and meshtron's Llama: wq/wk/wv, w1/w3) run one GEMM each:
    # the split column-parallel groups are priced piece by piece (a GQA model's wk and wv at
    # tp = 8 are kv_dim / tp wide, where tile saturation costs most), each piece with its
    # group's FP8 share.
    pieces = {"qkv": (h / tp, kv / tp, kv / tp),
              "up": (f / tp, f / tp) if model.mlp == "swiglu" else (f / tp,)} \
        if opts.separate_projections else {}

    def gemm(group: str, rows: float = tokens, backward: bool = False) -> float:
        n, k, split = shapes[group]
        kernel = bwd_kernel if backward else fp8_kernel
        return sum(gemm_group(rows, w, k, lin_cl, cluster, frac, group, split, kernel)
                   for w in pieces.get(group, (n,)))
    fp8_kernel = (FP8, fp8_tile_scale(opts)) if lin_dt == "fp8" else (BF16, 1.0)
    # the input- and weight-gradient GEMMs: FP8 ones without fast accumulation promote their
    # partial sums (KernelOptions.fp8_split_accum_bwd); each is priced at the forward's shape,
    # which the saturation model gives the same time when all three widths saturate alike
    bwd_kernel = (FP8, fp8_tile_scale(opts, backward=True)) if lin_dt == "fp8" else fp8_kernel
    gemms = {g: gemm(g) for g in shapes}
    linear = sum(gemms.values())
    linear_bwd = (sum(gemm(g, backward=True) for g in shapes) if bwd_kernel != fp8_kernel
                  else linear)  # one of the two backward GEMMs of every Linear
    heads_local = model.heads / tp
    hd = model.head_dim
    batch_heads = micro_batch * heads_local
    q_len = seq / cp  # each context rank's queries attend to the whole (causal) sequence
    core_fwd, core_bwd, ring = _core_time(cluster, opts, batch_heads, q_len, seq, cp, hd, bw)
    elementwise = tokens * elementwise_bytes(model, tp, sp, opts) / bw
    q_f = q_b = 0.0
    if lin_dt == "fp8":
        # casts of activations (per token) and of the local weights (torchao: each
        # micro-batch, forward and transposed for the input gradient, and rowwise's pass over
        # the weight gradient; Transformer Engine: once per step, fp8_step_cast_s)
        cb = cast_bytes(opts.fp8_scaling, fp8_recipe, opts.stack == "compiled")
        weights = fp8_weight_elements(model, tp, frac)
        casts = fp8_input_casts(model, tp, fp8_recipe, opts.fp8_filter) if cb.per_linear \
            else None
        per_tok_f, per_tok_b = quantisation_bytes(model, tp, frac, cb, casts, sp)
        q_f = (tokens * per_tok_f + cb.weight_fwd * weights) / bw
        q_b = (tokens * per_tok_b + (cb.weight_bwd + cb.wgrad_out) * weights) / bw
    if opts.fp32_params_autocast:
        weights = (h * (h + 2 * kv) + h * h + h * (up + f)) / tp
        elementwise += 6.0 * weights / bw
    elem_f, elem_b, host_f = elementwise, 2.0 * elementwise, 0.0
    if gqa_repeat:  # repeat_kv's copies and their backward sums (not twice the forward)
        rep_f, rep_b = gqa_repeat_bytes(model, tp, opts.stack)
        elem_f, elem_b = elem_f + tokens * rep_f / bw, elem_b + tokens * rep_b / bw
    if opts.flash_unpad and opts.attention == "flash":  # bert_padding around the kernel
        un_f, un_b = flash_unpad.unpad_bytes(model, tp)
        elem_f, elem_b = elem_f + tokens * un_f / bw, elem_b + tokens * un_b / bw
        host_f = flash_unpad.unpad_host_s(dispatch_s(cluster))
    # K/V elements per rank that context parallelism moves: every query head where repeated
    kv_moved = h if gqa_repeat else kv
    # torch's ring: its fp32 merges and copies (ring_attention.py; its byte counts are of a
    # bf16 core, so an fp32 run keeps the plain exchange)
    torch_ring = cp > 1 and opts.torch_ring and ring is not None and other_dt == "bf16"
    if torch_ring:
        ring_f, ring_b = torch_ring_bytes(tokens * h / tp, tokens * kv_moved / tp, cp)
        elem_f, elem_b = elem_f + ring_f / bw, elem_b + ring_b / bw
    fwd = linear + core_fwd + elem_f + q_f + host_f
    bwd = 2.0 * linear_bwd + core_bwd + elem_b + q_b
    # Tensor-parallel communication: 2 all-reduces of the [tokens, h] activation per pass
    # (Shoeybi et al. 2019, fig. 4); with sequence parallelism each becomes a reduce-scatter plus
    # an all-gather of the same total volume (Korthikanti et al. 2022, section 4.2.2). Which
    # GEMM each collective can hide behind: `tp_exposed`.
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    act_bytes = (4.0 if dtype == "fp32" else BF16) * tokens * h
    # FP8 recipes cast a column-parallel GEMM's input before gathering it (Transformer
    # Engine's fp8_buf userbuffers, torchao's Float8ColwiseParallel): 1 byte per element
    in_bytes = tokens * h if lin_dt == "fp8" else act_bytes
    colls = {"ag": comm.all_gather(act_bytes, group, fab),
             "ag_in": comm.all_gather(in_bytes, group, fab),
             "rs": comm.reduce_scatter(act_bytes, group, fab),
             "ar": comm.all_reduce(act_bytes, group, fab)}
    tp_f, tp_b = (tp_exposed(colls, gemms, gemm, tokens, tp, sp, opts, sm_count(cluster),
                             host.sm_interference(cluster, group.nodes > 1))
                  if tp > 1 else (0.0, 0.0))
    if tp > 1 and not sp and opts.residual_reduce_once and model.parallel_residual:
        tp_f -= colls["ar"]  # the two branches' sum reduced once (KernelOptions)
    if cp > 1:
        cp_f, cp_b = _cp_exposed(cluster, fab, opts, dtype, tp, cp, tokens * kv_moved / tp,
                                 core_fwd, core_bwd, ring if torch_ring else None)
        tp_f, tp_b = tp_f + cp_f, tp_b + cp_b
    # the host launches every kernel and collective: where they are shorter than their launches
    # the GPU waits on it (planner/host.py), over the layer's compute and exposed communication
    issue_f, issue_b = host.layer_issue(kernels_per_layer(model, opts),
                                        host.tp_collectives(tp, sp)
                                        + (2 if cp > 1 and not torch_ring else 0),
                                        dispatch_s(cluster))
    if torch_ring:  # its Python ops and collectives around the calls, each a launch
        issue_f, issue_b = _ring_issue(cp, dispatch_s(cluster), issue_f, issue_b)
    if opts.launch_blocking:  # every launch waits for its kernel: no running ahead
        wait_f, wait_b = issue_f, issue_b
    else:
        wait_f = host.launch_bound(fwd + tp_f, issue_f)
        wait_b = host.launch_bound(bwd + tp_b, issue_b)
    parts = (("gemm", linear, 2.0 * linear_bwd), ("attention", core_fwd, core_bwd),
             ("elementwise", elem_f, elem_b), ("fp8_cast", q_f, q_b),
             ("host_wait", host_f + wait_f, wait_b))
    return LayerCost(fwd=fwd + wait_f, bwd=bwd + wait_b, wgrad=linear_bwd, linear_fwd=linear,
                     core_fwd=core_fwd, tp_fwd=tp_f, tp_bwd=tp_b, parts=parts)


def _ring_issue(cp: int, per_op_s: float, issue_f: float,
                issue_b: float) -> tuple[float, float]:
    """Host issue seconds of a layer with torch's ring attention: the plain layer's plus the
    ring's own ops and collectives (ring_attention.torch_ring_launches), each at a forward
    op's cost: the ring's backward runs as Python, not in autograd's C++ engine."""
    ops_f, ops_b, coll_f, coll_b = torch_ring_launches(cp)
    return issue_f + (ops_f + coll_f) * per_op_s, issue_b + (ops_b + coll_b) * per_op_s


def _core_time(cluster: ClusterSpec, opts: KernelOptions, batch_heads: float, q_len: float,
               seq: int, cp: int, hd: int,
               bw: float) -> tuple[float, float, tuple[float, float, float, float] | None]:
    """(forward, backward, ring) seconds of the attention core on one rank: `q_len` queries
    per head against the causal `seq`; `ring`: ring_core_time's four figures where a flash
    core runs with cp > 1, else None.

    Causal FlashAttention computes about half the square; per head: QK^T and PV, head_dim
    wide, timed by the GEMM model (with context parallelism the load-balanced split gives
    every rank 1/cp of the square, in cp calls: ring_attention.ring_core_time). The unfused
    core computes the full square with two batched GEMMs and moves the scores through HBM."""
    if opts.attention == "flash" and cp > 1:
        ring = ring_core_time(cluster, batch_heads, q_len, cp, hd)
        return ring[0], ring[1], ring
    one = (cluster_gemm_time(q_len, seq, hd, cluster)
           + cluster_gemm_time(q_len, hd, seq, cluster))
    if opts.attention == "flash":
        if opts.flash_isa != "native":  # its GEMMs at the peak its instructions reach; the
            # tile model at a lower peak saturates sooner, so it could price short sequences
            # faster than the native kernel: a slower instruction never is
            sm = flash_isa.core_cluster(cluster, opts.flash_isa)
            one = max(one, cluster_gemm_time(q_len, seq, hd, sm)
                      + cluster_gemm_time(q_len, hd, seq, sm))
        core_fwd = 0.5 * batch_heads * one
        return core_fwd, 2.5 * core_fwd, None
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


def _cp_exposed(cluster: ClusterSpec, fab: comm.Fabric, opts: KernelOptions, dtype: str,
                tp: int, cp: int, kv_elems: float, core_fwd: float, core_bwd: float,
                ring: tuple[float, float, float, float] | None) -> tuple[float, float]:
    """(forward, backward) exposed seconds of context parallelism's K/V exchange for
    `kv_elems` K (= V) elements on this rank. K/V of the local tokens travel to the other
    cp-1 ranks (ring: cp-1 p2p steps of the local K/V chunk; all-gather: the same volume),
    their gradients come back in the backward (Liu et al. 2023 "Ring Attention";
    Megatron-Core context parallelism docs). `ring` (torch's ring attention, with its
    calls' times): its own collectives, ring_attention.py; else hidden behind the core
    where the stack overlaps them (`cp_overlap`), exposed otherwise."""
    kv_bytes = (4.0 if dtype == "fp32" else BF16) * 2 * kv_elems
    cpg = cp_group(tp, cp, cluster.gpus_per_node)
    nccl = host.sm_interference(cluster, cpg.nodes > 1)
    if ring is not None:
        return torch_ring_exposed(kv_elems, cp, cpg, fab, ring[2], ring[3],
                                  core_bwd - ring[3], nccl)
    cp_f = comm.all_gather(kv_bytes * cp, cpg, fab)
    cp_b = comm.reduce_scatter(kv_bytes * cp, cpg, fab)
    if opts.cp_overlap:
        return overlapped(cp_f, core_fwd, nccl), overlapped(cp_b, core_bwd, nccl)
    return cp_f, cp_b


def cp_group(tp: int, cp: int, gpus_per_node: int) -> comm.Group:
    """The context-parallel Group: cp ranks tp apart (mesh order ..., "cp", "tp")."""
    from meshtron.planner.placement import MESH_AXES_CP, Placement

    return Placement(MESH_AXES_CP, (1, 1, 1, cp, tp), gpus_per_node).group("cp")


@lru_cache(maxsize=4096)
def head_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
              sp: bool, stack: str = "fused", cp: int = 1, dtype: str = "bf16",
              eager_norm: str = "aten") -> EdgeCost:
    """Final norm + vocabulary-parallel LM head + cross-entropy for one micro-batch.

    The head GEMM is [tokens, h] x [h, V/tp]; the fused loss reads bf16 logits and writes fp32
    probabilities (6 bytes per logit) forward, and the reverse backward; eager PyTorch casts the
    logits to fp32 (2+4), runs log-softmax (4+4) and, backward, its gradient (4+4+4) and the cast
    back (4+2): 14 bytes per logit forward, 18 backward (Megatron's
    vocab-parallel cross-entropy; only 3 floats per token cross the tensor group, in three
    fp32 all-reduces: max logit, target logit, sum of exponentials).

    Tensor-parallel traffic of the head's input (Shoeybi et al. 2019, the f/g operators;
    Korthikanti et al. 2022, section 4.2.2): without sequence parallelism the replicated input
    enters the vocabulary-parallel GEMM through an identity whose backward all-reduces the
    input gradient [tokens, h]; with it, the sequence-sharded input is all-gathered forward and
    its gradient reduce-scattered backward.

    With context parallelism a rank holds 1/cp of the tokens; FP8 recipes keep the head in bf16.
    """
    cluster = cluster.at_dtype(compute_dtypes(dtype)[1])
    hbm = membound_bytes_per_s(cluster, stack)
    tokens = micro_batch * seq / cp
    gemm = cluster_gemm_time(tokens, model.vocab / tp, model.hidden, cluster)
    logits = tokens * model.vocab / tp
    loss_f, loss_b = (14.0, 18.0) if stack == "eager" else (6.0, 6.0)
    norm_b = NORM_BYTES[norm_key(stack, eager_norm, model.norm)]
    norm = tokens * norm_b * model.hidden / (tp if sp else 1) / hbm
    fwd_c = gemm + logits * loss_f / hbm + norm
    compute = fwd_c + 2 * gemm + logits * loss_b / hbm + 2 * norm
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    nbytes = BF16 * tokens * model.hidden
    loss_ar = 3 * comm.all_reduce(4.0 * tokens, group, fab)
    if sp:
        tp_f = comm.all_gather(nbytes, group, fab) + loss_ar
        tp_b = comm.reduce_scatter(nbytes, group, fab)
    else:
        tp_f = loss_ar
        tp_b = comm.all_reduce(nbytes, group, fab)
    # launches (planner/host.py): the norm, the head GEMM and the loss (eager: cast,
    # log-softmax, target gather, mean; fused: one kernel), the loss's all-reduces with tp
    kernels = (NORM_KERNELS[norm_key(stack, eager_norm, model.norm)] + 1
               + (4 if stack == "eager" else 1))
    colls = (3 if tp > 1 else 0) + (1 if sp and tp > 1 else 0)
    issue_f, issue_b = host.layer_issue(kernels, colls, dispatch_s(cluster))
    wait_f = host.launch_bound(fwd_c + tp_f, issue_f)
    wait_b = host.launch_bound(compute - fwd_c + tp_b, issue_b)
    fwd_c += wait_f
    compute += wait_f + wait_b
    parts = (("gemm", 3 * gemm),
             ("elementwise", logits * (loss_f + loss_b) / hbm + 3 * norm),
             ("host_wait", wait_f + wait_b))
    return EdgeCost(compute=compute, tp=tp_f + tp_b, fwd=fwd_c + tp_f, wgrad=gemm, parts=parts)


@lru_cache(maxsize=4096)
def chunked_loss_parts(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, seq: int,
                       cp: int = 1, dtype: str = "bf16",
                       stack: str = "eager") -> tuple[tuple[str, float], ...]:
    """Seconds meshtron's chunked cross-entropy (meshtron/model/loss.py, tp = 1 without a
    pipeline) adds to `head_cost` per micro-batch, by kind (PART_KINDS). It runs the head and
    the loss on chunks of tokens/ceil(vocab/hidden) tokens under activation checkpointing, so
    the backward (1) replays each chunk's head GEMM and loss forward, (2) computes the head's
    weight gradient chunk by chunk, a [vocab, hidden] product over only `chunk` tokens each
    (bound by writing its output), and (3) autograd sums the chunks' weight gradients, one
    add of a [vocab, hidden] tensor per chunk after the first (read both, write the sum).
    The GEMMs of (1) and (2) are 'gemm', the loss replay and (3) 'elementwise'."""
    cl = cluster.at_dtype(compute_dtypes(dtype)[1])
    hbm = membound_bytes_per_s(cl, stack)
    tokens = micro_batch * seq / cp
    v, h = model.vocab, model.hidden
    chunk = math.ceil(tokens / math.ceil(v / h))
    chunks = math.ceil(tokens / chunk)
    wgrad = chunks * cluster_gemm_time(v, h, chunk, cl) - cluster_gemm_time(v, h, tokens, cl)
    gemm = cluster_gemm_time(tokens, v, h, cl) + max(0.0, wgrad)
    loss = tokens * v * (14.0 if stack == "eager" else 6.0) / hbm
    elem = 4.0 if dtype == "fp32" else BF16
    grad_sum = (chunks - 1) * 3.0 * elem * v * h / (cl.hbm_bytes_per_s * HBM_EFFICIENCY)
    return (("gemm", gemm), ("elementwise", loss + grad_sum))


def chunked_loss_extra(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, seq: int,
                       cp: int = 1, dtype: str = "bf16", stack: str = "eager") -> float:
    """`chunked_loss_parts` in all: seconds per micro-batch."""
    return sum(s for _, s in chunked_loss_parts(model, cluster, micro_batch, seq, cp, dtype,
                                                stack))


@lru_cache(maxsize=4096)
def embedding_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
                   sp: bool, cp: int = 1) -> EdgeCost:
    """Vocabulary-parallel embedding lookup: write [tokens, h] forward, scatter-add backward,
    plus the all-reduce (reduce-scatter with SP) that combines the vocabulary shards forward;
    with SP the backward all-gathers the sequence-sharded gradient (the conjugate of the
    reduce-scatter, Korthikanti et al. 2022, section 4.2.2), without it the backward is local."""
    hbm = cluster.hbm_bytes_per_s * HBM_EFFICIENCY
    tokens = micro_batch * seq / cp
    nbytes = BF16 * tokens * model.hidden
    compute = 3 * nbytes / hbm
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    if sp:
        tp_f = comm.reduce_scatter(nbytes, group, fab)
        tp_b = comm.all_gather(nbytes, group, fab)
    else:
        tp_f, tp_b = comm.all_reduce(nbytes, group, fab), 0.0
    return EdgeCost(compute=compute, tp=tp_f + tp_b, fwd=nbytes / hbm + tp_f, wgrad=0.0,
                    parts=(("elementwise", compute),))


def active_equivalent(model: ModelSpec) -> ModelSpec:
    """The dense model that computes what a token of `model` computes: a mixture of experts
    becomes one SwiGLU per block of the mean active width (top_k routed experts + shared
    experts, the router's E outputs as E/3 more columns of the three GEMMs: same FLOPs), so
    GEMM time, memory-bound traffic and saved activations count active parameters only
    (memory counts all of them: `memory.layer_params_local`). What the experts cost beyond
    it (grouped GEMMs of the per-expert rows, permutation copies, routing imbalance, the
    expert-parallel all-to-alls) is planner/moe_cost.py's. A dense model is returned
    unchanged."""
    if not model.is_moe:
        return model
    moe = (model.moe_top_k + model.moe_shared_experts) * model.moe_ffn_hidden \
        + model.moe_experts / 3.0
    width = (model.moe_dense_layers * model.ffn_hidden + model.moe_layers * moe) / model.layers
    return model.replace(ffn_hidden=max(1, round(width)), mlp="swiglu", moe_experts=0,
                         moe_top_k=0, moe_ffn_hidden=0, moe_shared_experts=0,
                         moe_dense_layers=0, moe_aux_loss=0.0, moe_bias_update=0.0)


def model_flops_per_step(model: ModelSpec, tokens: float, seq: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recomputation)."""
    return model.flops_per_token(seq) * tokens


def recompute_flops_per_token(model: ModelSpec, seq: int, recompute: str, attention: str) -> float:
    """FLOPs executed again by recomputation, per token (see module docstring)."""
    core = 4.0 * model.layers * model.hidden * seq  # QK^T + AV forward, full square
    if recompute in ("full", "half"):
        share = 1.0 if recompute == "full" else 0.5  # 'half': every second block
        # active parameters only: recomputation replays the experts a token ran through
        return share * (2.0 * model.block_matmul_params(active=True) + core)
    if recompute == "selective" and attention == "unfused":
        return core
    return 0.0
