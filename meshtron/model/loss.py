"""Next-token cross-entropy, and the fused form that never holds the logits of a whole
micro-batch.

The plain loss runs the output head on every token ([tokens, vocab] logits in the compute
dtype), upcasts them to fp32 and keeps fp32 log-probabilities for backward: about 4 GB at a
128k vocabulary and 8k tokens. `chunked_cross_entropy` is a fused linear cross-entropy (the
scheme of Liger-Kernel's `LigerFusedLinearCrossEntropyFunction`): one autograd node whose
forward walks chunks of tokens once and, per chunk, computes the logits in the compute dtype,
an fp32 log-sum-exp and loss, the logits' gradient, and from it the chunk's input gradient and
the head's weight gradient. The weight gradient accumulates inside the GEMM (addmm with beta 1)
into one fp32 [vocab, hidden] buffer: no per-chunk gradient tensors for autograd to sum and no
head GEMM replayed in backward, which only scales the saved gradients by the incoming one. The
chunk size follows Liger's rule (logits of one chunk about as large as the hidden states:
tokens / ceil(vocab / hidden)).

Held from the loss's forward to its backward: the fp32 weight-gradient accumulator and the
input gradient [tokens, hidden] (the planner prices both: planner/memory_acts.py
`chunked_loss_bytes`). No host synchronisation: the count of non-ignored targets stays a
tensor and nothing branches on tensor values.

Gradients equal the plain loss's to fp32 summation order (tests/test_model.py).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Targets with this value are left out of the mean, as `F.cross_entropy` does."""


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats of whole logits, computed in fp32 (the path of
    vocabulary-sharded DTensor logits under `loss_parallel` and of pipeline stages)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: one chunk's logits about as large as the whole hidden states."""
    return max(1, math.ceil(tokens / math.ceil(vocab / hidden)))


@lru_cache(maxsize=None)
def _addmm_out_dtype(device: str, dtype: torch.dtype) -> bool:
    """Whether addmm on `device` ("cuda:0", "cpu") adds `dtype` operands' product into an fp32
    output in place (`out_dtype`, beta 1), as `_accumulate` uses it: probed once per device and
    dtype on tiny real tensors (feature detection; CUDA has it for 16-bit operands, torch
    2.13's CPU not), on the rank's own device (never another GPU). Outside any dispatch mode:
    fake tensors (`meshtron rehearse`) accept the call on a device whose kernels lack it."""
    from meshtron.torch_compat import lookup

    no_modes = lookup("torch.utils._python_dispatch._disable_current_modes", None)
    if no_modes is None:  # torch without it: the upcast path (the same fp32 sum)
        return False
    with no_modes():
        return accumulates_in_fp32(torch.addmm, torch.device(device), dtype)


def accumulates_in_fp32(addmm, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `addmm(acc, g.t(), x, out_dtype=float32, out=acc)` with `dtype` g and x adds
    g^T x to the fp32 `acc` (beta 1, transposed g as `_accumulate` passes it). Run on values
    whose fp32 sum is known and not a 16-bit number (2^-10 + 3 in every element), so a kernel
    that refuses the call, ignores `acc` or rounds the sum to `dtype` is not used: the upcast
    path is exact instead. One host read, once per device and dtype (`_addmm_out_dtype`'s
    cache)."""
    g = torch.ones(3, 2, dtype=dtype, device=device)
    x = torch.ones(3, 2, dtype=dtype, device=device)
    acc = torch.full((2, 2), 2.0 ** -10, dtype=torch.float32, device=device)
    try:
        addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return acc.dtype == torch.float32 and bool((acc == 3 + 2.0 ** -10).all())


def _accumulate(acc: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """acc += g^T x inside one GEMM (beta 1) into the fp32 accumulator. 16-bit operands use
    addmm's fp32 output where the device has it; elsewhere (CPU) they are upcast first, which
    costs a chunk-sized copy but keeps the same fp32 sum."""
    if g.dtype == acc.dtype:
        torch.addmm(acc, g.t(), x, out=acc)
    elif _addmm_out_dtype(str(acc.device), g.dtype):
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
    else:
        torch.addmm(acc, g.t().float(), x.float(), out=acc)


def _chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           t: torch.Tensor, count: torch.Tensor, grads: tuple | None) -> torch.Tensor:
    """Summed loss of one chunk of tokens; with `grads` (input-gradient slice or None, weight
    and bias accumulators or None) also the chunk's gradients of the mean loss."""
    valid = t != IGNORE_INDEX
    logits = F.linear(h, weight, bias)
    z = logits.float()  # fp32 softmax: the plain loss's upcast; a no-op at fp32
    del logits
    lse = torch.logsumexp(z, dim=-1)
    idx = torch.where(valid, t, 0).unsqueeze(1)
    loss = ((lse - z.gather(1, idx).squeeze(1)) * valid).sum()
    if grads is None:
        return loss
    g_in, g_w, g_b = grads
    # d(mean)/d(logits) = (softmax - onehot(target)) / count on valid rows, 0 elsewhere;
    # written in place over z, the chunk's only fp32 [chunk, vocab] tensor
    p = z.sub_(lse.unsqueeze(1)).exp_()
    p.scatter_add_(1, idx, valid.to(p.dtype).neg().unsqueeze(1))
    # ignored rows get 0; with every target ignored 0 too (count clamped), as F.cross_entropy's
    # backward gives, while the loss itself is 0/0 = nan as its forward
    p.mul_((valid / count.clamp(min=1)).unsqueeze(1))
    g = p.to(h.dtype)
    del p, z
    if g_in is not None:
        torch.mm(g, weight, out=g_in)
    if g_w is not None:
        _accumulate(g_w, g, h)
    if g_b is not None:
        g_b.add_(g.sum(0, dtype=torch.float32))
    return loss


def _walk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor,
          chunk: int, grads: tuple | None) -> torch.Tensor:
    """Mean loss over all chunks (fp32), filling `grads` chunk by chunk when given."""
    count = (t != IGNORE_INDEX).sum()
    sums = []
    for i, (hc, tc) in enumerate(zip(h.split(chunk), t.split(chunk))):
        if grads is None:
            sums.append(_chunk(hc, weight, bias, tc, count, None))
            continue
        g_in, g_w, g_b = grads
        part = None if g_in is None else g_in[i * chunk:i * chunk + hc.shape[0]]
        sums.append(_chunk(hc, weight, bias, tc, count, (part, g_w, g_b)))
    return torch.stack(sums).sum() / count


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss forward and every gradient in one pass over the chunks; backward only scales."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk, dtype, passes=1):
        with torch.autocast(h.device.type, enabled=False):  # explicit dtypes below
            x, w = h.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            need_h, need_w, need_b = ctx.needs_input_grad[:3]
            g_in = torch.empty_like(x) if need_h else None
            g_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
            g_b = (torch.zeros(b.shape, dtype=torch.float32, device=b.device)
                   if need_b and b is not None else None)
            loss = _walk(x, w, b, targets, chunk, (g_in, g_w, g_b))
        # kept on ctx, not saved: backward drops them after its last expected pass, so one
        # more backward through this node fails loudly instead of scaling twice
        ctx.grads, ctx.passes_left = (g_in, g_w, g_b), passes
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("the fused cross-entropy's gradients were already used: "
                               "backward through it runs once (no retain_graph)")
        ctx.passes_left -= 1
        if ctx.passes_left == 0:
            ctx.grads = None
        if not getattr(ctx, "scaled", False):  # the later pass gets the same tensors
            ctx.scaled = True
            grads = tuple(None if g is None else g.mul_(grad_loss) for g in grads)
        return (*grads, None, None, None, None)


