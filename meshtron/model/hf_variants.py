"""The dense variants Hugging Face configs bring (Gemma, Nemotron, OLMo 2, Granite, StarCoder2,
Phi-3): their ModelSpec fields' checks, and what meshtron's runtime does not compute.

The planner prices every field here; the runtime (model/transformer.py) computes the cheap and
exact ones (squared ReLU, GeGLU, zero-centred norm weights, sandwich and post norms, embedding,
residual and logit factors, the softmax scale, partial rotary embeddings, sliding windows:
model/attention.py window_attention) and `runtime_problem` names the rest in one line at
`meshtron train`. No torch here: `meshtron plan` imports this.
"""

from __future__ import annotations

import math
from typing import Any

from meshtron.errors import UserError

NORM_LAYOUTS = ("pre", "sandwich", "post")


def check_variants(spec: Any) -> None:
    """The variant fields' own values (ModelSpec.__post_init__)."""
    if spec.gelu_approximate not in ("tanh", "none"):
        raise UserError(f"model.gelu_approximate={spec.gelu_approximate!r}: allowed values are "
                        "tanh, none")
    if spec.norm_layout not in NORM_LAYOUTS:
        raise UserError(f"model.norm_layout={spec.norm_layout!r}: allowed values are "
                        f"{', '.join(NORM_LAYOUTS)}")
    for field in ("qk_norm_whole", "norm_plus_one"):
        if not isinstance(getattr(spec, field), bool):
            raise UserError(f"model.{field}={getattr(spec, field)!r}: must be true or false")
    if spec.qk_norm_whole and not spec.qk_norm:
        raise UserError("model.qk_norm_whole=true: needs model.qk_norm=true")
    fraction = spec.rope_fraction
    if not _positive(fraction) or fraction > 1:
        raise UserError(f"model.rope_fraction={fraction!r}: must be in (0, 1]")
    for field in ("embed_scale", "residual_scale", "logit_scale"):
        if not _positive(getattr(spec, field)):
            raise UserError(f"model.{field}={getattr(spec, field)!r}: must be a positive number")
    for field in ("attn_scale", "rope_local_theta"):
        value = getattr(spec, field)
        if value is not None and not _positive(value):
            raise UserError(f"model.{field}={value!r}: must be a positive number or null")
    for field in ("attn_softcap", "logit_softcap"):
        value = getattr(spec, field)
        if not _number(value) or not math.isfinite(value) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative number (0: none)")
    for field in ("sliding_window", "window_every", "attn_chunk", "chunk_every"):
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative integer")
    if spec.window_every and not spec.sliding_window:
        raise UserError(f"model.window_every={spec.window_every}: needs a sliding_window")
    if spec.window_blocks and (not spec.sliding_window or spec.window_every):
        raise UserError(f"model.window_blocks={list(spec.window_blocks)}: needs a "
                        "sliding_window and window_every=0 (the list says which blocks slide)")
    if spec.chunk_every and not spec.attn_chunk:
        raise UserError(f"model.chunk_every={spec.chunk_every}: needs an attn_chunk")
    if spec.attn_chunk and spec.sliding_window:
        raise UserError(f"model.attn_chunk={spec.attn_chunk}: chunked attention with a "
                        f"sliding_window ({spec.sliding_window}) is not a model meshtron "
                        "describes; set one of them to 0")


QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def qwen_window(cfg: Any, mtype: str, layers: int, max_pos: int) -> dict[str, Any]:
    """ModelSpec's window fields of a Qwen config.json with `use_sliding_window` true, as
    transformers 5.25 builds the model: `sliding_window` (class default 4096) on the blocks
    transformers' `layer_types` marks 'sliding_attention' (Qwen2Config / Qwen3Config: from
    block `max_window_layers` (default 28) on; Qwen2MoeConfig: the even blocks below it;
    Qwen3MoeAttention: every block). No sliding block, or a window no shorter than
    max_position_embeddings: full causal attention, no field. The runtime computes the
    window on exactly those blocks (Transformer's Attention asks ModelSpec.slides)."""
    use = cfg.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise UserError(f"config.json use_sliding_window={use!r}: must be true or false")
    window = cfg.get("sliding_window", 4096)
    if not use or window in (None, 0):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UserError(f"config.json sliding_window={window!r}: must be a positive integer "
                        "or null")
    blocks = _qwen_sliding_blocks(cfg, mtype, layers)
    if not blocks or window >= max_pos:
        return {}
    if len(blocks) == layers:
        return {"sliding_window": window}
    return {"sliding_window": window, "window_blocks": tuple(blocks)}


def _qwen_sliding_blocks(cfg: Any, mtype: str, layers: int) -> list[int]:
    types = cfg.get("layer_types") if mtype != "qwen3_moe" else None
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(
                t not in ("sliding_attention", "full_attention") for t in types):
            raise UserError(f"config.json layer_types={types!r}: must be 'sliding_attention' "
                            f"/ 'full_attention', one per block ({layers})")
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if mtype == "qwen3_moe":
        return list(range(layers))
    first = cfg.get("max_window_layers", 28)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise UserError(f"config.json max_window_layers={first!r}: must be a non-negative "
                        "integer")
    if mtype == "qwen2_moe":
        return [i for i in range(min(first, layers)) if i % 2 == 0]
    return list(range(first, layers))


def runtime_problem(spec: Any) -> str | None:
    """One line naming the first field meshtron's runtime does not compute exactly, with
    its value and what is allowed; None when the runtime trains `spec` (sliding windows
    with packed documents and context parallelism included: model/attention.py,
    parallel/context.py)."""
    if spec.attn_chunk:
        return (f"model.attn_chunk={spec.attn_chunk}: chunked attention (Llama 4 "
                "attention_chunk_size) is priced by the planner but meshtron's runtime does "
                "not compute it; only 0")
    if spec.attn_softcap or spec.logit_softcap:
        field = "attn_softcap" if spec.attn_softcap else "logit_softcap"
        return (f"model.{field}={getattr(spec, field)}: soft-capping (Gemma 2) is priced by "
                "the planner but meshtron's runtime does not compute it; only 0")
    return None  # qk_norm_whole's limit to tp=1 is a plan rule (plan_rules.model_problems)


def local_rope(spec: Any) -> bool:
    """The sliding blocks rotate with a base of their own (Gemma 3)."""
    return bool(spec.sliding_window and spec.sliding_blocks and spec.rope_local_theta is not None
                and spec.rope_local_theta != spec.rope_theta)


def check_runtime(spec: Any) -> None:
    """`runtime_problem` as a UserError (meshtron train, Transformer)."""
    problem = runtime_problem(spec)
    if problem:
        raise UserError(problem)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and value > 0
