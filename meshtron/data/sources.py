"""Readers for training data: plain text files, JSONL records and pre-tokenized binary shards.

Text readers yield documents (strings) in a deterministic order. A token shard is a raw array of
token ids (`<name>.bin`, little-endian uint16 when the vocabulary fits in 16 bits, else uint32)
with a JSON sidecar `<name>.bin.json` that records dtype, vocabulary size and token count; it is
read back through `numpy.memmap`, so a shard larger than memory costs nothing until it is sampled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from meshtron.data.text_check import TextDamage, decode_file
from meshtron.data.tokenizer import token_dtype
from meshtron.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
"""Files picked up in a directory given as a text source (a file named directly is always read)."""

SHARD_FORMAT = "meshtron-tokens"
SHARD_VERSION = 1


def check_exists(path: str | Path, field: str = "data.source") -> Path:
    """The path as a `Path`, or a ValueError naming the field when nothing is there."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{field}='{path}': does not exist")
    return p


# ---- plain text ----------------------------------------------------------------------------

def list_text_files(paths: str | Path | Sequence[str | Path],
                    suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """Files named directly plus, for each directory, its `suffixes` files found recursively.

    Order is deterministic: arguments in the given order, each directory's files sorted by their
    POSIX path relative to that directory (hidden files and directories are skipped).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for path in paths:
        p = check_exists(path)
        if p.is_file():
            files.append(p)
            continue
        found = []
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if not name.startswith(".") and name.lower().endswith(tuple(suffixes)):
                    full = Path(dirpath) / name
                    found.append((full.relative_to(p).as_posix(), full))
        if not found:
            raise UserError(
                f"data.source='{path}': directory holds no text files ({', '.join(suffixes)})")
        files.extend(full for _, full in sorted(found))
    return files


def read_text_files(paths: str | Path | Sequence[str | Path],
                    suffixes: Sequence[str] = TEXT_SUFFIXES,
                    warnings: list[str] | None = None) -> Iterator[str]:
    """One document per file (UTF-8); empty files are skipped.

    A file that is not UTF-8 text is refused, one with a few undecodable bytes (read as U+FFFD)
    adds a line to `warnings` (`meshtron.data.text_check`). Paths are checked before the first
    document is produced.
    """
    files = list_text_files(paths, suffixes)

    def gen() -> Iterator[str]:
        for f in files:
            text = decode_file(f, warnings)
            if text:
                yield text

    return gen()


# ---- JSONL ---------------------------------------------------------------------------------

def read_jsonl(path: str | Path, field: str = "text",
               warnings: list[str] | None = None) -> Iterator[str]:
    """One document per line: the string under `field` of each JSON object; blank lines skipped.

    A line that is not JSON, not an object, lacks `field` or holds a non-string there raises a
    ValueError naming `file:line`; a file that is not UTF-8 is refused (or warned about) as
    `read_text_files` does. The path is checked before the first document is produced.
    """
    p = check_exists(path)
    if not p.is_file():
        raise UserError(f"data.source='{path}': is a directory, expected a .jsonl file")

    def gen() -> Iterator[str]:
        damage = TextDamage(p)
        with open(p, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                line = raw.decode("utf-8", errors="replace")
                damage.add(raw, line)
                line = line.strip()
                if not line:
                    continue
                where = f"data.source line {p}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    damage.check(None)  # UTF-16 fails as JSON first: name the encoding
                    raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") \
                        from None
                if not isinstance(record, dict):
                    raise UserError(
                        f"{where}: expected a JSON object with a {field!r} field, "
                        f"got {type(record).__name__}")
                if field not in record:
                    keys = ", ".join(map(repr, list(record)[:5])) or "none"
                    raise UserError(f"{where}: no {field!r} field (keys: {keys}); "
                                    "data.json_key (--json-key) names the text field")
                text = record[field]
                if not isinstance(text, str):
                    raise UserError(
                        f"{where}: field {field!r} must be a string, got {type(text).__name__}")
                if text:
                    yield text
        damage.check(warnings)

    return gen()


JSONL_SUFFIXES = (".jsonl",)
"""JSON Lines files picked up in a directory given as a source (Hugging Face datasets'
`to_json` shards). A folder's `.json` files are not read: `save_to_disk` folders hold
dataset_info.json / state.json, JSON but no documents; a .json named directly is JSON Lines."""


def read_folder(path: str | Path, field: str = "text",
                warnings: list[str] | None = None) -> Iterator[str]:
    """The documents of a directory: its text files (one document each, `read_text_files`) or
    its JSON Lines shards (one document per line under `field`, as `read_jsonl` reads a .jsonl
    named directly), both in `list_text_files`'s sorted order. A folder holding both kinds is
    refused: one file per document beside one line per document is no layout a dataset
    writes, and the text is most likely a dataset card (README.md) that would be trained on."""
    files = list_text_files(path, TEXT_SUFFIXES + JSONL_SUFFIXES)
    shards = [f for f in files if f.suffix.lower() in JSONL_SUFFIXES]
    if not shards:
        return read_text_files(files, warnings=warnings)
    texts = [f for f in files if f.suffix.lower() not in JSONL_SUFFIXES]
    if texts:
        raise UserError(
            f"data.source='{path}': holds both JSON Lines ({shards[0].relative_to(path)}) and "
            f"text files ({texts[0].relative_to(path)}); allowed: a folder of .jsonl shards or "
            f"one of text files ({', '.join(TEXT_SUFFIXES)}): move the other kind out")
    readers = [read_jsonl(f, field=field, warnings=warnings) for f in shards]
    return (doc for reader in readers for doc in reader)


def first_record(path: Path) -> Any:
    """The first non-blank line of the JSON Lines file `path`, parsed; None when it is not
    JSON (read_jsonl then names the line) or the file holds none."""
    with open(path, "rb") as fh:
        for raw in fh:
            line = raw.decode("utf-8", errors="replace").strip()
            if line:
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


def check_json_key(files: Sequence[Path], key: Any, source: Any) -> None:
    """Refuse data.json_key before any reading: not a non-empty string; given (not 'text')
    for a source that holds no JSON Lines (`files` empty: it would be ignored); absent from
    the first record, naming the keys that record has. Later records lacking it are named
    by file and line as read_jsonl reaches them."""
    if not isinstance(key, str) or not key:
        raise UserError(f"data.json_key={key!r}: must be a non-empty string, the field of "
                        "each JSON Lines record that holds its text (default 'text')")
    if not files:
        if key != "text":
            raise UserError(f"data.json_key={key!r}: names the text field of JSON Lines "
                            f"records, but data.source={str(source)!r} holds none; allowed: "
                            "a .jsonl / .json file or a folder of .jsonl shards, or drop it")
        return
    record = first_record(files[0])
    if isinstance(record, dict) and key not in record:
        keys = ", ".join(map(repr, record)) or "none"
        raise UserError(f"data.json_key={key!r}: not a field of the first record of "
                        f"{files[0]} (its keys: {keys}); allowed: one of those "
                        "(--json-key FIELD)")


# ---- pre-tokenized shards ------------------------------------------------------------------

def shard_sidecar(path: str | Path) -> Path:
    """Where the metadata of the shard at `path` lives: `<path>.json`."""
    p = Path(path)
    return p.with_name(p.name + ".json")


def write_token_shard(path: str | Path, ids: Iterable[int] | np.ndarray, vocab_size: int,
                      meta: dict[str, Any] | None = None) -> Path:
    """Write token ids as a raw little-endian array plus its JSON sidecar; returns `path`.

    The dtype is uint16 when `vocab_size <= 65536`, else uint32. Every id must lie in
    `[0, vocab_size)`. `meta` (JSON-able) is stored in the sidecar, e.g. the tokenizer fingerprint.
    Both files are written atomically (temp file + rename).
    """
    dtype = token_dtype(vocab_size).newbyteorder("<")
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if arr.ndim != 1:
        raise UserError(f"token shard ids: expected a flat sequence, got shape {arr.shape}")
    if arr.size:
        if not np.issubdtype(arr.dtype, np.integer):
            raise UserError(f"token shard ids: expected integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            raise UserError(
                f"token shard ids: values span {lo}..{hi}, outside vocab_size={vocab_size}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    info = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "dtype": dtype.name,
            "byteorder": "little", "vocab_size": vocab_size, "num_tokens": int(arr.size)}
    if meta:
        info["meta"] = meta
    tmp = p.with_name(f".{p.name}.tmp")
    arr.astype(dtype, copy=False).tofile(tmp)
    tmp.replace(p)
    side = shard_sidecar(p)
    tmp_side = side.with_name(f".{side.name}.tmp")
    tmp_side.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp_side.replace(side)
    return p


def shard_info(path: str | Path) -> dict[str, Any]:
    """The sidecar metadata of a shard, validated against the shard's size on disk."""
    p = check_exists(path)
    side = shard_sidecar(p)
    if not side.is_file():
        raise UserError(
            f"data.source='{path}': token shard has no sidecar '{side.name}' "
            "(write shards with `meshtron tokenize` or meshtron.data.write_token_shard)")
    try:
        info = json.loads(side.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"data.source='{path}': sidecar '{side.name}' is not JSON ({exc.msg})") \
            from None
    if not isinstance(info, dict) or info.get("format") != SHARD_FORMAT:
        raise UserError(
            f"data.source='{path}': sidecar '{side.name}' is not a {SHARD_FORMAT} file")
    if info.get("version") != SHARD_VERSION or info.get("dtype") not in ("uint16", "uint32"):
        raise UserError(
            f"data.source='{path}': unsupported shard version {info.get('version')!r} "
            f"or dtype {info.get('dtype')!r} (expected version {SHARD_VERSION}, uint16/uint32)")
    itemsize = np.dtype(info["dtype"]).itemsize
    expected = int(info["num_tokens"]) * itemsize
    actual = p.stat().st_size
    if actual != expected:
        raise UserError(
            f"data.source='{path}': shard holds {actual} bytes, sidecar promises "
            f"{info['num_tokens']} x {info['dtype']} = {expected} (truncated or overwritten?)")
    return info


def read_token_shard(path: str | Path) -> np.ndarray:
    """The shard's ids as a read-only `numpy.memmap` (an empty array for an empty shard)."""
    info = shard_info(path)
    dtype = np.dtype(info["dtype"]).newbyteorder("<")
    if int(info["num_tokens"]) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(int(info["num_tokens"]),))
