"""Tokenizers: a byte-level one by default, a locally trained byte-level BPE as an option.

Both share one small interface (`vocab_size`, `bos_id`, `eos_id`, `pad_id`, `encode`, `decode`,
`encode_documents`, `fingerprint`). `encode_documents` is the bulk path used to build corpora: it
returns one flat numpy array, every document followed by EOS, in the narrowest dtype that holds the
vocabulary (`token_dtype`).

The `tokenizers` package is imported lazily, only when a BPE tokenizer is trained or loaded, so the
rest of meshtron works without it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from meshtron.errors import UserError

BYTE_VOCAB = 259
"""256 byte values plus BOS, EOS and PAD: the vocabulary of the tiny/debug model presets."""

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
"""BPE special tokens; they take ids 0, 1, 2 of a trained BPE vocabulary."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32 (what shards and corpora store)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise UserError(f"vocab_size={vocab_size!r}: must be a positive integer")
    if vocab_size >= 2**32:
        raise UserError(f"vocab_size={vocab_size}: must be below 2**32")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    kind: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray: ...

    @property
    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 BOS, 257 EOS, 258 PAD (vocab 259)."""

    kind = "byte"
    vocab_size = BYTE_VOCAB
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif not 256 <= i < BYTE_VOCAB:
                raise UserError(f"token id {i}: outside the byte vocabulary 0..{BYTE_VOCAB - 1}")
        return out.decode("utf-8", errors="replace")

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        parts: list[np.ndarray] = []
        eos = np.array([self.eos_id], dtype=np.uint16)
        for text in texts:
            parts.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
            parts.append(eos)
        if not parts:
            return np.zeros(0, dtype=np.uint16)
        return np.concatenate(parts)

    @property
    def fingerprint(self) -> str:
        return "byte-259-v1"

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            "data.tokenizer='bpe': needs the 'tokenizers' package, which is not installed "
            "(pip install 'meshtron[bpe]'), or use data.tokenizer='byte'") from None
    return tokenizers


def encode_with_eos(backend: Any, texts: Sequence[str], eos_id: int, dtype) -> np.ndarray:
    """Documents through a `tokenizers` backend, each followed by the end-of-text id."""
    texts = list(texts)
    if not texts:
        return np.zeros(0, dtype=dtype)
    eos = np.array([eos_id], dtype=dtype)
    parts: list[np.ndarray] = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=dtype))
        parts.append(eos)
    return np.concatenate(parts)


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` library, trained locally (no download).

    Ids 0, 1, 2 are `<|bos|>`, `<|eos|>`, `<|pad|>`; the 256 byte symbols follow, then merges.
    Training is deterministic for a given list of texts and vocab size (checked by the tests), but
    in a multi-process run train once, `save`, and `load` the file on every rank.
    """

    kind = "bpe"

    def __init__(self, backend: Any) -> None:
        self._tok = backend
        ids = [backend.token_to_id(t) for t in SPECIAL_TOKENS]
        if any(i is None for i in ids):
            raise UserError(
                f"BPE tokenizer: missing special tokens {list(SPECIAL_TOKENS)}; "
                "train it with BPETokenizer.train")
        self.bos_id, self.eos_id, self.pad_id = ids
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self._dtype = token_dtype(self.vocab_size)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
        """Learn merges from `texts` until the vocabulary holds `vocab_size` tokens."""
        if (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                or not BYTE_VOCAB <= vocab_size < 2**31):
            raise UserError(
                f"data.bpe_vocab={vocab_size!r}: a byte-level BPE needs an integer "
                f">= {BYTE_VOCAB} (256 bytes + 3 specials)")
        tk = _import_tokenizers()
        backend = tk.Tokenizer(tk.models.BPE())
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"BPE tokenizer file '{path}': does not exist")
        tk = _import_tokenizers()
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(
                f"BPE tokenizer file '{path}': not a tokenizers JSON file ({first})") from None
        return cls(backend)

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer JSON (atomically, so concurrent readers never see half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks may save at once
        tmp.write_text(self._tok.to_str(), encoding="utf-8")
        tmp.replace(path)
        return path

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise UserError(
                    f"token id {i}: outside the BPE vocabulary 0..{self.vocab_size - 1}")
        return self._tok.decode(ids, skip_special_tokens=True)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        return encode_with_eos(self._tok, texts, self.eos_id, self._dtype)

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]
        return f"bpe-{self.vocab_size}-{digest}"

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")
"""A tokenizer folder's files: copied with a run, and beside exported weights (meshtron/hf/)."""

