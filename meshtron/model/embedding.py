"""Token (and learned position) embedding whose weight gradient is summed in fp32 on every device.

Why: a bf16 embedding's weight gradient is a sum over every position of the micro-batch that
holds a token. PyTorch's CUDA kernel sums it in fp32 and rounds once
(aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu: partial sums in `acc_type`, float for
bf16; torch 2.13), but its CPU kernel allocates the gradient in the gradient's own dtype and adds
row by row (aten/src/ATen/native/Embedding.cpp `embedding_dense_backward_cpu`: `grad_weight`
made with `grad_.options()`, one TensorIterator add per position), so a frequent token's
gradient loses bits with every addition: on `tiny` with the default data (stdlib text, bytes), micro-batch 16 of 256 tokens, 24% relative
error against fp32 (the user audit of 2026-12-05 saw 18%), 2% at micro-batch 2, every other
parameter within 1.1%; summed in fp32: 0.5-0.6% (2026-12-05, tests/test_embedding_grad.py).

What: `Embedding` is an `nn.Embedding` (same parameter, same state-dict key, same hooks, so
tensor parallelism, FSDP2 and checkpoints see no change) whose forward picks the backward by
the weight's device: on CUDA, or for an fp32/fp64 weight, `F.embedding` (PyTorch's kernel: no
extra memory or host work); elsewhere, for a bf16/fp16 plain tensor, `_Fp32GradEmbedding`:
the same gather forward, and a backward that sums the rows into an fp32 [vocab, hidden] buffer
(twice the bf16 gradient's bytes, CPU only) and rounds it to the weight's dtype once, as the
CUDA kernel does. `Embedding.kernel` overrides the choice (`meshtron rehearse` on a CPU measures
a GPU run's kernel).

Under tensor parallelism the weight is a DTensor sharded over its rows (the vocabulary-parallel
embedding: `RowwiseParallel`, meshtron/parallel/tensor.py) and the tokens a replicated DTensor.
DTensor's own lookup masks the tokens outside this rank's rows to row 0, gathers, zeroes their
output rows and returns a partial sum over the tp ranks (torch 2.13 torch/distributed/tensor/
_ops/_embedding_ops.py `MaskPartial`); its backward is PyTorch's kernel on the local shard,
in bf16 on a CPU. Off CUDA the same masked lookup runs here on the local shard through
`_Fp32GradEmbedding` (`_row_shard_lookup`), returned as the same partial sum (`Partial`), so
the parallelize style's output redistribution (all-reduce, or reduce-scatter under sequence
parallelism) is unchanged; on CUDA DTensor's path runs as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_EXACT_DTYPES = (torch.float32, torch.float64)


class _Fp32GradEmbedding(torch.autograd.Function):
    """Gather rows of `weight`; backward sums the gradient rows per token in fp32."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.rows, ctx.dtype = weight.shape[0], weight.dtype
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        width = grad_out.shape[-1]
        total = torch.zeros(ctx.rows, width, dtype=torch.float32, device=grad_out.device)
        total.index_add_(0, tokens.reshape(-1), grad_out.reshape(-1, width).float())
        return None, total.to(ctx.dtype)


def sums_in_fp32_natively(weight: torch.Tensor) -> bool:
    """PyTorch's own embedding backward already sums this weight's gradient in fp32 (or the
    weight is fp32/fp64)."""
    return weight.device.type == "cuda" or weight.dtype in _EXACT_DTYPES


def _row_shard(tokens: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The first row this rank holds when `weight` is a DTensor sharded over its rows on a
    one-dimensional mesh and `tokens` a replicated DTensor on the same mesh (tensor
    parallelism's vocabulary-parallel lookup); None for any other layout (DTensor's own
    lookup then runs). Uneven shards (vocabulary 259 over 2 ranks: 130 + 129) included."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not (isinstance(weight, DTensor) and isinstance(tokens, DTensor)):
        return None
    if (weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),)
            or tokens.device_mesh != weight.device_mesh
            or tuple(tokens.placements) != (Replicate(),)):
        return None
    from meshtron.model.init import local_box

    return local_box(weight)[1][0]


def _row_shard_lookup(tokens, weight, first: int):
    """DTensor's masked lookup (`MaskPartial`, module docstring) on this rank's rows, with the
    weight gradient summed in fp32: a partial-sum DTensor [*tokens.shape, hidden]."""
    from torch.distributed.tensor import DTensor, Partial

    ids, local = tokens.to_local(), weight.to_local()
    inside = (ids >= first) & (ids < first + local.shape[0])
    rows = _Fp32GradEmbedding.apply(torch.where(inside, ids - first, 0), local)
    rows = rows * inside.unsqueeze(-1).to(rows.dtype)  # others' tokens: 0 here, exact
    return DTensor.from_local(rows, weight.device_mesh, [Partial()], run_check=False)


class Embedding(nn.Embedding):
    """`nn.Embedding` with an fp32-summed weight gradient on every device (module docstring)."""

    kernel: str | None = None
    """None: chosen by the weight's device and dtype (module docstring); "pytorch": always
    PyTorch's kernel (`meshtron rehearse` on a CPU measures what a GPU run allocates, whose
    kernel needs no fp32 buffer); "fp32_sum": always `_Fp32GradEmbedding`."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        plain = (self.padding_idx is None and self.max_norm is None
                 and not self.scale_grad_by_freq and not self.sparse)
        native = self.kernel == "pytorch" or (
            self.kernel is None and sums_in_fp32_natively(self.weight))
        if not plain or native or not torch.is_grad_enabled():
            return super().forward(tokens)
        from torch.distributed.tensor import DTensor

        if isinstance(self.weight, DTensor):
            first = _row_shard(tokens, self.weight)
            if first is None:
                return super().forward(tokens)
            return _row_shard_lookup(tokens, self.weight, first)
        return _Fp32GradEmbedding.apply(tokens, self.weight)
