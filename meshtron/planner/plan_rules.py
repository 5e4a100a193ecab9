"""The plan's validity rules: one place, used by Plan, Knobs, the search and the runtime.

`plan_problems` is THE validity function (meshtron/planner/plan.py re-exports every name here):
rules on the plan's own fields, between the fields, against the world size and against the
model's shapes, and the runtime's own limits.

The rules are split by topic, this module their one entry point: plan_rules_fields.py (the
fields and their consistency), plan_rules_pipeline.py (schedules and each stack's layer
split), plan_rules_offload.py (the host offload each stack runs), plan_rules_zero.py (the ZeRO
stages each stack runs), plan_rules_stack.py (the tp / pp / MoE each stack's code lacks),
plan_rules_runtime.py (meshtron's runtime limits, its stack options decided in
plan_rules_options.py); every name stays importable here.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from meshtron.errors import UserError
from meshtron.planner.plan_rules_fields import (  # noqa: F401  (re-exported)
    _DTYPE_ALIASES, ATTENTION, COMM_DEFAULTS, COMPRESS_SCOPES, COMPRESSIONS, CONTEXT, DTYPES,
    FP8_RECIPES, KNOBS, LAYOUT_DEFAULTS, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_TOKENS_PER_STEP,
    OFFLOADS, RECOMPUTE, REDUCE_DTYPES, SCHEDULES, ZERO_STAGES, _is_int, comm_problems,
    EP_FOLDS, ep_fold_problem, ep_rule, ep_stack_problem, field_problems)
from meshtron.planner.plan_rules_pipeline import (  # noqa: F401  (re-exported)
    ONE_SCHEDULE_PER_STEP, RUNS_STACKS, STACK_SCHEDULES, megatron_account_for,
    microbatch_problem, most_chunks, runs_problem, schedule_problem, schedule_zero_problem,
    split_problem)
from meshtron.planner.plan_rules_offload import (  # noqa: F401  (re-exported)
    STACK_OFFLOADS, least_zero, most_zero, offload_kinds, offload_problem)
from meshtron.planner.plan_rules_stack import (  # noqa: F401  (re-exported)
    STACK_LAYOUTS, layout_problem, most_chunk_layers)
from meshtron.planner.plan_rules_zero import (  # noqa: F401  (re-exported)
    STACK_ZEROS, zero_limit, zero_problem)
from meshtron.planner.plan_rules_runtime import (  # noqa: F401  (re-exported)
    compile_runtime_problem, cp_runtime_problems, ep_runtime_problems, options_runtime_problems,
    recompute_runtime_problems, schedule_runtime_problem)


def model_problems(k: Mapping[str, Any], model: Any, runtime: bool = True,
                   split: str | None = None) -> Iterator[str]:
    """Rules between the plan and the model's shapes (a ModelSpec), incl. the runtime's limit on
    tied embeddings (`runtime`: False when pricing another framework, e.g. Megatron-LM, which
    keeps a copy of a tied embedding on the last stage and all-reduces its gradient) and the
    priced stack's layer-to-stage rule (`split`: `split_problem`)."""
    tp, pp, v = k.get("tp"), k.get("pp"), k.get("virtual_stages") or 1
    ep = k.get("ep") or 1
    if ep > 1 and not getattr(model, "is_moe", False):
        yield (f"plan.ep={ep}: expert parallelism needs a mixture-of-experts model (model "
               f"{model.name} has no routed experts); use ep=1")
        return
    if ep > 1 and model.moe_experts % ep:
        yield (f"plan.ep={ep}: must divide the model's {model.moe_experts} routed experts "
               "(every ep rank holds the same number)")
        return
    etp = k.get("etp")
    if etp is not None and model.is_moe and model.moe_ffn_hidden % etp:
        yield (f"plan.etp={etp}: must divide the experts' FFN width "
               f"({model.moe_ffn_hidden}: each expert's GEMMs are split over etp ranks)")
        return
    if tp is not None:
        # Named as a user knows them, whether the model came from a preset or a config.json.
        for attr, what in (("heads", "attention heads"),
                           ("kv_heads", "key/value heads (they are not replicated across "
                                        "tensor ranks)"),
                           ("ffn_hidden", "FFN width (intermediate size)")):
            n = getattr(model, attr)
            if n % tp:
                yield f"plan.tp={tp}: must divide the model's {n} {what}"
                return
    if runtime and getattr(model, "mtp_depth", 0):
        yield (f"model.mtp_depth={model.mtp_depth}: meshtron's runtime builds no multi-token "
               "prediction modules (the planner prices them for DeepSeek's stack); use 0")
        return
    if runtime and tp is not None and tp > 1 and getattr(model, "qk_norm_whole", False):
        # the norm's mean of squares runs over every head: a tp rank holds heads/tp of them
        yield (f"plan.tp={tp}: model.qk_norm_whole=true (OLMo 2's norm over the whole q and k "
               "projections) needs every head on one rank in meshtron's runtime; use tp=1")
        return
    if runtime and pp is not None and pp > 1 and getattr(model, "tied_embeddings", False):
        yield (f"plan.pp={pp}: model {model.name} ties its input and output embeddings, which "
               "the runtime cannot split across pipeline stages; use pp=1")
        return
    sl = k.get("stage_layers")
    if pp is not None and (not sl or len(sl) == pp * v):
        problem = split_problem(split, model.layers, pp, v, list(sl) if sl else None)
        if problem:
            yield problem
            return
    if sl:
        if sum(sl) != model.layers:
            yield (f"plan.stage_layers={list(sl)}: sums to {sum(sl)}, the model has "
                   f"{model.layers} layers")
    elif pp is not None and pp * v > model.layers and not (
            split == "megatron-ends" and megatron_account_for(model.layers, pp, v)):
        # Megatron-Core's account_for_embedding/loss_in_pipeline_split counts the embedding
        # and the loss as a layer each: pp*v may exceed the blocks by up to two, the very
        # first (last) chunk holding only the embedding (loss) (megatron_account_for)
        name = f"plan.pp={pp}" if v == 1 else f"plan.pp*virtual_stages={pp}*{v}={pp * v}"
        yield f"{name}: more pipeline stages than model layers ({model.layers})"



