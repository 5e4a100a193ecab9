"""Parallelisms per priced stack (part of THE validity function, plan_rules.plan_problems):
the tensor, pipeline and context parallelism, sequence parallelism, recomputation modes and
mixture-of-experts models a stack's code at the preset's version cannot run, keyed by the
preset's `MemoryOptions.layouts` as the ZeRO rule keys its stages (plan_rules_zero). Imports
nothing of meshtron.

Keys of a stack's entry: 'tp', 'pp', 'cp' (any size > 1 refused), 'sp' (sequence parallelism
refused), 'selective' (recompute 'selective' refused), 'half' (the stack's partial
recomputation counts layers per model chunk: recompute 'half' refused where the largest chunk
holds fewer than two layers, which no per-chunk count can split), 'tp-zero3' (tp > 1 with ZeRO
3 refused), 'moe' (mixture-of-experts models refused).

A refused mixture of experts is refused whatever the layout: pricing it with every expert
replicated on each rank would price code that did not exist.
"""

from __future__ import annotations

_COMPOSER_FSDP = ("llm-foundry trains through Composer's PyTorch FSDP only: ")
_K22 = ("sequence parallelism and selective recomputation came with Korthikanti et al. 2022 "
        "(Megatron-LM commits cfd2e21607 and bbab79f869, 2022-04/05, --sequence-parallel and "
        "--recompute-granularity)")
# Megatron-LM's block recomputation: --activations-checkpoint-method block (since v2.6,
# 3860e99526, 2021-08-27: megatron/model/transformer.py _checkpointed_forward checkpoints
# layers l < activations_checkpoint_num_layers of self.num_layers, the chunk's own count);
# Megatron-Core's recompute_method 'block' with recompute_num_layers (core_v0.12.0, d580efc6:
# megatron/core/transformer/transformer_block.py, num_layers_per_pipeline_rank =
# len(self.layers), the model chunk's own layers, `layer_idx < recompute_num_layers` in
# _checkpointed_forward). One N of each chunk's L layers: 'half' (N = L / 2) needs L >= 2.
_BLOCK_2021 = ("--activations-checkpoint-method block recomputes N of each model chunk's own "
               "layers (--activations-checkpoint-num-layers, counted per chunk: Megatron-LM "
               "v2.6 3860e99526 megatron/model/transformer.py)")
_BLOCK_CORE = ("recompute_method 'block' recomputes N of each model chunk's own layers "
               "(recompute_num_layers, counted per chunk: Megatron-Core core_v0.12.0 d580efc6 "
               "megatron/core/transformer/transformer_block.py)")
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
               "first, switch_mlp.py, came in 2023-10, megatron/core/transformer/moe/ in 2024)",
        "cp": "Megatron-LM of 2021 has no context parallelism (--context-parallel-size came "
              "with Megatron-Core, commit 80590f9894 of 2023-08, core_v0.4.0)",
        "sp": "Megatron-LM of 2021 has no sequence parallelism: " + _K22,
        "selective": "Megatron-LM of 2021 recomputes whole layers only "
                     "(--checkpoint-activations): " + _K22,
        "half": _BLOCK_2021},
    "megatron-core": {"half": _BLOCK_CORE},
    "deepspeed-2021": {
        "moe": "DeepSpeed 0.3.15 has no mixture of experts (deepspeed/moe/ came with "
               "DeepSpeed-MoE, DeepSpeed#1310, v0.5.0), nor has GPT-NeoX's 2022 main on it "
               "(MoE reached main in gpt-neox#1129, 2024-03; the 2022 'moe' branch was never "
               "merged)",
        "cp": "DeepSpeed 0.3.15 with Megatron-DeepSpeed, and GPT-NeoX's 2022 main, have no "
              "context parallelism (each rank attends over whole sequences: Megatron-LM's "
              "came in 2023-08, DeepSpeed-Ulysses in v0.10.2, 2023-08)",
        "sp": "DeepSpeed 0.3.15 with Megatron-DeepSpeed, and GPT-NeoX's April 2022 main, run "
              "Megatron-LM's 2021 layers, before its sequence parallelism: " + _K22,
        "selective": "DeepSpeed 0.3.15 with Megatron-DeepSpeed, and GPT-NeoX's April 2022 "
                     "main, checkpoint whole layers (checkpoint-activations): " + _K22},
    "deepspeed-2024": {
        "sp": "DeepSpeed's tensor parallelism for Hugging Face models (AutoTP training, "
              "deepspeed >= 0.16.4: blogs/huggingface-tp/README.md, docs/_tutorials/"
              "autotp-training.md) shards the linear layers only, no Megatron-style sequence "
              "parallelism",
        "tp-zero3": "DeepSpeed's AutoTP training (deepspeed >= 0.16.4) combines tensor "
                    "parallelism with ZeRO stage 0, 1 or 2 only (docs/_tutorials/"
                    "autotp-training.md)"},
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
"""What each stack's code cannot run: {'tp' | 'pp' | 'cp' | 'sp' | 'selective' | 'half' |
'tp-zero3' | 'moe': why (its code)} (module docstring)."""
LAYOUT_RULES = ("any",) + tuple(STACK_LAYOUTS)
"""MemoryOptions.layouts values; 'any' (no stack named): every layout is priced."""


