"""Per-step fault tolerance across data-parallel replica groups (`meshtron train --replica-ft G`),
on torchft 0.2.0 (github.com/pytorch/torchft: its Lighthouse, Manager and reconfigurable
ProcessGroupGloo; torchft's own fault-tolerant HSDP/DDP design).

Layout: G replica groups, one process each, each holding the whole model and its AdamW state
(plain data parallelism, ZeRO-0, per group). Replica group i reads rows [i*B/G, (i+1)*B/G) of
the single-process global batch, as data-parallel rank i does in meshtron/train/parallel.py.

One step: a quorum of the live groups (the Lighthouse, in the launching process), then forward
and backward on the group's rows, then ONE all-reduce (average over the quorum's participants)
of a flat buffer holding every gradient and the loss, then the optimizer step if every
participant commits (`Manager.should_commit`). When a group dies (SIGKILL, lost host), the
others' all-reduce fails, they do not commit, and the same step is retried at once by a quorum
of the survivors (the data position is rewound to the step's start): training goes on at G-1
groups without a restart or a checkpoint. The launching process starts a replacement
(`--max-restarts` times in all); it joins the next quorum, and torchft copies the live model,
optimizer, LR-schedule and data position from a healthy group (its HTTP checkpoint transport)
before the step, so from then on every group holds the same weights bit for bit.

What is exact:
- with no failure, the update equals data parallelism at G replicas, i.e. the single-process
  run on the same seed and global batch (float tolerance: the mean of G partial gradients);
- at a step that a quorum of k < G groups commits, the update is the mean gradient over those
  k groups' rows only: a run at k replicas for that step. The dropped groups' rows (micro-
  batches) of that step are never trained on (they are not replayed later), so a run with a
  failure is NOT bit-identical to one without;
- a rejoined group's weights, optimizer state and data position equal the healthy groups'
  exactly (tests/test_replica_ft.py compares them bit for bit at the end).

Events (exits, restarts, quorum sizes per step) go to RUN_DIR/replica_ft/; the run folder's
records (run.toml, config.json, metrics.jsonl as steps commit, summary.json) are written as
every run writes them (meshtron/train/replica_run.py).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.errors import RunFailed, UserError
from meshtron.train import run_lock
from meshtron.train.replica_log import CommittedSteps

QUORUM_TIMEOUT_S = 60.0
"""A quorum (or an all-reduce) not reached in this long fails the step for good."""
HEARTBEAT_TIMEOUT_MS = 1000
"""The Lighthouse drops a group from the next quorum after this long without a heartbeat
(torchft's default is 5000; a killed process's connection errors arrive sooner anyway)."""
NO_PEER_EXIT = 3
"""Exit status of a replacement group that found no healthy group to copy from."""
JOIN_TIMEOUT_MS = 100
"""How long the Lighthouse waits for more groups to join before forming a smaller quorum."""


@dataclass(frozen=True)
class ReplicaFTJob:
    """What the launcher hands every replica-group process (pickled into RUN_DIR/replica_ft)."""

    cfg: Any
    """The RunConfig (train.replica_ft = the number of replica groups)."""
    lighthouse: str
    """Address of the torchft Lighthouse (http://host:port)."""
    groups: int
    """Replica groups of the full-strength run (the data split)."""


@dataclass
class GroupRecord:
    """One replica-group process's outcome (RUN_DIR/replica_ft/group<i>_<attempt>.json)."""

    group: int
    """Replica-group index (its data rows)."""
    attempt: int
    """0 for the first process of this group, then 1, 2... for replacements."""
    first_step: int
    """The step this process started at (0, or the step it healed into)."""
    last_step: int
    """Steps committed when it finished."""
    healed: bool
    """It copied the live state from a healthy group before its first step."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """Per committed step: step, loss (global mean over the quorum), participants, t."""


def group_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "replica_ft"


# ---- one replica group ----------------------------------------------------------------------

class _Group:
    """The model, optimizer, schedule and data of one replica group, with torchft's Manager."""

    def __init__(self, job: ReplicaFTJob, group: int):
        import torch
        from datetime import timedelta

        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        from meshtron.train.loop import LocalEngine, build_run_data

        torch.set_num_threads(1)
        self.cfg = cfg = job.cfg
        self.engine = LocalEngine(cfg)
        self.data = build_run_data(cfg, dp_rank=group, dp_size=job.groups, main=False)
        self.params = [p for p in self.engine.model.parameters() if p.requires_grad]
        self.healed = False
        self.eval_set = None
        self.groups = job.groups
        self.started = time.monotonic()
        # The group's own store (torchft's per-group rendezvous); one rank per group here.
        self.store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
        timeout = timedelta(seconds=QUORUM_TIMEOUT_S)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
            load_state_dict=self._load, state_dict=self._state, use_async_quorum=False,
            replica_id=f"group{group}", store_addr="127.0.0.1", store_port=self.store.port,
            rank=0, world_size=1, lighthouse_addr=job.lighthouse, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout)

    def _state(self) -> dict[str, Any]:
        e = self.engine
        return {"model": e.model.state_dict(), "optim": e.optimizer.state_dict(),
                "sched": e.scheduler.state_dict(), "data": self.data.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        e = self.engine
        e.model.load_state_dict(state["model"])
        e.optimizer.load_state_dict(state["optim"])
        e.scheduler.load_state_dict(state["sched"])
        self.data.load_state_dict(state["data"])
        self.healed = True

    def step(self) -> dict[str, Any] | None:
        """One fault-tolerant step; the record when it committed, None when it is retried."""
        import torch

        from meshtron.train.loop import forward_backward

        e, m = self.engine, self.manager
        m.start_quorum()  # blocking: a recovering group loads the live state here
        if (m.current_step() == 0 and m.num_participants() < self.groups
                and time.monotonic() < self.started + QUORUM_TIMEOUT_S):
            # Step 1 waits for every group (the first to start would otherwise take it alone,
            # on 1/G of the batch): every member of this quorum sees the same count and skips.
            m.report_error(RuntimeError("waiting for every replica group before step 1"))
            m.should_commit()
            time.sleep(0.05)
            return None
        position = self.data.state_dict()
        inputs, targets = self.data.next_batch()
        loss = forward_backward(e.model, inputs, targets, e.micro)
        # One collective per step: every gradient and the loss in one flat buffer.
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [loss.reshape(1)])
        m.allreduce(flat).wait()
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        norm = (torch.nn.utils.clip_grad_norm_(self.params, e.grad_clip, foreach=True)
                if e.grad_clip > 0 else None)
        lr = e.scheduler.get_last_lr()[0]
        committed = m.should_commit()
        if committed:
            e.optimizer.step()
            e.scheduler.step()
        else:
            self.data.load_state_dict(position)  # the retried step reads the same rows
        e.optimizer.zero_grad(set_to_none=True)
        if not committed:
            return None
        return {"step": m.current_step(), "loss": float(flat[-1]), "lr": lr,
                "grad_norm": float(norm) if norm is not None else None,
                "participants": m.num_participants(), "t": time.time()}

    def evaluate(self, step: int) -> dict[str, float]:
        """eval_loss and eval_time_s at the run's evaluation steps (the loop's rule), else {}.
        Every group evaluates the whole held-out set (the single-process run's, not its own
        rows of it) with the same weights after a commit, so each computes the same value."""
        from meshtron.train.loop import build_run_data
        from meshtron.train.metrics import evaluates_at

        if not evaluates_at(self.cfg.train, step):
            return {}
        t0 = time.perf_counter()
        if self.eval_set is None:
            self.eval_set = build_run_data(self.cfg, main=False).eval_batches()
        loss = self.engine.evaluate(self.eval_set)
        return {"eval_loss": loss, "eval_time_s": time.perf_counter() - t0}


