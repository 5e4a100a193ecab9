"""The training loop's checkpoint manager: resume, periodic asynchronous saves, preemption.

One `Checkpointer` per rank; every method is called by every rank at the same point of the loop
(they are collective). Saving (Nicolae et al.'s two-phase scheme, as torch.distributed.checkpoint's
`async_save` implements it): the step's state is copied to host memory (pinned, with non-blocking
copies on a side stream, on CUDA) by DCP's stager thread, then written by a background thread,
while training continues. The training thread blocks only where it must: before the next
optimizer step (a step pre-hook), the first write to the tensors being copied, if the copy is not
done by then (torchtitan's `maybe_wait_for_staging` at the same point). One save is in flight at
a time: the next one first waits for it. Each rank's background thread then hashes the files that
rank wrote, rank 0 gathers the digests, writes the manifest and commits (integrity.py, store.py).
DCP's background collectives and the digests run on a gloo group of their own: on the training
group they crash with 'Connection reset by peer' (shared notes); a second gloo group carries the
per-step preemption vote, so the two threads never share a group.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# `integrity` (DCP's writer) is imported where a checkpoint is read or written: a run that never
# checkpoints imports no torch.distributed.checkpoint (its own share: about 0.05 s of CPU per
# rank, measured with FSDP2's DTensor and dynamo already imported, which every rank needs).
from meshtron.checkpoint import history, rank_entries, restart, staging, state, store
from meshtron.checkpoint.config import CheckpointConfig, recorded_settings
from meshtron.checkpoint.preempt import PreemptionWatch
from meshtron.checkpoint.resume import check_compatible, prepare_start  # noqa: F401 (API)
from meshtron.errors import UserError

AUTO_PROBE_STEPS = 8
"""With `--checkpoint-every auto`, the first save happens after this many steps of the attempt:
its stall is the measured save cost, and the steps before it give the step time."""
AUTO_WARMUP_STEPS = 3
"""The attempt's first steps are not timed for `auto`: they allocate, autotune and compile
(the audit: 6.16 s, then 0.58 s, on a run whose later steps took about 1 s; their median was
taken as the step). A run shorter than the probe times its last step."""


class Preempted(Exception):
    """SIGTERM reached a rank; the checkpoint of `step` is committed. Exit with EXIT_PREEMPTED."""

    def __init__(self, step: int, seconds: float):
        super().__init__(f"preempted after step {step}; checkpoint committed in {seconds:.1f} s")
        self.step = step
        self.seconds = seconds


def _stager(staging_thread: bool = True):
    """One stager for the whole run: it keeps its host buffers (pinned on CUDA) from one save to
    the next instead of allocating them per save. Safe because a save starts only after the
    previous one has finished reading them (one save in flight). Staging runs on the stager's
    thread (and CUDA side stream); `Checkpointer.wait_staging` holds back the next optimizer
    step until the copy is complete, so no tensor changes while it is read. `staging_thread`
    False: copy on the training thread inside `save` (bench/checkpoint_save.py compares)."""
    return staging.OrderedStager(staging_thread, staging.device_streams())


def _as_typed(line: str, ckpt: CheckpointConfig) -> str:
    """A refusal of the checkpoint's settings, named as what the user typed: an elastic round
    continues the job's checkpoint without a --resume (audit s55: its ranks said '--resume:
    train.steps=20: ...' to a user who never gave --resume)."""
    if ckpt.resume_if_any and not ckpt.resume and line.startswith("--resume: "):
        return ("elastic round (continuing the job's newest checkpoint): "
                + line.removeprefix("--resume: "))
    return line


def make_checkpointer(ckpt: CheckpointConfig | None, cfg: Any, engine: Any, data: Any,
                      plan: Any = None) -> "Checkpointer | None":
    """The loop's checkpointer for this job (collective: every rank calls it), or None when the
    job neither saves nor resumes."""
    if ckpt is None or not (ckpt.enabled or restart.attempt() > 0):
        return None
    return Checkpointer(ckpt, cfg, engine, data, cfg.train.run_dir, plan)


