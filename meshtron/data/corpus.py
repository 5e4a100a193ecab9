"""Token corpora: documents -> one flat token array, split into train and held-out parts.

The default corpus needs no download: the Python standard library's own `.py` sources, read at run
time from `sysconfig.get_paths()['stdlib']`. Files are taken in sorted order of their POSIX path
relative to that directory, skipping test suites, `site-packages`, build config and the
machine-specific `_sysconfigdata*` module, up to a byte cap, so every rank on every machine with
the same Python build reads the same bytes in the same order. `TokenCorpus.fingerprint` names the
exact result; ranks can compare it.

The held-out split is deterministic: with at least `holdout_every` documents, every
`holdout_every`-th document (indices k-1, 2k-1, ...) is held out whole; with fewer (a single text
file, a token shard) the last `1/holdout_every` of the tokens is.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from meshtron.data.tokenizer import BPETokenizer, ByteTokenizer
from meshtron.errors import UserError

DEFAULT_MAX_BYTES = 8 * 2**20
"""Cap of the stdlib corpus in source bytes (8 MiB: about 8.4M byte tokens, ~0.2 s to build)."""

DEFAULT_HOLDOUT_EVERY = 50
"""One document in 50 (or the last 2% of tokens) is held out for evaluation."""

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                       "__pycache__"})
"""Directory names never descended into when gathering the stdlib corpus."""

CACHE_VERSION = 1


def stdlib_root() -> Path:
    """The directory holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES, root: str | Path | None = None
                 ) -> list[tuple[str, int]]:
    """(relative POSIX path, size in bytes) of the stdlib files in the corpus, in corpus order.

    Files are taken in sorted path order until the next one would push the total past
    `max_bytes`.
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise UserError(f"max_bytes={max_bytes!r}: must be a positive integer")
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise UserError(f"data.source='{base}': does not exist (no standard library sources)")
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not d.startswith((".", "config-"))]
        rel_dir = Path(dirpath).relative_to(base)
        for name in filenames:
            if not name.endswith(".py") or name.startswith(("_sysconfigdata", ".")):
                continue
            full = Path(dirpath) / name
            if full.is_file():
                found.append(((rel_dir / name).as_posix(), full.stat().st_size))
    found.sort()
    chosen: list[tuple[str, int]] = []
    total = 0
    for rel, size in found:
        if total + size > max_bytes:
            break
        chosen.append((rel, size))
        total += size
    if not chosen:
        raise UserError(
            f"max_bytes={max_bytes}: no stdlib source file fits "
            f"(found {len(found)} .py files under '{base}')")
    return chosen


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES, root: str | Path | None = None
                     ) -> list[str]:
    """The stdlib corpus as documents (one per file, UTF-8 with undecodable bytes replaced)."""
    base = Path(root) if root is not None else stdlib_root()
    docs = []
    for rel, _ in stdlib_files(max_bytes, base):
        text = (base / rel).read_bytes().decode("utf-8", errors="replace")
        if text:
            docs.append(text)
    return docs


def split_documents(documents: Sequence[str], holdout_every: int = DEFAULT_HOLDOUT_EVERY
                    ) -> tuple[list[str], list[str]]:
    """(train, held-out) documents: every `holdout_every`-th one is held out.

    With fewer than `holdout_every` documents nothing is held out here (the corpus then holds out
    the tail of the token stream instead).
    """
    _check_holdout(holdout_every)
    if len(documents) < holdout_every:
        return list(documents), []
    train = [d for i, d in enumerate(documents) if i % holdout_every != holdout_every - 1]
    held = [d for i, d in enumerate(documents) if i % holdout_every == holdout_every - 1]
    return train, held


def split_tokens(tokens: np.ndarray, holdout_every: int = DEFAULT_HOLDOUT_EVERY
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) views of a token array; the last `len // holdout_every` tokens are held
    out."""
    _check_holdout(holdout_every)
    cut = len(tokens) - len(tokens) // holdout_every
    return tokens[:cut], tokens[cut:]


def _check_holdout(holdout_every: int) -> None:
    if not isinstance(holdout_every, int) or isinstance(holdout_every, bool) or holdout_every < 2:
        raise UserError(f"holdout_every={holdout_every!r}: must be an integer >= 2")


