"""Discrete-event simulation of one training step of a plan, rank by rank.

What is simulated: every pipeline device runs its forwards, backwards (and zero-bubble weight
gradients) in its schedule's order (schedule.py), each taking the planner's per-micro-batch
time for its layers (planner/step_pieces.py `step_pieces`: the same compute, tensor-parallel and
recomputation model the analytical planner adds up, on the planner's layer split); activations
and their gradients cross stage boundaries as transfers that delay the receiving operation by
the planner's hop time (a sender's own wait for its send, where a runtime's schedule waits
on it, is not modelled: the planner's pipeline.p2p_time charges it). Every
data-parallel cost is the planner's, placed where it happens: FSDP2 under
torch.distributed.pipelining reduces each chunk's gradients after the chunk's last backward
with the compute stream waiting (pipeline.reduce_after_drain), so those reductions stall the
device there and the graph itself finds how much of them the drain hides; the other exposed
data-parallel time (`_dp_time`: bucketed reductions during the backward, ZeRO-1's
all-gather, the gathers kept over the step) is one synchronous event after the device's last
backward, and ZeRO-3 / FSDP per-unit collectives are added to each micro-batch's work
(synchronising the replicas at every micro-batch). Megatron's and DeepSpeed's tied-embedding
all-reduce joins the end stages before their optimizer step. So without stragglers or jitter
the simulated step is the planner's (tests/test_simulate_agrees.py) but for two pieces the
event graph does itself: the pipeline transfers (the planner charges every steady-state one on
the critical stage, the graph only where a receiver waits) and the bubble of unequal stages
(the planner's closed form, pipeline.bubble_time, is the walk's makespan for equal stages,
zero bubble's included: both take torch's order, planner/pipeline_zb.py).

How ranks are handled: a plan of tp x pp x dp ranks has dp replicas of one pipeline, each
pipeline stage being tp ranks in lockstep (their tensor-parallel collectives are inside every
operation, so an operation takes as long as its slowest tensor rank). Replicas that behave alike
are one class and are simulated once: the unperturbed job is one class whatever its size, a job
with one slow GPU two classes (the slow GPU's replica and all the others), a job with per-op
jitter one class per replica, vectorised with numpy (the tensor ranks' slowest draw is taken per
operation). Collectives couple the classes: their start is the latest member's readiness.

The event order is fixed per resource (a device's schedule; a link's transfers in the order they
become ready at nominal durations, as their issue order is), so the simulation evaluates the
event graph in one topological pass: every event's time is the latest of its inputs plus its
duration, per class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshtron.errors import UserError
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.step_pieces import StepPieces, step_pieces
from meshtron.simulate.schedule import device_of, device_orders


@dataclass(frozen=True)
class Perturbation:
    """What makes ranks differ: slow GPUs and random per-operation noise."""

    stragglers: tuple[tuple[int, float], ...] = ()
    """(global rank, slowdown factor >= 1) pairs: that GPU computes factor x slower."""
    jitter: float = 0.0
    """Standard deviation of the log-normal per-operation noise of every rank (0.05 = ~5%)."""
    seed: int = 0
    """Seed of the noise."""

    def __post_init__(self) -> None:
        for rank, factor in self.stragglers:
            if not (isinstance(rank, int) and rank >= 0):
                raise UserError(f"straggler rank={rank!r}: must be a whole number >= 0")
            if not (isinstance(factor, (int, float)) and 1.0 <= factor < 1e3):
                raise UserError(f"straggler factor={factor!r}: must be a number in [1, 1000)")
        if not (isinstance(self.jitter, (int, float)) and 0.0 <= self.jitter < 2.0):
            raise UserError(f"jitter={self.jitter!r}: must be a number in [0, 2)")


@dataclass
class StepResult:
    """One simulated step."""

    step_time_s: float
    """Wall time of the step (the slowest class)."""
    class_step_s: np.ndarray
    """Per class, when its last event ends."""
    class_counts: np.ndarray
    """Replicas per class."""
    compute_s: float
    """Critical device's compute per step at nominal speed (sum of its operations)."""
    analytical_s: float
    """The planner's step time for the same plan."""
    events: int
    """Events simulated per class."""
    classes: int
    """Rank classes simulated (replicas that behave alike share one)."""
    seconds: float
    """Wall time of the simulation."""
    notes: list[str] = field(default_factory=list)
    """How perturbed ranks were mapped."""

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "analytical_s": self.analytical_s,
                "ratio_to_analytical": self.step_time_s / self.analytical_s,
                "compute_s": self.compute_s, "classes": self.classes, "events": self.events,
                "simulation_s": self.seconds, "notes": self.notes}


