"""The pipeline's rules (part of THE validity function, plan_rules.plan_problems): the
schedules' limits on micro-batches, ZeRO-3 with zero bubble, and each priced stack's own
layer-to-stage split and schedules (memory_options.PIPELINE_SPLITS). Imports nothing of
meshtron: pipeline_split.py and the field rules build on it.
"""

from __future__ import annotations

def schedule_zero_problem(schedule: str | None, zero: int | None, pp: int | None) -> str | None:
    """The runtime's refusal of zero-bubble schedules with ZeRO-3. Measured (../shared/notes):
    they drift silently from the reference with FSDP2 reshard_after_forward=True on torch 2.13."""
    if schedule == "zb" and zero == 3 and (pp is None or pp > 1):
        return ("plan.schedule='zb' with plan.zero=3: zero-bubble schedules give wrong gradients "
                "with FSDP2 resharding after forward on torch 2.13; use zero 0-2 or another "
                "schedule")
    return None


def microbatch_problem(schedule: str | None, pp: int, v: int, m: int) -> str | None:
    """The pipeline schedules' own limits on the micro-batches per step `m`, as
    torch.distributed.pipelining 2.13 enforces them: single-stage 1F1B needs one micro-batch
    per stage in flight; the looped schedules (interleaved 1F1B, and zero bubble other than the
    V of two stages) run micro-batches in rounds of pp and need m divisible by the number of
    rounds, max(1, m // pp). GPipe, looped BFS and ZBV take any m."""
    if pp == 1 or schedule is None:
        return None
    if schedule == "1f1b" and v == 1 and m < pp:
        return (f"plan.micro_batch: {m} micro-batches per step, schedule '1f1b' needs at least "
                f"pp={pp}")
    looped = schedule == "interleaved" or (schedule == "1f1b" and v > 1) or \
        (schedule == "zb" and v != 2)
    rounds = max(1, m // pp)
    if looped and m % rounds:
        return (f"plan.micro_batch: {m} micro-batches per step, schedule {schedule!r} with "
                f"{v} stage(s) per rank runs them in rounds of pp={pp}: needs fewer than "
                f"{2 * pp} or a multiple of {rounds}")
    return None



_MEGATRON_WHY = {
    "megatron-even": "Megatron-LM builds num_layers // pp layers per stage and "
                     "num_layers // (pp*virtual_stages) per chunk (megatron/arguments.py asserts "
                     "the divisions)",
    "megatron-ends": "Megatron-Core builds equal chunks; only --decoder-first/last-pipeline-"
                     "num-layers (each a multiple of virtual_stages) or "
                     "account_for_embedding/loss_in_pipeline_split (num_layers + 1 or 2 "
                     "divisible by pp*virtual_stages) make the end stages differ "
                     "(transformer_config.py)"}


def megatron_account_for(layers: int, pp: int, v: int) -> list[int]:
    """Layers counted for the embedding and loss (1 or 2) with which Megatron-Core's
    account_for_embedding/loss_in_pipeline_split can split `layers` (empty: none). A chunk of
    one counted layer is allowed: the very first (last) then builds none and holds only the
    embedding (loss) (transformer_block.get_num_layers_to_build asserts >= 0 layers)."""
    return [e for e in (1, 2) if (layers + e) % (pp * v) == 0 and (layers + e) // (pp * v) >= 1]


def most_chunks(rule: str | None, layers: int, pp: int) -> int:
    """The most virtual stages per pipeline rank the stack's split can give `layers` blocks:
    one block per chunk, or with Megatron-Core's account_for_embedding/loss_in_pipeline_split
    ('megatron-ends') up to two more chunks than blocks, the very first and very last holding
    only the embedding and the loss (`megatron_account_for`)."""
    return (layers + 2) // pp if rule == "megatron-ends" else layers // pp


def split_problem(rule: str | None, layers: int, pp: int, v: int = 1,
                  stage_layers: list[int] | None = None) -> str | None:
    """The stack's own limits on assigning `layers` to pp stages of v chunks (`rule`:
    memory_options.PIPELINE_SPLITS), one line, or None. Megatron-LM (2021 to Megatron-Core
    0.8, 'megatron-even') asserts num_layers % pp == 0 and, interleaved, that the layers per
    stage divide by v; Megatron-Core 0.9-0.12 ('megatron-ends': ADLR/megatron-lm!1881
    2024-09 --decoder-first/last-pipeline-num-layers; !1961 2025-02 uneven virtual stages and
    account_for_embedding/loss_in_pipeline_split) sets the end stages apart, the middle ones
    still equal. So 'megatron-ends' expresses L layers iff v divides L and L >= pp*v, or
    L + 1 or L + 2 divides by pp*v. Other rules express any split (torchtitan's split points;
    DeepSpeed's partition is computed, pipeline_split.py). Megatron-Core 0.13+'s
    pipeline_model_parallel_layout places any layers: `pipeline_split = "any"`."""
    if pp > 1 and rule == "deepspeed-transformer" and not stage_layers and layers >= pp:
        per = -(-layers // pp)  # _lprobe fills stages with ceil(L/pp) blocks from the first
        if -(-layers // per) < pp:
            return (f"plan.pp={pp}: DeepSpeed's balanced partition of {layers} blocks gives "
                    f"the first stages {per} each and leaves the last without blocks "
                    "(runtime/utils.py partition_balanced)")
    if pp <= 1 or rule not in _MEGATRON_WHY:
        return None
    name = f"plan.pp={pp}" if v == 1 else f"plan.pp={pp} with virtual_stages={v}"
    if stage_layers:
        if not _megatron_expresses(rule, pp, v, list(stage_layers)):
            return (f"plan.stage_layers={list(stage_layers)}: not a split Megatron can "
                    f"express: {_MEGATRON_WHY[rule]}")
        return None
    if rule == "megatron-even" and layers % (pp * v):
        return (f"{name}: the model's {layers} layers are not divisible by pp*virtual_stages="
                f"{pp * v}: {_MEGATRON_WHY[rule]}")
    if rule == "megatron-ends" and (layers % v or layers < pp * v) and \
            not megatron_account_for(layers, pp, v):
        return f"{name}: the model's {layers} layers cannot be split: {_MEGATRON_WHY[rule]}"
    return None


def _megatron_expresses(rule: str, pp: int, v: int, sl: list[int]) -> bool:
    """Whether chunk counts `sl` (virtual stage order) are one of Megatron's splits."""
    per = [[sl[c * pp + d] for c in range(v)] for d in range(pp)]
    devices = [sum(c) for c in per]
    equal_chunks = all(len(set(c)) == 1 for c in per)
    if rule == "megatron-even":
        return equal_chunks and len(set(devices)) == 1
    if equal_chunks and len(set(devices[1:-1])) <= 1 and min(devices) > 0:
        return True
    # account_for_embedding/loss: every chunk c, the very first and very last maybe c - 1
    c = max(sl)
    inner = sl[1:-1]
    return all(k == c for k in inner) and sl[0] in (c - 1, c) and sl[-1] in (c - 1, c)


STACK_SCHEDULES = {
    "megatron-even": (("1f1b", "interleaved"), "Megatron-LM runs 1F1B and its interleaved "
                      "schedule only (megatron/core/pipeline_parallel/schedules.py "
                      "get_forward_backward_func)"),
    "megatron-ends": (("1f1b", "interleaved"), "Megatron-Core runs 1F1B and its interleaved "
                      "schedule only (megatron/core/pipeline_parallel/schedules.py "
                      "get_forward_backward_func)"),
    "deepspeed-transformer": (("1f1b",), "DeepSpeed's pipeline engine runs its 1F1B "
                              "TrainSchedule only, one stage per rank (runtime/pipe/schedule.py)"),
    "deepspeed-parameters": (("1f1b",), "DeepSpeed's pipeline engine runs its 1F1B "
                             "TrainSchedule only, one stage per rank (runtime/pipe/schedule.py)"),
    "dualpipe": (("dualpipe",), "DeepSeek's stack runs DualPipe (deepseek-ai/DualPipe "
                 "dualpipe.py; DualPipeV with virtual_stages=2, dualpipev.py)")}
"""The schedules each stack's pipeline engine runs, by its split rule (memory_options
PIPELINE_SPLITS; 'any': every schedule the planner prices, torch.distributed.pipelining's)."""


def schedule_problem(rule: str | None, schedule: str | None, pp: int | None,
                     v: int | None, m: int | None = None) -> str | None:
    """A schedule the priced stack's pipeline engine does not run, one line, or None; with
    `m` (micro-batches per step) also Megatron's limits on its interleaved schedule: Megatron-LM
    (2021 to Megatron-Core 0.9, schedules.py) raises unless pp divides m; Megatron-Core 0.10+
    groups microbatch_group_size_per_vp_stage micro-batches, which must lie in [pp, m], so m
    >= pp."""
    if schedule == "dualpipe" and rule is not None and rule != "dualpipe" and (pp or 1) > 1:
        return dualpipe_elsewhere()
    if rule not in STACK_SCHEDULES or schedule is None or (pp or 1) <= 1:
        return None
    allowed, why = STACK_SCHEDULES[rule]
    if schedule not in allowed:
        return (f"plan.schedule={schedule!r}: {why}; allowed: {', '.join(allowed)}")
    if rule == "dualpipe":
        return dualpipe_problem(pp, v or 1, m)
    if (v or 1) > 1 and "interleaved" not in allowed:
        return f"plan.virtual_stages={v}: {why}; use virtual_stages=1"
    looped = schedule == "interleaved" or (v or 1) > 1
    if looped and m is not None and rule == "megatron-even" and m % pp:
        return (f"plan.micro_batch: {m} micro-batches per step, Megatron-LM's interleaved "
                f"schedule needs a multiple of pp={pp} (schedules.py)")
    if looped and m is not None and rule == "megatron-ends" and m < pp:
        return (f"plan.micro_batch: {m} micro-batches per step, Megatron-Core's interleaved "
                f"schedule needs at least pp={pp} (microbatch_group_size_per_vp_stage in "
                "[pp, m], schedules.py)")
    return None


ONE_SCHEDULE_PER_STEP = {
    "megatron-even": "Megatron-LM runs one schedule of all global/(dp*micro_batch) "
                     "micro-batches per step (schedules.py get_forward_backward_func, "
                     "num_microbatches)",
    "megatron-ends": "Megatron-Core runs one schedule of all global/(dp*micro_batch) "
                     "micro-batches per step (schedules.py get_forward_backward_func, "
                     "num_microbatches)",
    "deepspeed-transformer": "DeepSpeed's pipeline engine runs one TrainSchedule of all "
                             "gradient_accumulation_steps micro-batches per step "
                             "(runtime/pipe/engine.py train_batch)",
    "deepspeed-parameters": "DeepSpeed's pipeline engine runs one TrainSchedule of all "
                            "gradient_accumulation_steps micro-batches per step "
                            "(runtime/pipe/engine.py train_batch)",
    "dualpipe": "DeepSeek's DualPipe runs all of a step's chunks in one schedule (dualpipe.py "
                "step)"}
"""Stacks whose engine runs one pipeline schedule per optimizer step (plan.pipeline_runs = 1),
by split rule; the rest run torch.distributed.pipelining, whose callers (torchtitan's
trainer.py, NeMo AutoModel's train_ft.py) may call schedule.step several times per step."""


RUNS_STACKS = {
    "torchtitan@2025": "torchtitan/trainer.py: gradient_accumulation_steps calls of "
                       "pp_schedule.step (since pytorch/torchtitan#1238, June 2025)",
    "nemo-automodel@2025": "recipes/llm/train_ft.py _run_train_optim_step: one schedule.step "
                           "per local batch, GA of them"}
"""The priced stacks whose trainer calls its pipeline schedule several times per optimizer
step (plan.pipeline_runs > 1), with where; meshtron's runtime refuses it in its own words
(plan_rules_runtime.schedule_runtime_problem)."""


def runs_problem(rule: str | None, runs: int | None, schedule: str | None, pp: int | None,
                 v: int | None, m: int | None, stack: str | None = None) -> str | None:
    """plan.pipeline_runs > 1 (the step's m micro-batches in `runs` schedule calls of m/runs):
    needs a pipeline, a stack that calls its schedule several times per step (`rule`: its
    split rule, ONE_SCHEDULE_PER_STEP; `stack`: 'name@era', RUNS_STACKS; None: not named), a
    count that divides m, and m/runs micro-batches per call within torch's own limits
    (`microbatch_problem`: single-stage 1F1B needs m/runs >= pp). One line or None."""
    if not isinstance(runs, int) or isinstance(runs, bool) or runs <= 1:
        return None  # 1, unset, or not a positive integer (field_problems says so)
    if pp is not None and pp <= 1:
        return (f"plan.pipeline_runs={runs}: needs a pipeline (pp > 1); without one every "
                "micro-batch is its own forward and backward")
    if schedule == "dualpipe" or rule in ONE_SCHEDULE_PER_STEP:
        why = ONE_SCHEDULE_PER_STEP.get(rule, ONE_SCHEDULE_PER_STEP["dualpipe"])
        return f"plan.pipeline_runs={runs}: {why}; use pipeline_runs=1"
    if stack is not None and stack not in RUNS_STACKS and not stack.startswith("meshtron@"):
        return (f"plan.pipeline_runs={runs}: {stack} calls its pipeline schedule once per "
                f"optimizer step (several calls: {', '.join(RUNS_STACKS)}); use "
                "pipeline_runs=1")
    if m is None or pp is None:
        return None
    if m % runs:
        return (f"plan.pipeline_runs={runs}: must divide the {m} micro-batches per step "
                "(each schedule call runs m / pipeline_runs of them)")
    problem = microbatch_problem(schedule, pp, v or 1, m // runs)
    if problem:
        return (f"plan.pipeline_runs={runs}: {m} / {runs} = {m // runs} micro-batches per "
                f"schedule call, but {problem.split(', ', 1)[1]} (torch.distributed.pipelining)")
    return None


def dualpipe_elsewhere() -> str:
    """The one line refusing DualPipe outside DeepSeek's stack: the runtime's
    (plan_rules_runtime.schedule_runtime_problem) and another stack's (`schedule_problem`)."""
    return ("plan.schedule='dualpipe': DeepSeek's DualPipe runs only in DeepSeek's own stack "
            "(priced with memory.pipeline_split='dualpipe'); meshtron's runtime and the other "
            "stacks run 1f1b, interleaved, zb, gpipe")


def dualpipe_problem(pp: int, v: int, m: int | None) -> str | None:
    """DualPipe's own asserts (deepseek-ai/DualPipe at 3da1bbe): dualpipe.py (virtual_stages 1)
    needs an even number of ranks and `num_chunks % 2 == 0 and num_chunks >= num_ranks * 2`;
    dualpipev.py (the V, virtual_stages 2) `num_chunks >= num_ranks * 2`. One line or None."""
    if v not in (1, 2):
        return (f"plan.virtual_stages={v}: DualPipe holds two stages per rank, DualPipeV two "
                "chunks of a V (deepseek-ai/DualPipe); use virtual_stages 1 or 2")
    if v == 1 and pp % 2:
        return (f"plan.pp={pp}: DualPipe needs an even number of pipeline ranks "
                "(deepseek-ai/DualPipe dualpipe.py asserts num_ranks % 2 == 0)")
    if v == 1 and pp == 2:
        # pipeline_dualpipe.fold prices DualPipe as the V it is per rank on pp/2 ranks: at
        # pp 2 that is one rank holding both stages, no pipeline, which no Plan describes
        return ("plan.pp=2: DualPipe on two ranks puts both stages on each rank (the whole "
                "model twice, no pipeline); the planner prices DualPipe from pp=4 on; use "
                "pp >= 4, or DualPipeV (virtual_stages 2, schedule dualpipev) at pp=2")
    if m is not None and (m < 2 * pp or (v == 1 and m % 2)):
        even = "an even number, " if v == 1 else ""
        return (f"plan.micro_batch: {m} micro-batches per step, DualPipe needs {even}at least "
                f"2*pp={2 * pp} (deepseek-ai/DualPipe asserts num_chunks >= num_ranks * 2)")
    return None
