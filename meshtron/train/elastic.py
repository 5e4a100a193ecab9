"""Elastic world sizes: train on whatever nodes are left, re-planned for them.

`meshtron train --nnodes MIN:MAX --nproc N --rdzv-endpoint HOST:PORT --rdzv-id ID ...` runs on
every node (one invocation per node; on one machine, several invocations simulate nodes). Each
starts torchrun's elastic agent for its node (`launch_node`: torchrun's own c10d rendezvous, no
launcher or rendezvous of meshtron's), which forms a world of MIN..MAX nodes of N ranks. When a
node is lost (its ranks' peers see their collectives fail, their agent restarts them) or one
joins (every agent stops its ranks for a new rendezvous round), a new round starts with another
world size; each round's ranks then:

1. `begin_round`: rank 0 tells a new job from a later round of the same job by the marker file
   RUN_DIR/elastic.json (the rendezvous run id): a new job obeys the usual run-folder rules
   (--overwrite, --resume); a later round continues from the newest complete checkpoint.
2. plan for the world they have (`agreed_plan`, the planner's best plan for this many ranks,
   with the axes the user fixed in `--plan` kept: `--plan tp=2` is a plan family), and
   `announce_replan`: the old layout (the checkpoint's), the new one, why, and both predicted
   throughputs, as an `{"event": "replan"}` record in metrics.jsonl and one log line.
3. load the checkpoint, resharded by torch.distributed.checkpoint to the new layout, and
   continue at its data position: the sampler's position is a global sample counter and the
   global batch is fixed, so step s reads stream entries [(s-1)B, sB) whatever the layout (no
   sample skipped or seen twice). Every metrics record of an elastic run carries
   `samples_from` and `samples_sha` (the sampler's `last_step_fields`), the proof that can be compared with an
   uninterrupted run.

Joining a round: torchrun's agents share one TCP store across rounds by default, and each agent
numbers its restarts itself (a node that joins later starts at 0), so the namespacing by restart
count that `--max-restarts` uses (meshtron/checkpoint/restart.py) could not agree across nodes.
The agents are therefore started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torchrun's opt-out):
every round's rank 0 hosts a fresh store on a port the rendezvous hands out, so no round sees
another's keys.

Scaling up: the agents stop their ranks with SIGTERM, which meshtron's preemption path turns into
a checkpoint of the current step (meshtron/checkpoint/preempt.py), so a node added back costs no
step. A lost node costs the steps since the last periodic checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.errors import UserError

ROUND_FILE = "elastic.json"
"""RUN_DIR/elastic.json: the rendezvous run id of the elastic job that owns the folder."""
DEFAULT_ENDPOINT = "localhost:29400"
MAX_CHECKED_NODE_COUNTS = 8
"""Node counts whose world the launcher plans for before starting (all of them when the range
is at most this wide, else the two ends)."""


@dataclass(frozen=True)
class ElasticConfig:
    """An elastic job: its node range and rendezvous (the launcher), or the marker that this
    process is a rank of one."""

    min_nodes: int
    """Fewest nodes the job trains on (torchrun --nnodes MIN:MAX)."""
    max_nodes: int
    """Most nodes the job trains on."""
    nproc_per_node: int = 1
    """Ranks per node (--nproc)."""
    endpoint: str = DEFAULT_ENDPOINT
    """HOST:PORT of torchrun's c10d rendezvous store (one agent hosts it, or an outside
    store)."""
    run_id: str = "meshtron"
    """Rendezvous id shared by every node of the job (a later start with the same id and run
    folder continues the job)."""
    rdzv_conf: str = ""
    """torchrun --rdzv-conf (e.g. last_call_timeout=5,is_host=0), passed through."""
    rank: bool = False
    """This process is a rank of the job (started by an agent), not a node's launcher."""

    def __post_init__(self) -> None:
        if not (1 <= self.min_nodes <= self.max_nodes):
            raise UserError(f"--nnodes={self.node_range}: allowed MIN:MAX with 1 <= MIN <= MAX")

    @property
    def node_range(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}"

    def torchrun_args(self) -> list[str]:
        """The rendezvous arguments of the node's torchrun (instead of --standalone)."""
        args = ["--nnodes", self.node_range, "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id]
        return args + (["--rdzv-conf", self.rdzv_conf] if self.rdzv_conf else [])

    def world_sizes(self) -> list[int]:
        """The world sizes the launcher checks the plan family on."""
        counts = list(range(self.min_nodes, self.max_nodes + 1))
        if len(counts) > MAX_CHECKED_NODE_COUNTS:
            counts = [self.min_nodes, self.max_nodes]
        return [n * self.nproc_per_node for n in counts]


def parse_nnodes(text: str) -> tuple[int, int]:
    """'MIN:MAX' or 'N' -> (MIN, MAX)."""
    parts = str(text).split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values or [0]) < 1 or values[0] > values[-1]:
        raise UserError(f"--nnodes={text!r}: allowed MIN:MAX (or N) with 1 <= MIN <= MAX")
    return values[0], values[-1]


