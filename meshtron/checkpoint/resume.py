"""What a resume must match: checks made before any tensor is loaded (one line each, exit 2).

`check_compatible`: the settings the checkpoint was saved with against this run's, for every
KEEP field of `resume_fields.FIELDS` (the ranks call it before loading, the launcher before
starting them); `recorded*`: what the command line takes from the checkpoint when a resume
omits a setting; `prepare_start`: the launcher's checks, before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtron.checkpoint import resume_fields as rf
from meshtron.checkpoint import store
from meshtron.checkpoint.config import CheckpointConfig
from meshtron.checkpoint.extend import check_steps, say_extended
from meshtron.errors import UserError

_SHAPE_IGNORED = ("name",)

_NO_PLAN = object()


def check_compatible(meta: dict[str, Any], cfg: Any, folder: Path, plan: Any = _NO_PLAN,
                     lr_override: bool = False) -> None:
    """Refuse (one line) a run whose KEEP settings (resume_fields.FIELDS) differ from those the
    checkpoint in `folder` was saved with: the model's shape field by field, then the run
    config's, then (when `plan` is given: a Plan, or None for one process) the plan's; and a
    train.steps whose schedule the steps taken did not follow, unless `lr_override`
    (--override-lr-schedule: checkpoint/extend.py)."""
    saved_cfg = meta.get("config", {})
    now_cfg = json.loads(json.dumps(cfg.to_dict(), default=str))
    _refuse_model_change(dict(saved_cfg.get("model", {})), now_cfg["model"], folder)
    for section in ("data", "optim", "train"):
        for key in rf.kept(section):
            if section in saved_cfg and key in saved_cfg[section]:  # else saved before it existed
                _refuse_change(f"{section}.{key}", saved_cfg[section][key],
                               now_cfg[section][key], folder)
    check_steps(meta, cfg, folder, lr_override)  # EXTEND (checkpoint/extend.py)
    if plan is not _NO_PLAN:
        saved_plan, now_plan = recorded_comm(meta), _comm_of(plan)
        for key in rf.kept("plan"):
            _refuse_change(f"plan.{key}", saved_plan[key], now_plan[key], folder,
                           flag="--" + key.replace("_", "-"))
        _refuse_residual_family(meta, plan, folder)


def check_model(meta: dict[str, Any], spec: Any, folder: Path,
                ignore: tuple[str, ...] = ()) -> None:
    """Refuse (one line) a model `spec` (a ModelSpec) other than the one the checkpoint in
    `folder` was saved with; the fields in `ignore` are not compared."""
    import dataclasses

    now = json.loads(json.dumps(dataclasses.asdict(spec), default=str))
    saved = dict(meta.get("config", {}).get("model", {}))
    _refuse_model_change({k: v for k, v in saved.items() if k not in ignore},
                         {k: v for k, v in now.items() if k not in ignore}, folder)


def _refuse_model_change(saved: dict[str, Any], now: dict[str, Any], folder: Path) -> None:
    """The model's shape field by field; when the model's name differs too, the refusal names
    what the user changed (--model) before the first field that differs."""
    for key in sorted(set(saved) | set(now)):
        if key in _SHAPE_IGNORED or saved.get(key) == now.get(key):
            continue
        shape = f"model.{key}={saved.get(key)!r}, this run has {now.get(key)!r}"
        was, want = saved.get("name"), now.get("name")
        if was and want and was != want:
            raise UserError(f"--resume: --model {want}: the checkpoint {folder.name} was saved "
                            f"by a run of model {was} ({shape}); allowed: --model {was} (or "
                            "train a new --run-dir)")
        raise UserError(f"--resume: checkpoint {folder} holds a model with {shape}; resume "
                        "with the same model or start a new --run-dir")


def _refuse_residual_family(meta: dict[str, Any], plan: Any, folder: Path) -> None:
    """Error-feedback residuals reload only into their ZeRO family's layout (0/1: per
    parameter, 2/3: per FSDP unit; meshtron/compress/runtime.py `GradCompression.state_dict`)."""
    was = residual_zero(meta)
    if was is None or plan is None or (plan.zero >= 2) == (was >= 2):
        return
    family = "2 or 3" if was >= 2 else "0 or 1"
    raise UserError(f"--resume: plan.zero={plan.zero}: the checkpoint {folder.name} holds "
                    f"int8 error-feedback residuals of a zero={was} run, laid out per "
                    f"{'FSDP unit' if was >= 2 else 'parameter'}; allowed: --zero {family} "
                    "(or train a new --run-dir)")


def _refuse_change(field: str, was: Any, want: Any, folder: Path, flag: str = "") -> None:
    if was == want:
        return
    why = rf.FIELDS[field][1]
    if was is None:
        hint = f"{field} not set"
    else:
        hint = f"{flag} {was}" if flag else f"{field}={was!r}"
    raise UserError(f"--resume: {field}={want!r}: the checkpoint {folder.name} was saved by a "
                    f"run with {field}={was!r}, and {why}; allowed: {hint} (or train a new "
                    "--run-dir)")


def _comm_of(plan: Any) -> dict[str, Any]:
    from meshtron.planner.plan_rules_fields import COMM_DEFAULTS

    return {k: (getattr(plan, k) if plan is not None else d) for k, d in COMM_DEFAULTS.items()}


def recorded_comm(meta: dict[str, Any]) -> dict[str, Any]:
    """The data-parallel traffic fields of the plan the checkpoint was saved with (defaults
    where its plan file left them out, or for a one-process run)."""
    from meshtron.planner.plan_rules_fields import COMM_DEFAULTS

    plan = meta.get("plan") or {}
    return {k: plan.get(k, d) for k, d in COMM_DEFAULTS.items()}


def residual_zero(meta: dict[str, Any]) -> int | None:
    """The ZeRO stage of a run whose checkpoint holds error-feedback residuals (int8 gradient
    compression), else None. meshtron/compress/runtime.py `GradCompression.state_dict` stores
    them per parameter under ZeRO-0/1 and per FSDP unit under ZeRO-2/3: the other family's
    layout has none of the checkpoint's keys (DCP: `Missing key in checkpoint state_dict`)."""
    plan = meta.get("plan") or {}
    if recorded_comm(meta)["grad_compression"] == "none" or plan.get("zero") is None:
        return None
    return int(plan["zero"])


