"""Context parallelism's sliding-window halos: a sliding block (Mistral, Gemma 3's sliding
blocks, StarCoder2) whose query i sees the keys i - window + 1 .. i gathers nothing; each rank
fetches only the rows before its chunks that their windows reach.

A query of chunk j reaches keys [jc - window + 1, (j+1)c), its own chunk and the last
window - 1 rows of chunk j-1. Where those fit in one chunk (window - 1 <= c, `halo_rows`) each
rank sends the tails of its two chunks to the ranks holding the next chunks (`exchange_halos`,
one all_to_all of K and V between neighbours) and attends over [halo, chunk] per chunk
(`attend_halo`): 2(w-1) rows moved and seq/cp + 2(w-1) kept per rank instead of
(cp-1)/cp x seq received and seq kept (at 128k tokens, cp 8, Gemma 3's window of 1024: 2046
rows received instead of 114688, 18430 kept instead of 131072). The document ids of the halo
rows are read from the ids already gathered once per forward (parallel/context.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from meshtron.model.attention import band_attention
from meshtron.parallel.cp_flex import BAND_BLOCKS, flex_attention, mask_builder


def halo_attend(group, cp: int, rank: int, window: int, halo: int, pos: torch.Tensor,
                q_doc, kv_doc, seq: int, flex: bool) -> Callable:
    """The sliding blocks' attention over this rank's chunks and their halos
    (`attend_halo`); `flex` with the block mask of the local keys (per forward with
    documents, kept per shape without)."""
    block = None
    key = (seq, cp, rank, window, "halo", str(pos.device))
    if flex and (q_doc is not None or key not in BAND_BLOCKS):
        kv_pos, kv_seg = halo_keys(seq, cp, rank, halo, pos.device)
        if q_doc is not None:  # the halo rows' document ids: from the gathered ids
            block = halo_block_mask(pos, kv_pos, kv_seg, q_doc, kv_doc[:, kv_pos], window)
        else:
            BAND_BLOCKS[key] = halo_block_mask(pos, kv_pos, kv_seg, None, None, window)
    if flex and q_doc is None:
        block = BAND_BLOCKS[key]
    return partial(attend_halo, group=group, cp=cp, rank=rank, window=window, halo=halo,
                   kv_doc=kv_doc, block=block)


def attend_halo(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int, rank: int,
                window: int, halo: int, kv_doc: torch.Tensor | None = None,
                block: Any = None) -> torch.Tensor:
    """Sliding-window attention of the local queries against their own chunks and the
    `halo` keys before each (`exchange_halos`): the band's exact CPU path per chunk
    (`band_attention` with the chunk's first query at row `halo` of its keys), or `block`
    (CUDA) the band's FlexAttention block mask over [halo a, chunk a, halo b, chunk b]."""
    c = q.shape[2] // 2
    kv = torch.cat([k, v], dim=3)  # one exchange for K and V (their head sizes may differ)
    halo_a, halo_b = exchange_halos(kv, group, cp, rank, halo)
    keys = [torch.cat([halo_a, kv[:, :, :c]], 2), torch.cat([halo_b, kv[:, :, c:]], 2)]
    dk = k.shape[3]
    if block is not None:
        both = torch.cat(keys, 2)
        return flex_attention(q, both[..., :dk], both[..., dk:], block)
    outs = []
    for i, (chunk, kv_i) in enumerate(zip((rank, 2 * cp - 1 - rank), keys)):
        before = kv_i.shape[2] - c  # halo rows (none before chunk 0)
        doc = None if kv_doc is None else kv_doc[:, chunk * c - before:(chunk + 1) * c]
        outs.append(band_attention(q[:, :, i * c:(i + 1) * c], kv_i[..., :dk],
                                   kv_i[..., dk:], window, before, doc))
    return torch.cat(outs, dim=2)


def halo_rows(seq: int, cp: int, window: int) -> int | None:
    """Keys a sliding block's chunk needs from before its start (window - 1), or None where
    they reach past the previous chunk (window - 1 > c = seq / 2cp): then the whole sequence
    is gathered instead (a halo from several chunks and ranks is not worth its bookkeeping
    at such short chunks)."""
    return window - 1 if window - 1 <= seq // (2 * cp) else None


def exchange_halos(x: torch.Tensor, group, cp: int, rank: int,
                   halo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the `halo` rows before chunk a, those before chunk b) of this rank's chunks a = rank,
    b = 2cp-1-rank, from x [b, heads, 2c, d] on every rank. Chunk j's halo is the tail of
    chunk j-1: chunk a's comes from rank-1's first chunk (none for rank 0: chunk 0 starts the
    sequence); chunk b's from rank+1's second chunk, or for rank cp-1 (b = cp) from its own
    first chunk. So each rank sends its tails to its neighbours: one all_to_all_single of
    known split sizes (no host sync), differentiable (backward returns each halo's gradient to
    the rank that owns its rows: torch's `all_to_all_single_autograd`)."""
    from meshtron.torch_compat import require

    exchange = require("torch.distributed._functional_collectives.all_to_all_single_autograd",
                       "context parallelism's halo exchange")
    c = x.shape[2] // 2
    sent, received = [0] * cp, [0] * cp  # rows per destination / source rank
    tails = []
    if rank > 0:  # the tail of chunk b goes to rank-1 (its chunk b + 1 = 2cp-rank)
        tails.append(x[:, :, 2 * c - halo:])
        sent[rank - 1] = halo
        received[rank - 1] = halo  # rank-1's tail of chunk a = rank-1
    tails.append(x[:, :, c - halo:c])  # the tail of chunk a, to the holder of chunk rank+1
    sent[min(rank + 1, cp - 1)] += halo
    received[min(rank + 1, cp - 1)] += halo
    # sequence first: all_to_all_single splits dim 0
    send = torch.cat(tails, dim=2).permute(2, 0, 1, 3).contiguous()
    got = exchange(send, received, sent, group).permute(1, 2, 0, 3)
    first = halo if rank > 0 else 0
    return got[:, :, :first], got[:, :, first:]


def halo_keys(seq: int, cp: int, rank: int, halo: int,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(global positions, local chunk 0 / 1) of the keys `attend_halo` lays out:
    [halo a, chunk a, halo b, chunk b]. The chunk index keeps a query to its own chunk's keys:
    rank cp-1's halo b repeats the tail of its chunk a."""
    c = seq // (2 * cp)
    parts = [torch.arange(max(0, j * c - halo), (j + 1) * c, device=device)
             for j in (rank, 2 * cp - 1 - rank)]
    seg = torch.cat([torch.full_like(p, i) for i, p in enumerate(parts)])
    return torch.cat(parts), seg


def halo_block_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, kv_seg: torch.Tensor,
                    q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, window: int):
    """FlexAttention block mask of the local queries (global positions `q_pos`: chunk a then
    chunk b) against the keys at `kv_pos` (`halo_keys`): the band, inside the query's own
    chunk's keys (`kv_seg`), and inside documents with document ids (kv_doc [b, keys])."""
    c = q_pos.numel() // 2

    def band(q_idx, kv_idx):
        gap = q_pos[q_idx] - kv_pos[kv_idx]
        return (gap >= 0) & (gap < window) & (q_idx // c == kv_seg[kv_idx])

    if q_doc is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return band(q_idx, kv_idx)
        batch = None
    else:
        batch = q_doc.shape[0]

        def mask_mod(b, h, q_idx, kv_idx):
            return band(q_idx, kv_idx) & (q_doc[b, q_idx] == kv_doc[b, kv_idx])
    build = mask_builder(q_pos.device)
    return build(mask_mod, batch, None, q_pos.numel(), kv_pos.numel(), device=q_pos.device)
