"""The config.json meshtron writes for a spec: the keys transformers' configuration class of
the model type reads back into the same architecture (and meshtron's hf_config.py reads back
into the same spec). Keys as transformers 5.25's configuration_<type>.py names them; both
RoPE spellings (`rope_parameters`, transformers >= 5; `rope_theta` / `rope_scaling`, 4.x).
No torch here."""

from __future__ import annotations

from typing import Any

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM",
        "nemotron": "NemotronForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
        "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
        "granitemoe": "GraniteMoeForCausalLM",
        "granitemoeshared": "GraniteMoeSharedForCausalLM"}


def hf_config(spec: Any, dtype: str, mtype: str) -> dict[str, Any]:
    """A config.json of model type `mtype` (meshtron/hf/layouts.py resolved it) for `spec`."""
    if mtype == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": spec.hidden, "n_layer": spec.layers, "n_head": spec.heads,
                "n_inner": spec.ffn_hidden, "n_positions": spec.max_seq,
                "vocab_size": spec.vocab, "layer_norm_epsilon": spec.norm_eps,
                "activation_function": ("gelu" if spec.gelu_approximate == "none"
                                        else "gelu_new"), "tie_word_embeddings": True,
                "torch_dtype": dtype, "dtype": dtype}
    cfg: dict[str, Any] = {
        "architectures": [ARCH[mtype]],
        "model_type": mtype,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn_hidden,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "num_hidden_layers": spec.layers,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": (spec.rope_original_max_seq if spec.rope_type == "dynamic"
                                    else spec.max_seq),
        "rms_norm_eps": spec.norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta
        # and rope_scaling.
        "rope_theta": spec.rope_theta,
        "rope_parameters": rope_parameters(spec),
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if spec.rope_type != "default":
        cfg["rope_scaling"] = {k: v for k, v in cfg["rope_parameters"].items()
                               if k not in ("rope_theta", "partial_rotary_factor")}
    if spec.is_moe:
        cfg.update(_moe(spec, mtype))
    else:
        cfg.update(_DENSE.get(mtype, lambda s: {})(spec))
    if spec.rope_fraction != 1:
        cfg["partial_rotary_factor"] = spec.rope_fraction
        cfg["rope_parameters"]["partial_rotary_factor"] = spec.rope_fraction
    return cfg


def _window(spec: Any) -> dict[str, Any]:
    return {"sliding_window": spec.sliding_window or None,
            "use_sliding_window": bool(spec.sliding_window)}


def _granite_scales(spec: Any) -> dict[str, Any]:
    """transformers' Granite: embeddings x embedding_multiplier, softmax scale
    attention_multiplier, branches x residual_multiplier, logits / logits_scaling."""
    return {"embedding_multiplier": spec.embed_scale,
            "attention_multiplier": (spec.attn_scale if spec.attn_scale is not None
                                     else spec.head_dim ** -0.5),
            "residual_multiplier": spec.residual_scale,
            "logits_scaling": 1.0 / spec.logit_scale}


def _gemma3(spec: Any) -> dict[str, Any]:
    """Gemma 3: softmax scale query_pre_attn_scalar**-0.5; a window on all blocks but every
    window_every-th (layer_types); the sliding blocks' RoPE base nested per layer type."""
    every = spec.window_every
    kinds = ["full_attention" if not spec.sliding_window or (every and (i + 1) % every == 0)
             else "sliding_attention" for i in range(spec.layers)]
    local = spec.rope_local_theta if spec.rope_local_theta is not None else spec.rope_theta
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _scalar(spec),
            "sliding_window": spec.sliding_window or None, "layer_types": kinds,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_local_base_freq": local,
            "rope_parameters": {"full_attention": rope_parameters(spec),
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": local}},
            "attention_bias": False}


def _scalar(spec: Any) -> float | int:
    """Gemma's query_pre_attn_scalar (an int field of Gemma3TextConfig) from the scale."""
    if spec.attn_scale is None:
        return spec.head_dim
    value = spec.attn_scale ** -2
    return round(value) if abs(value - round(value)) < 1e-6 * value else value


