"""ZeRO stages per priced stack (part of THE validity function, plan_rules.plan_problems): the
`plan.zero` values (plan.py ZERO_STAGES: 0 replicated states, 1 optimizer states sharded,
2 + gradients, 3 + parameters) each stack's code runs, keyed by the preset's
`MemoryOptions.zero_stages` as the offload rule keys host offload (plan_rules_offload).
Imports nothing of meshtron.

Where the planner's terms meet a stack's: Megatron-Core's distributed optimizer shards the fp32
main weights and the optimizer states and reduce-scatters the gradients, yet every rank keeps
the whole gradient buffer (megatron/core/distributed/param_and_grad_buffer.py): zero 1 as
planner/memory_states.state_bytes prices a sharding='zero' stack (gradients sharded only from
zero 2). Every limit holds with dp > 1 only: with one data rank there is nothing to shard.
"""

from __future__ import annotations

STACK_ZEROS: dict[str, tuple[tuple[int, ...], str]] = {
    "all": ((0, 1, 2, 3), "meshtron's runtime runs ZeRO 0-3 (parallel/data_parallel.py)"),
    "megatron-2021": ((0,), "Megatron-LM 2021 (megatron@2021) has no ZeRO: its optimizer "
                      "(megatron/optimizer/optimizer.py, Float16OptimizerWithFloat16Params) "
                      "keeps every optimizer state and fp32 main weight on each data rank; "
                      "the distributed optimizer (--use-distributed-optimizer, "
                      "megatron/optimizer/distrib_optimizer.py) arrived in 2022"),
    "megatron-core": ((0, 1, 2, 3), "Megatron-Core (megatron@2024) runs zero 0 (DDP), 1 (the "
                      "distributed optimizer: optimizer states and fp32 main weights sharded, "
                      "the gradient buffer whole; megatron/core/optimizer/distrib_optimizer.py, "
                      "distributed/param_and_grad_buffer.py) and, with its own FSDP "
                      "(--use-custom-fsdp, megatron/core/distributed/custom_fsdp/, wired into "
                      "NeMo 2025-02; renamed Megatron-FSDP in 0.14), 1-3 "
                      "(data_parallel_sharding_strategy optim, optim_grads, optim_grads_params)"),
    "deepspeed": ((0, 1, 2, 3), "DeepSpeed runs ZeRO stages 0-3 "
                  "(runtime/zero/stage_1_and_2.py, stage3.py)"),
    "torchtitan": ((0, 2, 3), "torchtitan shards with FSDP2 fully_shard (zero 2 with "
                   "reshard_after_forward off, 3 on; HSDP over dp_replicate) or replicates "
                   "with DDP (zero 0), and has no ZeRO-1 "
                   "(torchtitan/models/llama3/infra/parallelize.py)"),
    "automodel": ((0, 3), "NeMo Automodel (nemo-automodel) shards with FSDP2 fully_shard, "
                  "every block resharded after its forward (zero 3; components/distributed/"
                  "parallelizer.py apply_fsdp2_sharding_recursively), or replicates with "
                  "DDPManager (zero 0); no ZeRO-1 or ZeRO-2"),
    "composer": ((0, 2, 3), "llm-foundry's Composer runs PyTorch FSDP sharding_strategy "
                 "NO_SHARD (zero 0), SHARD_GRAD_OP (2), FULL_SHARD (3; HYBRID_SHARD over "
                 "replicas), composer/trainer/mosaic_fsdp_utils.py SHARDING_MAP, or DDP "
                 "(zero 0); no ZeRO-1"),
    "olmo-core": ((0, 3), "OLMo-core v1.3-v1.5 shards with FSDP2 fully_shard, every block but "
                  "the last resharded after its forward (zero 3; HSDP over dp_replicate), or "
                  "replicates with DDP (zero 0): src/olmo_core/nn/transformer/model.py "
                  "apply_fsdp / apply_ddp at 41400c46fc, DataParallelType fsdp | ddp; no "
                  "ZeRO-1 or ZeRO-2")}
