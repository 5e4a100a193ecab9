"""Branch and bound over a search space (search_space.SearchSpace): every config is queued with
a lower bound of its step time, best bound first, and evaluated in full only while it could
still enter the top k or beat its family's best; a layout whose model states cannot fit even
fully sharded is evaluated once, at its leanest knobs, for the "needs X GiB" explanation.
"""

from __future__ import annotations

import heapq

from meshtron.errors import UserError
from meshtron.planner import memory, moe_cost, offload
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.plan import Plan, schedule_zero_problem
from meshtron.planner.search_result import SearchResult
from meshtron.planner.search_space import SearchSpace, family

Families = tuple[dict[str, Estimate], dict[str, Estimate]]
"""Per family (search_space.FAMILIES): its fastest plan that fits, its leanest that does not."""


class _Tally:
    """What the search keeps of the configs it evaluates: the top k that fit (a max-heap by
    step time), each family's fastest that fits and leanest that does not, the leanest of all."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        # (negated rank_key, order, estimate): the worst kept plan on top
        self.top: list[tuple[tuple, int, Estimate]] = []
        self.fam_best: dict[str, Estimate] = {}
        self.fam_lean: dict[str, Estimate] = {}
        self.lean: Estimate | None = None
        self.feasible = 0
        self.counter = 0  # configs evaluated in full

    def kth(self) -> float:
        """The k-th best step time so far (inf until there are k plans)."""
        return -self.top[0][0][0] if len(self.top) >= self.top_k else float("inf")

    def add_fit(self, fam: str, est: Estimate) -> None:
        # kept by the full ranking key, ties included, so that the answer does not depend on
        # the order configs are evaluated in (branch and bound's vs every config's)
        self.feasible += 1
        key = rank_key(est)
        worst = tuple(-x for x in key)
        if len(self.top) < self.top_k:
            heapq.heappush(self.top, (worst, self.counter, est))
        elif key < tuple(-x for x in self.top[0][0]):
            heapq.heapreplace(self.top, (worst, self.counter, est))
        fb = self.fam_best.get(fam)
        if fb is None or key < rank_key(fb):
            self.fam_best[fam] = est

    def add_lean(self, fam: str, est: Estimate) -> None:
        need = est.memory.total
        fl = self.fam_lean.get(fam)
        if fl is None or need < fl.memory.total:
            self.fam_lean[fam] = est
        if self.lean is None or need < self.lean.memory.total:
            self.lean = est

    def ranked(self) -> list[Estimate]:
        """The top k by `rank_key`."""
        return sorted((e for _, _, e in self.top), key=rank_key)


_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "half": 2, "full": 3}


def rank_key(est: Estimate) -> tuple[float, int, int, float]:
    """Plans by step time; ties (e.g. ZeRO stages whose extra traffic is fully hidden) go to
    the simpler plan: lower ZeRO stage, less recomputation, then less memory."""
    return (round(est.step_time_s, 9), est.config.zero, _RECOMPUTE_ORDER[est.config.recompute],
            est.memory.total)


def branch_and_bound(ev: Evaluator, space: SearchSpace, top_k: int,
                     cutoff: float = float("inf")) -> tuple[SearchResult, Families]:
    """Branch and bound over `space`; `cutoff`: a step time no plan of interest exceeds (the
    best plan of another search), below which configs are bounded away. Also returns each
    family's best and leanest plan, for the explanation (search_explain.py)."""
    tally = _Tally(top_k)
    queue, hopeless, any_layout = _enumerate(ev, space, tally)
    if not any_layout:
        raise UserError(_no_layout_message(space, ev.cluster, ev.global_batch))
    _bound(ev, queue, tally, cutoff)
    if not queue and space.why_empty and (not hopeless or tally.lean is None):
        # the knobs leave nothing to run (hopeless layouts too: their leanest point refused):
        # not a memory matter
        raise UserError(space.why_empty)
    result = SearchResult(model=ev.model, cluster=ev.cluster, global_batch=ev.global_batch,
                          seq_len=ev.seq, options=ev.opts, plans=tally.ranked(),
                          evaluated=tally.counter, feasible=tally.feasible,
                          enumerated=len(queue) + hopeless, notes=list(space.notes),
                          dtype=space.dtype, layouts=tuple(space.layouts()))
    lean = tally.lean
    if not result.plans and lean is None:  # nothing evaluated: say what refused the points
        result.refused = space.refusal_summary()
    if not result.plans and lean is not None:
        # re-evaluate the leanest plan with the memory-balanced split for an exact figure
        result.near_miss = ev.evaluate(lean.config)
        # ...and priced like the candidates: the memory-minimising split can be far slower
        result.near_miss_priced = ev.evaluate(lean.config, exact_memory=False)
        result.evaluated += 2
    return result, (tally.fam_best, tally.fam_lean)


