"""Time of one transformer layer on one GPU, for one micro-batch (`layer_cost`), and the
planner's one import for the pieces of a layer's and a step's compute around it (re-exported
below): the cost records (planner/compute_parts.py), the attention core and context
parallelism (planner/compute_core.py), the embedding, head and loss (planner/compute_edges.py),
the FLOPs of a step and of recomputation (planner/compute_flops.py).

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
"""

from __future__ import annotations

from functools import lru_cache

from meshtron.model.mla_shapes import mla_projections
from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, flash_unpad, host
from meshtron.planner.placement import tp_group
from meshtron.planner.ring_attention import (
    te_ring_bytes, te_ring_launches, torch_ring_bytes, torch_ring_bytes_compiled,
    torch_ring_launches)
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute_core import core_time, core_widths, cp_exposed, cp_group, cp_halo, ring_issue, window_share  # noqa: F401
from meshtron.planner.compute_edges import (  # noqa: F401  (re-exported for callers)
    chunked_loss_extra, chunked_loss_forward_s, chunked_loss_parts, embedding_cost, head_cost)
from meshtron.planner.compute_flops import (  # noqa: F401  (re-exported for callers)
    active_equivalent, fine_recompute_flops_per_token, hardware_flops_per_step,
    model_flops_per_step, recompute_flops_per_token)
from meshtron.planner.compute_parts import (  # noqa: F401  (re-exported for callers)
    PART_KINDS, EdgeCost, LayerCost, compute_dtypes, recompute_share)
from meshtron.planner.elementwise import (  # noqa: F401  (kernels_per_layer re-exported)
    NORM_BYTES, NORM_KERNELS, elementwise_bytes, gqa_repeat_bytes, kernels_per_layer, norm_key,
    recomputed_bytes)
from meshtron.planner.fp8 import (  # noqa: F401  (quantisation_bytes re-exported)
    GEMM_GROUPS, async_tp_unfused, cast_bytes, fp8_fractions, fp8_input_casts,
    fp8_weight_elements, quantisation_bytes)
from meshtron.planner.fp8_amax import current_amax_tp_s
from meshtron.planner.fp8_gather import gathered_weight_casts, torchao_gathers_fp8
from meshtron.planner.gemm import (  # noqa: F401  (re-exported for callers)
    BF16, CAST_ADD_BYTES_PER_SM, DISPATCH_S, FP8, HBM_EFFICIENCY, cast_add_bytes_per_s,
    cluster_gemm_time, dispatch_s, fp8_tile_scale, gemm_efficiency, gemm_group,
    membound_bytes_per_s)
from meshtron.planner.kernel_options import (  # noqa: F401  (re-exported: callers' one import)
    DEFAULT_IMBALANCE, KernelOptions, compiled)
