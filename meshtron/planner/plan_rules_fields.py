"""The plan's rules on its own fields and between them (part of THE validity function,
plan_rules.plan_problems): allowed values, sizes, gradient compression / DiLoCo, and the
consistency of the layout's axes. The pipeline schedules' own limits are in
plan_rules_pipeline.py, the runtime's in plan_rules_runtime.py.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from meshtron.planner.plan_rules_pipeline import microbatch_problem, schedule_zero_problem

RECOMPUTE = ("none", "selective", "half", "full")
"""'half': every second block fully recomputed, the others keep everything (torchtitan's
activation_checkpoint mode = "selective" with selective_ac_option = "2": its apply_ac wraps
every block whose 1-based count is a multiple of 2; meshtron/parallel/recompute.py does the
same)."""
ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1f1b", "interleaved", "zb", "gpipe", "dualpipe")
"""Pipeline schedules (planner/pipeline.py costs them; parallel/pipeline.py runs all but
'dualpipe'). With virtual_stages v > 1: gpipe = looped BFS, 1f1b = interleaved 1F1B, zb with
v = 2 = ZBV. 'dualpipe' (DeepSeek's, planner/pipeline_dualpipe.py) is priced for DeepSeek's
stack only: v = 1 DualPipe, v = 2 DualPipeV (plan_rules_pipeline.schedule_problem)."""
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
                   "etp": None, "compile": False, "async_tp": False, "fp8_recipe": "rowwise",
                   "offload": "none", "offload_activations": False,
                   "pipeline_runs": 1}
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


# ---- the rules on the plan's fields -----------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def field_problems(k: Mapping[str, Any]) -> Iterator[str]:
    """Rules on the plan's own fields. `k` maps field names to values; a missing or None value
    is unknown and its rules are skipped (so partial knobs are checked by the same rules)."""
    g = k.get
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "virtual_stages",
                 "dp_replicate", "global_batch", "seq_len", "pipeline_runs"):
        v = g(name)
        if v is not None and (not _is_int(v) or v <= 0):
            yield f"plan.{name}={v!r}: must be a positive integer"
            return
    for name in ("model", "cluster"):  # what it was made for: read back as a path or preset
        v = g(name)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            yield (f"plan.{name}={v!r}: must be a non-empty string (the preset name or file "
                   "the plan was made for)")
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
    problem = ep_fold_problem(g("ep"), g("etp"), tp, dp, cp, g("dp_replicate"))
    if problem:
        yield problem
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


EP_FOLDS = {"megatron": "tp"}
"""Stacks (MemoryOptions.framework) whose code folds expert parallelism over the tensor ranks
too: Megatron-Core from 0.10.0 (NVIDIA/Megatron-LM commit 7f22e210cd, "MoE parallel folding",
November 2024; Liu et al. 2025, arXiv 2504.14960) builds the experts' own rank grid
(expert_tensor_parallel_size = etp, expert_model_parallel_size = ep, expert data parallel =
world / (pp * ep * etp), order "tp-ep-dp-pp": parallel_state.initialize_model_parallel) over
the same tp x cp x dp ranks of a pipeline stage as the dense grid. Every other stack folds ep
over the data (x context) ranks only (meshtron/parallel/mesh.py ExpertMeshes, torchtitan's
ParallelDims dp_shard x cp, DeepSpeed-MoE's expert groups from the data-parallel ranks)."""


def ep_fold_problem(ep, etp, tp, dp, cp, dp_replicate) -> str | None:
    """The ranks expert parallelism is folded over. Without `etp` (None: the stack's own expert
    tensor parallelism, tp in Megatron-Core, experts replicated over tp in meshtron): ep divides
    the data x context ranks dp/dp_replicate*cp. With `etp` (Megatron-Core's folding, EP_FOLDS):
    the experts' grid etp x ep x expert-dp covers a stage's tp x cp x dp ranks, so ep * etp
    divides tp*cp*dp (parallel_state.py: world % (etp * ep * pp) == 0)."""
    if ep is None or dp is None or (ep == 1 and etp is None):
        return None
    if etp is not None:
        ranks = (tp or 1) * (cp or 1) * dp
        if tp is not None and ranks % (ep * etp):
            return (f"plan.ep={ep} with plan.etp={etp}: ep*etp = {ep * etp} must divide the "
                    f"tensor x context x data ranks it is folded over, tp*cp*dp = {ranks}")
        return None
    shard = dp // (dp_replicate or 1) * (cp or 1)
    if ep > 1 and shard % ep:
        return (f"plan.ep={ep}: must divide the data x context ranks it is folded over, "
                f"dp/dp_replicate*cp = {shard} (stacks that fold ep over the tensor ranks "
                "too, megatron@2024 and megatron-bridge, take it with plan.etp: ep*etp divides tp*cp*dp)")
    return None


def ep_rule(framework: str | None) -> str:
    """'tp' where the stack folds ep over tp x cp x dp (EP_FOLDS), else 'data'."""
    return EP_FOLDS.get(framework or "", "data")


def ep_stack_problem(rule: str | None, etp: int | None, tp: int | None = None,
                     sp: bool | None = None, moe: bool = False) -> str | None:
    """A plan with `etp` on a stack that does not fold ep over the tensor ranks (`rule`:
    ep_rule(MemoryOptions.framework); None: no stack named, as a Plan read alone); on the
    folding stack, a mixture of experts under tp > 1 without sequence parallelism, which
    Megatron-Core refuses to train (moe_layer.py MoELayer.forward: "performance may degrade
    if MoE and tensor parallelism are enabled without also enabling sequence parallelism",
    a ValueError; the folded dispatcher's price assumes each tp rank's own T/tp tokens)."""
    if rule == "tp" and moe and sp is False and (tp or 1) > 1:
        return (f"plan.sp=false with plan.tp={tp}: Megatron-Core trains a mixture of experts "
                "under tensor parallelism only with sequence parallelism (moe_layer.py); use "
                "sp=true")
    if etp is not None and rule == "data":
        return (f"plan.etp={etp}: the priced stack folds expert parallelism over the data x "
                "context ranks only and has no expert tensor parallelism of its own; leave etp "
                "unset (megatron@2024 and megatron-bridge take it)")
    return None


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

