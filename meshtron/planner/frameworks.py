"""Software stacks the planner can price: `meshtron plan --framework NAME[@ERA]`.

The same layout costs different time and memory on different software: what the gradient
reduction moves and when, which kernels are fused, what overlaps, what a rank allocates. A
`Framework` bundles those choices (compute.KernelOptions for time, memory.MemoryOptions for
bytes, and the default gradient-reduction dtype), each preset defined by what that software's
code and documentation do at the version named, never by a published throughput figure.

Presets (NAME@ERA; NAME alone is its newest era):

Expert parallelism (ep > 1, mixture-of-experts models) is priced for the stacks that run it
(`Framework.expert_parallel`): meshtron, torchtitan@2025, megatron@2024 and megatron-bridge
(Megatron-Core MoE), deepspeed@2024 (DeepSpeed-MoE), nemo-automodel (its own MoE model
classes and components/moe/, with the defaults of that path: `Framework.moe_path`);
megatron@2021, deepspeed@2021, gpt-neox, torchtitan@2024 and llm-foundry had none and refuse
ep > 1; their code had no mixture-of-experts model at all, so they refuse MoE models outright
(MemoryOptions `layouts`, plan_rules_stack.STACK_LAYOUTS, which cites each), as llm-foundry
refuses tp > 1 and pp > 1 (Composer's PyTorch FSDP is its only parallelism then).
DeepSeek's DualPipe (all-to-alls overlapped with another micro-batch) and its node-limited
routing are options, not a preset: `ep_overlap = true`, `ep_node_limit = 4`, and its FP8
dispatch `ep_dispatch = "fp8"`; DualPipe itself is the memory option `pipeline_split =
"dualpipe"` (DeepSeek's engine) with `--schedule dualpipe` (or `dualpipev`), priced by
planner/pipeline_dualpipe.py and refused by meshtron's runtime. DeepEP's kernels (NeMo
AutoModel's `dispatcher: deepep`, Megatron-Core's flex dispatcher) are `ep_dispatch =
"deepep"`, NVIDIA's HybridEP (the flex dispatcher's `hybridep` backend) `ep_dispatch =
"hybridep"`, with `expert_routing` ("spread", or "contiguous" for AutoModel's fake balanced
gate; planner/moe_deepep.py); NeMo AutoModel's bf16 model and its experts left out of FSDP2
on a one-rank ep_shard group are the memory options `param_dtype = "bf16"` (the preset's for
every model: its dense Hugging Face path builds bf16 models too) and `experts_outside_fsdp =
true`, which the nemo-automodel preset sets for MoE models.

* `meshtron` (default): meshtron's own runtime (meshtron/parallel/): eager PyTorch modules,
  FSDP2 with fp32 sharded parameters and MixedPrecisionPolicy(param bf16, reduce fp32); ZeRO-0/1
  reduce once per step, ZeRO-1 is a distributed optimizer, ZeRO-2/3 reduce-scatter per
  micro-batch (planner/dp_cost.py `dp_flags`); selective recomputation saves matmul and
  collective outputs; the loss upcasts logits to fp32; pipeline stages send their output as
  each rank holds it (torch.distributed.pipelining: whole per tensor rank without sp,
  `p2p_scatter_gather = false`); after each zero-bubble W pass it folds the weight gradients
  into FSDP2's fp32 accumulator (parallel/pipeline.py, `fold_after_weight_pass = true`; the
  other FSDP2 stacks run torch's schedule as it is). Only the options its runtime runs are
  accepted (planner/plan_rules_options.py; any other is refused by name).
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
  `--fp8-param-gather`, off by default as in Megatron-Core), delayed scaling's amax
  all-reduces over each stage's dp x tp x cp ranks twice per micro-batch and model chunk
  (planner/fp8_amax.py). megatron@2021 prices FP8 the same way, a what-if: 2021's
  Megatron-LM had no FP8 (Transformer Engine and its amax reductions came later), so an FP8
  plan on it is Megatron-Core's TE delayed scaling on the 2021 stack, amax all-reduces
  included.
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

* `torchtitan@2024`: torchtitan's December 2024 tree (the TT24 benchmarks'): torchtitan@2025's
  FSDP2 stack with foreach AdamW (torchtitan/optimizer.py; `--optimizer.fused` became the
  default in pytorch/torchtitan#881, February 2025) and its Python RMSNorm (models/norms.py,
  five kernels: eager_norm = "python"; torch.nn.RMSNorm from #985, March 2025).
* `megatron-bridge@2025` (NVIDIA-NeMo/Megatron-Bridge v0.2.0-v0.3.0, Megatron-Core 0.15-0.16,
  Transformer Engine 2.9-2.12; NeMo containers 25.11 and 26.02; read at both tags): what
  its library recipes set (src/megatron/bridge/recipes/llama/llama3.py `_llama3_common`,
  training/mixed_precision.py, training/comm_overlap.py, models/gpt_provider.py):
  megatron@2024's stack, plus TE
  userbuffers TP overlap (every recipe with tp > 1 passes CommOverlapConfig(tp_comm_overlap=
  True); comm_overlap.py turns it off without sequence parallelism), FP8 as the library's
  Hopper recipe bf16_with_fp8_current_scaling_mixed (tensorwise current scaling with FP8
  parameters gathered in FP8: fp8_scaling = "te-current", fp8_param_gather = true; its BF16
  first and last layers are not priced), the DDP config's check_for_nan_in_grad (one norm
  pass over every gradient bucket: grad_bucket_passes = 1) and Megatron-Core >= 0.13's
  weighted SwiGLU for MoE experts. Its gradients are reduced in fp32 (bf16_mixed
  grad_reduce_in_fp32 True), the loss is TE's fused cross-entropy; its manual garbage
  collection (TrainingConfig manual_gc, every 100 steps) is host time the planner does not
  price for any stack. Its performance scripts
  (scripts/performance, what the published DGX tables ran) change more, as an [options]
  table: `grad_bucket_passes = 0` (utils/helpers.py set_common_perf_overrides:
  check_for_nan_in_grad False), and per workload configs/*/*_llm_pretrain.py
  `fp32_grad_reduce = false` with `reduce_dtype = "bf16"` (grad_reduce_in_fp32 False for
  Llama 3 and Qwen 3), `ep_overlap = true` where a MoE config sets moe_a2a_overlap.
* `nemo-automodel@2025` (NVIDIA-NeMo/Automodel v0.2.0, December 2025): FSDP2 over a Hugging
  Face model built in bf16 with no fp32 master weights (`param_dtype = "bf16"`: from_config
  resolves torch_dtype 'auto' to bfloat16, _transformers/auto_model.py; train_ft's build_model
  and load_base_model keep the built dtype; components/distributed/fsdp2.py FSDP2Manager:
  MixedPrecisionPolicy param and
  reduce bf16, so gradients reduce-scatter in bf16; offload_policy CPUOffloadPolicy;
  activation_checkpointing off), eager kernels (torch.compile only with a `compile` section,
  recipes/llm/train_ft.py), attention `flash_attention_2` (_transformers/auto_model.py; flash-
  attn takes grouped K/V as they are), Hugging Face's separate q/k/v and gate/up Linears,
  MaskedCrossEntropy with fp32_upcast (components/loss/masked_ce.py: the whole logits cast to
  fp32, loss = "eager"), torch.optim Adam/AdamW at their CUDA default (foreach; train_ft.py
  sets foreach False under tensor parallelism, which the preset does not follow), context
  parallelism through torch's context_parallel ring (components/distributed/cp_utils.py). Not
  read, left at the base KernelOptions: FP8, and the Liger kernels it applies at tp = cp = 1.
  A mixture of experts runs AutoModel's own model classes through components/moe/
  parallelizer.py, whose defaults the preset takes for MoE models (`for_model`; an
  [options] value wins): FSDP2 reducing in fp32 (apply_fsdp's MixedPrecisionPolicy when none
  is passed: `fp32_grad_reduce`, `reduce_dtype = "fp32"`), Transformer Engine attention,
  Linear and RMSNorm (BackendConfig 'te': `stack = "fused"`, MLA's V at its own width),
  DeepEP's dispatcher where deep_ep is installed (`ep_dispatch = "deepep"`), and routed
  experts outside FSDP2
  wherever dp x cp / ep is one rank (`experts_outside_fsdp`). Its expert parallelism folds
  ep over the dp x cp ranks (fsdp2.py's moe mesh (pp, ep_shard, ep)); parallelize_model
  asserts tp 1 for its MoE models, and a plan with tp > 1 for one is refused
  (`Framework.moe_no_tp`). A run's own settings stay options: the fake balanced gate
  (`expert_imbalance = 1`, `expert_routing = "contiguous"`),
  MaskedCrossEntropy(fp32_upcast=False) (`loss = "eager-bf16"`).
* `megatron-deepspeed` is an alias of `deepspeed@2021` (Megatron-DeepSpeed on DeepSpeed
  0.3.15, the stack that preset states). BLOOM's 2022 BigScience fork (BF16_Optimizer,
  ALiBi, CUDA_LAUNCH_BLOCKING) is not a preset: bench/published/rows_megatron.BLOOM_STACK.
* `gpt-neox@2022` (EleutherAI/gpt-neox 450b58c4, April 2022, on DeeperSpeed eb7f5cff, DeepSpeed
  0.3.15's engine): deepspeed@2021's pipeline engine and ZeRO with the settings its code and
  shipped configs run: softmax and bias-GeLU fusions off (neox_args.py defaults; configs/*.yml
  but 20B.yml: eager kernels), dropout 0 (every shipped config), and `gpt_j_residual`'s single
  all-reduce of the summed attention and MLP outputs for a parallel-residual model
  (residual_reduce_once). Its default pipe_partition_method 'type:transformer|mlp' is priced
  as 'type:transformer'.
* `llm-foundry@2024` (mosaicml/llm-foundry January 2024 on Composer 0.17.2, PyTorch FSDP): its
  benchmark YAMLs' amp_bf16 with FSDP mixed precision DEFAULT (composer/trainer/
  mosaic_fsdp_utils.py: param bf16, reduce fp32), fp32 sharded parameters, eager kernels, MPT's
  fused QKV and flash-attn's fused cross-entropy (loss_fn fused_crossentropy: 2 + 4 bytes per
  logit, flash_ce; memory: loss = "flash-ce", not in place), Composer's DecoupledAdamW
  stepping tensor by tensor (optimizer = "for-loop"), Composer's two train metrics of
  ComposerMPTCausalLM (train_metrics = 2: a cross-entropy over the whole logits each per
  micro-batch, and their world-wide torchmetrics sync at every step's end, the plan's
  `step_host` time: planner/composer_metrics.py) and FSDP1's flat parameters (flat_param: no
  copy-out, a gradient cat per backward, the cast and pre-division of every gradient before
  its reduction, SHARD_GRAD_OP re-gathering each micro-batch). `llm-foundry@2023` (v0.3.0 on
  Composer 0.16.3): DEFAULT left reduce_dtype unset, so FSDP reduced in bf16. Precision PURE
  is the [options] pair `fp32_grad_reduce = false`, `reduce_dtype = "bf16"`; attn_impl
  'flash' on padded batches is `flash_unpad = true`, 'triton' on an H100
  `flash_isa = "sm80"`.

* `olmo-core@2024` (allenai/OLMo-core v1.3-v1.5, 8c03ca8a21 to 41400c46fc, September-November
  2024) as its official training scripts run it (src/scripts/train/*.py over
  src/olmo_core/internal/experiment.py; where the four scripts agree, else the library's
  default): FSDP2 fully_shard per block, every block but the last resharded after forward
  (ZeRO 3; DDP is ZeRO 0; no host offload), param bf16 / reduce fp32, per-block torch.compile
  with PyTorch SDPA (TransformerConfig.llama_like turns flash-attn and fused ops off under
  compile) and its Python RMSNorm outside the blocks (eager_norm = "python"), real RoPE,
  separate projections, repeated K/V for SDPA under GQA, its selected_ops activation
  checkpointing torchtitan's op policy (nn/utils.py: activations = "alternate-matmul";
  the scripts set none), torch.optim.AdamW(fused=True), the
  z-loss of every script (z_loss: a separate logsumexp over the fp32 logits with the default
  unfused loss), the model's fp32 logits (logits_fp32); TrainerConfig.fused_loss (the 7B /
  13B / Llama 8B scripts) is `flash_ce = true`, `loss = "flash-ce"`; FP8 torchao tensorwise
  on every Linear but the head, its weights gathered in FP8 (Float8Config
  enable_fsdp_float8_all_gather: fp8_fsdp_gather). Data parallelism only: tp, pp, cp and MoE refused
  (MemoryOptions layouts 'olmo-core-2024'). Not priced: the root unit that holds the
  embedding, final norm and head together, and the FP8 scales' per-step amax all-reduce.

What else a stack's code lacks is refused and never searched (the same `layouts` rule):
megatron@2021 context parallelism (Megatron-Core 2023-08), sequence parallelism and selective
recomputation (Korthikanti et al. 2022, Megatron-LM 2022-04/05); deepspeed@2021 and gpt-neox
the same three; deepspeed@2024 sequence parallelism and ZeRO 3 under tensor parallelism (its
tp is AutoTP training, deepspeed >= 0.16.4, ZeRO 0-2). Recompute 'half' is what each stack's
partial recomputation sets: meshtron every second block of each model part
(parallel/recompute.py, `i % 2 == 1` per part); torchtitan every second block the process
wraps (selective_ac_option "2": a counter kept on ptd_checkpoint_wrapper across every model
part it wraps, models/llama3/parallelize_llama.py at d0ed9b42), so across a rank's chunks;
Megatron (both eras) recompute_method 'block', N of each model chunk's own layers
(transformer_block.py), so 'half' is refused where a chunk holds one layer.

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
nemo-automodel FSDP2's CPUOffloadPolicy (FSDP2Manager.offload_policy, 'full'); llm-foundry
none (Composer 0.16-0.17's get_cpu_offload raises 'FSDP CPU Offload not supported yet.');
gpt-neox DeepSpeed 0.3.15's (deepspeed@2021's); torchtitan@2024 and megatron-bridge those of
the presets they derive from. The search tries only those; another `--offload` is refused by
name.

ZeRO stages likewise (MemoryOptions `zero_stages`, plan_rules_zero.STACK_ZEROS): meshtron 0-3;
torchtitan 0 (DDP, data parallelism alone), 2, 3 (FSDP2); megatron@2021 0 (no distributed
optimizer before 2022); megatron@2024 0-3 (distributed optimizer: 1; its own FSDP: 1-3);
deepspeed 0-3, at most 1
with a pipeline (PipelineEngine); nemo-automodel 0 (DDPManager) and 3 (FSDP2 with every block
resharded after its forward: components/distributed/parallelizer.py); llm-foundry 0, 2, 3
(Composer's FSDP NO_SHARD / SHARD_GRAD_OP / FULL_SHARD, or DDP); gpt-neox, torchtitan@2024
and megatron-bridge those of the presets they derive from. The search tries only those;
another `--zero` is refused.

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
from pathlib import Path
from typing import Any, Mapping

from meshtron.errors import UserError
from meshtron.planner.compute import KernelOptions
from meshtron.planner.framework_presets import PRESETS, Framework
from meshtron.planner.memory import MemoryOptions

NEWEST = {"meshtron": "meshtron@2026", "torchtitan": "torchtitan@2025",
          "megatron": "megatron@2024", "deepspeed": "deepspeed@2024",
          "megatron-bridge": "megatron-bridge@2025", "nemo-automodel": "nemo-automodel@2025",
          "gpt-neox": "gpt-neox@2022", "llm-foundry": "llm-foundry@2024",
          "olmo-core": "olmo-core@2024"}
"""NAME alone means its newest era."""
ALIASES = {"megatron-lm": "megatron", "megatron-core": "megatron@2024", "mcore": "megatron@2024",
           "nemo": "megatron@2024", "ptd-p": "megatron@2021",
           # deepspeed@2021 is DeepSpeed 0.3.15 as Megatron-DeepSpeed runs it (its docstring)
           "megatron-deepspeed": "deepspeed@2021", "automodel": "nemo-automodel",
           "llmfoundry": "llm-foundry", "composer": "llm-foundry", "neox": "gpt-neox"}
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
                        f"{', '.join(sorted(set(NEWEST) | set(PRESETS)))} (aliases: "
                        f"{', '.join(sorted(ALIASES))})")
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


def for_model(fw: Framework, model: Any) -> Framework:
    """`fw` as its stack runs `model`: a mixture of experts gets the preset's `moe_path`
    options (the stack's MoE code and its defaults), except those an [options] table or flag
    already set, which the user's values keep. The overrides listed stay the user's."""
    if not getattr(fw, "moe_path", ()) or not getattr(model, "is_moe", False):
        return fw
    given = {key for key, _ in fw.overrides}
    path = {key: value for key, value in fw.moe_path if key not in given}
    return dataclasses.replace(with_options(fw, path, where="moe_path"),
                               overrides=fw.overrides)


def load_options(path: str | Path) -> tuple[str | None, dict[str, Any]]:
    """(framework or None, [options] table) of an options TOML file."""
    from meshtron.argtypes import existing_file

    p = existing_file(path, "options")  # missing, a folder, a device: each named as such
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
    return with_flags(fw, {k: v for k, v in flags.items() if v is not None})


def with_flags(fw: Framework, flags: Mapping[str, Any]) -> Framework:
    """`fw` with the command's option flags (--stack, --attention, --dropout): a refused
    value is named by its flag as typed (`--stack=megatron: allowed values are ...`)."""
    for key, value in flags.items():
        try:
            fw = with_options(fw, {key: value}, where="flag")
        except UserError as exc:  # "flag: stack='megatron': allowed ...": the reason
            reason = str(exc).split(": ", 2)[-1]
            raise UserError(f"--{key.replace('_', '-')}={value}: {reason}") from None
    return fw


def saved_fields(fw: Framework) -> dict[str, Any]:
    """The Plan fields that record what `fw` priced (Plan.framework, Plan.framework_options):
    none for meshtron's own preset with no option changed, so those files stay as they were
    (and files without them read as meshtron's runtime)."""
    if fw.name == DEFAULT and not fw.overrides:
        return {}
    return {"framework": f"{fw.name}@{fw.era}", "framework_options": fw.overrides}


def for_plan(plan: Any) -> Framework:
    """The stack a saved plan was priced for: its `framework` preset (None: meshtron's runtime)
    with its `framework_options`, each refused by name as the plan's field when unknown."""
    try:
        fw = preset(plan.framework)
    except UserError as exc:
        raise UserError(f"plan.{exc}") from None
    if plan.framework_options:
        options = dict(plan.framework_options)
        fw = with_options(fw, options, where="plan.framework_options")
        red = getattr(plan, "reduce_dtype", None)
        if "reduce_dtype" in options and red is not None and options["reduce_dtype"] != red:
            # the plan's field is what every stack's pricing (search.py fixes the knob) and
            # meshtron's runtime (FSDP2 MixedPrecisionPolicy, parallel/data_parallel.py) use
            raise UserError(f"plan.framework_options.reduce_dtype={options['reduce_dtype']!r} "
                            f"with plan.reduce_dtype={red!r}: the plan's reduce_dtype is "
                            "what is priced and run; make them agree or drop the option")
    return fw


def same_preset(a: Framework, b: Framework) -> bool:
    """The same NAME@ERA, whatever their options."""
    return (a.name, a.era) == (b.name, b.era)


__all__ = ["Framework", "PRESETS", "preset", "resolve", "with_options", "load_options",
           "for_model", "for_plan", "saved_fields", "same_preset"]