def chunked_cross_entropy(head: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                          chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `head(h)` against `targets` ([batch, seq, hidden] and [batch, seq])
    without the [tokens, vocab] logits, `chunk` tokens at a time (default `chunk_tokens`).
    The head's weight is used directly (not `head(...)` per chunk): called from
    `OutputHead.forward`, FSDP2 has gathered it once for the whole call and reduces its
    gradient once. Under autocast the GEMMs run in the autocast dtype, as `F.linear` would."""
    flat_h, flat_t = h.flatten(0, 1), targets.flatten()
    weight, bias = head.weight, head.bias
    chunk = chunk or chunk_tokens(flat_h.shape[0], flat_h.shape[-1], weight.shape[0])
    kind = flat_h.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    needs = (flat_h.requires_grad or weight.requires_grad
             or (bias is not None and bias.requires_grad))
    if torch.is_grad_enabled() and needs:
        if not getattr(head, "split_backward", False):
            return _FusedLinearCrossEntropy.apply(flat_h, weight, bias, flat_t, chunk, dtype, 1)
        return _anchored(head, _FusedLinearCrossEntropy.apply(flat_h, weight, bias, flat_t,
                                                              chunk, dtype, 2))
    with torch.autocast(kind, enabled=False):
        b = None if bias is None else bias.to(dtype)
        return _walk(flat_h.to(dtype), weight.to(dtype), b, flat_t, chunk, None)


def _anchored(head: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """A zero-bubble schedule's loss: a copy of the fused loss, whose own output stays on
    `head` (`loss_anchors`) until `release_anchors`. The schedule detaches the stage's output
    after the input backward and runs the weight backward later from the loss node it kept
    (torch/distributed/pipelining/_backward.py `stage_backward_input`, `t.detach_()`); an
    autograd.Function's node is held only weakly by its Python object, and torch 2.11 frees
    it with the detached output, so the weight pass raised "Attribute '_input_metadata' is
    invalid for this instance of _C._FunctionBase" (2.13 keeps it). The copy is what gets
    detached; the anchored output keeps the node (its saved tensors go after the second pass,
    as always). A copy, not a view: the schedule's in-place detach refuses views."""
    head.__dict__.setdefault("loss_anchors", []).append(loss)
    return loss.clone()


def release_anchors(head: nn.Module) -> None:
    """Drop the fused-loss outputs `_anchored` kept (a step's weight passes have all run)."""
    head.__dict__.pop("loss_anchors", None)


class OutputHead(nn.Linear):
    """The output head: an `nn.Linear` (same parameters and names) whose forward also takes
    `targets` and then returns the fused mean cross-entropy instead of logits. The loss runs
    inside the head's own single call, so FSDP2's hooks gather its weight once and reduce its
    gradient once per backward, however many chunks there are."""

    split_backward = False
    """Set by meshtron/parallel/pipeline.py on a zero-bubble schedule's last stage: torch runs
    the loss node's backward twice there, once for the input gradient and once, with the same
    incoming gradient, for the weight gradient (torch/distributed/pipelining/_backward.py
    `stage_backward_input` with retain_graph, then `stage_backward_weight` from the saved
    intermediate gradients). The fused loss then returns the same scaled gradients both times
    and drops them after the second."""

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        return chunked_cross_entropy(self, h, targets)
