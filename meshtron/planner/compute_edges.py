"""The pipeline's edges on one GPU: the embedding (first stage), the final norm + LM head +
loss (last stage), and what meshtron's fused cross-entropy adds to the head, each for one
micro-batch, as EdgeCosts (planner/compute_parts.py) or parts by kind."""

from __future__ import annotations

import math
from functools import lru_cache

from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, composer_metrics, host
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute_parts import EdgeCost, compute_dtypes
from meshtron.planner.elementwise import NORM_BYTES, NORM_KERNELS, norm_key
from meshtron.planner.gemm import (
    BF16, HBM_EFFICIENCY, cluster_gemm_time, dispatch_s, membound_bytes_per_s)
from meshtron.planner.placement import tp_group


VOCAB_PARALLEL_CE_BYTES = (6.0 + 4.0 + 8.0 + 8.0 + 4.0 + 8.0, 8.0 + 6.0)
"""(forward, backward) bytes per logit of Megatron-Core's unfused VocabParallelCrossEntropy
(megatron/core/tensor_parallel/cross_entropy.py at f2e5db402c), one pass each: forward the
fp32 cast of the bf16 logits (2+4), max (4), in-place subtraction of the max (4+4), exp in place
(4+4), sum (4), in-place division by the sum (4+4): 38; backward the in-place multiplication by
the incoming gradient (4+4) and autograd's cast of the fp32 gradient back to bf16 (4+2): 14.
The target gathers and the one-hot subtraction touch one logit per token."""
VOCAB_PARALLEL_CE_KERNELS = 17
"""Forward kernels of that loss (cast, max, subtraction, the target mask and gather's nine
small ones, exp, sum, log and difference, division), for the host's issue."""


FLASH_CE_BYTES = (BF16, 2 * BF16)
"""(forward, backward) bytes per logit of flash-attn's fused cross-entropy (KernelOptions
flash_ce; flash-attn 2.4.2 flash_attn/ops/triton/cross_entropy.py: cross_entropy_fwd_kernel
reads a row of 16-bit logits and stores one loss and one log-sum-exp, cross_entropy_bwd_kernel
reads the row again and stores its gradient in the logits' dtype)."""


FLASH_CE_FP32_BYTES = (BF16 + 4.0 + 4.0, 4.0 + 4.0 + 4.0 + BF16)
"""(forward, backward) bytes per logit of flash-attn's fused cross-entropy over logits the model
cast to fp32 (KernelOptions.logits_fp32; OLMo-core's `self.w_out(h).float()` before its copy of
that kernel, src/olmo_core/triton/cross_entropy_loss.py at 41400c46fc): the cast (2 + 4) and
the kernel's read of the fp32 row (4) forward; the kernel's read of the row and its fp32
gradient (4 + 4), then autograd's cast of that gradient back to the head's bf16 (4 + 2)."""
Z_LOSS_BYTES = (4.0 + 8.0 + 8.0 + 4.0, 8.0 + 8.0 + 8.0 + 12.0)
"""(forward, backward) bytes per fp32 logit of the z-loss computed apart from the cross-entropy
(KernelOptions.z_loss; OLMo-core nn/functional/cross_entropy_loss.py `cross_entropy_loss`:
`logits.logsumexp(-1).pow(2)`). Forward, ATen's logsumexp (aten/src/ATen/native/
ReduceOps.cpp logsumexp_out_impl): amax (4), `self - maxes` (4 + 4), its exp_ in place
(4 + 4), the sum (4); backward, logsumexp_backward (FunctionsManual.cpp: `grad * (self -
result).exp()`): the subtraction, the exp and the product (4 + 4 each), then autograd adds it
to the cross-entropy's gradient of the same logits (4 + 4 read, 4 written). The per-token
square, mask and sum are not per logit."""


def loss_bytes(stack: str, vocab_parallel_ce: bool = False, flash_ce: bool = False,
               z_loss: bool = False, logits_fp32: bool = False) -> tuple[float, float]:
    """(forward, backward) HBM bytes per logit of the cross-entropy (head_cost's docstring):
    eager PyTorch's fp32 cast and log-softmax, Megatron-Core's unfused vocabulary-parallel
    loss (KernelOptions.vocab_parallel_ce: VOCAB_PARALLEL_CE_BYTES), flash-attn's fused loss
    (KernelOptions.flash_ce: FLASH_CE_BYTES, over fp32 logits FLASH_CE_FP32_BYTES), or one
    fused kernel; plus a z-loss computed apart (KernelOptions.z_loss: Z_LOSS_BYTES; inside
    the fused flash-attn kernel it costs no pass)."""
    if vocab_parallel_ce:
        return VOCAB_PARALLEL_CE_BYTES
    if flash_ce:
        return FLASH_CE_FP32_BYTES if logits_fp32 else FLASH_CE_BYTES
    fwd, bwd = (14.0, 18.0) if stack == "eager" else (6.0, 6.0)
    if z_loss:
        fwd, bwd = fwd + Z_LOSS_BYTES[0], bwd + Z_LOSS_BYTES[1]
    return fwd, bwd


