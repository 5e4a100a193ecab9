"""What `meshtron train` is asked to do about failures: the checkpoint flags, typed and checked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtron.errors import UserError

EXIT_PREEMPTED = 75
"""Exit code of a run stopped by SIGTERM after writing its checkpoint: sysexits.h EX_TEMPFAIL
("temporary failure, try again"), so a scheduler script can tell a preemption (requeue with
`--resume`) from success (0), bad input (2) and a failure (1)."""
EXIT_STORAGE = 74
"""Exit code of a rank (and of the launcher) that failed on a file-system error a restart would
meet again (checkpoint/restart.py `storage_error`: a read-only or full checkpoint folder):
sysexits.h EX_IOERR ("an error occurred while doing I/O on some file"). Never restarted."""

RESIDUALS = ("own", "mean")
"""`CheckpointConfig.residuals` values."""
DEFAULT_KEEP = 3
DEFAULT_PREEMPT_GRACE_S = 30.0


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing, resuming, restarts and preemption of one training job."""

    every: int | str = 0
    """Save every this many optimizer steps; 'auto': Daly's optimal interval from the measured
    save stall and the mean time between failures; 0: off (SIGTERM is then not intercepted
    either, unless --resume or --max-restarts is given)."""
    keep: int = DEFAULT_KEEP
    """Complete checkpoints kept on disk (the oldest are deleted after a new one commits)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in RUN_DIR/checkpoints."""
    max_restarts: int = 0
    """Restarts of all ranks (through torchrun's elastic agent) after a rank dies."""
    preempt_grace_s: float = DEFAULT_PREEMPT_GRACE_S
    """Seconds between SIGTERM and the checkpoint being committed (the notice a spot instance or
    Slurm gives); the launcher waits this long (plus a margin) before killing ranks."""
    mtbf_hours: float | None = None
    """The job's mean time between failures for `every='auto'`; None: derived from the GPU
    count and the Llama 3 per-GPU failure rate (meshtron.reliability)."""
    snapshot_every: int = 0
    """Take an in-memory snapshot (own shard + a copy on the next node,
    meshtron.checkpoint.snapshot) every this many steps; a restarted attempt restores from it
    before looking at disk. 0: off.
    The node size is the plan's `ranks_per_node` (--ranks-per-node; default LOCAL_WORLD_SIZE)."""

    residuals: str = "own"
    """What disk checkpoints hold of gradient compression's error feedback (meshtron/compress):
    'own', every rank's own residual beside the group's mean (a resume on the same layout
    continues bit for bit; 4 B per parameter per data-parallel rank, meshtron/checkpoint/
    rank_entries.py), or 'mean', only the group's mean (4 B per parameter; a resume restarts
    every rank from it and continues close to, not bit for bit with, the uninterrupted run: what
    DeepSpeed's 1-bit Adam does, which resets the errors on load). `meshtron cost` prices both."""

    override_lr_schedule: bool = False
    """With `resume` and a train.steps other than the run's: continue on the new value's
    learning-rate schedule from the checkpoint's step even where the steps taken had another
    rate (the rate jumps there; without it that resume is refused: meshtron/checkpoint/
    extend.py), as Megatron-LM's --override-opt_param-scheduler."""

    resume_if_any: bool = False
    """Continue from the newest complete checkpoint when there is one, else start at step 0
    (every round of an elastic job, meshtron/train/elastic.py; set by the rank, not a flag)."""

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, str) and every != "auto" or isinstance(every, bool) or (
                isinstance(every, int) and every < 0) or not isinstance(every, (int, str)):
            raise UserError(f"--checkpoint-every={every!r}: allowed an integer >= 0 (steps; 0 = "
                            "off) or 'auto'")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise UserError(f"--keep={self.keep!r}: allowed an integer >= 1 (complete "
                            "checkpoints kept)")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) \
                or self.max_restarts < 0:
            raise UserError(f"--max-restarts={self.max_restarts!r}: allowed an integer >= 0")
        if not (isinstance(self.preempt_grace_s, (int, float)) and math.isfinite(
                self.preempt_grace_s) and self.preempt_grace_s > 0):
            raise UserError(f"--preempt-grace={self.preempt_grace_s!r}: allowed a positive "
                            "number of seconds")
        if self.residuals not in RESIDUALS:
            raise UserError(f"--checkpoint-residuals={self.residuals!r}: allowed own (each "
                            "rank's error-feedback residual: a resume continues bit for bit) or "
                            "mean (the data-parallel group's mean only: smaller checkpoints)")
        if self.mtbf_hours is not None and not (
                isinstance(self.mtbf_hours, (int, float)) and math.isfinite(self.mtbf_hours)
                and self.mtbf_hours > 0):
            raise UserError(f"--mtbf-hours={self.mtbf_hours!r}: allowed a positive number of "
                            "hours")

        if self.override_lr_schedule and not self.resume:
            raise UserError("--override-lr-schedule: allowed only with --resume (it continues "
                            "a run on another train.steps' learning-rate schedule)")
        _check_snapshots(self)

    @property
    def enabled(self) -> bool:
        """Anything to do beyond the plain run (periodic saves or a resume)."""
        return self.every != 0 or self.resume or self.max_restarts > 0

    def rank_argv(self) -> list[str]:
        """The same settings as command-line flags, for the ranks a launcher starts."""
        argv = ["--checkpoint-every", str(self.every), "--keep", str(self.keep),
                "--preempt-grace", repr(float(self.preempt_grace_s)),
                "--max-restarts", str(self.max_restarts),
                # always given: a --resume rank would otherwise take the checkpoint's own
                "--checkpoint-residuals", self.residuals]
        if self.snapshot_every:
            argv += ["--snapshot-every", str(self.snapshot_every)]
        if self.mtbf_hours is not None:
            argv += ["--mtbf-hours", repr(float(self.mtbf_hours))]
        if self.resume:
            argv.append("--resume")
        if self.override_lr_schedule:
            argv.append("--override-lr-schedule")
        return argv