def layout_problem(rule: str | None, tp: int | None = None, pp: int | None = None,
                   moe_model: str | None = None, stack: str | None = None,
                   cp: int | None = None, sp: bool | None = None,
                   recompute: str | None = None, zero: int | None = None,
                   chunk_layers: int | None = None) -> str | None:
    """A parallelism, recomputation or model the priced stack's code cannot run, one line
    naming the field, its value, the stack, why and what is allowed, or None (`rule`:
    MemoryOptions.layouts; `moe_model`: the model's name when it is a mixture of experts;
    `stack`: its name for the message; `chunk_layers`: the layers of the plan's largest model
    chunk, `most_chunk_layers`). Unknown values (None) are not held against it."""
    limits = STACK_LAYOUTS.get(rule or "", {})
    who = f" on {stack}" if stack else ""
    if moe_model and "moe" in limits:
        return (f"--model {moe_model} (a mixture of experts){who}: {limits['moe']}; "
                "allowed: dense models")
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp)):
        if name in limits and isinstance(size, int) and size > 1:
            return f"plan.{name}={size}{who}: {limits[name]}; allowed: {name}=1"
    if "sp" in limits and sp is True:
        return f"plan.sp=true{who}: {limits['sp']}; allowed: sp=false"
    if "selective" in limits and recompute == "selective":
        return (f"plan.recompute='selective'{who}: {limits['selective']}; allowed: none, "
                "full" + (", half" if "half" not in limits else ", half with 2+ layers per "
                          "model chunk"))
    if ("half" in limits and recompute == "half" and isinstance(chunk_layers, int)
            and chunk_layers < 2):
        return (f"plan.recompute='half'{who} with {chunk_layers} layer per model chunk: "
                f"{limits['half']}; half of one layer is none or all of it; allowed: none, "
                "full, or 'half' with fewer pipeline stages or virtual stages (2+ layers "
                "per chunk)")
    if "tp-zero3" in limits and zero == 3 and isinstance(tp, int) and tp > 1:
        return (f"plan.zero=3 with plan.tp={tp}{who}: {limits['tp-zero3']}; allowed: zero "
                "0-2 with tp > 1, or tp=1")
    return None


def most_chunk_layers(layers: int, pp: int | None, virtual_stages: int | None,
                      stage_layers=None) -> int | None:
    """The layers of the largest model chunk (a pipeline rank's virtual stage, the whole model
    without a pipeline): the plan's `stage_layers` where given, else an even split of
    `layers` over pp x virtual_stages (an unknown count: 1); None where pp is unknown."""
    if stage_layers:
        return max(stage_layers)
    if not isinstance(pp, int) or pp < 1:
        return None
    chunks = pp * (virtual_stages if isinstance(virtual_stages, int) and virtual_stages > 0
                   else 1)
    return -(-layers // chunks)


__all__ = ["STACK_LAYOUTS", "LAYOUT_RULES", "layout_problem", "most_chunk_layers"]
