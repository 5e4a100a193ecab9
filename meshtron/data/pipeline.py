"""`build_data`: source + tokenizer + batch layout -> (train loader, held-out batches).

Everything is passed explicitly; nothing is global. The same arguments on every data-parallel
rank (only `dp_rank` differs) give each rank its slice of one shared global batch sequence.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from meshtron.data.corpus import (
    DEFAULT_HOLDOUT_EVERY,
    DEFAULT_MAX_BYTES,
    TokenCorpus,
    build_token_corpus,
    documents_digest,
    split_documents,
    split_tokens,
    stdlib_documents,
)
from meshtron.data.sources import (
    JSONL_SUFFIXES,
    TEXT_SUFFIXES,
    check_exists,
    check_json_key,
    list_text_files,
    read_folder,
    read_jsonl,
    read_text_files,
    read_token_shard,
    shard_info,
)
from meshtron.data.tokenizer import (
    BYTE_VOCAB,
    TOKENIZER_KINDS,
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    tokenizer_file,
    tokenizer_info,
)
from meshtron.errors import UserError

if TYPE_CHECKING:  # the dataset imports torch: build_data imports it (see data/__init__.py)
    from meshtron.data.dataset import Batch, EvalBatches, TrainLoader

STDLIB = "stdlib"


def source_kind(source: str | Path) -> str:
    """'stdlib', 'text' (a text file, or a directory of text files or of .jsonl shards:
    sources.read_folder), 'jsonl' (.jsonl or .json: JSON Lines) or 'shard' (.bin); a table
    file (TABLE_SUFFIXES) is refused."""
    if str(source) == STDLIB:
        return "stdlib"
    p = check_exists(source, "data.source")
    if p.is_dir():
        return "text"
    suffix = p.suffix.lower()
    shard = p.with_suffix("")  # NAME.bin.json -> NAME.bin
    if p.name.lower().endswith(".bin.json") and shard.is_file():
        # a shard's sidecar was read as JSON Lines: "invalid JSON ... at column 2" (session-52
        # user audit)
        raise UserError(f"data.source='{source}': the sidecar of the token shard '{shard}' "
                        f"(its dtype and vocabulary); allowed: the shard itself, --data {shard}")
    if suffix in (".jsonl", ".json"):  # Hugging Face datasets' to_json writes JSON Lines
        return "jsonl"
    if suffix == ".bin":
        return "shard"
    if suffix in TABLE_SUFFIXES:
        raise UserError(f"data.source='{source}': a {suffix} table is not read; allowed: a "
                        "text file or folder, a .jsonl / .json of JSON Lines ({\"text\": ...} "
                        "per line; --json-key names another field) or a .bin token shard "
                        "(e.g. datasets' Dataset.from_parquet(PATH).to_json('rows.jsonl'))")
    return "text"


def check_source_key(source: str | Path, key: Any) -> None:
    """data.json_key against the source (sources.check_json_key): the JSON Lines files
    `read_documents` would read, the first one's first record."""
    files: list[Path] = []
    kind = source_kind(source)
    if kind == "jsonl":
        files = [Path(source)]
    elif kind == "text" and Path(source).is_dir():
        files = [f for f in list_text_files(source, TEXT_SUFFIXES + JSONL_SUFFIXES)
                 if f.suffix.lower() in JSONL_SUFFIXES]
    check_json_key(files, key, source)


TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".csv", ".tsv")
"""Columnar and tabular files a Hugging Face dataset comes as: read as text they would train
on their bytes or their column syntax."""


def read_documents(source: str | Path = STDLIB, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   jsonl_field: str = "text", warnings: list[str] | None = None) -> list[str]:
    """The documents of a text source ('stdlib', a text file, a folder of text files or of
    .jsonl shards, a .jsonl), in order; at least one. Text that is not quite clean UTF-8 adds a line to `warnings`."""
    kind = source_kind(source)
    if kind == "shard":
        raise UserError(f"data.source='{source}': a token shard holds ids, not documents")
    if kind == "stdlib":
        docs = stdlib_documents(max_bytes)
    elif kind == "jsonl":
        docs = list(read_jsonl(source, field=jsonl_field, warnings=warnings))
    elif Path(source).is_dir():
        docs = list(read_folder(source, field=jsonl_field, warnings=warnings))
    else:
        docs = list(read_text_files(source, warnings=warnings))
    if not docs:
        raise UserError(f"data.source='{source}': holds no non-empty documents")
    return docs