def _enumerate(ev: Evaluator, space: SearchSpace,
               tally: _Tally) -> tuple[list[tuple[float, str, Plan]], int, bool]:
    """Every config of `space` with the lower bound of its step time, (bound, family, plan);
    a hopeless layout (its model states alone exceed the memory) is evaluated once at its
    leanest knobs instead, into `tally`. Returns (queue, hopeless layouts, any layout)."""
    model = ev.model
    queue: list[tuple[float, str, Plan]] = []
    hopeless = 0
    any_layout = False
    experts = moe_cost.expert_params_per_layer(model) * model.moe_layers
    params = model.num_params()
    for tp, cp, pp, dp, ep in space.layouts():
        any_layout = True
        fam = family(tp, pp)
        need = _states_need(ev, space, params, experts, cp, dp, ep, tp, pp)
        if need / (tp * pp) > ev.tensor_budget:
            # Hopeless layout: evaluate it once at its leanest knobs, for "needs X GiB".
            est = _leanest(ev, space, tp, cp, pp, dp, ep)
            hopeless += 1
            if est is not None:
                tally.counter += 1
                tally.add_lean(fam, est)
            continue
        # per layout, not per point: the stages and their replica counts (HSDP)
        replicas = {z: space.replicates(tp, cp, dp, z, ep)
                    for z in space.zeros(dp * cp, cp, ep, tp, pp)}
        for mb in space.micro_batches(dp):
            m = ev.global_batch // (dp * mb)
            for rec in space.recomputes:
                for sp in space.sps(tp):
                    for sched, v in space.schedules(pp, m):
                        for zero, reps in replicas.items():
                            if schedule_zero_problem(sched, zero, pp):
                                space.tally(schedule_zero_problem(sched, zero, pp))
                                continue  # the runtime refuses it (plan.py)
                            for r in reps:
                                cfg = space.point(tp, pp, dp, zero, mb, rec, sp, sched, v, cp,
                                                  ep, r)
                                if cfg is not None:
                                    queue.append((ev.lower_bound_step(cfg), fam, cfg))
    return queue, hopeless, any_layout