"""What each stack runs: (its ZeRO stages, why: its code)."""

PIPELINE_MAX: dict[str, tuple[int, str]] = {
    "deepspeed": (1, "DeepSpeed's PipelineEngine asserts a ZeRO stage below 2 "
                  "(runtime/pipe/engine.py: ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                  "parallelism)"),
    # core_v0.12.0-v0.16.0: docs/source/api-guide/custom_fsdp.md lists TP, EP and CP only, no
    # functional test runs --use-custom-fsdp / --use-megatron-fsdp at pp > 1, the torch FSDP2
    # path asserts pipeline_model_parallel_size == 1 (megatron/training/arguments.py);
    # NVIDIA/Megatron-LM issue #1455 ("Is there any plan to make custom_fsdp compatible with
    # PP?", 2025-03, open) and PR #6486 (2026-08, open: pipeline support for M-FSDP v2)
    "megatron-core": (1, "Megatron-Core shards gradients (zero 2) and parameters (zero 3) "
                      "only with its own FSDP (Megatron-FSDP), which runs with TP, EP and CP "
                      "but not with pipeline parallelism (docs/source/api-guide/"
                      "custom_fsdp.md, core_v0.12-0.16; NVIDIA/Megatron-LM issue #1455 open); "
                      "its distributed optimizer (zero 1) runs with pipelines")}
"""The highest stage the stack runs with pipeline parallelism (pp > 1), and why."""

DDP_ONE_D: dict[str, str] = {
    "torchtitan": "torchtitan's DDP (zero 0) runs only without tensor, context or pipeline "
                  "parallelism (parallelize.py apply_ddp: DDP has not supported > 1D "
                  "parallelism)"}
"""Stacks whose zero 0 (DDP) runs on a data-parallel-only mesh, and why."""

ZERO_RULES = ("any",) + tuple(STACK_ZEROS)
"""MemoryOptions.zero_stages values; 'any' (no stack named): every stage is priced."""


def zero_limit(rule: str | None, zero: int, dp: int | None = None, tp: int | None = None,
               pp: int | None = None, cp: int | None = None) -> str | None:
    """Why the stack does not run ZeRO stage `zero` on this (possibly partial) layout, or None.
    Unknown sizes (None) are not held against it; dp == 1 shards nothing, so any stage goes."""
    if rule not in STACK_ZEROS or not isinstance(zero, int) or dp == 1:
        return None
    stages, why = STACK_ZEROS[rule]
    if zero not in stages:
        return why
    if rule in PIPELINE_MAX and isinstance(pp, int) and pp > 1 and zero > PIPELINE_MAX[rule][0]:
        return PIPELINE_MAX[rule][1]
    if zero == 0 and rule in DDP_ONE_D and any(isinstance(n, int) and n > 1
                                               for n in (tp, pp, cp)):
        return DDP_ONE_D[rule]
    return None


def zero_problem(rule: str | None, zero: int | None, dp: int | None = None,
                 tp: int | None = None, pp: int | None = None, cp: int | None = None,
                 stack: str | None = None) -> str | None:
    """A ZeRO stage the priced stack does not run, one line naming it and what it runs, or
    None (`rule`: MemoryOptions.zero_stages; `stack`: its name for the message)."""
    why = zero_limit(rule, zero, dp, tp, pp, cp) if isinstance(zero, int) else None
    if why is None:
        return None
    who = f" on {stack}" if stack else ""
    ok = [z for z in STACK_ZEROS[rule][0] if zero_limit(rule, z, dp, tp, pp, cp) is None]
    return (f"plan.zero={zero}{who}: {why}; allowed: "
            f"{', '.join(map(str, ok)) or 'none on this layout'}")


__all__ = ["STACK_ZEROS", "PIPELINE_MAX", "DDP_ONE_D", "ZERO_RULES", "zero_limit",
           "zero_problem"]
