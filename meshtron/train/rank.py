"""The rank entry point: one process of a multi-rank run (started by `meshtron train --nproc`,
or by an outside torchrun / srun for multi-node jobs).

Joins the process group, takes the plan rank 0 resolved (broadcast, so nodes with different
local files cannot disagree), trains, and leaves. Exit codes: 0 done; 2 bad input (one line);
1 anything else, a bug or a failed run, with this rank's traceback, every line prefixed by
`[rank N]` so that interleaved output from many ranks stays readable; 74 a storage error a
restart would meet again (a read-only or full checkpoint folder: one line, never restarted);
a collective that fails because a peer process died (expected after another rank's failure) is one line instead. A failing rank does not
wait for the others at a barrier (torchrun then stops the rest).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from meshtron.errors import RunFailed, UserError
from meshtron.launch import World, leave_on_interrupt
from meshtron.train import run_lock
from meshtron.train.job import ParallelRequest, TrainJob

EXIT_USAGE = 2


def run_rank(job: TrainJob, world: World) -> NoReturn:
    """Train this rank's part of the job, then exit the process (never returns)."""
    from meshtron.checkpoint import phases

    phases.mark("rank_entry")  # interpreter up, the command line parsed
    leave_on_interrupt()  # an outside torchrun's ranks too
    hold_usr1()
    import torch  # noqa: F401 - here, so its import time is a phase of its own

    phases.mark("torch_imported")
    from meshtron import doctor
    from meshtron.runtime import init_rank, shutdown_rank

    from meshtron.checkpoint import EXIT_PREEMPTED, EXIT_STORAGE
    from meshtron.checkpoint.checkpointer import Preempted
    from meshtron.checkpoint.restart import brief_cause, cause_text, storage_error

    try:
        doctor.prepare_env()
        attempt = _attempt(job, world)
        # Before the rendezvous (not for elastic rounds, whose world is fixed by it): a rank
        # that never joins hangs the others in init_process_group, for its whole timeout on
        # gloo; the doctor's hello file, SIGUSR1 and watchdog then already work.
        if job.elastic is None:
            _start_doctor(job, world, attempt, joining=True)
        device = init_rank(world, dump_prefix=str(
            doctor.trace_dir(job.cfg.train.run_dir, attempt) / "nccl_flight_recorder_rank_"),
            store=_attempt_store(job, world), record=job.recorder)
        doctor.joined()
        phases.mark("group_ready")
        if job.elastic is not None:  # a rendezvous round: start or continue the job
            from meshtron.train.elastic import begin_round

            job = begin_round(job, world)
        plan, cluster = agreed_plan(job, world)
        run_lock.join(job.cfg.train.run_dir)  # after rank 0's claim (agreed_plan)
        if job.elastic is not None:
            from meshtron.train.elastic import announce_replan

            announce_replan(job, world, plan)
            _start_doctor(job, world, attempt, joining=False)
        from meshtron.train.parallel import train_on_rank

        summary = train_on_rank(job.cfg, plan, world, device, cluster,
                                fresh_tokenizer=not job.launched_rank,
                                checkpoint=job.checkpoint,
                                trace_samples=job.elastic is not None,
                                curves=not job.launched_rank)  # the launcher draws them
        if summary is not None and not job.launched_rank:
            # Started by an outside torchrun/srun: rank 0 reports (meshtron's own launcher
            # reports from the parent instead).
            from meshtron.train import outputs

            run_dir = Path(job.cfg.train.run_dir)
            plan.save(run_dir / "plan.toml")
            outputs.print_result(job.cfg, summary, run_dir)
    except Preempted:
        doctor.stop()
        # Stopping torchrun's agent (restart mode) makes it SIGTERM every rank: done before a
        # slower peer had finished the preemption (its records, the exit barrier), that peer
        # was torn down or its barrier broke. So: ignore SIGTERM from here (this rank has
        # nothing left to save), meet every rank in the exit barrier, and only then stop it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run_dir = job.cfg.train.run_dir
        shutdown_rank(EXIT_PREEMPTED, then=lambda: _end_restarts(run_dir, EXIT_PREEMPTED))
    except RunFinished as done:
        if world.rank == 0:
            print(done, flush=True)
        shutdown_rank(0)
    except UserError as exc:
        _end_restarts(job.cfg.train.run_dir, EXIT_USAGE)
        _abort(world, f"error: {exc}", EXIT_USAGE)
    except RunFailed as exc:
        _note(job, world, f"RunFailed: {exc}")
        _dump(exc)
        _abort(world, f"failed: {exc}", 1)
    except BaseException as exc:  # noqa: BLE001 - a bug: its traceback, and no hung peers
        _note(job, world, cause_text(exc), brief=brief_cause(exc))
        _dump(exc, cause_text(exc))
        if storage_error(exc):  # a restart would meet it again: EXIT_STORAGE is not retried
            _end_restarts(job.cfg.train.run_dir, EXIT_STORAGE)
            _abort(world, f"failed: {cause_text(exc)} (a storage error: a restart "
                          "would meet it again)", EXIT_STORAGE)
        if peer_lost(exc):  # expected once another rank died: that rank says why
            _abort(world, f"stopped: a peer rank is gone ({_first_line(exc)}); the rank that "
                          "failed reports why (trace: meshtron doctor "
                          f"{job.cfg.train.run_dir})", 1)
        for line in traceback.format_exc().rstrip().splitlines():
            print(f"[rank {world.rank}] {line}", file=sys.stderr)
        _abort(world, f"failed: {type(exc).__name__}: {exc}", 1)
    doctor.stop()
    shutdown_rank(0)


