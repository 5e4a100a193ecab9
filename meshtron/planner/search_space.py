"""The knob values open to the planner's search (planner/search.py), checked by the plan's own
validity function: layouts (tp, cp, pp, dp, ep), micro-batches, recomputation, sequence
parallelism, schedules and ZeRO stages, with the reason a whole family of them is left out.
The fixed knobs' checks and the layer split's fallback are in planner/search_fixed.py
(`PinnedKnobs`, `SplitFallback`), the schedules tried in planner/search_schedules.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner import memory
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.plan import (RECOMPUTE, Plan, check, fp8_runtime_problem,
                                    offload_runtime_problem, plan_problems, runs_problem,
                                    schedule_zero_problem)
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.plan_rules_options import option_values
from meshtron.planner.plan_rules import (compile_runtime_problem, ep_fold_problem,
                                         ep_runtime_problems, least_zero, most_zero,
                                         schedule_problem, zero_limit)
from meshtron.planner.plan_rules_stack import layout_problem, most_chunk_layers
from meshtron.planner.search_batch import batch_advice, is_batch_reason
from meshtron.planner.search_fixed import PinnedKnobs, SplitFallback, runs_ep
from meshtron.planner.search_schedules import VIRTUAL_STAGES, searched_schedules

_LAYOUT_FIELD = re.compile(r"plan\.(tp|cp|pp|dp|ep)=\d+: ")
"""A validity reason whose subject is a degree the layout family varies (its value differs
from one layout of the family to the next)."""
MIN_CP_TOKENS = 8192
"""Fewest tokens of a sequence per context rank for the search to try that cp
(`SearchSpace.cps`)."""
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
    return family(cfg.tp, cfg.pp)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def family(tp: int, pp: int) -> str:
    if pp == 1:
        return "dp" if tp == 1 else "tp"
    return "pp" if tp == 1 else "3d"


class SearchSpace(PinnedKnobs):
    """The knob values open to the search. Fixed knobs go through the plan's own validity
    function (plan.py `check`); layouts are filtered by it too, and the reason a whole family
    of layouts is left out is kept for the output (`notes`). The one search policy of its own:
    tensor parallelism stays inside a node (its all-reduces are on the critical path)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 knobs: Knobs, opts: KernelOptions, mem: MemoryOptions | None = None,
                 runtime: bool = True, framework: Any = None,
                 traffic: dict[str, Any] | None = None) -> None:
        k = knobs
        # the data-parallel traffic knobs priced (Evaluator.traffic_knobs): a layout they
        # cannot act on (dp=1 under gradient compression) is left out with their reason
        self.traffic = dict(traffic or {})
        self.context = {"global_batch": global_batch, "seq_len": seq_len}
        self.notes: list[str] = []
        # meshtron's runtime limits apply when pricing meshtron (the default stack)
        self.runtime = runtime
        # the priced stack's layer-to-stage rule (Megatron's equal chunks: plan_rules) and its
        # pipeline engine (the schedules it runs); a pinned layout the rule cannot split is
        # priced on the nearest rule the engine could be configured to (`_settle_split`)
        self.mem = mem or memory.options_for(opts)
        # every stack option priced, checked against meshtron's runtime (plan_rules_options)
        self.option_values = option_values(opts, self.mem, k.reduce_dtype or "fp32")
        self.split, self.engine = self.mem.split_rule, self.mem.engine
        self.split_fallback: SplitFallback | None = None
        self._refusal: str | None = None
        self.knobs = k
        self.framework = framework
        # 'name@era' of the priced stack (None: not named), for rules its trainer decides
        self.stack = (f"{framework.name}@{framework.era}"
                      if getattr(framework, "name", None) and getattr(framework, "era", None)
                      else None)
        self.n, self.model, self.global_batch = cluster.num_gpus, model, global_batch
        self.gpus_per_node = cluster.gpus_per_node
        self._check_fixed(cluster.gpus_per_node)
        self.dtype = k.dtype or DEFAULT_DTYPE
        self.replicate = k.dp_replicate or 1
        self.reduce_dtype = k.reduce_dtype or "fp32"
        self.accumulate = bool(k.accumulate_unsharded)
        self.offload = k.offload or "none"
        self.fp8_recipe = k.fp8_recipe or "rowwise"
        # meshtron's compiled stack is its --compile: the plan says compile=true, so the
        # runtime compiles what was priced compiled and refuses what it cannot compile
        # (plan_rules_options.RUNTIME_OPTIONS 'stack', parallel/compile.py)
        self.compile = bool(k.compile) or bool(k.async_tp) or (
            runtime and opts.stack == "compiled")
        self.async_tp = bool(k.async_tp)
        if runtime and self.offload == "optimizer":  # refused by name, not "nothing fits"
            raise UserError(offload_runtime_problem(Plan(offload="optimizer", dp=2, zero=3)))
        self.why_empty: str | None = None
        """Why some fixed knob left no plan to evaluate (not memory): the first reason seen."""
        self.refusals: Counter[str] = Counter()
        """How often each reason (its numbers as N) refused a schedule or knob point of a valid
        layout; `refusal_examples` holds the first full message of each (`refusal_summary`)."""
        self.refusal_examples: dict[str, str] = {}
        self.tps = self._tensor_degrees(cluster.gpus_per_node)
        self.recomputes = self._recompute_values(seq_len, opts, mem or memory.options_for(opts))
        notes = list(self.notes)
        self._layouts = self._valid_layouts()
        self._settle_split(notes)
        if self.offload == "full" and runtime:
            # FSDP2's CPU offload does not run in a pipeline (plan.py offload_runtime_problem):
            # drop those layouts before their knobs are enumerated (`point` would refuse each)
            self._layouts = [lay for lay in self._layouts if lay[2] == 1]
        if k.zero is None and k.schedule in (None, "zb") and any(
                p > 1 and 3 in self.zeros(d * c, c, e, t, p) for t, c, p, d, e in self._layouts) \
                and schedule_problem(self.engine, "zb", 2, 1) is None:  # its engine runs zb
            self.notes.append("schedule=zb with zero=3 left out: "
                              + schedule_zero_problem("zb", 3, 2).split(": ", 1)[1])

    def _tensor_degrees(self, gpn: int) -> list[int]:
        """Tensor-parallel degrees searched: the fixed one, else the divisors of a node's GPUs
        the validity function accepts (a mixture of experts: 1, a search policy)."""
        k, model = self.knobs, self.model
        if k.tp:
            return [k.tp]
        if model.is_moe:
            # a search policy: tp > 1 of a MoE is priced when fixed (experts replicated over
            # tp in meshtron's runtime, expert-TP in Megatron-Core: planner/moe_memory.py,
            # moe_cost.py) but not offered, its replicated routed experts rarely pay
            self.notes.append(f"tensor-parallel layouts (tp > 1, inside a node of {gpn}) left "
                              "out for a mixture of experts: fix --layout tp=N to price one")
            return [1]
        tps, why = [], ""
        for t in divisors(gpn):
            problems = plan_problems({"tp": t}, model=model, runtime=self.runtime)
            if self.n % t == 0 and not problems:
                tps.append(t)
            elif problems and not why:
                why = problems[0]
        if tps == [1] and why:
            self.notes.append(f"tensor-parallel layouts (tp > 1, inside a node of {gpn}) "
                              f"left out: {why}")
        return tps

    def _recompute_values(self, seq_len: int, opts: KernelOptions,
                          mem: MemoryOptions) -> list[str]:
        """Recomputation searched: the fixed one, else all but a 'selective' that keeps what
        'none' keeps (`selective_is_none`)."""
        k = self.knobs
        same = selective_is_none(self.model, seq_len, opts, mem, self.dtype)
        if not k.recompute and same:
            self.notes.append("recompute=selective left out: with FlashAttention and this "
                              "framework's selective policy it keeps the same tensors as none "
                              "(the attention core is never stored)")
        # the modes the stack's code has (plan_rules_stack: e.g. no selective before 2022)
        return [k.recompute] if k.recompute else [
            r for r in RECOMPUTE if not (r == "selective" and same)
            and layout_problem(mem.layouts, recompute=r) is None]

    def point(self, tp: int, pp: int, dp: int, zero: int, mb: int, rec: str, sp: bool,
              sched: str | None, v: int, cp: int, ep: int = 1,
              replicate: int | None = None) -> Plan | None:
        """The plan at these knobs, or None where the runtime does not run its host offload
        (plan.py `offload_runtime_problem`: ZeRO-2/3 and no pipeline for offload='full')."""
        if rec == "half" and self._refused(layout_problem(
                self.mem.layouts, recompute=rec, stack=self.stack, chunk_layers=most_chunk_layers(
                    self.model.layers, pp, v))):
            return None  # the stack's partial recomputation counts per chunk (plan_rules_stack)
        rep = self.replicate if replicate is None else replicate
        cfg = Plan.trusted(tp, pp, dp, zero, mb, rec, sp, sched, v, self.dtype, rep, cp,
                           self.reduce_dtype, self.accumulate, ep, offload=self.offload)
        if self.dtype == "fp8" and self.fp8_recipe != "rowwise":
            cfg = dataclasses.replace(cfg, fp8_recipe=self.fp8_recipe)
        if self.knobs.etp is not None:  # not searched: the user's (Megatron-Core's folding)
            cfg = dataclasses.replace(cfg, etp=self.knobs.etp)
        runs = self.knobs.pipeline_runs
        if runs not in (None, 1):  # not searched: the stack's schedule calls per step
            if self._refused(runs_problem(self.engine, runs, sched, pp, v,
                                          self.global_batch // (dp * mb), self.stack)):
                return None  # e.g. pp = 1, or runs not dividing this micro-batch count
            cfg = dataclasses.replace(cfg, pipeline_runs=runs)
        if self.async_tp and not (tp > 1 and sp):
            return None  # async TP pipelines the sequence-parallel collectives (plan_rules)
        if self.compile:
            cfg = dataclasses.replace(cfg, compile=True, async_tp=self.async_tp)
            if self.runtime and self._refused(compile_runtime_problem(cfg)):
                return None  # e.g. compiled zero-bubble (plan_rules.compile_runtime_problem)
        if self.offload != "none" and self.runtime and self._refused(
                offload_runtime_problem(cfg)):
            return None
        if self.dtype == "fp8" and self.runtime and self._refused(fp8_runtime_problem(cfg)):
            return None  # FP8 with tensor parallelism: planned for other stacks only
        if ep > 1 and self.runtime and self._refused(next(iter(ep_runtime_problems(
                {"ep": ep, "cp": cp, "zero": zero, "pp": pp, "recompute": rec})), None)):
            return None  # e.g. selective recomputation of gathered experts (plan_rules)
        if self.traffic and self._refused(self._traffic_problem(cfg)):
            return None  # e.g. DiLoCo with ZeRO-3 and no dp_replicate: its rule, kept
        return cfg

    def _traffic_problem(self, cfg: Plan) -> str | None:
        """Why the traffic knobs (gradient compression, DiLoCo) cannot act on this point, None
        where they can: refused here with their rule's reason, which `plan --diloco 16 --zero 3`
        then answers with, not with the reasons of the points left (Evaluator.evaluate's own
        check drops such a point silently: audit s55 review)."""
        try:
            cfg.replace(**self.traffic)
        except UserError as e:
            return str(e)
        return None

    def _refused(self, problem: str | None) -> bool:
        """Keep the validity function's reason for a point it refuses: when it refuses every
        point, the search answers with that reason (`_search`), not "nothing fits"."""
        if problem and self.why_empty is None:
            self.why_empty = problem
        self.tally(problem)
        return bool(problem)

    def tally(self, problem: str | None) -> None:
        """Count a reason the validity function refused a point of the space (open knobs too),
        for `refusal_summary`."""
        if problem:
            key = re.sub(r"\d+", "N", problem)
            self.refusals[key] += 1
            self.refusal_examples.setdefault(key, problem)

    def refusal_summary(self, top: int = 3) -> str | None:
        """The commonest reasons points of the valid layouts were refused, each with its count
        and its first message (one line), or None when none was."""
        if not self.refusals:
            return None
        total = sum(self.refusals.values())
        parts = [f"{n}x {self.refusal_examples[key]}"
                 for key, n in self.refusals.most_common(top)]
        more = len(self.refusals) - min(top, len(self.refusals))
        tail = f" (+{more} other reason(s))" if more > 0 else ""
        return (f"every schedule / knob point of the {len(self._layouts)} valid layout(s) "
                f"was refused ({total} refusals), commonest first: {'; '.join(parts)}{tail}")

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

    def eps(self, dp: int, cp: int, tp: int = 1) -> list[int]:
        """Expert-parallel degrees searched on a layout: the fixed one, else (mixtures of
        experts on a stack with expert parallelism) 1 and every divisor of the experts that
        divides the ranks it folds over (plan_rules.ep_fold_problem: dp/dp_replicate*cp, or
        with a fixed etp tp*cp*dp / etp)."""
        k = self.knobs
        if k.ep:
            return [k.ep]
        if not self.model.is_moe or not self.ep_ok:
            return [1]
        return [e for e in divisors(self.model.moe_experts)
                if ep_fold_problem(e, k.etp, tp, dp, cp, k.dp_replicate) is None]

    def _valid_layouts(self) -> list[tuple[int, int, int, int, int]]:
        k, n = self.knobs, self.n
        fixed = {**k.to_dict(), **self.context}
        out, left_out, refused = [], {}, {}
        for tp in self.tps:
            for cp in self.cps(n // tp):
                if (n // tp) % cp:
                    continue
                rest = n // (tp * cp)
                for pp in ([k.pp] if k.pp else divisors(rest)):
                    if rest % pp:
                        continue
                    dp = rest // pp
                    if k.dp and dp != k.dp:
                        continue
                    for ep in self.eps(dp, cp, tp):
                        knobs = {**fixed, "tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
                        problems = self._layout_problems(knobs)
                        if problems:
                            left_out.setdefault(family(tp, pp), problems[0])
                            if all(map(is_batch_reason, problems)):  # a batch may cure
                                refused.setdefault(family(tp, pp), []).append(knobs)
                            continue
                        out.append((tp, cp, pp, dp, ep))
        found = {family(tp, pp) for tp, _, pp, _, _ in out}
        by_reason: dict[str, list[str]] = {}
        for fam, reason in left_out.items():
            if fam not in found:
                # "plan.pp=2: model ... ties ..." -> the reason, shared by every pp value; a
                # field the family does not vary keeps its subject ("plan.global_batch=16
                # (...): must be divisible by plan.dp=3": without it, no subject at all)
                why = reason.split(": ", 1)[1] if _LAYOUT_FIELD.match(reason) else reason
                if is_batch_reason(reason) and fam in refused:
                    # the first layout tried has the family's largest dp: name the batch
                    # some layout of the family takes (search_batch.py)
                    why = batch_advice(self.global_batch, reason, refused[fam],
                                       self._layout_problems) or why
                by_reason.setdefault(why, []).append(FAMILIES[fam])
        for why, fams in by_reason.items():
            self.notes.append(f"{' and '.join(fams)} layouts left out: {why}")
        return out

    def _layout_problems(self, knobs: dict[str, Any]) -> list[str]:
        """The validity function's reasons a layout (with the fixed knobs) cannot run here."""
        return plan_problems({**knobs, **self.traffic}, self.n, self.model, self.runtime,
                             self.split, self.engine, ep_rule=self.ep_rule,
                             layout_rule=self.mem.layouts)

    def layouts(self):
        return iter(self._layouts)

    def micro_batches(self, dp: int) -> list[int]:
        per_replica = self.global_batch // dp
        if self.knobs.micro_batch:
            return [self.knobs.micro_batch] if per_replica % self.knobs.micro_batch == 0 else []
        return [d for d in divisors(per_replica) if d <= 64]

    def schedules(self, pp: int, m: int) -> list[tuple[str, int]]:
        """The schedules searched for pp stages and m micro-batches (search_schedules.py)."""
        return searched_schedules(self, pp, m)

    def sps(self, tp: int) -> list[bool]:
        if self.knobs.sp is not None:
            return [self.knobs.sp] if (tp > 1 or not self.knobs.sp) else []
        if tp > 1 and self.ep_rule == "tp" and self.model.is_moe:
            return [True]  # Megatron-Core's MoE under tp (plan_rules.ep_stack_problem)
        if layout_problem(self.mem.layouts, sp=True) is not None:
            return [False]  # the stack's code has no sequence parallelism (plan_rules_stack)
        return [False, True] if tp > 1 else [False]

    def zeros(self, dp: int, cp: int = 1, ep: int = 1, tp: int = 1, pp: int = 1) -> list[int]:
        """The ZeRO stages tried on a layout (`dp`: the data ranks, dp x cp): only those the
        priced stack runs on it (plan_rules_zero, MemoryOptions.zero_stages)."""
        rule = self.mem.zero_stages
        zeros = [z for z in self._zeros(dp, cp, ep)
                 if zero_limit(rule, z, dp, tp, pp, cp) is None
                 and layout_problem(self.mem.layouts, tp=tp, zero=z) is None]
        if self.traffic.get("diloco") and self.knobs.zero is None \
                and self.knobs.dp_replicate is None:
            # DiLoCo's replicas step alone: full replicas (ZeRO-0) or, where the search offers
            # them, HSDP's node-aligned replicas of ZeRO-2/3 (plan_rules_fields: the replicas
            # are the dp_replicate axis); the other stages would be refused point by point
            zeros = [z for z in zeros if z == 0 or (
                z >= 2 and self.replicates(tp, cp, dp // cp, z, ep) != [1])]
        return zeros

    def replicates(self, tp: int, cp: int, dp: int, zero: int, ep: int = 1) -> list[int]:
        """dp_replicate values searched at this layout and ZeRO stage: the fixed one; else 1
        and, where the data-parallel group of a ZeRO-2/3 plan spans nodes on a stack whose data
        parallelism is FSDP, the node-aligned HSDP one: each replica's shard group is the
        data-parallel ranks of one node (mesh order pp, dp_replicate, dp_shard, cp, tp), so
        the weight gathers and gradient reduce-scatters stay inside it and only one gradient
        all-reduce per step crosses nodes. FSDP2's `fully_shard` over a 2-D (replicate, shard)
        mesh is HSDP (torch/distributed/fsdp/_fully_shard/_fully_shard.py); torchtitan
        (data_parallel_replicate_degree), OLMo-core and meshtron's runtime build that mesh,
        Composer its HYBRID_SHARD. Other node-crossing splits are priced when fixed, not
        searched (a search policy, as tp > 1 of a mixture of experts)."""
        if self.knobs.dp_replicate is not None:
            return [self.replicate]
        per_node = self.gpus_per_node // (tp * cp) if self.gpus_per_node % (tp * cp) == 0 else 0
        compressed = self.traffic.get("grad_compression", "none") != "none"
        if zero < 2 or self.mem.framework != "fsdp2" or per_node < 2 or dp <= per_node \
                or dp % per_node or (compressed and not self.traffic.get("diloco")):
            return [1]  # compression without DiLoCo: HSDP refused (FSDP2's own all-reduce)
        r = dp // per_node
        if ep_fold_problem(ep, self.knobs.etp, tp, dp, cp, r) is not None:
            return [1]  # the experts fold over one replica's shard ranks (plan_rules)
        # DiLoCo: its replicas are the dp_replicate axis (ZeRO-2/3 with one replica refused)
        return [r] if self.traffic.get("diloco") else [1, r]

    def _zeros(self, dp: int, cp: int, ep: int) -> list[int]:
        if self.knobs.zero is not None:
            return [self.knobs.zero]
        # ep > 1: every stage (meshtron folds ep over the data ranks of any ZeRO stage:
        # parallel/mesh.py ExpertMeshes); with cp only ZeRO-2/3, as below
        if self.offload == "full" and self.runtime:
            # FSDP2's CPU offload is of shards (ZeRO-2/3); alone, ZeRO-2 gathers once a step
            return [2, 3] if dp > 1 else [2]
        # the priced stack runs its host offload only from some ZeRO stage (plan_rules_offload);
        # alone (dp 1) that stage, as the runtime's FSDP2 offload above
        low = least_zero(self.mem.host_offload, self.offload)
        high = most_zero(self.mem.host_offload, self.offload)  # and up to some (Megatron-FSDP)
        if (self.knobs.dp_replicate or 1) > 1 or (cp > 1 and self.runtime):
            # HSDP: replicas of sharded groups; meshtron runs cp on FSDP ZeRO-2/3 only
            # (plan_rules.cp_runtime_problems)
            return [z for z in (2, 3) if low <= z <= high]
        if dp == 1:
            return [low]
        # dp here: every rank sharing gradients
        return [z for z in (0, 1, 2, 3) if low <= z <= high]


def selective_is_none(model: ModelSpec, seq_len: int, opts: KernelOptions, mem: MemoryOptions,
                      dtype: str) -> bool:
    """Selective recomputation saves nothing over none: Korthikanti's policy (recompute the
    attention core) with FlashAttention, which never stores the core's scores, and whose
    output the out-projection keeps in bf16 anyway (under Transformer Engine's FP8 the
    checkpointed core drops the bf16 copy beside the FP8 one: memory_acts._korthikanti, then
    searched). Policies that recompute more (meshtron's and torchtitan's: they keep matmul
    outputs only) save less memory and are searched."""
    if opts.attention != "flash":
        return False
    import dataclasses as dc

    m = dc.replace(mem, dtype=dtype)
    args = (model, 1, False, 1, seq_len)
    return (memory.activation_bytes(*args, "selective", opts, m)
            >= memory.activation_bytes(*args, "none", opts, m))


__all__ = ["SplitFallback", "VIRTUAL_STAGES", "MIN_CP_TOKENS", "DEFAULT_DTYPE", "FAMILIES",
           "SearchSpace", "family", "family_of", "divisors", "runs_ep", "selective_is_none"]
