"""The run's data, built and checked: the one function the launching parent (before any rank
starts: a bad path is one line, not N tracebacks), the one process and every rank call.

Torch-free (the data pipeline builds numpy windows and a sampler; tensors are made per batch),
so that `meshtron train --nproc N`'s parent on a node without a GPU starts its ranks without
importing torch (launch.py).
"""

from __future__ import annotations

import sys

from meshtron.config import RunConfig
from meshtron.errors import UserError


def build_run_data(cfg: RunConfig, dp_rank: int = 0, dp_size: int = 1, main: bool = True,
                   barrier=None, fresh: bool = True):
    """The data pipeline for this data-parallel rank, checked against the model's vocabulary.
    A BPE tokenizer is trained once, by the main rank (or the launching parent), into
    RUN_DIR/tokenizer/; the other ranks wait (`barrier()`) and load it. `fresh`: this run has
    not trained it yet (a file left by an earlier run in the folder is replaced); a fresh main
    build also prints the data's warnings (text that is not clean UTF-8), once per run.
    Evaluation off (train.eval_every=0): no held-out sequence is needed."""
    from meshtron.data import build_data
    from meshtron.data.tokenizer import run_tokenizer_path

    tok_path = run_tokenizer_path(cfg)
    if tok_path is not None and cfg.data.bpe_vocab > cfg.model.vocab:  # before training it
        raise UserError(f"model.vocab={cfg.model.vocab}: smaller than data.bpe_vocab="
                        f"{cfg.data.bpe_vocab} (the BPE tokenizer's ids)")
    if tok_path is not None and main and fresh:
        tok_path.unlink(missing_ok=True)  # an earlier run's (--overwrite): train afresh
    if tok_path is not None and not main and barrier is not None:
        barrier()

    def build():
        return build_data(source=cfg.data.source, tokenizer=cfg.data.tokenizer,
                          seq_len=cfg.data.seq_len, global_batch=cfg.data.global_batch,
                          seed=cfg.train.seed, dp_rank=dp_rank, dp_size=dp_size,
                          eval_batches=cfg.data.eval_batches if cfg.train.eval_every else 0,
                          bpe_vocab=cfg.data.bpe_vocab,
                          tokenizer_path=tok_path, jsonl_field=cfg.data.json_key)

    made = tok_path is not None and main and not tok_path.parent.exists()
    try:
        data = build()
    except UserError:
        if made:  # nothing half-written: the folder this call created goes
            import shutil

            shutil.rmtree(tok_path.parent, ignore_errors=True)
        raise
    if tok_path is not None and main and barrier is not None:
        barrier()
    if main and fresh:  # once per run: the launching parent, or the one process
        from meshtron.data.text_check import warning_lines

        for line in warning_lines(data.info["warnings"]):
            print(f"meshtron train: warning: {line}", file=sys.stderr, flush=True)
    if data.vocab_size > cfg.model.vocab:
        raise UserError(f"model.vocab={cfg.model.vocab}: smaller than the tokenizer's "
                        f"{data.vocab_size} ids")
    return data