def load_corpus(source: str | Path = STDLIB, tokenizer: str = "byte", *,
                bpe_vocab: int | None = None, tokenizer_path: str | Path | None = None,
                holdout_every: int = DEFAULT_HOLDOUT_EVERY, max_bytes: int = DEFAULT_MAX_BYTES,
                cache_dir: str | Path | None = None, jsonl_field: str = "text",
                warnings: list[str] | None = None,
                ) -> tuple[TokenCorpus, ByteTokenizer | BPETokenizer]:
    """Read `source`, make (or load, or train) the tokenizer, tokenise and split. Text that is
    not quite clean UTF-8 adds a line to `warnings` (`meshtron.data.text_check`).

    A BPE tokenizer without an existing `tokenizer_path` file is trained on the training split of
    the documents (never on held-out ones) and saved to `tokenizer_path` when given, else (with
    `cache_dir`) to `cache_dir/bpe-<vocab>-<hash of the training documents>.json` and reused.
    """
    hf_tok = HFTokenizer.load(tokenizer) if tokenizer_file(tokenizer) is not None else None
    if hf_tok is None and tokenizer not in TOKENIZER_KINDS:
        allowed = ", ".join(map(repr, TOKENIZER_KINDS))
        raise UserError(f"data.tokenizer={tokenizer!r}: must be one of {allowed}, a "
                        "tokenizer.json or a folder holding one")
    if source_kind(source) == "shard":
        return _shard_corpus(Path(source), tokenizer, bpe_vocab, tokenizer_path, holdout_every)
    docs = read_documents(source, max_bytes=max_bytes, jsonl_field=jsonl_field,
                          warnings=warnings)
    if hf_tok is not None:
        tok = hf_tok
    elif tokenizer == "bpe":
        train_docs, _ = split_documents(docs, holdout_every)
        if tokenizer_path is None and cache_dir is not None and bpe_vocab is not None:
            # Cache the trained tokenizer too, keyed by what it is trained on.
            key = documents_digest(train_docs)[:16]
            tokenizer_path = Path(cache_dir) / f"bpe-{bpe_vocab}-{key}.json"
        tok = build_tokenizer("bpe", vocab_size=bpe_vocab, path=tokenizer_path,
                              train_texts=train_docs)
    else:
        tok = ByteTokenizer()
    corpus = build_token_corpus(docs, tok, holdout_every, source=str(source), cache_dir=cache_dir)
    return corpus, tok


