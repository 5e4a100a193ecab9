"""The trainer's hooks into meshtron.hf: `--init-from` (fill the shards from a checkpoint
instead of the seed) and `--export` (write a Hugging Face folder at the end of the run).
Each is one call from the trainer, so the training loop stays unaware of file formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from meshtron.config import RunConfig


def check_job(cfg: RunConfig) -> None:
    """Validate `train.init_from` (headers, names, shapes) and `train.export` before any rank
    starts: bad input is one line naming the tensor or folder, exit code 2."""
    if cfg.train.init_from:
        from meshtron.hf.load import check_checkpoint

        check_checkpoint(cfg.train.init_from, cfg.model)
    if cfg.train.export:
        from meshtron.hf.export import export_type, prepare_export_dir

        export_type(cfg.model, source_config(cfg), "train.export")
        prepare_export_dir(cfg.train.export, run_dir=cfg.train.run_dir)


def hf_fill(cfg: RunConfig) -> Callable[[list[Any]], None] | None:
    """The `fill` for `parallelize`: read this rank's shards from `train.init_from`."""
    if not cfg.train.init_from:
        return None

    def fill(parts: list[Any]) -> None:
        from meshtron.hf.load import load_into

        load_into(parts, cfg.train.init_from, cfg.model)

    return fill


def source_config(cfg: RunConfig) -> dict[str, Any] | None:
    """The config.json of `train.init_from`, kept for the export (its other fields: token ids,
    generation settings, architecture name)."""
    if not cfg.train.init_from:
        return None
    path = Path(cfg.train.init_from) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def tokenizer_source(cfg: RunConfig, run_dir: Path) -> Path | None:
    """Where the run's tokenizer files are: the run folder's copy, else the checkpoint's."""
    folders = [run_dir / "tokenizer"] + ([Path(cfg.train.init_from)] if cfg.train.init_from
                                         else [])
    return next((f for f in folders if (f / "tokenizer.json").is_file()), None)


def export_at_end(cfg: RunConfig, run_dir: Path, pm=None, model=None) -> None:
    """Write the trained weights to `train.export` (collective when `pm` is a ParallelModel),
    with export.json naming this run and its last step."""
    if not cfg.train.export:
        return
    from meshtron.hf.export import export_parallel, save_hf
    from meshtron.hf.origin import origin_record

    tok = tokenizer_source(cfg, run_dir)
    # the loop always ends at step train.steps; written before the weights' commit
    origin = origin_record(run_dir, cfg.train.steps, cfg.train.init_from, cfg.train.seed)
    if pm is not None:
        export_parallel(pm, cfg.model, cfg.train.export, source_config(cfg), tok,
                        origin=origin)
    else:
        save_hf(dict(model.named_parameters()), cfg.model, cfg.train.export,
                source_config(cfg), tok, field="train.export", origin=origin)
