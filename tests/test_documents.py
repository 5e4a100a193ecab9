"""Packed documents (`--attention-mask document`): a packed sequence computes exactly what its
documents compute one by one (attention inside each document, RoPE positions restarting), on
the tokens the data pipeline packs (documents each followed by the end-of-text token)."""

from __future__ import annotations

import pytest
import torch

from meshtron.data.tokenizer import ByteTokenizer
from meshtron.model.spec import ModelSpec
from meshtron.model.transformer import Transformer, document_positions
from testkit.equivalence import DEFAULT_CFG, GPT_MODEL

SPEC = ModelSpec(**dict(DEFAULT_CFG["spec"], vocab=259, max_seq=64))
TEXTS = ["def f(x):\n", "import os", "a = 1\nb = 2\n"]


def _packed_and_docs():
    tok = ByteTokenizer()
    packed = torch.from_numpy(tok.encode_documents(TEXTS).astype("int64"))
    docs, start = [], 0
    for i, t in enumerate(packed.tolist()):
        if t == tok.eos_id:
            docs.append(packed[start:i + 1])
            start = i + 1
    return tok, packed, docs


def test_positions_restart_after_every_end_of_text():
    tokens = torch.tensor([[4, 9, 2, 9, 9, 7, 1]])
    doc, pos = document_positions(tokens, eos=9)
    assert doc.tolist() == [[0, 0, 1, 1, 2, 3, 3]]
    assert pos.tolist() == [[0, 1, 0, 1, 0, 0, 1]]


def test_packed_equals_each_document_alone():
    tok, packed, docs = _packed_and_docs()
    for spec in (SPEC, ModelSpec(**dict(DEFAULT_CFG["spec"], vocab=259, max_seq=64,
                                        **dict(GPT_MODEL, name="gpt")))):
        model = Transformer(spec, init_seed=2)
        alone = torch.cat([model(d[None]) for d in docs], dim=1)
        model.document_eos = tok.eos_id
        together = model(packed[None])
        if spec.position == "rope":
            assert (together - alone).abs().max() < 1e-5
        else:  # learned absolute positions keep their positions: only the first document agrees
            n = len(docs[0])
            assert (together[:, :n] - alone[:, :n]).abs().max() < 1e-5
        # Without the mask, later documents see the earlier ones.
        model.document_eos = None
        assert (model(packed[None]) - alone)[:, len(docs[0]):].abs().max() > 1e-4


def _packed_batch(seq=48, eos=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(6, 259, (2, seq), generator=g)
    tokens[0, [3, 20, 21, 40]] = eos  # a one-token document, a document ending the row
    tokens[1, seq - 1] = eos          # row 1: one document
    targets = torch.randint(0, 259, (2, seq), generator=g)
    return tokens, targets


def _dense_attention(q, k, v, mask=None):
    """The previous kernel: SDPA with the dense [batch, 1, seq, seq] boolean mask."""
    import torch.nn.functional as F

    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(),
                                          enable_gqa=q.shape[1] != k.shape[1])


def test_document_kernel_equals_dense_mask_loss_and_gradients(monkeypatch):
    """Per-document SDPA (the CPU kernel) against SDPA with the dense mask: loss and every
    gradient, Llama style (GQA, RoPE restarts) and GPT style."""
    import meshtron.model.transformer as tr

    tokens, targets = _packed_batch()
    for spec in (SPEC, ModelSpec(**dict(DEFAULT_CFG["spec"], vocab=259, max_seq=64,
                                        **dict(GPT_MODEL, name="gpt")))):
        model = Transformer(spec.replace(layers=2), init_seed=5)
        model.document_eos = 5
        results = []
        for kernel in (tr.attention, _dense_attention):
            monkeypatch.setattr(tr, "attention", kernel)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            loss.backward()
            results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (got, got_g), (want, want_g) = results
        assert abs(got - want) < 1e-6 * want
        for n, g in want_g.items():
            assert (got_g[n] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-8, n


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_equals_dense_mask():
    """The FlexAttention path (CUDA's kernel; eager and forward-only here: FlexAttention has no
    CPU backward in torch 2.13) computes the dense mask's attention, GQA included."""
    from meshtron.model.attention import attention, document_mask
    from meshtron.model.transformer import document_positions

    tokens, _ = _packed_batch(seq=256)
    doc, _ = document_positions(tokens, 5)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = torch.randn(2, 2, 256, 16, generator=g), torch.randn(2, 2, 256, 16, generator=g)
    flex = document_mask(doc, kernel="flex")
    assert flex.block_mask is not None
    with torch.no_grad():
        want = _dense_attention(q, k, v, flex)
        assert (attention(q, k, v, flex) - want).abs().max() < 1e-5
        assert (attention(q, k, v, document_mask(doc)) - want).abs().max() < 1e-5


def test_document_mask_builds_no_seq_by_seq_tensor():
    """Forward and backward with the document mask never allocate batch x seq x seq (the
    chunked loss keeps the logits below that too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seq = 256
    tokens, targets = _packed_batch(seq=seq)
    tokens[:, ::32] = 5  # documents of at most 32 tokens
    model = Transformer(SPEC.replace(max_seq=seq, layers=1), init_seed=1)
    model.document_eos = 5
    largest = [0]

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    largest[0] = max(largest[0], t.numel())
            return out

    with Sizes():
        model(tokens, targets).backward()
    assert 0 < largest[0] < 2 * seq * seq
