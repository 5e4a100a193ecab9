"""Software stacks the planner can price: `meshtron plan --framework NAME[@ERA]`.

The same layout costs different time and memory on different software: what the gradient
reduction moves and when, which kernels are fused, what overlaps, what a rank allocates. A
`Framework` bundles those choices (compute.KernelOptions for time, memory.MemoryOptions for
bytes, and the default gradient-reduction dtype), each preset defined by what that software's
code and documentation do at the version named, never by a published throughput figure.

Presets (NAME@ERA; NAME alone is its newest era):

Expert parallelism (ep > 1, mixture-of-experts models) is priced for the stacks that run it
(`Framework.expert_parallel`): meshtron, torchtitan@2025, megatron@2024 (Megatron-Core MoE),
deepspeed@2024 (DeepSpeed-MoE); megatron@2021 and deepspeed@2021 had none and refuse ep > 1.
DeepSeek's DualPipe (all-to-alls overlapped with another micro-batch) and its node-limited
routing are options, not a preset: `ep_overlap = true`, `ep_node_limit = 4`, and its FP8
dispatch `ep_dispatch = "fp8"`; DualPipe itself is the memory option `pipeline_split =
"dualpipe"` (DeepSeek's engine) with `--schedule dualpipe` (or `dualpipev`), priced by
planner/pipeline_dualpipe.py and refused by meshtron's runtime. DeepEP's kernels (NeMo
AutoModel's `dispatcher: deepep`, Megatron-Core's flex dispatcher) are `ep_dispatch =
"deepep"` with `expert_routing` ("spread", or "contiguous" for AutoModel's fake balanced
gate; planner/moe_deepep.py); NeMo AutoModel's bf16 model and its experts left out of FSDP2
on a one-rank ep_shard group are the memory options `param_dtype = "bf16"` and
`experts_outside_fsdp = true` (bench/published/rows_2025.py `automodel`).

* `meshtron` (default): meshtron's own runtime (meshtron/parallel/): eager PyTorch modules,
  FSDP2 with fp32 sharded parameters and MixedPrecisionPolicy(param bf16, reduce fp32); ZeRO-0/1
  reduce once per step, ZeRO-1 is a distributed optimizer, ZeRO-2/3 reduce-scatter per
  micro-batch (planner/dp_cost.py `dp_flags`); selective recomputation saves matmul and
  collective outputs; the loss upcasts logits to fp32.
* `torchtitan@2025`: pytorch/torchtitan main 2025 (torchtitan/models/llama3/infra/
  parallelize.py, torchtitan/config/job_config.py): FSDP2 (fp32 master parameters, bf16
  compute, `mixed_precision_reduce = "float32"`), compile off by default (eager kernels;
  `stack = "compiled"` in [options] for `--compile.enable`), selective AC "op" policy (every other
  matmul saved: activations = "alternate-matmul"), cross-entropy on fp32-cast logits, async TP
  off by default, pipelining through torch.distributed.pipelining; with --dtype fp8 torchao
  float8 with its float8 config's default recipe (recipe_name None: tensorwise, weights
  gathered in bf16: enable_fsdp_float8_all_gather off by default).
* `megatron@2021`: Megatron-LM PTD-P as in Narayanan et al. 2021 (github.com/NVIDIA/
  Megatron-LM, 2021 tree): fused kernels, unfused attention with dropout, fp32 main_grad
  (`--accumulate-allreduce-grads-in-fp32`, forced on for bf16 in arguments.py), gradients
  all-reduced once per step after the backward (no overlap), scatter/gather pipeline sends.
* `megatron@2024`: Megatron-Core 0.8-0.12 as NeMo 2.0 recipes run it (Megatron-LM
  docs/source/api-guide/distrib_optimizer.md, megatron/core/distributed/; NeMo
  nemo/collections/llm/recipes/): Transformer Engine fused kernels and flash attention, no
  dropout, distributed optimizer with fp32 main grads (`grad_reduce_in_fp32`), gradients
  reduced once per step with `--overlap-grad-reduce`, `--overlap-param-gather` (the NeMo
  recipes' DistributedDataParallelConfig), gradient accumulation fusion, Megatron's
  asynchronous tensor-parallel linears, overlap_p2p_comm with the interleaved schedule, ring
  attention with p2p overlap for context parallelism. `--tp-comm-overlap` (TE userbuffers) is
  off, as in Megatron-Core (model_parallel_config.py) and NeMo's recipes outside their
  `performance_mode`: `tp_comm_overlap = true` in [options] prices it. FP8 through Transformer
  Engine with Megatron-Core's default `--fp8-recipe delayed` (`fp8_scaling = "te-current"` in
  [options] for 'tensorwise', current scaling; `fp8_param_gather = true` for
  `--fp8-param-gather`, off by default as in Megatron-Core); megatron@2021 prices FP8 the
  same way.
* `deepspeed@2021`: DeepSpeed 0.3.15 (April 2021; deepspeed/runtime/zero/stage3.py,
  partition_parameters.py, runtime/pipe/engine.py) under Megatron-DeepSpeed: ZeRO-3 gathers each
  weight separately, device-synchronised, and prefetches the next weight on its fetch stream
  (`stage3_prefetch_bucket_size` 5e7) while fewer than `stage3_max_live_parameters` (1e9) are
  gathered, the tied word embedding included (Megatron's GPT2Model keeps it gathered over the
  step: `live_embedding`), reduces every parameter separately, list-based collectives; the
  pipeline engine's blocking sends of whole activations.
* `deepspeed@2024`: DeepSpeed 0.14-0.16 with Hugging Face-style models (eager kernels): ZeRO-3
  per-submodule fetch (7 linears of a Llama block) with `overlap_comm`, a 5e7-element
  `stage3_prefetch_bucket_size` under a 1e9 `stage3_max_live_parameters`, parameters released
  after every forward (recomputation
  gathers again); gradients in the model dtype on the wire (`communication_data_type`
  unset); the pipeline engine's blocking sends.

Pipeline stages get the layers each stack's own code would give them (MemoryOptions
`pipeline_split`, planner/pipeline_split.py; plan_rules.split_problem refuses what a stack
cannot express): meshtron and torchtitan (`pipeline_parallel_split_points`, any block
boundary) the time-balanced split; megatron@2021 equal stages and chunks (num_layers % pp == 0
asserted); megatron@2024 equal middle stages with the end stages set apart
(--decoder-first/last-pipeline-num-layers, account_for_embedding/loss_in_pipeline_split;
Megatron-Core 0.13+'s pipeline_model_parallel_layout is `pipeline_split = "any"`);
deepspeed@2021 Megatron-DeepSpeed's PipelineModule partition_method 'type:transformer',
deepspeed@2024 PipelineModule's default 'parameters' (0.12.5+'s dynamic programme; 2021's
DeepSpeed filled the stages left-greedy).
The same rule names the schedules the stack's engine runs (plan_rules.STACK_SCHEDULES):
Megatron 1F1B and interleaved, DeepSpeed 1F1B; meshtron and torchtitan every one priced.

Host offload is what each stack's code runs (MemoryOptions `host_offload`,
plan_rules_offload.STACK_OFFLOADS, which cites the code): meshtron and torchtitan FSDP2's
CPUOffloadPolicy ('full'); megatron@2021 none; megatron@2024 Megatron-Core 0.12's
--optimizer-cpu-offload ('optimizer', distributed optimizer); deepspeed ZeRO-Offload
('optimizer': ZeRO-2/3 in 0.3.15, ZeRO-1/2/3 in 0.14+) and ZeRO-3 parameter offload ('full').
The search tries only those; another `--offload` is refused by name.

ZeRO stages likewise (MemoryOptions `zero_stages`, plan_rules_zero.STACK_ZEROS): meshtron 0-3;
torchtitan 0 (DDP, data parallelism alone), 2, 3 (FSDP2); megatron@2021 0 (no distributed
optimizer before 2022); megatron@2024 0-3 (distributed optimizer: 1; its own FSDP: 1-3);
deepspeed 0-3, at most 1
with a pipeline (PipelineEngine). The search tries only those; another `--zero` is refused.

Around the kernel, torchtitan@2025's Llama (models/llama/model.py, 2024-2025) runs its complex
RoPE (`complex_rope`: no inductor code for complex tensors, so eager bytes under compile too)
and `repeat_kv` (MemoryOptions.gqa_copies: the copies and their backward sums priced as
memory-bound work), and its context parallelism is torch's ring attention (`torch_ring`: fp32
merges and dk/dv sums, K/V at every query head; planner/ring_attention.py).

Any single option overrides from a TOML file (`--options FILE`)::

    framework = "megatron@2024"      # optional: the preset the table modifies
    [options]
    tp_comm_overlap = false          # any field of KernelOptions (planner/compute.py)
    loss = "inplace"                 # or of MemoryOptions (planner/memory.py), but dtype
    reduce_dtype = "bf16"            # the gradient reduction dtype default

Unknown keys and bad values are refused by name.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from meshtron.errors import UserError
from meshtron.planner.compute import KernelOptions
from meshtron.planner.memory import MemoryOptions


@dataclass(frozen=True)
class Framework:
    """One software stack as the cost model sees it."""

    name: str
    """Preset name, e.g. 'megatron'."""
    era: str
    """Era (version family) of the preset, e.g. '2024'."""
    models: str
    """The version of the software this preset models."""
    source: str
    """Where its choices come from (code paths, documentation)."""
    kernel: KernelOptions
    """Time-side choices (fusion, overlap, gradient reduction timing, pipeline engine)."""
    memory: MemoryOptions
    """Memory-side choices (what the framework allocates); dtype is the plan's."""
    reduce_dtype: str = "fp32"
    """Gradient reduction dtype the stack uses unless the plan fixes one."""
    overrides: tuple[tuple[str, Any], ...] = ()
    """Options changed from the preset by an [options] table, in file order."""
    expert_parallel: str = ""
    """How the stack runs expert parallelism of mixture-of-experts models (what its code
    does); empty: it has none, and plans with ep > 1 are refused by name."""

    @property
    def label(self) -> str:
        extra = f" +{len(self.overrides)} option(s)" if self.overrides else ""
        return f"{self.name}@{self.era}{extra}"

    def to_dict(self) -> dict[str, Any]:
        """JSON: the preset, its source and every option value the cost model used."""
        return {"name": self.name, "era": self.era, "models": self.models,
                "source": self.source, "reduce_dtype": self.reduce_dtype,
                "expert_parallel": self.expert_parallel,
                "overrides": dict(self.overrides),
                "kernel": dataclasses.asdict(self.kernel),
                "memory": {k: v for k, v in dataclasses.asdict(self.memory).items()
                           if k not in ("dtype", "split_priced")}}