class _Graph:
    """Events with fixed inputs; evaluated per class in one topological pass."""

    def __init__(self) -> None:
        self.preds: list[list[tuple[int, float]]] = []
        self.dur: list[Any] = []
        self.sync: list[bool] = []
        self.finals: list[int] = []

    def add(self, preds: list[tuple[int, float]], dur: Any, sync: bool = False) -> int:
        """An event starting after every (pred, lag) has ended (+ lag: may be negative, for a
        bucket ready part-way through an operation), lasting `dur` (scalar or per class)."""
        self.preds.append(preds)
        self.dur.append(dur)
        self.sync.append(sync)
        return len(self.dur) - 1

    def run(self, classes: int) -> list[Any]:
        if classes == 1 and not any(isinstance(d, np.ndarray) for d in self.dur):
            return self._run_scalar()
        zero = np.zeros(classes)
        end: list[np.ndarray] = []
        for preds, dur, sync in zip(self.preds, self.dur, self.sync):
            start = zero
            for i, lag in preds:
                start = np.maximum(start, end[i] + lag)
            if sync:
                start = np.full(classes, start.max())
            end.append(start + dur)
        return end

    def _run_scalar(self) -> list[Any]:
        """One class with fixed durations: the same pass on floats (much faster)."""
        end: list[float] = []
        for preds, dur in zip(self.preds, self.dur):
            start = 0.0
            for i, lag in preds:
                t = end[i] + lag
                if t > start:
                    start = t
            end.append(start + dur)
        return end


def _coords(cfg, rank: int) -> tuple[int, int]:
    """(dp replica, pp stage) of a global rank in planner/placement.py's order
    rank = (r_pp * dp + r_dp) * tp + r_tp (tensor ranks innermost, stages outermost)."""
    if rank >= cfg.tp * cfg.pp * cfg.dp:
        raise UserError(f"straggler rank={rank}: the plan has {cfg.tp * cfg.pp * cfg.dp} ranks")
    stage, rest = divmod(rank, cfg.tp * cfg.dp)
    return rest // cfg.tp, stage