@dataclass(frozen=True)
class TokenCorpus:
    """Train and held-out token streams (documents each followed by EOS) of one source."""

    train: np.ndarray
    """Flat training token ids (uint16 or uint32; a memmap for shards)."""
    eval: np.ndarray
    """Flat held-out token ids, disjoint from `train`."""
    vocab_size: int
    source: str
    """What was read, for display: 'stdlib', a path."""
    fingerprint: str
    """Hex digest naming the exact contents (documents or shard, tokenizer, split)."""
    num_documents: int = 0
    """Documents read (0 for pre-tokenized shards)."""
    num_eval_documents: int = 0
    """Documents held out whole (0 when the held-out part is the token tail)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        """Small JSON-able summary for logs."""
        return {"source": self.source, "train_tokens": int(len(self.train)),
                "eval_tokens": int(len(self.eval)), "vocab_size": self.vocab_size,
                "documents": self.num_documents, "eval_documents": self.num_eval_documents,
                "fingerprint": self.fingerprint, **self.extra}


def documents_digest(documents: Sequence[str]) -> str:
    """sha256 over the documents (length-prefixed UTF-8), order-sensitive."""
    h = hashlib.sha256()
    for doc in documents:
        raw = doc.encode("utf-8", errors="surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def build_token_corpus(documents: Sequence[str], tokenizer: ByteTokenizer | BPETokenizer,
                       holdout_every: int = DEFAULT_HOLDOUT_EVERY, source: str = "documents",
                       cache_dir: str | Path | None = None) -> TokenCorpus:
    """Tokenise `documents` (each followed by EOS) into a train/held-out `TokenCorpus`.

    With `cache_dir`, the token arrays are stored there under a key hashed from the documents,
    the tokenizer fingerprint and the split, and reused on the next call with the same inputs.
    """
    _check_holdout(holdout_every)
    documents = list(documents)
    if not documents:
        raise UserError(f"data.source='{source}': holds no non-empty documents")
    key_src = json.dumps({"v": CACHE_VERSION, "docs": documents_digest(documents),
                          "tok": tokenizer.fingerprint, "holdout_every": holdout_every},
                         sort_keys=True)
    fingerprint = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache_path = None
    if cache_dir is not None:
        cache_path = Path(cache_dir) / f"tokens-{fingerprint}.npz"
        cached = _load_cache(cache_path)
        if cached is not None:
            train, held, n_eval_docs = cached
            return TokenCorpus(train, held, tokenizer.vocab_size, source, fingerprint,
                               len(documents), n_eval_docs, {"cached": True})
    train_docs, eval_docs = split_documents(documents, holdout_every)
    if eval_docs:
        train = tokenizer.encode_documents(train_docs)
        held = tokenizer.encode_documents(eval_docs)
    else:
        train, held = split_tokens(tokenizer.encode_documents(documents), holdout_every)
    if cache_path is not None:
        _save_cache(cache_path, train, held, len(eval_docs))
    return TokenCorpus(train, held, tokenizer.vocab_size, source, fingerprint,
                       len(documents), len(eval_docs), {"cached": False})


def load_stdlib_corpus(tokenizer: ByteTokenizer | BPETokenizer,
                       max_bytes: int = DEFAULT_MAX_BYTES,
                       holdout_every: int = DEFAULT_HOLDOUT_EVERY,
                       cache_dir: str | Path | None = None,
                       root: str | Path | None = None) -> TokenCorpus:
    """The embedded default corpus (Python stdlib sources) tokenised with `tokenizer`."""
    docs = stdlib_documents(max_bytes, root)
    return build_token_corpus(docs, tokenizer, holdout_every, source="stdlib",
                              cache_dir=cache_dir)


def _load_cache(path: Path) -> tuple[np.ndarray, np.ndarray, int] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["train"], z["eval"], int(z["eval_documents"])
    except Exception:  # a damaged cache file is rebuilt, never trusted
        return None


def _save_cache(path: Path, train: np.ndarray, held: np.ndarray, n_eval_docs: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, train=train, eval=held, eval_documents=np.int64(n_eval_docs))
    # pid-unique temp name + rename: concurrent ranks writing the same key never clash.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