class Checkpointer:
    """See the module docstring. `engine`: LocalEngine or ParallelEngine; `data`: the run's data
    (its `state_dict` is the sampler position); `plan`: the plan (None on one process);
    `staging_thread`: see `_stager`."""

    def __init__(self, ckpt: CheckpointConfig, cfg: Any, engine: Any, data: Any,
                 run_dir: str | Path, plan: Any = None, staging_thread: bool = True):
        self.ckpt, self.cfg, self.data, self.plan = ckpt, cfg, data, plan
        self.engine = engine
        self.run_dir = Path(run_dir)
        self.root = store.checkpoint_root(run_dir)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if self.distributed:
            self.save_group = dist.new_group(backend="gloo")
            self.vote_group = dist.new_group(backend="gloo")
        if not self.distributed:  # one process: DCP warns that it assumes one process
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        self.state = state.EngineState(engine)
        from meshtron.checkpoint.snapshot import make_snapshots

        self.snapshots = make_snapshots(ckpt, self.state, engine, data, run_dir, plan) \
            if self.distributed else None
        """In-memory snapshots (--snapshot-every), or None."""
        self.presized = False
        """The last load built the optimizer's states from the checkpoint's metadata (no
        zero-lr optimizer step: EngineState.presize_optimizer)."""
        self.restored: dict[str, Any] = {}
        """How a restarted attempt got its state: restored_from (memory | disk), restore_s."""
        self._finished = False
        self.every: int | None = ckpt.every if isinstance(ckpt.every, int) else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="meshtron-ckpt")
        self._stager = _stager(staging_thread)
        self._inflight: Future | None = None
        self._staging: Future | None = None
        # The optimizer step is the first write to the tensors a save copies: wait there.
        self._step_hook = engine.optimizer.register_step_pre_hook(self._before_step)
        self._step_marks: list[float] = []
        self.watch = PreemptionWatch(self.rank)
        self.start_step = 0
        self.resumed = False
        self.stalls_s: list[float] = []
        """Seconds the training thread was blocked by each save: in `save` (collecting the
        state, waiting for the previous save when it was still in flight) and before the next
        optimizer step (the copy to host memory, when not done by then)."""
        self.commits_s: list[float] = []
        """Seconds from the start of each save to its commit (main rank; written, hashed,
        manifest, renamed)."""

    # ---- helpers ------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"meshtron train: {text}", file=sys.stderr, flush=True)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.vote_group)

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.vote_group)
        return box[0]

    def _max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device="cpu")
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.vote_group)
        return t.tolist()

    @property
    def may_resume(self) -> bool:
        """This start continues a run (--resume, or a torchrun restart)."""
        return self.ckpt.resume or self.ckpt.resume_if_any or restart.attempt() > 0

    # ---- start ---------------------------------------------------------------------------------
    def start(self) -> int:
        """Clear unfinished saves, then resume when asked (or when torchrun restarted us);
        returns the number of steps already done (0: a fresh start). Marks the start-up phases
        (meshtron/checkpoint/phases.py) around it."""
        from meshtron.checkpoint import phases

        phases.mark("engine_built")
        step = self._resume()
        phases.mark("restored")
        return step

    def _resume(self) -> int:
        """Clear unfinished saves, then resume when asked (or when torchrun restarted us);
        returns the number of steps already done (0: a fresh start)."""
        n = restart.attempt()
        resume = self.may_resume
        if self.rank == 0:
            if not resume and self.root.is_dir():  # a fresh run replaces an old run's state
                store.clear_root(self.root)
            store.remove_partial(self.root)
            (self.root / store.PREEMPTED).unlink(missing_ok=True)
        if self.snapshots is not None and n == 0:
            self.snapshots.clear()
        self._barrier()
        self.resumed = resume
        if not resume:
            return 0
        if n > 0 and self.snapshots is not None:
            newest = self._broadcast(next((s for s, _ in store.committed(self.root)), None)
                                     if self.rank == 0 else None)
            step = self.snapshots.restore(newest)
            if step is not None:
                self.restored = dict(self.snapshots.restored or {})
                self.start_step = step
                return step
        from meshtron.checkpoint import integrity

        t0 = time.perf_counter()
        found = integrity.find_latest(self.root, self.rank, self.world_size,
                                      self.vote_group if self.distributed else None)
        for line in found.report():
            self.say(line)
        chosen = self._broadcast(None if found is None or found.path is None
                                 else (found.step, str(found.path)))
        if chosen is None:
            if self.ckpt.resume_if_any:  # an elastic job before its first checkpoint: step 0
                self.resumed = False
                return 0
            if n == 0:
                raise UserError(f"--resume: no complete checkpoint in {self.root}"
                                + ("" if found is None or not found.rejected else
                                   " (" + "; ".join(f"{a}: {b}" for a, b in found.rejected)
                                   + ")"))
            self.say(f"restart {n}: no complete checkpoint yet; starting over from step 0")
            return 0
        step, path = chosen
        t1 = time.perf_counter()
        parts = self.load(Path(path))
        total, *maxed = self._max([time.perf_counter() - t0, t1 - t0, *parts.values()])
        self.restored = {"restored_from": "disk", "restore_s": total,
                         "presized_optimizer": self.presized,
                         "restore_parts_s": dict(zip(("verify", *parts), maxed))}
        self.start_step = step
        return step

    def history(self) -> list[dict[str, Any]]:
        """Main rank, after `start`: cut metrics.jsonl back to the resumed step (the steps after
        it are trained again), add the `restart` / `resume` record, and return the step records
        kept (the earlier part of the run, for summary.json and curves.png)."""
        if self.rank != 0 or not self.resumed:
            return []
        path = self.run_dir / "metrics.jsonl"
        kept, last = history.truncate(path, self.start_step)
        n = restart.attempt()
        # An elastic job's agents count their restarts each on its own (a node that joins later
        # starts at 0), so attempt notes do not name a cause there: its `replan` record does.
        if n > 0 and not self.ckpt.resume_if_any:
            event = restart.restart_record(self.run_dir, self.world_size, self.start_step, last)
            event.update(self.restored)
            from meshtron.checkpoint import phases

            event["phases"] = phases.marks()  # this rank's start-up, for the benches
            self.say(f"restart {n} (torchrun): {event['cause']}; "
                     f"{restart.resumed_words(self.start_step, event['lost_steps'])}")
        else:
            event = {"event": "resume", "resumed_from_step": self.start_step,
                     "last_logged_step": last, "time": time.time()}
            if self.ckpt.resume_if_any:
                event["lost_steps"] = None if last is None else max(0, last - self.start_step)
        history.append(path, event)
        return kept

    def past_intervals(self) -> list[tuple[int, int, float, bool]]:
        """Main rank, after `history`: the step clock's intervals of the steps kept from the
        earlier attempts (so tokens/s covers every step 1..N once)."""
        if self.rank != 0 or not self.resumed:
            return []
        return history.past_intervals(self.run_dir / "metrics.jsonl")

    def load(self, folder: Path) -> dict[str, float]:
        """Load the checkpoint in `folder` (collective); returns its parts' seconds (template:
        the engine's state dict DCP loads into; read: dcp.load; apply: into the engine)."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        meta = store.read_meta(folder)
        try:
            check_compatible(meta, self.cfg, folder, self.plan,
                             lr_override=self.ckpt.override_lr_schedule)
        except UserError as exc:
            raise UserError(_as_typed(str(exc), self.ckpt)) from None
        saved_replicas = int(meta.get("replica_states", 1))
        per_replica = saved_replicas > 1 and saved_replicas == self.state.replicas
        if saved_replicas > 1 and not per_replica:
            self.say(f"{folder.name} was saved inside a DiLoCo round by {saved_replicas} "
                     f"replicas; this run has {self.state.replicas}: every replica continues "
                     "from replica 0's model and optimizer")
        # no zero-lr optimizer step to build the template (state.py presize_optimizer)
        self.presized = not per_replica and \
            self.state.presize_optimizer(_saved_optimizer_states(folder))
        template = self.state.tensors(per_replica)
        # each rank's own error-feedback residual only on the same layout (rank_entries.py)
        residual_note = rank_entries.select(template, folder, meta, self.world_size, self.plan)
        t1 = time.perf_counter()
        dcp.load(template, checkpoint_id=str(folder),
                 process_group=self.save_group if self.distributed else None,
                 no_dist=not self.distributed)
        t2 = time.perf_counter()
        self.state.load_tensors(template, per_replica)
        state.set_schedule_position(self.engine.scheduler, meta["schedule_last_epoch"])
        self.data.load_state_dict(meta["data"])
        rank_doc = state.read_rank_file(folder, self.rank, meta["world_size"])
        state.set_rng_state(rank_doc["rng"])
        self.say(f"resumed from {folder} (step {meta['step']}, saved on "
                 f"{meta['world_size']} rank(s){_layout(meta.get('plan'))})")
        if residual_note:
            self.say(residual_note)
        return {"template": t1 - t0, "read": t2 - t1, "apply": time.perf_counter() - t2}

    # ---- saving --------------------------------------------------------------------------------
    def save(self, step: int, blocking: bool = False) -> float:
        """Checkpoint the state after `step`; returns the seconds the caller was blocked.
        `blocking`: write, checksum and commit before returning (no background thread)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from meshtron.checkpoint import integrity

        t0 = time.perf_counter()
        self.wait()
        tmp = self.root / (store.TMP_PREFIX + store.step_name(step))
        tmp.mkdir(parents=True, exist_ok=True)
        state.write_rank_file(tmp, self.rank)
        if self.rank == 0:
            store.write_json(tmp / store.META, self._meta(step))
        writer = integrity.RecordingWriter(str(tmp))
        group = self.save_group if self.distributed else None
        tensors = self.state.tensors(per_replica=self.state.diverged())
        if self.ckpt.residuals == "mean":  # --checkpoint-residuals mean: the group's mean only
            rank_entries.drop_own(tensors)
        if blocking:
            dcp.save(tensors, storage_writer=writer, process_group=group,
                     no_dist=not self.distributed)
            self._commit(step, writer, t0)
        else:
            response = dcp.async_save(tensors, storage_writer=writer, process_group=group,
                                      no_dist=not self.distributed, async_stager=self._stager)
            upload = response
            if isinstance(response, AsyncSaveResponse):
                self._staging, upload = response.staging_completion, response.upload_completion
            self._inflight = self._executor.submit(self._finish, upload, step, writer, t0)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        return stall

    def _before_step(self, *_: Any) -> None:
        self.wait_staging()
        if self.snapshots is not None:
            self.snapshots.wait_staging()

    def wait_staging(self) -> float:
        """Block until the save in flight has copied the state to host memory (called before
        every optimizer step); returns the seconds blocked, added to that save's stall."""
        return staging.wait_staging(self)

    def _meta(self, step: int) -> dict[str, Any]:
        return {"format": store.FORMAT, "step": step, "world_size": self.world_size,
                "data": self.data.state_dict(),
                "schedule_last_epoch": self.engine.scheduler.last_epoch,
                "replica_states": self.state.replicas if self.state.diverged() else 1,
                "plan": self.plan.to_dict() if self.plan is not None else None,
                "config": json.loads(json.dumps(self.cfg.to_dict(), default=str)),
                "checkpoint": recorded_settings(self.ckpt), "time": time.time()}

    def _finish(self, future: Any, step: int, writer: Any, t0: float) -> None:
        future.result()  # every rank's shards written (DCP gathers them before its metadata)
        self._commit(step, writer, t0)

    def _commit(self, step: int, writer: Any, t0: float) -> None:
        """Collective over the save group: every rank hashes the files it wrote; rank 0
        writes the manifest from the gathered digests and commits."""
        tmp = self.root / (store.TMP_PREFIX + store.step_name(step))
        from meshtron.checkpoint import integrity

        mine = [f"rank_{self.rank}.json", *writer.written]
        if self.rank == 0:
            mine += [".metadata", store.META]
        digests = integrity.gather_digests(tmp, mine, self.rank, self.world_size,
                                           self.save_group if self.distributed else None)
        if self.rank != 0:
            return
        store.write_manifest(tmp, step, digests)
        final = store.commit(self.root, step)
        self.commits_s.append(time.perf_counter() - t0)
        removed = store.prune(self.root, self.ckpt.keep)
        gone = f"; removed {', '.join(removed)}" if removed else ""
        print(f"meshtron train: checkpoint {final.name} committed{gone}", file=sys.stderr,
              flush=True)

    def wait(self) -> None:
        """Wait for the save in flight (its error, if any, is raised here)."""
        self.wait_staging()
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()

    # ---- the loop's hook -----------------------------------------------------------------------
    def after_step(self, step: int, total_steps: int) -> None:
        """Called by every rank after optimizer step `step`: periodic save, `auto` probe, and
        the preemption vote (raises `Preempted` once the checkpoint is committed)."""
        self._step_marks.append(time.perf_counter())
        if self._preempt_vote():
            self._preempt(step)
        if self.every is None and self.ckpt.every == "auto" \
                and step - self.start_step == min(AUTO_PROBE_STEPS, total_steps - self.start_step):
            self._choose_interval(step)
        elif self.every and (step % self.every == 0 or step == total_steps):
            self.save(step)
        if self.snapshots is not None:
            self.snapshots.after_step(step, total_steps)
        self._finished = step == total_steps

    def _preempt_vote(self) -> bool:
        """Whether any rank got SIGTERM: a one-element MAX all-reduce on a gloo group, so every
        rank stops after the same step even when one rank alone was signalled."""
        flag = 1.0 if self.watch.requested else 0.0
        return self._max([flag])[0] > 0 if self.distributed else flag > 0

    def _preempt(self, step: int) -> None:
        t0 = self.watch.requested_at or time.monotonic()
        self.save(step)
        self.wait()
        seconds = time.monotonic() - t0
        if self.rank == 0:
            doc = {"step": step, "seconds_after_signal": seconds,
                   "grace_s": self.ckpt.preempt_grace_s}
            store.write_json(self.root / store.PREEMPTED, doc)
            history.append(self.run_dir / "metrics.jsonl", {
                "event": "preempted", "checkpoint_step": step, "seconds_after_signal": seconds,
                "grace_s": self.ckpt.preempt_grace_s, "time": time.time()})
            late = "" if seconds <= self.ckpt.preempt_grace_s else (
                f" (over the {self.ckpt.preempt_grace_s:g} s grace: lower --checkpoint-every "
                "so less work is at risk, or raise --preempt-grace)")
            self.say(f"preempted: checkpoint of step {step} committed {seconds:.1f} s after "
                     f"the signal{late}; continue with --resume")
        raise Preempted(step, seconds)

    def _choose_interval(self, step: int) -> None:
        """`--checkpoint-every auto`: save once, measure the stall, apply Daly's interval."""
        from meshtron.reliability import (
            cluster_mtbf_s,
            expected_overhead_fraction,
            interval_steps,
        )

        marks = self._step_marks  # one after each step of the attempt: gaps time steps 2, 3, ..
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        timed = gaps[AUTO_WARMUP_STEPS - 1:] or gaps[-1:]
        # gaps[i] is step start + 2 + i; a one-step attempt has no gap (as before: 1 ms)
        first = self.start_step + 2 + len(gaps) - len(timed) if timed else step
        timed = timed or [1e-3]
        # The probe waits for the copy to host memory at once: an upper bound of the stall
        # (later saves overlap it with the next forward and backward).
        stall = self.save(step) + self.wait_staging()
        stall, step_s = self._max([stall, statistics.median(timed)])
        step_s = max(step_s, 1e-6)
        if self.ckpt.mtbf_hours is not None:
            mtbf, source = self.ckpt.mtbf_hours * 3600.0, "--mtbf-hours"
        else:
            mtbf = cluster_mtbf_s(self.world_size)
            source = f"{self.world_size} GPU(s) at Llama 3's 1.97e-5 failures per GPU-hour"
        self.every = interval_steps(step_s, max(stall, 1e-6), mtbf)
        overhead = expected_overhead_fraction(self.every * step_s, stall, mtbf)
        steps = f"step {first}" if first == step else f"steps {first}-{step}"
        self.say(f"--checkpoint-every auto: save stall {stall * 1e3:.1f} ms, step "
                 f"{step_s * 1e3:.1f} ms (median of {steps}), MTBF {mtbf / 3600:.3g} h ({source}) -> checkpoint "
                 f"every {self.every} steps ({self.every * step_s:.1f} s, Daly 2006); expected "
                 f"overhead {overhead * 100:.3g}% (stalls + lost work)")

    def close(self, step: int | None = None) -> None:
        """At the end of the run: wait for the save in flight, release the signal handler."""
        try:
            self.wait()
            if self.snapshots is not None:
                self.snapshots.close(self._finished)
        finally:
            self._step_hook.remove()
            self._executor.shutdown(wait=True)
            self._stager.close()
            self.watch.close()


def _saved_optimizer_states(folder: Path) -> dict[str, tuple[torch.dtype, bool]]:
    """{'state.<fqn>.<name>': (dtype, scalar)} of the optimizer tensors in DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    prefix = "optim.state."
    for key, md in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            out[key[len("optim."):]] = (md.properties.dtype, len(md.size) == 0)
    return out


def _layout(plan: dict[str, Any] | None) -> str:
    if not plan:
        return ""
    cp = f" cp={plan['cp']}" if (plan.get("cp") or 1) > 1 else ""
    ep = f" ep={plan['ep']}" if (plan.get("ep") or 1) > 1 else ""
    schedule = ""
    if (plan.get("pp") or 1) > 1 and plan.get("schedule"):
        v = plan.get("virtual_stages") or 1
        schedule = f" schedule={plan['schedule']}" + (f":{v}" if v > 1 else "")
    return (f", layout tp={plan.get('tp')}{cp} pp={plan.get('pp')} dp={plan.get('dp')}{ep} "
            f"zero={plan.get('zero')}{schedule}")
