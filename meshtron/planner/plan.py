"""The one plan type (`Plan`), its one validity function (`plan_problems`), and fixed knobs.

A `Plan` is the contract between the planner (which costs it), `meshtron train` (which runs it)
and the Python API (`meshtron.build_mesh` / `meshtron.parallelize`). It is torch-free, frozen and
validated on construction (field rules); `Plan.validate(world_size, model)` adds the rules that
need the world size or the model's shapes, and the runtime's own limits. Both go through
`plan_problems`, the single list of rules, so planner and runtime always give the same verdict.

Plan TOML, format "meshtron-plan/2" (every key at top level except the optional [predicted]
table; all sizes in sequences or layers, not tokens; keys whose value is "none" are omitted,
TOML having no null)::

    format = "meshtron-plan/2"
    model = "llama3-70b"          # preset name or path the plan was made for (optional)
    cluster = "dgx-h100:16"       # preset or cluster file it was made for (optional)
    gpus = 128                    # = tp * pp * dp (written for reading; checked on load)
    global_batch = 1024           # sequences per optimizer step (optional for the API)
    seq_len = 8192                # tokens per sequence (optional for the API)
    tp = 8                        # tensor-parallel degree
    pp = 4                        # pipeline stages
    dp = 4                        # data-parallel degree
    dp_replicate = 1              # with zero 2/3: replicate over this many groups (HSDP)
    zero = 1                      # ZeRO stage 0..3 over the data-parallel group
    micro_batch = 1               # sequences per micro-batch per replica
    num_microbatches = 256        # = global_batch / (dp * micro_batch), for convenience
    recompute = "selective"       # "none" | "selective" | "full"
    sp = true                     # sequence parallelism (needs tp > 1)
    schedule = "interleaved"      # "1f1b" | "interleaved" | "zb" | "gpipe"; absent when pp = 1
    virtual_stages = 2            # model chunks per GPU stage
    stage_layers = [10, 10, ...]  # layers per (virtual) stage in pipeline order, length
                                  # pp * virtual_stages (empty: even split); virtual stage j
                                  # lives on GPU stage j % pp (zb with 2: a V); the embedding
                                  # is on the first, the LM head on the last
    dtype = "bf16"                # the run's precision: "bf16" (mixed) | "fp32"
    attention = "flash"           # kernel the prediction assumed: "flash" | "unfused"
    grad_compression = "int8"     # data-parallel traffic: "none" | "bf16" | "int8" (written
                                  # only when not default, like the other keys below)
    grad_compression_block = 256  # int8 elements per absmax block (one fp32 scale each)
    compress_scope = "all"        # "all" hops | "inter_node" (fp32 inside a node)
    ranks_per_node = 8            # node size for "inter_node" (default: LOCAL_WORLD_SIZE)
    diloco = 0                    # DiLoCo inner steps H between replica syncs (0: off)
    outer_lr = 0.7                # DiLoCo outer SGD learning rate (default: by H)
    outer_momentum = 0.9          # DiLoCo outer Nesterov momentum (default: by H)

    [predicted]                   # the planner's estimate, for predicted-vs-measured reports
    step_time_s = 10.2
    tokens_per_s = 822000.0
    memory_gib = 61.3
    mfu = 0.41

Format "meshtron-plan/1" files still load: their `schedule = "1f1b"` with pp = 1 becomes none,
and they had no `dtype` (the run's `--dtype` decided; they load as "fp32", the runtime default).
Unknown keys are rejected.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import tomli_w

from meshtron.errors import UserError

FORMAT = "meshtron-plan/2"
OLD_FORMATS = ("meshtron-plan/1",)
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1f1b", "interleaved", "zb", "gpipe")
"""Pipeline schedules (planner/pipeline.py costs them; parallel/pipeline.py runs them). With
virtual_stages v > 1: gpipe = looped BFS, 1f1b = interleaved 1F1B, zb with v = 2 = ZBV."""
DTYPES = ("bf16", "fp32")
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
COMPRESSIONS = ("none", "bf16", "int8")
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
    for name in ("tp", "pp", "dp", "micro_batch", "virtual_stages", "dp_replicate",
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
        yield f"plan.global_batch={b}: must be divisible by plan.dp={dp}"
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


def model_problems(k: Mapping[str, Any], model: Any) -> Iterator[str]:
    """Rules between the plan and the model's shapes (a ModelSpec), incl. the runtime's limit on
    tied embeddings."""
    tp, pp, v = k.get("tp"), k.get("pp"), k.get("virtual_stages") or 1
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
    if pp is not None and pp > 1 and getattr(model, "tied_embeddings", False):
        yield (f"plan.pp={pp}: model {model.name} ties its input and output embeddings, which "
               "the runtime cannot split across pipeline stages")
        return
    sl = k.get("stage_layers")
    if sl:
        if sum(sl) != model.layers:
            yield (f"plan.stage_layers={list(sl)}: sums to {sum(sl)}, the model has "
                   f"{model.layers} layers")
    elif pp is not None and pp * v > model.layers:
        name = f"plan.pp={pp}" if v == 1 else f"plan.pp*virtual_stages={pp}*{v}={pp * v}"
        yield f"{name}: more pipeline stages than model layers ({model.layers})"


def world_problem(k: Mapping[str, Any], world_size: int) -> str | None:
    tp, pp, dp = k.get("tp"), k.get("pp"), k.get("dp")
    if None not in (tp, pp, dp):
        if tp * pp * dp != world_size:
            return (f"plan.dp*tp*pp={dp}*{tp}*{pp}={dp * tp * pp}: must equal the world size "
                    f"{world_size}")
        return None
    for name, val in (("tp", tp), ("pp", pp), ("dp", dp)):
        if val is not None and world_size % val:
            return f"plan.{name}={val}: must divide the world size {world_size}"
    fixed = (tp or 1) * (pp or 1) * (dp or 1)
    if world_size % fixed:
        return f"plan tp*pp*dp={fixed} (fixed part): must divide the world size {world_size}"
    return None


def plan_problems(k: Mapping[str, Any], world_size: int | None = None,
                  model: Any = None) -> list[str]:
    """THE validity function: every reason the (possibly partial) plan `k` cannot run, checked
    against `world_size` and `model` (a ModelSpec) when given. Empty when valid."""
    out = list(field_problems(k))
    if world_size is not None:
        w = world_problem(k, world_size)
        if w:
            out.append(w)
    if model is not None:
        out.extend(model_problems(k, model))
    return out


def check(k: Mapping[str, Any], world_size: int | None = None, model: Any = None) -> None:
    """Raise UserError with the first of `plan_problems`."""
    problems = plan_problems(k, world_size, model)
    if problems:
        raise UserError(problems[0])


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """One parallel layout with all its knobs; the contract between planner and runtime."""

    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of GPU stages)."""
    dp: int = 1
    """Data-parallel degree (dp_replicate * dp_shard)."""
    zero: int = 0
    """ZeRO stage 0-3 over the data-parallel group."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel replica."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'selective' (attention core) or 'full'."""
    sp: bool = False
    """Sequence parallelism for the norm/dropout regions (needs tp > 1)."""
    schedule: str | None = None
    """Pipeline schedule ('1f1b', 'interleaved', 'zb', 'gpipe'); None when pp == 1, '1f1b' when
    pp > 1 and not given. 'zbv' is read as 'zb' with two virtual stages."""
    virtual_stages: int = 1
    """Model chunks per GPU stage."""
    stage_layers: tuple[int, ...] = ()
    """Layers per virtual stage in pipeline order, length pp * virtual_stages; () = even split."""
    dp_replicate: int = 1
    """With zero 2/3: replicated groups of sharded data parallelism (HSDP); dp_shard = dp / it."""
    dtype: str = "fp32"
    """The run's precision: 'bf16' (bf16 compute, fp32 master weights and reductions) or 'fp32'."""
    attention: str = "flash"
    """Attention kernel the prediction assumed ('flash' or 'unfused')."""
    model: str | None = None
    """Model preset name or path the plan was made for."""
    cluster: str | None = None
    """Cluster preset or file the plan was made for."""
    global_batch: int | None = None
    """Sequences per optimizer step (None: not tied to a batch)."""
    seq_len: int | None = None
    """Tokens per sequence (None: not tied to a sequence length)."""
    predicted: Mapping[str, float] = field(default_factory=dict, compare=False)
    """The planner's estimate (step_time_s, tokens_per_s, memory_gib, mfu, ...)."""
    grad_compression: str = "none"
    """How data-parallel gradients travel: 'none' (fp32), 'bf16', or 'int8' (block-wise absmax
    with error feedback, reduced in fp32; meshtron/compress/). With diloco > 0: how the outer
    gradients travel."""
    grad_compression_block: int = 256
    """Elements per int8 block (one fp32 scale each: 1 + 4/block bytes per element)."""
    compress_scope: str = "all"
    """'all': compress every data-parallel hop; 'inter_node': fp32 inside a node, compressed
    between nodes (hierarchical reduction)."""
    ranks_per_node: int | None = None
    """Ranks per node for compress_scope='inter_node' (None: torchrun's LOCAL_WORLD_SIZE)."""
    diloco: int = 0
    """DiLoCo (Douillard et al. 2023): inner optimizer steps each data-parallel replica takes
    alone between averaging the replicas' parameter change; 0 = off (plain data parallelism)."""
    outer_lr: float | None = None
    """DiLoCo outer SGD learning rate; None: chosen by H (meshtron/compress/diloco.py
    `outer_settings`: 1.0 below H = 500, the paper's 0.7 from there)."""
    outer_momentum: float | None = None
    """DiLoCo outer Nesterov momentum (0 = plain SGD); None: chosen by H (0 below H = 500,
    the paper's 0.9 from there)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stage_layers, (list, tuple)):
            set_(self, "stage_layers", tuple(self.stage_layers))
        else:
            raise UserError(f"plan.stage_layers={self.stage_layers!r}: must be a list of "
                             "layer counts")
        if isinstance(self.schedule, str):
            s = self.schedule.strip().lower()
            if s == "zbv":  # zero bubble on a V of two stages per rank
                s = "zb"
                if self.virtual_stages == 1 and len(self.stage_layers) != self.pp:
                    set_(self, "virtual_stages", 2)
            if s == "1f1b" and self.pp == 1 and self.virtual_stages == 1:
                s = None  # the old files' placeholder: pp=1 has no schedule
            set_(self, "schedule", s)
        elif self.schedule is None and _is_int(self.pp) and self.pp > 1:
            set_(self, "schedule", "1f1b")
        if isinstance(self.dtype, str):
            d = self.dtype.strip().lower()
            set_(self, "dtype", _DTYPE_ALIASES.get(d, d))
        check(self.knobs_and_context())

    @classmethod
    def trusted(cls, tp: int, pp: int, dp: int, zero: int, micro_batch: int, recompute: str,
                sp: bool, schedule: str | None, virtual_stages: int = 1,
                dtype: str = "fp32", dp_replicate: int = 1) -> "Plan":
        """A search-space point built without re-running the rules: the search draws every
        value from a space `plan_problems` already vetted (tests check its output validates)."""
        p = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(p, f.name, f.default if f.default is not dataclasses.MISSING
                               else f.default_factory())
        for name, val in (("tp", tp), ("pp", pp), ("dp", dp), ("zero", zero),
                          ("micro_batch", micro_batch), ("recompute", recompute), ("sp", sp),
                          ("schedule", schedule if pp > 1 else None),
                          ("virtual_stages", virtual_stages), ("dtype", dtype),
                          ("dp_replicate", dp_replicate if zero >= 2 else 1)):
            object.__setattr__(p, name, val)
        return p

    # ---- views ---------------------------------------------------------------------------
    def knobs_and_context(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "predicted"}

    def knobs(self) -> dict[str, Any]:
        """How to run: the KNOBS fields."""
        return {name: getattr(self, name) for name in KNOBS}

    def comm_knobs(self) -> dict[str, Any]:
        """The data-parallel traffic knobs that differ from their defaults (COMM_DEFAULTS)."""
        return {name: getattr(self, name) for name, default in COMM_DEFAULTS.items()
                if getattr(self, name) != default}

    @property
    def compressed(self) -> bool:
        """Gradients (or DiLoCo outer gradients) travel compressed."""
        return self.grad_compression != "none"

    def validate(self, world_size: int | None = None, model: Any = None) -> "Plan":
        """Check against a world size and a ModelSpec (UserError naming the first problem)."""
        check(self.knobs_and_context(), world_size, model)
        return self

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    world_size = gpus

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks a ZeRO-2/3 shard spans (all of dp for zero 0/1: none shard)."""
        return self.dp // self.dp_replicate if self.zero >= 2 else 1

    @property
    def replicas(self) -> int:
        """Replicated data-parallel groups: dp for zero 0/1, dp_replicate for zero 2/3."""
        return self.dp_replicate if self.zero >= 2 else self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def num_microbatches(self) -> int | None:
        if self.global_batch is None:
            return None
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)

    def layout(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"

    def schedule_label(self) -> str:
        """'-' without a pipeline, 'interleaved:V' with virtual stages, else the schedule."""
        if self.pp == 1 or self.schedule is None:
            return "-"
        if self.virtual_stages > 1:
            return f"{self.schedule}:{self.virtual_stages}"
        return self.schedule

    def describe(self) -> str:
        return (f"{self.layout()} zero={self.zero} mb={self.micro_batch} "
                f"recompute={self.recompute} sp={'on' if self.sp else 'off'} "
                f"schedule={self.schedule_label()}")

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    # ---- files -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field (None stays None), plus format, gpus, num_microbatches."""
        d: dict[str, Any] = {"format": FORMAT, "model": self.model, "cluster": self.cluster,
                             "gpus": self.gpus, "global_batch": self.global_batch,
                             "seq_len": self.seq_len}
        for name, value in self.knobs().items():
            d[name] = list(value) if name == "stage_layers" else value
        d["num_microbatches"] = self.num_microbatches
        d.update(self.comm_knobs())
        if self.predicted:
            d["predicted"] = dict(self.predicted)
        return d

    def to_toml(self) -> str:
        header = ("# meshtron plan: parallel layout for `meshtron train` "
                  "(schema: meshtron/planner/plan.py)\n")
        return header + tomli_w.dumps({k: v for k, v in self.to_dict().items() if v is not None})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """A plan from a file's table or a dict of knobs (unknown keys refused by name)."""
        data = dict(data)
        fmt = data.pop("format", FORMAT)
        if fmt != FORMAT and fmt not in OLD_FORMATS:
            raise UserError(f"plan.format={fmt!r}: allowed values are {FORMAT!r}, "
                             f"{', '.join(map(repr, OLD_FORMATS))}")
        derived = {k: data.pop(k) for k in ("gpus", "num_microbatches") if k in data}
        if isinstance(data.get("schedule"), str) and ":" in data["schedule"]:
            data["schedule"], v = parse_schedule(data["schedule"])
            if v is not None:
                data.setdefault("virtual_stages", v)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            allowed = ", ".join(sorted(names | {"format", "gpus", "num_microbatches"}))
            raise UserError(f"plan.{unknown[0]}: unknown key; allowed: {allowed}")
        plan = cls(**data)
        for key, value in derived.items():
            if value != getattr(plan, key):
                raise UserError(f"plan.{key}={value!r}: must equal "
                                 + ("tp*pp*dp" if key == "gpus" else
                                    "global_batch/(dp*micro_batch)")
                                 + f" = {getattr(plan, key)}")
        return plan

    @classmethod
    def from_toml(cls, text: str) -> "Plan":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"plan: not valid TOML ({exc})") from None
        return cls.from_dict(data)


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan written by `meshtron plan --save`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan={str(path)!r}: file does not exist")
    return Plan.from_toml(path.read_text())


