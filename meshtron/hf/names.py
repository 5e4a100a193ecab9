"""Hugging Face tensor names <-> meshtron parameter names, and the config.json meshtron writes.

Llama, Mistral and Qwen2 checkpoints store every projection unfused and in the layout meshtron's
model uses (`nn.Linear` [out, in] weights; q/k rows in the half-split "rotate_half" RoPE order
that meshtron's `apply_rope` uses): one name to one name, and a rank reads exactly the rows and
columns it owns. GPT-2 stores Conv1D weights transposed ([in, out]) and q, k, v fused in one
`c_attn` matrix (columns q | k | v): a meshtron tensor is then a transposed column range of the
Hugging Face one (`Source.transpose`, `Source.offset`), still read as a box. GPT-NeoX fuses
q/k/v interleaved per head (and often rotates part of each head only); it is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe")
"""model_type values whose weights load and export."""


@dataclass(frozen=True)
class Source:
    """Where a meshtron tensor lives in a Hugging Face checkpoint."""

    name: str
    """The Hugging Face tensor."""
    transpose: bool = False
    """The Hugging Face tensor is stored [in, out] (GPT-2's Conv1D): meshtron's rows are its
    columns."""
    offset: int = 0
    """First row of the meshtron tensor inside a fused Hugging Face tensor (in meshtron's
    orientation: a column offset of the stored tensor when `transpose`)."""
    stacked: tuple[str, ...] = ()
    """MoE experts: the meshtron tensor [experts, out, in] stacks these per-expert Hugging Face
    tensors (expert e is `stacked[e]`; `name` is the first). A rank holding experts e0..e1
    reads only theirs."""


_LLAMA_LAYER = {
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
LM_HEAD = "lm_head.weight"

IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Checkpoint tensors that are derived buffers, not weights (older Llama conversions' RoPE
frequencies, old GPT-2 files' causal-mask buffers)."""


# MoE blocks: (router, per-expert prefix, (w1, w3, w2) names) of each model type.
_MOE_LAYER = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.",
                ("w1.weight", "w3.weight", "w2.weight")),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.",
                  ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
}


def check_supported(spec: ModelSpec, where: str) -> str:
    """The model_type meshtron reads and writes for `spec` (llama, qwen2, gpt2, mixtral or
    qwen3_moe); a UserError naming `where` for other architectures."""
    from meshtron.model.hf_variants import variant_fields

    if variant_fields(spec):  # Gemma, Nemotron, OLMo 2, Granite...: their names are not wired
        raise UserError(f"{where}: Hugging Face weights of model {spec.name!r} (model."
                         f"{', model.'.join(variant_fields(spec))}) are not read or written "
                         "yet; train it from scratch")
    llama_like = (spec.mlp == "swiglu" and spec.norm == "rmsnorm" and spec.position == "rope"
                  and not spec.bias and not spec.parallel_residual)
    if getattr(spec, "is_mla", False):
        # DeepSeek's checkpoints interleave the rotary dimensions (their rotary key's rows of
        # kv_a_proj_with_mqa would need permuting into meshtron's half-split layout): not wired
        raise UserError(f"{where}: Hugging Face weights of multi-head latent attention "
                         f"(DeepSeek-V2/V3, model {spec.name!r}) are not supported yet; train "
                         "from scratch or use a model without kv_lora_rank")
    if spec.is_moe:
        plain = (spec.moe_router == "softmax" and not spec.moe_shared_experts
                 and not spec.moe_dense_layers and spec.moe_route_scale == 1.0
                 and spec.moe_layer_step == 1 and not spec.moe_mlp_only_layers)
        if llama_like and plain and not spec.qkv_bias and not spec.qk_norm and \
                spec.head_size is None and spec.moe_norm_topk:
            return "mixtral"
        if llama_like and plain and not spec.qkv_bias and spec.qk_norm:
            return "qwen3_moe"
        raise UserError(f"{where}: Hugging Face weights of mixtures of experts are supported for "
                         f"model_type mixtral and qwen3_moe; model {spec.name!r} has another "
                         "architecture (DeepSeek-V3's sigmoid router, shared experts or dense "
                         "layers between MoE layers are not)")
    if llama_like and spec.qk_norm and not spec.qkv_bias:
        return "qwen3"  # Qwen3's names are Llama's plus q_norm / k_norm
    if spec.qk_norm:
        raise UserError(f"{where}: Hugging Face weights with qk_norm are supported for "
                         f"model_type qwen3 and qwen3_moe only; model {spec.name!r} has "
                         "another architecture")
    if (spec.mlp == "swiglu" and spec.norm == "rmsnorm" and spec.position == "rope"
            and not spec.bias and not spec.parallel_residual):
        return "qwen2" if spec.qkv_bias else "llama"
    if (spec.mlp == "gelu" and spec.norm == "layernorm" and spec.position == "learned"
            and spec.bias and spec.tied_embeddings and not spec.parallel_residual
            and spec.heads == spec.kv_heads):
        return "gpt2"
    raise UserError(f"{where}: Hugging Face weights are supported for model_type "
                     f"{', '.join(SUPPORTED_TYPES)}; model {spec.name!r} has another "
                     "architecture (GPT-NeoX's per-head fused q/k/v is not)")


