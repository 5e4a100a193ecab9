"""Which Hugging Face model_type's tensor names hold a ModelSpec's weights, and those names.

A spec read from a config.json does not remember its `model_type`; the type whose tensors
hold its weights is read from its fields (`infer_type`: the one type that expresses them,
e.g. partial rotary embeddings need Phi-3, a post-norm layout OLMo 2). Where a config.json
names the type (the checkpoint folder's own, or the source config an export keeps), that
type is taken when it expresses the spec (`resolve_type`: Phi-3 also expresses Llama's and
Mistral's fields, Granite Llama's with unit multipliers, Granite MoE Mixtral's).

Names as transformers 5.x `save_pretrained` writes them (its checkpoint conversions reverted:
per-expert tensors for Mixtral / Qwen-MoE / OLMoE, Granite MoE's fused `input_linear`),
read from models/<type>/modeling_<type>.py and conversion_mapping.py of transformers 5.25:
- Phi-3 (Phi3Attention, Phi3MLP): q | k | v rows fused in `qkv_proj`, gate | up rows in
  `gate_up_proj`.
- Nemotron (NemotronMLP): `up_proj` then squared ReLU then `down_proj` (no gate);
  LayerNorm1P norms with biases.
- StarCoder2 (Starcoder2MLP): `c_fc`, `c_proj`; biases on every Linear and LayerNorm.
- Gemma 3 (Gemma3DecoderLayer): input / post_attention / pre_feedforward /
  post_feedforward norms; OLMo 2 (Olmo2DecoderLayer): post_attention / post_feedforward only.
- Granite MoE (GraniteMoeParallelExperts): `input_linear` [experts, 2 x width, hidden] with
  the gate's rows first (`chunk(2, dim=-1)`, the first half through SiLU), `output_linear`
  [experts, hidden, width], `router.layer`; granitemoeshared's shared expert
  (GraniteMoeSharedMLP) `shared_mlp.input_linear` [gate | up rows, hidden] and
  `shared_mlp.output_linear`.
- Qwen2-MoE: `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate`.
No torch here (`meshtron plan` and `--help` import meshtron.hf.names).
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import UserError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "nemotron",
              "starcoder2", "gemma3_text", "olmo2")
MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "granitemoeshared")
SUPPORTED_TYPES = LLAMA_LIKE + ("gpt2",) + MOE_TYPES
"""model_type values whose weights load and export."""

EXPRESSES = {"mistral": ("llama",), "phi3": ("llama", "mistral"), "granite": ("llama",),
             "granitemoe": ("mixtral",), "qwen2_moe": ("mixtral",),
             "granitemoeshared": ("granitemoe", "mixtral")}
"""A declared type (a config.json's model_type) may hold the weights of specs read as these
types too: its modeling code computes the same function with its defaults."""

# meshtron module (inside block i) -> Hugging Face module (inside model.layers.i.)
_BASE = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_MODULES: dict[str, dict[str, str]] = {
    "nemotron": dict(_BASE, **{"feed_forward.w1": "mlp.up_proj"}),
    "starcoder2": dict(_BASE, **{"feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}),
    "gemma3_text": dict(_BASE, **{"attention_post_norm": "post_attention_layernorm",
                                  "ffn_norm": "pre_feedforward_layernorm",
                                  "ffn_post_norm": "post_feedforward_layernorm"}),
    "olmo2": dict(_BASE, **{"attention_post_norm": "post_attention_layernorm",
                            "ffn_post_norm": "post_feedforward_layernorm"}),
}
# MoE blocks: (router, per-expert prefix, (w1, w3, w2) leaf names) of each model type.
_MOE_LAYER = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
}
_MOE_LAYER["qwen2_moe"] = _MOE_LAYER["olmoe"] = _MOE_LAYER["qwen3_moe"]


def block_params(spec: Any, i: int) -> list[str]:
    """The names of block i's parameters in meshtron's model (model/transformer.py, moe.py),
    counted from the spec as the modules create them."""
    out = [f"attention.{p}.weight" for p in ("wq", "wk", "wv", "wo")]
    if spec.bias or spec.qkv_bias:
        out += [f"attention.{p}.bias" for p in ("wq", "wk", "wv")]
    if spec.bias:
        out.append("attention.wo.bias")
    if spec.qk_norm:
        out += ["attention.q_norm.weight", "attention.k_norm.weight"]
    norms = (["attention_norm", "ffn_norm"] if spec.norm_layout != "post" else []) + (
        ["attention_post_norm", "ffn_post_norm"] if spec.norm_layout != "pre" else [])
    for n in norms:
        out += [f"{n}.weight"] + ([f"{n}.bias"] if spec.norm == "layernorm" else [])
    if spec.is_moe_layer(i):
        out += ["feed_forward.router.gate.weight"] + [
            f"feed_forward.experts.{w}.weight" for w in ("w1", "w3", "w2")]
        if spec.moe_shared_experts:
            out += [f"feed_forward.shared.{w}.weight" for w in ("w1", "w3", "w2")]
        if spec.moe_shared_gate:
            out.append("feed_forward.shared.gate.weight")
        return out
    for w in ("w1", "w3", "w2") if spec.gated_mlp else ("w1", "w2"):
        out += [f"feed_forward.{w}.weight"] + ([f"feed_forward.{w}.bias"] if spec.bias else [])
    return out


def hf_module(mtype: str, module: str) -> str | None:
    """The Hugging Face module of meshtron block module `module` for `mtype` (None: none)."""
    return _MODULES.get(mtype, _BASE).get(module)


def moe_names(mtype: str) -> tuple[str, str, tuple[str, str, str]]:
    return _MOE_LAYER[mtype]


def _scaled(spec: Any) -> bool:
    """Granite's multipliers away from 1 (the softmax scale set explicitly counts too)."""
    return (spec.embed_scale != 1 or spec.residual_scale != 1 or spec.logit_scale != 1
            or spec.attn_scale is not None)


def _refuse(where: str, spec: Any, why: str) -> UserError:
    return UserError(f"{where}: Hugging Face weights of model {spec.name!r} are not read or "
                     f"written: {why}; supported model types are {', '.join(SUPPORTED_TYPES)}")


def infer_type(spec: Any, where: str) -> str:
    """The model_type whose checkpoints hold `spec`'s weights; a one-line UserError naming
    `where` and what no supported type expresses."""
    if getattr(spec, "is_mla", False):
        # DeepSeek's checkpoints interleave the rotary dimensions (their rotary key's rows of
        # kv_a_proj_with_mqa would need permuting into meshtron's half-split layout): not wired
        raise UserError(f"{where}: Hugging Face weights of multi-head latent attention "
                         f"(DeepSeek-V2/V3, model {spec.name!r}) are not supported yet; train "
                         "from scratch or use a model without kv_lora_rank")
    if spec.attn_softcap or spec.logit_softcap:
        raise _refuse(where, spec, "soft-capping (Gemma 2, model.attn_softcap / "
                      "model.logit_softcap) is not trained by meshtron's runtime")
    if spec.attn_chunk:
        raise _refuse(where, spec, "chunked attention (Llama 4, model.attn_chunk) is not "
                      "trained by meshtron's runtime")
    if spec.parallel_residual:
        raise _refuse(where, spec, "GPT-NeoX's per-head fused q/k/v (model.parallel_residual)"
                      " is not wired")
    if spec.position == "learned":
        if (spec.mlp == "gelu" and spec.norm == "layernorm" and spec.bias
                and spec.tied_embeddings and spec.heads == spec.kv_heads and not spec.is_moe
                and _plain_attention(spec)):
            return "gpt2"
        raise _refuse(where, spec, "learned positions are GPT-2's only (model.position)")
    if spec.is_moe:
        return _moe_type(spec, where)
    return _dense_type(spec, where)


def _plain_attention(spec: Any) -> bool:
    return (not spec.qk_norm and spec.norm_layout == "pre" and not spec.norm_plus_one
            and spec.rope_fraction == 1 and not spec.sliding_window and not _scaled(spec))


def _dense_type(spec: Any, where: str) -> str:
    checks = [  # (type, it applies, what the type needs of the spec else)
        ("nemotron", spec.mlp == "relu2",
         spec.norm == "layernorm" and spec.norm_plus_one and spec.norm_layout == "pre"
         and not spec.qk_norm and not spec.sliding_window and not _scaled(spec)),
        ("starcoder2", spec.mlp == "gelu",
         spec.norm == "layernorm" and not spec.norm_plus_one and spec.norm_layout == "pre"
         and not spec.qk_norm and spec.rope_fraction == 1 and not spec.window_every
         and not spec.window_blocks and not _scaled(spec) and spec.gelu_approximate == "tanh"
         and (spec.bias or not spec.qkv_bias)),
        ("gemma3_text", spec.norm_layout == "sandwich",
         spec.mlp == "geglu" and spec.norm_plus_one and spec.qk_norm
         and not spec.qk_norm_whole and spec.tied_embeddings and not spec.bias
         and not spec.qkv_bias and spec.rope_fraction == 1 and spec.residual_scale == 1
         and not spec.window_blocks
         # Gemma3TextScaledWordEmbedding: embeddings times hidden_size**0.5, always
         and spec.logit_scale == 1 and abs(spec.embed_scale - spec.hidden ** 0.5) < 1e-9
         * spec.embed_scale),
        ("olmo2", spec.norm_layout == "post",
         spec.mlp == "swiglu" and spec.qk_norm_whole and not spec.norm_plus_one
         and not spec.bias and not spec.qkv_bias and not spec.sliding_window
         and spec.rope_fraction == 1 and not _scaled(spec)),
    ]
    for mtype, applies, ok in checks:
        if applies:
            if not (ok and spec.norm == ("rmsnorm" if mtype in ("gemma3_text", "olmo2")
                                         else "layernorm")):
                raise _refuse(where, spec, f"its fields are {mtype}'s in part only")
            return mtype
    llama = (spec.mlp == "swiglu" and spec.norm == "rmsnorm" and spec.norm_layout == "pre"
             and not spec.norm_plus_one and not spec.bias and not spec.qk_norm_whole)
    if not llama:
        raise _refuse(where, spec, "no supported type has its mlp / norm / bias fields")
    if _scaled(spec) or spec.qk_norm or spec.qkv_bias:
        kind = ("granite" if _scaled(spec) and not spec.qk_norm and not spec.qkv_bias
                else "qwen3" if spec.qk_norm and not _scaled(spec) and not spec.qkv_bias
                else "qwen2" if not _scaled(spec) and not spec.qk_norm else None)
        if kind is None or spec.rope_fraction != 1 or (spec.sliding_window
                                                        and kind not in WINDOW_TYPES):
            raise _refuse(where, spec, "no supported type combines its qk_norm / qkv_bias / "
                          "multipliers / rope_fraction / sliding_window")
        return kind
    if spec.rope_fraction != 1 or spec.window_every or spec.window_blocks:
        if spec.window_every or spec.window_blocks:
            raise _refuse(where, spec, "a window on some blocks only is Gemma's or Qwen's")
        return "phi3"
    return "mistral" if spec.sliding_window else "llama"


def _moe_type(spec: Any, where: str) -> str:
    plain = (spec.mlp == "swiglu" and spec.norm == "rmsnorm" and spec.norm_layout == "pre"
             and not spec.norm_plus_one and not spec.bias and spec.rope_fraction == 1
             and not spec.window_every and spec.moe_router == "softmax"
             and spec.moe_route_scale == 1.0 and not spec.moe_dense_layers)
    if not plain:
        raise _refuse(where, spec, "mixtures of experts load as mixtral, qwen3_moe, qwen2_moe, "
                      "olmoe or granitemoe(shared) (a sigmoid router, dense first blocks, "
                      "windows or LayerNorms are none of them)")
    pattern = spec.moe_layer_step != 1 or bool(spec.moe_mlp_only_layers)
    shared = bool(spec.moe_shared_experts)
    if spec.qk_norm_whole:
        ok = not (shared or pattern or spec.qkv_bias or _scaled(spec))
        kind = "olmoe"
    elif _scaled(spec) or (shared and not spec.moe_shared_gate):
        ok = not (spec.moe_shared_gate or pattern or spec.qkv_bias or spec.qk_norm) \
            and spec.moe_norm_topk
        kind = "granitemoeshared" if shared else "granitemoe"
    elif spec.qk_norm:
        ok = not (shared or spec.qkv_bias)
        kind = "qwen3_moe"
    elif shared or spec.qkv_bias or pattern or not spec.moe_norm_topk:
        ok = not shared or spec.moe_shared_gate
        kind = "qwen2_moe"
    else:  # softmax top-k renormalised, every block routed: Mixtral's router and names
        ok, kind = True, "mixtral"
    if not ok:
        raise _refuse(where, spec, f"its experts' fields are {kind}'s in part only")
    if spec.sliding_window and kind not in WINDOW_TYPES:
        raise _refuse(where, spec, f"a sliding window is no field of {kind}")
    if spec.window_blocks and spec.sliding_window and kind != "qwen2_moe":
        raise _refuse(where, spec, f"a window on some blocks (model.window_blocks) is no "
                      f"field of {kind}")
    return kind


WINDOW_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen2", "qwen3")
"""The MoE and Qwen types whose config.json says where the window is (configs.py): Mixtral
and Qwen3-MoE in every block, Qwen2/Qwen3/Qwen2-MoE on the blocks its layer_types lists."""


def resolve_type(spec: Any, declared: Any, where: str) -> str:
    """The type whose names hold `spec`'s weights: `declared` (a config.json's model_type)
    where it expresses the spec, else the inferred one; a declared type that cannot hold the
    spec is one line naming both."""
    inferred = infer_type(spec, where)
    if declared is None or declared == inferred:
        return inferred
    if declared in SUPPORTED_TYPES and inferred in EXPRESSES.get(declared, ()):
        return declared
    allowed = (inferred,) + tuple(t for t, held in EXPRESSES.items() if inferred in held)
    raise UserError(f"{where}: config.json model_type={declared!r} does not hold model "
                    f"{spec.name!r}, whose fields read as model_type {inferred!r}; allowed: "
                    f"{', '.join(allowed)}")