_MESHTRON = Framework(
    "meshtron", "2026", "meshtron's runtime (this repository)",
    "meshtron/parallel/data_parallel.py, meshtron/parallel/recompute.py, meshtron/model/",
    KernelOptions(), MemoryOptions(framework="fsdp2", host_offload="fsdp2", zero_stages="all"),
    "fp32",
    expert_parallel="meshtron/parallel/expert.py: ep folded over the data ranks (dp_shard x "
                    "cp, or dp_replicate under ZeRO-0/1), uneven all_to_all_single "
                    "dispatch/combine on the compute stream (exposed), experts FSDP-sharded "
                    "over dp_shard/ep (ZeRO-2/3) or reduced over the dp/ep replicas (ZeRO-0/1)")
_TORCHTITAN = Framework(
    "torchtitan", "2025", "pytorch/torchtitan main, 2025 (FSDP2, torch.compile off by default)",
    "torchtitan/models/llama3/infra/parallelize.py; torchtitan/config/job_config.py "
    "(mixed_precision_param bfloat16, mixed_precision_reduce float32, activation_checkpoint "
    "selective_ac_option 'op')",
    KernelOptions(stack="eager", sharding="fsdp", fp32_grad_reduce=True, cp_overlap=True,
                  torch_ring=True, complex_rope=True,
                  fp8_filter="all", fp8_scaling="torchao-tensorwise",
                  separate_projections=True,
                  # models/deepseek_v3/model/model.py hands SDPA / flex V at v_head_dim
                  v_width="native"),
    MemoryOptions(framework="fsdp2", activations="alternate-matmul", loss="eager",
                  gqa_copies=True, host_offload="fsdp2", zero_stages="torchtitan"), "fp32",
    expert_parallel="torchtitan/distributed/expert_parallel.py (ExpertParallel: all-to-all "
                    "token dispatch, not overlapped by default), ParallelDims ep folded over "
                    "dp_shard x cp, experts FSDP-sharded over dp_shard_mod_ep")
