"""Which stack options meshtron's own runtime runs: one decision for every option field the
planner takes (KernelOptions, MemoryOptions but the plan's dtype and the search's split_priced,
and the framework's reduce_dtype), read from the runtime's code (meshtron/model,
meshtron/parallel, meshtron/train). `RUNTIME_OPTIONS[name]` = (the values the runtime runs, or
ANY; what it does, with the code that does it). plan_rules_runtime.options_runtime_problems
refuses every other value under framework meshtron (part of THE validity function,
plan_rules.plan_problems); tests/test_runtime_options.py fails on a field with no decision.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ANY = None
"""Every value the field takes is run (or is a measurement, not a choice of the code)."""

_KERNEL = {
    "attention": (("flash",), "runs SDPA's fused kernels (F.scaled_dot_product_attention, "
                  "flex_attention for documents: model/attention.py), never materialised "
                  "scores"),
    "dropout": ((False,), "builds no dropout (model/transformer.py)"),
    "overlap_grad_reduce": ((True,), "reduces each FSDP2 unit's gradients on FSDP's own "
                            "stream as its backward ends (parallel/data_parallel.py)"),
    "fp32_grad_reduce": ((False,), "keeps no fp32 main_grad buffer: FSDP2 reduces in "
                         "plan.reduce_dtype (MixedPrecisionPolicy, parallel/data_parallel.py; "
                         "--reduce-dtype)"),
    "p2p_scatter_gather": ((False,), "sends each stage's output as the rank holds it "
                           "(torch.distributed.pipelining, parallel/pipeline.py): with sp=false "
                           "every tensor rank sends the whole replicated activation "
                           "(parallel/tensor.py), no scatter/gather over the tensor group"),
    "p2p_blocking": ((False,), "runs torch.distributed.pipelining's batched isend/irecv "
                     "(parallel/pipeline.py)"),
    "stack": (("eager", "compiled"), "runs eager modules, or compiled per block as the "
              "plan's compile=true (--compile, parallel/compile.py; the search marks a "
              "compiled plan so), no fused Megatron / Transformer Engine kernels"),
    "shard_units_per_layer": ((1,), "wraps one FSDP2 unit per block (parallel/"
                              "data_parallel.py fully_shard)"),
    "reduce_units_per_layer": ((None,), "reduce-scatters once per FSDP2 unit "
                               "(parallel/data_parallel.py)"),
    "prefetch_params": ((None,), "prefetches the next FSDP2 unit whole (FSDP2's implicit "
                        "prefetch)"),
    "max_live_params": ((None,), "has no live-parameter limit (FSDP2)"),
    "live_embedding": ((False,), "gathers and frees the embedding as any FSDP2 unit "
                       "(parallel/data_parallel.py)"),
    "recompute_regathers": ((False,), "gathers each unit once for its recomputed forward and "
                            "backward (FSDP2's pre-backward unshard)"),
    "fp8_filter": (("torchao",), "converts the block Linears torchao's size thresholds "
                   "admit (parallel/fp8.py)"),
    "fp8_scaling": (("torchao",), "scales FP8 by plan.fp8_recipe with torchao's float8 "
                    "(parallel/fp8.py; --fp8-recipe)"),
    "fp8_gemm": (("cublas",), "runs torch._scaled_mm with per-tensor or per-row scales "
                 "(torchao, parallel/fp8.py), no block-scaled GEMMs"),
    "fp8_split_accum_bwd": ((True,), "takes torchao's from_recipe_name config, fast "
                            "accumulation in the forward GEMM only (parallel/fp8.py)"),
    "separate_projections": ((True,), "builds separate wq/wk/wv and w1/w3 Linears "
                             "(model/transformer.py)"),
    "fp8_param_gather": ((False,), "keeps no Transformer Engine FP8 parameters "
                         "(parallel/fp8.py: torchao float8)"),
    "list_collectives": ((False,), "gathers and reduces with FSDP2's flat collectives"),
    "sharding": (("fsdp",), "shards with FSDP2 at every ZeRO stage (parallel/"
                 "data_parallel.py)"),
    "fp32_params_autocast": ((False,), "gathers bf16 compute copies (FSDP2 "
                             "MixedPrecisionPolicy param_dtype, parallel/data_parallel.py)"),
    "tp_comm_overlap": ((False,), "runs DTensor's tensor-parallel collectives, none "
                        "overlapped with its GEMM (parallel/tensor.py)"),
    "async_tp": ((False,), "runs torch's async TP only as the plan's async_tp = true "
                 "(parallel/api.py, parallel/compile.py enable_async_tp)"),
    "cp_overlap": ((False,), "all-gathers K/V before attention, exposed "
                   "(parallel/context.py)"),
    "complex_rope": ((False,), "applies RoPE as real half-split rotations "
                     "(model/rope.py)"),
    "torch_ring": ((False,), "runs its own all-gather context parallelism, not torch's "
                   "ring attention (parallel/context.py)"),
    "ep_overlap": ((False,), "runs the expert all-to-alls on the compute stream, exposed "
                   "(parallel/expert.py)"),
    "ep_node_limit": ((0,), "sends every one of a token's top-k rows (all_to_all_single, "
                      "parallel/expert.py), no per-node deduplication"),
    "ep_dispatch": (("bf16",), "dispatches with torch's all_to_all_single of the routed rows "
                    "as held (parallel/expert.py): no FP8 dispatch, DeepEP or HybridEP"),
    "expert_routing": (("spread",), "routes with a learned gate (model/moe.py), not a fake "
                       "balanced one"),
    "expert_imbalance": (ANY, "(a measurement of the router's load: `meshtron calibrate`)"),
    "router_dtype": (("bf16",), "runs the gate's GEMM in the compute dtype and only then "
                     "casts the logits to fp32 (model/moe.py Router: gate(x).float())"),
    "expert_capacity": ((0.0,), "is dropless: every token reaches its k experts, no "
                        "capacity factor (model/moe.py)"),
    "expert_capacity_pad": ((True,), "pads no expert's rows: it is dropless (model/moe.py), "
                            "so the option's default, inert without expert_capacity, is the "
                            "only value it takes"),
    "p2p_overlap": ((False,), "receives just before the compute (torch.distributed."
                    "pipelining's schedules)"),
    "eager_norm": (("aten",), "runs torch.nn.RMSNorm / F.rms_norm (model/transformer.py)"),
    "megatron_linear": ((False,), "runs autograd's conjugate DTensor collectives "
                        "(parallel/tensor.py)"),
    "optimizer": (("fused",), "builds torch.optim.AdamW(fused=True) on CUDA "
                  "(train/optim.py)"),
    "grad_clip": ((False, True), "clips by the run's optim.grad_clip (train/parallel.py; "
                  "the planner takes it from the config in train/planning.py)"),
    "grad_accum_fusion": ((False,), "accumulates micro-batch gradients in FSDP2 / autograd, "
                          "a separate add"),
    "zero1_all_reduce": ((False,), "runs ZeRO-1 as FSDP2's reduce-scatter "
                         "(parallel/data_parallel.py)"),
    "p2p_grads_whole": ((False,), "has no DeepSpeed pipe engine (parallel/pipeline.py)"),
    "residual_reduce_once": ((False,), "reduces each parallel-residual branch "
                             "(RowwiseParallel, parallel/tensor.py)"),
    "score_bias_copy": ((False,), "materialises no attention bias (model/attention.py)"),
    "flash_unpad": ((False,), "calls SDPA on padded batches, no flash-attn unpad "
                    "(model/attention.py)"),
    "flash_isa": (("native",), "runs SDPA's kernels for the device (model/attention.py)"),
    "v_width": (("padded",), "pads MLA's V to the q/k head size for SDPA (model/mla.py)"),
    "launch_blocking": ((False,), "sets no CUDA_LAUNCH_BLOCKING (train/launch.py)"),
    "vocab_parallel_ce": ((False,), "computes the loss with its chunked cross-entropy or "
                          "under loss_parallel (model/loss.py, parallel/tensor.py)"),
    "grad_bucket_passes": ((0,), "reduces with FSDP2, no Megatron bucket norm or scaling "
                           "pass (parallel/data_parallel.py)"),
    "flash_ce": ((False,), "has no flash-attn cross-entropy (model/loss.py)"),
    "flat_param": ((False,), "runs FSDP2's per-parameter DTensors, not FSDP1 "
                   "(parallel/data_parallel.py)"),
    "train_metrics": ((0,), "updates no train metrics on the logits (train/metrics.py "
                      "records the loss and the step clock)"),
    "fp8_fsdp_gather": ((False,), "decides torchao's FP8 all-gather by itself from the plan's "
                        "fp8_recipe under fp8_scaling 'torchao' (parallel/fp8.py)"),
    "z_loss": ((False,), "adds no z-loss to its cross-entropy (model/loss.py)"),
    "logits_fp32": ((False,), "has no fused loss over a model's fp32 logits: its chunked "
                    "cross-entropy casts chunk by chunk (model/loss.py)"),
}

_MEMORY = {
    "framework": (("fsdp2",), "keeps FSDP2's memory layout (parallel/data_parallel.py)"),
    "activations": ((None, "eager"), "saves what eager autograd saves (its recomputation: "
                    "parallel/recompute.py), no Megatron or torchtitan saved-tensor list"),
    "loss": ((None, "chunked"), "runs its chunked cross-entropy (model/loss.py)"),
    "gqa_copies": ((False,), "hands SDPA K/V at kv width (enable_gqa, model/attention.py)"),
    "fused_norm": ((True,), "runs torch.nn.RMSNorm, one fused kernel on CUDA "
                   "(model/transformer.py)"),
    "moe_weighted_act": ((False,), "weights the experts' rows at the combine "
                         "(model/moe.py)"),
    "recompute_norms": ((False,), "recomputes whole blocks or its selective policy's ops, "
                        "never the norms alone (parallel/recompute.py)"),
    "recompute_up_proj": ((False,), "recomputes whole blocks or its selective policy's ops, "
                          "never MLA's up-projections alone (parallel/recompute.py)"),
    "swiglu_recompute": ((False,), "keeps SwiGLU's input and output in the compute dtype "
                         "(model/transformer.py, parallel/recompute.py)"),
    "attn_out_e5m6": ((False,), "keeps no E5M6 cache (model/attention.py)"),
    "bf16_moments": ((False,), "keeps AdamW's moments in the fp32 parameters' dtype "
                     "(train/optim.py)"),
    "master_weights": (("fp32",), "trains the fp32 FSDP2 parameters themselves "
                       "(parallel/data_parallel.py)"),
    "grads_at_first_backward": ((False,), "accumulates as FSDP2 does (no ZeRO buffer)"),
    "fold_after_weight_pass": ((True,), "folds each zero-bubble W pass's gradients into "
                               "FSDP2's accumulator (parallel/pipeline.py fold_weight_grads)"),
    "param_dtype": (("fp32",), "keeps fp32 sharded parameters (parallel/data_parallel.py)"),
    "experts_outside_fsdp": ((False,), "wraps the experts in FSDP2 at every group size "
                             "(parallel/data_parallel.py)"),
    "expandable_segments": ((False,), "sets no PYTORCH_ALLOC_CONF (train/launch.py)"),
    "pipeline_split": ((None, "any"), "cuts stages at plan.stage_layers, any split "
                       "(parallel/pipeline.py)"),
    "host_offload": ((None, "any", "fsdp2"), "offloads with FSDP2's CPUOffloadPolicy only "
                     "(parallel/offload.py)"),
    "zero_stages": ((None, "any", "all"), "runs ZeRO 0-3 (parallel/data_parallel.py)"),
    "layouts": ((None, "any"), "runs every tp / pp / MoE layout the plan rules allow"),
    "half_counts": ((None, "part"), "checkpoints every second block of each model part "
                    "(parallel/recompute.py)"),
}

RUNTIME_OPTIONS: dict[str, tuple[tuple[Any, ...] | None, str]] = {
    **_KERNEL, **_MEMORY,
    "reduce_dtype": (("fp32", "bf16"), "reduces in plan.reduce_dtype (FSDP2 "
                     "MixedPrecisionPolicy, parallel/data_parallel.py)"),
}
"""Every option field: (values meshtron's runtime runs, or ANY; what it does, and where)."""

NOT_OPTIONS = ("dtype", "split_priced")
"""MemoryOptions fields that are no stack option: the plan's dtype, the search's split."""


def runs(value: Any, allowed: tuple[Any, ...] | None) -> bool:
    """Whether `value` is one the runtime runs (a bool matches only a bool: False is no 0)."""
    return allowed is ANY or any(value == a and isinstance(value, bool) == isinstance(a, bool)
                                 for a in allowed)


def shown(value: Any) -> str:
    """A value as an options file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    return repr(value)


def option_values(kernel: Any, memory: Any, reduce_dtype: str) -> dict[str, Any]:
    """Every option field's value the planner prices with: the KernelOptions `kernel`, the
    MemoryOptions `memory` (but NOT_OPTIONS) and the gradient reduction dtype."""
    values = {**dataclasses.asdict(kernel), **dataclasses.asdict(memory)}
    for name in NOT_OPTIONS:
        values.pop(name, None)
    return {**values, "reduce_dtype": reduce_dtype}