def world_problem(k: Mapping[str, Any], world_size: int) -> str | None:
    tp, pp, dp, cp = k.get("tp"), k.get("pp"), k.get("dp"), k.get("cp") or 1
    if None not in (tp, pp, dp):
        if tp * cp * pp * dp != world_size:
            if cp > 1:
                return (f"plan.dp*tp*cp*pp={dp}*{tp}*{cp}*{pp}={dp * tp * cp * pp}: must equal "
                        f"the world size {world_size}")
            return (f"plan.dp*tp*pp={dp}*{tp}*{pp}={dp * tp * pp}: must equal the world size "
                    f"{world_size}")
        return None
    given = [(name, val) for name, val in (("tp", tp), ("cp", k.get("cp")), ("pp", pp),
                                            ("dp", dp)) if val is not None]
    fixed = (tp or 1) * (pp or 1) * (dp or 1) * cp
    if len(given) > 1 and world_size % fixed:
        names, sizes = "*".join(n for n, _ in given), "*".join(str(v) for _, v in given)
        rest = "*".join(n for n in ("tp", "cp", "pp", "dp") if n not in dict(given))
        return (f"plan.{names}={sizes}={fixed}: must divide the world size {world_size} "
                f"(GPUs; {rest or 'nothing'} takes the rest)")
    for name, val in given:
        if world_size % val:
            return f"plan.{name}={val}: must divide the world size {world_size}"
    return None


