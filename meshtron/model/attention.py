"""The attention core: causal scaled-dot-product attention with native grouped-query attention,
and document masks for packed sequences that never build an S x S tensor.

- Causal: `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`: SDPA reads each
  key/value head for its group of query heads itself (flash / memory-efficient kernels on CUDA),
  so K/V are never copied `heads/kv_heads` times (`repeat_interleave` did).
- Documents on CUDA: FlexAttention (Dong et al. 2024, `torch.nn.attention.flex_attention`) with a
  block mask built from the tokens' document ids, compiled as torchtitan does: blocks outside
  every document are skipped, the rest run in a fused kernel; no dense mask, no host sync.
- Documents elsewhere (CPU): FlexAttention has no CPU backward in torch 2.13 ("FlexAttention
  does not support backward on CPU"), so each document runs as its own causal SDPA call on its
  slice of the packed row (the variable-length idea of FlashAttention-2's `cu_seqlens`, as a
  loop). Exact: a token's softmax runs over the same keys as with the dense mask. Memory is the
  longest document's square, never the sequence's.
- Sliding windows (`window_attention`), with or without documents: query i sees key j iff
  0 <= i - j < window (and, packed, both in one document). CUDA: a FlexAttention block mask of
  the band (of band and documents: built with the document mask, once per forward, shared by
  the sliding blocks); elsewhere `band_attention`: the queries in chunks of `window`, each
  against the at most 2 x window - 1 keys its band reaches, masked by band and document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DocumentMask:
    """Which keys each query of a packed batch may attend to: earlier tokens of its document.
    Built once per forward (`document_mask`) and shared by every layer."""

    __slots__ = ("doc", "segments", "block_mask", "window_block_mask", "positions")

    def __init__(self, doc: torch.Tensor, segments: list[list[tuple[int, int]]] | None,
                 block_mask=None, window_block_mask=None,
                 positions: torch.Tensor | None = None):
        self.doc = doc
        """[batch, seq] document index of every token (0, 1, ... along each row)."""
        self.segments = segments
        """CPU path: per batch row, the (start, end) token range of each document."""
        self.block_mask = block_mask
        """CUDA path: FlexAttention's BlockMask for the document-causal mask."""
        self.window_block_mask = window_block_mask
        """CUDA path with a window: the BlockMask of band and documents together."""
        self.positions = positions
        """[batch, seq] each token's position inside its document (Gemma 3's sliding blocks
        rotate by it with a RoPE table of their own); None where not given."""

    def dense(self) -> torch.Tensor:
        """The boolean [batch, 1, seq, seq] mask this stands for (tests and debugging only)."""
        seq = self.doc.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=self.doc.device).tril()
        return ((self.doc[:, :, None] == self.doc[:, None, :]) & causal)[:, None]


def document_mask(doc: torch.Tensor, kernel: str | None = None, window: int = 0,
                  positions: torch.Tensor | None = None,
                  every_block_slides: bool = False) -> DocumentMask:
    """The mask of document ids `doc` [batch, seq]. `kernel`: "flex" (default on CUDA) or
    "segments" (default elsewhere). `window`: the sliding blocks' window (0: none); on the
    flex path its block mask (band and documents) is built here too, once per forward, and
    the plain one only where some block attends globally (not `every_block_slides`:
    Mistral's)."""
    kernel = kernel or ("flex" if doc.is_cuda else "segments")
    window = window if window and doc.shape[1] > window else 0  # else the band is causal
    if kernel == "flex":
        plain = None if window and every_block_slides else _flex_block_mask(doc)
        return DocumentMask(doc, None, plain, _flex_block_mask(doc, window) if window else None,
                            positions)
    if kernel != "segments":
        raise ValueError(f"kernel={kernel!r}: expected 'flex' or 'segments'")
    # One device->host copy per forward; only on the CPU path, where it costs nothing.
    rows = []
    for row in doc.cpu():
        _, counts = torch.unique_consecutive(row, return_counts=True)
        ends = counts.cumsum(0).tolist()
        rows.append(list(zip([0] + ends[:-1], ends)))
    return DocumentMask(doc, rows, None, None, positions)


_COMPILED: dict[str, object] = {}


def _compiled(name: str):
    """FlexAttention and its block-mask builder compiled once per process: eager FlexAttention
    materialises the scores (a debugging path); compiled, it is a fused kernel (torchtitan
    compiles both the same way)."""
    fn = _COMPILED.get(name)
    if fn is None:
        from torch.nn.attention import flex_attention as fa

        fn = _COMPILED[name] = torch.compile(getattr(fa, name))
    return fn