def add_arguments(p) -> None:
    """The elastic flags of `meshtron train` (argparse)."""
    g = p.add_argument_group("elastic world sizes (meshtron.train.elastic)")
    g.add_argument("--nnodes", metavar="MIN:MAX",
                   help="run on MIN..MAX nodes of --nproc ranks (torchrun's elastic c10d "
                        "rendezvous; run the same command on every node); the job re-plans "
                        "and continues from its newest checkpoint when nodes leave or join")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous store (default $MASTER_ADDR:$MASTER_PORT, else "
                        f"{DEFAULT_ENDPOINT})")
    g.add_argument("--rdzv-id", metavar="ID",
                   help="job id shared by the nodes (default $SLURM_JOB_ID, else 'meshtron')")
    g.add_argument("--rdzv-conf", metavar="K=V,...", default="",
                   help="torchrun --rdzv-conf, e.g. last_call_timeout=5,join_timeout=600")
    g.add_argument("--elastic-rank", metavar="MIN:MAX", help=argparse.SUPPRESS)


def from_args(args, nproc: int | None) -> ElasticConfig | None:
    """The job's elastic settings from the command line; None when not elastic."""
    rank_range = getattr(args, "elastic_rank", None)
    if rank_range:
        lo, hi = parse_nnodes(rank_range)
        return ElasticConfig(lo, hi, rank=True)
    text = getattr(args, "nnodes", None)
    if text is None:
        for flag in ("rdzv_endpoint", "rdzv_id", "rdzv_conf"):
            if getattr(args, flag, None):
                raise UserError(f"--{flag.replace('_', '-')}: needs --nnodes MIN:MAX")
        return None
    lo, hi = parse_nnodes(text)
    env = os.environ
    endpoint = args.rdzv_endpoint or (f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29400')}"
                                      if "MASTER_ADDR" in env else DEFAULT_ENDPOINT)
    run_id = args.rdzv_id or env.get("SLURM_JOB_ID") or "meshtron"
    return ElasticConfig(lo, hi, nproc or 1, endpoint, run_id, args.rdzv_conf or "")


# ---- the node's launcher -----------------------------------------------------------------------

def check_job(job) -> None:
    """What an elastic job needs, checked before its agent starts (one line each)."""
    ckpt = job.checkpoint
    if ckpt.every == 0:
        raise UserError("--checkpoint-every=0: an elastic run (--nnodes) continues from its "
                        "newest checkpoint after a node is lost; allowed: N >= 1 or auto")
    request = job.parallel
    if request is not None and request.comm:
        name = sorted(request.comm)[0]
        raise UserError(f"--{name.replace('_', '-')}: not supported with --nnodes yet "
                        "(gradient compression and DiLoCo keep per-rank state)")
    from meshtron.train.planning import is_plan_file

    if request is not None and is_plan_file(request.plan):
        raise UserError(f"--plan={request.plan}: a saved plan has a fixed world size; with "
                        "--nnodes give 'auto' or a plan family such as tp=2")


def check_family(job, elastic: ElasticConfig):
    """The plan of every world size the job may have (UserError naming the world that has
    none); returns the plan of the smallest world."""
    from meshtron.train.job import ParallelRequest
    from meshtron.train.planning import resolve_run_plan

    request = job.parallel or ParallelRequest()
    first = None
    for world in elastic.world_sizes():
        try:
            plan, _ = resolve_run_plan(job.cfg, request, world)
        except UserError as exc:
            raise UserError(f"--nnodes={elastic.node_range}: at {world // elastic.nproc_per_node}"
                            f" node(s) ({world} ranks): {exc}") from None
        first = first or plan
    return first