_MEGATRON_2021 = Framework(
    "megatron", "2021", "Megatron-LM PTD-P (Narayanan et al. 2021, SC'21)",
    "NVIDIA/Megatron-LM 2021: megatron/arguments.py (bf16 forces "
    "accumulate_allreduce_grads_in_fp32), megatron/model/fused_softmax.py, "
    "megatron/p2p_communication.py (scatter/gather)",
    KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                  separate_projections=False,  # fused QKV and fc1 GEMMs
                  fp32_grad_reduce=True, stack="fused", sharding="zero", fp8_filter="all",
                  fp8_scaling="te-delayed",
                  v_width="native"),  # unfused: two batched GEMMs take any head sizes
    MemoryOptions(framework="megatron", pipeline_split="megatron-even", host_offload="none",
                  zero_stages="megatron-2021"),
    "fp32")
# gradient accumulation fusion arrived in Megatron-LM in February 2022 (commit 83b1e42f30): the
# 2021 tree adds every micro-batch's gradient to main_grad in a backward hook of its own
_MEGATRON_2024 = Framework(
    "megatron", "2024", "Megatron-Core 0.8-0.12 / NeMo 2.0 (Transformer Engine 1.x)",
    "NVIDIA/Megatron-LM docs/source/api-guide/distrib_optimizer.md, "
    "megatron/core/distributed/param_and_grad_buffer.py (overlap_grad_reduce, "
    "overlap_param_gather), megatron/core/tensor_parallel/layers.py + TE userbuffers "
    "(tp_comm_overlap), megatron/core/transformer/attention.py + TE context parallelism "
    "(p2p ring); NVIDIA/NeMo nemo/collections/llm/recipes/precision/mixed_precision.py "
    "(grad_reduce_in_fp32)",
    KernelOptions(attention="flash", dropout=False, overlap_grad_reduce=True,
                  separate_projections=False,  # fused QKV and fc1 GEMMs
                  fp32_grad_reduce=True, stack="fused", sharding="zero", tp_comm_overlap=False,
                  cp_overlap=True, fp8_filter="all", fp8_scaling="te-delayed",
                  grad_accum_fusion=True,
                  megatron_linear=True, p2p_overlap=True,
                  # megatron/core/transformer/multi_latent_attention.py: TE's DotProductAttention
                  # with k_channels = qk head, v_channels = v_head_dim (cuDNN fused attention)
                  v_width="native"),
    MemoryOptions(framework="megatron", pipeline_split="megatron-ends",
                  host_offload="mcore-optimizer", zero_stages="megatron-core"), "fp32",
    expert_parallel="megatron/core/transformer/moe/ (expert_model_parallel_size, alltoall "
                    "token dispatcher, grouped GEMM; expert tensor parallelism "
                    "expert_tensor_parallel_size is not priced: tp=1 for MoE); A2A overlap "
                    "(overlap_moe_expert_parallel_comm) off unless set: ep_overlap option")
