"""The run folder of a replica-FT run (`meshtron train --replica-ft G`): claimed, recorded and
finished as every run's (meshtron/train/launch.py, outputs.py), by its launcher.

`run_replica_ft` holds the folder's lock (the groups join it), writes run.toml and config.json,
starts the groups (meshtron/train/replica.py `Launcher`, whose `CommittedSteps` streams
metrics.jsonl: meshtron/train/replica_log.py) and ends with summary.json and curves.png. A
`--resume` of such a folder is refused in one line (`refuse_resume`): the groups keep no
checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from meshtron.errors import RunFailed, UserError
from meshtron.train import run_lock
from meshtron.train.replica_log import CommittedSteps


def refuse_resume(run_dir: str | Path) -> None:
    """--resume of a replica-FT run: refused in one line. Its groups keep no checkpoint while
    it runs (they recover from each other's weights); a finished run's one checkpoint, its
    final state, is for `meshtron export` / `merge`. Nothing when the folder's run.toml does
    not record a replica-FT run."""
    from meshtron.config import load_toml

    run_file = Path(run_dir) / "run.toml"
    try:
        train = load_toml(run_file, "run.toml").get("train", {}) if run_file.is_file() else {}
    except UserError:  # unreadable: not this function's to judge (the resume path reads meta)
        return
    groups = train.get("replica_ft", 0) if isinstance(train, dict) else 0
    if groups:
        raise UserError(f"--resume: {str(run_dir)!r} holds a replica-FT run (train.replica_ft="
                        f"{groups}), which does not resume (its groups recover from each other "
                        "while it runs; it saves only its final state, for export and merge); "
                        "start it again with --overwrite")


def run_replica_ft(job, max_restarts: int) -> int:
    """`meshtron train --replica-ft G` (`job`: its TrainJob): the run folder as every run
    keeps it (lock, run.toml, config.json, metrics.jsonl as steps commit, summary.json,
    curves.png), the Lighthouse and the groups in between."""
    from meshtron.data.tokenizer import keep_tokenizer
    from meshtron.doctor.dump import clear_trace
    from meshtron.train.replica import Launcher
    from meshtron.train import outputs
    from meshtron.train.launch import claim_run_dir, write_single_process_files
    from meshtron.train.job import warn
    from meshtron.train.run_data import build_run_data

    cfg = job.cfg
    os.environ.setdefault("RUST_LOG", "error")  # the Lighthouse logs every quorum otherwise
    run_lock.check_free(cfg.train.run_dir)
    outputs.check_run_dir(cfg, job.overwrite)
    data = build_run_data(cfg)  # bad data input fails here, before anything is written
    claim_run_dir(job, plan=None)  # held until the last group exits (they join it)
    try:
        warn(job)
        write_single_process_files(job)  # run.toml (what --resume, export, doctor read)
        clear_trace(Path(cfg.train.run_dir))  # an earlier run's: doctor would read it as ours
        run_dir = outputs.prepare_run_dir(cfg)
        keep_tokenizer(data.tokenizer, run_dir)  # a Hugging Face tokenizer's files, for export
        t0 = time.time()
        launcher = Launcher(cfg, max_restarts)
        try:
            done = launcher.run()
        except RunFailed as exc:
            from meshtron.checkpoint import history

            history.append(run_dir / "metrics.jsonl", {
                "event": "failed", "cause": str(exc), "steps_committed":
                launcher.steps.next_step - 1, "time": time.time()})
            raise
    finally:
        run_lock.release(cfg.train.run_dir)
    summary = replica_summary(cfg, launcher.steps, done, time.time() - t0)
    check_final_checkpoint(cfg, launcher.dir)
    outputs.finish_run(run_dir, summary, launcher.steps.records)
    outputs.print_result(cfg, summary, run_dir)
    print(f"replica-ft: {cfg.train.steps} steps on {cfg.train.replica_ft} replica groups, "
          f"{summary['degraded_steps']} with fewer; events in {launcher.dir}")
    for line in unjoined_replacements(launcher.dir / "events.jsonl"):
        print(line)
    return 0


def unjoined_replacements(events: Path) -> list[str]:
    """One line per replacement group that left without ever rejoining (replica.py
    `run_group`: alone in its quorum with no live state to copy, it exits NO_PEER_EXIT), read
    from the launcher's events.jsonl: the run finished without it."""
    from meshtron.train.replica import NO_PEER_EXIT

    last: dict[int, dict[str, Any]] = {}
    for line in events.read_text().splitlines() if events.exists() else []:
        event = json.loads(line)
        if event.get("event") == "exit":
            last[event["group"]] = event
    return [f"replica-ft: group {g}'s replacement (attempt {e['attempt']}) never rejoined: "
            "the other groups had finished, leaving no live state to copy (exit "
            f"{NO_PEER_EXIT}); the run's steps after its failure were taken without it"
            for g, e in sorted(last.items())
            if e.get("rc") == NO_PEER_EXIT and e.get("attempt", 0) > 0]


def replica_summary(cfg, steps: CommittedSteps, done: list[Any],
                    wall_s: float) -> dict[str, Any]:
    """summary.json: a single-process run's fields (meshtron/train/loop.py TrainResult), then
    the replica groups', degraded steps and the groups that finished."""
    from meshtron.train.loop import TrainResult

    if steps.next_step <= cfg.train.steps:
        raise RunFailed(f"replica-ft: the groups finished but logged steps only up to "
                        f"{steps.next_step - 1} of {cfg.train.steps}; see {steps.group_dir}")
    logged = steps.records
    result = TrainResult(
        steps=cfg.train.steps, first_loss=logged[0]["loss"], final_loss=logged[-1]["loss"],
        eval_loss=steps.eval_loss, tokens=cfg.data.global_batch * cfg.data.seq_len
        * cfg.train.steps, wall_s=wall_s, tokens_per_s=steps.clock.tokens_per_s(),
        step_time_s=steps.clock.median_step_s(), params=cfg.model.num_params())
    return {**result.to_dict(), "replica_groups": cfg.train.replica_ft,
            "degraded_steps": steps.degraded_steps,
            "groups_finished": sorted(r.group for r in done)}


def check_final_checkpoint(cfg, group_dir: Path) -> None:
    """The final state's checkpoint (replica.save_final_checkpoint: the first group to finish
    writes it, and only that one) is committed: a group that claimed it and then failed (its
    log in `group_dir`) leaves the run without one, which the run reports as failed rather
    than a finished run that export and merge then refuse."""
    from meshtron.checkpoint import store

    steps = cfg.train.steps
    if not any(step == steps for step, _ in store.committed(
            store.checkpoint_root(cfg.train.run_dir))):
        raise RunFailed(f"replica-ft: the groups finished {steps} steps but the final "
                        f"checkpoint (checkpoints/{store.step_name(steps)}) was not committed; "
                        f"see {group_dir}/*.log")
