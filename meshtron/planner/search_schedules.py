"""The pipeline schedules the planner's search tries for a layout (`searched_schedules`,
SearchSpace.schedules): 1F1B, ZB-H1 and interleaved over VIRTUAL_STAGES, or what the user
fixed, each through the priced stack's engine, its layer split and torch's micro-batch
limits, and the search's own policy on the micro-batch count (`_formulas_hold`)."""

from __future__ import annotations

from typing import Any

from meshtron.planner.plan import microbatch_problem
from meshtron.planner.plan_rules import most_chunks, schedule_problem, split_problem

VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""Virtual stages (model chunks per pipeline rank) the search tries for interleaving."""


def searched_schedules(space: Any, pp: int, m: int) -> list[tuple[str, int]]:
    """Schedules searched for pp stages and m micro-batches per step: 1F1B, ZB-H1 and
    interleaved (v in VIRTUAL_STAGES, at least one layer per virtual stage); GPipe and other
    virtual-stage counts only when fixed; DualPipe and DualPipeV for DeepSeek's engine
    (split rule 'dualpipe'). Each must pass the schedules' own limits. `space`: the
    SearchSpace (its knobs, model, split rule and engine); a fixed schedule that cannot run
    sets its `why_empty`, an open one refused is counted in its `tally`."""
    k = space.knobs
    if pp == 1:
        return [(None, 1)]
    layers_per_stage = most_chunks(space.split, space.model.layers, pp)  # chunks at most
    if k.schedule is not None:
        if k.schedule == "interleaved" and not k.virtual_stages:
            cands = [("interleaved", v) for v in VIRTUAL_STAGES if v <= layers_per_stage]
        else:
            cands = [(k.schedule, k.virtual_stages or 1)]
    else:
        vs = [k.virtual_stages] if k.virtual_stages else VIRTUAL_STAGES
        cands = [("1f1b", 1), ("zb", 1)] if not k.virtual_stages else []
        cands += [("interleaved", v) for v in vs if 2 <= v <= layers_per_stage]
        if space.engine == "dualpipe":  # DeepSeek's engine runs DualPipe and its V only
            cands = [("dualpipe", v) for v in (1, 2) if k.virtual_stages in (None, v)]
    ok = []
    fixed = k.schedule is not None or k.virtual_stages is not None

    def rounds(s: str, v: int) -> str | None:
        # torch.distributed.pipelining's limits on the micro-batch count: those of every
        # stack that runs its schedules (meshtron's runtime, and the 'any' engine:
        # torchtitan, NeMo AutoModel; their order deadlocks otherwise, pipeline_zb
        # _program), not another engine's (a DualPipe or Megatron schedule priced as zb)
        torch_engine = space.runtime or space.engine == "any"
        return microbatch_problem(s, pp, v, m) if torch_engine else None

    def split(v: int) -> str | None:
        # what the priced stack's pipeline engine builds and runs (plan_rules)
        return split_problem(space.split, space.model.layers, pp, v)

    for s, v in cands:
        engine = schedule_problem(space.engine, s, pp, v, m)
        if not fixed:
            why = engine or (None if v > layers_per_stage else rounds(s, v) or split(v))
            if v <= layers_per_stage and why is None:
                ok.append((s, v))
            space.tally(why)
        elif engine is not None:
            space.why_empty = space.why_empty or engine
        elif split(v) is not None:
            space.why_empty = space.why_empty or split(v)
        elif v > layers_per_stage:
            space.why_empty = space.why_empty or (
                f"plan.schedule={s!r} with {v} virtual stages: needs pp*virtual_stages="
                f"{pp}*{v}={pp * v} <= the model's {space.model.layers} layers")
        elif rounds(s, v) is not None:
            space.why_empty = space.why_empty or rounds(s, v)
        else:
            ok.append((s, v))
    if k.schedule is not None and k.schedule == "interleaved" and not cands:
        space.why_empty = space.why_empty or (
            f"plan.schedule='interleaved': needs at least 2 layers per pipeline stage "
            f"(the model has {space.model.layers} layers over pp={pp})")
    if k.schedule is None:  # the formulas see one schedule call's micro-batches
        per_call = m // (k.pipeline_runs or 1)
        held = [(s, v) for s, v in ok if _formulas_hold(s, pp, per_call)]
        for s, v in ok:
            if not _formulas_hold(s, pp, per_call):
                space.tally(_formulas_why(s, pp, per_call))
        if ok and not held and per_call < m:
            space.why_empty = space.why_empty or (
                f"plan.pipeline_runs={k.pipeline_runs}: {per_call} micro-batches per "
                f"schedule call, fewer than pp={pp} (or not a multiple of it) for every "
                "schedule searched; fix one with --schedule (e.g. gpipe) or use fewer runs")
        ok = held
    return ok


def _formulas_why(schedule: str, pp: int, m: int) -> str:
    """Why `_formulas_hold` leaves a schedule out of the search (one line)."""
    need = "at least pp" if schedule in ("1f1b", "zb") else "a multiple of pp"
    return (f"plan.micro_batch: {m} micro-batches per step, the search's schedule "
            f"{schedule!r} needs {need}={pp} (fix --schedule, e.g. gpipe, to price fewer)")


def _formulas_hold(schedule: str, pp: int, m: int) -> bool:
    """Search policy for schedules the user did not fix: pipeline.py's bubble and in-flight
    formulas assume 1F1B and ZB-H1 keep pp micro-batches in flight (m >= pp) and interleaving
    runs whole rounds of pp (m % pp == 0, as Megatron-LM requires)."""
    if schedule in ("1f1b", "zb"):
        return m >= pp
    if schedule == "interleaved":
        return m % pp == 0
    return True
