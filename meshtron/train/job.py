"""A training job as typed values: what the command line hands to the stages below it
(launch -> plan resolution -> rank -> loop). No argparse object travels past the CLI."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.checkpoint.config import CheckpointConfig
from meshtron.config import RunConfig


@dataclass(frozen=True)
class ParallelRequest:
    """How to run on torch.distributed."""

    plan: str = "auto"
    """'auto' (the planner picks), a layout such as 'tp=2,pp=2,dp=2' (open knobs picked by the
    planner), or a plan file saved by `meshtron plan --save`."""
    nproc: int | None = None
    """Local ranks to start with torchrun; None: the outside world's size, or 1."""
    cluster: str | None = None
    """Cluster to plan for (preset or TOML); None: this machine's calibration file."""
    knobs: dict[str, Any] = field(default_factory=dict)
    """Knobs fixed on the command line (tp/pp/dp, zero, schedule, recompute, sp, micro_batch)."""
    comm: dict[str, Any] = field(default_factory=dict)
    """Plan fields of gradient compression / DiLoCo given as flags (meshtron/compress/cli.py)."""
    resumed_plan: dict[str, Any] | None = None
    """On a `--resume` whose command gives no layout, knob, cluster or compression flag: the
    plan the checkpoint was saved with (its meta.json), which the run continues on when the
    world has its size (planning.py `resolve_run_plan`)."""


@dataclass(frozen=True)
class TrainJob:
    """One `meshtron train` (or demo) invocation, validated."""

    cfg: RunConfig
    """The run configuration (model, data, optimizer, loop, outputs)."""
    parallel: ParallelRequest | None = None
    """None: one process without torch.distributed (unless started inside a torchrun/Slurm
    world, which always means the parallel path)."""
    overwrite: bool = False
    """Replace the outputs of a run already in cfg.train.run_dir."""
    watchdog_timeout_s: float | None = None
    """Abort the run (every rank dumps its trace, then exits non-zero) when a rank makes no
    progress for this many seconds (longer before the first step); None: no watchdog."""
    recorder: bool = True
    """Record every collective (meshtron doctor); dumps still happen without it."""
    launched_rank: bool = False
    """This process is a rank started by `meshtron train --nproc` on this machine: the parent
    process validated everything, saved the plan and reports the result."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints, --resume, automatic restarts and preemption (meshtron.checkpoint)."""
    elastic: Any = None
    """A `meshtron.train.elastic.ElasticConfig` (--nnodes MIN:MAX: the world may change between
    rendezvous rounds, each round re-plans), or None."""

    def __post_init__(self):
        # The watchdog polls every 0.2 s; under a second it could only abort healthy runs.
        t = self.watchdog_timeout_s
        if t is not None and not (1.0 <= t < float("inf")):
            from meshtron.errors import UserError

            raise UserError(f"--watchdog-timeout={t!r}: allowed a finite number of seconds "
                            ">= 1")


def warn(job: TrainJob) -> None:
    """Print the run's valid-but-probably-unintended settings, once, before it starts."""
    for text in [*job.cfg.warnings(), *job_warnings(job)]:
        print(f"meshtron train: warning: {text}", file=sys.stderr)


def job_warnings(job: TrainJob) -> list[str]:
    """The checkpoint settings' valid-but-probably-unintended combinations."""
    ck = job.checkpoint
    if ck.max_restarts > 0 and ck.every == 0 and not ck.snapshot_every and not ck.resume:
        # audit s55: a restart then started over from step 0, said only after the failure
        return [f"--max-restarts {ck.max_restarts} without --checkpoint-every: a restart "
                "starts over from step 0 (no checkpoint to resume from)"]
    return []


def write_run_file(job: TrainJob, path: Path) -> None:
    """The resolved run file the ranks read (`--config`)."""
    import tomli_w

    _replace_text(path, tomli_w.dumps(job.cfg.to_toml_dict()))


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text` or, if writing fails part-way (a full disk, a kill), what it held
    before: --resume, export and doctor never read half a run.toml. Written beside it, then
    renamed over it (os.replace: atomic on POSIX)."""
    part = path.with_name(path.name + ".part")
    try:
        part.write_text(text)
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def write_run_records(job: TrainJob, plan) -> None:
    """The run's records, the same on every launch path (meshtron's own launcher, one
    process, rank 0 of an outside torchrun/srun): run.toml (the resolved config: what
    --resume, export and doctor read) and plan.toml (`plan`; None: one process, whose folder
    then keeps no plan.toml of an earlier run). Written after the folder is claimed and
    `prepare_start` has cleared an --overwrite-n run's checkpoints. run.toml carries the run's
    id (`train.run_id`), set on `job.cfg` here so that this process's records agree."""
    run_dir = Path(job.cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job.cfg.train.run_id = run_id_of(job)
    write_run_file(job, run_dir / "run.toml")
    if plan is None:
        (run_dir / "plan.toml").unlink(missing_ok=True)
    else:
        _replace_text(run_dir / "plan.toml", plan.to_toml())


def run_id_of(job: TrainJob) -> str:
    """The run's id (meshtron/checkpoint/run_id.py): the continued run's on a --resume, an
    elastic round or an automatic restart of an outside torchrun; a new one for a new run
    (any id in the run file it was given, e.g. a copied run.toml, is another run's)."""
    from meshtron.checkpoint import restart
    from meshtron.checkpoint.run_id import continued_run_id, new_run_id

    ckpt = job.checkpoint
    if ckpt.resume or ckpt.resume_if_any or restart.attempt() > 0:
        return continued_run_id(job.cfg.train.run_dir) or new_run_id()
    return new_run_id()
