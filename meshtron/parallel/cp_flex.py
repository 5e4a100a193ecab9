"""FlexAttention for context parallelism's CUDA paths: the block masks of the local queries
against the gathered sequence (`block_mask`: causal, documents, a sliding window), the builder
(`mask_builder`: compiled `create_block_mask` on CUDA) and the call (`flex_attention`: compiled
once per process on CUDA). Shared by parallel/context.py (gathered keys) and
parallel/cp_halo.py (a sliding block's halo keys). No S x S tensor is built: the masks are
`mask_mod` functions evaluated per block.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

BAND_BLOCKS: dict[tuple, Any] = {}
"""Band block masks without documents (they depend on the shapes only), per (seq, cp, rank,
window[, "halo"], device): built once per process and shared by every layer and step."""


def block_mask(q_pos: torch.Tensor, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None,
               batch: int, seq: int, window: int = 0):
    """FlexAttention block mask of the local queries (global positions `q_pos`) against the
    whole sequence: causal, inside each document when document ids are given, and within the
    last `window` keys with a window. Blocks the mask empties are skipped (the causal half of
    the work on average, all but the band with a window; no S x S tensor)."""
    kv_pos = torch.arange(seq, device=q_pos.device)
    return positions_block_mask(q_pos, kv_pos, q_doc, kv_doc, window, batch)


def positions_block_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, q_doc: torch.Tensor | None,
                         kv_doc: torch.Tensor | None, window: int = 0, batch: int | None = None):
    """FlexAttention block mask of queries at global positions `q_pos` against keys at
    `kv_pos` (each position once: the gathered sequence, or a halo's key layout): causal on
    positions, within the last `window` of them (0: the whole causal prefix), inside documents
    with document ids (q_doc [b, queries], kv_doc [b, keys]).

    One `mask_mod` code for every window, global blocks included: the window is a 0-d tensor
    the mask reads, not a Python number in its closure. FlexAttention's dynamo trace guards
    on a closure's numbers (one compiled kernel per window: a model mixing sliding and global
    blocks compiled two, eager CPU FlexAttention traced again per window) and only on a
    tensor's shape and dtype. `new_full` fills it on the device: no host-to-device copy."""
    reach = q_pos.new_full((), window if window else kv_pos.numel())
    if q_doc is None:
        mask_mod, batch = _band_mask(q_pos, kv_pos, reach), None
    else:
        mask_mod, batch = _band_document_mask(q_pos, kv_pos, reach, q_doc, kv_doc), q_doc.shape[0]
    build = mask_builder(q_pos.device)
    return build(mask_mod, batch, None, q_pos.numel(), kv_pos.numel(), device=q_pos.device)


def _band_mask(q_pos, kv_pos, reach) -> Callable:
    def band(b, h, q_idx, kv_idx):
        gap = q_pos[q_idx] - kv_pos[kv_idx]
        return (gap >= 0) & (gap < reach)

    return band


def _band_document_mask(q_pos, kv_pos, reach, q_doc, kv_doc) -> Callable:
    band = _band_mask(q_pos, kv_pos, reach)

    def band_document(b, h, q_idx, kv_idx):
        return band(b, h, q_idx, kv_idx) & (q_doc[b, q_idx] == kv_doc[b, kv_idx])

    return band_document


def mask_builder(device: torch.device) -> Callable:
    """`create_block_mask`, compiled on CUDA (the process-wide one model/attention.py uses
    for document masks), eager elsewhere (a reference path)."""
    if device.type == "cuda":
        from meshtron.model.attention import _compiled

        return _compiled("create_block_mask")
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask


_FLEX: dict[str, Callable] = {}


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Any) -> torch.Tensor:
    """FlexAttention with `block` (compiled once per process on CUDA, as torchtitan does; eager
    elsewhere, a reference path without backward on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if q.is_cuda and "cuda" not in _FLEX:
        _FLEX["cuda"] = torch.compile(flex)
    return _FLEX.get("cuda" if q.is_cuda else "", flex)(q, k, v, block_mask=block,
                                                         enable_gqa=True)