def recorded(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(folder, meta.json) of the checkpoint a --resume of `run_dir` loads (None: no complete
    one; prepare_start refuses that)."""
    found = store.find_latest(store.checkpoint_root(run_dir), deep=False)
    return None if found.path is None else (found.path, store.read_meta(found.path))


def recorded_run_doc(meta: dict[str, Any]) -> dict[str, Any]:
    """The run file the checkpoint was saved with, its KEEP and FOLLOW fields (a run file
    document: `config_from_dict` reads it)."""
    saved = meta.get("config", {})
    doc: dict[str, Any] = {}
    if isinstance(saved.get("model"), dict):
        doc["model"] = {k: v for k, v in saved["model"].items() if v is not None}
    for section in ("data", "optim", "train"):
        table = saved.get(section) or {}
        doc[section] = {k: table[k] for k in rf.inherited(section)
                        if table.get(k) is not None}
    return doc


def recorded_checkpointing(meta: dict[str, Any]) -> dict[str, Any]:
    """The CheckpointConfig fields the run was saving with (empty: saved before they were
    recorded)."""
    table = meta.get("checkpoint") or {}
    return {k: table[k] for k in rf.inherited("checkpoint") if k in table}


def _no_checkpoints(root) -> str:
    """Why a run folder holds no checkpoint folder at all: no run there, or a run that saved
    none (checkpoints are off unless --checkpoint-every is given)."""
    run_dir = root.parent
    if root.exists():
        return ""
    if not run_dir.is_dir():
        return f"{run_dir} holds no run"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        # run.toml records no checkpoint settings: a run of --checkpoint-every 50 killed at
        # step 8 was told its checkpoints were off (audit s55); say both and how far it got
        return (f"the run there saved none{_logged_up_to(metrics)}: checkpoints are off "
                "unless --checkpoint-every N is given, and with it the first is saved at step N")
    return ""


def _logged_up_to(metrics) -> str:
    """' by its last logged step, 8' from metrics.jsonl ('' when it logged none)."""
    import json

    last = None
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            last = record["step"]
    return "" if last is None else f" by its last logged step, {last}"


def check_resume(ckpt: CheckpointConfig, cfg: Any, plan: Any = _NO_PLAN) -> None:
    """`--resume`: a complete checkpoint (sizes checked here; checksums by the ranks) saved with
    this run's KEEP settings (and `plan`'s). Reads only: callable before the folder is claimed."""
    if not ckpt.resume:
        return
    root = store.checkpoint_root(cfg.train.run_dir)
    found = store.find_latest(root, deep=False)
    if found.path is None:
        why = "; ".join(f"{a}: {b}" for a, b in found.rejected) or _no_checkpoints(root)
        raise UserError(f"--resume: no complete checkpoint in {root}"
                        + (f" ({why})" if why else ""))
    check_compatible(store.read_meta(found.path), cfg, found.path, plan,
                     lr_override=ckpt.override_lr_schedule)


def finished_line(ckpt: CheckpointConfig, cfg: Any) -> str | None:
    """`--resume` of a run whose newest complete checkpoint already reached train.steps: the one
    line that says so (the run's outputs are left as they are: resuming would train no step and
    rewrite summary.json from nothing); None otherwise. After `check_resume`: a train.steps
    other than the run's was checked there (checkpoint/extend.py), and one at or below the
    checkpoint's step leaves nothing to train either."""
    found = recorded(cfg.train.run_dir) if ckpt.resume else None
    if found is None:
        return None
    step = int(found[1].get("step", 0))
    if step < cfg.train.steps:
        return None
    return (f"meshtron train: train.run_dir={cfg.train.run_dir!r} is already complete at step "
            f"{step} (train.steps={cfg.train.steps}); nothing to resume, its outputs are kept")


def say_world(ckpt: CheckpointConfig, cfg: Any, nproc: int) -> None:
    """`--resume` on another number of ranks than the run's, or with another train.steps: one
    line on stderr each (after the checks, before the ranks start; a resharded resume continues
    the same trajectory, an extended one the new run's: checkpoint/extend.py)."""
    found = recorded(cfg.train.run_dir) if ckpt.resume else None
    if found:
        say_extended(found[1], cfg)
    was = int(found[1].get("world_size") or 1) if found else nproc
    if was != nproc:
        import sys

        print(f"meshtron train: resuming on {nproc} rank{'s' if nproc > 1 else ''} (the run "
              f"used {was})", file=sys.stderr)


def prepare_start(ckpt: CheckpointConfig, cfg: Any, overwrite: bool, plan: Any = _NO_PLAN) -> None:
    """Checks in the launching process, before any rank starts: `check_resume`; a fresh run
    over an old one (--overwrite) drops the old checkpoints so a later --resume cannot pick
    them up."""
    root = store.checkpoint_root(cfg.train.run_dir)
    if ckpt.resume:
        check_resume(ckpt, cfg, plan)
        (root / store.PREEMPTED).unlink(missing_ok=True)
    elif overwrite and root.is_dir():  # also a link or mount point: emptied, kept
        store.clear_root(root)
    elif overwrite and root.exists():  # a file where the checkpoints go: replaced as well
        root.unlink()
