"""Causal attention of one context-parallel query chunk by SDPA's own kernels, without a mask.

With load-balanced, equal-size chunks (context.py: rank r holds chunks r and 2*cp-1-r of size
c), the queries of global chunk j see the keys [0, (j+1)c): the blocks [0, jc) fully and the
square diagonal block [jc, (j+1)c) causally. A square diagonal block is exactly SDPA's top-left
causal mask (`is_causal=True`), the prefix needs no mask at all, and the blocks after the
diagonal are never visited, so no mask is built and the flash kernels run (torch's own
`context_parallel` ring attention splits its blocks the same way). Documents need a mask:
they stay with FlexAttention (CUDA) or the exact boolean mask (CPU), context.py.

The two partial results are merged by their log-sum-exp (out = sum_b out_b * exp(lse_b - lse),
lse = logaddexp over b), which the public `F.scaled_dot_product_attention` does not return:
the forward and backward are the private aten ops SDPA dispatches to (`SdpaKernel`, the same
ones torch's ring attention calls; registered in meshtron/torch_compat.py). The backward of
every block takes the merged output and log-sum-exp, which makes each block's gradient the
exact gradient of the whole softmax (FlashAttention-2's backward recomputes P = exp(S - lse)
and D = rowsum(dO * O) from them).

Grouped-query attention needs no expanded K/V: both kernels take fewer K/V heads than query
heads (head h reads K/V head h // (heads / kv_heads), as SDPA's `enable_gqa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class SdpaKernel:
    """One device's SDPA forward that also returns the log-sum-exp, and its backward."""

    name: str
    device: str
    """The device type it runs on (its key in KERNELS)."""
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple]]
    """(q, k, v, is_causal, scale) -> (out, lse [b, h, s] fp32, what backward needs)."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(dout, q, k, v, out, lse, saved, is_causal, scale) -> (dq, dk, dv)."""


def _cpu_forward(q, k, v, is_causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, saved, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)


def _cuda_forward(q, k, v, is_causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False,
                                                           scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_backward(dout, q, k, v, out, lse, saved, is_causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset,
        scale=scale)


KERNELS = {"cpu": SdpaKernel("cpu-flash", "cpu", _cpu_forward, _cpu_backward),
           "cuda": SdpaKernel("cuda-flash", "cuda", _cuda_forward, _cuda_backward)}
_OPS = {"cpu": "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "cuda": "torch.ops.aten._scaled_dot_product_flash_attention"}
"""The private ops each kernel calls (and their `_backward`)."""


def _detect() -> dict[str, bool]:
    from meshtron.torch_compat import available

    return {dev: available(op) and available(op + "_backward") for dev, op in _OPS.items()}


_AVAILABLE = _detect()
"""Which kernels this torch has, found once at import (a constant where torch.compile traces
`kernel_for`)."""


def kernel_for(q: torch.Tensor) -> SdpaKernel | None:
    """The kernel for `q`'s device and shape, or None where the flash kernels do not apply
    (the caller keeps the masked path): a torch without the ops, or on CUDA other than
    16-bit inputs with head sizes that are multiples of 8 up to 256."""
    kern = KERNELS.get(q.device.type)
    if kern is None or not _AVAILABLE[kern.device]:
        return None
    if q.device.type == "cuda" and (q.dtype not in (torch.float16, torch.bfloat16)
                                    or q.shape[-1] % 8 or q.shape[-1] > 256):
        return None
    return kern


def _blocks(c: int, chunk: int) -> list[tuple[int, int, bool]]:
    """(key start, key end, causal) of query chunk `chunk` (size c): the diagonal block, then
    the prefix before it (none for the first chunk)."""
    blocks = [(chunk * c, (chunk + 1) * c, True)]
    if chunk > 0:
        blocks.append((0, chunk * c, False))
    return blocks


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(out [b, h, s, d], lse [b, h, s])] of one query block over disjoint key blocks -> the
    softmax over all of them: (out in lse's precision, fp32 or fp64; lse)."""
    lse = parts[0][1]
    for _, other in parts[1:]:
        lse = torch.logaddexp(lse, other)
    out = sum(o.to(lse.dtype) * torch.exp(lb - lse).unsqueeze(-1) for o, lb in parts)
    return out, lse


class _ChunkAttention(torch.autograd.Function):
    """Attention of one query chunk to the keys it sees (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, chunk: int, kernel: str, scale: float):
        """`kernel`: the KERNELS key (a string: what torch.compile can trace through)."""
        kern = KERNELS[kernel]
        c = q.shape[2]
        parts, saved = [], []
        for start, end, causal in _blocks(c, chunk):
            o, lse, extra = kern.forward(q, k[:, :, start:end], v[:, :, start:end], causal,
                                         scale)
            parts.append((o, lse))
            saved.append(extra)
        out, lse = merge(parts)
        if out.dtype != q.dtype:
            # Never a no-op `.to` (fp32 inputs: it returns its input): under torch.compile,
            # torch 2.11's dynamo then gave wrong q/k/v gradients (the returned output an
            # alias of the forward's own result; tests/test_context_parallel.py
            # `test_flash_chunks_trace_under_fullgraph_compile`; 2.13 did not).
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk, ctx.kernel, ctx.scale, ctx.extras = chunk, kernel, scale, saved
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kern = KERNELS[ctx.kernel]
        acc = torch.promote_types(q.dtype, torch.float32)  # sum the blocks' gradients in it
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(k, dtype=acc)
        dv = torch.zeros_like(v, dtype=acc)
        dout = dout.contiguous()
        for (start, end, causal), extra in zip(_blocks(q.shape[2], ctx.chunk), ctx.extras):
            gq, gk, gv = kern.backward(dout, q, k[:, :, start:end], v[:, :, start:end], out,
                                       lse, extra, causal, ctx.scale)
            dq += gq
            dk[:, :, start:end] += gk
            dv[:, :, start:end] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int,
                    kernel: SdpaKernel) -> torch.Tensor:
    """Causal attention of the queries of global chunk `chunk` (q [b, h, c, d]) to the
    gathered sequence's keys (k, v [b, kv_heads, >= (chunk + 1) * c, d]): only the prefix
    they can see is passed on (the rest gets no gradient)."""
    end = (chunk + 1) * q.shape[2]
    return _ChunkAttention.apply(q, k[:, :, :end], v[:, :, :end], chunk, kernel.device,
                                 q.shape[-1] ** -0.5)