def as_plan(obj: Any) -> Plan:
    """What the Python API accepts as a plan: a Plan, a saved plan file (str or Path), or a dict
    of Plan fields. Anything else is refused (it used to be read attribute by attribute, and a
    dict silently became dp=tp=pp=1)."""
    if isinstance(obj, Plan):
        return obj
    if isinstance(obj, (str, Path)):
        return load_plan(obj)
    if isinstance(obj, Mapping):
        return Plan.from_dict(obj)
    raise UserError(f"plan={type(obj).__name__}: expected a meshtron Plan, a plan file path or a "
                     "dict of plan fields (tp, pp, dp, zero, micro_batch, recompute, sp, schedule, "
                     "virtual_stages, stage_layers, dp_replicate, dtype)")


# ---- fixed knobs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """Knobs fixed by the user for the search; None leaves a knob to the search. Validated by
    the same rules as Plan (`plan_problems`), applied to the values given."""

    tp: int | None = None
    """Tensor-parallel degree."""
    pp: int | None = None
    """Pipeline-parallel degree."""
    dp: int | None = None
    """Data-parallel degree."""
    zero: int | None = None
    """ZeRO stage."""
    micro_batch: int | None = None
    """Micro-batch size in sequences."""
    recompute: str | None = None
    """'none', 'selective' or 'full'."""
    sp: bool | None = None
    """Sequence parallelism."""
    schedule: str | None = None
    """'1f1b', 'interleaved', 'zb' or 'gpipe'."""
    virtual_stages: int | None = None
    """Virtual stages per GPU stage."""
    dtype: str | None = None
    """The run's precision ('bf16' or 'fp32'); not searched, the planner's default when None."""
    dp_replicate: int | None = None
    """HSDP replica groups (with zero 2/3); not searched, 1 when None."""

    def __post_init__(self) -> None:
        check(self.to_dict())

    @classmethod
    def of(cls, fixed: "Knobs | Plan | Mapping[str, Any] | None") -> "Knobs":
        if fixed is None:
            return cls()
        if isinstance(fixed, Knobs):
            return fixed
        if isinstance(fixed, Plan):
            return cls(**{f.name: getattr(fixed, f.name) for f in dataclasses.fields(cls)})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fixed) - names)
        if unknown:
            raise UserError(f"{unknown[0]}: unknown knob; allowed: {', '.join(sorted(names))}")
        values = dict(fixed)
        if isinstance(values.get("schedule"), str):
            sched, v = parse_schedule(values["schedule"])
            values["schedule"] = sched
            if v is not None and values.get("virtual_stages") is None:
                values["virtual_stages"] = v
        if isinstance(values.get("sp"), str):
            values["sp"] = parse_on_off("sp", values["sp"])
        if values.get("pp") == 1 and values.get("schedule") == "1f1b" \
                and values.get("virtual_stages") in (None, 1):
            values["schedule"] = None  # the old spelling of "no pipeline"
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def parse_layout(text: str) -> dict[str, int]:
    """'tp=8,pp=16,dp=64' (any subset) -> {'tp': 8, 'pp': 16, 'dp': 64}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(tp|pp|dp)\s*=\s*(\d+)", part)
        if not m:
            raise UserError(f"layout={text!r}: expected comma-separated tp=N, pp=N, dp=N")
        key, value = m.group(1), int(m.group(2))
        if value <= 0:
            raise UserError(f"layout {key}={value}: must be a positive integer")
        if key in out:
            raise UserError(f"layout={text!r}: {key} given twice")
        out[key] = value
    if not out:
        raise UserError(f"layout={text!r}: expected comma-separated tp=N, pp=N, dp=N")
    return out