def _classes(cfg, pert: Perturbation) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Replica classes: (per class per pipeline stage compute factor, replicas per class,
    notes). Without jitter the unperturbed replicas are one class and each replica holding a
    slow GPU is its own; with jitter every replica is its own class."""
    slow: dict[int, np.ndarray] = {}
    notes = []
    for rank, factor in pert.stragglers:
        d, s = _coords(cfg, rank)
        row = slow.setdefault(d, np.ones(cfg.pp))
        # the stage's tensor ranks wait for their slowest member at every tp collective
        row[s] = max(row[s], factor)
        notes.append(f"rank {rank} (replica {d}, stage {s}) x{factor:g}")
    if pert.jitter > 0:
        factors = np.ones((cfg.dp, cfg.pp))
        for d, row in slow.items():
            factors[d] = row
        return factors, np.ones(cfg.dp, dtype=np.int64), notes
    rows = [np.ones(cfg.pp)] if len(slow) < cfg.dp else []
    counts = [cfg.dp - len(slow)] if rows else []
    for d in sorted(slow):
        rows.append(slow[d])
        counts.append(1)
    return np.array(rows), np.array(counts, dtype=np.int64), notes


def simulate_step(ev: Evaluator, est: Estimate, pert: Perturbation | None = None,
                  pieces: StepPieces | None = None) -> StepResult:
    """Simulate one step of the evaluated plan `est` (from `ev`), perturbed by `pert`;
    `pieces`: its costs (default: the planner's, `step_pieces`; tests take one out)."""
    t0 = time.perf_counter()
    pert = pert or Perturbation()
    cfg = est.config
    pieces = pieces or step_pieces(ev, est)
    factors, counts, notes = _classes(cfg, pert)
    graph, compute_s = _build(cfg, est.num_microbatches, pieces, factors, pert,
                              est.stage_layers)
    end = graph.run(len(counts))
    per_class = np.max(np.vstack([np.atleast_1d(end[i]) for i in graph.finals]), axis=0)
    return StepResult(step_time_s=float(per_class.max()), class_step_s=per_class,
                      class_counts=counts, compute_s=compute_s, analytical_s=est.step_time_s,
                      events=len(end), classes=len(counts), seconds=time.perf_counter() - t0,
                      notes=notes)


def _noise(rng: np.random.Generator | None, classes: int, tp: int, sigma: float) -> Any:
    """Per class, the slowest of its tp ranks' log-normal factors (mean 1) for one operation."""
    if rng is None:
        return 1.0
    z = rng.standard_normal((classes, tp)).max(axis=1)
    return np.exp(sigma * z - 0.5 * sigma * sigma)


def _build(cfg, m: int, pc: StepPieces, factors: np.ndarray, pert: Perturbation,
           stage_layers: list[int]):
    """The event graph of one step; returns it and the nominal compute of the busiest device."""
    p, v = cfg.pp, cfg.virtual_stages
    nv = p * v
    classes = factors.shape[0]
    rng = np.random.default_rng(pert.seed) if pert.jitter > 0 else None
    zb = cfg.schedule == "zb"
    b_only = [b - w for b, w in zip(pc.bwd, pc.wgrad)] if zb else pc.bwd
    orders = device_orders(cfg.schedule, p, v, m)
    # the operation after which each chunk's gradients are complete (its last B, W under zb)
    release = "W" if zb else "B"
    last_of = {op[1]: k for order in orders for k, op in enumerate(order) if op[0] == release}
    per_unit = any(f > 0 for f in pc.fold_s)
    g = _Graph()
    done: dict[tuple[str, int, int], int] = {}
    last = [None] * p  # last event on each device
    # operations in an order where every input exists: sweep the devices, each as far as its
    # inputs allow; a transfer delays the receiver by the hop (its own link direction)
    pending = [list(o) for o in orders]
    pos = [0] * p
    progressed = True
    compute = [0.0] * p
    while progressed:
        progressed = False
        for s in range(p):
            while pos[s] < len(pending[s]):
                kind, j, mb = pending[s][pos[s]]
                preds = [] if last[s] is None else [(last[s], 0.0)]
                dep = _input(kind, j, mb, nv)
                if dep is not None:
                    if dep not in done:
                        break
                    # no transfer between two stages of one device (the V's turn)
                    hop = pc.hop_s if device_of(cfg.schedule, p, v, dep[1]) != s else 0.0
                    preds.append((done[dep], hop))
                base = {"F": pc.fwd[j], "B": b_only[j], "W": pc.wgrad[j]}[kind]
                fold = pc.fold_s[s] / (2 * v) if kind in ("F", "B") else 0.0
                compute[s] += base + fold
                # a slow or noisy GPU stretches its computation, not the network's share
                if classes > 1 or rng is not None:
                    dur = base * factors[:, s] * _noise(rng, classes, cfg.tp, pert.jitter) + fold
                else:
                    dur = base * float(factors[0, s]) + fold
                e = g.add(preds, dur, sync=per_unit and kind in ("F", "B"))
                done[(kind, j, mb)] = e
                last[s] = e
                if pc.drain_s[s] > 0 and last_of[j] == pos[s]:
                    # FSDP2 under torch pipelining: the chunk's reductions after its last
                    # backward, the compute stream waiting (pipeline.reduce_after_drain)
                    last[s] = g.add([(e, 0.0)], pc.drain_s[s] / v, sync=True)
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(pending[s]) for s in range(p)):
        raise RuntimeError("pipeline schedule deadlocked (an operation waits for one that "
                           "never runs)")
    # the rest of each device's exposed data-parallel time (a collective: synchronous)
    ends = [g.add([(last[s], 0.0)], pc.dp_s[s], sync=pc.dp_s[s] > 0) for s in range(p)]
    if pc.tied_s > 0 and p > 1:  # the end stages' tied-embedding all-reduce, then their steps
        tied = g.add([(ends[0], 0.0), (ends[-1], 0.0)], pc.tied_s)
        ends[0] = ends[-1] = tied
    g.finals = [g.add([(ends[s], 0.0)], pc.optimizer_s[s]) for s in range(p)]
    return g, max(compute)


def _input(kind: str, j: int, mb: int, nv: int):
    if kind == "F":
        return ("F", j - 1, mb) if j > 0 else None
    if kind == "B":
        return ("B", j + 1, mb) if j < nv - 1 else ("F", j, mb)
    return ("B", j, mb)