def _shard_corpus(path: Path, tokenizer: str, bpe_vocab: int | None,
                  tokenizer_path: str | Path | None, holdout_every: int
                  ) -> tuple[TokenCorpus, ByteTokenizer | BPETokenizer]:
    info = shard_info(path)
    shard_vocab = int(info["vocab_size"])
    if tokenizer == "byte":
        if shard_vocab != BYTE_VOCAB:
            raise UserError(
                f"data.tokenizer='byte': shard '{path}' holds ids of a {shard_vocab}-token "
                "vocabulary; give the tokenizer it was written with: --tokenizer FILE.json "
                "(a Hugging Face tokenizer.json or its folder)")
        tok: ByteTokenizer | BPETokenizer | HFTokenizer = ByteTokenizer()
    elif tokenizer_file(tokenizer) is not None:
        tok = HFTokenizer.load(tokenizer)
        if tok.vocab_size > shard_vocab:
            raise UserError(f"data.tokenizer='{tokenizer}': has {tok.vocab_size} ids but shard "
                            f"'{path}' was written with vocab_size={shard_vocab}")
    else:
        if tokenizer_path is None or not Path(tokenizer_path).is_file():
            # (`tokenizer_path` is build_data's argument; a run's is RUN_DIR/tokenizer.)
            _refuse_bpe_on_byte_shard(path, info)
            raise UserError(
                f"data.tokenizer='bpe': shard '{path}' needs the tokenizer file it was "
                "written with, not a newly trained one; give it as --tokenizer FILE.json")
        tok = build_tokenizer("bpe", vocab_size=bpe_vocab, path=tokenizer_path)
        if tok.vocab_size != shard_vocab:
            raise UserError(
                f"data.tokenizer='bpe': '{tokenizer_path}' has {tok.vocab_size} ids but shard "
                f"'{path}' was written with vocab_size={shard_vocab}")
    want = (info.get("meta") or {}).get("tokenizer")
    if want is not None and want != tok.fingerprint:
        raise UserError(
            f"data.tokenizer={tokenizer!r}: fingerprint {tok.fingerprint} differs from the "
            f"{want} that shard '{path}' was written with")
    tokens = read_token_shard(path)
    train, held = split_tokens(tokens, holdout_every)
    # Content-free on purpose (hashing a large shard costs a full read): sidecar + split.
    side = json.dumps(info, sort_keys=True) + f"|holdout_every={holdout_every}"
    fingerprint = "shard-" + hashlib.sha256(side.encode()).hexdigest()[:16]
    corpus = TokenCorpus(train, held, shard_vocab, str(path), fingerprint,
                         extra={"cached": False})
    return corpus, tok


def _refuse_bpe_on_byte_shard(path: Path, info: dict[str, Any]) -> None:
    """`--tokenizer bpe` on a shard the byte tokenizer wrote (`meshtron tokenize`'s default):
    the refusal asked for "the tokenizer file it was written with", which does not exist
    (session-52 user audit); it names the byte tokenizer instead."""
    written = (info.get("meta") or {}).get("tokenizer")
    if written == ByteTokenizer().fingerprint or (
            written is None and int(info["vocab_size"]) == BYTE_VOCAB):
        raise UserError(f"data.tokenizer='bpe': shard '{path}' was written with the byte "
                        f"tokenizer ({BYTE_VOCAB} ids); allowed: --tokenizer byte (the "
                        "default: drop --tokenizer)")


class Data:
    """What `build_data` returns: this rank's training loader and held-out batches.

    Unpacks as `(train, eval)`; also forwards the common calls (`next_batch`, `eval_batches`,
    `state_dict`, `load_state_dict`) so a training loop can hold just this object.
    """

    def __init__(self, train: TrainLoader, eval: EvalBatches,
                 tokenizer: ByteTokenizer | BPETokenizer, info: dict[str, Any]) -> None:
        self.train, self.eval, self.tokenizer, self.info = train, eval, tokenizer, info

    def __iter__(self) -> Iterator[Any]:
        return iter((self.train, self.eval))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def seq_len(self) -> int:
        return self.train.seq_len

    @property
    def global_batch(self) -> int:
        return self.train.global_batch

    @property
    def local_batch(self) -> int:
        return self.train.local_batch

    def next_batch(self) -> Batch:
        """This rank's next (inputs, targets), [global_batch/dp_size, seq_len] int64 each."""
        return self.train.next_batch()

    def eval_batches(self) -> list[Batch]:
        """The fixed held-out batches (this rank's rows), materialised."""
        return list(self.eval)

    def state_dict(self) -> dict[str, int]:
        return self.train.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state)

    def __repr__(self) -> str:
        i = self.info
        return (f"Data(source={i['source']!r}, tokenizer={self.tokenizer!r}, "
                f"train_tokens={i['train_tokens']}, eval_tokens={i['eval_tokens']}, "
                f"seq_len={self.seq_len}, global_batch={self.global_batch}, "
                f"local_batch={self.local_batch})")


