"""`--resume --steps N` with another N than the run's: extending (or shortening) a run.

The learning-rate schedule is a function of train.steps (meshtron/config.py
`OptimConfig.lr_factor`: linear warm-up, then cosine decay to min_lr_ratio * lr at train.steps),
and a checkpoint holds the schedule's position, not its shape: a resumed rank builds the
scheduler for the train.steps it is given and sets it at the checkpoint's step
(checkpoint/state.py `set_schedule_position`), as torchtitan rebuilds its learning-rate lambda
from the configured `training.steps` when it loads a checkpoint.

So a changed train.steps continues *exactly* as a run started with it when every step the
checkpoint already took had the same learning rate under both values: all of them inside the
warm-up, a constant rate after it (min_lr_ratio = 1: a "constant after warm-up" schedule), or
at most the first step after the warm-up (the peak under both). Then the steps that follow are
the new run's, bit for bit, and are said in one line. Otherwise the steps taken followed another
curve than the new one, and the next step's rate would jump (a 12-step run resumed with --steps
20 moved it from 2.07e-4 to 5.39e-4): refused, naming the first step whose rate differs.
Megatron-LM refuses the same change (megatron/core/optimizer_param_scheduler.py at d98e8a6,
`load_state_dict` -> `_check_and_set`: the checkpoint's `lr_decay_steps`, from --train-iters or
--lr-decay-iters, against the new one) unless --override-opt_param-scheduler takes the new
schedule at the current step; meshtron's way to that is a new run from the exported weights
(`meshtron export`, then `--init-from`), which starts its own schedule.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from meshtron.errors import UserError


def first_difference(optim: Any, was_steps: int, steps: int, taken: int) -> int | None:
    """The first of the `taken` optimizer steps (0-based) whose learning rate differs between
    a `was_steps` and a `steps` run of the schedule `optim` (an OptimConfig); None: none does."""
    for step in range(taken):
        if optim.lr_factor(step, was_steps) != optim.lr_factor(step, steps):
            return step
    return None


def check_steps(meta: dict[str, Any], cfg: Any, folder: Path) -> None:
    """Refuse (one line) a train.steps that differs from the checkpoint's run's where the steps
    the checkpoint took would have had another learning rate (module docstring)."""
    was = (meta.get("config", {}).get("train") or {}).get("steps")
    steps, taken = cfg.train.steps, int(meta.get("step", 0))
    if was is None or was == steps:  # saved before train.steps was recorded, or unchanged
        return
    differs = first_difference(cfg.optim, int(was), steps, taken)
    if differs is None:
        return
    lr = cfg.optim.lr
    raise UserError(
        f"--resume: train.steps={steps}: the checkpoint {folder.name} was saved at step {taken} "
        f"of a run with train.steps={was}, whose learning rate at step {differs + 1} was "
        f"{lr * cfg.optim.lr_factor(differs, int(was)):.4g} and is "
        f"{lr * cfg.optim.lr_factor(differs, steps):.4g} with train.steps={steps} (the cosine "
        "decay ends at train.steps): the steps taken would not be this run's; allowed: "
        f"train.steps={was}, or a new run from its weights (`meshtron export "
        f"{folder.parent.parent} --to DIR`, then `meshtron train --init-from DIR --steps "
        f"{steps}`)")


def extended_line(meta: dict[str, Any], cfg: Any) -> str | None:
    """After `check_steps` passed: the line that says what a changed train.steps does (None
    when unchanged, or when the checkpoint is already at or past the new end)."""
    was = (meta.get("config", {}).get("train") or {}).get("steps")
    steps, taken = cfg.train.steps, int(meta.get("step", 0))
    if was is None or was == steps or taken >= steps:
        return None
    verb = "extending" if steps > was else "shortening"
    return (f"meshtron train: --resume: {verb} the run from train.steps={was} to {steps}: its "
            f"{taken} steps taken had the same learning rate under both, so steps {taken + 1}"
            f"-{steps} continue exactly as in a run started with --steps {steps}")


def say_extended(meta: dict[str, Any], cfg: Any) -> None:
    line = extended_line(meta, cfg)
    if line:
        print(line, file=sys.stderr)