_DENSE = {
    "llama": lambda s: {"attention_bias": False, "mlp_bias": False},
    "mistral": lambda s: {"sliding_window": s.sliding_window or None},
    "qwen2": lambda s: qwen_window(s, "qwen2"),
    "qwen3": lambda s: dict(qwen_window(s, "qwen3"), attention_bias=False),
    "granite": lambda s: dict(_granite_scales(s), attention_bias=False, mlp_bias=False),
    "phi3": lambda s: {"sliding_window": s.sliding_window or None, "pad_token_id": None},
    "nemotron": lambda s: {"hidden_act": "relu2", "norm_eps": s.norm_eps,
                           "partial_rotary_factor": s.rope_fraction,
                           "attention_bias": s.bias, "mlp_bias": s.bias},
    "starcoder2": lambda s: {"hidden_act": "gelu_pytorch_tanh", "norm_epsilon": s.norm_eps,
                             "use_bias": s.bias, "sliding_window": s.sliding_window or None},
    "gemma3_text": _gemma3,
    "olmo2": lambda s: {"attention_bias": False},
}


def qwen_window(spec: Any, mtype: str) -> dict[str, Any]:
    """Qwen's window keys (model/hf_variants.py qwen_window reads them back): the blocks that
    slide as transformers' `layer_types` (Qwen3-MoE has none: every block), and the
    `max_window_layers` that gives the same blocks where transformers derives them from it
    (Qwen2/Qwen3: blocks from it on; Qwen2-MoE: the even blocks below it)."""
    if not spec.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None}
    out: dict[str, Any] = {"use_sliding_window": True, "sliding_window": spec.sliding_window}
    slides = [spec.slides(i) for i in range(spec.layers)]
    if mtype != "qwen3_moe":
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
        out["max_window_layers"] = (max(i for i, s in enumerate(slides) if s) + 1
                                    if mtype == "qwen2_moe" else slides.index(True))
    return out


def _moe(spec: Any, mtype: str) -> dict[str, Any]:
    out: dict[str, Any] = {"num_local_experts": spec.moe_experts,
                           "num_experts": spec.moe_experts,
                           "num_experts_per_tok": spec.moe_top_k,
                           "router_aux_loss_coef": spec.moe_aux_loss,
                           "use_sliding_window": False, "sliding_window": None}
    if mtype in ("mixtral", "olmoe", "granitemoe", "granitemoeshared"):  # experts that wide
        out["intermediate_size"] = spec.moe_ffn_hidden
    if mtype == "mixtral":  # MixtralAttention's window, in every block (hf_config.py)
        out["sliding_window"] = spec.sliding_window or None
    if mtype in ("qwen2_moe", "qwen3_moe"):
        out.update(qwen_window(spec, mtype))
    if mtype in ("qwen3_moe", "qwen2_moe"):
        out.update(moe_intermediate_size=spec.moe_ffn_hidden,
                   decoder_sparse_step=spec.moe_layer_step,
                   mlp_only_layers=list(spec.moe_mlp_only_layers),
                   norm_topk_prob=spec.moe_norm_topk)
    if mtype == "qwen3_moe":
        out["attention_bias"] = False
    if mtype == "qwen2_moe":
        out.update(qkv_bias=spec.qkv_bias, shared_expert_intermediate_size=(
            spec.moe_shared_experts * spec.moe_ffn_hidden))
    if mtype == "olmoe":
        out.update(norm_topk_prob=spec.moe_norm_topk, clip_qkv=None, attention_bias=False)
    if mtype in ("granitemoe", "granitemoeshared"):
        out.update(_granite_scales(spec), attention_bias=False)
    if mtype == "granitemoeshared":
        out["shared_intermediate_size"] = spec.moe_shared_experts * spec.moe_ffn_hidden
    return out


def rope_parameters(spec: Any) -> dict[str, Any]:
    """config.json's `rope_parameters` (transformers >= 5 spelling) for `spec`'s RoPE."""
    out: dict[str, Any] = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type == "default":
        return out
    out["factor"] = spec.rope_factor
    if spec.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = spec.rope_original_max_seq
    if spec.rope_type == "llama3":
        out.update(low_freq_factor=spec.rope_low_freq_factor,
                   high_freq_factor=spec.rope_high_freq_factor)
    if spec.rope_type == "yarn":
        out.update(beta_fast=spec.rope_beta_fast, beta_slow=spec.rope_beta_slow,
                   truncate=spec.rope_truncate)
        if spec.rope_attention_factor is not None:
            out["attention_factor"] = spec.rope_attention_factor
    return out
