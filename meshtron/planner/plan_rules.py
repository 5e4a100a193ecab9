"""The plan's validity rules: one place, used by Plan, Knobs, the search and the runtime.

`plan_problems` is THE validity function (meshtron/planner/plan.py re-exports every name here):
rules on the plan's own fields, between the fields, against the world size and against the
model's shapes, and the runtime's own limits.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from meshtron.errors import UserError

RECOMPUTE = ("none", "selective", "half", "full")
"""'half': every second block fully recomputed, the others keep everything (torchtitan's
activation_checkpoint mode = "selective" with selective_ac_option = "2": its apply_ac wraps
every block whose 1-based count is a multiple of 2; meshtron/parallel/recompute.py does the
same)."""
ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1f1b", "interleaved", "zb", "gpipe")
"""Pipeline schedules (planner/pipeline.py costs them; parallel/pipeline.py runs them). With
virtual_stages v > 1: gpipe = looped BFS, 1f1b = interleaved 1F1B, zb with v = 2 = ZBV."""
DTYPES = ("bf16", "fp32", "fp8")
"""fp8: FP8 GEMMs in the blocks (the Linears planner/fp8.py's rule picks), bf16 elsewhere; the
runtime trains it with torchao float8 (meshtron/parallel/fp8.py, emulated on CPU)."""
REDUCE_DTYPES = ("fp32", "bf16")
ATTENTION = ("flash", "unfused")
_DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}
KNOBS = ("tp", "pp", "dp", "zero", "micro_batch", "recompute", "sp", "schedule",
         "virtual_stages", "stage_layers", "dp_replicate", "dtype", "attention")
"""The fields that say how to run; the rest of a Plan says what it was made for."""
CONTEXT = ("model", "cluster", "global_batch", "seq_len", "predicted")
COMM_DEFAULTS = {"grad_compression": "none", "grad_compression_block": 256,
                 "compress_scope": "all", "ranks_per_node": None, "diloco": 0,
                 "outer_lr": None, "outer_momentum": None}
"""Knobs of the data-parallel traffic (meshtron/compress/): how gradients (or DiLoCo's outer
gradients) travel. Written to plan files only when they differ from these defaults."""
LAYOUT_DEFAULTS = {"cp": 1, "reduce_dtype": "fp32", "accumulate_unsharded": False, "ep": 1,
                   "compile": False, "async_tp": False, "fp8_recipe": "rowwise",
                   "offload": "none", "offload_activations": False}
"""Shared layout fields written to plan files only when they differ from these defaults."""
COMPRESSIONS = ("none", "bf16", "int8")
FP8_RECIPES = ("rowwise", "tensorwise")
"""torchao float8 scaling recipes (Float8LinearConfig.from_recipe_name)."""
OFFLOADS = ("none", "optimizer", "full")
"""Host offload: 'optimizer' = ZeRO-Offload (Ren et al. 2021), 'full' = also the parameters
(FSDP2 CPUOffloadPolicy, ZeRO-Infinity)."""
COMPRESS_SCOPES = ("all", "inter_node")


MAX_GLOBAL_BATCH = 2**24
"""Sequences per step above which a batch is taken for a typo (published pre-training runs use
at most a few thousand: Llama 3 405B 2,048 x 8,192 tokens)."""
MAX_SEQ_LEN = 2**24
"""Tokens per sequence above which a length is taken for a typo."""
MAX_TOKENS_PER_STEP = 2**31
"""global_batch * seq_len above which a step is taken for a typo (~2.1B tokens, over 100x the
largest published batches of ~16M tokens)."""



# ---- the rules: one place, used by Plan, Knobs, the search and the runtime -------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def field_problems(k: Mapping[str, Any]) -> Iterator[str]:
    """Rules on the plan's own fields. `k` maps field names to values; a missing or None value
    is unknown and its rules are skipped (so partial knobs are checked by the same rules)."""
    g = k.get
    for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "virtual_stages", "dp_replicate",
                 "global_batch", "seq_len"):
        v = g(name)
        if v is not None and (not _is_int(v) or v <= 0):
            yield f"plan.{name}={v!r}: must be a positive integer"
            return
    yield from _size_problems(k)
    if g("zero") is not None and (not _is_int(g("zero")) or g("zero") not in ZERO_STAGES):
        yield f"plan.zero={g('zero')!r}: allowed values are 0, 1, 2, 3"
    if g("recompute") is not None and g("recompute") not in RECOMPUTE:
        yield f"plan.recompute={g('recompute')!r}: allowed values are {', '.join(RECOMPUTE)}"
    if g("sp") is not None and not isinstance(g("sp"), bool):
        yield f"plan.sp={g('sp')!r}: must be true or false"
    if g("schedule") is not None and g("schedule") not in SCHEDULES:
        yield f"plan.schedule={g('schedule')!r}: allowed values are {', '.join(SCHEDULES)}"
    if g("dtype") is not None and g("dtype") not in DTYPES:
        yield f"plan.dtype={g('dtype')!r}: allowed values are {', '.join(DTYPES)}"
    if g("reduce_dtype") is not None and g("reduce_dtype") not in REDUCE_DTYPES:
        yield (f"plan.reduce_dtype={g('reduce_dtype')!r}: allowed values are "
               f"{', '.join(REDUCE_DTYPES)}")
    au = g("accumulate_unsharded")
    if au is not None and not isinstance(au, bool):
        yield f"plan.accumulate_unsharded={au!r}: must be true or false"
    elif au and g("zero") is not None and g("zero") < 2:
        yield (f"plan.accumulate_unsharded=true with plan.zero={g('zero')}: only ZeRO-2/3 "
               "reduce-scatter gradients per micro-batch (ZeRO-0/1 already reduce once per step)")
    for name in ("compile", "async_tp", "offload_activations"):
        if g(name) is not None and not isinstance(g(name), bool):
            yield f"plan.{name}={g(name)!r}: must be true or false"
    if g("fp8_recipe") is not None and g("fp8_recipe") not in FP8_RECIPES:
        yield (f"plan.fp8_recipe={g('fp8_recipe')!r}: allowed values are "
               f"{', '.join(FP8_RECIPES)}")
    if g("offload") is not None and g("offload") not in OFFLOADS:
        yield f"plan.offload={g('offload')!r}: allowed values are {', '.join(OFFLOADS)}"
    if g("attention") is not None and g("attention") not in ATTENTION:
        yield f"plan.attention={g('attention')!r}: allowed values are {', '.join(ATTENTION)}"
    yield from _consistency(k)
    yield from comm_problems(k)


def comm_problems(k: Mapping[str, Any]) -> Iterator[str]:
    """Rules on gradient compression and DiLoCo (meshtron/compress/): what the runtime runs,
    refused here rather than ignored there."""
    g = k.get
    mode, block, scope = g("grad_compression"), g("grad_compression_block"), g("compress_scope")
    h, rpn, zero, dp, rep = g("diloco"), g("ranks_per_node"), g("zero"), g("dp"), g("dp_replicate")
    if mode is not None and mode not in COMPRESSIONS:
        yield f"plan.grad_compression={mode!r}: allowed values are {', '.join(COMPRESSIONS)}"
    elif block is not None and (not _is_int(block) or not 4 <= block <= 2**20 or block % 4):
        yield (f"plan.grad_compression_block={block!r}: must be a multiple of 4 from 4 to "
               f"{2**20} (elements per int8 block)")
    elif scope is not None and scope not in COMPRESS_SCOPES:
        yield f"plan.compress_scope={scope!r}: allowed values are {', '.join(COMPRESS_SCOPES)}"
    elif rpn is not None and (not _is_int(rpn) or rpn <= 0):
        yield f"plan.ranks_per_node={rpn!r}: must be a positive integer"
    elif h is not None and (not _is_int(h) or h < 0):
        yield f"plan.diloco={h!r}: must be an integer >= 0 (inner steps; 0 = off)"
    elif g("outer_lr") is not None and (not isinstance(g("outer_lr"), (int, float))
                                        or isinstance(g("outer_lr"), bool)
                                        or not 0 < g("outer_lr") <= 10):
        yield f"plan.outer_lr={g('outer_lr')!r}: must be a number in (0, 10]"
    elif g("outer_momentum") is not None and (
            not isinstance(g("outer_momentum"), (int, float))
            or isinstance(g("outer_momentum"), bool) or not 0 <= g("outer_momentum") < 1):
        yield f"plan.outer_momentum={g('outer_momentum')!r}: must be a number in [0, 1)"
    else:
        yield from _comm_layout_problems(mode, scope, h or 0, zero, dp, rep)


def _comm_layout_problems(mode, scope, h: int, zero, dp, rep) -> Iterator[str]:
    if scope == "inter_node" and mode in (None, "none"):
        yield "plan.compress_scope='inter_node': needs plan.grad_compression bf16 or int8"
    elif (mode not in (None, "none") or h) and dp == 1:
        what = f"plan.diloco={h}" if h else f"plan.grad_compression={mode!r}"
        yield f"{what}: needs plan.dp > 1 (it acts on the data-parallel traffic)"
    elif h and zero == 1:
        yield (f"plan.diloco={h} with plan.zero=1: DiLoCo replicas step alone, a ZeRO-1 "
               "optimizer is shared across them; use zero 0, or zero 2/3 with dp_replicate > 1")
    elif h and zero in (2, 3) and rep == 1:
        yield (f"plan.diloco={h} with plan.zero={zero}: the replicas are the dp_replicate axis; "
               "set plan.dp_replicate > 1 (ZeRO shards inside a replica) or use zero 0")
    elif not h and mode not in (None, "none") and zero in (2, 3) and rep not in (None, 1):
        yield (f"plan.grad_compression={mode!r} with plan.dp_replicate={rep}: HSDP's replica "
               "all-reduce is FSDP2's own and cannot be compressed; use dp_replicate=1")


def _size_problems(k: Mapping[str, Any]) -> Iterator[str]:
    b, s = k.get("global_batch"), k.get("seq_len")
    if b is not None and b > MAX_GLOBAL_BATCH:
        yield (f"plan.global_batch={b}: more than {MAX_GLOBAL_BATCH:,} sequences per step; "
               "published runs use at most a few thousand")
    elif s is not None and s > MAX_SEQ_LEN:
        yield f"plan.seq_len={s}: more than {MAX_SEQ_LEN:,} tokens per sequence"
    elif b is not None and s is not None and b * s > MAX_TOKENS_PER_STEP:
        yield (f"plan.global_batch={b} x seq_len={s} = {b * s:,} tokens per step: more than "
               f"{MAX_TOKENS_PER_STEP:,}; published runs use at most ~16M")


def _consistency(k: Mapping[str, Any]) -> Iterator[str]:
    g = k.get
    tp, pp, dp, v = g("tp"), g("pp"), g("dp"), g("virtual_stages")
    if g("sp") and tp == 1:
        yield "plan.sp=true: sequence parallelism needs plan.tp > 1"
    if pp == 1 and g("schedule") is not None:
        yield f"plan.schedule={g('schedule')!r}: needs plan.pp > 1 (pp=1 has no pipeline)"
    if pp == 1 and v is not None and v != 1:
        yield f"plan.virtual_stages={v}: needs plan.pp > 1"
    cp, seq = g("cp"), g("seq_len")
    if cp is not None and cp > 1 and seq is not None and seq % (2 * cp):
        yield (f"plan.cp={cp}: seq_len={seq} must be divisible by 2*cp={2 * cp} (each context "
               "rank holds two chunks of every sequence, for a balanced causal mask)")
    if g("async_tp") and tp == 1:
        yield "plan.async_tp=true: asynchronous tensor parallelism needs plan.tp > 1"
    elif g("async_tp") and g("compile") is False:
        yield ("plan.async_tp=true: torch runs asynchronous TP as a torch.compile pass; "
               "needs plan.compile=true")
    elif g("async_tp") and g("sp") is False:
        yield ("plan.async_tp=true: torch's micro-pipelining fuses the sequence-parallel "
               "all-gather / reduce-scatter with their matmuls (no all-reduce form); needs "
               "plan.sp=true")
    ep = g("ep")
    if ep is not None and ep > 1 and dp is not None:
        shard = dp // (g("dp_replicate") or 1) * (cp or 1)
        if shard % ep:
            yield (f"plan.ep={ep}: must divide the data x context ranks it is folded over, "
                   f"dp/dp_replicate*cp = {shard}")
    r, zero = g("dp_replicate"), g("zero")
    if r is not None and r > 1:
        if zero is not None and zero < 2:
            yield (f"plan.dp_replicate={r}: replicated groups of sharded data parallelism (HSDP) "
                   "need plan.zero 2 or 3")
        elif dp is not None and dp % r:
            yield f"plan.dp_replicate={r}: must divide plan.dp={dp}"
    problem = schedule_zero_problem(g("schedule"), zero, pp)
    if problem:
        yield problem
    yield from _stage_layer_problems(k)
    b, mb = g("global_batch"), g("micro_batch")
    if b is not None and mb is not None and dp is None and b % mb:
        yield f"plan.micro_batch={mb}: must divide plan.global_batch={b}"
    elif b is not None and dp is not None and b % dp:
        yield (f"plan.global_batch={b} (the global batch, sequences per step): must be "
               f"divisible by plan.dp={dp}, every data-parallel rank takes global_batch/dp whole "
               f"sequences; use a multiple of {dp}")
    elif b is not None and dp is not None and b % (dp * (mb or 1)):
        yield (f"plan.micro_batch={mb}: must divide the per-replica batch global_batch/dp = "
               f"{b}/{dp} = {b // dp}")
    elif b is not None and pp is not None and mb is not None and dp is not None:
        problem = microbatch_problem(g("schedule"), pp, v or 1, b // (dp * mb))
        if problem:
            yield problem


def _stage_layer_problems(k: Mapping[str, Any]) -> Iterator[str]:
    sl = k.get("stage_layers")
    if not sl:
        return
    pp, v = k.get("pp"), k.get("virtual_stages") or 1
    if any(not _is_int(c) or c < 0 for c in sl):
        yield f"plan.stage_layers={list(sl)}: entries must be integers >= 0"
        return
    if pp is not None and len(sl) != pp * v:
        yield (f"plan.stage_layers has {len(sl)} entries: must be "
               f"pp*virtual_stages={pp * v}")
        return
    # The first and last stages carry the embedding and the head, so they may hold no layers.
    for i, c in enumerate(sl):
        if c == 0 and 0 < i < len(sl) - 1:
            yield f"plan.stage_layers={list(sl)}: middle stage {i} has no layers"
            return


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
    if runtime and pp is not None and pp > 1 and getattr(model, "tied_embeddings", False):
        yield (f"plan.pp={pp}: model {model.name} ties its input and output embeddings, which "
               "the runtime cannot split across pipeline stages")
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
    elif pp is not None and pp * v > model.layers:
        name = f"plan.pp={pp}" if v == 1 else f"plan.pp*virtual_stages={pp}*{v}={pp * v}"
        yield f"{name}: more pipeline stages than model layers ({model.layers})"


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
                             "TrainSchedule only, one stage per rank (runtime/pipe/schedule.py)")}
"""The schedules each stack's pipeline engine runs, by its split rule (memory_options
PIPELINE_SPLITS; 'any': every schedule the planner prices, torch.distributed.pipelining's)."""


def schedule_problem(rule: str | None, schedule: str | None, pp: int | None,
                     v: int | None, m: int | None = None) -> str | None:
    """A schedule the priced stack's pipeline engine does not run, one line, or None; with
    `m` (micro-batches per step) also Megatron's limits on its interleaved schedule: Megatron-LM
    (2021 to Megatron-Core 0.9, schedules.py) raises unless pp divides m; Megatron-Core 0.10+
    groups microbatch_group_size_per_vp_stage micro-batches, which must lie in [pp, m], so m
    >= pp."""
    if rule not in STACK_SCHEDULES or schedule is None or (pp or 1) <= 1:
        return None
    allowed, why = STACK_SCHEDULES[rule]
    if schedule not in allowed:
        return (f"plan.schedule={schedule!r}: {why}; allowed: {', '.join(allowed)}")
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
    for name, val in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        if val is not None and world_size % val:
            return f"plan.{name}={val}: must divide the world size {world_size}"
    fixed = (tp or 1) * (pp or 1) * (dp or 1) * cp
    if world_size % fixed:
        return (f"plan tp*cp*pp*dp={fixed} (fixed part): must divide the world size "
                f"{world_size}")
    return None


def plan_problems(k: Mapping[str, Any], world_size: int | None = None,
                  model: Any = None, runtime: bool = True, split: str | None = None,
                  engine: str | None = None) -> list[str]:
    """THE validity function: every reason the (possibly partial) plan `k` cannot run, checked
    against `world_size` and `model` (a ModelSpec) when given. Empty when valid. `runtime`:
    include meshtron's runtime limits (False when the planner prices another framework);
    `split`: the priced stack's layer-to-stage rule (memory_options.PIPELINE_SPLITS);
    `engine`: the rule naming the stack's pipeline engine, whose schedules are checked, when
    a pinned layout is priced on another split (search_space.SplitFallback; default `split`)."""
    out = list(field_problems(k))
    g = k.get
    sizes = (g("global_batch"), g("dp"), g("micro_batch"))
    m = (sizes[0] // (sizes[1] * sizes[2])
         if all(_is_int(x) and x > 0 for x in sizes) else None)
    problem = schedule_problem(split if engine is None else engine, g("schedule"), g("pp"),
                               g("virtual_stages"), m)
    if problem:
        out.append(problem)
    if world_size is not None:
        w = world_problem(k, world_size)
        if w:
            out.append(w)
    if model is not None:
        out.extend(model_problems(k, model, runtime, split))
    if runtime:
        out.extend(cp_runtime_problems(k, model))
        out.extend(ep_runtime_problems(k))
    return out


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


def check(k: Mapping[str, Any], world_size: int | None = None, model: Any = None,
          runtime: bool = True, split: str | None = None) -> None:
    """Raise UserError with the first of `plan_problems`."""
    problems = plan_problems(k, world_size, model, runtime, split)
    if problems:
        raise UserError(problems[0])


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