def run_group(job_path: Path, group: int, attempt: int) -> int:
    """A replica-group process: train until the run's last step, then write its record."""
    job: ReplicaFTJob = pickle.loads(Path(job_path).read_bytes())
    run_lock.join(job.cfg.train.run_dir)  # the folder stays held while any group lives
    g = _Group(job, group)
    steps = job.cfg.train.steps
    rec = GroupRecord(group=group, attempt=attempt, first_step=-1, last_step=0, healed=False)
    out = group_dir(Path(job.cfg.train.run_dir))
    log = (out / f"group{group}_{attempt}.jsonl").open("a")
    mark = time.perf_counter()
    while g.manager.current_step() < steps:
        r = g.step()
        if attempt > 0 and not g.healed and g.manager.num_participants() == 1:
            # A replacement alone in its quorum has no live state to copy: it would start the
            # run again from step 0. It leaves instead (the others finished or all died).
            os._exit(NO_PEER_EXIT)
        if rec.first_step < 0:
            rec.first_step = g.manager.current_step() - (1 if r else 0)
            rec.healed = g.healed
        if r is not None:
            # training seconds since the last commit (retried attempts included), evaluation
            # excluded, as the loop's step clock counts them
            r["seconds"] = time.perf_counter() - mark
            r.update(g.evaluate(r["step"]))
            r["group"] = group
            rec.records.append(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
            mark = time.perf_counter()
    rec.last_step = g.manager.current_step()
    import torch

    torch.save(g.engine.model.state_dict(), out / f"group{group}_final.pt")
    if rec.last_step == steps and _first_to_finish(out):
        save_final_checkpoint(g)
    (out / f"group{group}_{attempt}.json").write_text(json.dumps(rec.__dict__))
    g.manager.shutdown(wait=False)
    os._exit(0)  # skip interpreter teardown of the gloo groups (shared notes: abort at exit)


def _first_to_finish(out: Path) -> bool:
    """True in exactly one group process of the run: the first to finish (an O_EXCL file)."""
    try:
        os.close(os.open(out / "final.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def save_final_checkpoint(g: _Group) -> None:
    """The run's final state (model, optimizer, schedule, data position after the last step)
    as a committed checkpoint, RUN_DIR/checkpoints/step_N, written by the single-process
    checkpointer (meshtron/checkpoint/checkpointer.py): what `meshtron export` and `meshtron
    merge` read. Every finished group holds the same state bit for bit, so one writes it."""
    from meshtron.checkpoint.checkpointer import Checkpointer
    from meshtron.checkpoint.config import CheckpointConfig

    ckpt = Checkpointer(CheckpointConfig(), g.cfg, g.engine, g.data, g.cfg.train.run_dir,
                        staging_thread=False)
    try:
        ckpt.save(g.cfg.train.steps, blocking=True)
    finally:
        ckpt.close()


# ---- the launcher ---------------------------------------------------------------------------

def check_replica_ft(cfg, parallel_asked: bool, saving: dict | None = None) -> int:
    """The replica-group count of a valid replica-FT run (UserError otherwise). `saving`: the
    checkpoint flags given ({flag: value}); replica groups keep no disk checkpoint or
    in-memory snapshot (they recover from each other's weights), so a flag asking for one is
    refused rather than silently ignored."""
    g = cfg.train.replica_ft
    if parallel_asked:
        raise UserError(f"train.replica_ft={g}: runs one process per replica group (plain data "
                        "parallelism); drop --nproc/--plan/--zero and the other layout flags")
    for flag, value in (saving or {}).items():
        if value not in (None, 0, "0"):
            raise UserError(f"train.replica_ft={g}: keeps no disk checkpoint or in-memory "
                            "snapshot while it runs (a rejoining group copies a healthy group's "
                            f"weights; the final state is saved at the end); drop {flag}={value}")
    for what, bad in (("train.dtype", cfg.train.dtype != "fp32"),
                      ("model (MoE)", cfg.model.is_moe),
                      ("data.attention_mask", cfg.data.attention_mask != "causal"),
                      ("train.export", cfg.train.export is not None),
                      ("train.tensorboard", cfg.train.tensorboard)):
        if bad:
            raise UserError(f"train.replica_ft={g}: not wired for {what} yet; replica groups "
                            "run fp32 dense causal models (drop --replica-ft or that setting)")
    if cfg.data.global_batch % g:
        raise UserError(f"train.replica_ft={g}: must divide data.global_batch="
                        f"{cfg.data.global_batch} (each group trains B/G rows)")
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise UserError(f"train.replica_ft={g}: needs torchft (pip install 'meshtron[ft]', "
                        "torchft==0.2.0)") from None
    return g


class Launcher:
    """Starts the Lighthouse, G replica-group processes and one warm spare; when a group dies
    the spare (torch already imported: seconds saved per recovery) takes its place and a new
    spare starts, `max_restarts` replacements in all."""

    def __init__(self, cfg, max_restarts: int):
        from torchft._torchft import LighthouseServer

        self.cfg = cfg
        self.groups = cfg.train.replica_ft
        self.restarts_left = max_restarts
        self.dir = group_dir(Path(cfg.train.run_dir))
        shutil.rmtree(self.dir, ignore_errors=True)  # an earlier run's (check_run_dir allowed)
        self.dir.mkdir(parents=True)
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1,
                                           join_timeout_ms=JOIN_TIMEOUT_MS,
                                           heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        self.job_path = self.dir / "job.pkl"
        self.job_path.write_bytes(pickle.dumps(ReplicaFTJob(
            cfg=cfg, lighthouse=self.lighthouse.address(), groups=self.groups)))
        self.procs: dict[int, subprocess.Popen] = {}
        self.attempts = {i: 0 for i in range(self.groups)}
        self.spare: tuple[int, subprocess.Popen] | None = None
        self.spares = 0
        self.events = (self.dir / "events.jsonl").open("a")
        self.steps = CommittedSteps(cfg, Path(cfg.train.run_dir), self.dir)
        """metrics.jsonl, written here as the groups commit steps."""

    def _event(self, **kw) -> None:
        kw["t"] = time.time()
        self.events.write(json.dumps(kw) + "\n")
        self.events.flush()

    def _popen(self, args: list[str], log_name: str) -> subprocess.Popen:
        from meshtron.launch import PARENT_ENV

        # PARENT_ENV: the group dies with this launcher (`bind_to_parent`), SIGKILL included
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error",
               PARENT_ENV: str(os.getpid())}
        log = (self.dir / log_name).open("w")
        return subprocess.Popen([sys.executable, "-m", "meshtron.train.replica",
                                 str(self.job_path), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT)

    def _write_pids(self) -> None:
        (self.dir / "pids.json").write_text(json.dumps({str(k): p.pid
                                                        for k, p in self.procs.items()}))

    def _start_spare(self) -> None:
        if self.restarts_left > 0 and self.spare is None:
            n = self.spares
            self.spares += 1
            self.spare = (n, self._popen(["spare", str(n)], f"spare{n}.log"))
            self._event(event="spare", spare=n, pid=self.spare[1].pid)

    def _replace(self, i: int) -> None:
        """Group i's replacement: the warm spare when one is alive, else a fresh process."""
        self.restarts_left -= 1
        self.attempts[i] += 1
        if self.spare is not None and self.spare[1].poll() is None:
            n, proc = self.spare
            self.spare = None
            go = self.dir / f"spare{n}.go"
            go.with_suffix(".tmp").write_text(json.dumps([i, self.attempts[i]]))
            go.with_suffix(".tmp").rename(go)  # atomic: the spare never reads half a file
        else:
            proc = self._popen([str(i), str(self.attempts[i])],
                               f"group{i}_{self.attempts[i]}.log")
        self.procs[i] = proc
        self._event(event="replace", group=i, attempt=self.attempts[i], pid=proc.pid)
        self._write_pids()
        self._start_spare()

    def run(self) -> list[GroupRecord]:
        for i in range(self.groups):
            self.procs[i] = self._popen([str(i), "0"], f"group{i}_0.log")
            self._event(event="start", group=i, attempt=0, pid=self.procs[i].pid)
        self._write_pids()
        self._start_spare()
        done: list[GroupRecord] = []
        try:
            while self.procs:
                time.sleep(0.02)
                self.steps.poll()
                for i, p in list(self.procs.items()):
                    rc = p.poll()
                    if rc is not None:
                        del self.procs[i]
                        self._exited(i, rc, done)
        finally:
            if self.spare is not None:  # unused: it only waits for a go file
                self.spare[1].kill()
                self.spare[1].wait()
            for p in self.procs.values():  # only after an error above
                p.kill()
                p.wait()
            self.lighthouse.shutdown()
            self.steps.poll()  # the groups are gone: the last steps they logged
            self.steps.close()
        return done

    def _exited(self, i: int, rc: int, done: list[GroupRecord]) -> None:
        self._event(event="exit", group=i, attempt=self.attempts[i], rc=rc)
        if rc == 0:
            done.append(GroupRecord(**json.loads(
                (self.dir / f"group{i}_{self.attempts[i]}.json").read_text())))
        elif rc != NO_PEER_EXIT and self.restarts_left > 0 and self.procs:
            self._replace(i)  # someone alive holds the live state to copy
        elif not self.procs and not done:
            raise RunFailed(f"replica-ft: every replica group died (last: group {i}, exit "
                            f"{rc}); see {self.dir}/*.log")


def wait_as_spare(job_path: Path, n: int) -> int:
    """A warm spare: import what a group needs, then wait for the launcher's go file."""
    import torch  # noqa: F401  (the expensive part of a start, done before it is needed)
    import torchft  # noqa: F401

    import meshtron.train.loop  # noqa: F401

    go = group_dir(pickle.loads(Path(job_path).read_bytes()).cfg.train.run_dir) / f"spare{n}.go"
    while not go.exists():
        time.sleep(0.01)
    group, attempt = json.loads(go.read_text())
    return run_group(job_path, group, attempt)


if __name__ == "__main__":
    from meshtron.launch import bind_to_parent

    bind_to_parent()  # a group (or spare) never outlives its launcher
    if sys.argv[2] == "spare":
        sys.exit(wait_as_spare(Path(sys.argv[1]), int(sys.argv[3])))
    sys.exit(run_group(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