def build_data(source: str | Path = STDLIB, tokenizer: str = "byte", seq_len: int = 256,
               global_batch: int = 16, seed: int = 0, dp_rank: int = 0, dp_size: int = 1, *,
               bpe_vocab: int | None = None, tokenizer_path: str | Path | None = None,
               eval_batches: int = 4, holdout_every: int = DEFAULT_HOLDOUT_EVERY,
               max_bytes: int = DEFAULT_MAX_BYTES, cache_dir: str | Path | None = None,
               jsonl_field: str = "text") -> Data:
    """This data-parallel rank's training loader and fixed held-out batches.

    source: 'stdlib' (default, the embedded corpus), a text file, a directory of text files,
        a .jsonl file (documents under `jsonl_field`) or a .bin token shard.
    tokenizer: 'byte' (vocab 259; `bpe_vocab` ignored) or 'bpe' (byte-level BPE with `bpe_vocab`
        ids, trained locally on the training documents; loaded from / saved to `tokenizer_path`).
    seq_len; global_batch: sequences per optimizer step over all ranks; seed: data order;
    dp_rank / dp_size: this rank's slice, rows [r*B/dp, (r+1)*B/dp) of every global batch.
    eval_batches: held-out batches of `global_batch` rows, sliced per rank like training ones;
        0 (evaluation off): the held-out split may then hold less than one sequence.

    Returns a `Data`, which unpacks as `(train_loader, eval_batches)`.
    """
    from meshtron.data.dataset import (DistributedBatchSampler, EvalBatches, TokenDataset,
                                       TrainLoader, check_dp)

    check_dp(global_batch, dp_rank, dp_size)  # fail fast, before any reading
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise UserError(f"data.seq_len={seq_len!r}: must be a positive integer")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UserError(f"train.seed={seed!r}: must be a non-negative integer")
    warnings: list[str] = []
    corpus, tok = load_corpus(source, tokenizer, bpe_vocab=bpe_vocab,
                              tokenizer_path=tokenizer_path, holdout_every=holdout_every,
                              max_bytes=max_bytes, cache_dir=cache_dir, jsonl_field=jsonl_field,
                              warnings=warnings)
    train_ds = TokenDataset(corpus.train, seq_len, name="train")
    _check_held_out(corpus, seq_len, holdout_every, eval_batches)
    eval_ds = TokenDataset(corpus.eval, seq_len, name="held-out", required=False)
    if global_batch > train_ds.num_windows:
        # A step larger than the whole training set is a typo, not a plan (and would try to
        # materialise that many held-out rows).
        raise UserError(f"data.global_batch={global_batch}: larger than the training set "
                        f"({train_ds.num_windows} sequences of {seq_len} tokens in "
                        f"{source}); lower it (--global-batch) or add data")
    sampler = DistributedBatchSampler(train_ds.num_windows, global_batch, seed, dp_rank, dp_size)
    info: dict[str, Any] = {**corpus.info(), "tokenizer": tokenizer_info(tok), "seq_len": seq_len,
                            "train_windows": train_ds.num_windows,
                            "eval_windows": eval_ds.num_windows, "warnings": warnings}
    loader = TrainLoader(train_ds, sampler, tokenizer=tok, info=info)
    evals = EvalBatches(eval_ds, global_batch, eval_batches, dp_rank, dp_size)
    return Data(loader, evals, tok, info)


def _check_held_out(corpus: TokenCorpus, seq_len: int, holdout_every: int,
                    eval_batches: int) -> None:
    """With evaluation on, the held-out split must hold one sequence; say what would help."""
    held = len(corpus.eval)
    if eval_batches == 0 or held > seq_len:
        return
    share = (f"every {holdout_every}th document" if corpus.num_eval_documents
             else f"the last 1/{holdout_every} of its tokens")
    shorter = f", --seq-len {held - 1} or less" if held > 1 else ""
    raise UserError(
        f"data.seq_len={seq_len}: the held-out split of '{corpus.source}' ({share}) holds "
        f"{held} tokens, fewer than one sequence of seq_len+1={seq_len + 1}; add data{shorter}, "
        "or turn evaluation off (--eval-every 0: the held-out split is then never read)")