# Names of the end-of-text token in common Hugging Face tokenizers, tried when the folder has no
# tokenizer_config.json naming it (GPT-2/NeoX/Qwen, Llama 2/Mistral, Llama 3, Gemma).
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def tokenizer_file(value: str | Path) -> Path | None:
    """The tokenizer.json that `value` names (the file, or a folder holding one); None when
    `value` names neither (e.g. 'byte')."""
    path = Path(value)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return path / TOKENIZER_FILE
    if path.is_file() and path.suffix == ".json":
        return path
    return None


def _special(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "</s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (any model the `tokenizers` library reads), so a run
    uses the tokenizer of the checkpoint it starts from.

    The end-of-text id (the document separator of packed sequences) comes from the folder's
    `tokenizer_config.json` (`eos_token`), else from the usual names; BOS and PAD fall back to
    it. `vocab_size` counts added tokens; a model's vocabulary may be larger (checkpoints
    often pad it), never smaller."""

    kind = "hf"

    def __init__(self, backend: Any, path: Path, config: dict[str, Any]) -> None:
        self._tok, self.path = backend, path
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

        def find(key: str) -> int | None:
            name = _special(config, key)
            return vocab.get(name) if name is not None else None

        eos = find("eos_token")
        if eos is None:
            eos = next((vocab[n] for n in _EOS_CANDIDATES if n in vocab), None)
        if eos is None:
            raise UserError(f"data.tokenizer='{path}': no end-of-text token (eos_token in "
                             f"tokenizer_config.json, or one of {', '.join(_EOS_CANDIDATES)}); "
                             "packed documents need a separator")
        self.eos_id = eos
        self.bos_id = find("bos_token") if find("bos_token") is not None else eos
        self.pad_id = find("pad_token") if find("pad_token") is not None else eos
        self._dtype = token_dtype(self.vocab_size)

    @classmethod
    def load(cls, value: str | Path) -> HFTokenizer:
        path = tokenizer_file(value)
        if path is None:
            raise UserError(f"data.tokenizer='{value}': not byte, bpe, a tokenizer.json or a "
                             "folder holding one")
        tk = _import_tokenizers()
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"data.tokenizer='{value}': not a tokenizers JSON file ({first})"
                            ) from None
        config: dict[str, Any] = {}
        cfg_path = path.parent / "tokenizer_config.json"
        if cfg_path.is_file():
            import json

            try:
                loaded = json.loads(cfg_path.read_text())
                config = loaded if isinstance(loaded, dict) else {}
            except (ValueError, UnicodeDecodeError):
                raise UserError(f"data.tokenizer='{value}': {cfg_path} is not valid JSON"
                                ) from None
        return cls(backend, path, config)

    def files(self) -> list[Path]:
        """The tokenizer's files (tokenizer.json and its sidecars) to copy with a run."""
        return [self.path.parent / n for n in TOKENIZER_FILES
                if (self.path.parent / n).is_file() and n != self.path.name] + [self.path]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        return encode_with_eos(self._tok, texts, self.eos_id, self._dtype)

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]
        return f"hf-{self.vocab_size}-{digest}"

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


TOKENIZER_KINDS = ("byte", "bpe")


