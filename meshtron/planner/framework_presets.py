"""The software-stack presets `meshtron plan --framework NAME[@ERA]` names: the `Framework`
record and one instance per stack and era. What each preset states, and from which code, is
told in planner/frameworks.py's module docstring (the user-facing list); the comments here say
why a field differs from the preset it is derived from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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
    moe_no_tp: str = ""
    """Why the stack runs no mixture of experts under tensor parallelism (its code), where it
    does not: a plan with tp > 1 for an MoE model is refused with it. Empty: it runs them."""
    moe_path: tuple[tuple[str, Any], ...] = ()
    """Options the stack's code sets by itself for a mixture-of-experts model, where it runs
    those through other code than dense ones (NeMo AutoModel: its own model classes and
    components/moe/parallelizer.py); applied by frameworks.for_model, an option the user
    gives winning. Empty: one path for every model."""

    @property
    def label(self) -> str:
        extra = f" +{len(self.overrides)} option(s)" if self.overrides else ""
        return f"{self.name}@{self.era}{extra}"

    def to_dict(self) -> dict[str, Any]:
        """JSON: the preset, its source and every option value the cost model used."""
        return {"name": self.name, "era": self.era, "models": self.models,
                "source": self.source, "reduce_dtype": self.reduce_dtype,
                "expert_parallel": self.expert_parallel,
                "moe_path": dict(self.moe_path),
                "overrides": dict(self.overrides),
                "kernel": dataclasses.asdict(self.kernel),
                "memory": {k: v for k, v in dataclasses.asdict(self.memory).items()
                           if k not in ("dtype", "split_priced")}}


_MESHTRON = Framework(
    "meshtron", "2026", "meshtron's runtime (this repository)",
    "meshtron/parallel/data_parallel.py, meshtron/parallel/recompute.py, meshtron/model/",
    # torch.distributed.pipelining sends a stage's output as the rank holds it
    # (parallel/pipeline.py): under sp=false the activation is replicated over the tensor
    # group (parallel/tensor.py), so every tensor rank sends it whole (no Megatron
    # scatter/gather; under sp it is a sequence shard already: estimate_pieces.py)
    # expert_capacity_pad True: inert, the runtime is dropless (model/moe.py), and its rule
    # (plan_rules_options) takes only this value
    KernelOptions(p2p_scatter_gather=False, expert_capacity_pad=True),
    # fold_after_weight_pass (the default): each zero-bubble W pass's gradients go to
    # FSDP2's fp32 accumulator at W's end (meshtron/parallel/pipeline.py `fold_weight_grads`)
    MemoryOptions(framework="fsdp2", host_offload="fsdp2", zero_stages="all",
                  half_counts="part", fold_after_weight_pass=True),
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
    # half_counts 'rank': selective_ac_option "2" checkpoints every second block the process
    # wraps, one counter kept on ptd_checkpoint_wrapper across every model part a rank builds
    # (torchtitan/models/llama3/parallelize_llama.py _apply_ac_to_transformer_block at
    # d0ed9b42, 2025-05), not afresh per chunk as meshtron's runtime does.
    # fold_after_weight_pass False: torch's schedule as it is, W's gradients folded by the
    # next B's post_backward (torchtitan/distributed/pipeline_parallel.py: torch's
    # PipelineStage and get_schedule_class, no W pass wrapped; pytorch/torchtitan b5bcd76c)
    MemoryOptions(framework="fsdp2", activations="alternate-matmul", loss="eager",
                  gqa_copies=True, host_offload="fsdp2", zero_stages="torchtitan",
                  half_counts="rank", fold_after_weight_pass=False), "fp32",
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
                  # 2021's Megatron-LM had no FP8: --dtype fp8 on this preset is a what-if,
                  # priced as Megatron-Core's TE delayed scaling (amax all-reduces included)
                  fp8_scaling="te-delayed",
                  v_width="native"),  # unfused: two batched GEMMs take any head sizes
    MemoryOptions(framework="megatron", pipeline_split="megatron-even", host_offload="none",
                  zero_stages="megatron-2021", layouts="megatron-2021"),
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
                  # token drop pads to capacity only when asked: moe_pad_expert_input_to_
                  # capacity defaults False (megatron/core/transformer/transformer_config.py,
                  # core_v0.12.2 and core_v0.15.0); NeMo's MegatronTokenDropCallback sets it
                  # True (the token-drop rows in bench/published set it so)
                  expert_capacity_pad=False,
                  # megatron/core/transformer/multi_latent_attention.py: TE's DotProductAttention
                  # with k_channels = qk head, v_channels = v_head_dim (cuDNN fused attention)
                  v_width="native"),
    # layouts 'megatron-core': recompute 'half' is recompute_method 'block' with
    # recompute_num_layers N of each model chunk's own layers (plan_rules_stack, which cites
    # transformer_block.py): none with 1-layer chunks
    MemoryOptions(framework="megatron", pipeline_split="megatron-ends",
                  host_offload="mcore-optimizer", zero_stages="megatron-core",
                  layouts="megatron-core"), "fp32",
    expert_parallel="megatron/core/transformer/moe/ (expert_model_parallel_size, alltoall "
                    "token dispatcher, grouped GEMM); MoE parallel folding (Megatron-Core "
                    ">= 0.10.0, parallel_state.py's expert grid): ep folded over tp x cp x dp "
                    "with expert_tensor_parallel_size (plan etp; default tp: ep over dp x "
                    "cp); A2A overlap (overlap_moe_expert_parallel_comm) off unless set: "
                    "ep_overlap option")
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
                  # DeepSpeed-MoE's GShard dispatch (deepspeed/moe/sharded_moe.py: top1gating /
                  # top2gating build the [S, E, C] dispatch mask, MOELayer.forward's einsum
                  # "sec,sm->ecm" fills [E, C, h], padded to the capacity whatever the routing)
                  expert_capacity_pad=True,
                  v_width="native"),  # unfused: two batched GEMMs take any head sizes
    MemoryOptions(framework="deepspeed", pipeline_split="deepspeed-transformer",
                  host_offload="zero-offload-2021", zero_stages="deepspeed",
                  layouts="deepspeed-2021"), "bf16")
# "deepspeed@2024": DeepSpeed 0.14-0.16 training a Hugging Face-style model (no Megatron
# layers): ZeRO 0-3 and the pipe engine; tensor parallelism is AutoTP training (deepspeed >=
# 0.16.4, deepspeedai/DeepSpeed blogs/huggingface-tp/README.md, docs/_tutorials/
# autotp-training.md), which shards the linear layers with ZeRO 0-2 only and has no
# sequence parallelism (layouts 'deepspeed-2024', plan_rules_stack)
_DEEPSPEED_2024 = Framework(
    "deepspeed", "2024", "DeepSpeed 0.14-0.16 with Hugging Face-style models (tp: AutoTP "
    "training, >= 0.16.4, ZeRO 0-2)",
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
                  fp8_filter="all", v_width="padded",
                  # DeepSpeed-MoE's GShard dispatch into [E, C, h] (sharded_moe.py, as 2021)
                  expert_capacity_pad=True),
    MemoryOptions(framework="deepspeed", activations="eager", loss="eager",
                  gqa_copies=True, pipeline_split="deepspeed-parameters",
                  host_offload="zero-offload", zero_stages="deepspeed",
                  layouts="deepspeed-2024"), "bf16",
    expert_parallel="DeepSpeed-MoE (deepspeed/moe/layer.py, sharded_moe.py: ep_size, "
                    "_AllToAll dispatch and combine, not overlapped)")


# torchtitan of December 2024 (the TT24 benchmarks' tree): the 2025 preset's FSDP2 stack with
# foreach AdamW (torchtitan/optimizer.py: `--optimizer.fused` off until pytorch/torchtitan#881,
# February 2025) and its own Python RMSNorm (norms.py, replaced by torch.nn.RMSNorm in #985,
# March 2025); no expert parallelism yet (torchtitan/distributed/expert_parallel.py came in 2025)
# and no mixture-of-experts model at all (torchtitan/models/ is llama only; DeepSeek-V3 came in
# torchtitan#830, February 2025): plan_rules_stack 'torchtitan-2024' refuses MoE models
_TORCHTITAN_2024 = dataclasses.replace(
    _TORCHTITAN, era="2024",
    models="pytorch/torchtitan main, December 2024 (FSDP2, torch.compile off by default)",
    source="torchtitan/parallelisms/parallelize_llama.py, torchtitan/optimizer.py (foreach "
           "AdamW), torchtitan/models/norms.py (Python RMSNorm), torchtitan/config_manager.py",
    kernel=dataclasses.replace(_TORCHTITAN.kernel, optimizer="foreach", eager_norm="python"),
    memory=dataclasses.replace(_TORCHTITAN.memory, layouts="torchtitan-2024"),
    expert_parallel="")
# Megatron-Core 0.15-0.16 (pyproject.toml pins of Megatron-Bridge v0.2.0 and v0.3.0)
# as Megatron-Bridge's library recipes configure it (src/megatron/bridge/recipes/llama/
# llama3.py `_llama3_common` and the 70B/405B recipes): everything megatron@2024 states, plus
# - TE userbuffers TP overlap: every recipe with tp > 1 passes CommOverlapConfig(
#   tp_comm_overlap=True, ...) (training/comm_overlap.py drops it without sequence parallel);
# - FP8 as the library's tested Hopper recipe bf16_with_fp8_current_scaling_mixed
#   (training/mixed_precision.py: fp8_recipe 'tensorwise', fp8_param_gather True);
# - DistributedDataParallelConfig(check_for_nan_in_grad=True, average_in_collective=True): one
#   norm pass over each gradient bucket before it is reduced (grad_bucket_passes 1);
# - Megatron-Core >= 0.13's weighted SwiGLU for MoE experts (moe_weighted_act).
# grad_reduce_in_fp32 True (bf16_mixed and the recipe's DDP config), overlap_grad_reduce,
# overlap_param_gather, the distributed optimizer, gradient accumulation fusion, masked-softmax
# and cross-entropy fusion (models/gpt_provider.py defaults; cross_entropy_fusion_impl 'te')
# and overlap_p2p_comm under the interleaved schedule (comm_overlap.py) are megatron@2024's.
_MEGATRON_BRIDGE = Framework(
    "megatron-bridge", "2025",
    "Megatron-Core 0.15-0.16 through NVIDIA-NeMo/Megatron-Bridge v0.2.0-v0.3.0 library "
    "recipes (NeMo containers 25.11, 26.02; Transformer Engine 2.9-2.12)",
    "NVIDIA-NeMo/Megatron-Bridge v0.2.0: src/megatron/bridge/recipes/llama/llama3.py "
    "(_llama3_common: DistributedDataParallelConfig, cross_entropy_fusion_impl 'te'; 70B/405B "
    "CommOverlapConfig(tp_comm_overlap=True)), training/mixed_precision.py (bf16_mixed, "
    "bf16_with_fp8_current_scaling_mixed), training/comm_overlap.py, models/gpt_provider.py",
    dataclasses.replace(_MEGATRON_2024.kernel, tp_comm_overlap=True, fp8_scaling="te-current",
                        fp8_param_gather=True, grad_bucket_passes=1),
    dataclasses.replace(_MEGATRON_2024.memory, moe_weighted_act=True), "fp32",
    expert_parallel="Megatron-Core megatron/core/transformer/moe/ (expert_model_parallel_"
                    "size, alltoall token dispatcher, grouped GEMM); MoE parallel folding: ep "
                    "over tp x cp x dp with expert_tensor_parallel_size (plan etp; default tp); "
                    "A2A overlap (overlap_moe_expert_parallel_comm) off unless set: ep_overlap "
                    "option; the flex dispatcher (moe_token_dispatcher_type 'flex', "
                    "training/flex_dispatcher_backend.py) with moe_flex_dispatcher_backend "
                    "'deepep' or 'hybridep': ep_dispatch option of that name")
# NVIDIA-NeMo/Automodel v0.2.0 (December 2025), its train_ft recipe with FSDP2Manager over a
# Hugging Face model: MixedPrecisionPolicy(param bf16, reduce bf16) (components/distributed/
# fsdp2.py), MaskedCrossEntropy with fp32_upcast (components/loss/masked_ce.py; 89 of the 93
# example YAMLs), torch.compile only with a `compile` section, flash_attention_2 as the HF
# attention (flash-attn takes grouped K/V as they are: no repeat_kv copies), Hugging Face's
# separate q/k/v and gate/up Linears, RoPE by rotate_half (real), torch.optim Adam/AdamW at
# their CUDA default (foreach), context parallelism through torch's experimental
# context_parallel ring (components/distributed/cp_utils.py); activation checkpointing off by
# default (FSDP2Manager.activation_checkpointing False; `--recompute` picks). ZeRO 0 (DDPManager)
# or 3 (blocks resharded after forward: parallelizer.py), plan_rules_zero 'automodel'.
# Its mixtures of experts run other code (its own model classes, components/models/*, with
# components/moe/parallelizer.py parallelize_model as the recipe's `parallelizer`), whose
# defaults differ from the dense path's: `moe_path` below, applied to MoE models only
# (frameworks.for_model), each read at v0.2.0:
# - fp32_grad_reduce / reduce_dtype fp32: parallelize_model passes no mp_policy, and apply_fsdp
#   then builds MixedPrecisionPolicy(param bf16, reduce float32, output bf16); the dense path's
#   FSDP2Manager default reduces in bf16 (the preset's own reduce_dtype);
# - stack 'fused': BackendConfig attn / linear / rms_norm default 'te' where Transformer Engine
#   imports and CUDA is up (components/moe/utils.py);
# - v_width 'native': TE's DotProductAttention gets num_v_channels = v_head_dim
#   (components/models/deepseek_v3/layers.py), MLA's V is not padded;
# - ep_dispatch 'deepep': BackendConfig.enable_deepep defaults to HAVE_DEEP_EP (deep_ep
#   importable: the docker build's INSTALL_DEEPEP, every examples/benchmark *_te_deepep.yaml
#   and the performance summary's "TE + DeepEP"). Without deep_ep, GroupedExperts all-gathers
#   every token over ep, loops over its local experts and reduce-scatters (components/moe/
#   layers.py: "sub-optimal but ... for correctness"): not priced; `ep_dispatch = "bf16"`
#   prices an all-to-all instead, cheaper than that path;
# - param_dtype 'bf16' (the dense path's too, set on the preset): from_config builds the model in
#   config.torch_dtype, default bf16, and initialize_weights casts to bf16 (components/models/
#   deepseek_v3/model.py); no fp32 master;
# - experts_outside_fsdp: apply_fsdp wraps the experts over the ep_shard mesh only when it
#   has more than one rank, else they are the block's ignored_params; the memory model applies
#   it only where dp x cp / ep is 1 (estimate_memory), so it is on for every MoE layout.
# Fields not read: FP8 (fp8_filter, fp8_scaling), Liger's fused RMSNorm/SwiGLU (use_liger_kernel
# at tp = cp = 1, not priced); the experts' own reduce dtype where ep_shard > 1 (their
# fully_shard has no mp_policy: bf16, the parameters'; priced at the plan's one reduce_dtype);
# reshard_after_forward False, parallelize_model's default (ZeRO-2 in meshtron's terms; the
# 'automodel' ZeRO rule offers 0 and 3 only, so its MoE runs are priced at ZeRO-3); DeepEP's
# async dispatch (dispatcher_async_dispatch False: not overlapped, ep_overlap off).
_NEMO_AUTOMODEL = Framework(
    "nemo-automodel", "2025",
    "NVIDIA-NeMo/Automodel v0.2.0 (FSDP2 over Hugging Face models, eager; its own MoE models "
    "with Transformer Engine and DeepEP)",
    "NVIDIA-NeMo/Automodel v0.2.0: nemo_automodel/components/distributed/fsdp2.py "
    "(FSDP2Manager mp_policy, activation_checkpointing False, offload_policy), "
    "components/loss/masked_ce.py (fp32_upcast), _transformers/auto_model.py "
    "(attn_implementation flash_attention_2), recipes/llm/train_ft.py (compile only if set), "
    "components/distributed/cp_utils.py (torch context_parallel); MoE: components/moe/"
    "parallelizer.py (apply_fsdp mp_policy, ignored expert params), components/moe/utils.py "
    "(BackendConfig te, enable_deepep), components/models/deepseek_v3/",
    KernelOptions(stack="eager", sharding="fsdp", fp32_grad_reduce=False, cp_overlap=True,
                  torch_ring=True, optimizer="foreach"),
    # param_dtype bf16 on the dense path too: train_ft's build_model instantiates the model
    # (NeMoAutoModelForCausalLM.from_config: torch_dtype 'auto' -> torch.bfloat16; from_pretrained:
    # 'auto', the checkpoint's dtype, and 65 of the example YAMLs set torch_dtype bf16) and
    # load_base_model's to_empty_parameters_only keeps that dtype; FSDP2Manager's mp_policy
    # (param bf16) casts nothing up: no fp32 master weights (_transformers/auto_model.py,
    # recipes/llm/train_ft.py build_model, components/checkpoint/checkpointing.py)
    # fold_after_weight_pass False: no W pass of its own, torch's schedules as they are
    MemoryOptions(framework="fsdp2", loss="eager", host_offload="fsdp2", zero_stages="automodel",
                  param_dtype="bf16", fold_after_weight_pass=False),
    "bf16",
    expert_parallel="components/moe/parallelizer.py (apply_ep: experts Shard(0) over the moe "
                    "mesh's 'ep' dim; apply_fsdp: experts fully_shard on dim 1 over 'ep_shard' "
                    "when it has more than one rank, else outside FSDP2); components/"
                    "distributed/fsdp2.py _get_moe_mesh (pp, ep_shard, ep): ep folded over the "
                    "dp x cp ranks, ep_shard = dp x cp / ep, no tensor parallelism for its MoE "
                    "models; components/moe/layers.py GroupedExpertsDeepEP with megatron/"
                    "token_dispatcher.py MoEFlexTokenDispatcher over DeepEP's Buffer "
                    "(fused_a2a.py) where deep_ep imports, not overlapped",
    moe_no_tp="components/moe/parallelizer.py parallelize_model asserts \"Tensor parallelism "
              "not supported for custom MoE models\"",
    moe_path=(("fp32_grad_reduce", True), ("reduce_dtype", "fp32"), ("stack", "fused"),
              ("v_width", "native"), ("ep_dispatch", "deepep"),
              ("experts_outside_fsdp", True)))
# GPT-NeoX (EleutherAI/gpt-neox of April 2022, 450b58c4, the 20B release; DeeperSpeed
# eb7f5cff, DeepSpeed 0.3.15's engine): deepspeed@2021's pipeline engine and ZeRO, but the
# softmax and bias-GeLU fusions off (neox_args.py defaults, and every shipped config but
# 20B.yml: scaled-upper-triang-masked-softmax-fusion / bias-gelu-fusion false: eager
# kernels), dropout 0 in every shipped config (the code's default 0.1 is not what its
# configs run), and gpt_j_residual's one all-reduce of the summed attention and MLP outputs
# for a parallel-residual model (residual_reduce_once; gpt_j_residual is the model's flag).
_GPT_NEOX = dataclasses.replace(
    _DEEPSPEED_2021, name="gpt-neox", era="2022",
    models="EleutherAI/gpt-neox April 2022 (DeeperSpeed, DeepSpeed 0.3.15 engine)",
    source="EleutherAI/gpt-neox 450b58c4: megatron/neox_arguments/neox_args.py (fusions off, "
           "pipe_partition_method), configs/*.yml (hidden-dropout 0, fusions false but "
           "20B.yml), megatron/model/transformer.py (gpt_j_residual); requirements "
           "DeeperSpeed eb7f5cff",
    kernel=dataclasses.replace(_DEEPSPEED_2021.kernel, dropout=False, stack="eager",
                               residual_reduce_once=True))
# (no mixture of experts in 2022's main either: deepspeed@2021's layout rule, which cites both)
# llm-foundry (mosaicml/llm-foundry) on Composer with PyTorch FSDP (FSDP1), as its benchmark
# YAMLs run it (scripts/train/benchmarking): amp_bf16 with FSDP mixed precision DEFAULT, the
# MPT model's flash-attn fused cross-entropy (loss_fn fused_crossentropy: the gradient
# overwrites the logits), Composer's DecoupledAdamW; the kernels and their citations are
# bench/published/stacks.py LLM_FOUNDRY_AMP (2024: Composer 0.17.2, reduce_dtype fp32) and
# LLM_FOUNDRY_AMP_2023 (2023: Composer 0.16.3, reduce in bf16). Precision 'PURE' is the
# option pair fp32_grad_reduce = false, reduce_dtype = "bf16". The loss is flash-attn's fused
# cross-entropy (flash_ce: the gpu-flash2 extra's flash-attn 2.4.2 Triton kernels, the gpu
# extra's 1.0.9 xentropy_cuda_lib), and Composer updates ComposerMPTCausalLM's two train
# metrics (LanguageCrossEntropy, LanguagePerplexity) on the logits every micro-batch and
# gathers them over the world every step (train_metrics 2: planner/composer_metrics.py).
# Composer's FSDP is FSDP1 (flat_param: torch 2.1's FlatParameter, views, no copy-out).
_LLM_FOUNDRY_2024 = Framework(
    "llm-foundry", "2024",
    "mosaicml/llm-foundry January 2024 main on Composer 0.17.2 (PyTorch FSDP, amp_bf16)",
    "mosaicml/composer 0.17.2 composer/trainer/mosaic_fsdp_utils.py (get_mixed_precision "
    "DEFAULT: param bf16, reduce fp32), composer/optim/decoupled_weight_decay.py; "
    "llm-foundry llmfoundry/models/mpt/modeling_mpt.py (loss_fn fused_crossentropy, "
    "ComposerMPTCausalLM train metrics), composer/trainer/trainer.py (_eval_train_metrics, "
    "_compute_and_log_metrics), torchmetrics 1.0 utilities/distributed.py gather_all_tensors",
    KernelOptions(fp32_grad_reduce=True, separate_projections=False, stack="eager",
                  optimizer="for-loop", flash_ce=True, train_metrics=2, flat_param=True),
    # Composer's FSDP is llm-foundry's only parallelism then, and its FFNs are dense: no tp, pp
    # or MoE (plan_rules_stack 'llm-foundry', which cites the code)
    MemoryOptions(framework="fsdp2", loss="flash-ce", host_offload="composer",
                  zero_stages="composer", layouts="llm-foundry",
                  fold_after_weight_pass=False), "fp32")
_LLM_FOUNDRY_2023 = dataclasses.replace(
    _LLM_FOUNDRY_2024, era="2023",
    models="mosaicml/llm-foundry v0.3.0 (September 2023) on Composer 0.16.3 (amp_bf16)",
    source="mosaicml/composer 0.16.3 mosaic_fsdp_utils.py: DEFAULT leaves reduce_dtype None, "
           "which FSDP1 reads as param_dtype bf16 (composer#2047 to #2628)",
    kernel=dataclasses.replace(_LLM_FOUNDRY_2024.kernel, fp32_grad_reduce=False),
    reduce_dtype="bf16")

# allenai/OLMo-core v1.3-v1.5 (8c03ca8a21 of 2024-09-26 to 41400c46fc of 2024-11-01), as
# its official training scripts run it (src/scripts/train/OLMo-{1B,7B,13B}.py, Llama-8B.py over
# src/olmo_core/internal/experiment.py): where all four scripts agree the preset takes their
# value, elsewhere the library's default. Read at both commits (the same at each):
# - FSDP2 (nn/transformer/model.py apply_fsdp, "adapted from" torchtitan's
#   parallelize_llama.py): fully_shard per block, every block but the last resharded after
#   forward (zero 3), the root module (embedding, final norm, head) one more unit; no host
#   offload, no ZeRO-1/2 (zero_stages / host_offload 'olmo-core'); HSDP where the experiment
#   has more than one node (init_hybrid_shard_mesh: --dp-replicate). The trainer's
#   micro-batch loop turns gradient sync off for DDP only (train/trainer.py
#   _train_microbatch_context): FSDP2 reduce-scatters every micro-batch;
# - MixedPrecisionPolicy(param bf16, reduce fp32): every script's
#   TransformerDataParallelConfig(param_dtype bfloat16, reduce_dtype float32); fp32 sharded
#   parameters (TransformerConfig dtype float32);
# - compile=True in every script: per-block torch.compile (apply_compile), and with compile
#   TransformerConfig.llama_like turns flash-attn and fused ops off: PyTorch SDPA, RMSNorm in
#   Python (nn/layer_norm.py RMSNorm: fp32 cast, pow, mean, rsqrt, weight, cast back), compiled
#   inside the blocks, eager for the final norm (eager_norm 'python'); RoPE on real sin / cos
#   tables (nn/rope.py: complex_rope False); separate w_q / w_k / w_v and w1 / w2 / w3
#   (nn/attention.py, nn/feed_forward.py); K/V repeated per query head for SDPA under GQA
#   (attention.py repeat_interleave: gqa_copies); activation checkpointing off in every
#   script, its selected_ops mode torchtitan's op policy (activations 'alternate-matmul');
# - torch.optim.AdamW(fused=True) (every script's AdamWConfig fused=True; optim/adamw.py
#   AdamWConfig.optimizer is torch.optim.AdamW); GradClipperCallback(max_grad_norm 1.0)
#   through nn.utils.clip_grad_norm_ (experiment.py; train/callbacks/grad_clipper.py);
# - z-loss: every script sets z_loss_multiplier 1e-5 (z_loss); the model returns fp32 logits
#   (model.py `self.w_out(h).float()`: logits_fp32); the loss is F.cross_entropy on them
#   unless TrainerConfig.fused_loss (default False; OLMo-7B / 13B / Llama-8B set it True, 1B
#   does not), which is `flash_ce = true` (its triton/cross_entropy_loss.py, flash-attn's
#   kernel, inplace_backward False: memory loss 'flash-ce');
# - FP8 (Float8Config, --model.float8_config.enabled=true): torchao Float8Linear on every
#   Linear but the head (convert_to_float8_training modules_to_ignore {'w_out'}), dynamic
#   scaling of input, weight and grad output (float8.py: fp8_scaling 'torchao-tensorwise'),
#   enable_fsdp_float8_all_gather (fp8_fsdp_gather: FSDP2 gathers the FP8 weights in FP8) and
#   precompute_float8_dynamic_scale_for_fsdp True (one amax all-reduce of every weight after
#   the optimizer step, train/callbacks/float8_handler.py: not priced).
# Host-side work the planner prices for no stack: the cancel check's gloo all-reduce every
# cancel_check_interval steps in a thread, metrics moved to the host every
# metrics_collect_interval steps, gc.collect(1) every 1,000 steps (GarbageCollectorCallback).
_OLMO_CORE_2024 = Framework(
    "olmo-core", "2024",
    "allenai/OLMo-core v1.3-v1.5 (September-November 2024; FSDP2, per-block torch.compile) as "
    "its official training scripts run it",
    "allenai/OLMo-core 8c03ca8a21 and 41400c46fc: src/olmo_core/nn/transformer/model.py "
    "(apply_fsdp, apply_compile, forward's fp32 logits), nn/transformer/config.py (llama_like: "
    "no flash-attn or fused ops under compile), nn/layer_norm.py, nn/rope.py, nn/attention.py, "
    "train/trainer.py (get_losses, z-loss, micro-batch loop), nn/functional/"
    "cross_entropy_loss.py, float8.py, optim/adamw.py; src/scripts/train/*.py (compile, "
    "param bf16 / reduce fp32, fused AdamW, z_loss_multiplier)",
    KernelOptions(stack="compiled", sharding="fsdp", fp32_grad_reduce=True, optimizer="fused",
                  eager_norm="python", complex_rope=False, separate_projections=True,
                  fp8_filter="all", fp8_scaling="torchao-tensorwise", fp8_fsdp_gather=True,
                  z_loss=True, logits_fp32=True,
                  # no MLA model in OLMo-core v1.3-v1.5 (nn/attention.py); SDPA's flash
                  # kernels take one head size, as for meshtron's model: inert
                  v_width="padded"),
    # activations: TransformerActivationCheckpointingMode.selected_ops wraps each block with
    # nn/utils.py selective_checkpointing_context_fn, torchtitan's op policy ("adapted from"
    # parallelize_llama.py: mm, SDPA and reduce-scatter outputs saved, every second mm
    # recomputed): the torchtitan preset's list. No script sets ac_config (AC off).
    # fold_after_weight_pass False: no W pass of its own, torch's schedules as they are
    MemoryOptions(framework="fsdp2", activations="alternate-matmul", loss="eager",
                  gqa_copies=True, host_offload="olmo-core", zero_stages="olmo-core",
                  layouts="olmo-core-2024", fold_after_weight_pass=False), "fp32")

PRESETS: dict[str, Framework] = {f"{f.name}@{f.era}": f for f in (
    _MESHTRON, _TORCHTITAN_2024, _TORCHTITAN, _MEGATRON_2021, _MEGATRON_2024, _MEGATRON_BRIDGE,
    _NEMO_AUTOMODEL, _DEEPSPEED_2021, _DEEPSPEED_2024, _GPT_NEOX, _LLM_FOUNDRY_2023,
    _LLM_FOUNDRY_2024, _OLMO_CORE_2024)}
"""Every preset by NAME@ERA."""
