"""Dense Hugging Face model types beyond Llama's (qwen3, nemotron, gemma2, gemma3_text, phi3,
olmo2, granite, starcoder2) read into a ModelSpec, each as transformers' modeling code builds
it (models/<type>/modeling_<type>.py); errors name the config's keys.

What each brings (ModelSpec's variant fields, model/hf_variants.py):
- qwen3: Llama with per-head q/k RMSNorm and an explicit head_dim (Qwen3-4B: 128, not 80).
- nemotron: squared-ReLU MLP of two matrices, LayerNorm1P (weight applied as 1 + weight),
  partial rotary embeddings (partial_rotary_factor 0.5).
- gemma2 / gemma3_text: GeGLU (gelu_pytorch_tanh), zero-centred RMSNorm weights, four norms a
  block, embeddings times sqrt(hidden), tied, softmax scale query_pre_attn_scalar**-0.5,
  sliding-window blocks (gemma2 every other one, gemma3 five of six); gemma2 soft-caps
  scores and logits, gemma3 norms q and k per head and has a second RoPE base for the
  sliding blocks.
- phi3: Llama's shapes (q/k/v and gate/up stored fused), optional partial rotary and window.
- olmo2: norms after attention and the MLP (none before), RMSNorm over the whole q and k.
- granite: Llama with embedding, softmax, residual and logit factors.
- starcoder2: GELU MLP and LayerNorm with biases everywhere, sliding window.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from meshtron.errors import UserError
from meshtron.model.hf_variants import qwen_window
from meshtron.model.shapes import ModelSpec, is_number

DENSE_TYPES = ("qwen3", "nemotron", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
               "starcoder2")

_ACT = {"qwen3": "silu", "nemotron": "relu2", "gemma2": "gelu_pytorch_tanh",
        "gemma3_text": "gelu_pytorch_tanh", "phi3": "silu", "olmo2": "silu", "granite": "silu",
        "starcoder2": "gelu_pytorch_tanh"}
_MLP = {"silu": "swiglu", "relu2": "relu2"}
_EPS = {"qwen3": ("rms_norm_eps", 1e-6), "nemotron": ("norm_eps", 1e-5),
        "gemma2": ("rms_norm_eps", 1e-6), "gemma3_text": ("rms_norm_eps", 1e-6),
        "phi3": ("rms_norm_eps", 1e-5), "olmo2": ("rms_norm_eps", 1e-5),
        "granite": ("rms_norm_eps", 1e-6), "starcoder2": ("norm_epsilon", 1e-5)}


def hf_dense(cfg: dict[str, Any], mtype: str, name: str, need, num, flag, opt_int,
             rope: Callable[[dict[str, Any], int], dict[str, Any]]) -> ModelSpec:
    """`rope(cfg, max_pos)`: hf_config._hf_rope's RoPE fields of `cfg` (partial rotary
    taken out here); the other helpers as hf_config's."""
    gemma = mtype in ("gemma2", "gemma3_text")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = opt_int("head_dim", 256 if gemma else 128 if mtype == "qwen3" else None)
    fields: dict[str, Any] = dict(
        name=name, layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
        kv_heads=opt_int("num_key_value_heads", None) or heads,
        ffn_hidden=need("intermediate_size"), vocab=need("vocab_size"),
        head_size=head_dim if head_dim not in (None, hidden // heads) or (
            head_dim and hidden % heads) else None,
        mlp=_mlp(cfg, mtype), norm_eps=num(*_EPS[mtype]),
        tied_embeddings=flag("tie_word_embeddings", gemma or mtype == "starcoder2"))
    fields.update(_biases(cfg, mtype, flag))
    rope_cfg, local_theta = _rope_config(cfg, mtype, num)
    fields.update(rope(rope_cfg, opt_int("max_position_embeddings", 4096)))
    if mtype == "gemma3_text" and "rope_theta" not in cfg and "rope_parameters" not in cfg:
        fields.update(rope_theta=1e6)  # Gemma3TextConfig's default global base
    # transformers' NemotronConfig rotates half of each head unless told otherwise
    fields.update(rope_fraction=_fraction(cfg, 0.5 if mtype == "nemotron" else 1.0))
    fields.update(_window(cfg, mtype, opt_int))
    if mtype == "qwen3":
        fields.update(qwen_window(cfg, mtype, fields["layers"],
                                  opt_int("max_position_embeddings", 4096)), qk_norm=True)
    elif mtype == "nemotron":
        fields.update(norm="layernorm", norm_plus_one=True)
    elif gemma:
        # transformers' Gemma2Config / Gemma3TextConfig default 256, whatever head_dim is
        scalar = num("query_pre_attn_scalar", 256.0)
        fields.update(norm_plus_one=True, norm_layout="sandwich", embed_scale=math.sqrt(hidden),
                      attn_scale=scalar ** -0.5, qk_norm=mtype == "gemma3_text",
                      # transformers' Gemma2Config defaults: 50 and 30 (Gemma 3: none)
                      attn_softcap=_cap(cfg, "attn_logit_softcapping", mtype == "gemma2", 50.0),
                      logit_softcap=_cap(cfg, "final_logit_softcapping", mtype == "gemma2",
                                         30.0),
                      rope_local_theta=local_theta)
    elif mtype == "olmo2":
        fields.update(norm_layout="post", qk_norm=True, qk_norm_whole=True)
    elif mtype == "granite":
        fields.update(embed_scale=num("embedding_multiplier", 1.0),
                      attn_scale=num("attention_multiplier", 1.0),
                      residual_scale=num("residual_multiplier", 1.0),
                      logit_scale=1.0 / num("logits_scaling", 1.0))
    elif mtype == "starcoder2":
        fields.update(mlp="gelu", norm="layernorm")
    return ModelSpec(**fields)


