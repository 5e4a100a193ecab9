"""Context parallelism's sliding-window halos: a sliding block (Mistral, Gemma 3's sliding
blocks, StarCoder2) whose query i sees the keys i - window + 1 .. i gathers nothing; each rank
fetches only the rows before its chunks that their windows reach.

The queries of chunk j (c = seq / 2cp rows) reach the keys [jc - window + 1, (j+1)c): their
own chunk and the window - 1 rows before it, which for a window longer than a chunk lie in
several chunks held by several ranks. Which rows, from where, in which order, is host
arithmetic shared with the planner (model/cp_halo_plan.py `halo_plan`); here one
all_to_all_single of K and V side by side moves them (`exchange_halos`: split sizes known on
every rank, no host sync; differentiable, its backward returns each row's gradient to the rank
holding it), and each rank attends over its key layout, the union of its two chunks' key
ranges in global order (`attend_halo`: the band's exact CPU path per chunk, or on CUDA one
FlexAttention call under the band's block mask, `halo_block_mask`). At 128k tokens, cp 8 and
Gemma 3's window of 1024 the fullest rank receives 2046 rows instead of 114688 and keeps 18430
instead of 131072; at 32k tokens, cp 8 and a window of 4096 (two chunks), 8190 instead of
28672 and 12286 instead of 32768. `halo_rows` says where the halo pays. The halo rows'
document ids are read from the ids already gathered once per forward (parallel/context.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from meshtron.model.attention import band_attention
from meshtron.model.cp_halo_plan import HaloPlan, halo_plan, halo_rows, local_row, rank_chunks
from meshtron.parallel.cp_flex import BAND_BLOCKS, flex_attention, positions_block_mask

__all__ = ["attend_halo", "exchange_halos", "halo_attend", "halo_block_mask", "halo_keys",
           "halo_rows"]


def halo_attend(group, cp: int, rank: int, window: int, pos: torch.Tensor, q_doc, kv_doc,
                seq: int, flex: bool) -> Callable:
    """The sliding blocks' attention over this rank's chunks and the rows before them
    (`attend_halo`); `flex` with the block mask of the key layout (per forward with
    documents, kept per shape without)."""
    plan = halo_plan(seq, cp, rank, window)
    block = None
    key = (seq, cp, rank, window, "halo", str(pos.device))
    if flex and (q_doc is not None or key not in BAND_BLOCKS):
        kv_pos = halo_keys(plan, pos.device)
        if q_doc is not None:  # the halo rows' document ids: from the gathered ids
            block = halo_block_mask(pos, kv_pos, q_doc, kv_doc[:, kv_pos], window)
        else:
            BAND_BLOCKS[key] = halo_block_mask(pos, kv_pos, None, None, window)
    if flex and q_doc is None:
        block = BAND_BLOCKS[key]
    return partial(attend_halo, group=group, plan=plan, window=window, kv_doc=kv_doc,
                   block=block)


def attend_halo(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, plan: HaloPlan,
                window: int, kv_doc: torch.Tensor | None = None,
                block: Any = None) -> torch.Tensor:
    """Sliding-window attention of the local queries (chunk a, then chunk b) against the key
    layout `exchange_halos` assembles: per chunk the band's exact CPU path (`band_attention`
    over the chunk's contiguous keys, its first query at row `before`), or `block` (CUDA) the
    band's FlexAttention block mask over the whole layout."""
    kv = torch.cat([k, v], dim=3)  # one exchange for K and V (their head sizes may differ)
    keys = exchange_halos(kv, group, plan)
    dk = k.shape[3]
    if block is not None:
        return flex_attention(q, keys[..., :dk], keys[..., dk:], block)
    c = plan.c
    outs = []
    for i, chunk in enumerate(rank_chunks(plan.cp, plan.rank)):
        first, rows, before = plan.chunk_keys(i)
        kv_i = keys[:, :, first:first + rows]
        doc = None if kv_doc is None else kv_doc[:, chunk * c - before:(chunk + 1) * c]
        outs.append(band_attention(q[:, :, i * c:(i + 1) * c], kv_i[..., :dk],
                                   kv_i[..., dk:], window, before, doc))
    return torch.cat(outs, dim=2)


def _runs(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(source, first row, rows) pieces with the contiguous ones of one source merged: fewer
    slices to copy."""
    out: list[list[int]] = []
    for src, start, rows in pieces:
        if out and out[-1][0] == src and out[-1][1] + out[-1][2] == start:
            out[-1][2] += rows
        else:
            out.append([src, start, rows])
    return [(s, a, n) for s, a, n in out]


def exchange_halos(x: torch.Tensor, group, plan: HaloPlan) -> torch.Tensor:
    """This rank's key layout [b, heads, plan.key_rows(), d] from x [b, heads, 2c, d] (its
    chunks a, b) on every rank: the union of its chunks' key ranges in global order, its own
    rows read locally, the others' received in one all_to_all_single of the split sizes
    `plan` gives (the same host integers on every rank: no host sync), differentiable
    (torch's `all_to_all_single_autograd`: backward returns each row's gradient to the rank
    holding it). A window of one needs nothing from anyone: no collective (every rank sees
    the same window)."""
    if plan.halo == 0:
        return x
    from meshtron.torch_compat import require

    exchange = require("torch.distributed._functional_collectives.all_to_all_single_autograd",
                       "context parallelism's halo exchange")
    # sequence first: all_to_all_single splits dim 0
    rows = [(plan.rank, local_row(lo, plan.c, plan.cp, plan.rank), hi - lo)
            for _, lo, hi in plan.send]  # by destination, each destination's in its order
    send = torch.cat([x[:, :, a:a + n] for _, a, n in _runs(rows)], dim=2)
    got = exchange(send.permute(2, 0, 1, 3).contiguous(), list(plan.recv_sizes),
                   list(plan.send_sizes), group).permute(1, 2, 0, 3)
    parts = [(x if src == plan.rank else got)[:, :, a:a + n]
             for src, a, n in _runs(list(plan.recv_pieces()))]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def halo_keys(plan: HaloPlan, device=None) -> torch.Tensor:
    """Global positions of the keys `exchange_halos` lays out (each once, ascending)."""
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in plan.keys])


def halo_block_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, q_doc: torch.Tensor | None,
                    kv_doc: torch.Tensor | None, window: int):
    """FlexAttention block mask of the local queries (global positions `q_pos`: chunk a then
    chunk b) against the keys at `kv_pos` (`halo_keys`: every position once, so the band on
    positions alone keeps a query to its own keys), inside documents with document ids
    (kv_doc [b, keys]): cp_flex's mask over positions (one traced mask for every window)."""
    return positions_block_mask(q_pos, kv_pos, q_doc, kv_doc, window)
