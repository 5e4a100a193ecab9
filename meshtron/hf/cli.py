"""`meshtron export RUN_DIR --to DIR [--step N]`: a run's checkpoint as a Hugging Face folder.

Reads a torch.distributed.checkpoint (DCP) checkpoint of the run, whatever layout saved it (the
shards are stitched into full tensors by DCP's own metadata, in this one process, without a
process group), keeps the model tensors (keys `model.<name>` or plain parameter names) and
writes them with `save_hf`: safetensors + config.json (+ the run's tokenizer files).
Checkpoints are the folders under RUN_DIR/checkpoints/ holding DCP's `.metadata`; the step is
the last number in a folder's name; the newest is taken unless `--step` names one.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from meshtron.argtypes import positive_int
from meshtron.errors import UserError

CHECKPOINTS = "checkpoints"


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, int]:
    """(folder, step) of the newest complete checkpoint, or of `step`."""
    root = run_dir / CHECKPOINTS
    found: dict[int, Path] = {}
    if root.is_dir():
        for folder in root.iterdir():
            digits = re.findall(r"\d+", folder.name)
            if folder.is_dir() and digits and (folder / ".metadata").is_file():
                found[int(digits[-1])] = folder
    if not found:
        raise UserError(f"export RUN_DIR={str(run_dir)!r}: no complete checkpoint under "
                         f"{str(root)!r} (save some with the run's checkpointing)")
    if step is None:
        step = max(found)
    if step not in found:
        raise UserError(f"export --step={step}: no checkpoint of that step; steps saved: "
                         f"{', '.join(map(str, sorted(found)))}")
    return found[step], step


def load_model_state(folder: Path) -> dict:
    """Full model tensors of a DCP checkpoint folder, keyed by meshtron parameter names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = dcp.FileSystemReader(str(folder))
    names = {k for k, v in reader.read_metadata().state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and not k.startswith(("optim", "optimizer"))}
    loaded: dict = {}
    # DCP's own dcp_to_torch_save uses this entry point: it loads without a process group and
    # returns the keys the planner adds (the public `load` fills only the keys it is given).
    _load_state_dict(loaded, storage_reader=reader,
                     planner=_EmptyStateDictLoadPlanner(keys=names), no_dist=True)
    flat: dict = {}
    _flatten(loaded, "", flat)
    return {k.removeprefix("model."): v for k, v in flat.items() if k in names}


def _flatten(tree: dict, prefix: str, out: dict) -> None:
    for key, value in tree.items():
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", out)
        else:
            out[f"{prefix}{key}"] = value


def run_config(run_dir: Path):
    """The run's resolved configuration: run.toml (multi-rank runs) or config.json."""
    import json

    from meshtron.config import config_from_dict, load_toml

    if (run_dir / "run.toml").is_file():
        return config_from_dict(load_toml(run_dir / "run.toml", "run.toml"))
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"export RUN_DIR={str(run_dir)!r}: no run.toml or config.json (not a "
                         "meshtron run folder)")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"export RUN_DIR={str(run_dir)!r}: {path} is not valid JSON") from None
    sections = ("model", "data", "optim", "train")
    return config_from_dict({k: ({f: v for f, v in doc[k].items() if v is not None}
                                 if isinstance(doc[k], dict) else doc[k])
                             for k in sections if k in doc})


def cmd_export(args: argparse.Namespace) -> int:
    from meshtron.hf.export import prepare_export_dir, save_hf
    from meshtron.hf.hooks import source_config, tokenizer_source
    from meshtron.hf.names import check_supported

    run_dir = Path(args.run_dir)
    cfg = run_config(run_dir)
    check_supported(cfg.model, "export")
    prepare_export_dir(args.to, "export --to")
    folder, step = find_checkpoint(run_dir, args.step)
    state = load_model_state(folder)
    out = save_hf(state, cfg.model, args.to, source_config(cfg), tokenizer_source(cfg, run_dir))
    print(f"exported step {step} of {run_dir} ({len(state)} tensors) to {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder",
                       description="Consolidate a run's checkpoint (any layout) into "
                                   "safetensors + config.json that transformers loads.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds run.toml and "
                   "checkpoints/)")
    p.add_argument("--to", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--step", type=positive_int, help="the checkpoint's step (default: newest)")
    p.set_defaults(func=cmd_export)
