"""The inputs of `meshtron merge`: dense runs (a run folder with checkpoints) or exported weights
(a Hugging Face folder), described from their small files first and checked against each other
before any tensor is read, then loaded one at a time as full CPU tensors in meshtron names.

A branch's base (what it started from) is known for run folders: the `train.init_from` folder
it was trained from (identified by the SHA-256 of its weight files, so a copy of the base is
the same base), or the seed of the deterministic initialization when it started from scratch.
Exported weights record it in export.json (meshtron/hf/origin.py), with the run and step they
are of; weights from elsewhere do not. For them, and as a second guard for all, `check_close`
refuses branches whose shared weights lie farther apart than two independent initializations'
halfway point (see RELATIVE_DISTANCE_LIMIT).

A branch is known by what it is: the run it was trained in and the step of its weights,
whichever folder holds them (the run's checkpoint, an export of it, the run through a symlink or
another spelling of its path, the run folder moved or renamed since). The run is its id
(run.toml's `train.run_id`, recorded in export.json: meshtron/checkpoint/run_id.py); a run or
export from before the id is known by its resolved folder and configuration digest instead, and
weights of unknown origin by their resolved folder. `check_distinct` refuses one model given
twice before a tensor is read, and `check_not_same` refuses, as the tensors are read, a branch
whose every tensor equals an earlier one's (a copied run or export, which no record links).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.argtypes import folder_problem
from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec

FIELD = "merge --experts"

RELATIVE_DISTANCE_LIMIT = 1.0
"""Largest ||W_i - W_0|| / ||W_0|| over the matrices every branch shares (attention, embeddings,
head) for branches of one base. Two independent draws of the same initialization are sqrt(2)
apart; fine-tuned branches of one base stay far below (0.32 in bench/btx.py's last run)."""


@dataclass(frozen=True)
class Branch:
    """One input of a merge, described without reading its tensors."""

    path: Path
    """The folder given on the command line."""
    kind: str
    """'run' (a meshtron run folder: run.toml or config.json, and checkpoints/) or 'weights'
    (an exported Hugging Face folder: config.json and *.safetensors)."""
    spec: ModelSpec
    """The dense model it holds."""
    base: str | None
    """What it started from: 'init:<sha256 of the base's weights>', 'seed:<seed>', or None
    (exported weights record no origin)."""
    tokenizer: str | None
    """'byte', 'sha256:<digest of tokenizer.json>', or None when unknown."""
    tokenizer_dir: Path | None
    """A folder holding its tokenizer.json (copied next to the merged weights), if any."""
    run: str | None = None
    """The resolved run folder its weights were trained in (a run: itself; exported weights:
    their export.json's record), None when unknown."""
    step: int | None = None
    """The step of its weights (a run: of the checkpoint `with_checkpoint` chose; exported
    weights: their record's), None when unknown."""
    config: str | None = None
    """'sha256:<digest>' of its run's configuration file (origin.config_digest; exported
    weights: their record's), None when unknown: which run held the folder `run` names."""
    run_id: str | None = None
    """The run's id (its run.toml's `train.run_id`; exported weights: their record's), None
    when unknown (recorded before the id existed)."""
    checkpoint: Path | None = None
    """A run's checkpoint folder to merge (`with_checkpoint`), None for exported weights."""
    given: str = ""
    """The folder as the command line spelled it (named in errors)."""

    @property
    def label(self) -> str:
        return repr(self.given or str(self.path))


def describe(path: str | Path) -> Branch:
    """Read a branch's configuration (not its weights); UserError naming the folder when it is
    neither a run folder with a checkpoint nor exported weights."""
    folder = Path(path)
    if (problem := folder_problem(folder)) is not None:
        raise UserError(f"{FIELD}={str(path)!r}: {problem} (give a run folder with "
                        "checkpoints/ or an exported weights folder)")
    if (folder / "run.toml").is_file() or (folder / "checkpoints").is_dir():
        return dataclasses.replace(_describe_run(folder), given=str(path))
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return dataclasses.replace(_describe_weights(folder), given=str(path))
    step = folder.resolve().name.removeprefix("step_")
    if (folder / "meta.json").is_file() and step.isdigit():
        raise UserError(f"{FIELD}={str(path)!r}: is one checkpoint of a run; give the run "
                        f"folder (its newest intact checkpoint is merged) or, for this step, "
                        f"`meshtron export {folder.resolve().parent.parent} --step {int(step)} "
                        "--to DIR` and DIR")
    raise UserError(f"{FIELD}={str(path)!r}: neither a meshtron run folder (run.toml and "
                    "checkpoints/) nor exported weights (config.json and *.safetensors)")


def _describe_run(folder: Path) -> Branch:
    from meshtron.checkpoint import store
    from meshtron.checkpoint.run_id import folder_run_id
    from meshtron.hf.cli import run_config
    from meshtron.hf.hooks import tokenizer_source
    from meshtron.hf.origin import config_digest, recorded_path

    cfg = run_config(folder, FIELD)
    root = store.checkpoint_root(folder)
    if not (root.is_dir() and store.committed(root)):
        raise UserError(f"{FIELD}={str(folder)!r}: the run saved no checkpoint (train it with "
                        "--checkpoint-every N, or give its --export folder)")
    if cfg.train.init_from:  # relative to the folder the run was trained in, not today's
        base = _base_of(recorded_path(cfg.train.init_from, folder, cfg.train.run_dir))
    else:
        base = f"seed:{cfg.train.seed}"
    tok_dir = tokenizer_source(cfg, folder)
    if tok_dir is not None:
        tok = "sha256:" + _sha256(tok_dir / "tokenizer.json")
    elif cfg.data.tokenizer == "byte":
        tok = "byte"
    else:
        tok = None
    return Branch(folder, "run", cfg.model, base, tok, tok_dir, run=str(folder.resolve()),
                  config=config_digest(folder), run_id=folder_run_id(folder))


def _describe_weights(folder: Path) -> Branch:
    from meshtron.hf.load import Checkpoint, model_shapes
    from meshtron.hf.origin import read_origin

    spec = _weights_spec(folder)
    # every tensor's name, shape and bytes checked now (headers only), before any is read
    Checkpoint(folder, f"{FIELD}={str(folder)!r}").check(spec, model_shapes(spec))
    tok_file = folder / "tokenizer.json"
    tok = "sha256:" + _sha256(tok_file) if tok_file.is_file() else None
    origin = read_origin(folder, FIELD)
    if origin is None:
        return Branch(folder, "weights", spec, None, tok, folder if tok_file.is_file() else None)
    base = (_base_of(Path(origin["init_from"])) if origin["init_from"]
            else f"seed:{origin['seed']}")
    return Branch(folder, "weights", spec, base, tok, folder if tok_file.is_file() else None,
                  run=origin["run"], step=origin["step"], config=origin.get("config"),
                  run_id=origin.get("run_id"))


def _weights_spec(folder: Path) -> ModelSpec:
    """The dense model an exported folder's config.json describes."""
    import json

    from meshtron.model.hf_config import from_hf_dict

    path = folder / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise UserError(f"{FIELD}={str(folder)!r}: {path} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{FIELD}={str(folder)!r}: {path} must hold a JSON object")
    return from_hf_dict(doc, name=folder.resolve().name)


def _base_of(base: Path) -> str:
    """The identity of a base folder: the SHA-256 of its weight files (names and bytes), so a
    copy of the base is the same base; its resolved path when it is gone."""
    files = sorted(base.glob("*.safetensors")) if base.is_dir() else []
    if not files:
        return f"path:{base.resolve()}"
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(_sha256(f).encode())
    return "init:" + h.hexdigest()


def _sha256(path: Path) -> str:
    from meshtron.checkpoint.store import file_digest

    return file_digest(path)


def check_compatible(branches: list[Branch]) -> None:
    """Every branch dense, SwiGLU, of the first one's shapes and vocabulary, tokenizer and base;
    the first mismatch is one line naming both folders and the field."""
    first = branches[0]
    for b in branches:
        if b.spec.is_moe:
            raise UserError(f"{FIELD}={str(b.path)!r}: is already a mixture of experts "
                            f"(model.moe_experts={b.spec.moe_experts}); give dense models")
        if b.spec.mlp != "swiglu":
            raise UserError(f"{FIELD}={str(b.path)!r}: model.mlp={b.spec.mlp!r}; experts are "
                            "SwiGLU, so only SwiGLU dense models merge")
    for b in branches[1:]:
        diff = _spec_difference(first.spec, b.spec)
        if diff:
            field, mine, theirs = diff
            raise UserError(f"{FIELD}={str(b.path)!r}: model.{field}={theirs!r} but "
                            f"{str(first.path)!r} has {mine!r}: branches must have the same "
                            "shapes and vocabulary")
        if b.tokenizer and first.tokenizer and b.tokenizer != first.tokenizer:
            raise UserError(f"{FIELD}={str(b.path)!r}: tokenizer {b.tokenizer[:19]} differs "
                            f"from {str(first.path)!r}'s {first.tokenizer[:19]}: branches "
                            "must share one tokenizer")
        if _known(b.base) and _known(first.base) and b.base != first.base:
            raise UserError(f"{FIELD}={str(b.path)!r}: started from {b.base[:24]} but "
                            f"{str(first.path)!r} from {first.base[:24]}: branches must "
                            "share one base")


def _known(base: str | None) -> bool:
    """A base compared with others: its weights' digest or its seed. A base folder that is not
    on this machine ('path:', a run or export trained elsewhere, or a base since moved or
    removed) says nothing about its weights: two copies of one base on two machines have two
    paths, and one path on two machines can hold two bases; `check_close` still guards."""
    return bool(base) and not base.startswith("path:")


def _spec_difference(a: ModelSpec, b: ModelSpec) -> tuple[str, Any, Any] | None:
    for f in dataclasses.fields(ModelSpec):
        # train_notes: warnings of the config.json read (dropout), not shapes
        if f.name not in ("name", "train_notes") and getattr(a, f.name) != getattr(b, f.name):
            return f.name, getattr(a, f.name), getattr(b, f.name)
    return None


def with_checkpoint(branch: Branch) -> Branch:
    """A run branch with its newest intact checkpoint and that checkpoint's step (a damaged
    newer one skipped is said on stderr); exported weights as they are."""
    if branch.kind != "run":
        return branch
    from meshtron.checkpoint.export import newest_intact

    try:
        folder, step = newest_intact(branch.path, f"meshtron merge: {branch.path}")
    except UserError as exc:
        raise UserError(f"{FIELD}={str(branch.path)!r}: {exc}") from None
    return dataclasses.replace(branch, checkpoint=folder, step=step)


def same_model(a: Branch, b: Branch) -> str | None:
    """What two branches both are, or None when they differ: one run at one step, whichever
    folders hold it: by the run's id when both know it (the folder may have moved since), else
    by its folder (and, when both know it, one configuration file: another run trained in the
    same folder later, or at the same path on another machine, is another model); or one
    folder."""
    if None not in (a.run_id, a.step, b.run_id, b.step):
        same = (a.run_id, a.step) == (b.run_id, b.step)
        return f"run {a.run_id} at step {a.step}" if same else None
    if None not in (a.run, a.step, b.run, b.step):
        same = (a.run, a.step) == (b.run, b.step) and (
            a.config is None or b.config is None or a.config == b.config)
        return f"run {a.run} at step {a.step}" if same else None
    folder = a.path.resolve()
    return f"folder {folder}" if folder == b.path.resolve() else None


def check_distinct(branches: list[Branch]) -> None:
    """No model twice: the first two inputs that are one model, named in one line."""
    for i, b in enumerate(branches):
        for earlier in branches[:i]:
            what = same_model(earlier, b)
            if what:
                raise UserError(f"{FIELD}: {earlier.label} and {b.label} are one model "
                                f"({what}), given twice; give different branches (use "
                                "--copies to repeat one model's MLP)")


def check_not_same(branch: Branch, state: dict[str, Any],
                   earlier: list[tuple[Branch, dict[str, Any]]]) -> None:
    """Refuse a branch whose every tensor equals an earlier branch's: the same model under
    another name (a copied run folder or export)."""
    import torch

    for other, other_state in earlier:
        if state.keys() == other_state.keys() and all(
                torch.equal(state[n], t) for n, t in other_state.items()):
            raise UserError(f"{FIELD}: {other.label} and {branch.label} hold the "
                            "same weights, tensor for tensor: one model given twice; give "
                            "different branches (use --copies to repeat one model's MLP)")


def load_state(branch: Branch) -> dict[str, Any]:
    """Full CPU tensors of a branch, keyed by meshtron's parameter names (a run: the checkpoint
    `with_checkpoint` chose, or its newest intact one; exported weights: every tensor, read
    through safetensors)."""
    import torch

    if branch.kind == "run":
        from meshtron.checkpoint.export import load_checkpoint, load_full_state_dict

        return (load_checkpoint(branch.checkpoint) if branch.checkpoint
                else load_full_state_dict(branch.path))
    from meshtron.hf.load import Checkpoint, model_shapes
    from meshtron.model.init import BLOCK_ELEMS

    ckpt = Checkpoint(branch.path)
    shapes = model_shapes(branch.spec)
    out = {}
    for name, src in ckpt.check(branch.spec, shapes).items():
        target = torch.empty(shapes[name], dtype=torch.float32, device="cpu")
        ckpt.read_into(src, target, (0,) * target.dim(), BLOCK_ELEMS)
        out[name] = target
    return out


def read_branch(branch: Branch) -> tuple[Branch, dict[str, Any]]:
    """(the branch as read, its `load_state`): a run's checkpoint that its live run's retention
    removed after `with_checkpoint` chose it is replaced by the newest complete one again
    (checkpoint/export.py `read_newest`, a bounded number of tries), and the branch then names
    the checkpoint read."""
    if branch.kind != "run" or branch.checkpoint is None:
        return branch, load_state(branch)
    from meshtron.checkpoint.export import load_checkpoint, read_newest, vanished

    try:
        return branch, load_state(branch)
    except Exception as exc:  # noqa: BLE001 - DCP wraps a reader's error in its own
        if branch.checkpoint.is_dir() or not vanished(exc):
            raise
    state, folder, step = read_newest(branch.path, load_checkpoint,
                                      f"meshtron merge: {branch.path}")
    return dataclasses.replace(branch, checkpoint=folder, step=step), state


def check_close(branch: Branch, state: dict[str, Any], first: Branch,
                first_state: dict[str, Any]) -> float:
    """The relative distance of `state` from `first_state` over the matrices they share (not
    the MLPs, which branches specialise); UserError above RELATIVE_DISTANCE_LIMIT."""
    num = den = 0.0
    for name, t in first_state.items():
        if t.dim() >= 2 and ".feed_forward." not in name:
            num += float((state[name].double() - t.double()).pow(2).sum())
            den += float(t.double().pow(2).sum())
    dist = (num / den) ** 0.5 if den else 0.0
    if dist > RELATIVE_DISTANCE_LIMIT:
        raise UserError(f"{FIELD}={str(branch.path)!r}: its attention and embedding weights "
                        f"are {dist:.2f} (relative) from {str(first.path)!r}'s, above "
                        f"{RELATIVE_DISTANCE_LIMIT}: not branches of one base")
    return dist
