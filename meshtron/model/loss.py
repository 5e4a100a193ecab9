"""Next-token cross-entropy, and the chunked form that never holds the logits of a whole
micro-batch.

The plain loss runs the output head on every token ([tokens, vocab] logits in the compute
dtype), upcasts them to fp32 and keeps fp32 log-probabilities for backward: about 4 GB at a
128k vocabulary and 8k tokens. `chunked_cross_entropy` runs the head and the loss on chunks of
tokens under activation checkpointing (`torch.utils.checkpoint`, non-reentrant): forward keeps
only each chunk's loss, backward recomputes one chunk's logits at a time (bf16 logits per chunk
under bf16, fp32 softmax and log-sum-exp inside it). The idea of Liger-Kernel's fused linear
cross-entropy and of Megatron-LM's chunked output layer; the chunk size follows Liger's rule
(logits of one chunk about as large as the hidden states: tokens / ceil(vocab / hidden)). The
price is one extra head matmul per token in backward.

Gradients equal the plain loss's to fp32 summation order (tests/test_model.py).
"""

from __future__ import annotations

import math

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


def _chunk_loss(weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight, bias).float(), targets, reduction="sum",
                           ignore_index=IGNORE_INDEX)


def chunked_cross_entropy(head: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                          chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `head(h)` against `targets` ([batch, seq, hidden] and [batch, seq])
    without the [tokens, vocab] logits: the head runs on `chunk` tokens at a time (default
    `chunk_tokens`) and is recomputed in backward. The head's weight is used directly (not
    `head(...)` per chunk): called from `OutputHead.forward`, FSDP2 has gathered it once for
    the whole call, and a module called once per chunk would reduce its gradient once per
    chunk (one collective per chunk and step instead of one)."""
    from torch.utils.checkpoint import checkpoint

    flat_h, flat_t = h.flatten(0, 1), targets.flatten()
    n = flat_h.shape[0]
    weight = head.weight
    chunk = chunk or chunk_tokens(n, flat_h.shape[-1], weight.shape[0])
    # `split`, not slicing: one SplitBackward concatenates the chunks' gradients once, where
    # slices would each scatter into a zero-filled [tokens, hidden] gradient.
    pieces = zip(flat_h.split(chunk), flat_t.split(chunk))
    if torch.is_grad_enabled() and (flat_h.requires_grad or weight.requires_grad):
        sums = [checkpoint(_chunk_loss, weight, head.bias, hc, tc, use_reentrant=False)
                for hc, tc in pieces]
    else:
        sums = [_chunk_loss(weight, head.bias, hc, tc) for hc, tc in pieces]
    count = (flat_t != IGNORE_INDEX).sum()
    return torch.stack(sums).sum() / count


class OutputHead(nn.Linear):
    """The output head: an `nn.Linear` (same parameters and names) whose forward also takes
    `targets` and then returns the chunked mean cross-entropy instead of logits. The loss runs
    inside the head's own single call, so FSDP2's hooks gather its weight once and reduce its
    gradient once per backward, however many chunks there are."""

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        return chunked_cross_entropy(self, h, targets)
