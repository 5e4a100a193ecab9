"""Why the other plans lose: the best plan of each other family and of each other knob value on
the winner's layout, each with a one-line reason ("12% slower, pipeline bubble (+0.8 s)")."""

from __future__ import annotations

from typing import Any

from meshtron.errors import UserError
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.plan import RECOMPUTE, Plan
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.search_bound import branch_and_bound
from meshtron.planner.search_result import Alternative, SearchResult
from meshtron.planner.search_space import FAMILIES, SearchSpace, family_of


_CAUSES = {
    "compute": "more computation (recomputation or less efficient small GEMMs)",
    "tp_comm": "tensor-parallel communication",
    "pp_comm": "pipeline transfers",
    "dp_comm": "data-parallel communication exposed",
    "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "ep_comm": "expert-parallel all-to-all exposed",
    "offload": "host-link copies of offloaded state",
    "step_host": "host work at the step's end (train-metric sync)",
    "fp8_sync": "FP8 amax all-reduces of delayed scaling (over dp x tp x cp)",
}
"""Every part of estimate_results.TimeBreakdown: the one that grew most is the reason."""


def loss_reason(winner: Estimate, other: Estimate) -> str:
    """'12% slower, data-parallel all-gather exposed (+0.8 s)' style explanation."""
    if not other.fits:
        m = other.memory
        if m.total <= m.capacity and not m.host_fits:
            return (f"needs {m.host:.1f} GiB of host memory per node > {m.host_capacity:.4g} "
                    f"GiB usable (offload={other.config.offload}; {other.config.describe()})")
        return (f"needs {other.memory.total:.1f} GiB > {other.memory.capacity:.0f} GiB "
                f"per {m.device} (at its leanest: {other.config.describe()})")
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


def search_and_explain(ev: Evaluator, space: SearchSpace, top_k: int, explain: bool,
                       cutoff: float = float("inf")) -> SearchResult:
    """search_bound.branch_and_bound over `space`, with the reasons the other families and knob
    values lose (`alternatives`) when `explain` and a plan fits."""
    result, (fam_best, fam_lean) = branch_and_bound(ev, space, top_k, cutoff)
    if result.plans and explain:
        result.alternatives = explain_losses(result.plans[0], fam_best, fam_lean, ev, space)
    return result


def explain_losses(best: Estimate, fam_best: dict[str, Estimate], fam_lean: dict[str, Estimate],
                   ev: Evaluator, space: SearchSpace) -> list[Alternative]:
    """The best plan of each other family (else its leanest), then the best plan of each other
    knob value on the winner's layout, each with why it loses to `best`."""
    out: list[Alternative] = []
    win_fam = family_of(best.config)
    for fam, label in FAMILIES.items():
        if fam == win_fam:
            continue
        est = fam_best.get(fam) or fam_lean.get(fam)
        if est is None:
            continue
        name = label
        if fam == "dp" and est.fits:  # tp = pp = 1, where context parallelism may split
            z = est.config.zero
            name = (f"ZeRO-{z} data x context parallel" if est.config.cp > 1
                    else f"pure ZeRO-{z} data parallel")
        out.append(Alternative(f"{name} ({est.config.layout()})", est, loss_reason(best, est)))
    return out + _knob_losses(best, ev, space)


def _knob_variants(c: Plan, space: SearchSpace) -> list[tuple[str, dict[str, Any]]]:
    """(label, change) of every other value of the knobs on the winner `c`'s layout."""
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
        for e in space.eps(c.dp, c.cp, c.tp):
            if e != c.ep:
                variants.append((f"ep={e}", {"ep": e}))
    return variants


def _knob_losses(best: Estimate, ev: Evaluator, space: SearchSpace) -> list[Alternative]:
    """Knob alternatives on the winner's layout: the best plan with each other value (one
    small search each), unless the user fixed that knob or it ties."""
    c = best.config
    out: list[Alternative] = []
    base = {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep}
    given = space.knobs.to_dict()
    for label, change in _knob_variants(c, space):
        fixed = {**base, **{k: v for k, v in given.items() if k not in base}, **change}
        if any(given.get(k) not in (None, v) for k, v in change.items()):
            continue  # the user fixed this knob
        try:
            sub_space = SearchSpace(space.model, ev.cluster, ev.global_batch, ev.seq,
                                    Knobs.of(fixed), ev.opts, ev.mem, space.runtime,
                                    space.framework, space.traffic)
            sub, _ = branch_and_bound(ev, sub_space, 1)
        except UserError:
            continue  # this knob value leaves nothing to run on the layout (e.g. too few layers)
        est = sub.best or sub.near_miss
        if est is None or (est.fits and est.step_time_s <= best.step_time_s * 1.0005):
            continue  # ties are not a reason to lose
        out.append(Alternative(f"{c.layout()} with {label}", est, loss_reason(best, est)))
    return out


__all__ = ["loss_reason", "explain_losses", "search_and_explain", "split_text"]


