"""Parallelisms per priced stack (part of THE validity function, plan_rules.plan_problems):
the tensor parallelism, pipeline parallelism and mixture-of-experts models a stack's code at
the preset's version cannot run, keyed by the preset's `MemoryOptions.layouts` as the ZeRO rule
keys its stages (plan_rules_zero). Imports nothing of meshtron.

A refused mixture of experts is refused whatever the layout: pricing it with every expert
replicated on each rank would price code that did not exist.
"""

from __future__ import annotations

_COMPOSER_FSDP = ("llm-foundry trains through Composer's PyTorch FSDP only: ")
STACK_LAYOUTS: dict[str, dict[str, str]] = {
    "llm-foundry": {
        "tp": _COMPOSER_FSDP + "no tensor parallelism in llm-foundry before its TP support "
              "(llm-foundry#1521, 2024-09; Composer's tp_config, composer#3269, 2024-05)",
        "pp": _COMPOSER_FSDP + "no pipeline parallelism in llm-foundry or Composer",
        "moe": "llm-foundry before its MegaBlocks MoE (llm-foundry#1102, 2024-04) has no "
               "mixture of experts: llmfoundry/models/layers/ffn.py ffn_type is mptmlp, mptglu "
               "or te_ln_mlp"},
    "megatron-2021": {
        "moe": "Megatron-LM of 2021 has no mixture of experts (nothing under megatron/; its "
               "first, switch_mlp.py, came in 2023-10, megatron/core/transformer/moe/ in 2024)"},
    "deepspeed-2021": {
        "moe": "DeepSpeed 0.3.15 has no mixture of experts (deepspeed/moe/ came with "
               "DeepSpeed-MoE, DeepSpeed#1310, v0.5.0), nor has GPT-NeoX's 2022 main on it "
               "(MoE reached main in gpt-neox#1129, 2024-03; the 2022 'moe' branch was never "
               "merged)"},
    "torchtitan-2024": {
        "moe": "torchtitan of December 2024 has no mixture-of-experts model (torchtitan/models/ "
               "is llama only; its first, DeepSeek-V3, came in torchtitan#830, 2025-02)"},
    "olmo-core-2024": {
        "tp": "OLMo-core v1.3-v1.5 has data parallelism only (FSDP2 / HSDP or DDP: "
              "src/olmo_core/nn/transformer/config.py TransformerConfig.build at 41400c46fc); "
              "no tensor parallelism",
        "pp": "OLMo-core v1.3-v1.5 has no pipeline engine (apply_fsdp's pp_enabled flag only; "
              "nothing under src/olmo_core/distributed/ at 41400c46fc)",
        "cp": "OLMo-core v1.3-v1.5 has no context parallelism (attention.py runs SDPA or "
              "flash-attn on the whole sequence at 41400c46fc)",
        "moe": "OLMo-core v1.3-v1.5's mixture of experts is a wrapper around MegaBlocks' MoE "
               "layers (src/olmo_core/nn/moe/ at 41400c46fc, their own expert parallelism), "
               "which the olmo-core@2024 preset does not price"}}
"""What each stack's code cannot run: {'tp' | 'pp' | 'cp' | 'moe': why (its code)}."""
LAYOUT_RULES = ("any",) + tuple(STACK_LAYOUTS)
"""MemoryOptions.layouts values; 'any' (no stack named): every layout is priced."""


def layout_problem(rule: str | None, tp: int | None = None, pp: int | None = None,
                   moe_model: str | None = None, stack: str | None = None,
                   cp: int | None = None) -> str | None:
    """A parallelism or model the priced stack's code cannot run, one line naming the field,
    its value, why and what is allowed, or None (`rule`: MemoryOptions.layouts; `moe_model`:
    the model's name when it is a mixture of experts; `stack`: its name for the message).
    Unknown sizes (None) are not held against it."""
    limits = STACK_LAYOUTS.get(rule or "", {})
    who = f" on {stack}" if stack else ""
    if moe_model and "moe" in limits:
        return (f"--model {moe_model} (a mixture of experts){who}: {limits['moe']}; "
                "allowed: dense models")
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp)):
        if name in limits and isinstance(size, int) and size > 1:
            return f"plan.{name}={size}{who}: {limits[name]}; allowed: {name}=1"
    return None


__all__ = ["STACK_LAYOUTS", "LAYOUT_RULES", "layout_problem"]
