"""`meshtron train --resume` typed by a user: the run's own settings where the command gives
none, and a contradicted one refused before anything is touched.

What --resume does with each setting is one table, meshtron/checkpoint/resume_fields.py; the
recorded values are the meta.json of the checkpoint the resume loads (meshtron/checkpoint/
resume.py reads and checks them; this module applies them to the command line).
"""

from __future__ import annotations

import argparse
from typing import Any

from meshtron.config import RunConfig


def resumed_meta(args: argparse.Namespace, run_dir: str) -> tuple[Any, dict[str, Any]] | None:
    """(folder, meta.json) of the checkpoint a `--resume` typed by the user continues (None: not
    a resume, a rank the launcher started with the resolved files, or no complete checkpoint,
    which prepare_start refuses)."""
    if not getattr(args, "resume", False) or args.launched_rank:
        return None
    from meshtron.checkpoint.resume import recorded

    return recorded(run_dir)


def _run_dir_of(doc: dict[str, Any], overrides: dict[str, Any]) -> str:
    from meshtron.config import TrainConfig

    table = doc.get("train")
    return (overrides.get("train.run_dir")
            or (table.get("run_dir") if isinstance(table, dict) else None)
            or TrainConfig.run_dir)


def _on_top(base: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Run file `doc` over the recorded run file `base`: its tables key by key, its model
    whole."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in doc.items():
        if key != "model" and isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key].update(value)
        else:
            out[key] = value
    return out


def resumed_comm(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    """On --resume: the resumed run's gradient compression / DiLoCo settings (those not at
    their defaults), which the flags may restate, not change (resume.check_compatible)."""
    from meshtron.checkpoint import resume_fields as rf
    from meshtron.checkpoint.resume import recorded_comm
    from meshtron.planner.plan_rules_fields import COMM_DEFAULTS

    resumed = resumed_meta(args, cfg.train.run_dir)
    if resumed is None:
        return {}
    return {k: v for k, v in recorded_comm(resumed[1]).items()
            if k in rf.kept("plan") and v != COMM_DEFAULTS[k]}


def resumed_knobs(args: argparse.Namespace, cfg: RunConfig,
                  knobs: dict[str, Any]) -> dict[str, Any]:
    """On --resume of a compressed run with no --zero: the search keeps the recorded stage (a
    stage of the residuals' family; resume.check_compatible refuses a --zero of the other)."""
    if "zero" in knobs:
        return knobs
    from meshtron.checkpoint.resume import residual_zero

    resumed = resumed_meta(args, cfg.train.run_dir)
    zero = residual_zero(resumed[1]) if resumed else None
    return knobs if zero is None else {**knobs, "zero": zero}


def resumed_nproc(args: argparse.Namespace, resumed: tuple[Any, dict[str, Any]] | None,
                  default: int | None) -> int | None:
    """The ranks of a --resume: --nproc, else the recorded world size (a FOLLOW decision, as
    torchrun / Megatron-LM jobs restart on their own size; another size is said once the checks
    pass: resume.say_world). Unchanged outside a resume, with a saved plan (its size) or an
    elastic job."""
    from meshtron.train.planning import is_plan_file

    given = args.nproc or default
    if resumed is None or getattr(args, "nnodes", None) or is_plan_file(getattr(args, "plan",
                                                                                None)):
        return given
    from meshtron.launch import current_world

    if current_world().source != "single":  # torchrun / srun: the world is the outside one
        return given
    return int(resumed[1].get("world_size") or 1) if given is None else given


def over_recorded(args: argparse.Namespace, doc: dict[str, Any],
                  overrides: dict[str, Any]) -> dict[str, Any]:
    """The run file `doc` over the resumed checkpoint's recorded one (unchanged when this is
    not a user's --resume)."""
    resumed = resumed_meta(args, _run_dir_of(doc, overrides))
    if resumed is None:
        return doc
    from meshtron.checkpoint.resume import recorded_run_doc

    return _on_top(recorded_run_doc(resumed[1]), doc)


def refuse_model_change(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """On a user's --resume whose run file `doc` (flags applied) does not make a valid config:
    refuse the model change behind it, if there is one, rather than its symptom (`--model debug`
    on a run of `tiny` was refused as `data.seq_len=256: exceeds the model's max_seq=128`, the
    run's recorded length against the new model). The vocabulary is not compared: a tokenizer
    resizes it after this point (data/tokenizer.py follow_tokenizer)."""
    resumed = resumed_meta(args, _run_dir_of(doc, {}))
    if resumed is None:
        return
    from meshtron.checkpoint.resume import check_model
    from meshtron.config import model_from_value
    from meshtron.errors import UserError

    try:
        spec = model_from_value(doc.get("model", "tiny"))
    except UserError:
        return  # the model itself is bad input: that error is the one to see
    check_model(resumed[1], spec, resumed[0], ignore=("vocab",))


def check_given(args: argparse.Namespace, cfg: RunConfig) -> tuple[Any, dict[str, Any]] | None:
    """Refuse a KEEP setting given with another value than the checkpoint's (one line, before
    the folder is touched); returns `resumed_meta` for the checkpoint flags."""
    resumed = resumed_meta(args, cfg.train.run_dir)
    if resumed is not None:
        from meshtron.checkpoint.resume import check_compatible

        check_compatible(resumed[1], cfg, resumed[0],
                         lr_override=getattr(args, "override_lr_schedule", False))
    return resumed
