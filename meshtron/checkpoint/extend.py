"""`--resume --steps N` with another N than the run's: extending (or shortening) a run.

The learning-rate schedule is a function of train.steps (meshtron/config.py
`OptimConfig.lr_factor`: linear warm-up, then cosine decay to min_lr_ratio * lr at train.steps),
and a checkpoint holds the schedule's position, not its shape: a resumed rank builds the
scheduler for the train.steps it is given and sets it at the checkpoint's step
(checkpoint/state.py `set_schedule_position`), as torchtitan's scheduler saves only
`last_epoch` and recomputes the rate from the lambda its configured `training.steps` (or
`lr_scheduler.total_steps`) built (torchtitan/components/optimizer/lr_scheduler.py at b5bcd76,
`LRSchedulersContainer`).

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
schedule at the current step; meshtron's analogue is --override-lr-schedule
(CheckpointConfig.override_lr_schedule: the resumed ranks set the new schedule's rate at the
checkpoint's step, so the rate jumps there, said in one line). A run that should start its own
schedule is a new run from the exported weights (`meshtron export`, then `--init-from`).
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


def _change(meta: dict[str, Any], cfg: Any) -> tuple[int, int, int] | None:
    """(the run's train.steps, this one's, the checkpoint's step) when train.steps changed;
    None when unchanged or saved before train.steps was recorded."""
    was = (meta.get("config", {}).get("train") or {}).get("steps")
    if was is None or int(was) == cfg.train.steps:
        return None
    return int(was), cfg.train.steps, int(meta.get("step", 0))


def _rates(cfg: Any, step: int, was: int, steps: int) -> str:
    lr, optim = cfg.optim.lr, cfg.optim
    old, new = _apart(lr * optim.lr_factor(step, was), lr * optim.lr_factor(step, steps))
    return f"{old} under train.steps={was} and {new} under train.steps={steps}"


def _apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` with 4 significant digits, or as many more as tell them apart: a step just
    after the warm-up read "0.002 under train.steps=400 and 0.002 under train.steps=150" in the
    refusal that said they differ (session-52 user audit)."""
    for digits in range(4, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def check_steps(meta: dict[str, Any], cfg: Any, folder: Path, lr_override: bool = False) -> None:
    """Refuse (one line) a train.steps that differs from the checkpoint's run's where a step the
    checkpoint took would have had another learning rate (module docstring), unless
    `lr_override` (--override-lr-schedule)."""
    change = _change(meta, cfg)
    if change is None or lr_override:
        return
    was, steps, taken = change
    differs = first_difference(cfg.optim, was, steps, taken)
    if differs is None:
        return
    raise UserError(
        f"--resume: train.steps={steps}: the checkpoint {folder.name} was saved at step {taken} "
        f"of a run with train.steps={was}; the learning rate of its step {differs + 1} was "
        f"{_rates(cfg, differs, was, steps)} (the cosine decay ends at train.steps), so the "
        f"steps taken are not those of a --steps {steps} run; allowed: train.steps={was}, "
        f"--override-lr-schedule (step {taken + 1} on takes the new schedule's rate, a jump; "
        "Megatron-LM's --override-opt_param-scheduler), or a new run from its weights "
        f"(`meshtron export {folder.parent.parent} --to DIR`, then `meshtron train "
        f"--init-from DIR --steps {steps}`)")


def extended_line(meta: dict[str, Any], cfg: Any) -> str | None:
    """After `check_steps` passed: the line that says what a changed train.steps does (None
    when unchanged, or when the checkpoint is already at or past the new end); a step taken at
    another rate means --override-lr-schedule let it through."""
    change = _change(meta, cfg)
    if change is None or change[2] >= change[1]:
        return None
    was, steps, taken = change
    verb = "extending" if steps > was else "shortening"
    head = f"meshtron train: --resume: {verb} the run from train.steps={was} to {steps}: "
    if first_difference(cfg.optim, was, steps, taken) is None:
        return head + (f"its {taken} steps taken had the same learning rate under both, so "
                       f"steps {taken + 1}-{steps} continue exactly as in a run started with "
                       f"--steps {steps}")
    return head + (f"--override-lr-schedule: steps {taken + 1}-{steps} take the new schedule's "
                   f"rates (step {taken + 1}: {_rates(cfg, taken, was, steps)}); steps "
                   f"1-{taken} followed the old one")


def say_extended(meta: dict[str, Any], cfg: Any) -> None:
    line = extended_line(meta, cfg)
    if line:
        print(line, file=sys.stderr)
