"""Context parallelism's sliding-window halo at an odd cp (3 gloo ranks), the attention alone:
`ContextParallel._window_attend` (the halo exchange where `halo_rows` says it pays, the gather
otherwise) against SDPA under the dense band-and-document mask, forward and the gradients of
q, k and v (the halo rows' gradients return to the ranks holding them through the
all_to_all's backward), in float64, on every rank; and the CUDA branch's band-and-document
block mask (eager FlexAttention on CPU, forward). The model-level tests (test_context_parallel.py,
test_cp_train.py) run cp 2 and 4; at cp 3 rank cp-1 = 2 holds the adjacent chunks 2 and 3 and
no rank pairs up symmetrically. Windows: 1 (no exchange), every window - 1 at and beside
multiples of the chunk (c = 4: h = k*c - 1, k*c, k*c + 1 up to the sequence), documents
crossing the chunk borders or not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from testkit.multiproc import run_on_ranks

CP, C = 3, 4
SEQ = 2 * CP * C  # 24
WINDOWS = sorted({1, 2} | {k * C + d for k in range(1, 2 * CP) for d in (0, 1, 2)} - {SEQ, SEQ + 1})


def _dense(window: int, doc: torch.Tensor | None) -> torch.Tensor:
    i = torch.arange(SEQ)
    mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window))[None, None]
    return mask if doc is None else mask & (doc[:, None, :, None] == doc[:, None, None, :])


def _odd_cp_rank() -> dict:
    """Worst differences against the dense reference, and per window whether the halo ran and
    how many all_to_all calls its forward + backward issued."""
    import torch.distributed as dist

    from meshtron.parallel.context import ContextParallel, chunk_positions
    from meshtron.parallel.cp_halo import halo_rows

    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    cpx = ContextParallel(dist.group.WORLD)
    pos = chunk_positions(SEQ, CP, rank)
    worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "flex": 0.0}
    calls = {}
    for window in WINDOWS:
        for documents in (False, True):
            g = torch.Generator().manual_seed(100 * window + documents)
            q = torch.randn(2, 4, SEQ, 8, generator=g, requires_grad=True)
            k, v = (torch.randn(2, 2, SEQ, 8, generator=g, requires_grad=True) for _ in range(2))
            # documents end at random columns, crossing chunk borders (different per row)
            doc = (torch.rand(2, SEQ, generator=g) < 0.2).long().cumsum(1) if documents else None
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=_dense(window, doc),
                                                  enable_gqa=True)
            dout = torch.randn(want.shape, generator=g)
            ref = torch.autograd.grad(want, (q, k, v), dout)
            q_doc = None if doc is None else doc[:, pos]
            local = [t.detach()[:, :, pos].requires_grad_(True) for t in (q, k, v)]
            seen = _count_all_to_all()
            with seen:
                out = cpx._window_attend(window, pos, q_doc, doc, SEQ, False)(*local)
                grads = torch.autograd.grad(out, local, dout[:, :, pos])
            worst["out"] = max(worst["out"], (out - want[:, :, pos]).abs().max().item())
            for name, got, full in zip(("dq", "dk", "dv"), grads, ref):
                worst[name] = max(worst[name], (got - full[:, :, pos]).abs().max().item())
            if documents:  # the block mask of band and documents (eager FlexAttention: slow)
                with torch.no_grad():
                    flex = cpx._window_attend(window, pos, q_doc, doc, SEQ, True)(
                        *(t.detach() for t in local))
                worst["flex"] = max(worst["flex"], (flex - want[:, :, pos]).abs().max().item())
            calls[window, documents] = (halo_rows(SEQ, CP, window) is not None, seen.count)
    torch.set_default_dtype(torch.float32)
    return {"worst": worst, "calls": calls}


def _count_all_to_all():
    """A dispatch mode counting the all_to_all_single calls under it (`.count`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] == "all_to_all_single":
                self.count += 1
            return func(*args, **(kwargs or {}))

    return Count()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_halo_at_odd_cp_is_the_dense_band_with_gradients():
    results = run_on_ranks(_odd_cp_rank, CP, timeout=240)
    for rank, res in enumerate(results):
        assert max(res["worst"].values()) < 1e-12, (rank, res["worst"])
        for (window, documents), (halo, a2a) in res["calls"].items():
            # the halo: one all_to_all forward, one backward (none for a window of one);
            # the gather otherwise (the longest windows: every rank would keep the sequence)
            assert a2a == (2 if halo and window > 1 else 0), (rank, window, documents, a2a)
    ran = {w for (w, _), (halo, _) in results[0]["calls"].items() if halo}
    assert {1, C + 1, 2 * C, 2 * C + 1, 3 * C + 1, 4 * C} <= ran, ran  # one chunk .. four
    assert max(WINDOWS) not in ran  # and past the threshold the gather ran
