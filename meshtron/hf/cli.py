"""`meshtron export RUN_DIR --to DIR [--step N]`: a run's checkpoint as a Hugging Face folder.

Reads a torch.distributed.checkpoint (DCP) checkpoint of the run, whatever layout saved it (the
shards are stitched into full tensors by DCP's own metadata, in this one process, without a
process group), keeps the model tensors (keys `model.<name>` or plain parameter names) and
writes them with `save_hf`: safetensors + config.json (+ the run's tokenizer files), and
export.json (the run and step they are of: meshtron/hf/origin.py).
Checkpoints are meshtron.checkpoint's committed folders under RUN_DIR/checkpoints/ (verified
against their manifest); the newest intact one is taken unless `--step` names one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshtron.argtypes import folder_problem, positive_int
from meshtron.errors import UserError

def run_config(run_dir: Path, field: str = "export RUN_DIR"):
    """The run's resolved configuration: run.toml (multi-rank runs) or config.json; errors
    name `field` (the option that gave the folder) and the file."""
    import json

    from meshtron.config import config_from_dict, load_toml

    if (problem := folder_problem(run_dir)) is not None:  # was "no run.toml or config.json"
        raise UserError(f"{field}={str(run_dir)!r}: {problem}; give a meshtron run folder")
    if (run_dir / "run.toml").is_file():
        return config_from_dict(load_toml(run_dir / "run.toml", field))
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{field}={str(run_dir)!r}: no run.toml or config.json (not a "
                         "meshtron run folder)")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{field}={str(run_dir)!r}: {path} is not valid JSON") from None
    sections = ("model", "data", "optim", "train")
    return config_from_dict({k: ({f: v for f, v in doc[k].items() if v is not None}
                                 if isinstance(doc[k], dict) else doc[k])
                             for k in sections if k in doc})


def cmd_export(args: argparse.Namespace) -> int:
    from meshtron.checkpoint.export import check_model_matches, load_checkpoint, read_newest
    from meshtron.hf.export import export_type, prepare_export_dir, save_hf
    from meshtron.hf.hooks import source_config, tokenizer_source
    from meshtron.hf.load import Checkpoint, model_aliases, model_shapes
    from meshtron.hf.origin import origin_record, recorded_path

    run_dir = Path(args.run_dir)
    _weights_already(run_dir)
    cfg = run_config(run_dir)
    export_type(cfg.model, source_config(cfg), "export")
    prepare_export_dir(args.to, "export --to")
    _no_checkpoint(run_dir)
    expected = model_shapes(cfg.model)
    source = run_dir / ("run.toml" if (run_dir / "run.toml").is_file() else "config.json")

    def read(folder: Path):
        check_model_matches(folder, expected, str(source),  # before any tensor is read
                            model_aliases(cfg.model))
        return load_checkpoint(folder)  # verified by read_newest

    # the newest complete checkpoint (or --step's), chosen again when a live run's retention
    # removes it while it is read
    state, _, step = read_newest(run_dir, read, "meshtron export", args.step)
    init = (str(recorded_path(cfg.train.init_from, run_dir, cfg.train.run_dir))
            if cfg.train.init_from else None)
    out = save_hf(state, cfg.model, args.to, source_config(cfg), tokenizer_source(cfg, run_dir),
                  origin=origin_record(run_dir, step, init, cfg.train.seed))
    # what the files hold: experts are one stacked tensor here, one per expert in HF, and a
    # tied head is not written twice
    written = len(Checkpoint(out, "export --to").shapes)
    print(f"exported step {step} of {run_dir} ({written} tensors) to {out}")
    return 0


def _weights_already(run_dir: Path) -> None:
    """Refuse (one line) a Hugging Face folder given as RUN_DIR (a merge's or an export's
    output): it is already what export writes, and read as a run it only lacked checkpoints."""
    if (run_dir / "run.toml").is_file() or not any(run_dir.glob("*.safetensors")):
        return
    made = ("a merge's output" if (run_dir / "merge.json").is_file() else
            "an export" if (run_dir / "export.json").is_file() else "weights")
    raise UserError(f"export RUN_DIR={str(run_dir)!r}: is a Hugging Face folder already "
                    f"({made}: config.json and *.safetensors), not a run folder; use it as it "
                    f"is, e.g. `meshtron train --init-from {run_dir}`")


def _no_checkpoint(run_dir: Path) -> None:
    """Refuse a run folder without any committed checkpoint (one line)."""
    from meshtron.checkpoint import store

    root = store.checkpoint_root(run_dir)
    if not store.committed(root):
        raise UserError(f"export RUN_DIR={str(run_dir)!r}: no complete checkpoint under "
                        f"{str(root)!r} (save some with --checkpoint-every)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder",
                       description="Consolidate a run's checkpoint (any layout) into "
                                   "safetensors + config.json that transformers loads.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds run.toml and "
                   "checkpoints/)")
    p.add_argument("--to", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--step", type=positive_int, help="the checkpoint's step (default: newest)")
    p.set_defaults(func=cmd_export)
