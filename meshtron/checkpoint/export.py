"""A checkpoint as one unsharded state dict, in one process without a process group (for
`meshtron export` and inspection): whatever layout wrote it, the shards are stitched back by
DCP's own metadata into full tensors keyed by meshtron's parameter names."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

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
    return read_newest(path, lambda folder: load_checkpoint(folder, optimizer))[0]


LIVE_TRIES = 5
"""Reads of a live run's newest checkpoint: each try that loses its checkpoint to the run's
retention (`store.prune` keeps `--keep` of them, the oldest goes at each commit) takes the newest
again; after this many the reader gives up in one line."""


def read_newest(path: str | Path, read: Callable[[Path], Any], who: str | None = None,
                step: int | None = None) -> tuple[Any, Path, int]:
    """(read(folder), folder, step) of the newest complete checkpoint under `path` (or of
    `step`): a folder removed while it is read (a live run's rotation) is chosen again, up to
    LIVE_TRIES times. `who`: as in `newest_intact`."""
    for _ in range(LIVE_TRIES):
        folder, found = (newest_intact(path, who) if step is None
                         else _the_step(Path(path), step))
        try:
            return read(folder), folder, found
        except Exception as exc:  # noqa: BLE001 - DCP wraps a reader's error in its own
            if folder.is_dir() and store.verify(folder, deep=False) is None:
                raise  # the checkpoint is still whole: not a rotation, a real failure
            if not vanished(exc):
                raise
            if step is not None:
                raise UserError(f"checkpoint of step {step} under {path}: removed by the "
                                "live run's retention while it was read (--keep); export "
                                "a newer --step or the newest") from None
    raise UserError(f"{path}: the newest checkpoint was removed while it was read "
                    f"{LIVE_TRIES} times in a row (a live run saving faster than it can be "
                    "read); retry, or give --keep more checkpoints") from None


def vanished(exc: BaseException) -> bool:
    """`exc` (or what DCP wrapped in it) is a file that is not there any more."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileNotFoundError) or "No such file" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _the_step(path: Path, step: int) -> tuple[Path, int]:
    """The committed checkpoint of `step` under the run folder `path`, verified."""
    root = path if path.name == "checkpoints" else store.checkpoint_root(path)
    saved = dict(store.committed(root))
    if step not in saved:
        listed = ", ".join(map(str, sorted(saved))) or "none"
        raise UserError(f"export --step={step}: no checkpoint of that step; steps saved: {listed}")
    problem = store.verify(saved[step])
    if problem:
        raise UserError(f"export --step={step}: checkpoint {saved[step]} is damaged: {problem}")
    return saved[step], step


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Model tensor name (without 'model.') -> full shape, from DCP's metadata alone (no
    tensor is read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k[len("model."):]: tuple(v.size) for k, v in meta.items()
            if isinstance(v, TensorStorageMetadata) and k.startswith("model.")}


def check_model_matches(folder: Path, expected: dict[str, tuple[int, ...]],
                        where: str, aliases: dict[str, str] | None = None) -> None:
    """Refuse (one line) a checkpoint whose model tensors are not the ones `expected` (the run
    config's model, `hf.load.model_shapes`) names, with those shapes: a config of another run
    beside the checkpoint (`where` names it) would export a broken model. `aliases`: second
    names of one parameter (`hf.load.model_aliases`: a tied `output.weight`), which a
    checkpoint also holds, as the model's state_dict has them: accepted with their
    parameter's shape."""
    held = tensor_shapes(folder)
    for alias, name in (aliases or {}).items():
        if alias in held and alias not in expected and held[alias] == held.get(name):
            del held[alias]
    for name in sorted(set(expected) | set(held)):
        want, have = expected.get(name), held.get(name)
        if want is not None and have is not None and tuple(want) == have:
            continue
        if have is None:
            problem = f"the model of {where} has {name} {list(want)}, the checkpoint has none"
        elif want is None:
            problem = f"the checkpoint holds {name} {list(have)}, the model of {where} has none"
        else:
            problem = f"{name} is {list(have)} in the checkpoint, {list(want)} in {where}"
        raise UserError(f"checkpoint {folder}: does not match the run's model config: "
                        f"{problem} ({len(held)} tensors vs {len(expected)}); nothing written")


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