def recorded_settings(c: CheckpointConfig) -> dict[str, Any]:
    """What every checkpoint's meta.json records of these settings: the ones a `--resume` takes
    when not given (resume_fields.FIELDS)."""
    from meshtron.checkpoint.resume_fields import inherited

    return {name: getattr(c, name) for name in inherited("checkpoint")}


def _check_snapshots(c: CheckpointConfig) -> None:
    every = c.snapshot_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UserError(f"--snapshot-every={every!r}: allowed an integer >= 0 (steps; 0 = off)")
    if every and c.max_restarts < 1:
        raise UserError(f"--snapshot-every={every}: needs --max-restarts >= 1 (only a restarted "
                        "attempt reads a snapshot)")


def parse_every(text: str) -> int | str:
    """`--checkpoint-every` value: 'auto' or an integer (range checked by CheckpointConfig)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--checkpoint-every={text!r}: allowed an integer >= 0 (steps; 0 = off) "
                        "or 'auto'") from None


def refuse_unread(typed: dict[str, Any], ckpt: CheckpointConfig, compression: str) -> None:
    """A flag that only tunes checkpointing, given where it reads nothing, is refused in one
    line (it trained as if not given: audit s54, finding 3), as `--outer-lr` without --diloco
    is (planner/comm_flags.py refuse_unread). `typed`: the flags as the user typed them, by
    name without dashes (None: not given); `ckpt`: the run's settings (a resume's recorded
    ones included); `compression`: the plan's gradient compression ('none' without)."""
    mtbf, keep = typed.get("mtbf_hours"), typed.get("keep")
    grace, residuals = typed.get("preempt_grace"), typed.get("checkpoint_residuals")
    if mtbf is not None and ckpt.every != "auto":
        raise UserError(f"--mtbf-hours={mtbf:g}: only with --checkpoint-every auto (Daly's "
                        "interval is all that reads it; `meshtron cost` prices a run's "
                        "failures)")
    if keep is not None and ckpt.every == 0:
        raise UserError(f"--keep={keep}: only with --checkpoint-every N or auto (checkpoints "
                        "are off without it, so there is nothing to keep)")
    if grace is not None and not ckpt.enabled:
        raise UserError(f"--preempt-grace={grace:g}: only with --checkpoint-every, --resume or "
                        "--max-restarts (without them SIGTERM is not intercepted and no "
                        "checkpoint is written)")
    if residuals is None:
        return
    if compression in (None, "none"):
        raise UserError(f"--checkpoint-residuals={residuals}: only with --grad-compression "
                        "bf16 or int8 (what checkpoints hold of its error feedback)")
    if ckpt.every == 0:
        raise UserError(f"--checkpoint-residuals={residuals}: only with --checkpoint-every N "
                        "or auto (checkpoints are off without it)")