_DEEPSPEED_2021 = Framework(
    "deepspeed", "2021", "DeepSpeed 0.3.15 (April 2021) with Megatron-DeepSpeed",
    "microsoft/DeepSpeed v0.3.15: deepspeed/runtime/zero/stage3.py, partition_parameters.py "
    "(_allgather_param, _reduce_scatter_gradients), constants.py; deepspeed/runtime/pipe/"
    "engine.py (blocking p2p; activations split over the tensor group, is_pipe_partitioned; "
    "gradients sent whole, is_grad_partitioned False; ZeRO-1 all-reduced, _exec_reduce_grads)",
    KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                  separate_projections=False,  # fused QKV and fc1 GEMMs
                  fp32_grad_reduce=False, p2p_scatter_gather=True, p2p_grads_whole=True,
                  p2p_blocking=True, zero1_all_reduce=True,  # the pipe engine's all-reduce
                  stack="fused", sharding="zero", shard_units_per_layer=4,
                  reduce_units_per_layer=12, prefetch_params=5e7, max_live_params=1e9,
                  live_embedding=True,
                  recompute_regathers=True, list_collectives=True, fp8_filter="all",
                  v_width="native"),  # unfused: two batched GEMMs take any head sizes
    MemoryOptions(framework="deepspeed", pipeline_split="deepspeed-transformer",
                  host_offload="zero-offload-2021", zero_stages="deepspeed"), "bf16")
_DEEPSPEED_2024 = Framework(
    "deepspeed", "2024", "DeepSpeed 0.14-0.16 with Hugging Face-style models",
    "microsoft/DeepSpeed: deepspeed/runtime/zero/parameter_offload.py and "
    "partitioned_param_coordinator.py (per-submodule fetch, prefetch bucket), "
    "deepspeed/runtime/zero/config.py (stage3_prefetch_bucket_size 5e7, overlap_comm), "
    "docs/_pages/config-json.md (communication_data_type), deepspeed/runtime/pipe/engine.py",
    KernelOptions(attention="flash", dropout=False, overlap_grad_reduce=True,
                  # pipe/engine.py: is_pipe_partitioned = is_grad_partitioned =
                  # is_model_parallel (since DeepSpeed#1407, v0.5.4)
                  fp32_grad_reduce=False, p2p_scatter_gather=True, p2p_blocking=True,
                  stack="eager", sharding="zero", shard_units_per_layer=7,
                  prefetch_params=5e7, max_live_params=1e9, recompute_regathers=True,
                  # Hugging Face's DeepseekV3Attention pads V to the q/k head for flash-attn 2
                  fp8_filter="all", v_width="padded"),
    MemoryOptions(framework="deepspeed", activations="eager", loss="eager",
                  gqa_copies=True, pipeline_split="deepspeed-parameters",
                  host_offload="zero-offload", zero_stages="deepspeed"), "bf16",
    expert_parallel="DeepSpeed-MoE (deepspeed/moe/layer.py, sharded_moe.py: ep_size, "
                    "_AllToAll dispatch and combine, not overlapped)")

PRESETS: dict[str, Framework] = {f"{f.name}@{f.era}": f for f in (
    _MESHTRON, _TORCHTITAN, _MEGATRON_2021, _MEGATRON_2024, _DEEPSPEED_2021, _DEEPSPEED_2024)}
"""Every preset by NAME@ERA."""
NEWEST = {"meshtron": "meshtron@2026", "torchtitan": "torchtitan@2025",
          "megatron": "megatron@2024", "deepspeed": "deepspeed@2024"}
"""NAME alone means its newest era."""
ALIASES = {"megatron-lm": "megatron", "megatron-core": "megatron@2024", "mcore": "megatron@2024",
           "nemo": "megatron@2024", "ptd-p": "megatron@2021"}
"""Other spellings users type."""
DEFAULT = "meshtron"

_KERNEL_FIELDS = {f.name for f in dataclasses.fields(KernelOptions)}
# the plan's dtype, and the split a search prices for a pinned layout, are not stack options
_MEMORY_FIELDS = {f.name for f in dataclasses.fields(MemoryOptions)} - {"dtype", "split_priced"}