def _head_inputs(cluster: ClusterSpec, micro_batch: int, seq: int, cp: int, dtype: str,
                 stack: str) -> tuple[ClusterSpec, float, float]:
    """(cluster at the head's dtype, memory-bound bytes/s, tokens on this rank): FP8 recipes
    keep the head in bf16 (compute_dtypes)."""
    cl = cluster.at_dtype(compute_dtypes(dtype)[1])
    return cl, membound_bytes_per_s(cl, stack), micro_batch * seq / cp


@lru_cache(maxsize=4096)
def head_cost(model: ModelSpec, cluster: ClusterSpec, tp: int, micro_batch: int, seq: int,
              sp: bool, stack: str = "fused", cp: int = 1, dtype: str = "bf16",
              eager_norm: str = "aten", vocab_parallel_ce: bool = False,
              flash_ce: bool = False, train_metrics: int = 0, z_loss: bool = False,
              logits_fp32: bool = False) -> EdgeCost:
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
    `train_metrics`: Composer's metric updates on the whole logits after the backward
    (planner/composer_metrics.py), memory-bound passes of the eager stack.
    """
    cluster, hbm, tokens = _head_inputs(cluster, micro_batch, seq, cp, dtype, stack)
    gemm = cluster_gemm_time(tokens, model.vocab / tp, model.hidden, cluster)
    logits = tokens * model.vocab / tp
    loss_f, loss_b = loss_bytes(stack, vocab_parallel_ce, flash_ce, z_loss, logits_fp32)
    norm_b = NORM_BYTES[norm_key(stack, eager_norm, model.norm)]
    norm = tokens * norm_b * model.hidden / (tp if sp else 1) / hbm
    fwd_c = gemm + logits * loss_f / hbm + norm
    metrics = composer_metrics.update_bytes(train_metrics, logits) / membound_bytes_per_s(
        cluster, "eager")
    compute = fwd_c + 2 * gemm + logits * loss_b / hbm + 2 * norm + metrics
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
    loss_kernels = (VOCAB_PARALLEL_CE_KERNELS if vocab_parallel_ce
                    else 4 if stack == "eager" else 1)
    kernels = NORM_KERNELS[norm_key(stack, eager_norm, model.norm)] + 1 + loss_kernels
    colls = (3 if tp > 1 else 0) + (1 if sp and tp > 1 else 0)
    issue_f, issue_b = host.layer_issue(kernels, colls, dispatch_s(cluster))
    wait_f = host.launch_bound(fwd_c + tp_f, issue_f)
    wait_b = host.launch_bound(compute - fwd_c + tp_b, issue_b)
    fwd_c += wait_f
    compute += wait_f + wait_b
    parts = (("gemm", 3 * gemm),
             ("elementwise", logits * (loss_f + loss_b) / hbm + 3 * norm + metrics),
             ("host_wait", wait_f + wait_b))
    return EdgeCost(compute=compute, tp=tp_f + tp_b, fwd=fwd_c + tp_f, wgrad=gemm, parts=parts)


FUSED_LOSS_BYTES = (60.0, 48.0)
"""HBM bytes per logit of the fused loss's elementwise work per chunk, with 16-bit and with
fp32 logits (meshtron/model/loss.py `_chunk`, each pass a kernel of its own in eager mode):
the fp32 copy of the logits (read 2, write 4); `torch.logsumexp`, which ATen runs as four
passes (ReduceOps.cpp logsumexp_out_impl: amax read 4, the max subtracted into a new fp32
tensor 4 + 4, exp_ in place 4 + 4, sum read 4: 24); the softmax written in place over the
fp32 logits (sub_ of the log-sum-exp 4 + 4, exp_ 4 + 4); the 1/count scale (4 + 4); the
gradient's cast for the GEMMs (4 + 2). With fp32 logits the copy and the cast are the tensor
itself: 48. The target gather and the one-hot scatter touch one logit per token.
tests/test_loss_fused.py counts these passes in a profile of `_chunk`."""


@lru_cache(maxsize=4096)
def chunked_loss_parts(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, seq: int,
                       cp: int = 1, dtype: str = "bf16",
                       stack: str = "eager") -> tuple[tuple[str, float], ...]:
    """Seconds meshtron's fused cross-entropy (meshtron/model/loss.py, tp = 1; a pipeline's
    last stage too: parallel/parallel_model.py `_stage_computes_loss`) adds to `head_cost` per
    micro-batch, by kind (PART_KINDS). Its forward walks
    chunks of tokens/ceil(vocab/hidden) tokens once and runs, per chunk, the head GEMM, the
    input-gradient GEMM and the weight-gradient GEMM; that one accumulates into an fp32
    [vocab, hidden] buffer (addmm, beta 1), reading and writing it per chunk (8 bytes per
    element per chunk: memory-bound at Liger's chunk, about hidden tokens deep). Nothing is
    replayed in backward, which scales the accumulator and the input gradient in place and
    casts the accumulator to a 16-bit parameter's dtype (autograd). 'gemm': the chunked GEMMs
    less head_cost's three whole ones; 'elementwise': the chunks' loss (FUSED_LOSS_BYTES) less
    head_cost's loss and the backward's scaling and cast."""
    gemm, loss, scale, _ = _chunked_loss_pieces(model, cluster, micro_batch, seq, cp, dtype,
                                                stack)
    return (("gemm", max(0.0, gemm)), ("elementwise", max(0.0, loss + scale)))


def _chunked_loss_pieces(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, seq: int,
                         cp: int, dtype: str, stack: str) -> tuple[float, float, float, float]:
    """`chunked_loss_parts`' seconds apart: (the chunked GEMMs less head_cost's three whole
    ones, the chunks' loss less head_cost's loss, the backward's scaling and cast, one whole
    head GEMM as head_cost prices it)."""
    cl, hbm, tokens = _head_inputs(cluster, micro_batch, seq, cp, dtype, stack)
    v, h = model.vocab, model.hidden
    chunk = math.ceil(tokens / math.ceil(v / h))
    chunks = math.ceil(tokens / chunk)
    elem = 4.0 if dtype == "fp32" else BF16
    acc_rw = (elem * (v * chunk + chunk * h) + 8.0 * v * h) / cl.hbm_bytes_per_s
    wgrad = max(cluster_gemm_time(v, h, chunk, cl), acc_rw)
    per_chunk = (cluster_gemm_time(chunk, v, h, cl) + cluster_gemm_time(chunk, h, v, cl)
                 + wgrad)
    whole = cluster_gemm_time(tokens, v, h, cl)
    gemm = chunks * per_chunk - 3.0 * whole
    fused = FUSED_LOSS_BYTES[1 if dtype == "fp32" else 0]
    loss = tokens * v * (fused - sum(loss_bytes(stack))) / hbm
    cast = 0.0 if dtype == "fp32" else 4.0 + elem
    scale = ((8.0 + cast) * v * h + 2.0 * elem * tokens * h) / hbm
    return gemm, loss, scale, whole


def chunked_loss_forward_s(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, seq: int,
                           cp: int = 1, dtype: str = "bf16", stack: str = "eager") -> float:
    """Seconds meshtron's fused cross-entropy runs in its forward beyond `head_cost`'s forward:
    its walk over the chunks makes every gradient there (meshtron/model/loss.py
    `_FusedLinearCrossEntropy.forward`), so head_cost's input- and weight-gradient GEMMs and
    its backward loss pass move into the forward, with `chunked_loss_parts`' GEMM excess and
    the chunks' loss; the backward keeps only the scaling and cast (and the final norm's).
    What a pipeline's stage times split by pass (forward; zero bubble's input and weight
    passes: the weight pass of the loss returns the gradients already scaled, nothing runs)."""
    gemm, loss, scale, whole = _chunked_loss_pieces(model, cluster, micro_batch, seq, cp,
                                                    dtype, stack)
    _, hbm, tokens = _head_inputs(cluster, micro_batch, seq, cp, dtype, stack)
    backward_loss = tokens * model.vocab * loss_bytes(stack)[1] / hbm
    # the clamps of chunked_loss_parts: what it adds in all is what moves, less the scaling
    added = max(0.0, gemm) + max(0.0, loss + scale) - scale
    return 2.0 * whole + backward_loss + added


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