def _flex_block_mask(doc: torch.Tensor, window: int = 0):
    """The document-causal BlockMask of `doc`; with `window`, of the band inside documents.
    One `mask_mod` code for both, the window a 0-d tensor it reads (the sequence for
    document-causal): FlexAttention's trace guards on a closure's numbers but only on a
    tensor's shape, so a model's global and sliding blocks share one compiled kernel
    (parallel/cp_flex.py `positions_block_mask` does the same under context parallelism)."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, seq = doc.shape
    reach = doc.new_full((), window if window else seq)

    def document_band(b, h, q_idx, kv_idx):
        gap = q_idx - kv_idx
        return (doc[b, q_idx] == doc[b, kv_idx]) & (gap >= 0) & (gap < reach)

    build = _compiled("create_block_mask") if doc.is_cuda else create_block_mask
    return build(document_band, bsz, None, seq, seq, device=doc.device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: DocumentMask | None = None) -> torch.Tensor:
    """q [batch, heads, seq, hd], k/v [batch, kv_heads, seq, hd] (heads a multiple of
    kv_heads) -> [batch, heads, seq, hd]; causal, or document-causal with `mask`."""
    # A branch, not the comparison itself: under torch.compile with dynamic shapes (a second
    # shape recompiles the blocks dynamically) the comparison is a SymBool, which SDPA's
    # `enable_gqa` refuses; branching on it makes dynamo guard and pass a plain bool.
    gqa = True if q.shape[1] != k.shape[1] else False
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask.block_mask is not None:
        flex = _compiled("flex_attention") if q.is_cuda else _eager_flex()
        return flex(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)
    return _segment_attention(q, k, v, mask.segments, gqa)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     window: int, kernel: str | None = None,
                     mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal sliding-window attention (Mistral, StarCoder2, Gemma's sliding blocks): query i
    attends to keys i - window + 1 .. i (transformers' sliding-window mask); with `mask`
    (packed documents) only to those of its own document. Shapes as `attention`. CUDA:
    FlexAttention with the window's block mask (the tiles outside the band are skipped, as
    FlashAttention's local attention does; with documents the mask's own band-and-document
    block mask). Elsewhere `band_attention`: exact (every softmax over the same keys), never
    an S x S tensor. `kernel`: "flex" (default on CUDA) or "chunks" (default elsewhere; "flex"
    runs eagerly off CUDA, forward only, so tests check the CUDA branch's mask on CPU); with
    documents the mask's kernel decides (`document_mask`)."""
    gqa = True if q.shape[1] != k.shape[1] else False
    seq = q.shape[2]
    kernel = kernel or ("flex" if q.is_cuda else "chunks")
    if kernel not in ("flex", "chunks"):
        raise ValueError(f"kernel={kernel!r}: expected 'flex' or 'chunks'")
    if seq <= window:  # the band covers the whole causal prefix
        return attention(q, k, v, mask)
    if mask is not None:
        if mask.window_block_mask is not None:
            flex = _compiled("flex_attention") if q.is_cuda else _eager_flex()
            return flex(q, k, v, block_mask=mask.window_block_mask, enable_gqa=gqa)
        return band_attention(q, k, v, window, doc=mask.doc)
    if kernel == "flex":
        flex = _compiled("flex_attention") if q.is_cuda else _eager_flex()
        return flex(q, k, v, block_mask=_window_block_mask(seq, window, q.device),
                    enable_gqa=gqa)
    return band_attention(q, k, v, window)


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   q_start: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
    """Exact sliding-window attention of the queries at positions q_start .. q_start + n - 1
    (q [b, heads, n, hd]) against keys at positions 0 .. (k, v [b, kv_heads, >= q_start + n,
    hd]; a context-parallel rank's chunk against the gathered sequence, or the whole
    sequence): the queries in chunks of `window`, each against the at most 2 x window - 1
    keys its band reaches with a [window, 2 x window - 1] mask (band, and same document where
    `doc` [b, >= q_start + n] gives the keys' document ids). Every query sees itself, so no
    row is empty. Never an S x S tensor; the keys no chunk reaches get no gradient."""
    gqa = True if q.shape[1] != k.shape[1] else False
    parts = []
    for s in range(0, q.shape[2], window):
        e = min(s + window, q.shape[2])
        lo, hi = q_start + s, q_start + e  # the chunk's positions
        first = max(0, lo - window + 1)
        qi = torch.arange(lo, hi, device=q.device)[:, None]
        kj = torch.arange(first, hi, device=q.device)[None, :]
        mask = (kj <= qi) & (qi - kj < window)
        if doc is not None:  # [b, 1, chunk, keys]
            mask = mask & (doc[:, None, lo:hi, None] == doc[:, None, None, first:hi])
        parts.append(F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, first:hi], v[:, :, first:hi], attn_mask=mask,
            enable_gqa=gqa))
    return torch.cat(parts, dim=2)


_WINDOW_MASKS: dict[tuple, object] = {}


def _window_block_mask(seq: int, window: int, device: torch.device):
    """The sliding-window BlockMask of (seq, window) on `device`, built once per process and
    shared by every block and step (it depends on the shapes only)."""
    key = (seq, window, str(device))
    mask = _WINDOW_MASKS.get(key)
    if mask is None:
        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        build = _compiled("create_block_mask") if device.type == "cuda" else \
            _eager_block_mask()
        mask = _WINDOW_MASKS[key] = build(sliding, None, None, seq, seq, device=device)
    return mask


def _eager_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _segment_attention(q, k, v, segments, gqa: bool) -> torch.Tensor:
    rows = []
    for b, row in enumerate(segments):
        if len(row) == 1:  # one document: the plain causal kernel on the whole row
            rows.append(F.scaled_dot_product_attention(
                q[b:b + 1], k[b:b + 1], v[b:b + 1], is_causal=True, enable_gqa=gqa))
            continue
        parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                                v[b:b + 1, :, s:e], is_causal=True,
                                                enable_gqa=gqa)
                 for s, e in row]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
