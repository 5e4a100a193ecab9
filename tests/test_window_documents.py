"""Sliding windows with packed documents and under context parallelism, against dense masks.

Query i sees key j iff 0 <= i - j < window and, packed, both lie in one document. Each path is
compared with SDPA under that dense [seq, seq] mask (built here only): the CPU kernels
(`band_attention`: one process, and one context-parallel rank's chunks against the gathered
keys) forward and backward, and the CUDA branches' FlexAttention block masks run eagerly on
CPU (forward only: CPU FlexAttention has no backward). Odd cases: a window longer than the
sequence, windows shorter than a context-parallel chunk, documents crossing chunk borders.
The model: a packed row's logits equal each document's run alone (Gemma 3's sliding blocks
rotating with their own base), and the block masks a GPU gives each layer (injected on CPU)
equal the CPU path. RoPE scores depend on i - j only and every attended pair lies in one
document, so no test here can see whether positions restart per document (they do, as
transformers' packed position_ids): global positions would give the same logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

SEQ, BATCH = 32, 2
EOS_AT = {0: (5, 13, 14, 27), 1: (2, 19)}  # documents cross the 4- and 8-token chunk borders


def _docs() -> torch.Tensor:
    """[BATCH, SEQ] document ids: a document ends at each EOS_AT column (its last token)."""
    doc = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, ends in EOS_AT.items():
        for end in ends:
            doc[row, end + 1:] += 1
    return doc


def _dense(window: int, doc: torch.Tensor | None) -> torch.Tensor:
    """The [BATCH or 1, 1, SEQ, SEQ] boolean mask: band, and same document."""
    i = torch.arange(SEQ)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    if doc is None:
        return mask[None, None]
    return mask[None, None] & (doc[:, None, :, None] == doc[:, None, None, :])


def _qkv(seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, h, SEQ, 16, generator=g).requires_grad_(grad) for h in (4, 2, 2)]


def _reference(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [1, 3, 7, 40])
def test_one_process_window_with_documents_is_the_dense_band(window):
    """window_attention with a DocumentMask: the CPU band (forward and gradients) and the CUDA
    branch's band-and-document block mask equal the dense mask; documents change the result
    (so the comparison could fail)."""
    from meshtron.model.attention import document_mask, window_attention

    doc = _docs()
    q, k, v = _qkv(grad=True)
    want = _reference(q, k, v, _dense(window, doc))
    got = window_attention(q, k, v, window, mask=document_mask(doc, "segments", window))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), grads_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        flex_mask = document_mask(doc, "flex", window)
        assert (flex_mask.window_block_mask is None) == (window >= SEQ)  # then it is causal
        flex = window_attention(q.detach(), k.detach(), v.detach(), window, kernel="flex",
                                mask=flex_mask)
        torch.testing.assert_close(flex, want, rtol=1e-5, atol=1e-6)
        if window > 1:  # a window of one sees the query's own key only, documents or not
            alone = _reference(q, k, v, _dense(window, None))
            assert (alone - want).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [3, 13, 40])
@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_chunks_are_the_dense_bands_rows(window, documents):
    """Each rank's chunks (of 2*cp, cp 2 and 4: 8 or 4 tokens, windows shorter and longer)
    through ContextParallel.attend_window's CPU path (band_attention at the chunks' global
    positions, against the whole sequence's keys) and its CUDA block mask (context.block_mask
    with the window) give the dense band's rows at the rank's positions, gradients included."""
    from meshtron.model.attention import band_attention
    from meshtron.parallel.context import block_mask, chunk_positions, flex_attention

    doc = _docs() if documents else None
    q, k, v = _qkv(seed=window, grad=True)
    want = _reference(q, k, v, _dense(window, doc))
    for cp in (2, 4):
        c = SEQ // (2 * cp)
        for rank in range(cp):
            pos = chunk_positions(SEQ, cp, rank)
            lq = q.detach()[:, :, pos].requires_grad_(True)
            got = torch.cat([band_attention(lq[:, :, i * c:(i + 1) * c], k, v, window, j * c, doc)
                             for i, j in enumerate((rank, 2 * cp - 1 - rank))], dim=2)
            torch.testing.assert_close(got, want[:, :, pos], rtol=1e-5, atol=1e-6)
            dout = torch.randn_like(got)
            dq, dk, dv = torch.autograd.grad(got, (lq, k, v), dout)
            ref = torch.autograd.grad(want[:, :, pos], (q, k, v), dout, retain_graph=True)
            torch.testing.assert_close(dq, ref[0][:, :, pos], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dk, ref[1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dv, ref[2], rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                block = block_mask(pos, None if doc is None else doc[:, pos], doc, BATCH, SEQ,
                                   window)
                flex = flex_attention(lq.detach(), k.detach(), v.detach(), block)
            torch.testing.assert_close(flex, want[:, :, pos], rtol=1e-5, atol=1e-6)


def _gemma3_like():
    from meshtron.model.hf_config import from_hf_dict
    from testkit.hf_dense_ref import TINY

    # five sliding blocks of six (the sixth global), windows of 4 under 16-token documents;
    # the sliding blocks rotate at their own base (rope_local_base_freq)
    cfg = dict(TINY["gemma3_text"], num_hidden_layers=6, sliding_window=4,
               layer_types=["sliding_attention"] * 5 + ["full_attention"])
    spec = from_hf_dict(cfg)
    assert spec.sliding_blocks == 5 and spec.rope_local_theta != spec.rope_theta
    return spec


def test_packed_documents_equal_each_document_alone():
    """A Gemma-3-style model with packed documents (refused before): each document's logits
    equal the model run on that document alone, in sliding blocks and the global block."""
    from meshtron.model.transformer import Transformer

    spec = _gemma3_like()
    model = Transformer(spec, init_seed=5)
    eos = spec.vocab - 1
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, eos, (2, 24), generator=g)
    tokens[0, [6, 15]] = eos  # documents of 7, 9 and 8 tokens; the window is 4
    tokens[1, 10] = eos
    with torch.no_grad():
        model.document_eos = eos
        packed = model(tokens)
        model.document_eos = None
        for row, ends in ((0, (6, 15)), (1, (10,))):
            starts = (0,) + tuple(e + 1 for e in ends)
            for s, e in zip(starts, ends + (tokens.shape[1] - 1,)):
                alone = model(tokens[row:row + 1, s:e + 1])
                torch.testing.assert_close(packed[row:row + 1, s:e + 1], alone, rtol=1e-5,
                                           atol=2e-6)
        whole = model(tokens)  # without the document mask the logits differ
    assert (whole - packed).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("every", [2, 0])
def test_model_flex_document_masks_equal_the_cpu_path(every):
    """What a GPU runs, layer by layer, on CPU (`Transformer.document_kernel = "flex"`: eager
    FlexAttention, forward): a Gemma-3-style model (every=2: the sliding block's band-and-
    document block mask, the global block's document mask) and one whose every block slides
    (every=0, Mistral's: no plain document mask is built) give the CPU path's logits."""
    from meshtron.model.transformer import Transformer, document_context

    spec = _gemma3_like().replace(layers=2, window_every=every)
    model = Transformer(spec, init_seed=5)
    model.document_eos = eos = spec.vocab - 1
    tokens = torch.randint(0, eos, (2, 24), generator=torch.Generator().manual_seed(3))
    tokens[0, [6, 15]] = eos
    tokens[1, 10] = eos
    with torch.no_grad():
        want = model(tokens)
        model.document_kernel = "flex"
        got = model(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    _, mask = document_context(tokens, eos, None, spec, "flex")  # the masks the GPU builds
    assert mask.window_block_mask is not None
    assert (mask.block_mask is None) == (every == 0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_one_flex_trace_serves_every_window_and_the_global_blocks():
    """The block masks read their window from a 0-d tensor, not from a number in the
    mask_mod's closure: FlexAttention's dynamo trace (compiled on CUDA, traced eagerly on CPU)
    guards on a closure's numbers, so a number gave a trace, and on CUDA a compiled kernel,
    per window, and a model of sliding and global blocks compiled two. Now every window and
    the global mask (window 0) of one mask family share one trace: context parallelism's
    gathered-sequence masks with and without documents (cp_flex.positions_block_mask, whose
    halo masks are the same code) and one process's document masks (model/attention.py).
    The CPU counts what CUDA compiles: the same dynamo guards decide both."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from meshtron.model.attention import _flex_block_mask
    from meshtron.parallel.context import block_mask, chunk_positions, flex_attention

    doc = _docs()
    q, k, v = _qkv(seed=1)
    pos = chunk_positions(SEQ, 2, 1)
    windows = (0, 3, 6, 13, 40)

    def traces(calls) -> int:
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            for call in calls:
                call()
        return counters["stats"]["unique_graphs"] - before

    for docs in (None, doc):
        q_doc = None if docs is None else docs[:, pos]
        assert traces([lambda w=w: flex_attention(q[:, :, pos], k, v, block_mask(
            pos, q_doc, docs, BATCH, SEQ, w)) for w in windows]) == 1, docs
    assert traces([lambda w=w: flex_attention(q, k, v, _flex_block_mask(doc, w))
                   for w in windows]) == 1