def sources(spec: ModelSpec) -> dict[str, Source]:
    """Every meshtron parameter name (tied weights once, as `named_parameters` gives them) ->
    where it lives in a Hugging Face checkpoint."""
    mtype = check_supported(spec, "model")
    if mtype == "gpt2":
        return _gpt2_sources(spec)
    out = {"tok_embeddings.weight": Source("model.embed_tokens.weight")}
    for i in range(spec.layers):
        for ours, theirs in _LLAMA_LAYER.items():
            if ours.endswith(".bias") and not spec.qkv_bias:
                continue
            if ours.startswith("feed_forward.") and spec.is_moe_layer(i):
                continue
            out[f"layers.{i}.{ours}"] = Source(f"model.layers.{i}.{theirs}")
        if spec.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[f"layers.{i}.attention.{n}.weight"] = Source(
                    f"model.layers.{i}.self_attn.{n}.weight")
        if spec.is_moe_layer(i):
            out.update(_moe_sources(spec, mtype, i))
    out["norm.weight"] = Source("model.norm.weight")
    if not spec.tied_embeddings:
        out["output.weight"] = Source(LM_HEAD)
    return out


def _moe_sources(spec: ModelSpec, mtype: str, i: int) -> dict[str, Source]:
    router, expert, (w1, w3, w2) = _MOE_LAYER[mtype]
    base = f"model.layers.{i}."
    out = {f"layers.{i}.feed_forward.router.gate.weight": Source(base + router)}
    for ours, theirs in (("w1", w1), ("w3", w3), ("w2", w2)):
        names = tuple(base + expert.format(e=e) + theirs for e in range(spec.moe_experts))
        out[f"layers.{i}.feed_forward.experts.{ours}.weight"] = Source(names[0], stacked=names)
    return out


