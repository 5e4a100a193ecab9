"""Packed documents (`--attention-mask document`): a packed sequence computes exactly what its
documents compute one by one (attention inside each document, RoPE positions restarting), on
the tokens the data pipeline packs (documents each followed by the end-of-text token)."""

from __future__ import annotations

import torch

from meshtron.data.tokenizer import ByteTokenizer
from meshtron.model.spec import ModelSpec
from meshtron.model.transformer import Transformer, document_positions
from meshtron.testing.equivalence import DEFAULT_CFG, GPT_MODEL

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
