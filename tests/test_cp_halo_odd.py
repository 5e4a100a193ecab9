"""Context parallelism's sliding-window halo at an odd cp (3 gloo ranks), the attention alone:
`ContextParallel._window_attend` (the halo exchange where `halo_rows` says it pays, the gather
otherwise) against SDPA under the dense band-and-document mask, forward and the gradients of
q, k and v (the halo rows' gradients return to the ranks holding them through the
all_to_all's backward), in float64, on every rank; and the CUDA branch's band-and-document
block mask (eager FlexAttention on CPU, forward). The model-level tests (test_context_parallel.py,
test_cp_train.py) run cp 2 and 4; at cp 3 rank cp-1 = 2 holds the adjacent chunks 2 and 3 and
no rank pairs up symmetrically. Windows: 1 (no exchange), every window - 1 at and beside
multiples of the chunk (c = 4: h = k*c - 1, k*c, k*c + 1 up to the sequence), documents
crossing the chunk borders or not. And what selective recomputation keeps of a sliding block's
exchange (the received rows, read from the policy's calls) against the planner's
`gathered_kv_bytes`.
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


def _kept_by_selective_rank(window: int) -> dict:
    """Positions of K and V the selective recomputation policy (parallel/recompute.py) keeps
    from one sliding Attention block's collectives under CP, read from the policy's own calls:
    the received rows of each all_to_all it saves (K and V side by side), the positions of
    each all-gather (K, then V)."""
    from functools import partial

    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from meshtron.model.spec import PRESETS
    from meshtron.model.transformer import Attention, Transformer
    from meshtron.parallel import recompute
    from meshtron.parallel.context import apply_context_parallel, shard_batch

    kept = {"all_to_all_single": [], "all_gather_into_tensor": []}
    saved = recompute._saved_ops()

    def policy(ctx, op, *args, **kwargs):
        decision = recompute._selective_policy(saved, ctx, op, *args, **kwargs)
        name = op.__name__.split(".")[0]
        if op in saved and name in kept and not ctx.is_recompute:
            if name == "all_to_all_single":  # [rows, b, kv heads, K + V head]: the received
                rows = sum(args[1]) * args[0][0].numel() / (2 * spec.kv_dim)
            else:  # K or V of every rank (group size x the local tensor)
                rows = args[1] * args[0].numel() / spec.kv_dim
            kept[name].append(rows)  # positions, batch of one
        return decision

    spec = PRESETS["debug"].replace(sliding_window=window, window_every=0)
    model = Transformer(spec, init_seed=0)
    cp = apply_context_parallel(model, dist.group.WORLD)
    x = torch.randint(0, 200, (1, SEQ), generator=torch.Generator().manual_seed(0))
    tokens = shard_batch(x, None, cp.cp, cp.rank).tokens
    ctx = cp.context(tokens, model)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    h = torch.randn(1, SEQ // CP, spec.hidden, requires_grad=True)
    out = checkpoint(attn, h, ctx, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(policy))
    out.sum().backward()
    return kept


def test_selective_recompute_keeps_the_received_rows_the_planner_prices():
    """Under selective recomputation a sliding block under the halo keeps the all_to_all's
    output, the rows its rank received (planner/memory_acts.py `gathered_kv_bytes` prices
    those at the fullest rank), not its key layout; past the threshold the gathers keep the
    sequence's K and V."""
    from meshtron.model.cp_halo_plan import halo_plan
    from meshtron.model.spec import PRESETS
    from meshtron.planner import memory
    from meshtron.planner.kernel_options import KernelOptions
    from meshtron.planner.memory_acts import gathered_kv_bytes

    opts = KernelOptions()
    mem = memory.options_for(opts)
    for window in (6, 14, 23):
        got = run_on_ranks(_kept_by_selective_rank, CP, window, timeout=120)
        halo = window < 23
        spec = PRESETS["debug"].replace(sliding_window=window, window_every=0)
        for rank, kept in enumerate(got):
            if halo:
                assert kept == {"all_to_all_single": [halo_plan(SEQ, CP, rank, window).received()],
                                "all_gather_into_tensor": []}, (window, rank, kept)
            else:
                assert kept == {"all_to_all_single": [], "all_gather_into_tensor": [SEQ, SEQ]}, (
                    window, rank, kept)
        rows = max(k["all_to_all_single"][0] for k in got) if halo else SEQ
        assert gathered_kv_bytes(spec, 1, 1, SEQ, CP, "selective", opts, mem) == (
            2 * rows * spec.kv_dim * mem.compute_bytes), window
