"""Hugging Face tensor names <-> meshtron parameter names, and the config.json meshtron writes.

Llama, Mistral and Qwen2 checkpoints store every projection unfused and in the layout meshtron's
model uses (`nn.Linear` [out, in] weights; q/k rows in the half-split "rotate_half" RoPE order
that meshtron's `apply_rope` uses), so the mapping is one name to one name and a rank can read
exactly the rows and columns it owns. GPT-2 (Conv1D [in, out] weights, q/k/v fused in one matrix)
and GPT-NeoX (q/k/v fused and interleaved per head) would need a transform per tensor; they are
refused by name here rather than loaded wrongly.
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
"""model_type values whose weights load and export."""

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors that are derived buffers, not weights (older Llama conversions)."""


def check_supported(spec: ModelSpec, where: str) -> str:
    """The model_type meshtron reads and writes for `spec` (llama or qwen2); a UserError
    naming `where` for GPT-style models."""
    if spec.mlp != "swiglu" or spec.norm != "rmsnorm" or spec.position != "rope" or spec.bias \
            or spec.parallel_residual:
        raise UserError(f"{where}: Hugging Face weights are supported for Llama-style models "
                         f"(model_type {', '.join(SUPPORTED_TYPES)}); model {spec.name!r} is "
                         "GPT-style")
    return "qwen2" if spec.qkv_bias else "llama"


def meshtron_to_hf(spec: ModelSpec) -> dict[str, str]:
    """Every meshtron parameter name (tied weights once, as `named_parameters` gives them) ->
    its Hugging Face tensor name."""
    out: dict[str, str] = {"tok_embeddings.weight": _TOP["tok_embeddings.weight"]}
    for i in range(spec.layers):
        for ours, theirs in _LAYER.items():
            if ours.endswith(".bias") and not spec.qkv_bias:
                continue
            out[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    out["norm.weight"] = _TOP["norm.weight"]
    if not spec.tied_embeddings:
        out["output.weight"] = _TOP["output.weight"]
    return out


def is_ignorable(hf_name: str, spec: ModelSpec) -> bool:
    """A checkpoint tensor meshtron may skip: derived buffers, and the output head of a tied
    model (some writers store the shared matrix twice)."""
    return hf_name.endswith(IGNORED_SUFFIXES) or (spec.tied_embeddings
                                                    and hf_name == _TOP["output.weight"])


def hf_config(spec: ModelSpec, dtype: str = "float32") -> dict[str, Any]:
    """A config.json `transformers` reads back into the same architecture."""
    mtype = check_supported(spec, "export")
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if mtype == "qwen2" else "LlamaForCausalLM"],
        "model_type": mtype,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn_hidden,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "num_hidden_layers": spec.layers,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_seq,
        "rms_norm_eps": spec.norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if mtype == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg
