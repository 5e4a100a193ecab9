"""Host offload per priced stack (part of THE validity function, plan_rules.plan_problems): the
offload kinds (plan.offload) each stack's code runs, and the least ZeRO stage it runs each
with, keyed by the preset's `MemoryOptions.host_offload` as the split rule keys the schedules
(plan_rules_pipeline.STACK_SCHEDULES). Imports nothing of meshtron.

The kinds (planner/offload.py prices them): 'full' = parameter, gradient and optimizer shards on
the host; 'optimizer' = ZeRO-Offload (Ren et al. 2021): weights on the device, the optimizer
step on the host.
"""

from __future__ import annotations

STACK_OFFLOADS: dict[str, tuple[dict[str, int], str]] = {
    "fsdp2": ({"full": 2}, "meshtron's runtime and torchtitan run only FSDP2's CPUOffloadPolicy "
              "(fully_shard offload_policy: parameter, gradient and optimizer shards on the "
              "host, zero 2-3; meshtron/parallel/offload.py, torchtitan's "
              "training.enable_cpu_offload in models/llama3/infra/parallelize.py)"),
    "none": ({}, "Megatron-LM 2021 (megatron@2021) has no host offload (no offload option in "
             "the 2021 tree's megatron/arguments.py, nor anywhere in megatron/)"),
    "mcore-optimizer": ({"optimizer": 1}, "Megatron-Core (megatron@2024) runs only optimizer "
                        "offload, from 0.12 (--optimizer-cpu-offload: HybridDeviceOptimizer, "
                        "ADLR/megatron-lm!2526, 2025-02; it needs --use-precision-aware-"
                        "optimizer, which needs the distributed optimizer: zero 1; no "
                        "parameter offload; not with Megatron-FSDP, zero 2-3: its DTensor "
                        "parameters fail in get_megatron_optimizer, NVIDIA/Megatron-LM issue "
                        "#1986 'Megatron FSDP does not work with CPU_OFFLOADING', 2025-10, and "
                        "the fix, PR #4623, was still open in 2026-05, after Megatron-Core 0.16)"),
    "zero-offload-2021": ({"optimizer": 2, "full": 3}, "DeepSpeed 0.3.15 (deepspeed@2021) runs "
                          "zero_optimization.cpu_offload with its ZeRO-2 and ZeRO-3 optimizers "
                          "(stage 1's takes none: runtime/engine.py) and cpu_offload_params "
                          "with ZeRO-3 only"),
    "zero-offload": ({"optimizer": 1, "full": 3}, "DeepSpeed 0.14-0.16 (deepspeed@2024) runs "
                     "offload_optimizer with ZeRO-1/2/3 and offload_param with ZeRO-3 only "
                     "(runtime/engine.py, runtime/zero/offload_config.py)"),
    "composer": ({}, "llm-foundry's Composer (0.16-0.17) refuses FSDP CPU offload "
                 "(composer/trainer/mosaic_fsdp_utils.py get_cpu_offload: 'FSDP CPU Offload "
                 "not supported yet.')"),
    "olmo-core": ({}, "OLMo-core v1.3-v1.5 (olmo-core@2024) has no host offload: "
                  "Transformer.apply_fsdp passes fully_shard no offload_policy "
                  "(src/olmo_core/nn/transformer/model.py at 41400c46fc)")}
"""What each stack's host offload runs: {kind: least ZeRO stage}, and why (its code)."""
MOST_ZERO: dict[str, dict[str, int]] = {"mcore-optimizer": {"optimizer": 1}}
"""{rule: {kind: most ZeRO stage}} where a stack's offload stops short of ZeRO-3 (the reason:
STACK_OFFLOADS)."""
OFFLOAD_RULES = ("any",) + tuple(STACK_OFFLOADS)
"""MemoryOptions.host_offload values; 'any' (no stack named): every kind is priced."""
KINDS = ("optimizer", "full")
"""The kinds the search tries, in order: 'optimizer' moves less."""


def offload_kinds(rule: str | None) -> tuple[str, ...]:
    """The host offload kinds the stack runs, in the order the search tries them."""
    if rule is None or rule not in STACK_OFFLOADS:
        return KINDS
    runs = STACK_OFFLOADS[rule][0]
    return tuple(k for k in KINDS if k in runs)


def least_zero(rule: str | None, offload: str | None) -> int:
    """The least ZeRO stage the stack runs host offload `offload` with (0: no limit)."""
    if rule not in STACK_OFFLOADS or offload in (None, "none"):
        return 0
    return STACK_OFFLOADS[rule][0].get(offload, 0)


def most_zero(rule: str | None, offload: str | None) -> int:
    """The highest ZeRO stage the stack runs host offload `offload` with (3: no limit)."""
    if offload in (None, "none"):
        return 3
    return MOST_ZERO.get(rule or "", {}).get(offload, 3)


def offload_problem(rule: str | None, offload: str | None, zero: int | None = None,
                    stack: str | None = None) -> str | None:
    """Host offload the priced stack does not run, one line naming it and what it runs, or
    None (`rule`: MemoryOptions.host_offload; `stack`: its name for the message)."""
    if rule not in STACK_OFFLOADS or offload in (None, "none"):
        return None
    runs, why = STACK_OFFLOADS[rule]
    who = f" on {stack}" if stack else ""
    if offload not in runs:
        allowed = ", ".join(["none"] + [k for k in KINDS if k in runs])
        return f"plan.offload={offload!r}{who}: {why}; allowed: {allowed}"
    if isinstance(zero, int) and zero < runs[offload]:
        return (f"plan.offload={offload!r} with zero={zero}{who}: {why}; use zero "
                f"{runs[offload]} or more")
    high = most_zero(rule, offload)
    if isinstance(zero, int) and zero > high:
        return (f"plan.offload={offload!r} with zero={zero}{who}: {why}; use zero "
                f"{high} or less, or offload 'none'")
    return None


__all__ = ["STACK_OFFLOADS", "MOST_ZERO", "OFFLOAD_RULES", "offload_kinds", "least_zero",
           "most_zero", "offload_problem"]
