"""Enumerate the search space, prune, rank, and explain why other families of plans lose.

Search space: tp (divides gpus_per_node, heads and kv_heads) x pp (<= layers) x dp (the rest; must
divide the global batch) x ep (mixtures of experts on a stack with expert parallelism: divisors
of the experts dividing dp/dp_replicate*cp, folded over those ranks) x micro-batch (divides the per-replica batch) x recomputation x sequence
parallelism (tp > 1) x schedule (pp > 1: 1F1B, interleaved with v = 2, 3, 4, 6, 8 virtual stages,
zero-bubble ZB-H1; GPipe only when asked for) x ZeRO stage (dp > 1). With FlashAttention,
'selective' recomputation is the same plan as 'none' and is only evaluated when fixed.

Pruning: a layout (tp, pp) whose model states cannot fit even fully sharded is evaluated once, at
its leanest setting, for the "needs X GiB" explanation; a config whose perfectly balanced compute
alone is slower than both the current k-th best plan and its family's best is skipped. The
layer-cost pieces are cached per (tp, micro-batch, sp, recompute) and the time-optimal layer
split per (pp, v, layer time), so each further config costs a few dozen float operations.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass, field
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner import memory, moe_cost, offload
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions, compiled
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.plan import (RECOMPUTE, Plan, check, microbatch_problem,
                                    offload_runtime_problem, plan_problems,
                                    schedule_zero_problem)
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.plan_rules import (compile_runtime_problem, ep_runtime_problems,
                                         schedule_problem, split_problem)

VIRTUAL_STAGES = (2, 3, 4, 6, 8)
MIN_CP_TOKENS = 8192
"""Fewest tokens of a sequence per context rank for the search to try that cp (`_Space.cps`)."""
DEFAULT_DTYPE = "bf16"
"""The run precision planned for when the knobs do not fix one: GPU pre-training runs bf16
mixed precision (bf16 compute, fp32 master weights)."""
FAMILIES = {
    "dp": "pure data parallel / ZeRO (tp=1, pp=1)",
    "tp": "tensor + data parallel (pp=1)",
    "pp": "pipeline + data parallel (tp=1)",
    "3d": "3D: tensor x pipeline x data",
}


def family_of(cfg: Plan) -> str:
    """'dp', 'tp', 'pp' or '3d' (keys of FAMILIES)."""
    return _family(cfg.tp, cfg.pp)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class Alternative:
    """Why the best plan of another family (or another knob value) loses."""

    label: str
    """Family or knob description."""
    estimate: Estimate | None
    """Its best plan (feasible), or its leanest infeasible plan, or None if the family is empty."""
    reason: str
    """One-line explanation."""

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate
        return {"family": self.label, "reason": self.reason,
                "fits": bool(est and est.fits),
                "layout": est.config.describe() if est else None,
                "step_time_s": est.step_time_s if est and est.fits else None,
                "memory_gib": est.memory.total if est else None}


@dataclass
class SearchResult:
    """Ranked plans and the explanation of the ranking."""

    model: ModelSpec
    """The model planned for."""
    cluster: ClusterSpec
    """The cluster planned for."""
    global_batch: int
    """Sequences per step."""
    seq_len: int
    """Tokens per sequence."""
    options: KernelOptions
    """Kernel assumptions of the cost model."""
    plans: list[Estimate]
    """Best feasible plans, fastest first (at most top_k)."""
    alternatives: list[Alternative] = field(default_factory=list)
    """Why other families lose."""
    near_miss: Estimate | None = None
    """When nothing fits: the plan needing the least memory, under the layer split that needs
    the least (its memory is what "needs at least X GiB" states)."""
    near_miss_priced: Estimate | None = None
    """When nothing fits: the near miss's config evaluated as the search prices every candidate
    (`exact_memory=False`: the time-balanced layer split, or the plan's own `stage_layers`), so
    its step time compares with a fitting plan's; its memory is that split's."""
    layouts: tuple[tuple[int, int, int, int, int], ...] = ()
    """The (tp, cp, pp, dp, ep) layouts the knobs leave to the search (valid ones, before host
    offload drops pipelines); exactly one: the layout is pinned (planner/pinned.py)."""
    evaluated: int = 0
    """Configs evaluated in full by the cost model."""
    enumerated: int = 0
    """Configs in the search space (evaluated, or bounded away without evaluation)."""
    feasible: int = 0
    """Configs that fit in memory."""
    seconds: float = 0.0
    """Wall time of the search."""
    notes: list[str] = field(default_factory=list)
    """Knob families left out of the search, and why."""
    dtype: str = DEFAULT_DTYPE
    """The run precision planned for."""
    framework: Any = None
    """The software stack priced (frameworks.Framework; None: meshtron's runtime)."""
    offload_best: Estimate | None = None
    """When plans fit without host offload and offload was left to the search: the fastest
    offloaded plan that could beat them (None: none could, by its bound or its full cost)."""
    offload_compared: bool = False
    """Offloaded plans were priced against the plans without offload (search_plans)."""
    pinned: bool = False
    """The knobs leave one layout (`layouts`) and nothing of it fits: the one plan is the near
    miss priced as a candidate, with fits False (planner/pinned.py `answer_pinned`)."""
    fit_change: Any = None
    """With `pinned`: the fastest plan of the same layout that fits when one of the knobs the
    user fixed is freed (or all of them), and what changed (pinned.FitChange); None: none."""

    @property
    def best(self) -> Estimate | None:
        return self.plans[0] if self.plans else None

    @property
    def fits(self) -> bool:
        """The best plan fits in memory (a pinned layout is answered even when it does not)."""
        return bool(self.plans) and self.plans[0].fits


class _Space:
    """The knob values open to the search. Fixed knobs go through the plan's own validity
    function (plan.py `check`); layouts are filtered by it too, and the reason a whole family
    of layouts is left out is kept for the output (`notes`). The one search policy of its own:
    tensor parallelism stays inside a node (its all-reduces are on the critical path)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 knobs: Knobs, opts: KernelOptions, mem: MemoryOptions | None = None,
                 runtime: bool = True, framework: Any = None) -> None:
        n = cluster.num_gpus
        gpn = cluster.gpus_per_node
        k = knobs
        self.context = {"global_batch": global_batch, "seq_len": seq_len}
        self.notes: list[str] = []
        # meshtron's runtime limits apply when pricing meshtron (the default stack)
        self.runtime = runtime
        # the priced stack's layer-to-stage rule (Megatron's equal chunks: plan_rules)
        self.split = (mem or memory.options_for(opts)).split_rule
        check({**k.to_dict(), **self.context}, n, model, runtime, self.split)
        if k.tp is not None and (k.tp > gpn or gpn % k.tp):
            raise UserError(f"tp={k.tp}: must divide gpus_per_node={gpn} "
                             "(tensor parallelism stays inside a node)")
        self.knobs = k
        self.framework = framework
        # expert parallelism: searched for mixtures of experts on the stacks that run it
        self.ep_ok = runs_ep(framework)
        if k.ep is not None and k.ep > 1 and not self.ep_ok:
            raise UserError(f"plan.ep={k.ep}: framework {framework.label} has no expert "
                             "parallelism (frameworks.py: megatron@2024, torchtitan@2025, "
                             "deepspeed@2024 and meshtron run it); use ep=1")
        if model.is_moe and not k.ep and not self.ep_ok:
            self.notes.append(f"expert parallelism left out: {framework.label} has none "
                              "(ep=1: every rank holds every expert)")
        self.dtype = k.dtype or DEFAULT_DTYPE
        self.replicate = k.dp_replicate or 1
        self.reduce_dtype = k.reduce_dtype or "fp32"
        self.accumulate = bool(k.accumulate_unsharded)
        self.offload = k.offload or "none"
        self.fp8_recipe = k.fp8_recipe or "rowwise"
        self.compile = bool(k.compile) or bool(k.async_tp)
        self.async_tp = bool(k.async_tp)
        if runtime and self.offload == "optimizer":  # refused by name, not "nothing fits"
            raise UserError(offload_runtime_problem(Plan(offload="optimizer", dp=2, zero=3)))
        self.n, self.model, self.global_batch = n, model, global_batch
        self.why_empty: str | None = None
        """Why some fixed knob left no plan to evaluate (not memory): the first reason seen."""
        self.tps = [k.tp] if k.tp else []
        if model.is_moe and not k.tp:
            # a search policy: tp > 1 of a MoE is priced when fixed (experts replicated over
            # tp in meshtron's runtime, expert-TP in Megatron-Core: planner/moe_memory.py,
            # moe_cost.py) but not offered, its replicated routed experts rarely pay
            self.tps = [1]
            self.notes.append(f"tensor-parallel layouts (tp > 1, inside a node of {gpn}) left "
                              "out for a mixture of experts: fix --layout tp=N to price one")
        elif not k.tp:
            why = ""
            for t in _divisors(gpn):
                problems = plan_problems({"tp": t}, model=model, runtime=runtime)
                if n % t == 0 and not problems:
                    self.tps.append(t)
                elif problems and not why:
                    why = problems[0]
            if self.tps == [1] and why:
                self.notes.append(f"tensor-parallel layouts (tp > 1, inside a node of {gpn}) "
                                  f"left out: {why}")
        same = selective_is_none(model, seq_len, opts, mem or memory.options_for(opts),
                                 self.dtype)
        self.recomputes = [k.recompute] if k.recompute else [
            r for r in RECOMPUTE if not (r == "selective" and same)]
        if not k.recompute and same:
            self.notes.append("recompute=selective left out: with FlashAttention and this "
                              "framework's selective policy it keeps the same tensors as none "
                              "(the attention core is never stored)")
        self._layouts = self._valid_layouts()
        if self.offload == "full" and runtime:
            # FSDP2's CPU offload does not run in a pipeline (plan.py offload_runtime_problem):
            # drop those layouts before their knobs are enumerated (`point` would refuse each)
            self._layouts = [lay for lay in self._layouts if lay[2] == 1]
        if k.zero is None and k.schedule in (None, "zb") and any(p > 1 for _, _, p, _, _ in
                                                                  self._layouts) \
                and schedule_problem(self.split, "zb", 2, 1) is None:  # its engine runs zb
            self.notes.append("schedule=zb with zero=3 left out: "
                              + schedule_zero_problem("zb", 3, 2).split(": ", 1)[1])

    def point(self, tp: int, pp: int, dp: int, zero: int, mb: int, rec: str, sp: bool,
              sched: str | None, v: int, cp: int, ep: int = 1) -> Plan | None:
        """The plan at these knobs, or None where the runtime does not run its host offload
        (plan.py `offload_runtime_problem`: ZeRO-2/3 and no pipeline for offload='full')."""
        cfg = Plan.trusted(tp, pp, dp, zero, mb, rec, sp, sched, v, self.dtype, self.replicate,
                           cp, self.reduce_dtype, self.accumulate, ep, offload=self.offload)
        if self.dtype == "fp8" and self.fp8_recipe != "rowwise":
            cfg = dataclasses.replace(cfg, fp8_recipe=self.fp8_recipe)
        if self.async_tp and not (tp > 1 and sp):
            return None  # async TP pipelines the sequence-parallel collectives (plan_rules)
        if self.compile:
            cfg = dataclasses.replace(cfg, compile=True, async_tp=self.async_tp)
            if self.runtime and self._refused(compile_runtime_problem(cfg)):
                return None  # e.g. compiled zero-bubble (plan_rules.compile_runtime_problem)
        if self.offload != "none" and self.runtime and self._refused(
                offload_runtime_problem(cfg)):
            return None
        if ep > 1 and self.runtime and self._refused(next(iter(ep_runtime_problems(
                {"ep": ep, "cp": cp, "zero": zero, "pp": pp, "recompute": rec})), None)):
            return None  # e.g. selective recomputation of gathered experts (plan_rules)
        return cfg

    def _refused(self, problem: str | None) -> bool:
        """Keep the validity function's reason for a point it refuses: when it refuses every
        point, the search answers with that reason (`_search`), not "nothing fits"."""
        if problem and self.why_empty is None:
            self.why_empty = problem
        return bool(problem)

    def cps(self, rest: int) -> list[int]:
        """Context-parallel degrees searched on `rest` = gpus / tp ranks: the fixed one, else 1
        and the powers of two that leave every rank at least MIN_CP_TOKENS tokens of each
        sequence (below that the per-layer K/V exchange cannot hide behind attention: a search
        policy, cp fixed by --layout is always evaluated)."""
        if self.knobs.cp:
            return [self.knobs.cp]
        seq = self.context["seq_len"]
        out, c = [1], 2
        while c <= rest and seq // c >= MIN_CP_TOKENS:
            if rest % c == 0 and seq % (2 * c) == 0:
                out.append(c)
            c *= 2
        return out

    def eps(self, dp: int, cp: int) -> list[int]:
        """Expert-parallel degrees searched on a layout: the fixed one, else (mixtures of
        experts on a stack with expert parallelism) 1 and every divisor of the experts that
        divides the data x context ranks it folds over (dp/dp_replicate*cp)."""
        k = self.knobs
        if k.ep:
            return [k.ep]
        if not self.model.is_moe or not self.ep_ok:
            return [1]
        shard = dp // (k.dp_replicate or 1) * cp
        return [e for e in _divisors(self.model.moe_experts) if shard % e == 0]

    def _valid_layouts(self) -> list[tuple[int, int, int, int, int]]:
        k, n = self.knobs, self.n
        fixed = {**k.to_dict(), **self.context}
        out, left_out = [], {}
        for tp in self.tps:
            for cp in self.cps(n // tp):
                if (n // tp) % cp:
                    continue
                rest = n // (tp * cp)
                for pp in ([k.pp] if k.pp else _divisors(rest)):
                    if rest % pp:
                        continue
                    dp = rest // pp
                    if k.dp and dp != k.dp:
                        continue
                    for ep in self.eps(dp, cp):
                        problems = plan_problems({**fixed, "tp": tp, "cp": cp, "pp": pp,
                                                  "dp": dp, "ep": ep},
                                                 n, self.model, self.runtime, self.split)
                        if problems:
                            left_out.setdefault(_family(tp, pp), problems[0])
                            continue
                        out.append((tp, cp, pp, dp, ep))
        found = {_family(tp, pp) for tp, _, pp, _, _ in out}
        by_reason: dict[str, list[str]] = {}
        for fam, reason in left_out.items():
            if fam not in found:
                # "plan.pp=2: model ... ties ..." -> the reason, shared by every pp value
                why = reason.split(": ", 1)[1] if reason.startswith("plan.") else reason
                by_reason.setdefault(why, []).append(FAMILIES[fam])
        for why, fams in by_reason.items():
            self.notes.append(f"{' and '.join(fams)} layouts left out: {why}")
        return out

    def layouts(self):
        return iter(self._layouts)

    def micro_batches(self, dp: int) -> list[int]:
        per_replica = self.global_batch // dp
        if self.knobs.micro_batch:
            return [self.knobs.micro_batch] if per_replica % self.knobs.micro_batch == 0 else []
        return [d for d in _divisors(per_replica) if d <= 64]

    def schedules(self, pp: int, m: int) -> list[tuple[str, int]]:
        """Schedules searched for pp stages and m micro-batches per step: 1F1B, ZB-H1 and
        interleaved (v in VIRTUAL_STAGES, at least one layer per virtual stage); GPipe and other
        virtual-stage counts only when fixed. Each must pass the schedules' own limits."""
        k = self.knobs
        if pp == 1:
            return [(None, 1)]
        layers_per_stage = self.model.layers // pp
        if k.schedule is not None:
            if k.schedule == "interleaved" and not k.virtual_stages:
                cands = [("interleaved", v) for v in VIRTUAL_STAGES if v <= layers_per_stage]
            else:
                cands = [(k.schedule, k.virtual_stages or 1)]
        else:
            vs = [k.virtual_stages] if k.virtual_stages else VIRTUAL_STAGES
            cands = [("1f1b", 1), ("zb", 1)] if not k.virtual_stages else []
            cands += [("interleaved", v) for v in vs if 2 <= v <= layers_per_stage]
        ok = []
        fixed = k.schedule is not None or k.virtual_stages is not None

        def rounds(s: str, v: int) -> str | None:
            # torch.distributed.pipelining's limits on the micro-batch count: meshtron's
            # runtime's, not another stack's (a DualPipe or Megatron schedule priced as zb)
            return microbatch_problem(s, pp, v, m) if self.runtime else None

        def split(v: int) -> str | None:
            # what the priced stack's pipeline engine builds and runs (plan_rules)
            return split_problem(self.split, self.model.layers, pp, v)

        for s, v in cands:
            engine = schedule_problem(self.split, s, pp, v, m)
            if not fixed:
                if v <= layers_per_stage and rounds(s, v) is None and split(v) is None \
                        and engine is None:
                    ok.append((s, v))
            elif engine is not None:
                self.why_empty = self.why_empty or engine
            elif split(v) is not None:
                self.why_empty = self.why_empty or split(v)
            elif v > layers_per_stage:
                self.why_empty = self.why_empty or (
                    f"plan.schedule={s!r} with {v} virtual stages: needs pp*virtual_stages="
                    f"{pp}*{v}={pp * v} <= the model's {self.model.layers} layers")
            elif rounds(s, v) is not None:
                self.why_empty = self.why_empty or rounds(s, v)
            else:
                ok.append((s, v))
        if k.schedule is not None and k.schedule == "interleaved" and not cands:
            self.why_empty = self.why_empty or (
                f"plan.schedule='interleaved': needs at least 2 layers per pipeline stage "
                f"(the model has {self.model.layers} layers over pp={pp})")
        if k.schedule is None:
            ok = [(s, v) for s, v in ok if _formulas_hold(s, pp, m)]
        return ok

    def sps(self, tp: int) -> list[bool]:
        if self.knobs.sp is not None:
            return [self.knobs.sp] if (tp > 1 or not self.knobs.sp) else []
        return [False, True] if tp > 1 else [False]

    def zeros(self, dp: int, cp: int = 1, ep: int = 1) -> list[int]:
        if self.knobs.zero is not None:
            return [self.knobs.zero]
        # ep > 1: every stage (meshtron folds ep over the data ranks of any ZeRO stage:
        # parallel/mesh.py ExpertMeshes); with cp only ZeRO-2/3, as below
        if self.offload == "full" and self.runtime:
            # FSDP2's CPU offload is of shards (ZeRO-2/3); alone, ZeRO-2 gathers once a step
            return [2, 3] if dp > 1 else [2]
        if (self.knobs.dp_replicate or 1) > 1 or (cp > 1 and self.runtime):
            # HSDP: replicas of sharded groups; meshtron runs cp on FSDP ZeRO-2/3 only
            # (plan_rules.cp_runtime_problems)
            return [2, 3]
        return [0, 1, 2, 3] if dp > 1 else [0]  # dp here: every rank sharing gradients (dp*cp)


def runs_ep(framework: Any) -> bool:
    """The stack runs expert parallelism (meshtron's runtime does: framework None)."""
    return framework is None or bool(getattr(framework, "expert_parallel", ""))


def selective_is_none(model: ModelSpec, seq_len: int, opts: KernelOptions, mem: MemoryOptions,
                      dtype: str) -> bool:
    """Selective recomputation saves nothing over none: Korthikanti's policy (recompute the
    attention core) with FlashAttention, which never stores the core. Policies that recompute
    more (meshtron's and torchtitan's: they keep matmul outputs only) save less memory and are
    searched."""
    if opts.attention != "flash":
        return False
    import dataclasses as dc

    m = dc.replace(mem, dtype=dtype)
    args = (model, 1, False, 1, seq_len)
    return (memory.activation_bytes(*args, "selective", opts, m)
            >= memory.activation_bytes(*args, "none", opts, m))


def _formulas_hold(schedule: str, pp: int, m: int) -> bool:
    """Search policy for schedules the user did not fix: pipeline.py's bubble and in-flight
    formulas assume 1F1B and ZB-H1 keep pp micro-batches in flight (m >= pp) and interleaving
    runs whole rounds of pp (m % pp == 0, as Megatron-LM requires)."""
    if schedule in ("1f1b", "zb"):
        return m >= pp
    if schedule == "interleaved":
        return m % pp == 0
    return True


def search_plans(model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 fixed: Knobs | Plan | dict[str, Any] | None = None, top_k: int = 5,
                 options: KernelOptions | None = None, explain: bool = True,
                 mem: MemoryOptions | None = None, framework: Any = None) -> SearchResult:
    """Search every plan allowed by `fixed` and return the top_k fastest that fit. `framework`
    (frameworks.Framework) prices a software stack: its kernel and memory options and its
    gradient reduction dtype (unless `fixed` has one). Without it, `options` / `mem` override
    what is costed (memory.MemoryOptions; the dtype is the plan's); default meshtron's runtime."""
    t0 = time.perf_counter()
    knobs = Knobs.of(fixed)
    if framework is not None:
        options, mem = framework.kernel, framework.memory
        if knobs.reduce_dtype is None and framework.reduce_dtype != "fp32":
            knobs = dataclasses.replace(knobs, reduce_dtype=framework.reduce_dtype)
    opts = options or KernelOptions()
    if knobs.compile or knobs.async_tp:  # what --compile runs: compute.compiled
        opts = dataclasses.replace(compiled(opts), async_tp=opts.async_tp or bool(knobs.async_tp))
    ev = Evaluator(model, cluster, global_batch, seq_len, opts, mem=mem)
    runtime = framework is None or framework.name == "meshtron"
    space = _Space(model, cluster, global_batch, seq_len, knobs, opts, ev.mem, runtime,
                   framework)
    result = _search(ev, space, top_k, explain)
    layouts = result.layouts  # the knobs' layouts, whichever search below answers
    if not result.plans and knobs.offload is None:
        result = _with_offload(ev, result, model, cluster, global_batch, seq_len, knobs, opts,
                               runtime, top_k, explain, framework)
    elif knobs.offload is None and (cluster.gpu is not None
                                    or cluster.host_link_gb_per_s is not None):
        # a device with a host link to price (a catalogue GPU or a given link); a cluster of
        # bare numbers (the nominal CPU figures `meshtron train` plans with on a CPU) has its
        # "device" memory in the host already: offload is only a last resort there
        result = _offload_if_faster(ev, result, space, knobs, runtime, top_k)
    result.seconds = time.perf_counter() - t0
    result.framework = framework
    result.layouts = layouts
    return result


def _with_offload(ev: Evaluator, result: SearchResult, model: ModelSpec, cluster: ClusterSpec,
                  global_batch: int, seq_len: int, knobs: Knobs, opts: KernelOptions,
                  runtime: bool, top_k: int, explain: bool,
                  framework: Any = None) -> SearchResult:
    """Nothing fits in device memory: search again with host offload (what meshtron runs,
    'full'; for other frameworks first DeepSpeed's 'optimizer', which moves less). Host offload
    is only chosen here: it only adds host-link traffic and a slower optimizer step
    (planner/offload.py), so a plan that fits without it is never slower with it at the same
    knobs."""
    host_bound = None
    for off in (("full",) if runtime else ("optimizer", "full")):
        k = dataclasses.replace(knobs, offload=off)
        try:
            space = _Space(model, cluster, global_batch, seq_len, k, opts, ev.mem, runtime,
                           framework)
            found = _search(ev, space, top_k, explain)
        except UserError:
            continue
        if found.plans:
            found.notes.append(f"offload={off!r}: chosen because no plan fits in device "
                               "memory without host offload")
            return found
        nm = found.near_miss
        if nm is not None and nm.memory.total <= nm.memory.capacity \
                and not nm.memory.host_fits:
            host_bound = found  # offload would fit the devices but not the hosts: say so
    return host_bound if host_bound is not None else result


def _offload_if_faster(ev: Evaluator, result: SearchResult, space: _Space, knobs: Knobs,
                       runtime: bool, top_k: int) -> SearchResult:
    """Plans fit without host offload: price the offloaded ones too, bounded by the best plan's
    step time (only an offloaded config whose lower bound beats it is evaluated, so this costs
    little where offload cannot win), and keep one if it is faster. It can be: offload frees
    the device memory of the states, which can buy a larger micro-batch, no recomputation or
    less tensor parallelism, and on a fast host link (GH200 NVLink-C2C) that can outweigh the
    copies and the host's optimizer step."""
    best = result.plans[0]
    for off in (("full",) if runtime else ("optimizer", "full")):
        k = dataclasses.replace(knobs, offload=off)
        try:
            sub = _Space(ev.model, ev.cluster, ev.global_batch, ev.seq, k, ev.opts, ev.mem,
                         runtime, space.framework)
            found = _search(ev, sub, top_k, False, cutoff=best.step_time_s)
        except UserError:  # the knobs leave no offloaded plan (e.g. a pipeline): nothing to add
            continue
        result.evaluated += found.evaluated
        result.enumerated += found.enumerated
        result.offload_compared = True
        cand = found.best
        if cand is None or cand.step_time_s >= best.step_time_s:
            continue
        if result.offload_best is None or cand.step_time_s < result.offload_best.step_time_s:
            result.offload_best = cand
    win = result.offload_best
    if win is not None:
        plans = sorted(result.plans + [win], key=lambda e: e.step_time_s)[:top_k]
        result.notes.append(
            f"offload={win.config.offload!r}: chosen because faster ({win.step_time_s:.4g} s "
            f"per step vs {best.step_time_s:.4g} s without host offload)")
        # the other families' reasons, now against the offloaded winner
        others = [Alternative(a.label, a.estimate, loss_reason(win, a.estimate))
                  if a.estimate is not None else a for a in result.alternatives]
        result.alternatives = [Alternative("best plan without host offload", best,
                                           loss_reason(win, best))] + others
        result.plans = plans
    return result


def _search(ev: Evaluator, space: _Space, top_k: int, explain: bool,
            cutoff: float = float("inf")) -> SearchResult:
    """Branch and bound over `space`; `cutoff`: a step time no plan of interest exceeds (the
    best plan of another search), below which configs are bounded away."""
    model, cluster, global_batch = ev.model, ev.cluster, ev.global_batch
    top: list[tuple[float, int, Estimate]] = []  # max-heap by -step
    fam_best: dict[str, Estimate] = {}
    fam_lean: dict[str, Estimate] = {}
    lean: Estimate | None = None
    feasible = 0
    counter = 0
    budget = ev.tensor_budget
    any_layout = False
    queue: list[tuple[float, str, Plan]] = []
    hopeless = 0
    experts = moe_cost.expert_params_per_layer(model) * model.moe_layers
    for tp, cp, pp, dp, ep in space.layouts():
        any_layout = True
        fam = _family(tp, pp)
        # Lower bound of memory: model states at the most sharded ZeRO stage allowed (routed
        # experts: E/ep of them per rank, sharded over the dp*cp/ep ranks holding them; with
        # host offload only what stays on the device).
        ex = experts if ep > 1 else 0.0

        def _states(z: int, ranks: int) -> float:
            return sum(offload.device_states(
                space.offload, memory.state_bytes(z, ranks, ev.grad_bytes, ev.mem)))

        need = min(_states(z, dp * cp) * (model.num_params() - ex)
                   + _states(z, max(1, dp * cp // ep)) * ex / ep
                   for z in space.zeros(dp * cp, cp, ep))
        if need / (tp * pp) > budget:
            # Hopeless layout: evaluate it once at its leanest knobs, for "needs X GiB".
            est = _leanest(ev, space, tp, cp, pp, dp, ep)
            hopeless += 1
            if est is not None:
                counter += 1
                fl = fam_lean.get(fam)
                if fl is None or est.memory.total < fl.memory.total:
                    fam_lean[fam] = est
                if lean is None or est.memory.total < lean.memory.total:
                    lean = est
            continue
        for mb in space.micro_batches(dp):
            m = global_batch // (dp * mb)
            for rec in space.recomputes:
                for sp in space.sps(tp):
                    for sched, v in space.schedules(pp, m):
                        for zero in space.zeros(dp * cp, cp, ep):
                            if schedule_zero_problem(sched, zero, pp):
                                continue  # the runtime refuses it (plan.py)
                            cfg = space.point(tp, pp, dp, zero, mb, rec, sp, sched, v, cp, ep)
                            if cfg is None:
                                continue
                            queue.append((ev.lower_bound_step(cfg), fam, cfg))
    # Branch and bound, best bound first: a config whose bound is slower than the k-th best
    # plan and than its family's best cannot change the answer.
    queue.sort(key=lambda x: x[0])
    inf = float("inf")
    for bound, fam, cfg in queue:
        if bound >= cutoff:
            break  # sorted by bound: nothing further can beat the other search's best
        kth = -top[0][0] if len(top) >= top_k else inf
        fb = fam_best.get(fam)
        fb_t = fb.step_time_s if fb is not None else inf
        if bound > kth and bound > fb_t:
            continue
        # infeasible configs only matter while their family has no plan
        est = ev.evaluate(cfg, keep_infeasible=fb is None and cutoff == inf,
                          exact_memory=False, cutoff=min(max(kth, fb_t), cutoff))
        counter += 1
        if est is None:
            continue
        if est.fits:
            feasible += 1
            step = est.step_time_s
            if len(top) < top_k:
                heapq.heappush(top, (-step, counter, est))
            elif step < -top[0][0]:
                heapq.heapreplace(top, (-step, counter, est))
            if step < fb_t:
                fam_best[fam] = est
        else:
            need = est.memory.total
            fl = fam_lean.get(fam)
            if fl is None or need < fl.memory.total:
                fam_lean[fam] = est
            if lean is None or need < lean.memory.total:
                lean = est
    if not any_layout:
        raise UserError(_no_layout_message(space, cluster, global_batch))
    if not queue and not hopeless and space.why_empty:
        raise UserError(space.why_empty)  # the knobs leave nothing to run: not a memory matter
    # Rank by step time; ties (e.g. ZeRO stages whose extra traffic is fully hidden) go to
    # the simpler plan: lower ZeRO stage, less recomputation, then less memory.
    rec_order = {"none": 0, "selective": 1, "half": 2, "full": 3}
    plans = sorted((e for _, _, e in top), key=lambda e: (
        round(e.step_time_s, 9), e.config.zero, rec_order[e.config.recompute], e.memory.total))
    result = SearchResult(model=model, cluster=cluster, global_batch=global_batch,
                          seq_len=ev.seq, options=ev.opts, plans=plans, evaluated=counter,
                          feasible=feasible, enumerated=len(queue) + hopeless,
                          notes=list(space.notes), dtype=space.dtype,
                          layouts=tuple(space.layouts()))
    if not plans:
        # re-evaluate the leanest plan with the memory-balanced split for an exact figure
        result.near_miss = ev.evaluate(lean.config) if lean is not None else None
        # ...and priced like the candidates: the memory-minimising split can be far slower
        result.near_miss_priced = (ev.evaluate(lean.config, exact_memory=False)
                                   if lean is not None else None)
        result.evaluated += 2 if lean is not None else 0
    elif explain:
        result.alternatives = _explain(plans[0], fam_best, fam_lean, ev, space)
    return result


def _family(tp: int, pp: int) -> str:
    if pp == 1:
        return "dp" if tp == 1 else "tp"
    return "pp" if tp == 1 else "3d"


def _leanest(ev: Evaluator, space: _Space, tp: int, cp: int, pp: int,
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
    order = {None: 0, "1f1b": 0, "zb": 1, "interleaved": 2, "gpipe": 3}
    sched, v = min(scheds, key=lambda sv: (order[sv[0]], sv[1]))
    rec = "full" if "full" in space.recomputes else space.recomputes[0]
    sps = space.sps(tp)
    if not sps:
        return None
    zeros = [z for z in space.zeros(dp * cp, cp, ep)
             if not schedule_zero_problem(sched, z, pp)]
    if not zeros:
        return None
    cfg = space.point(tp, pp, dp, max(zeros), mb, rec, max(sps), sched, v, cp, ep)
    return ev.evaluate(cfg) if cfg is not None else None


def _no_layout_message(space: _Space, cluster: ClusterSpec, global_batch: int) -> str:
    k = space.knobs
    left_out = [n for n in space.notes if " layouts left out: " in n]
    if left_out:  # the validity function refused the layouts: its reason, not the batch's
        return f"no layout of {cluster.num_gpus} GPUs runs: {'; '.join(left_out)}"
    if k.dp is None:
        return (f"global_batch={global_batch}: no tp x pp x dp layout of {cluster.num_gpus} GPUs "
                f"has a data-parallel degree dividing it (tp from {space.tps}); "
                "use a batch divisible by more powers of two")
    return f"layout {k.to_dict()}: no valid layout on {cluster.num_gpus} GPUs"


_CAUSES = {
    "compute": "more computation (recomputation or less efficient small GEMMs)",
    "tp_comm": "tensor-parallel communication",
    "pp_comm": "pipeline transfers",
    "dp_comm": "data-parallel communication exposed",
    "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "ep_comm": "expert-parallel all-to-all exposed",
}


def loss_reason(winner: Estimate, other: Estimate) -> str:
    """'12% slower, data-parallel all-gather exposed (+0.8 s)' style explanation."""
    if not other.fits:
        m = other.memory
        if m.total <= m.capacity and not m.host_fits:
            return (f"needs {m.host:.1f} GiB of host memory per node > {m.host_capacity:.4g} "
                    f"GiB usable (offload={other.config.offload}; {other.config.describe()})")
        return (f"needs {other.memory.total:.1f} GiB > {other.memory.capacity:.0f} GiB "
                f"per GPU (at its leanest: {other.config.describe()})")
    slower = other.step_time_s / winner.step_time_s - 1.0
    diffs = {k: getattr(other.time, k) - getattr(winner.time, k) for k in _CAUSES}
    cause = max(diffs, key=diffs.get)
    text = _CAUSES[cause]
    if cause == "dp_comm" and other.config.zero == 3:
        text = "ZeRO-3 weight all-gathers and gradient reduce-scatters exposed"
    elif cause == "compute" and other.config.recompute != winner.config.recompute:
        text = f"recomputation ({other.config.recompute})"
    if slower < 0.0005:
        return "as fast (tie)"
    return f"{slower * 100:.1f}% slower, {text} (+{diffs[cause]:.3g} s per step)"


def _explain(best: Estimate, fam_best: dict[str, Estimate], fam_lean: dict[str, Estimate],
             ev: Evaluator, space: _Space) -> list[Alternative]:
    out: list[Alternative] = []
    win_fam = family_of(best.config)
    for fam, label in FAMILIES.items():
        if fam == win_fam:
            continue
        est = fam_best.get(fam) or fam_lean.get(fam)
        if est is None:
            continue
        name = label
        if fam == "dp" and est.fits:
            name = f"pure ZeRO-{est.config.zero} data parallel"
        out.append(Alternative(f"{name} ({est.config.layout()})", est, loss_reason(best, est)))
    # Knob alternatives on the winner's layout: the best plan with each other value.
    c = best.config
    variants: list[tuple[str, dict[str, Any]]] = []
    for rec in RECOMPUTE:
        if rec != c.recompute and not (rec == "selective" and "selective" not in
                                       space.recomputes and not space.knobs.recompute):
            variants.append((f"recompute={rec}", {"recompute": rec}))
    if c.tp > 1:
        variants.append((f"sp={'off' if c.sp else 'on'}", {"sp": not c.sp}))
    if c.pp > 1:
        for sched in ("1f1b", "interleaved", "zb"):
            if sched != c.schedule:
                variants.append((f"schedule={sched}", {"schedule": sched}))
    for z in (0, 1, 2, 3):
        if z != c.zero and c.dp > 1:
            variants.append((f"zero={z}", {"zero": z}))
    if space.model.is_moe and not space.knobs.ep:
        for e in space.eps(c.dp, c.cp):
            if e != c.ep:
                variants.append((f"ep={e}", {"ep": e}))
    base = {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep}
    for label, change in variants:
        fixed = {**base, **{k: v for k, v in space.knobs.to_dict().items()
                            if k not in base}, **change}
        if any(space.knobs.to_dict().get(k) not in (None, v) for k, v in change.items()):
            continue  # the user fixed this knob
        try:
            sub_space = _Space(space.model, ev.cluster, ev.global_batch, ev.seq,
                               Knobs.of(fixed), ev.opts, ev.mem, space.runtime,
                               space.framework)
        except UserError:
            continue
        try:
            sub = _search(ev, sub_space, 1, False)
        except UserError:
            continue  # this knob value leaves nothing to run on the layout (e.g. too few layers)
        est = sub.best or sub.near_miss
        if est is None or (est.fits and est.step_time_s <= best.step_time_s * 1.0005):
            continue  # ties are not a reason to lose
        out.append(Alternative(f"{c.layout()} with {label}", est, loss_reason(best, est)))
    return out


def evaluate_plan(model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                  fixed: Knobs | Plan | dict[str, Any], options: KernelOptions | None = None,
                  mem: MemoryOptions | None = None, framework: Any = None) -> Estimate:
    """Evaluate one plan. Knobs left open are searched (best value), so a fully fixed plan is
    evaluated as given; the result may not fit (check `.fits` and `.memory`)."""
    result = search_plans(model, cluster, global_batch, seq_len, fixed, top_k=1,
                          options=options, explain=False, mem=mem, framework=framework)
    # not fitting: priced on the split a fitting plan gets, not the memory-minimising one
    est = result.best or result.near_miss_priced
    if est is None:
        raise UserError(f"layout {Knobs.of(fixed).to_dict()}: no valid plan on "
                         f"{cluster.num_gpus} GPUs for global_batch={global_batch}")
    return est


__all__ = ["SearchResult", "Alternative", "search_plans", "evaluate_plan", "family_of",
           "loss_reason"]
