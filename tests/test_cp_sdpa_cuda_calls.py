"""Context parallelism's CUDA flash kernel calls (meshtron/parallel/cp_sdpa.py `_cuda_forward`,
`_cuda_backward`) run on a CPU machine: on meta tensors the private aten ops bind their
arguments against this torch's schemas and return what their meta kernels say, so a renamed
argument, a moved keyword or a changed number of outputs fails here, not on a GPU. The kit's
torch_tests case runs this under the GPU image's torch (2.11 on the H200)."""

from __future__ import annotations

import torch

from meshtron.parallel.cp_sdpa import KERNELS, chunk_attention


def _qkv(heads: int = 8, kv_heads: int = 2, c: int = 64, d: int = 128):
    def t(h, s):
        return torch.empty(2, h, s, d, device="meta", dtype=torch.bfloat16, requires_grad=True)

    return t(heads, c), t(kv_heads, 4 * c), t(kv_heads, 4 * c)


def test_the_cuda_forward_returns_output_lse_and_what_its_backward_needs():
    q, k, v = _qkv()
    out, lse, saved = KERNELS["cuda"].forward(q, k[:, :, :64], v[:, :, :64], True, 0.1)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32  # merged in fp32
    assert len(saved) == 6  # cum_q, cum_k, max_q, max_k, philox seed and offset
    dq, dk, dv = KERNELS["cuda"].backward(out, q, k[:, :, :64], v[:, :, :64], out, lse, saved,
                                          True, 0.1)
    assert dq.shape == q.shape and dk.shape == dv.shape == (2, 2, 64, 128)  # GQA: kv heads


def test_a_later_chunk_runs_the_cuda_kernels_through_autograd():
    """Chunk 2 of a cp group: a causal diagonal block and an unmasked prefix, merged by their
    log-sum-exp, and the backward of both blocks (the path no CPU run takes)."""
    q, k, v = _qkv()
    out = chunk_attention(q, k, v, 2, KERNELS["cuda"])
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert gq.shape == q.shape and gk.shape == gv.shape == k.shape