def preset(text: str | None) -> Framework:
    """The preset for 'NAME[@ERA]' (None: meshtron), or a UserError naming the choices."""
    key = (text or DEFAULT).strip().lower()
    key = ALIASES.get(key, key)
    if "@" not in key:
        key = NEWEST.get(key, key)
    elif key.split("@", 1)[0] in ALIASES:
        name, era = key.split("@", 1)
        key = f"{ALIASES[name].split('@')[0]}@{era}"
    if key not in PRESETS:
        raise UserError(f"framework={text!r}: allowed values are "
                        f"{', '.join(sorted(set(NEWEST) | set(PRESETS)))}")
    return PRESETS[key]


def with_options(fw: Framework, options: Mapping[str, Any], where: str = "options") -> Framework:
    """`fw` with single options overridden (KernelOptions / MemoryOptions fields, reduce_dtype);
    unknown keys and invalid values are refused by name."""
    kern, mem, red = {}, {}, fw.reduce_dtype
    for key, value in options.items():
        if key in _KERNEL_FIELDS:
            kern[key] = value
        elif key in _MEMORY_FIELDS:
            mem[key] = value
        elif key == "reduce_dtype":
            if value not in ("fp32", "bf16"):
                raise UserError(f"{where}.reduce_dtype={value!r}: allowed values are fp32, bf16")
            red = value
        else:
            allowed = ", ".join(sorted(_KERNEL_FIELDS | _MEMORY_FIELDS | {"reduce_dtype"}))
            raise UserError(f"{where}.{key}: unknown option; allowed: {allowed}")
    for key, value in kern.items():
        default = getattr(fw.kernel, key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UserError(f"{where}.{key}={value!r}: must be true or false")
    try:
        kernel = dataclasses.replace(fw.kernel, **kern)
        memory = dataclasses.replace(fw.memory, **mem)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    except TypeError as exc:  # pragma: no cover - field names are checked above
        raise UserError(f"{where}: {exc}") from None
    return dataclasses.replace(fw, kernel=kernel, memory=memory, reduce_dtype=red,
                               overrides=fw.overrides + tuple(options.items()))


def load_options(path: str | Path) -> tuple[str | None, dict[str, Any]]:
    """(framework or None, [options] table) of an options TOML file."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "file does not exist"
        raise UserError(f"options={str(p)!r}: {what}")
    try:
        doc = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"options={str(p)!r}: not valid TOML ({exc})") from None
    unknown = sorted(set(doc) - {"framework", "options"})
    if unknown:
        raise UserError(f"options.{unknown[0]}: unknown key in {p.name}; allowed: framework, "
                        "[options]")
    fw = doc.get("framework")
    if fw is not None and not isinstance(fw, str):
        raise UserError(f"options.framework={fw!r}: must be a string NAME[@ERA]")
    table = doc.get("options", {})
    if not isinstance(table, dict):
        raise UserError("options.options: must be a table ([options])")
    return fw, table


def resolve(framework: str | None = None, options_file: str | Path | None = None,
            **flags: Any) -> Framework:
    """The stack a command line asks for: --framework, then an --options file (whose own
    `framework` key is used when --framework is not given, and refused when it contradicts
    it), then single flags (--stack, --attention, --dropout) that were given (not None)."""
    table: dict[str, Any] = {}
    if options_file is not None:
        file_fw, table = load_options(options_file)
        if file_fw is not None:
            if framework is not None and preset(framework) != preset(file_fw):
                raise UserError(f"framework={framework!r}: contradicts {options_file}'s "
                                f"framework={file_fw!r}")
            framework = framework or file_fw
    fw = preset(framework)
    if table:
        fw = with_options(fw, table)
    given = {k: v for k, v in flags.items() if v is not None}
    if given:
        fw = with_options(fw, given, where="flag")
    return fw


__all__ = ["Framework", "PRESETS", "preset", "resolve", "with_options", "load_options"]
