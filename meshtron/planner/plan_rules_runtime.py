"""The runtime's own limits (part of THE validity function, plan_rules.plan_problems):
what meshtron's runtime does not run with expert or context parallelism, or compiled,
DeepSeek's DualPipe, which it does not run at all, and the stack options it does not run
(`options_runtime_problems`, the decisions in plan_rules_options.RUNTIME_OPTIONS).
Skipped when the planner prices another framework (plan_problems(runtime=False)), except
compile_runtime_problem, which the search and Plan ask directly.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from meshtron.planner.plan_rules_options import RUNTIME_OPTIONS, runs, shown
from meshtron.planner.plan_rules_pipeline import dualpipe_elsewhere


def schedule_runtime_problem(k: Mapping[str, Any]) -> str | None:
    """meshtron's runtime runs torch.distributed.pipelining's schedules (parallel/pipeline.py),
    not DeepSeek's DualPipe, which the planner prices for DeepSeek's stack only, and one
    schedule call per optimizer step (plan.pipeline_runs = 1)."""
    if k.get("schedule") == "dualpipe" and (k.get("pp") or 1) > 1:
        return dualpipe_elsewhere()
    runs = k.get("pipeline_runs")
    if runs is not None and runs != 1:
        # parallel/parallel_model.py `_run`: one schedule.step of all the rank's micro-batches
        return (f"plan.pipeline_runs={runs}: meshtron's runtime runs one pipeline schedule of "
                "all the step's micro-batches (parallel_model.py: one schedule.step per "
                "optimizer step); planned for torchtitan and nemo-automodel only; use "
                "pipeline_runs=1")
    return None


def ep_runtime_problems(k: Mapping[str, Any]) -> Iterator[str]:
    """What meshtron's runtime does not run with expert parallelism (ep > 1): ep is folded over
    the data ranks (meshtron/parallel/mesh.py `ExpertMeshes`: FSDP's shard axis dp_shard x cp
    for ZeRO-2/3, "dp_replicate" for ZeRO-0/1; every stage equals one process,
    tests/test_ep_train.py); gradient compression and DiLoCo are refused (they replace FSDP's
    reduction, which the experts' own FSDP unit relies on). Pipelines run,
    every schedule (tests/test_ep_pp.py: 1F1B, interleaved, GPipe, ZB-H1, ZBV equal one
    process). Selective recomputation runs with ep only under ZeRO-3 without a pipeline: the
    routed experts are an FSDP unit inside the checkpointed block, and where FSDP keeps them
    gathered after forward (ZeRO-0/1/2, or a pipeline's stage) its hooks record one profiler
    range more in the replay than in the forward, which torch 2.13's selective checkpoint
    refuses ("profiler._record_function_enter_new ... not found in storage"; measured with
    `meshtron rehearse --model tiny-moe --layout dp=8,ep=2 --zero 1 --recompute selective`
    and the same build on real tensors)."""
    ep, g = k.get("ep") or 1, k.get
    if g("etp") is not None:
        # no expert tensor parallelism: the runtime replicates the MoE over tp, ep is folded
        # over the data ranks only (meshtron/parallel/tensor.py `_moe_plan`, mesh.py)
        yield (f"plan.etp={g('etp')}: meshtron's runtime folds ep over the data x context "
               "ranks only and replicates the experts over tp (no expert tensor "
               "parallelism); leave etp unset")
        return
    if ep == 1:
        return
    if g("recompute") == "selective" and (
            (g("zero") is not None and g("zero") < 3) or (g("pp") or 1) > 1):
        yield (f"plan.recompute='selective' with plan.ep={ep}, zero={g('zero')}, "
               f"pp={g('pp') or 1}: torch 2.13's selective checkpoint fails on the experts' "
               "FSDP unit kept gathered after forward; use zero=3 without a pipeline, or "
               "recompute full, half or none")
    if (g("cp") or 1) > 1 and ep % g("cp"):
        yield (f"plan.ep={ep} with plan.cp={g('cp')}: ep spans whole context groups "
               "(ep = dp_shard_in_ep x cp); use a multiple of cp")
    elif g("grad_compression") not in (None, "none") or (g("diloco") or 0) > 0:
        yield (f"plan.ep={ep}: gradient compression and DiLoCo are not run with expert "
               "parallelism; use grad_compression='none', diloco=0 or ep=1")


def options_runtime_problems(options: Mapping[str, Any],
                             k: Mapping[str, Any]) -> Iterator[str]:
    """Every stack option (plan_rules_options.option_values: KernelOptions, MemoryOptions,
    reduce_dtype) whose value meshtron's runtime does not run, one line each: the field, the
    value, what the runtime does instead (its code) and the values allowed. Async TP is the
    plan's (`k`: async_tp), never an option's alone; a compiled stack is the plan's compile
    (`k`: compile, where the plan states it)."""
    for name, value in options.items():
        if name not in RUNTIME_OPTIONS:  # not an option the runtime takes (the plan's dtype)
            yield (f"options.{name}={shown(value)}: unknown option for meshtron's runtime "
                   "(not one of plan_rules_options.RUNTIME_OPTIONS)")
            continue
        problem = plan_field_problem(name, value, k)
        if problem:
            yield problem
            continue
        allowed, does = RUNTIME_OPTIONS[name]
        if name == "async_tp" and k.get("async_tp"):
            allowed = (False, True)  # the plan's own async_tp (search.py sets the option)
        if not runs(value, allowed):
            yield (f"options.{name}={shown(value)}: meshtron's runtime {does}; allowed: "
                   f"{', '.join(shown(a) for a in allowed)}, or --framework a stack whose "
                   "code does it")


def plan_field_problem(name: str, value: Any, k: Mapping[str, Any]) -> str | None:
    """An option that restates one of the plan's own fields and contradicts it: the runtime
    runs the field (compile: parallel/compile.py), so a contradicting option would be priced
    and not run. (reduce_dtype against plan.reduce_dtype: frameworks.for_plan.)"""
    if name == "stack" and value == "compiled" and k.get("compile") is False:
        return ("options.stack='compiled' with plan.compile=false: meshtron's runtime runs "
                "compiled blocks only as the plan's compile=true (parallel/compile.py); set "
                "compile = true, or stack = \"eager\"")
    return None


def recompute_runtime_problems(k: Mapping[str, Any]) -> Iterator[str]:
    """Selective recomputation under a zero-bubble pipeline: torch 2.13's split backward runs
    a second autograd pass (W, `stage_backward_weight`) through every checkpointed block after
    B, and the selective checkpoint's cache refuses it ("Trying to backward an extra time. You
    are only allowed to backward once on any region computed under selective activation
    checkpoint"; measured with `meshtron train --model debug --nproc 2 --plan pp=2 --schedule
    zb --recompute selective`, rank 1's first W; planner/zb_recompute.py)."""
    g = k.get
    if g("recompute") == "selective" and g("schedule") == "zb" and (g("pp") or 1) > 1:
        yield ("plan.recompute='selective' with plan.schedule='zb': torch 2.13's selective "
               "checkpoint refuses zero bubble's second (weight) backward; use recompute "
               "full, half or none, or another schedule")


def cp_runtime_problems(k: Mapping[str, Any], model: Any = None) -> Iterator[str]:
    """What meshtron's runtime does not run with context parallelism (cp > 1) yet: only the
    compositions tests/test_cp_train.py proves equal to one process are allowed (cp with FSDP
    ZeRO-2/3 over dp_shard x cp, tensor/sequence parallelism, recomputation, document masks).
    A pipeline, ZeRO-0/1 (replicated gradients: cp ranks still need FSDP's reduction over
    dp_shard x cp), gradient compression, DiLoCo and learned position tables are refused."""
    cp = k.get("cp") or 1
    if cp == 1:
        return
    g = k.get
    if g("pp") is not None and g("pp") > 1:
        yield (f"plan.cp={cp} with plan.pp={g('pp')}: meshtron's runtime does not run context "
               "parallelism inside a pipeline yet; use pp=1")
    elif g("zero") is not None and g("zero") < 2:
        yield (f"plan.zero={g('zero')} with plan.cp={cp}: context parallelism runs on FSDP over "
               "dp_shard x cp; use zero 2 or 3")
    elif g("grad_compression") not in (None, "none") or (g("diloco") or 0) > 0:
        yield (f"plan.cp={cp}: gradient compression and DiLoCo are not run with context "
               "parallelism yet; use grad_compression='none', diloco=0 or cp=1")
    elif model is not None and getattr(model, "position", "rope") != "rope":
        yield (f"plan.cp={cp}: model {model.name} has {model.position!r} position embeddings; "
               "context parallelism needs rotary (RoPE) positions; use cp=1")


def compile_runtime_problem(plan: Any) -> str | None:
    """Compiled layouts the runtime does not run (meshtron/parallel/compile.py runs the rest);
    one line, or None.

    Zero-bubble schedules split each stage's backward into an input-gradient pass
    (`retain_graph=True`) and a later weight-gradient pass (torch.distributed.pipelining
    `stage_backward_input` / `stage_backward_weight`, which walk the autograd graph between
    the stage's inputs and its parameters). A compiled block is one autograd node, and on
    torch 2.13: with AOT autograd's donated buffers the retained backward fails (RuntimeError
    "compiled with non-empty donated buffers ... retain_graph=False"); with donation off
    (`torch._functorch.config.donated_buffer=False`) it runs but the weight gradients come out
    wrong (parameters 4e-2 off the eager run after 3 steps, zb and zbv on pp=2, measured).
    Every other schedule matches eager to 1e-6 (tests/test_compile.py).

    Mixture-of-experts blocks compile with graph breaks (meshtron/parallel/compile.py: the
    routing reads token counts on the host) and match eager without expert parallelism; with
    ep > 1 dynamo's fake-tensor tracing of the experts' matmul meets their DTensor weights on
    the ep mesh next to plain activations and fails (measured, torch 2.13).

    Context parallelism: `meshtron train --plan cp=2 --compile` trained on losses 1e-3 to
    8e-2 off eager from the first forward whenever a micro-batch held more than one sequence
    (issue 28; the harness had only compiled micro-batches of one). Bisected on the block
    alone (RoPE, the K/V all-gather, the masked attention): the error vanished without RoPE
    and with a batch of one; turning off inductor's in-place buffers fixed `tiny` at seq 128
    but not `debug` under full recomputation, and replacing SDPA by plain matmuls fixed
    `debug` but not `tiny` (with or without in-place buffers): the miscompile moves with the
    graph rather than going away, so compiled CP is refused until a torch version compiles
    it right (eager CP matches one process, tests/test_cp_train.py).

    Selective recomputation under TP: compiling the checkpointed block (torchtitan's order)
    fails in AOT autograd ("expected all tensors_saved_with_vc_check to be Tensors", a
    DeviceMesh among them: DTensor redistributions inside a selective checkpoint); compiling
    inside the checkpoint runs, but the selective policy, which picks the ops to keep from the
    dispatched operators, no longer sees the compiled ones and the gradients come out wrong
    (1e-1 on the parameters, measured). Full and half recomputation under TP run with the
    checkpoint around the compiled block and match eager; selective without TP matches too."""
    if plan.compile and plan.tp > 1 and plan.recompute == "selective":
        return (f"plan.compile=true with plan.recompute='selective' and tp={plan.tp}: "
                "torch 2.13 cannot compile selective recomputation of tensor-parallel blocks "
                "correctly; use recompute full, half or none, or compile=false")
    if plan.compile and plan.pp > 1 and plan.schedule == "zb":
        return (f"plan.compile=true with plan.schedule='zb': zero-bubble's split backward "
                "(input then weight gradients) gives wrong weight gradients through compiled "
                "blocks on torch 2.13; use schedule 1f1b, interleaved or gpipe, or "
                "compile=false")
    if plan.compile and getattr(plan, "cp", 1) > 1:
        return (f"plan.compile=true with plan.cp={plan.cp}: torch 2.13's inductor miscompiles "
                "context-parallel blocks (losses 1e-3 to 8e-2 off eager from the first step "
                "with micro-batches of several sequences, measured); use cp=1 or "
                "compile=false")
    if plan.compile and getattr(plan, "ep", 1) > 1:
        return (f"plan.compile=true with plan.ep={plan.ep}: torch 2.13 fails to trace "
                "compiled mixture-of-experts blocks under expert parallelism (the experts' "
                "DTensor weights on the ep mesh meet plain tensors in the graph); use ep=1 or "
                "compile=false")
    return None