# What the backends raise in a collective whose peer process died (gloo's tcp transport,
# NCCL's remote-error and watchdog texts): the consequence of another rank's failure.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "ncclRemoteError", "remote process exited")


def peer_lost(exc: BaseException) -> bool:
    """`exc` is a collective failing because a peer rank is gone (not this rank's bug)."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_LOST)


def _first_line(exc: BaseException) -> str:
    """The error's first line without gloo's source-location prefix: its first sentence, or
    120 characters and '...' (never a word cut off unmarked)."""
    import re

    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    text = text.split(". ")[0].rstrip(".")
    return f"{type(exc).__name__}: {text if len(text) <= 120 else text[:117] + '...'}"


def _restarted_by_torchrun(job: TrainJob, world: World) -> bool:
    """torchrun restarts this world on a failure: meshtron's --max-restarts, or an outside
    torchrun's own (restart.torchrun_restarts); not elastic rounds (elastic.py)."""
    from meshtron.checkpoint.restart import torchrun_restarts

    return (world.source == "torchrun" and job.elastic is None
            and (job.checkpoint.max_restarts > 0 or torchrun_restarts()))


def _attempt_store(job: TrainJob, world: World):
    """With automatic restarts, the group's store namespaced by torchrun's attempt (None:
    the usual rendezvous). Without it a restarted outside torchrun's ranks read the last
    attempt's addresses from the agent's store, shared across attempts, and hung in gloo's
    connect or failed it, 'Connection refused' (pytorch/pytorch#135712). Elastic rounds need not: each round's rank 0 hosts a fresh
    store (elastic.py)."""
    if _restarted_by_torchrun(job, world):
        from meshtron.checkpoint.restart import attempt_store

        return attempt_store(world.rank, world.world_size, 600.0)
    return None


def _start_doctor(job: TrainJob, world: World, attempt: int, joining: bool) -> None:
    from meshtron import doctor

    session = doctor.start(job.cfg.train.run_dir, world.rank, world.world_size,
                           watchdog_timeout_s=job.watchdog_timeout_s, recorder=job.recorder,
                           attempt=attempt, joining=joining)
    _watch_failures(session, job, world)
    if _USR1_EARLY:  # asked for before the doctor could dump: dump now
        session.dump("SIGUSR1")


_USR1_EARLY: list[float] = []


