"""The optimizer step of an optimizer that loops over parameters in Python (KernelOptions
optimizer 'for-loop'): launch-bound on a small per-rank shard. Torch-free.

Composer's DecoupledAdamW (composer/optim/decoupled_weight_decay.py, 2023), which llm-foundry's
MPT yamls use, steps one parameter tensor at a time: `state['step'] += 1` while it collects the
tensors, then per tensor `exp_avg.mul_(beta1).add_(grad)`, `exp_avg_sq.mul_(beta2).addcmul_(grad,
grad)`, `denom = (exp_avg_sq.sqrt() / c2).add_(eps)`, `param.addcdiv_(exp_avg, denom)`: 9
kernels (the yamls set weight_decay 0.0, which skips `param.mul_`). Each tensor also reads its
step counter with `state_steps[i].item()`, a device tensor: one host synchronisation per
tensor. The yamls' gradient clipping (Composer's gradient_clipping algorithm, clipping_type
norm) calls FSDP's `clip_grad_norm_` on the root, which takes `torch.linalg.vector_norm` of
every gradient and then `grad.mul_(clip_coef)` per gradient
(torch/distributed/fsdp/fully_sharded_data_parallel.py): 2 more kernels per tensor.

Which tensors a rank steps: FSDP1 with use_orig_params (Composer's default, `fsdp_config.
setdefault('use_orig_params', True)`, trainer/dist_strategy.py) flattens each wrapped unit's
parameters in registration order into one flat parameter, pads it to a multiple of the shard
degree and gives rank r the r-th equal chunk; an original parameter outside a rank's chunk has
its gradient set to None (`_use_sharded_grad_views`, torch/distributed/fsdp/_flat_param.py)
and the loop skips it. A rank therefore steps the tensors its chunks intersect: 1 or 2 per unit
at a large shard degree, 3 on the rank whose chunk holds a norm weight between two matrices,
all of them unsharded. Every rank waits for the slowest at the next collective, so the slowest
rank is priced (`step_s`). (FSDP2 shards every parameter over every rank, so a loop over its
DTensors would step all tensors everywhere; no stack priced here runs that.)

Time: every kernel is a no-grad launch (the step runs under torch.no_grad: gemm.dispatch_s
without autograd's recording, host.AUTOGRAD_RECORD), and each `.item()` empties the queue
(host.SYNC_S). The launches of a tensor run ahead of the GPU only until its next `.item()`, so
host.launch_bound's stretch rule applies per tensor: the step is the sum over the rank's tensors
of max(launches, device time) plus a synchronisation each, on the slowest rank.
"""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner import gemm, host
from meshtron.planner.cluster import ClusterSpec

ADAM_KERNELS = 9
"""Kernels per tensor of DecoupledAdamW.step at weight_decay 0 (module docstring): the step
counter's increment, mul_ + add_, mul_ + addcmul_, sqrt, div, add_, addcdiv_."""
CLIP_KERNELS = 2
"""Kernels per gradient of FSDP's clip_grad_norm_: its vector_norm and the mul_ by the clip
coefficient (module docstring)."""
KERNELS_PER_TENSOR = ADAM_KERNELS + CLIP_KERNELS
SYNCS_PER_TENSOR = 1
"""`state_steps[i].item()` per tensor (module docstring)."""


def layer_tensors(model: ModelSpec, tp: int) -> list[float]:
    """Elements of one block's parameter tensors on one tensor-parallel rank, in registration
    order (MPT's MPTBlock: norm_1, attn.Wqkv, attn.out_proj, norm_2, ffn.up_proj,
    ffn.down_proj; a SwiGLU MLP adds its gate after up); biases after their weights."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    norm = [float(h)] + ([float(h)] if model.bias and model.norm == "layernorm" else [])
    qkv, out = (h * (h + 2 * kv)) / tp, h * h / tp
    ups = [h * f / tp] * (2 if model.gated_mlp else 1)
    down = h * f / tp
    out_t: list[float] = list(norm)
    for w, b in ((qkv, (h + 2 * kv) / tp), (out, h)):
        out_t += [w] + ([b] if model.bias else [])
    out_t += norm
    for w in ups:
        out_t += [w] + ([f / tp] if model.bias else [])
    out_t += [down] + ([float(h)] if model.bias else [])
    return out_t


def outer_tensors(model: ModelSpec, tp: int, first: bool, last: bool) -> list[float]:
    """The tensors outside the blocks on a stage, in one unit (FSDP1's root): the word
    embedding (+ learned position table) on the first stage, the final norm (+ untied head) on
    the last."""
    h = model.hidden
    t: list[float] = []
    if first:
        t.append(model.vocab * h / tp)
        if model.position == "learned":
            t.append(float(model.max_seq * h))
    if last:
        t += [float(h)] + ([float(h)] if model.bias and model.norm == "layernorm" else [])
        if not model.tied_embeddings:
            t.append(model.vocab * h / tp)
    return t


Units = list[tuple[list[float], int]]
"""(tensor sizes of one unit in registration order, how many such units) per unit kind."""


def _rank_slices(units: Units, shard: int) -> list[list[tuple[float, int]]]:
    """For each rank that may be the busiest, the (elements in its chunk, how many units)
    of every tensor it steps, `units` being (tensor sizes in order, how many such units)
    each flattened, padded and split into `shard` equal chunks (FSDP1's FlatParameter). A
    rank's tensor count is a sum of interval counts, which peaks at some tensor's first chunk:
    only those ranks are tried."""
    laid = []
    for sizes, count in units:
        if not sizes:
            continue
        chunk = -(-int(sum(sizes)) // max(1, shard))  # ceil: padded to a multiple of shard
        spans, off = [], 0
        for s in sizes:
            n = max(1, int(s))
            spans.append((off, off + n))
            off += n
        laid.append((spans, chunk, count))
    starts = {a // chunk for spans, chunk, _ in laid for a, _ in spans}
    out = []
    for r in sorted(starts):
        held = []
        for spans, chunk, count in laid:
            lo, hi = r * chunk, (r + 1) * chunk
            held += [(min(b, hi) - max(a, lo), count) for a, b in spans if a < hi and b > lo]
        out.append(held)
    return out


def busiest_rank_tensors(units: Units, shard: int) -> int:
    """Most parameter tensors any rank steps over `units` (`_rank_slices`)."""
    return max((sum(c for _, c in held) for held in _rank_slices(units, shard)), default=0)


def step_s(units: Units, shard: int, device_s: float, cluster: ClusterSpec) -> float:
    """Seconds of a for-loop optimizer step on the slowest rank (module docstring), the
    memory-bound `device_s` of a rank's whole shard shared out by elements. Each tensor's
    `.item()` empties the queue, so the host runs ahead only within a tensor: per tensor
    max(its launches, its device time) (host.launch_bound), plus the synchronisation."""
    launch = gemm.dispatch_s(cluster) / host.AUTOGRAD_RECORD  # no-grad: nothing recorded
    issue = KERNELS_PER_TENSOR * launch
    worst = 0.0
    for held in _rank_slices(units, shard):
        elems = sum(e * c for e, c in held)
        t = 0.0
        for e, c in held:
            dev = device_s * e / elems if elems else 0.0
            t += c * (dev + host.launch_bound(dev, issue) + SYNCS_PER_TENSOR * host.SYNC_S)
        worst = max(worst, t)
    return worst
