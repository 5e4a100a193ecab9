"""Packed documents: `data.attention_mask = "document"`.

The data pipeline packs documents back to back, each followed by the tokenizer's end-of-text
token, and cuts the stream into fixed-length sequences; that token is the document boundary.
With the document mask the model (meshtron/model/transformer.py, `document_context`) lets a
token attend only to earlier tokens of its own document and restarts RoPE positions at 0 for
every document, as production trainers do for packed sequences (a sequence then computes
exactly what each of its documents computes alone). Learned absolute position tables (GPT-2
style) keep their absolute positions; only the mask applies there. The mask is never a dense
[seq, seq] tensor: FlexAttention's block mask on CUDA, one causal SDPA call per document on CPU
(meshtron/model/attention.py); sliding-window blocks keep their band inside each document (a
block mask of both on CUDA, the band's chunks masked by document on CPU).
"""

from __future__ import annotations

from typing import Any, Iterable

from meshtron.errors import UserError

MASKS = ("causal", "document")


def check_document_layout(cfg: Any, plan: Any) -> None:
    """Refuse pipeline parallelism with the document mask: a later stage receives hidden
    states, not the tokens the boundaries are read from."""
    if cfg.data.attention_mask == "document" and plan.pp > 1:
        raise UserError(f"data.attention_mask='document': not supported with pipeline "
                         f"parallelism (plan pp={plan.pp}); use tensor/data parallelism or "
                         "--attention-mask causal")


def apply_document_mask(modules: Iterable[Any], cfg: Any, tokenizer: Any) -> None:
    """Turn the document mask on in the model (parts) when the run asks for it."""
    if cfg.data.attention_mask != "document":
        return
    for module in modules:
        module.document_eos = int(tokenizer.eos_id)