def _gpt2_sources(spec: ModelSpec) -> dict[str, Source]:
    h = spec.hidden
    out = {"tok_embeddings.weight": Source("transformer.wte.weight"),
           "pos_embeddings.weight": Source("transformer.wpe.weight")}
    for i in range(spec.layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        for j, proj in enumerate(("wq", "wk", "wv")):  # c_attn columns: q | k | v
            out[f"{p}attention.{proj}.weight"] = Source(f"{q}attn.c_attn.weight", True, j * h)
            out[f"{p}attention.{proj}.bias"] = Source(f"{q}attn.c_attn.bias", False, j * h)
        out[f"{p}attention.wo.weight"] = Source(f"{q}attn.c_proj.weight", True)
        out[f"{p}attention.wo.bias"] = Source(f"{q}attn.c_proj.bias")
        out[f"{p}feed_forward.w1.weight"] = Source(f"{q}mlp.c_fc.weight", True)
        out[f"{p}feed_forward.w1.bias"] = Source(f"{q}mlp.c_fc.bias")
        out[f"{p}feed_forward.w2.weight"] = Source(f"{q}mlp.c_proj.weight", True)
        out[f"{p}feed_forward.w2.bias"] = Source(f"{q}mlp.c_proj.bias")
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[f"{p}{ours}.weight"] = Source(f"{q}{theirs}.weight")
            out[f"{p}{ours}.bias"] = Source(f"{q}{theirs}.bias")
    out["norm.weight"] = Source("transformer.ln_f.weight")
    out["norm.bias"] = Source("transformer.ln_f.bias")
    return out


def meshtron_to_hf(spec: ModelSpec) -> dict[str, str]:
    """Every meshtron parameter name -> the Hugging Face tensor that holds it."""
    return {k: s.name for k, s in sources(spec).items()}


def hf_shapes(spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape every Hugging Face tensor must have, from meshtron's global `shapes`
    (fused tensors: the meshtron parts side by side)."""
    out: dict[str, list[int]] = {}
    for ours, src in sources(spec).items():
        shape = list(shapes[ours])
        if src.stacked:  # one [out, in] tensor per expert
            out.update({name: shape[1:] for name in src.stacked})
            continue
        if src.transpose:
            shape = shape[::-1]
        dim = 1 if src.transpose else 0
        if src.name in out:  # fused: parts extend one dimension
            out[src.name][dim] = max(out[src.name][dim], src.offset + shape[dim])
        else:
            shape[dim] += src.offset
            out[src.name] = shape
    return {k: tuple(v) for k, v in out.items()}


def is_ignorable(hf_name: str, spec: ModelSpec) -> bool:
    """A checkpoint tensor meshtron may skip: derived buffers, and the output head of a tied
    model (some writers store the shared matrix twice)."""
    return hf_name.endswith(IGNORED_SUFFIXES) or (spec.tied_embeddings and hf_name == LM_HEAD)


def hf_config(spec: ModelSpec, dtype: str = "float32") -> dict[str, Any]:
    """A config.json `transformers` reads back into the same architecture."""
    mtype = check_supported(spec, "export")
    if mtype == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": spec.hidden, "n_layer": spec.layers, "n_head": spec.heads,
                "n_inner": spec.ffn_hidden, "n_positions": spec.max_seq,
                "vocab_size": spec.vocab, "layer_norm_epsilon": spec.norm_eps,
                "activation_function": "gelu_new", "tie_word_embeddings": True,
                "torch_dtype": dtype, "dtype": dtype}
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}.get(mtype, "LlamaForCausalLM")
    cfg: dict[str, Any] = {
        "architectures": [arch],
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
        cfg["rope_scaling"] = {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
    if spec.is_moe:
        experts = {"num_local_experts": spec.moe_experts, "num_experts": spec.moe_experts,
                   "num_experts_per_tok": spec.moe_top_k,
                   "router_aux_loss_coef": spec.moe_aux_loss}
        cfg.update(experts, use_sliding_window=False, sliding_window=None)
        if mtype == "mixtral":  # Mixtral's experts are `intermediate_size` wide (no dense MLP)
            cfg["intermediate_size"] = spec.moe_ffn_hidden
        if mtype == "qwen3_moe":
            cfg.update(moe_intermediate_size=spec.moe_ffn_hidden, decoder_sparse_step=1,
                       mlp_only_layers=[], norm_topk_prob=spec.moe_norm_topk,
                       attention_bias=False)
    elif mtype == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
        if mtype == "qwen3":
            cfg.update(attention_bias=False)
    return cfg


def rope_parameters(spec: ModelSpec) -> dict[str, Any]:
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


class HFTensors:
    """Turns full meshtron tensors, fed one at a time, into Hugging Face tensors: transposes
    GPT-2's Conv1D weights and assembles a fused tensor once all its parts have arrived."""

    def __init__(self, spec: ModelSpec, shapes: dict[str, tuple[int, ...]]):
        self.sources = sources(spec)
        self.want = hf_shapes(spec, shapes)
        self.pending: dict[str, list[tuple[int, Any]]] = {}

    def add(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The Hugging Face tensors completed by meshtron tensor `name` (often one, or none
        while a fused tensor waits for its other parts)."""
        import torch

        src = self.sources[name]
        if src.stacked:
            return [(n, tensor[e].contiguous()) for e, n in enumerate(src.stacked)]
        t = tensor.t().contiguous() if src.transpose else tensor
        total = self.want[src.name][1 if src.transpose else 0]
        if src.offset == 0 and t.shape[1 if src.transpose else 0] == total:
            return [(src.name, t)]
        parts = self.pending.setdefault(src.name, [])
        parts.append((src.offset, t))
        dim = 1 if src.transpose else 0
        if sum(p.shape[dim] for _, p in parts) < total:
            return []
        del self.pending[src.name]
        return [(src.name, torch.cat([p for _, p in sorted(parts, key=lambda x: x[0])], dim))]