def build_tokenizer(kind: str = "byte", *, vocab_size: int | None = None,
                    path: str | Path | None = None,
                    train_texts: Iterable[str] | None = None) -> ByteTokenizer | BPETokenizer:
    """Make the tokenizer named by `kind`.

    'byte': the 259-id byte tokenizer (`vocab_size`, if given, must be 259).
    'bpe': load `path` when that file exists (it may not hold more than `vocab_size` ids);
    otherwise train on `train_texts` with `vocab_size` and, when `path` is given, save there.
    """
    if kind == "byte":
        if vocab_size is not None and vocab_size != BYTE_VOCAB:
            raise UserError(
                f"vocab_size={vocab_size!r}: the byte tokenizer has exactly {BYTE_VOCAB} ids")
        return ByteTokenizer()
    if kind == "bpe":
        if path is not None and Path(path).is_file():
            tok = BPETokenizer.load(path)
            # Fewer ids than asked is what training yields on a small corpus; more is a mismatch.
            if vocab_size is not None and tok.vocab_size > vocab_size:
                raise UserError(
                    f"data.bpe_vocab={vocab_size}: the tokenizer at '{path}' has "
                    f"{tok.vocab_size} ids; delete it to retrain or set "
                    f"data.bpe_vocab={tok.vocab_size}")
            return tok
        if vocab_size is None:
            raise UserError(
                "data.bpe_vocab=None: training a BPE tokenizer needs a vocabulary size")
        if train_texts is None:
            raise UserError(
                "data.tokenizer='bpe': needs texts to train on or an existing tokenizer file")
        tok = BPETokenizer.train(train_texts, vocab_size)
        if path is not None:
            tok.save(path)
        return tok
    if tokenizer_file(kind) is not None:
        return HFTokenizer.load(kind)
    allowed = ", ".join(map(repr, TOKENIZER_KINDS))
    raise UserError(f"data.tokenizer={kind!r}: must be one of {allowed}, a tokenizer.json or "
                     "a folder holding one")


def tokenizer_info(tok: ByteTokenizer | BPETokenizer) -> dict[str, Any]:
    """A small JSON-able description (kind, vocab, special ids, fingerprint) for logs."""
    return {"kind": tok.kind, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
            "eos_id": tok.eos_id, "pad_id": tok.pad_id, "fingerprint": tok.fingerprint}


def follow_tokenizer(cfg: Any) -> Any:
    """The run config with the model's vocabulary set to a tokenizer.json's size (no padding,
    so the embedding matrix has exactly the rows a Hugging Face model of this tokenizer has),
    or raised to data.bpe_vocab for the locally trained BPE.
    Weights from `train.init_from` keep their checkpoint's vocabulary, which the data pipeline
    checks is at least the tokenizer's."""
    import dataclasses

    if cfg.data.tokenizer == "bpe" and not cfg.train.init_from:
        # Trained later (on rank 0, from the data) with at most bpe_vocab ids: size the model
        # for that bound now, before the plan and the run file are fixed (unused rows are
        # never a target; a larger vocabulary given on purpose is kept).
        if cfg.model.vocab >= cfg.data.bpe_vocab:
            return cfg
        return dataclasses.replace(cfg, model=cfg.model.replace(vocab=cfg.data.bpe_vocab))
    if tokenizer_file(cfg.data.tokenizer) is None or cfg.train.init_from:
        return cfg
    vocab = HFTokenizer.load(cfg.data.tokenizer).vocab_size
    if vocab == cfg.model.vocab:
        return cfg
    return dataclasses.replace(cfg, model=cfg.model.replace(vocab=vocab))


RUN_TOKENIZER_DIR = "tokenizer"
"""Folder of a run that holds its tokenizer files (for resuming and exporting)."""


def run_tokenizer_path(cfg: Any) -> Path | None:
    """Where a run's locally trained BPE tokenizer lives: RUN_DIR/tokenizer/tokenizer.json
    (trained once, by the main rank; the other ranks load it). None for other tokenizers."""
    if cfg.data.tokenizer != "bpe":
        return None
    return Path(cfg.train.run_dir) / RUN_TOKENIZER_DIR / TOKENIZER_FILE


def keep_tokenizer(tok: Any, run_dir: str | Path) -> Path | None:
    """Copy a Hugging Face tokenizer's files into RUN_DIR/tokenizer (main rank); the BPE one is
    already saved there. Returns the folder, or None for the byte tokenizer."""
    import shutil

    folder = Path(run_dir) / RUN_TOKENIZER_DIR
    if isinstance(tok, HFTokenizer):
        folder.mkdir(parents=True, exist_ok=True)
        for path in tok.files():
            if path.resolve() != (folder / path.name).resolve():
                shutil.copyfile(path, folder / path.name)
        return folder
    return folder if (folder / TOKENIZER_FILE).is_file() else None