def hold_usr1() -> None:
    """From the rank's entry until its doctor starts, SIGUSR1 (the doctor's `kill -USR1`,
    whose default action ends a process) is kept for the doctor's first dump."""
    import time

    signal.signal(signal.SIGUSR1, lambda *_: _USR1_EARLY.append(time.time()))


def _watch_failures(session, job: TrainJob, world: World) -> None:
    """The doctor's watchdog and teardown exits leave a note for the restart record; in a
    fixed world (not elastic rounds or replica groups, whose ranks outlive peers by design) a
    SIGTERM after a peer ended is torchrun's teardown, not a preemption to checkpoint for."""
    from meshtron.checkpoint.preempt import set_peer_check

    session.on_fatal = lambda cause, kind: _note(job, world, cause, kind)
    fixed = job.elastic is None and not job.cfg.train.replica_ft and world.world_size > 1
    session.end_on_teardown = fixed
    set_peer_check(session.peers_gone if fixed else None)


def _attempt(job: TrainJob, world: World) -> int:
    """torchrun's restart attempt when meshtron restarts through it (each attempt's dumps go
    to a folder of their own: doctor.trace_dir); 0 otherwise (elastic agents count their
    restarts each on its own)."""
    if _restarted_by_torchrun(job, world):
        from meshtron.checkpoint.restart import attempt, open_notes

        open_notes(job.cfg.train.run_dir)  # while the disk has room for a folder
        return attempt()
    return 0


def _note(job: TrainJob, world: World, cause: str, kind: str = "exception",
          brief: str | None = None) -> None:
    """Leave the cause for the restarted attempt's `restart` record (meshtron.checkpoint)."""
    if job.checkpoint.max_restarts > 0 or _restarted_by_torchrun(job, world):
        from meshtron.checkpoint.restart import note_failure

        note_failure(job.cfg.train.run_dir, world.rank, cause, kind, brief)


def _dump(exc: BaseException, cause: str | None = None) -> None:
    """The rank's trace on a failure, for `meshtron doctor` (`cause`: the error named, through
    what wraps it)."""
    from meshtron import doctor

    session = doctor.current()
    if session is not None:
        session.dump_exception(exc, cause)


class RunFinished(Exception):
    """--resume of a run already at train.steps: every rank leaves with exit code 0, rank 0
    says so in one line (checkpoint/resume.py `finished_line`)."""


def _start_outside(job: TrainJob, plan) -> dict[str, Any]:
    """Rank 0 of an outside torchrun/srun (no meshtron parent): what the parent does before
    starting ranks (checkpoint/resume.py `prepare_start`: the --resume checks, an --overwrite
    drops the old run's checkpoints), then the run's records (job.write_run_records). A
    --resume of a finished run: {'finished': its line}, nothing written."""
    from meshtron.checkpoint.resume import check_resume, finished_line, prepare_start
    from meshtron.train.job import write_run_records

    check_resume(job.checkpoint, job.cfg, plan)
    line = finished_line(job.checkpoint, job.cfg)
    if line:
        run_lock.release(job.cfg.train.run_dir)
        return {"finished": line}
    from meshtron.checkpoint import restart

    if restart.attempt() == 0:  # a torchrun restart continues this run: its checkpoints stay
        prepare_start(job.checkpoint, job.cfg, job.overwrite, plan)
        _set_aside_earlier_launch(job, plan.gpus)
    write_run_records(job, plan)
    return {}