def _mlp(cfg: dict[str, Any], mtype: str) -> str:
    """The MLP kind; the activation must be the one transformers' code for the type gates
    (Gemma reads `hidden_activation`, the rest `hidden_act`)."""
    key = "hidden_activation" if mtype in ("gemma2", "gemma3_text") and \
        cfg.get("hidden_activation") is not None else "hidden_act"
    act = cfg.get(key, _ACT[mtype])
    if act != _ACT[mtype]:
        raise UserError(f"config.json {key}={act!r}: only {_ACT[mtype]!r} is supported for "
                         f"model_type {mtype!r}")
    return "geglu" if act == "gelu_pytorch_tanh" and mtype != "starcoder2" else \
        _MLP.get(act, "gelu")


def _biases(cfg: dict[str, Any], mtype: str, flag) -> dict[str, Any]:
    """StarCoder2's `use_bias` (every Linear, default true); other types' attention_bias /
    mlp_bias: meshtron's model has biases on every Linear or on q/k/v only."""
    if mtype == "starcoder2":
        return {"bias": flag("use_bias", True)}
    attn, mlp = flag("attention_bias", False), flag("mlp_bias", False)
    if attn != mlp:
        key = "attention_bias" if attn else "mlp_bias"
        raise UserError(f"config.json {key}=true: biases on only the attention or only the "
                         "MLP are not supported; both true or both false")
    return {"bias": attn}


def _fraction(cfg: dict[str, Any], default: float) -> float:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    if not is_number(value) or not 0 < value <= 1:
        raise UserError(f"config.json partial_rotary_factor={value!r}: must be in (0, 1]")
    return float(value)


