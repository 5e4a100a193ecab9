"""Context parallelism: every sequence split over `cp` ranks, attention over the whole sequence.

Which implementation, and why: all-gather K/V, as Llama 3 trained its long-context stage
(Dubey et al. 2024, section 3.3.2), on torch.distributed's functional collectives. PyTorch's own
`torch.distributed.tensor.experimental.context_parallel` (ring attention) was tried first on
PyTorch 2.13: on CPU/gloo it fails (`aten._scaled_dot_product_flash_attention_for_cpu` has no
DTensor sharding strategy), and it works by replacing `F.scaled_dot_product_attention`
process-wide, which this project does not do. The all-gather is the better fit anyway for
grouped-query attention: K and V have kv_heads heads (8 for Llama 3 70B/405B, against 64/128
query heads), so gathering them moves 2 * seq * kv_dim elements per layer, a fraction of the
attention FLOPs' time, and it supports any mask (documents) without ring bookkeeping; backward
reduce-scatters dK and dV (the autograd of `all_gather_single`).

Causal load balancing (Llama 3; torchtitan's "head-tail" sharding): each sequence is cut into
2*cp chunks and rank r holds chunks r and 2*cp-1-r, so every rank has the same amount of causal
attention work. RoPE uses the tokens' global positions (`chunk_positions`).

Without documents, each local query chunk (global chunk j of size c) sees the gathered keys
[0, jc) fully and the square block [jc, (j+1)c) causally: SDPA's flash kernels with no mask
(`is_causal=True` on the diagonal block, nothing on the prefix), merged by their log-sum-exp
(cp_sdpa.py; the split torch's own ring attention makes). It traces under
`torch.compile(fullgraph=True)` (tested with aot_eager and inductor), which SDPA's lower-right
causal bias over the whole prefix, tried earlier, did not on torch 2.13; FlexAttention with a
causal block mask (~2 GB built eagerly at 128k tokens over cp=8) was used in between. Where the flash kernels do not apply (fp32 on CUDA,
head sizes that are not a multiple of 8) the exact boolean-mask path below runs.

Document masks: the document ids come from the gathered token ids (one small all-gather of ints
per forward, reusing `document_positions`); on CUDA the mask is a FlexAttention block mask built
by the compiled `create_block_mask` from a `mask_mod` (no S x S tensor), once per forward (the
ids change every batch) and shared by every layer; on CPU, where FlexAttention has no backward,
an exact boolean mask per query chunk ([chunk, prefix]).

Sliding windows (Mistral, Gemma 3's sliding blocks, StarCoder2): query i sees the keys
i - window + 1 .. i (inside its document, with documents). The sliding blocks get an attention
function of their own (`AttentionContext.window_attend`): on CUDA a FlexAttention block mask of
the band (and documents) over the gathered keys, built once per forward with the document
masks (without documents it depends on the shapes only and is kept), so the tiles outside the
band are skipped, as Transformer Engine's all-gather context parallelism runs its windowed
kernel on each rank's chunks; on CPU `band_attention` (model/attention.py): each local chunk's
queries in chunks of the window against the at most 2 x window - 1 gathered keys they reach,
with an exact boolean mask. The global blocks keep the paths above. Gemma 3's sliding blocks
rotate with a table of their own at the tokens' `positions`.

Halos: where the window is short enough a sliding block gathers nothing; each rank fetches
only the rows before its chunks that their windows reach (parallel/cp_halo.py).

Use: `apply_context_parallel(model, group)` sets `model.context_parallel`; the model's forward
then takes this rank's chunks (`shard_batch`) and its attention calls `ContextParallel.attend`.
The loss of a rank is the mean over its tokens; the global mean is the mean over the cp ranks
(every rank holds the same number of tokens), and the gradients are summed over the cp group
(FSDP over dp_shard x cp does it in a full run).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from meshtron.errors import UserError
from meshtron.model.attention import band_attention
from meshtron.parallel.cp_flex import BAND_BLOCKS, block_mask, flex_attention
from meshtron.parallel.cp_halo import halo_attend, halo_rows
from meshtron.parallel.cp_sdpa import chunk_attention, kernel_for


def check_sequence(seq_len: int, cp: int) -> None:
    """The sequence must split into 2*cp equal chunks."""
    if seq_len % (2 * cp):
        raise UserError(f"data.seq_len={seq_len}: context parallelism cp={cp} cuts every "
                         f"sequence into 2*cp={2 * cp} equal chunks; use a multiple of {2 * cp}")


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [seq_len / cp] of the tokens rank `rank` holds: chunks `rank` and
    2*cp-1-rank of 2*cp."""
    check_sequence(seq_len, cp)
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * c])


