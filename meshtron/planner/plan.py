"""The one plan type (`Plan`), its file I/O, and the names of its companion modules.

The validity rules are in plan_rules.py (`plan_problems`, THE validity function), the knobs
fixed for a search in plan_knobs.py (`Knobs`, which imports this module), the command-line
spellings in plan_parse.py; the rules and spellings are re-exported here.

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
    dtype = "bf16"                # the run's precision: "bf16" (mixed) | "fp32" | "fp8" (torchao
                                  # float8 on the block Linears; emulated on CPU)
    attention = "flash"           # kernel the prediction assumed: "flash" | "unfused"
    grad_compression = "int8"     # data-parallel traffic: "none" | "bf16" | "int8" (written
                                  # only when not default, like the other keys below)
    grad_compression_block = 256  # int8 elements per absmax block (one fp32 scale each)
    compress_scope = "all"        # "all" hops | "inter_node" (fp32 inside a node)
    ranks_per_node = 8            # node size for "inter_node" (default: LOCAL_WORLD_SIZE)
    diloco = 0                    # DiLoCo inner steps H between replica syncs (0: off)
    outer_lr = 0.7                # DiLoCo outer SGD learning rate (default: by H)
    outer_momentum = 0.9          # DiLoCo outer Nesterov momentum (default: by H)
    cp = 2                        # context-parallel degree (gpus = tp * cp * pp * dp)
    reduce_dtype = "bf16"         # gradient reduction dtype: "fp32" (default) | "bf16"
    accumulate_unsharded = true   # ZeRO-2/3: reduce-scatter once per step, not per micro-batch
    ep = 8                        # expert-parallel degree (MoE): folded over the data (x cp) ranks
    compile = true                # per-block torch.compile (after TP and recomputation, before FSDP)
    async_tp = true               # micro-pipelined TP collectives with the matmuls (compile, sp)
    fp8_recipe = "tensorwise"     # with dtype = "fp8": "rowwise" (default) | "tensorwise" scaling
    offload = "full"              # host offload: "none" | "optimizer" | "full"
    offload_activations = true    # saved activations kept in pinned host memory
    pipeline_runs = 4             # pipeline schedule runs per optimizer step (torchtitan's and
                                  # NeMo AutoModel's gradient accumulation around schedule.step)
    framework = "megatron-bridge@2025"  # the stack the plan was priced for (frameworks.py
                                  # NAME@ERA); absent: meshtron's runtime, with no option changed

    [framework_options]           # the options changed from that stack's preset when it was
    ep_overlap = true             # priced (an --options file's [options], --stack, --attention,
                                  # --dropout); `cost`, `simulate`, `rehearse --plan` price them

    [predicted]                   # the planner's estimate, for predicted-vs-measured reports
    step_time_s = 10.2
    tokens_per_s = 822000.0
    memory_gib = 61.3
    mfu = 0.41

Files without `framework` (all those written before it was recorded) were priced for meshtron's
runtime and load as such. meshtron's runtime runs plans priced for meshtron only
(`runtime_problem`: `meshtron train --plan` refuses another stack's in one line).

Format "meshtron-plan/1" files still load: their `schedule = "1f1b"` with pp = 1 becomes none,
and they had no `dtype` (the run's `--dtype` decided; they load as "fp32", the runtime default).
Unknown keys are rejected.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import tomli_w

from meshtron.errors import UserError
from meshtron.planner.plan_parse import (  # noqa: F401  (re-exported: one import site)
    fixed_knobs, parse_layout, parse_on_off, parse_schedule)
from meshtron.planner.plan_rules import (  # noqa: F401  (re-exported)
    _DTYPE_ALIASES, ATTENTION, COMM_DEFAULTS, COMPRESS_SCOPES, COMPRESSIONS, CONTEXT, DTYPES, KNOBS,
    LAYOUT_DEFAULTS, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_TOKENS_PER_STEP, RECOMPUTE, REDUCE_DTYPES,
    SCHEDULES, ZERO_STAGES, _is_int, check, comm_problems, field_problems, microbatch_problem,
    model_problems, plan_problems, runs_problem, schedule_zero_problem, world_problem)
from meshtron.planner.plan_priced import (framework_field_problem, framework_runtime_problem,
                                          option_pairs)

FORMAT = "meshtron-plan/2"
PRICED_FOR = ("framework", "framework_options")
"""What the plan was priced with beyond its layout (frameworks.for_plan); not knobs of a run."""
OLD_FORMATS = ("meshtron-plan/1",)


# ---- the plan --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _trusted_defaults(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, default, default_factory or None) of every field of `cls` (Plan.trusted)."""
    return tuple((f.name, None if f.default is dataclasses.MISSING else f.default,
                  None if f.default_factory is dataclasses.MISSING else f.default_factory)
                 for f in dataclasses.fields(cls))


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
    """Activation recomputation: 'none', 'selective' (attention core), 'half' (every second
    block fully) or 'full'."""
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
    cp: int = 1
    """Context-parallel degree: each sequence's tokens split over cp ranks (ring / all-gather
    attention of K/V). World size = tp * cp * pp * dp; FSDP shards over dp_shard x cp; the global
    batch is split over dp only. Mesh order ("pp", "dp_replicate", "dp_shard", "cp", "tp")."""
    reduce_dtype: str = "fp32"
    """Dtype of the data-parallel gradient reduction: 'fp32' (default) or 'bf16'."""
    accumulate_unsharded: bool = False
    """ZeRO-2/3: accumulate gradients unsharded over the micro-batches and reduce-scatter once
    per step (memory for traffic); False: reduce-scatter after every micro-batch (FSDP2)."""
    ep: int = 1
    """Expert-parallel degree (MoE models): each expert lives on one of ep ranks and tokens
    travel to it by all-to-all. The ep ranks are taken from the data (and context) ranks, as
    torchtitan and Megatron-Core fold them: ep divides dp_shard x cp (dp_shard = dp /
    dp_replicate); it does not change the world size. Experts are FSDP-sharded (ZeRO-2/3) over
    the remaining dp_shard x cp / ep ranks; under ZeRO-0/1 replicated over the dp / ep ranks
    holding the same experts, reduced (ZeRO-0) or optimizer-sharded (ZeRO-1) over them
    (meshtron/parallel/mesh.py ExpertMeshes). With `etp` set, Megatron-Core's folding instead
    (plan_rules_fields.EP_FOLDS): ep * etp divides tp x cp x dp."""
    etp: int | None = None
    """Expert tensor-parallel degree where the stack folds expert parallelism over the tensor
    ranks too (Megatron-Core >= 0.10 `expert_tensor_parallel_size`; megatron@2024 only): the
    experts' own grid etp x ep x expert-dp (= tp*cp*dp / (ep*etp)) covers a pipeline stage's
    tp x cp x dp ranks, order etp innermost then ep (parallel_state.py's "tp-ep-dp-pp"); each
    expert's GEMMs split over etp ranks, its states over ep*etp ranks and ZeRO over the expert
    dp. None: the stack's own (Megatron-Core's default etp = tp, meshtron's experts replicated
    over tp; ep folded over the data x context ranks only). Megatron-Bridge's Qwen3 and
    DeepSeek-V3 recipes set 1."""
    compile: bool = False
    """Per-block torch.compile, applied as torchtitan does: after tensor parallelism and
    activation checkpointing, before FSDP (what the planner's 'fused' stack assumes)."""
    async_tp: bool = False
    """Asynchronous tensor parallelism: TP all-gathers/reduce-scatters micro-pipelined with the
    matmuls (torch's symmetric-memory pass under torch.compile; needs tp > 1, sp and compile;
    CUDA + NCCL only: meshtron/parallel/compile.py `async_tp_problem`)."""
    fp8_recipe: str = "rowwise"
    """With dtype='fp8' (torchao float8 training): 'rowwise' scaling (one scale per row, the
    default for accuracy) or 'tensorwise' (one scale per tensor; allows FP8 all-gathers in
    FSDP2)."""
    offload: str = "none"
    """Host-memory offload: 'none'; 'optimizer' (fp32 master weights, gradients and optimizer
    states on the host, optimizer step on the CPU: DeepSpeed ZeRO-Offload, Ren et al. 2021);
    'full' (also the sharded parameters live on the host and are copied in for each
    all-gather: FSDP2's CPUOffloadPolicy, ZeRO-Infinity's parameter offload)."""
    offload_activations: bool = False
    """Saved activations kept in pinned host memory between forward and backward."""
    pipeline_runs: int = 1
    """Pipeline schedule runs per optimizer step: the step's m micro-batches go through the
    schedule in `pipeline_runs` calls of m / pipeline_runs each, each with its own fill and
    drain, its own in-flight activations and, where the stack reshards between calls, its own
    gradient reduction and parameter gathers. torchtitan (trainer.py: a loop of
    gradient_accumulation_steps calls of pp_schedule.step) and NeMo AutoModel
    (train_ft._run_train_optim_step: one schedule.step per gradient-accumulation batch) run
    global_batch / (dp x local batch) of them; Megatron-Core and DeepSpeed run one schedule of
    all micro-batches (plan_rules_pipeline.runs_problem)."""
    framework: str | None = None
    """The software stack the plan was priced for, 'NAME@ERA' (planner/frameworks.py); None:
    meshtron's runtime. Priced again by `frameworks.for_plan`."""
    framework_options: tuple[tuple[str, Any], ...] = ()
    """The options changed from that stack's preset when the plan was priced (Framework.overrides:
    an --options file's [options], then --stack / --attention / --dropout), in that order; a
    table in the file ([framework_options])."""

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
        if not isinstance(self.predicted, Mapping) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                for v in self.predicted.values()):  # read back by train, rehearse and cost
            raise UserError(f"plan.predicted={self.predicted!r}: must be a table of numbers "
                            "([predicted] step_time_s = ..., as `meshtron plan --save` writes)")
        if isinstance(self.dtype, str):
            d = self.dtype.strip().lower()
            set_(self, "dtype", _DTYPE_ALIASES.get(d, d))
        set_(self, "framework_options", option_pairs(self.framework_options))
        problem = framework_field_problem(self.framework)
        if problem:
            raise UserError(problem)
        # the plan's own rules; meshtron's runtime limits apply in `validate` (a plan may
        # describe another framework's run)
        check(self.knobs_and_context(), runtime=False)

    @classmethod
    def trusted(cls, tp: int, pp: int, dp: int, zero: int, micro_batch: int, recompute: str,
                sp: bool, schedule: str | None, virtual_stages: int = 1,
                dtype: str = "fp32", dp_replicate: int = 1, cp: int = 1,
                reduce_dtype: str = "fp32", accumulate_unsharded: bool = False, ep: int = 1,
                compile: bool = False, offload: str = "none") -> "Plan":
        """A search-space point built without re-running the rules: the search draws every
        value from a space `plan_problems` already vetted (tests check its output validates)."""
        p = cls.__new__(cls)
        # the search builds thousands: the defaults are read once (`_trusted_defaults`), the
        # factories still run per plan (no two plans share a mutable default)
        values = {name: factory() if factory else default
                  for name, default, factory in _trusted_defaults(cls)}
        values.update(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro_batch,
                      recompute=recompute, sp=sp, schedule=schedule if pp > 1 else None,
                      virtual_stages=virtual_stages, dtype=dtype,
                      dp_replicate=dp_replicate if zero >= 2 else 1, cp=cp,
                      reduce_dtype=reduce_dtype,
                      accumulate_unsharded=accumulate_unsharded and zero >= 2, ep=ep,
                      compile=compile, offload=offload)
        p.__dict__.update(values)  # frozen: set as dataclasses' own __init__ does
        return p

    # ---- views ---------------------------------------------------------------------------
    def knobs_and_context(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("predicted",) + PRICED_FOR}

    def knobs(self) -> dict[str, Any]:
        """How to run: the KNOBS fields."""
        return {name: getattr(self, name) for name in KNOBS}

    def comm_knobs(self) -> dict[str, Any]:
        """The data-parallel traffic knobs that differ from their defaults (COMM_DEFAULTS)."""
        return {name: getattr(self, name) for name, default in COMM_DEFAULTS.items()
                if getattr(self, name) != default}

    def comm_label(self) -> str:
        """The comm_knobs as the 'Plan:' lines of `meshtron cost` / `simulate` print them after
        `describe()` (' grad_compression=int8 diloco=16'; '' for the defaults)."""
        return "".join(f" {k}={v}" for k, v in self.comm_knobs().items())

    def layout_knobs(self) -> dict[str, Any]:
        """cp, ep, reduce_dtype, accumulate_unsharded, compile, fp8_recipe, offload, ... where
        they differ from LAYOUT_DEFAULTS."""
        return {name: getattr(self, name) for name, default in LAYOUT_DEFAULTS.items()
                if getattr(self, name) != default}

    @property
    def compressed(self) -> bool:
        """Gradients (or DiLoCo outer gradients) travel compressed."""
        return self.grad_compression != "none"

    def validate(self, world_size: int | None = None, model: Any = None) -> "Plan":
        """Check against a world size and a ModelSpec (UserError naming the first problem), and
        that meshtron's runtime can run it (the runtime validates every plan through here)."""
        check(self.knobs_and_context(), world_size, model)
        problem = runtime_problem(self)
        if problem:
            raise UserError(problem)
        return self

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

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
        cp = f",cp={self.cp}" if self.cp > 1 else ""
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        if self.etp is not None:
            ep += f",etp={self.etp}"
        # HSDP's replicas as the --plan string spells them (plan_parse.parse_layout)
        replicate = f",dp_replicate={self.dp_replicate}" if self.dp_replicate > 1 else ""
        return f"tp={self.tp}{cp},pp={self.pp},dp={self.dp}{replicate}{ep}"

    def schedule_label(self) -> str:
        """'-' without a pipeline, 'interleaved:V' with virtual stages, else the schedule;
        'xN' after it for N schedule calls per step (pipeline_runs)."""
        if self.pp == 1 or self.schedule is None:
            return "-"
        runs = f" x{self.pipeline_runs}" if self.pipeline_runs > 1 else ""
        if self.virtual_stages > 1:
            return f"{self.schedule}:{self.virtual_stages}{runs}"
        return self.schedule + runs

    def describe(self) -> str:
        """The plan in one line: the layout and every searched knob, host offload included
        (the `plan` table's zero cell, `simulate`'s plan column and CSV show this)."""
        off = self.offload_label()
        return (f"{self.layout()} zero={self.zero} mb={self.micro_batch} "
                f"recompute={self.recompute} sp={'on' if self.sp else 'off'} "
                f"schedule={self.schedule_label()}" + (f" {off}" if off else ""))

    def offload_label(self) -> str:
        """'offload=KIND' (and 'offload_activations') where the plan offloads to the host,
        else ''."""
        kinds = [] if self.offload in (None, "none") else [f"offload={self.offload}"]
        return " ".join(kinds + (["offload_activations"] if self.offload_activations else []))

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
        d.update(self.layout_knobs())
        d.update(self.comm_knobs())
        if self.framework is not None:
            d["framework"] = self.framework
        if self.framework_options:
            d["framework_options"] = dict(self.framework_options)
        if self.predicted:
            d["predicted"] = dict(self.predicted)
        return d

    def to_toml(self) -> str:
        header = ("# meshtron plan: parallel layout for `meshtron train` "
                  "(schema: meshtron/planner/plan.py)\n")
        return header + tomli_w.dumps({k: v for k, v in self.to_dict().items() if v is not None})

    def save(self, path: str | Path) -> None:
        """Write the plan to `path`: beside it first, then renamed over it (atomic on POSIX),
        so a failed write (full disk, a kill) leaves the file it replaces whole."""
        import os

        path = Path(path)
        part = path.with_name(path.name + ".part")
        try:
            part.write_text(self.to_toml())
            os.replace(part, path)
        except BaseException:
            part.unlink(missing_ok=True)
            raise

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
                                 + ("tp*cp*pp*dp" if key == "gpus" else
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


def runtime_problem(plan: Plan) -> str | None:
    """What the planner can plan but meshtron's runtime does not run yet (one line), or None.
    The plan's stack and options are first resolved as `cost --plan` resolves them
    (frameworks.for_plan: an unknown stack, era or option, or an invalid value, is refused in
    its words), so that `train --plan` checks no less than `cost --plan`."""
    if plan.framework is not None or plan.framework_options:
        from meshtron.planner.frameworks import for_plan

        try:
            for_plan(plan)
        except UserError as exc:
            return str(exc)
    problem = framework_runtime_problem(plan)
    if problem:
        return problem
    from meshtron.planner.plan_rules_runtime import options_runtime_problems

    # a saved (or hand-edited) meshtron plan's options: the one rule the search applies
    # (plan_rules_options.RUNTIME_OPTIONS), so `meshtron train` never runs what it did not price
    options = dict(option_pairs(plan.framework_options or ()))
    knobs = {"async_tp": plan.async_tp, "compile": plan.compile}
    problem = next(options_runtime_problems(options, knobs), None)
    if problem:
        return problem
    problem = fp8_runtime_problem(plan)
    if problem:
        return problem
    from meshtron.planner.plan_rules import compile_runtime_problem

    problem = compile_runtime_problem(plan)
    if problem:
        return problem
    problem = offload_runtime_problem(plan)
    if problem:
        return problem
    return None


def fp8_runtime_problem(plan: Plan) -> str | None:
    """FP8 the runtime does not run: torchao float8 with tensor parallelism is not wired in."""
    if plan.dtype == "fp8" and plan.tp > 1:
        return (f"plan.dtype='fp8' with tp={plan.tp}: meshtron's runtime trains FP8 without "
                "tensor parallelism only (torchao's Float8ColwiseParallel is not wired in); "
                "use tp=1 or bf16")
    return None


def offload_runtime_problem(plan: Plan) -> str | None:
    """Host offload the runtime does not run (meshtron/parallel/offload.py runs the rest)."""
    if plan.offload == "optimizer":
        return ("plan.offload='optimizer': planned only (DeepSpeed ZeRO-Offload: fp32 master "
                "weights, gradients and AdamW states on the host, bf16 weights on the GPU); "
                "meshtron runs offload='full' (FSDP2 CPUOffloadPolicy)")
    if plan.offload == "full" and plan.zero < 2:
        return (f"plan.offload='full' with zero={plan.zero}: FSDP2's CPU offload keeps the "
                "parameter shards on the host, which is ZeRO-2/3 (zero=2 or 3)")
    if plan.offload == "full" and plan.pp > 1:
        return (f"plan.offload='full' with pp={plan.pp}: not run with pipelining (the schedules drive "
                "FSDP2's gradient sync and resharding themselves: not verified); use pp=1")
    if plan.offload_activations and plan.pp > 1:
        return (f"plan.offload_activations=true with pp={plan.pp}: not run with pipelining "
                "(the schedules run forward and backward themselves); use pp=1")
    return None


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan written by `meshtron plan --save`."""
    from meshtron.argtypes import read_text

    text = read_text(path, "plan")  # a folder, a missing file, a binary: one line each
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"plan={str(path)!r}: not valid TOML ({exc})") from None
    return Plan.from_dict(data)


def load_priced_plan(path: str | Path) -> Plan:
    """`load_plan` for the commands that price or run a plan's model from the file alone
    (`cost`, `simulate --step`, `rehearse --plan`): a run folder's plan.toml names its model by
    the run's name (`meshtron train` writes 'cfg' for cfg/config.json, no preset or file),
    there the run.toml beside it, whose [model] table is that model (`--model` reads a TOML
    file's model table). It said "model='cfg': the folder holds no config.json"."""
    from meshtron.model.spec import PRESETS

    plan = load_plan(path)
    beside, named = Path(path).parent / "run.toml", Path(plan.model or "")
    if (not plan.model or plan.model in PRESETS or named.is_file()
            or (named / "config.json").is_file() or not beside.is_file()):
        return plan
    try:
        model = tomllib.loads(beside.read_text()).get("model")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return plan
    if isinstance(model, dict) and model.get("name") == plan.model:
        return plan.replace(model=str(beside))
    return plan


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