def rank_argv(job, run_file: Path, elastic: ElasticConfig) -> list[str]:
    """The command line of every rank of every round: the resolved run file, the plan family
    and the fixed knobs (each round plans again for its world)."""
    request = job.parallel
    argv = ["train", "--config", str(run_file), "--elastic-rank", elastic.node_range]
    if request is not None:
        argv += ["--plan", request.plan]
        knobs = request.knobs
        if "zero" in knobs:
            argv += ["--zero", str(knobs["zero"])]
        if "recompute" in knobs:
            argv += ["--recompute", knobs["recompute"]]
        if "sp" in knobs:
            argv += ["--sp", "on" if knobs["sp"] else "off"]
        if "schedule" in knobs:
            v = knobs.get("virtual_stages")
            argv += ["--schedule", f"{knobs['schedule']}:{v}" if v else knobs["schedule"]]
        if request.cluster:
            argv += ["--cluster", request.cluster]
    if job.overwrite:
        argv.append("--overwrite")
    if job.watchdog_timeout_s:
        argv += ["--watchdog-timeout", repr(job.watchdog_timeout_s)]
    if not job.recorder:
        argv.append("--no-recorder")
    return argv + job.checkpoint.rank_argv()


def launch_node(job) -> int:
    """This node's part of an elastic job: check, then run torchrun's agent for the node until
    the job ends; returns its exit code."""
    from meshtron.launch import check_nproc, current_world, launch_local
    from meshtron.train.job import warn, write_run_file
    from meshtron.checkpoint import EXIT_PREEMPTED, EXIT_STORAGE
    from meshtron.train.run_data import build_run_data

    elastic = job.elastic
    if current_world().source == "torchrun":
        raise UserError("--nnodes: this process is already a rank of a torchrun world; run "
                        "`meshtron train --nnodes` on each node instead of inside torchrun")
    check_nproc(elastic.nproc_per_node)
    check_job(job)
    plan = check_family(job, elastic)
    build_run_data(job.cfg, dp_rank=0, dp_size=plan.dp)  # a bad data path: one line, here
    warn(job)
    folder = Path(tempfile.mkdtemp(prefix="meshtron-elastic-"))
    try:
        run_file = folder / "run.toml"
        write_run_file(job, run_file)
        print(f"meshtron train: elastic node: {elastic.node_range} nodes of "
              f"{elastic.nproc_per_node} rank(s), rendezvous {elastic.endpoint} id "
              f"{elastic.run_id}", file=sys.stderr, flush=True)
        code = launch_local(elastic.nproc_per_node, rank_argv(job, run_file, elastic),
                            max_restarts=job.checkpoint.max_restarts,
                            grace_s=job.checkpoint.preempt_grace_s,
                            rendezvous=elastic.torchrun_args(),
                            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if code == EXIT_PREEMPTED:  # torchrun returns it only when every failed rank checkpointed
        print(f"meshtron train: this node's ranks were preempted after their checkpoint (exit "
              f"code {code}); continue with --resume", file=sys.stderr)
    elif code != 0:
        print(f"meshtron train: this node's ranks failed (exit code {code}); their output is "
              "above", file=sys.stderr)
    # what the line says (meshtron/train/launch.py `failed_line`: 2, 74, 75, 128 + N kept)
    return code if code in (0, 2, EXIT_STORAGE, EXIT_PREEMPTED) or code > 128 else 1


# ---- a rank, at the start of every round -------------------------------------------------------

def begin_round(job, world):
    """Collective (every rank, after the process group exists): rank 0 decides whether this
    round starts the job or continues it; returns the job as this round runs it (a continuing
    round resumes from the newest complete checkpoint, if there is one)."""
    import torch.distributed as dist

    payload: list[Any] = [None]
    if world.rank == 0:
        try:
            continuing = _claim_run_dir(job)
            _set_aside_earlier_round(job, continuing)
            payload[0] = {"continuing": continuing}
        except UserError as exc:
            payload[0] = {"error": str(exc)}
    if world.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise UserError(payload[0]["error"])
    ckpt = dataclasses.replace(job.checkpoint, resume_if_any=True)
    # The folder is this job's from here on: rank 0's later checks must not refuse it.
    return dataclasses.replace(job, checkpoint=ckpt, overwrite=True)


def _set_aside_earlier_round(job, continuing: bool) -> None:
    """Rank 0, before any rank of this round writes into RUN_DIR/trace (an elastic rank starts
    its doctor after `begin_round`; the others wait in its broadcast): a later round keeps the
    rounds before it in RUN_DIR/earlier/N as a --resume keeps an earlier launch (`meshtron
    doctor RUN_DIR --earlier N`: the lost node's ranks); a new job follows the run's own rule
    (--resume keeps, a fresh run clears). Every round's ranks write RUN_DIR/trace (no attempt
    folders: each agent counts its restarts itself), so before this a job that went on with
    fewer ranks and finished kept the lost rank's hello file, and `meshtron doctor` called that
    rank frozen; a stale ABORT.json would have stopped the next round at once."""
    from meshtron.train import earlier

    earlier.keep_or_clear(job.cfg.train.run_dir, continuing or bool(job.checkpoint.resume))


def _claim_run_dir(job) -> bool:
    """Rank 0: True when the folder belongs to this elastic job (a later round); else apply the
    run-folder rules of a new run and claim the folder."""
    from meshtron.checkpoint.resume import prepare_start
    from meshtron.train import outputs
    from meshtron.train.job import write_run_records

    cfg = job.cfg
    run_dir = Path(cfg.train.run_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    marker = run_dir / ROUND_FILE
    try:
        if json.loads(marker.read_text()).get("run_id") == run_id:
            return True
    except (OSError, ValueError, AttributeError):
        pass
    outputs.check_run_dir(cfg, job.overwrite or job.checkpoint.resume)
    prepare_start(job.checkpoint, cfg, job.overwrite)
    if not job.checkpoint.resume:
        outputs.prepare_run_dir(cfg, True)  # an earlier run's outputs go (--overwrite)
    # run.toml as every launch path writes it (what --resume, export and doctor read; an
    # --overwrite-n run's would describe another model); the plan changes with each round's
    # world: rank 0 saves the last one at the end (rank.py), an earlier run's goes now
    write_run_records(job, None)
    marker.write_text(json.dumps({"run_id": run_id, "time": time.time()}))
    return False


def announce_replan(job, world, plan) -> dict[str, Any] | None:
    """Rank 0: when the newest checkpoint was saved by another world size or layout, the
    `replan` record (metrics.jsonl) and its log line; returns the record (None: nothing
    changed, or nothing to resume)."""
    if world.rank != 0:
        return None
    from meshtron.checkpoint import history, store

    found = store.find_latest(store.checkpoint_root(job.cfg.train.run_dir), deep=False)
    if found.path is None:
        return None
    meta = store.read_meta(found.path)
    request = job.parallel
    record = replan_record(meta.get("plan"), int(meta["world_size"]), plan, world.world_size,
                           nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                           node_range=job.elastic.node_range, step=int(meta["step"]),
                           family=request.plan if request is not None else "auto")
    if record is None:
        return None
    history.append(Path(job.cfg.train.run_dir) / "metrics.jsonl", record)
    print(f"meshtron train: replan: {record['why']}; {record['old']['layout']} -> "
          f"{record['new']['layout']}, predicted {_rate(record['old'])} -> "
          f"{_rate(record['new'])} tokens/s; continuing after step {record['resumed_from_step']}",
          file=sys.stderr, flush=True)
    return record


def _rate(side: dict[str, Any]) -> str:
    value = side.get("predicted_tokens_per_s")
    return "?" if value is None else f"{value:,.0f}"


def _side(plan, world: int) -> dict[str, Any]:
    step_s = (plan.predicted or {}).get("step_time_s")
    tokens = plan.global_batch * plan.seq_len
    return {"world_size": world, "layout": plan.describe(), "plan": plan.to_dict(),
            "predicted_step_time_s": step_s,
            "predicted_tokens_per_s": tokens / step_s if step_s else None}


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def replan_record(old_plan: dict[str, Any] | None, old_world: int, new_plan, new_world: int,
                  nodes: int, node_range: str, step: int, family: str) -> dict[str, Any] | None:
    """The decision as a metrics.jsonl event: None when the checkpoint's world size and layout
    are this round's (nothing was re-planned)."""
    from meshtron.planner.plan import Plan

    old = Plan.from_dict(old_plan) if old_plan else None
    if old is not None and old_world == new_world and old.describe() == new_plan.describe():
        return None
    reasons = []
    if old_world != new_world:
        change = "lost" if new_world < old_world else "added"
        reasons.append(f"world {old_world} -> {_ranks(new_world)} ({change} ranks: {nodes} "
                       f"node(s) in the rendezvous, range {node_range})")
        if old is not None:
            reasons.append(f"the checkpoint's layout {old.layout()} needs {old.gpus} ranks")
    choice = ("the planner's best plan" if family == "auto"
              else f"the planner's best plan of the family {family}")
    reasons.append(f"{choice} for {_ranks(new_world)}")
    old_side = _side(old, old_world) if old is not None else {
        "world_size": old_world, "layout": "one process", "plan": None,
        "predicted_step_time_s": None, "predicted_tokens_per_s": None}
    return {"event": "replan", "resumed_from_step": step, "nodes": nodes,
            "node_range": node_range, "old": old_side, "new": _side(new_plan, new_world),
            "why": "; ".join(reasons), "time": time.time()}