def plan_problems(k: Mapping[str, Any], world_size: int | None = None,
                  model: Any = None, runtime: bool = True, split: str | None = None,
                  engine: str | None = None, offload_rule: str | None = None,
                  zero_rule: str | None = None, ep_rule: str | None = None,
                  stack: str | None = None, layout_rule: str | None = None,
                  options: Mapping[str, Any] | None = None) -> list[str]:
    """THE validity function: every reason the (possibly partial) plan `k` cannot run, checked
    against `world_size` and `model` (a ModelSpec) when given. Empty when valid. `runtime`:
    include meshtron's runtime limits (False when the planner prices another framework);
    `split`: the priced stack's layer-to-stage rule (memory_options.PIPELINE_SPLITS);
    `engine`: the rule naming the stack's pipeline engine, whose schedules are checked, when
    a pinned layout is priced on another split (search_space.SplitFallback; default `split`);
    `offload_rule`: the host offload the stack runs (MemoryOptions.host_offload);
    `zero_rule`: the ZeRO stages it runs (MemoryOptions.zero_stages); `ep_rule`: "tp" where
    the stack folds expert parallelism over the tensor ranks too (EP_FOLDS), so it takes
    plan.etp; "data" where it does not; None: no stack named (a Plan read alone); `stack`:
    the priced stack as 'name@era', for the rules only its trainer decides (RUNS_STACKS);
    `layout_rule`: the tp / pp / cp / sp / recomputation / MoE its code cannot run
    (MemoryOptions.layouts);
    `options`: the stack options priced (plan_rules_options.option_values), checked against
    what meshtron's runtime runs when `runtime`."""
    out = list(field_problems(k))
    # the layout against the GPUs first: a product that cannot fill them is the layout's
    # fault, not the batch's its dp then fails to divide
    world = world_problem(k, world_size) if world_size is not None and all(
        _is_int(k.get(n)) and k.get(n) > 0 for n in ("tp", "pp", "dp", "cp")
        if k.get(n) is not None) else None
    if world:
        out.insert(0, world)
    # meshtron's own stack says it in its runtime's words (ep_runtime_problems)
    problem = None if runtime else ep_stack_problem(
        ep_rule, k.get("etp"), k.get("tp"), k.get("sp"), bool(getattr(model, "is_moe", False)))
    if problem:
        out.append(problem)
    g = k.get
    sizes = (g("global_batch"), g("dp"), g("micro_batch"))
    m = (sizes[0] // (sizes[1] * sizes[2])
         if all(_is_int(x) and x > 0 for x in sizes) else None)
    problem = schedule_problem(split if engine is None else engine, g("schedule"), g("pp"),
                               g("virtual_stages"), m)
    if problem:
        out.append(problem)
    problem = runs_problem(split if engine is None else engine, g("pipeline_runs"),
                           g("schedule"), g("pp"), g("virtual_stages"), m, stack)
    if problem:
        out.append(problem)
    problem = offload_problem(offload_rule, g("offload"), g("zero"))
    if problem:
        out.append(problem)
    problem = zero_problem(zero_rule, g("zero"), g("dp"), g("tp"), g("pp"), g("cp"))
    if problem:
        out.append(problem)
    moe_model = (getattr(model, "name", None) or "model") if getattr(model, "is_moe", False) \
        else None
    chunk = (most_chunk_layers(model.layers, g("pp"), g("virtual_stages"), g("stage_layers"))
             if model is not None else None)
    problem = layout_problem(layout_rule, g("tp"), g("pp"), moe_model, stack, g("cp"),
                             g("sp"), g("recompute"), g("zero"), chunk)
    if problem:
        out.append(problem)
    if model is not None:
        out.extend(model_problems(k, model, runtime, split))
    if runtime:
        problem = schedule_runtime_problem(k)
        if problem:
            out.append(problem)
        out.extend(cp_runtime_problems(k, model))
        out.extend(ep_runtime_problems(k))
        out.extend(recompute_runtime_problems(k))
        # after the plan's own: DualPipe's schedule is refused in its words, not its split's
        out.extend(options_runtime_problems(options or {}, k))
    return out



def check(k: Mapping[str, Any], world_size: int | None = None, model: Any = None,
          runtime: bool = True, split: str | None = None) -> None:
    """Raise UserError with the first of `plan_problems`."""
    problems = plan_problems(k, world_size, model, runtime, split)
    if problems:
        raise UserError(problems[0])
