"""ModelSpec's checks of its own fields (model/shapes.py `ModelSpec.__post_init__`): RoPE scaling
and the mixture-of-experts fields, each refusal one line naming the field, its value and what is
allowed. Torch-free (`meshtron plan` imports it)."""

from __future__ import annotations

import math
from typing import Any

from meshtron.errors import UserError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def is_number(value: Any) -> bool:
    """A real number, not a bool (JSON and TOML give both)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rope_scaling(spec: Any) -> None:
    check_choice("model.rope_type", spec.rope_type, ROPE_TYPES)
    if spec.rope_type == "default":
        return
    for field in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_beta_fast", "rope_beta_slow"):
        value = getattr(spec, field)
        if not is_number(value) or not math.isfinite(value) or value <= 0:
            raise UserError(f"model.{field}={value!r}: must be a positive finite number")
    if spec.rope_type in ("dynamic", "yarn") and spec.rope_factor < 1:
        raise UserError(f"model.rope_factor={spec.rope_factor!r}: must be at least 1 for "
                         f"rope_type {spec.rope_type!r}")
    original = spec.rope_original_max_seq
    if spec.rope_type != "linear" and (not isinstance(original, int) or isinstance(original, bool)
                                       or original <= 0):
        raise UserError(f"model.rope_original_max_seq={original!r}: must be a positive integer "
                         f"for rope_type {spec.rope_type!r}")
    # equal factors (Llama 4 Scout: 1.0 and 1.0) leave no band to interpolate: a step
    if spec.rope_type == "llama3" and spec.rope_high_freq_factor < spec.rope_low_freq_factor:
        raise UserError(f"model.rope_high_freq_factor={spec.rope_high_freq_factor!r}: must "
                         f"be at least model.rope_low_freq_factor={spec.rope_low_freq_factor!r}")
    factor = spec.rope_attention_factor
    if factor is not None and (not is_number(factor) or not math.isfinite(factor) or factor <= 0):
        raise UserError(f"model.rope_attention_factor={factor!r}: must be a positive number")
    if not isinstance(spec.rope_truncate, bool):
        raise UserError(f"model.rope_truncate={spec.rope_truncate!r}: must be true or false")


def check_moe(spec: Any) -> None:
    """MoE fields: all zero for a dense model; otherwise experts, top_k, width consistent."""
    for field in ("moe_experts", "moe_top_k", "moe_ffn_hidden", "moe_shared_experts",
                  "moe_dense_layers"):
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative integer")
    if spec.head_size is not None and (not isinstance(spec.head_size, int)
                                       or isinstance(spec.head_size, bool) or spec.head_size <= 0):
        raise UserError(f"model.head_size={spec.head_size!r}: must be a positive integer or null")
    for field in ("qk_norm", "attn_sinks", "moe_shared_gate"):
        if not isinstance(getattr(spec, field), bool):
            raise UserError(f"model.{field}={getattr(spec, field)!r}: must be true or false")
    _check_lists(spec)
    if not spec.is_moe:
        return
    if spec.mlp != "swiglu":
        raise UserError(f"model.mlp={spec.mlp!r}: MoE experts are SwiGLU; use mlp 'swiglu'")
    if not 1 <= spec.moe_top_k <= spec.moe_experts:
        raise UserError(f"model.moe_top_k={spec.moe_top_k!r}: must be between 1 and "
                         f"model.moe_experts={spec.moe_experts}")
    if spec.moe_ffn_hidden <= 0:
        raise UserError(f"model.moe_ffn_hidden={spec.moe_ffn_hidden!r}: must be a positive "
                         "integer for an MoE model")
    if spec.moe_dense_layers >= spec.layers:
        raise UserError(f"model.moe_dense_layers={spec.moe_dense_layers}: must be below "
                         f"model.layers={spec.layers}")
    step = spec.moe_layer_step
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise UserError(f"model.moe_layer_step={step!r}: must be a positive integer")
    if spec.moe_layers == 0:
        raise UserError(f"model.moe_layer_step={step}, moe_mlp_only_layers="
                         f"{list(spec.moe_mlp_only_layers)}: leave no block of the "
                         f"{spec.layers} with routed experts; keep at least one")
    if spec.moe_shared_gate and not spec.moe_shared_experts:
        raise UserError("model.moe_shared_gate=true: gates the shared experts; needs "
                         "model.moe_shared_experts >= 1")
    check_choice("model.moe_router", spec.moe_router, ("softmax", "sigmoid"))
    for field in ("moe_groups", "moe_topk_groups"):
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"model.{field}={value!r}: must be a positive integer")
    if spec.moe_experts % spec.moe_groups:
        raise UserError(f"model.moe_groups={spec.moe_groups}: must divide "
                         f"model.moe_experts={spec.moe_experts}")
    if spec.moe_topk_groups > spec.moe_groups:
        raise UserError(f"model.moe_topk_groups={spec.moe_topk_groups}: must be at most "
                         f"model.moe_groups={spec.moe_groups}")
    if spec.moe_topk_groups * (spec.moe_experts // spec.moe_groups) < spec.moe_top_k:
        raise UserError(f"model.moe_topk_groups={spec.moe_topk_groups}: the chosen groups hold "
                         f"fewer experts than model.moe_top_k={spec.moe_top_k}")
    if spec.moe_groups > 1 and spec.moe_router != "sigmoid":
        raise UserError(f"model.moe_groups={spec.moe_groups}: group-limited routing is "
                         "implemented for moe_router 'sigmoid' (DeepSeek-V3) only")
    for field in ("moe_route_scale", "moe_aux_loss", "moe_bias_update"):
        value = getattr(spec, field)
        if not is_number(value) or not math.isfinite(value) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative number")
    if spec.moe_bias_update and spec.moe_router != "sigmoid":
        raise UserError(f"model.moe_bias_update={spec.moe_bias_update}: bias-based balancing "
                         "needs moe_router 'sigmoid'")


def _check_lists(spec: Any) -> None:
    """The tuple fields (a run file's TOML gives lists: kept as tuples, so specs stay
    hashable and comparable)."""
    for field in ("moe_mlp_only_layers", "window_blocks"):
        blocks = getattr(spec, field)
        if not isinstance(blocks, (list, tuple)) or any(
                not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < spec.layers
                for i in blocks):
            raise UserError(f"model.{field}={blocks!r}: must be a list of block indices "
                            f"from 0 to {spec.layers - 1}")
        object.__setattr__(spec, field, tuple(blocks))
    for field in ("train_refusals", "train_notes"):
        lines = getattr(spec, field)
        if not isinstance(lines, (list, tuple)) or any(not isinstance(r, str) for r in lines):
            raise UserError(f"model.{field}={lines!r}: must be a list of strings")
        object.__setattr__(spec, field, tuple(lines))


def check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise UserError(f"{field}={value!r}: allowed values are {', '.join(allowed)}")
