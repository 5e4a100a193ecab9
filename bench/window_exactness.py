"""Sliding windows x packed documents x context parallelism against dense masks, in float64:
`python bench/window_exactness.py` (CPU, ~2 minutes; prints the worst differences, exit 1 on
a mismatch). A wider sweep than tests/test_window_documents.py, for changes to these paths.

Kernels: `window_attention` ("chunks", "flex" eager; with a DocumentMask "segments" and "flex",
every block sliding or not) and one CP rank's `band_attention` chunks and `context.block_mask`
+ FlexAttention (eager) at cp 1 to 4, every rank, and where the halo pays (`halo_rows`) the
halo layout's (`attend_halo`: the union of the chunks' key ranges, band_attention and
`halo_block_mask`, windows reaching over several chunks too), against SDPA under the dense mask
0 <= i - j < window and same document: sequences 1 to 67 (odd ones too), windows 1 to beyond
the sequence (shorter than a chunk, spanning three chunks), batch 3 with different documents
per row, GQA 6:2. Model: a Gemma-3-style model (sliding / global / sliding, a local RoPE base)
and an all-sliding StarCoder2-style one under cp 2, 3, 4 on real gloo ranks against one
process: logits and all-reduced gradients. Measured (review49, torch 2.13 CPU): kernels 1.3e-15,
logits 8.9e-16, gradients 7.5e-18 (absolute; 3e-15 relative); with halos over several chunks
(halo50): kernels 1.3e-15 (halo band 1.3e-15, halo flex 1.1e-15), logits 8.9e-16, gradients
9.5e-18.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
warnings.filterwarnings("ignore", "flex_attention called without torch.compile")

TOL = 1e-9


def dense(seq: int, window: int, doc, q_pos=None):
    import torch

    i = torch.arange(seq)
    qp = i if q_pos is None else q_pos
    mask = ((qp[:, None] >= i[None, :]) & (qp[:, None] - i[None, :] < window))[None, None]
    return mask if doc is None else mask & (doc[:, None, qp, None] == doc[:, None, None, :])


def random_documents(batch: int, seq: int, g):
    import torch

    doc = torch.zeros(batch, seq, dtype=torch.long)
    for row in range(batch):
        n = int(torch.randint(0, seq // 3 + 1, (1,), generator=g))
        for end in torch.randperm(max(seq - 1, 1), generator=g)[:n].tolist():
            doc[row, end + 1:] += 1
    return doc


def kernels() -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from meshtron.model.attention import band_attention, document_mask, window_attention
    from meshtron.parallel.context import block_mask, chunk_positions, flex_attention
    from meshtron.parallel.cp_halo import halo_rows

    worst: dict[str, float] = {}

    def note(name, got, want):
        worst[name] = max(worst.get(name, 0.0), (got - want).abs().max().item())

    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    for seq in (1, 2, 7, 31, 32, 48, 67):
        for window in (1, 2, 3, 5, 16, 31, 32, 33, 47, 48, 100):
            for b, heads, kv_heads in ((1, 2, 2), (3, 6, 2)):
                q = torch.randn(b, heads, seq, 8, generator=g)
                k, v = (torch.randn(b, kv_heads, seq, 8, generator=g) for _ in range(2))
                for doc in (None, random_documents(b, seq, g)):
                    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(seq, window, doc),
                                                          enable_gqa=True)
                    if doc is None:
                        for kernel in ("chunks", "flex"):
                            note(kernel, window_attention(q, k, v, window, kernel), want)
                    else:
                        note("segments", window_attention(
                            q, k, v, window, mask=document_mask(doc, "segments", window)), want)
                        for every in (False, True):
                            mask = document_mask(doc, "flex", window, every_block_slides=every)
                            note("flex documents", window_attention(q, k, v, window, "flex", mask),
                                 want)
                    for cp in (1, 2, 3, 4):
                        if seq % (2 * cp):
                            continue
                        c = seq // (2 * cp)
                        for rank in range(cp):
                            pos = chunk_positions(seq, cp, rank)
                            chunks = (rank, 2 * cp - 1 - rank)
                            got = torch.cat([band_attention(q[:, :, pos][:, :, i * c:(i + 1) * c],
                                                            k, v, window, j * c, doc)
                                             for i, j in enumerate(chunks)], dim=2)
                            note("cp band", got, want[:, :, pos])
                            blk = block_mask(pos, None if doc is None else doc[:, pos], doc, b,
                                             seq, window)
                            note("cp flex", flex_attention(q[:, :, pos], k, v, blk),
                                 want[:, :, pos])
                            if cp > 1 and halo_rows(seq, cp, window) is not None:
                                halo_kernels(note, q, k, v, doc, want, seq, cp, rank, window)
    return worst


def halo_kernels(note, q, k, v, doc, want, seq, cp, rank, window) -> None:
    """cp_halo.py `attend_halo`'s two paths on one rank's key layout (the union of its chunks
    and the rows before them, sliced from the whole K/V here; the exchange itself runs in the
    model cases): band_attention per chunk over its contiguous keys, and FlexAttention under
    `halo_block_mask`."""
    import torch

    from meshtron.model.attention import band_attention
    from meshtron.model.cp_halo_plan import halo_plan
    from meshtron.parallel.context import chunk_positions, flex_attention
    from meshtron.parallel.cp_halo import halo_block_mask, halo_keys

    pos = chunk_positions(seq, cp, rank)
    plan = halo_plan(seq, cp, rank, window)
    kv_pos = halo_keys(plan)
    kl, vl = k[:, :, kv_pos], v[:, :, kv_pos]
    c = seq // (2 * cp)
    outs = []
    for i in (0, 1):
        first, rows, before = plan.chunk_keys(i)
        keys = kv_pos[first:first + rows]
        outs.append(band_attention(q[:, :, pos[i * c:(i + 1) * c]], kl[:, :, first:first + rows],
                                   vl[:, :, first:first + rows], window, before,
                                   None if doc is None else doc[:, keys]))
    note("cp halo band", torch.cat(outs, dim=2), want[:, :, pos])
    blk = halo_block_mask(pos, kv_pos, None if doc is None else doc[:, pos],
                          None if doc is None else doc[:, kv_pos], window)
    note("cp halo flex", flex_attention(q[:, :, pos], kl, vl, blk), want[:, :, pos])


def _spec(kind: str, window: int):
    from meshtron.model.hf_config import from_hf_dict
    from testkit.hf_dense_ref import TINY

    if kind == "gemma3":
        return from_hf_dict(dict(TINY["gemma3_text"], num_hidden_layers=3, sliding_window=window,
                                 layer_types=["sliding_attention", "full_attention",
                                              "sliding_attention"]))
    return from_hf_dict(dict(TINY["starcoder2"], num_hidden_layers=2, sliding_window=window))


def _run(kind: str, window: int, seq: int, batch: int, documents: bool, cp_group=None):
    """Logits (this rank's positions under CP) and gradients of sum(logits^2) / numel."""
    import torch
    import torch.distributed as dist

    from meshtron.model.transformer import Transformer
    from meshtron.parallel.context import apply_context_parallel, shard_batch

    torch.set_default_dtype(torch.float64)
    spec = _spec(kind, window)
    model = Transformer(spec, init_seed=3).double()
    eos = spec.vocab - 1
    x = torch.randint(0, eos, (batch, seq), generator=torch.Generator().manual_seed(5))
    x[0, [2, 3, 9, 10, 11, 17, 30 % seq]] = eos  # many short documents
    x[1:2, seq // 2 + 1] = eos  # one border
    x[2:3, seq - 1] = eos  # one document
    if documents:
        model.document_eos = eos
    pos = None
    if cp_group is not None:
        cp = apply_context_parallel(model, cp_group)
        shard = shard_batch(x, None, cp.cp, cp.rank)
        x, pos = shard.tokens, shard.positions
    out = model(x)
    (out.pow(2).sum() / (batch * seq * out.shape[-1])).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if cp_group is not None:
        for grad in grads.values():
            dist.all_reduce(grad, group=cp_group)
    return pos, out.detach(), grads


def rank_fn(kind, window, seq, batch, documents):
    import torch.distributed as dist

    return _run(kind, window, seq, batch, documents, dist.group.WORLD)


MODEL_CASES = [("gemma3", 10, 48, 3, True, 4), ("gemma3", 10, 48, 3, False, 4),
               ("gemma3", 7, 48, 3, True, 3), ("gemma3", 1, 32, 2, True, 2),
               ("starcoder2", 10, 48, 3, True, 4), ("starcoder2", 5, 48, 2, True, 2),
               ("gemma3", 60, 48, 2, True, 2), ("starcoder2", 48, 48, 2, True, 2),
               ("gemma3", 7, 48, 3, True, 4),  # halo = a whole chunk of 6
               # halos over several chunks: 19 rows before a query (chunks of 6, cp 4: chunk
               # b's reach rank cp-1's chunk a), 29 (chunks of 8, cp 3), 19 (chunks of 12, cp 2)
               ("gemma3", 20, 48, 3, True, 4), ("starcoder2", 30, 48, 2, True, 3),
               ("gemma3", 20, 48, 2, False, 2)]
"""(kind, window, seq, batch, documents, cp)."""


def models() -> dict[str, float]:
    from testkit.multiproc import run_on_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import window_exactness  # the ranks import rank_fn by module name, not __main__

    worst = {"logits": 0.0, "grad": 0.0}
    for kind, window, seq, batch, documents, cp in MODEL_CASES:
        _, want, grads = _run(kind, window, seq, batch, documents)
        for pos, out, got in run_on_ranks(window_exactness.rank_fn, cp, kind, window, seq, batch, documents,
                                          timeout=300):
            worst["logits"] = max(worst["logits"], (out - want[:, pos]).abs().max().item())
            # absolute: a window of 1 leaves the sliding blocks' q/k gradients at rounding
            worst["grad"] = max(worst["grad"], max((got[n] - g).abs().max().item()
                                                   for n, g in grads.items()))
    return worst


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    worst = {**kernels(), **models()}
    for name, err in worst.items():
        print(f"{name:16s} {err:.1e}")
    return 0 if max(worst.values()) < TOL else 1


if __name__ == "__main__":
    sys.exit(main())