_RULES = {
    "any": "the time-balanced split (pipeline.partition_layers: meshtron's and torchtitan's "
           "stages take any layers)",
    "megatron-even": "Megatron-LM's equal stages",
    "megatron-ends": "Megatron-Core's uneven end stages (--decoder-first/last-pipeline-num-layers, "
                     "or account_for_embedding/loss_in_pipeline_split counting the embedding "
                     "and the loss as a layer each), the fastest it can express",
    "deepspeed-transformer": "DeepSpeed's partition_method 'type:transformer' (<= 0.12.4: "
                             "stages filled from the first up to the bottleneck)",
    "deepspeed-parameters": "DeepSpeed's partition_method 'parameters' (0.12.5+: balanced "
                            "parameters per stage)",
    "dualpipe": "the time-balanced split DeepSeek's DualPipe runs",
}
"""What each layer-to-stage rule (memory_options.PIPELINE_SPLITS) builds, in a plan's words."""


def split_text(est: Estimate) -> str | None:
    """Why the plan's pipeline ranks hold the layers they do (None without a pipeline): the
    plan's own split, the priced stack's rule with the per micro-batch times that unbalance the
    end stages, or memory (the rule's split over a rank's memory, re-split within it)."""
    sc, pp = est.split, est.config.pp
    if sc is None or pp == 1:
        return None
    per_rank = est.layers_per_rank
    shown = "/".join(map(str, per_rank))
    even = len(set(per_rank)) == 1
    if sc.by == "given":
        return f"{shown} layers per stage as the plan gives them (stage_layers)"
    if sc.by == "least":
        return (f"{shown} layers per stage: no split fits in memory; priced on the split "
                "needing the least (pipeline.min_memory_partition)")
    rule = _RULES.get(sc.rule, sc.rule)
    if sc.by == "unfit":
        return (f"{shown} layers per stage: no split fits in memory; priced on "
                f"{rule}{_unbalance(sc, per_rank, est.stage_layers)}")
    if sc.by == "memory" and not (sc.free and sc.over):
        return (f"{shown} layers per stage, chosen for memory: {rule} within the layers each "
                f"stage's memory holds ({'/'.join(map(str, sc.caps))})")
    if sc.by == "memory":
        over = ", ".join(str(i) for i in sc.over)
        return (f"{shown} layers per stage, chosen for memory: {rule} gives "
                f"{'/'.join(map(str, sc.free))}, over the memory of stage {over} (at most "
                f"{'/'.join(map(str, sc.caps))} layers fit per stage), so layers move to the "
                "stages with room, the slowest stage as fast as those caps allow"
                + (_SURPLUS if _surplus_first(sc, per_rank) else ""))
    if even:
        return f"{shown} layers per stage: {rule}, even"
    return f"{shown} layers per stage: {rule}{_unbalance(sc, per_rank, est.stage_layers)}"


def _unbalance(sc: Any, per_rank: list[int], chunks: list[int]) -> str:
    """Why the rule's split is uneven: the layers do not divide, and/or the end stages' extra
    work per micro-batch (the embedding on the first, the head and loss on the last)."""
    parts, pp = [], len(per_rank)
    if sc.rule == "megatron-ends" and len(chunks) > pp and (chunks[0] == 0 or chunks[-1] == 0):
        # Megatron-Core's account_for_embedding/loss_in_pipeline_split (pipeline_split.py)
        return (": account_for_embedding/loss_in_pipeline_split, the first chunk holds only "
                "the embedding and the last only the loss, each counted as a layer, so the "
                "end stages hold one layer fewer")
    if sc.layers % pp:
        parts.append(f"{sc.layers} layers do not divide into {pp} equal stages")
    if sc.rule in ("any", "megatron-ends", "dualpipe") and sc.layer_s > 0:
        first, last = (f"{t * 1e3:.3g} ms, {t / sc.layer_s:.2g} layers"
                       for t in (sc.first_s, sc.last_s))
        if sc.head_first:  # torch's V: the last virtual stage on rank 0 (pipeline.head_rank)
            parts.append(f"a layer takes {sc.layer_s * 1e3:.3g} ms per micro-batch, the first "
                         f"stage adds the embedding and, on torch's V, the output head and "
                         f"loss ({first})")
        else:
            parts.append(f"a layer takes {sc.layer_s * 1e3:.3g} ms per micro-batch, the first "
                         f"stage adds the embedding ({first}) and the last the output head "
                         f"and loss ({last})")
    if _surplus_first(sc, per_rank):
        parts.append(_SURPLUS[2:])
    return ": " + "; ".join(parts) if parts else ""


_SURPLUS = ("; the slowest stage's time leaves room for more layers than the model has, and "
            "the surplus comes off the first stages, which hold the most micro-batches in "
            "flight")
"""pipeline.partition_layers' tie rule (meshtron's and torchtitan's any split)."""


def _surplus_first(sc: Any, per_rank: list[int]) -> bool:
    """Whether the time-balanced rule took layers off the first stage below what its time
    (and, chosen for memory, its memory) would hold."""
    room = per_rank[0] < max(per_rank[1:])
    if sc.caps:
        room = room and per_rank[0] < sc.caps[0]
    return sc.rule in ("any", "dualpipe") and room
