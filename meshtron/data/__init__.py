"""Data: tokenizers, readers, the embedded stdlib corpus and the deterministic DP sampler.

Entry point: `build_data(source, tokenizer, seq_len, global_batch, seed, dp_rank, dp_size)`
returns `(TrainLoader, EvalBatches)`; see `meshtron.data.pipeline`.
"""

from meshtron.data.corpus import (
    DEFAULT_HOLDOUT_EVERY,
    DEFAULT_MAX_BYTES,
    TokenCorpus,
    build_token_corpus,
    load_stdlib_corpus,
    split_documents,
    split_tokens,
    stdlib_documents,
    stdlib_files,
    stdlib_root,
)
from meshtron.data.pipeline import Data, build_data, load_corpus, source_kind
from meshtron.data.sources import (
    TEXT_SUFFIXES,
    list_text_files,
    read_jsonl,
    read_text_files,
    read_token_shard,
    shard_info,
    write_token_shard,
)
from meshtron.data.tokenizer import (
    BYTE_VOCAB,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    token_dtype,
    tokenizer_info,
)

# The dataset's names (torch tensors) load on first use (PEP 562),
# so that `meshtron train --nproc N`'s launcher, which reads tokenizers and corpora but builds
# no batches, starts its ranks without importing torch.
_LAZY = {
    **dict.fromkeys(("Batch", "DistributedBatchSampler", "EvalBatches", "TokenDataset",
                     "TrainLoader", "check_dp", "epoch_permutation", "split_micro_batches"),
                    "meshtron.data.dataset"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshtron.data' has no attribute {name!r}")


__all__ = [
    "BYTE_VOCAB", "Batch", "Data", "BPETokenizer", "ByteTokenizer", "DEFAULT_HOLDOUT_EVERY",
    "DEFAULT_MAX_BYTES", "DistributedBatchSampler", "EvalBatches", "TEXT_SUFFIXES", "TokenCorpus",
    "TokenDataset", "Tokenizer", "TrainLoader", "build_data", "build_token_corpus",
    "build_tokenizer", "check_dp", "epoch_permutation", "list_text_files", "load_corpus",
    "load_stdlib_corpus", "read_jsonl", "read_text_files", "read_token_shard", "shard_info",
    "source_kind", "split_documents", "split_micro_batches", "split_tokens", "stdlib_documents",
    "stdlib_files", "stdlib_root", "token_dtype", "tokenizer_info", "write_token_shard",
]