def _states_need(ev: Evaluator, space: SearchSpace, params: float, experts: float, cp: int,
                 dp: int, ep: int, tp: int = 1, pp: int = 1) -> float:
    """Lower bound of memory: model states at the most sharded ZeRO stage allowed (routed
    experts: E/ep of them per rank, sharded over the dp*cp/ep ranks holding them; with host
    offload only what stays on the device), before dividing over tp x pp."""
    ex = experts if ep > 1 else 0.0
    etp = space.knobs.etp
    # Megatron-Core's folding with etp > tp: a rank holds E/(ep*etp) of the experts, fewer than
    # the E/(ep*tp) counted below (a bound must not exceed it)
    fold = tp / etp if ex and etp is not None and etp > tp else 1.0

    def states(z: int, ranks: int) -> float:
        return sum(offload.device_states(
            space.offload, memory.state_bytes(z, ranks, ev.grad_bytes, ev.mem),
            ev.mem.host_offload))

    # no stage the stack runs on this layout: nothing to evaluate (inf: hopeless)
    return min((states(z, dp * cp) * (params - ex) + states(z, max(1, dp * cp // ep)) * ex / ep * fold
                for z in space.zeros(dp * cp, cp, ep, tp, pp)), default=float("inf"))


def _bound(ev: Evaluator, queue: list[tuple[float, str, Plan]], tally: _Tally,
           cutoff: float) -> None:
    """Evaluate the queue best bound first: a config whose bound is slower than the k-th best
    plan and than its family's best cannot change the answer."""
    queue.sort(key=lambda x: x[0])  # stable: an HSDP point after its one-replica twin
    inf = float("inf")
    floors: dict[tuple, float] = {}
    for bound, fam, cfg in queue:
        if bound >= cutoff:
            break  # sorted by bound: nothing further can beat the other search's best
        kth = tally.kth()
        fb = tally.fam_best.get(fam)
        fb_t = fb.step_time_s if fb is not None else inf
        if cfg.dp_replicate > 1:
            floor = floors.get(_twin(cfg), 0.0)
            if floor == inf:
                continue  # Evaluator.replica_floor: it cannot fit
            bound = max(bound, floor)
        if bound > kth and bound > fb_t:
            continue
        # infeasible configs only matter while their family has no plan
        est = ev.evaluate(cfg, keep_infeasible=fb is None and cutoff == inf,
                          exact_memory=False, cutoff=min(max(kth, fb_t), cutoff))
        tally.counter += 1
        if est is None:
            continue
        if cfg.dp_replicate == 1 and cfg.zero >= 2:
            floors[_twin(cfg)] = ev.replica_floor(est)
        if est.fits:
            tally.add_fit(fam, est)
        else:
            tally.add_lean(fam, est)


def _twin(cfg: Plan) -> tuple:
    """The knobs a plan shares with its HSDP variants (all but dp_replicate)."""
    return (cfg.tp, cfg.pp, cfg.dp, cfg.zero, cfg.micro_batch, cfg.recompute, cfg.sp,
            cfg.schedule, cfg.virtual_stages, cfg.cp, cfg.ep)


def _leanest(ev: Evaluator, space: SearchSpace, tp: int, cp: int, pp: int,
             dp: int, ep: int = 1) -> Estimate | None:
    """The layout at the knob values that minimise memory (most ZeRO, smallest micro-batch,
    most recomputation, sequence parallelism, 1F1B-class schedule)."""
    mbs = space.micro_batches(dp)
    if not mbs:
        return None
    mb = mbs[0]
    m = space.global_batch // (dp * mb)
    scheds = space.schedules(pp, m)
    if not scheds:
        return None
    order = {None: 0, "1f1b": 0, "zb": 1, "dualpipe": 1, "interleaved": 2, "gpipe": 3}
    sched, v = min(scheds, key=lambda sv: (order[sv[0]], sv[1]))
    rec = "full" if "full" in space.recomputes else space.recomputes[0]
    sps = space.sps(tp)
    if not sps:
        return None
    zeros = [z for z in space.zeros(dp * cp, cp, ep, tp, pp)
             if not schedule_zero_problem(sched, z, pp)]
    if not zeros:
        return None
    cfg = space.point(tp, pp, dp, max(zeros), mb, rec, max(sps), sched, v, cp, ep)
    return ev.evaluate(cfg) if cfg is not None else None


def _no_layout_message(space: SearchSpace, cluster: ClusterSpec, global_batch: int) -> str:
    k = space.knobs
    devices = device_count(cluster)
    left_out = [n for n in space.notes if " layouts left out: " in n]
    if left_out:  # the validity function refused the layouts: its reason, not the batch's
        return f"no layout of {devices} runs: {'; '.join(left_out)}"
    if k.dp is None:
        return (f"global_batch={global_batch}: no tp x pp x dp layout of {devices} "
                f"has a data-parallel degree dividing it (tp from {space.tps}); "
                "use a batch divisible by more powers of two")
    return f"layout {k.to_dict()}: no valid layout on {devices}"


def device_count(cluster: ClusterSpec) -> str:
    """'16 GPUs' for a cluster of catalogue GPUs; '3 devices' for one described by numbers
    only (a CPU run's ranks: nominal-cpu, a calibrated machine; a TOML cluster)."""
    word = "GPU" if cluster.gpu is not None else "device"
    return f"{cluster.num_gpus} {word}{'s' if cluster.num_gpus != 1 else ''}"


__all__ = ["Families", "branch_and_bound"]