def _rope_config(cfg: dict[str, Any], mtype: str, num) -> tuple[dict[str, Any], Any]:
    """(a copy of `cfg` whose RoPE keys hf_config._hf_rope reads, without the partial factor
    it refuses; Gemma 3's second RoPE base). transformers >= 5 nests Gemma 3's parameters per
    layer type (`rope_parameters.full_attention` / `.sliding_attention`)."""
    out = {k: v for k, v in cfg.items() if k != "partial_rotary_factor"}
    params = cfg.get("rope_parameters")
    local = None
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        out["rope_parameters"] = params["full_attention"]
        sliding = params.get("sliding_attention") or {}
        local = sliding.get("rope_theta") if isinstance(sliding, dict) else None
    elif mtype == "gemma3_text":
        local = num("rope_local_base_freq", 10000.0)
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {k: v for k, v in out["rope_parameters"].items()
                                  if k != "partial_rotary_factor"}
    if local is not None and (not is_number(local) or local <= 0):
        raise UserError(f"config.json rope_local_base_freq={local!r}: must be a positive number")
    return out, (float(local) if local is not None else None)


def _window(cfg: dict[str, Any], mtype: str, opt_int) -> dict[str, Any]:
    """Sliding-window fields: StarCoder2 and Phi-3 slide in every block; Gemma 2 in every
    other block, Gemma 3 in five of six (`sliding_window_pattern`, or transformers >= 4.53's
    `layer_types` list, which must follow such a pattern)."""
    if mtype not in ("gemma2", "gemma3_text", "starcoder2", "phi3"):
        return {}
    gemma = mtype in ("gemma2", "gemma3_text")
    window = opt_int("sliding_window", 4096 if gemma else None)
    if not window:
        return {}
    every = 0
    if gemma:
        every = opt_int("sliding_window_pattern", 2 if mtype == "gemma2" else 6)
        types = cfg.get("layer_types")
        if types is not None:
            every = _pattern(types, cfg.get("num_hidden_layers"))
    return {"sliding_window": window, "window_every": every}


def _pattern(types: Any, layers: Any) -> int:
    """The full-attention period of `layer_types`, one entry per block (transformers'
    layer_type_validation refuses another length; a shorter list was read as a pattern)."""
    ok = isinstance(types, list) and len(types) == layers and all(
        t in ("sliding_attention", "full_attention") for t in types)
    if ok and "full_attention" not in types:
        return 0
    every = types.index("full_attention") + 1 if ok else 0
    if not ok or any((t == "full_attention") != ((i + 1) % every == 0)
                     for i, t in enumerate(types)):
        raise UserError(f"config.json layer_types={types!r}: must be 'sliding_attention' / "
                         f"'full_attention', one per block ({layers}), with a full block "
                         "every N blocks")
    return every


def _cap(cfg: dict[str, Any], key: str, has_default: bool, default: float) -> float:
    """A soft-capping value: absent gives the type's default, null none."""
    value = cfg.get(key, default if has_default else None)
    if value is None:
        return 0.0
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise UserError(f"config.json {key}={value!r}: must be a non-negative number or null")
    return float(value)


_NEOX_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh",
              "gelu_pytorch_tanh": "tanh"}


def neox_fields(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """GPT-NeoX's GELU (transformers' default 'gelu' is the erf form) and partial rotary share
    (`rotary_pct`, or transformers >= 5's `rope_parameters.partial_rotary_factor`; default
    0.25, Pythia's), and a copy of `cfg` for hf_config._hf_rope without the share."""
    act = cfg.get("hidden_act", "gelu")
    if act not in _NEOX_GELU:
        raise UserError(f"config.json hidden_act={act!r}: allowed values for model_type "
                         f"'gpt_neox' are {', '.join(_NEOX_GELU)}")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    key = ("rope_parameters.partial_rotary_factor" if "partial_rotary_factor" in params
           else "rotary_pct")
    pct = params.get("partial_rotary_factor", cfg.get("rotary_pct"))
    pct = 0.25 if pct is None else pct
    if not is_number(pct) or not 0 < pct <= 1:
        raise UserError(f"config.json {key}={pct!r}: must be in (0, 1]")
    rope_cfg, _ = _rope_config(cfg, "gpt_neox", None)
    return {"gelu_approximate": _NEOX_GELU[act], "rope_fraction": float(pct)}, rope_cfg
