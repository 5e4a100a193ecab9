"""bf16 token embedding under tensor parallelism (the vocabulary-parallel lookup, RowwiseParallel
over the rows): off CUDA the local shard's weight gradient is summed in fp32, as one process's
(meshtron/model/embedding.py `_row_shard_lookup`); DTensor's own lookup sums it in bf16 on a CPU
(8.1e-2 off fp32 against one process's 3.2e-3 on `debug`, 1,024 tokens per micro-batch,
2026-12-06). Two real gloo ranks; vocabulary 259 over 2 ranks: 130 + 129 rows."""

import pytest
import torch
import torch.nn.functional as F

from testkit.multiproc import run_on_ranks

VOCAB, HIDDEN = 259, 64


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _lookup_on_rank(sp: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from meshtron.model.embedding import Embedding
    from tests.test_embedding_grad import _zipf_tokens

    mesh = init_device_mesh("cpu", (2,))
    tokens = _zipf_tokens(VOCAB, (16, 256), seed=0)
    grad_out = torch.randn(16, 256, HIDDEN, generator=torch.Generator().manual_seed(1))
    full = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(2))
    full = full.to(torch.bfloat16)
    exact = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64).index_add_(
        0, tokens.reshape(-1), grad_out.reshape(-1, HIDDEN).to(torch.bfloat16).double())
    out_layout = Shard(1) if sp else Replicate()
    rank = mesh.get_local_rank()
    result = {}
    for kernel in (None, "pytorch"):
        emb = Embedding(VOCAB, HIDDEN).to(torch.bfloat16)
        with torch.no_grad():
            emb.weight.copy_(full)
        emb.kernel = kernel
        parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                      output_layouts=out_layout))
        out = emb(tokens)
        want_out = F.embedding(tokens, full)
        if sp:
            want_out = want_out.chunk(2, dim=1)[rank]
        grad = grad_out.chunk(2, dim=1)[rank] if sp else grad_out
        out.backward(grad.to(torch.bfloat16))
        # the whole gradient (DTensor's own lookup leaves it replicated on the row-sharded
        # weight, ParallelModel._align_grad_placements; ours leaves it sharded like the weight)
        whole = emb.weight.grad.full_tensor()
        result[kernel] = {
            "forward_equal": bool(torch.equal(out, want_out)),
            "node": type(out.grad_fn).__name__,
            "rows": emb.weight.to_local().shape[0],
            "grad_error": _relative(whole, exact),
        }
    return result


@pytest.mark.parametrize("sp", [False, True])
def test_the_tp_embedding_sums_its_local_gradient_in_fp32_off_cuda(sp):
    ranks = run_on_ranks(_lookup_on_rank, 2, sp, timeout=120)
    assert [r[None]["rows"] for r in ranks] == [130, 129]
    for r in ranks:
        ours, dtensor = r[None], r["pytorch"]
        # the same lookup as DTensor's (bit for bit), before and after its redistribution
        assert ours["forward_equal"] and dtensor["forward_equal"]
        # the fp32 sum of bf16 inputs, rounded to bf16 once: within bf16's rounding
        assert ours["grad_error"] < 2 ** -8
        # DTensor's own lookup on a CPU sums in bf16: the defect this fixes
        assert dtensor["grad_error"] > 4 * ours["grad_error"]