def _set_aside_earlier_launch(job: TrainJob, world_size: int) -> None:
    """An outside launch's rank 0: what earlier launches left in the run folder's trace and
    failure notes is kept in RUN_DIR/earlier/N (--resume) or removed (a fresh run), as
    meshtron's own launcher does before it starts ranks (train/launch.py
    earlier.keep_or_clear); here after the rendezvous, file by file (train/earlier.py)."""
    from meshtron.checkpoint import store
    from meshtron.train import earlier

    run_dir = Path(job.cfg.train.run_dir)
    resume = bool(job.checkpoint.resume)
    step = store.find_latest(store.checkpoint_root(run_dir), deep=False).step if resume else None
    try:
        kept = earlier.set_aside_in_place(run_dir, world_size, resume, step)
    except OSError as exc:
        raise UserError(f"run_dir={str(run_dir)!r}: could not set aside the previous "
                        f"launch's trace ({exc}); move the old files in "
                        f"{run_dir / 'trace'} away, or free the folder") from None
    earlier.say_kept(run_dir, kept)


def agreed_plan(job: TrainJob, world: World):
    """Rank 0 checks the run folder (unless the parent did) and resolves the plan and the
    cluster; every rank receives the same (or the same error)."""
    import torch.distributed as dist

    from meshtron.planner.cluster import cluster_from_dict
    from meshtron.planner.plan import Plan
    from meshtron.train.planning import resolve_run_plan

    payload: list[Any] = [None]
    if world.rank == 0:
        try:
            if not job.launched_rank:  # an outside torchrun/srun: no parent claimed it
                from meshtron.train import outputs

                if job.elastic is None:
                    run_lock.check_free(job.cfg.train.run_dir)
                from meshtron.checkpoint import restart

                # a restarted attempt continues this run in its own folder
                outputs.check_run_dir(job.cfg, job.overwrite or job.checkpoint.resume
                                      or restart.attempt() > 0)
                if job.elastic is None:  # elastic: elastic.py claims it per job
                    run_lock.claim(job.cfg.train.run_dir)
            plan, cluster = resolve_run_plan(job.cfg, job.parallel or ParallelRequest(),
                                             world.world_size)
            payload[0] = {"plan": plan.to_dict(), "cluster": cluster.to_dict()}
            if not job.launched_rank and job.elastic is None:
                payload[0].update(_start_outside(job, plan))
            if not job.launched_rank and "finished" not in payload[0]:
                # No meshtron parent printed the plan line (an outside torchrun/srun, each
                # elastic round): rank 0 says what this world runs, as the parent would.
                from meshtron.train import outputs

                outputs.print_plan(plan, cluster)
                outputs.print_moe_aux_note(job.cfg.model, plan)
        except UserError as exc:
            run_lock.abandon(job.cfg.train.run_dir)  # nothing left behind by bad input
            payload[0] = {"error": str(exc)}
    if dist.is_initialized() and world.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise UserError(payload[0]["error"])
    if "finished" in payload[0]:
        raise RunFinished(payload[0]["finished"])
    return Plan.from_dict(payload[0]["plan"]), cluster_from_dict(payload[0]["cluster"])


def _end_restarts(run_dir: str, code: int) -> None:
    """This rank ends the job with `code` (bad input, a storage error, a preemption's checkpoint
    written): under meshtron's launcher with restarts (its torchrun agent's pid in PARENT_ENV,
    the run folder in RUN_DIR_ENV), note the code for the agent's process and stop the agent
    with SIGTERM, once per attempt, before this rank exits, so that it stops the other ranks
    instead of restarting them (torchelastic restarts on any failure, whatever the exit code:
    torch 2.13 elastic/agent/server/api.py `_invoke_run`). Nothing elsewhere (one process, an
    outside torchrun: its user's restarts apply)."""
    from meshtron.checkpoint import restart
    from meshtron.launch import PARENT_ENV, RUN_DIR_ENV

    agent = os.environ.get(PARENT_ENV)
    if agent and os.environ.get(RUN_DIR_ENV) and restart.torchrun_restarts() \
            and restart.note_final(run_dir, code):
        os.kill(int(agent), signal.SIGTERM)


def _abort(world: World, message: str, code: int) -> NoReturn:
    print(f"meshtron train (rank {world.rank}): {message}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    # No barrier: the other ranks may be stuck in a collective; torchrun (or the job's own
    # launcher) stops them once this rank is gone.
    from meshtron.runtime import abort_rank

    abort_rank(code)
