"""A checkpoint as one unsharded state dict, in one process without a process group (for
`meshtron export` and inspection): whatever layout wrote it, the shards are stitched back by
DCP's own metadata into full tensors keyed by meshtron's parameter names."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from meshtron.checkpoint import store
from meshtron.errors import UserError


def latest_checkpoint(path: str | Path) -> Path:
    """The newest complete checkpoint under `path` (a run folder, its checkpoints/ folder, or a
    checkpoint folder itself, which is then verified). Raises UserError when there is none."""
    return newest_intact(path)[0]


def newest_intact(path: str | Path, who: str | None = None) -> tuple[Path, int]:
    """(folder, step) of `latest_checkpoint`; with `who` (e.g. 'meshtron export'), a damaged
    newer checkpoint skipped to reach it is said in one line on stderr, as `meshtron train`
    says it on resume."""
    path = Path(path)
    if (path / store.MANIFEST).exists() or (path / ".metadata").exists():
        problem = store.verify(path)
        if problem:
            raise UserError(f"checkpoint {path}: {problem}")
        return path, int(store.read_meta(path)["step"])
    root = path if path.name == "checkpoints" else store.checkpoint_root(path)
    found = store.find_latest(root)
    if found.path is None:
        why = "; ".join(f"{a}: {b}" for a, b in found.rejected) or "none saved"
        raise UserError(f"{path}: no complete checkpoint ({why})")
    if who and found.rejected:
        print(f"{who}: {found.skipped()}", file=sys.stderr, flush=True)
    return found.path, found.step


def load_full_state_dict(path: str | Path, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of the newest complete checkpoint under `path`, keyed by
    the plain model's parameter names (e.g. 'layers.0.attn.wq.weight'); with `optimizer`, also
    'optim.state.<name>.<exp_avg|exp_avg_sq|step>'. Loads on the CPU."""
    return load_checkpoint(latest_checkpoint(path), optimizer)


def load_checkpoint(folder: Path, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """`load_full_state_dict` of one checkpoint folder already verified (not hashed again)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    names = [k for k, v in reader.read_metadata().state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)
             and (k.startswith("model.") or optimizer and k.startswith("optim."))]
    loaded: dict = {}
    # The private entry point, as DCP's own dcp_to_torch_save uses it: the public `load` copies
    # the (empty) dict it is given and so cannot return the keys the planner adds.
    _load_state_dict(loaded, storage_reader=reader,
                     planner=_EmptyStateDictLoadPlanner(keys=set(names)), no_dist=True)
    flat: dict[str, torch.Tensor] = {}
    _flatten(loaded, "", flat)
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in flat.items()
            if k in set(names)}


def _flatten(tree: dict, prefix: str, out: dict) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(value, name + ".", out)
        else:
            out[name] = value