from meshtron.planner.overlap import (  # noqa: F401  (re-exported: one formula everywhere)
    DEFAULT_SMS, OVERLAP_INTERFERENCE, TE_UB_COMM_SMS, TE_UB_PIPELINE_SPLITS, overlapped,
    sm_count, sm_margin, tp_exposed)


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
               fp8_recipe: str = "rowwise", gqa_repeat: bool = False,
               amax_mlp_share: float = 1.0) -> LayerCost:
    """Per-GPU time of one layer for one micro-batch of `micro_batch` sequences of `seq` tokens,
    a 1/cp slice of each sequence's tokens on this rank (context parallelism), GEMMs at the
    peak of `dtype` (cluster.at_dtype; fp8: the block GEMMs whose Linears pass the runtime's
    rule, planner/fp8.py `fp8_linear`, the rest in bf16, see compute_dtypes). `fp8_frac`: the
    FP8 share of each GEMM group (planner/fp8.py GEMM_GROUPS, `fp8_fractions` of the real
    model: `model` may be a mixture's active equivalent, whose averaged width is no Linear's);
    None: from `model` with torchao's thresholds (opts.fp8_filter). `fp8_recipe`: the plan's
    torchao recipe (what opts.fp8_scaling 'torchao' casts with). `gqa_repeat`: the model code
    copies K/V to every query head before SDPA (MemoryOptions.gqa_copies: elementwise.py
    `gqa_repeat_bytes`; context parallelism then moves K/V at every head). `amax_mlp_share`:
    the share of the real model's blocks whose fc1 / fc2 reduce current scaling's amax over
    tp (fp8_amax.mlp_amax_share: not a mixture's routed experts)."""
    lin_dt, other_dt = compute_dtypes(dtype)
    lin_cl, cluster = cluster.at_dtype(lin_dt), cluster.at_dtype(other_dt)
    bw = membound_bytes_per_s(cluster, opts.stack)
    tokens = micro_batch * seq / cp
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    up = 2 * f if model.gated_mlp else f
    # Megatron tensor parallelism (Shoeybi et al. 2019): QKV and MLP-up split by columns,
    # attention output and MLP-down split by rows.
    frac = None
    if lin_dt == "fp8":
        frac = (dict(zip(GEMM_GROUPS, fp8_frac)) if fp8_frac is not None
                else fp8_fractions(model, tp, fp8_recipe, opts.fp8_filter))
    # q is heads x head_dim wide, the out-projection reads heads x v (hidden, except where a
    # config's head_dim is not hidden/heads: Qwen3-4B 4096 from 2560, Gemma 2 9B 4096 / 3584)
    q = model.heads * model.head_dim
    shapes = {"qkv": ((q + 2 * kv) / tp, h, True), "out": (h, model.out_width / tp, False),
              "up": (up / tp, h, True), "down": (h, f / tp, False)}

    # Separate Linears (torchtitan's and meshtron's Llama: wq/wk/wv, w1/w3) run one GEMM each:
    # the split column-parallel groups are priced piece by piece (a GQA model's wk and wv at
    # tp = 8 are kv_dim / tp wide, where tile saturation costs most), each piece with its
    # group's FP8 share.
    pieces = {"qkv": [(w, h, True) for w in (q / tp, kv / tp, kv / tp)],
              "up": [(w, h, True) for w in ((f / tp, f / tp) if model.gated_mlp
                                            else (f / tp,))]} \
        if opts.separate_projections else {}
    if model.is_mla:
        # MLA (model/mla.py): the down-projections (replicated: every tp rank runs them whole)
        # and the head-sharded up-projections, each GEMM at its own input width; the
        # out-projection reads heads x v_head_dim
        pieces["qkv"] = [(n, k, True) for _, n, k, _ in mla_projections(model, tp)]
        shapes["out"] = (h, model.out_width / tp, False)

    def gemm(group: str, rows: float = tokens, backward: bool = False) -> float:
        kernel = bwd_kernel if backward else fp8_kernel
        return sum(gemm_group(rows, n, k, lin_cl, cluster, frac, group, split, kernel)
                   for n, k, split in pieces.get(group, (shapes[group],)))
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
    hd, hd_v = core_widths(model, opts)  # MLA: QK^T at 192, PV at 128 or padded to 192
    batch_heads = micro_batch * heads_local
    q_len = seq / cp  # each context rank's queries attend to the whole (causal) sequence
    core_fwd, core_bwd, ring = core_time(cluster, opts, batch_heads, q_len, seq, cp, hd, bw,
                                         hd_v)
    if opts.attention == "flash" and not (cp > 1 and opts.torch_ring):
        # sliding-window blocks (Mistral, Gemma 2/3, StarCoder2) and chunked ones (Llama 4):
        # the kernel skips the tiles outside the window or chunk; the mean block is priced.
        # With cp > 1 each rank's queries compute the same share of their pairs: Transformer
        # Engine runs a sliding window under context parallelism only with cp_comm_type
        # 'all_gather' or 'a2a' (transformer_engine/pytorch/attention/dot_product_attention/
        # context_parallel.py `attn_forward_func_with_cp` asserts so, v2.8 and d0067d0da; p2p
        # is refused): the all-gather path calls the windowed kernel on each rank's
        # load-balanced chunks with the window moved to the gathered keys
        # (`get_kv_seq_info_after_all_gather`), the a2a path on whole sequences of its heads.
        # The K/V exchange is priced as the ring's (what cp_comm_type moves is not modelled
        # here). torch's ring attention (torch.distributed.tensor.experimental) calls SDPA's
        # causal kernel on every step, with no window: priced whole, as the unfused core,
        # which computes the masked square anyway.
        share = window_share(model, seq)
        core_fwd, core_bwd = core_fwd * share, core_bwd * share
    elementwise = tokens * elementwise_bytes(model, tp, sp, opts) / bw
    q_f = q_b = 0.0
    if lin_dt == "fp8":
        # casts of activations (per token) and of the local weights (torchao: each
        # micro-batch, forward and transposed for the input gradient, and rowwise's pass over
        # the weight gradient; Transformer Engine: once per step, fp8_step_cast_s)
        cb = cast_bytes(opts.fp8_scaling, fp8_recipe, opts.stack == "compiled")
        if torchao_gathers_fp8(opts, fp8_recipe):  # cast before the gather (fp8_gather.py)
            cb = gathered_weight_casts(cb)
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
    # bf16 core, so an fp32 run keeps the plain exchange); a compiled block traces the ring,
    # and inductor fuses them (torch_ring_bytes_compiled)
    torch_ring = cp > 1 and opts.torch_ring and ring is not None and other_dt == "bf16"
    if torch_ring:
        ring_bytes = torch_ring_bytes_compiled if opts.stack == "compiled" else torch_ring_bytes
        ring_f, ring_b = ring_bytes(tokens * h / tp, tokens * kv_moved / tp, cp)
        elem_f, elem_b = elem_f + ring_f / bw, elem_b + ring_b / bw
    # Transformer Engine's p2p ring (the overlapped exchange that is not torch's): its output
    # corrections, K/V buffer copies and dq / dkv accumulations (ring_attention.te_ring_bytes)
    te_ring = (cp > 1 and opts.attention == "flash" and opts.cp_overlap and not opts.torch_ring
               and other_dt == "bf16")
    if te_ring:
        te_f, te_b = te_ring_bytes(tokens * q / tp, tokens * model.out_width / tp,
                                   tokens * kv_moved / tp, cp)
        elem_f, elem_b = elem_f + te_f / bw, elem_b + te_b / bw
    fwd = linear + core_fwd + elem_f + q_f + host_f
    bwd = 2.0 * linear_bwd + core_bwd + elem_b + q_b
    # Tensor-parallel communication: 2 all-reduces of the [tokens, h] activation per pass
    # (Shoeybi et al. 2019, fig. 4); with sequence parallelism each becomes a reduce-scatter plus
    # an all-gather of the same total volume (Korthikanti et al. 2022, section 4.2.2). Which
    # GEMM each collective can hide behind: `tp_exposed`.
    fab = comm.Fabric.of(cluster)
    group = tp_group(tp, cluster.gpus_per_node)
    act_bytes = (4.0 if dtype == "fp32" else BF16) * tokens * h
    # FP8 recipes that gather FP8 (CastBytes.gathers_fp8) cast a column-parallel GEMM's input
    # before gathering it (Transformer Engine's fp8_buf userbuffers, torchao's
    # Float8ColwiseParallel, tensorwise only): 1 byte per element; torchao rowwise gathers
    # bf16 and casts after (torchtitan parallelize_llama.py enable_float8_tensorwise_tp)
    cb_tp = cast_bytes(opts.fp8_scaling, fp8_recipe, opts.stack == "compiled") \
        if lin_dt == "fp8" else None
    in_bytes = tokens * h if cb_tp is not None and cb_tp.gathers_fp8 else act_bytes
    # and the row-parallel GEMMs' output gradient, gathered for their input gradient, the
    # same way: cast on the shard, gathered in FP8 (Transformer Engine v1.8 module/base.py
    # `grad_output_preprocess`: cast_to_fp8, then gather_along_first_dim or, with
    # userbuffers, the cast written into proj_dgrad's / fc2_dgrad's FP8 buffer, `initialize_ub`
    # layers_all_gather_overlap; torchao v0.6.1 float8_tensor_parallel.py Float8RowwiseParallel:
    # NoopFwToFloat8E5M2BwDynamic casts the gradient before the redistribute's gather)
    grad_bytes = in_bytes
    # what async TP cannot fuse, per GEMM group with FP8 Linears (an all-bf16 group's plain mm
    # fuses as in bf16)
    atp_unfused = frozenset((kind, g) for kind in async_tp_unfused(cb_tp)
                            for g in GEMM_GROUPS if frac is not None and frac[g] > 0)
    colls = {"ag": comm.all_gather(grad_bytes, group, fab),
             "ag_in": comm.all_gather(in_bytes, group, fab),
             "rs": comm.reduce_scatter(act_bytes, group, fab),
             "ar": comm.all_reduce(act_bytes, group, fab)}
    tp_f, tp_b = (tp_exposed(colls, gemms, gemm, tokens, tp, sp, opts, sm_count(cluster),
                             host.sm_interference(cluster, group.nodes > 1),
                             atp_unfused)
                  if tp > 1 else (0.0, 0.0))
    if tp > 1 and not sp and opts.residual_reduce_once and model.parallel_residual:
        tp_f -= colls["ar"]  # the two branches' sum reduced once (KernelOptions)
    # current scaling's per-tensor amax all-reduces over tp before the FP8 gathers (fp8_amax)
    amax_f, amax_b = current_amax_tp_s(opts, sp, frac, group, fab, amax_mlp_share)
    tp_f, tp_b = tp_f + amax_f, tp_b + amax_b
    if cp > 1:
        cp_f, cp_b = cp_exposed(cluster, fab, opts, dtype, tp, cp, tokens * kv_moved / tp,
                                 core_fwd, core_bwd, ring if torch_ring else None,
                                 cp_halo(model, opts, seq, cp))
        tp_f, tp_b = tp_f + cp_f, tp_b + cp_b
    # the host launches every kernel and collective: where they are shorter than their launches
    # the GPU waits on it (planner/host.py), over the layer's compute and exposed communication
    issue_f, issue_b = host.layer_issue(kernels_per_layer(model, opts),
                                        host.tp_collectives(tp, sp)
                                        + (2 if cp > 1 and not (torch_ring or te_ring) else 0),
                                        dispatch_s(cluster))
    if torch_ring or te_ring:  # its Python ops and collectives around the calls, each a launch
        issue_f, issue_b = ring_issue(cp, dispatch_s(cluster), issue_f, issue_b,
                                      torch_ring_launches if torch_ring else te_ring_launches)
    if opts.launch_blocking:  # every launch waits for its kernel: no running ahead
        wait_f, wait_b = issue_f, issue_b
    else:
        wait_f = host.launch_bound(fwd + tp_f, issue_f)
        wait_b = host.launch_bound(bwd + tp_b, issue_b)
    parts = (("gemm", linear, 2.0 * linear_bwd), ("attention", core_fwd, core_bwd),
             ("elementwise", elem_f, elem_b), ("fp8_cast", q_f, q_b),
             ("host_wait", host_f + wait_f, wait_b))
    # what fine-grained recomputation can run again (LayerCost.fine_recompute): the pieces'
    # memory-bound bytes as in the forward, and the up-projection GEMMs at the forward's
    # kernel (MLA's head-sharded wq_b / wkv_b, or wq; without MLA the QKV projection)
    up_gemm = (sum(gemm_group(tokens, n, k, lin_cl, cluster, frac, "qkv", split, fp8_kernel)
                   for _, n, k, split in mla_projections(model, tp) if split)
               if model.is_mla else gemms["qkv"])
    recomputable = tuple((piece, "elementwise", tokens * b / bw)
                         for piece, b in recomputed_bytes(model, tp, sp, opts).items()) \
        + (("up_proj", "gemm", up_gemm),)
    return LayerCost(fwd=fwd + wait_f, bwd=bwd + wait_b, wgrad=linear_bwd, linear_fwd=linear,
                     core_fwd=core_fwd, tp_fwd=tp_f, tp_bwd=tp_b, parts=parts,
                     recomputable=recomputable)