@dataclass(frozen=True)
class Shard:
    """One cp rank's part of a batch."""

    tokens: torch.Tensor
    """[batch, seq/cp] token ids of this rank's two chunks."""
    targets: torch.Tensor | None
    """[batch, seq/cp] next-token targets of the same positions."""
    positions: torch.Tensor
    """[seq/cp] global positions of these tokens (what RoPE rotates by without documents)."""


def shard_batch(tokens: torch.Tensor, targets: torch.Tensor | None, cp: int, rank: int) -> Shard:
    """This cp rank's chunks of a full batch ([batch, seq] each)."""
    pos = chunk_positions(tokens.shape[1], cp, rank, tokens.device)
    return Shard(tokens[:, pos], None if targets is None else targets[:, pos], pos)


def _to_global(gathered: torch.Tensor, cp: int, seq_dim: int) -> torch.Tensor:
    """[cp * d0, ...] gathered in rank order (each rank: its chunks r, 2cp-1-r along `seq_dim`)
    -> the sequence in global order along `seq_dim`."""
    per_rank = gathered.chunk(cp, dim=0)
    heads = [t.chunk(2, dim=seq_dim)[0] for t in per_rank]
    tails = [t.chunk(2, dim=seq_dim)[1] for t in reversed(per_rank)]
    return torch.cat(heads + tails, dim=seq_dim)


def _gather_sequence(x: torch.Tensor, group, cp: int, seq_dim: int) -> torch.Tensor:
    """All-gather of x over the cp group along the sequence, in global order; differentiable
    (backward: reduce-scatter of the gradient)."""
    from meshtron.torch_compat import functional_all_gather

    g = functional_all_gather(x.contiguous(), 0, group)
    return _to_global(g, cp, seq_dim)