def parse_schedule(text: str) -> tuple[str, int | None]:
    """'1f1b' | 'interleaved' | 'interleaved:3' | 'zb' | 'zbv' | 'gpipe' -> (schedule, virtual
    stages or None when not given)."""
    m = re.fullmatch(r"(1f1b|interleaved|zbv|zb|gpipe)(?::(\d+))?", text.strip().lower())
    if not m:
        raise UserError(f"schedule={text!r}: allowed values are 1f1b, interleaved, "
                         "interleaved:V, zb, zbv, gpipe")
    sched, v = m.group(1), m.group(2)
    if sched == "zbv":
        if v is not None:
            raise UserError(f"schedule={text!r}: zbv always has 2 virtual stages")
        return "zb", 2
    if v is not None:
        if sched != "interleaved":
            raise UserError(f"schedule={text!r}: only 'interleaved' takes a virtual-stage count")
        if int(v) < 2:
            raise UserError(f"schedule={text!r}: interleaving needs at least 2 virtual stages")
        return sched, int(v)
    return sched, (1 if sched != "interleaved" else None)


def parse_on_off(name: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("on", "true", "yes", "1"):
        return True
    if t in ("off", "false", "no", "0"):
        return False
    raise UserError(f"{name}={text!r}: allowed values are on, off")


def fixed_knobs(layout: str | None = None, zero: int | None = None, recompute: str | None = None,
                sp: str | None = None, micro_batch: int | None = None,
                schedule: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Knobs fixed on a command line (`plan` and `train` share these flags); unset stay open."""
    fixed: dict[str, Any] = {}
    if layout:
        fixed.update(parse_layout(layout))
    if zero is not None:
        fixed["zero"] = zero
    if recompute is not None:
        fixed["recompute"] = recompute.strip().lower()
    if sp is not None:
        fixed["sp"] = parse_on_off("sp", sp)
    if micro_batch is not None:
        fixed["micro_batch"] = micro_batch
    if schedule is not None:
        sched, v = parse_schedule(schedule)
        fixed["schedule"] = sched
        if v is not None:
            fixed["virtual_stages"] = v
    if dtype is not None:
        fixed["dtype"] = dtype.strip().lower()
    return fixed