@dataclass
class AttentionContext:
    """What the model's attention needs under context parallelism, for one forward."""

    angles: torch.Tensor | None
    """RoPE cos/sin rows of this rank's tokens: [2, seq/cp, hd] or [2, batch, seq/cp, hd]."""
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(q [b, h, seq/cp, d], local k, v [b, kv_heads, seq/cp, d]) -> out [b, h, seq/cp, d]."""
    window_attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """The same for the sliding blocks (cp_halo.attend_halo where the halo pays, `halo_rows`,
    else attend_window over the whole gathered sequence); None where no block
    slides or the sequence fits in the window (then the band is causal attention)."""
    positions: torch.Tensor | None = None
    """RoPE positions of this rank's tokens: [seq/cp] global, or [batch, seq/cp] inside their
    documents (the rows a second RoPE table is read at: Gemma 3's sliding blocks). Under the
    document mask the logits are the same either way (RoPE scores depend on i - j, and both
    lie in one document); in-document positions keep the table within a document's length."""
    seq: int = 0
    """The whole sequence's length."""


class ContextParallel:
    """Context parallelism over one process group, attached as `model.context_parallel`."""

    def __init__(self, group, cp: int | None = None, rank: int | None = None):
        import torch.distributed as dist

        self.group = group
        self.cp = dist.get_world_size(group) if cp is None else cp
        self.rank = dist.get_rank(group) if rank is None else rank
        self.kernel: str | None = None
        """None: by device (FlexAttention block masks for documents and windows on CUDA,
        exact masks elsewhere); "flex": the block masks off CUDA too (eager, forward only), so
        tests run what a GPU runs, layer by layer, on CPU."""

    def chunks(self) -> tuple[int, int]:
        """The global indices of this rank's two chunks (of 2*cp)."""
        return self.rank, 2 * self.cp - 1 - self.rank

    def context(self, tokens: torch.Tensor, model: Any) -> AttentionContext:
        """The attention context of one forward of `model` on this rank's `tokens` ([b, seq/cp]
        ids, or hidden states on a later pipeline stage)."""
        seq = tokens.shape[1] * self.cp
        pos = chunk_positions(seq, self.cp, self.rank, tokens.device)
        table = model.rope_for(seq)
        q_doc = kv_doc = None
        if model.document_eos is None:
            rope_pos = pos
        else:
            from meshtron.model.transformer import document_positions
            from meshtron.torch_compat import functional_all_gather

            full = _to_global(functional_all_gather(tokens.contiguous(), 0, self.group),
                              self.cp, 1)
            kv_doc, doc_pos = document_positions(full, model.document_eos)
            q_doc = kv_doc[:, pos]
            rope_pos = doc_pos[:, pos]
        angles = table[:, rope_pos] if table is not None else None
        spec = model.spec
        window = spec.sliding_window if spec.sliding_blocks and seq > spec.sliding_window else 0
        flex = tokens.is_cuda or self.kernel == "flex"
        block = None  # FlexAttention: each block mask shared by every layer using it
        if flex and q_doc is not None and not (window and spec.sliding_blocks == spec.layers):
            block = block_mask(pos, q_doc, kv_doc, tokens.shape[0], seq)
        return AttentionContext(angles, partial(self.attend, q_doc=q_doc, kv_doc=kv_doc,
                                                block=block),
                                self._window_attend(window, pos, q_doc, kv_doc, seq, flex),
                                rope_pos, seq)

    def _window_attend(self, window: int, pos: torch.Tensor, q_doc, kv_doc, seq: int,
                       flex: bool):
        """The sliding blocks' attention function of one forward (None without a window).
        `flex` (CUDA) with the band's block mask: with documents built per forward (the ids
        change every batch), without them kept per shape (as model/attention.py keeps the
        one-process band's)."""
        if not window:
            return None
        if halo_rows(seq, self.cp, window) is not None:
            return halo_attend(self.group, self.cp, self.rank, window, pos, q_doc, kv_doc, seq,
                               flex)
        block = None
        if flex and q_doc is not None:
            block = block_mask(pos, q_doc, kv_doc, q_doc.shape[0], seq, window)
        elif flex:
            key = (seq, self.cp, self.rank, window, str(pos.device))
            if key not in BAND_BLOCKS:
                BAND_BLOCKS[key] = block_mask(pos, None, None, 1, seq, window)
            block = BAND_BLOCKS[key]
        return partial(self.attend_window, window=window, kv_doc=kv_doc, block=block)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_doc: torch.Tensor | None = None, kv_doc: torch.Tensor | None = None,
               block: Any = None) -> torch.Tensor:
        """Causal (and, with document ids, document) attention of the local queries against
        the K/V gathered from every cp rank. `block`: a documents' FlexAttention block mask
        (`block_mask`; CUDA); without documents SDPA's flash kernels, maskless (cp_sdpa.py);
        otherwise the exact path: per query chunk, SDPA against the key prefix it can see
        with a boolean [chunk, prefix] mask."""
        k = _gather_sequence(k, self.group, self.cp, 2)
        v = _gather_sequence(v, self.group, self.cp, 2)
        if block is not None:
            return flex_attention(q, k, v, block)
        c = q.shape[2] // 2
        kernel = kernel_for(q) if q_doc is None else None
        if kernel is not None:  # no documents: SDPA's kernels, no mask (cp_sdpa.py)
            return torch.cat([chunk_attention(q[:, :, i * c:(i + 1) * c], k, v, chunk, kernel)
                              for i, chunk in enumerate(self.chunks())], dim=2)
        outs = []
        for i, chunk in enumerate(self.chunks()):
            end = (chunk + 1) * c  # keys this chunk can see: the prefix up to its last token
            qi, ki, vi = q[:, :, i * c:(i + 1) * c], k[:, :, :end], v[:, :, :end]
            mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(end - c)
            if q_doc is not None:
                mask = mask & (q_doc[:, None, i * c:(i + 1) * c, None]
                               == kv_doc[:, None, None, :end])
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                       enable_gqa=True))
        return torch.cat(outs, dim=2)

    def attend_window(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                      kv_doc: torch.Tensor | None = None, block: Any = None) -> torch.Tensor:
        """Sliding-window attention (and, with document ids, inside documents) of the local
        queries against the gathered K/V: `block` (CUDA) the band's FlexAttention block mask;
        otherwise each local chunk through `band_attention` (exact, per window of queries)."""
        k = _gather_sequence(k, self.group, self.cp, 2)
        v = _gather_sequence(v, self.group, self.cp, 2)
        if block is not None:
            return flex_attention(q, k, v, block)
        c = q.shape[2] // 2
        return torch.cat([band_attention(q[:, :, i * c:(i + 1) * c], k, v, window, chunk * c,
                                         kv_doc)
                          for i, chunk in enumerate(self.chunks())], dim=2)


def apply_context_parallel(model: Any, group) -> ContextParallel:
    """Turn context parallelism on for `model` (a Transformer or a pipeline stage of one) over
    `group`; refuses models whose positions cannot follow a sharded sequence."""
    spec = model.spec
    if spec.position != "rope":
        raise UserError(f"model.position={spec.position!r}: context parallelism needs rotary "
                         "position embeddings (a learned position table is indexed by the "
                         "unsharded sequence); use a RoPE model or cp=1")
    cp = ContextParallel(group)
    model.context_parallel = cp
    return cp
