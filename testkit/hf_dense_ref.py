"""Tiny Hugging Face models of the dense types meshtron's runtime trains, their weights copied
into meshtron's Transformer by name: the reference for tests/test_hf_dense.py (transformers'
own modeling code computes the logits meshtron's model must equal)."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=320, max_position_embeddings=128)

TINY = {
    "qwen3": dict(SHAPES, model_type="qwen3", head_dim=32, rope_theta=5000.0),  # 32 != 64/4
    "nemotron": dict(SHAPES, model_type="nemotron", partial_rotary_factor=0.5, head_dim=16),
    "gemma3_text": dict(SHAPES, model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=24,
                        sliding_window=64, rope_theta=10000.0, rope_local_base_freq=10000.0,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(SHAPES, model_type="phi3", partial_rotary_factor=0.75, pad_token_id=0),
    "olmo2": dict(SHAPES, model_type="olmo2"),
    "granite": dict(SHAPES, model_type="granite", embedding_multiplier=3.0,
                    attention_multiplier=0.09, residual_multiplier=0.5, logits_scaling=4.0),
    "starcoder2": dict(SHAPES, model_type="starcoder2", sliding_window=64),
}
"""A tiny config.json of each trained type; sliding windows no shorter than the sequences
tested (64), where the runtime's full causal attention is exact."""

_NORMS = {  # transformers' block norm names -> meshtron's, per type
    "gemma3_text": {"input_layernorm": "attention_norm", "post_attention_layernorm":
                    "attention_post_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "ffn_post_norm"},
    "olmo2": {"post_attention_layernorm": "attention_post_norm",
              "post_feedforward_layernorm": "ffn_post_norm"},
}
_MLP = {"nemotron": {"up_proj": "w1", "down_proj": "w2"},
        "starcoder2": {"c_fc": "w1", "c_proj": "w2"}}


def hf_model(mtype: str, seed: int = 0):
    """A tiny transformers model of `mtype` (fp32), its norm weights away from their initial
    values so that a norm read as w where it is 1 + w (or skipped) shows in the logits."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**TINY[mtype])
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.1 if "norm" in name else 0.0, 0.2)
    return model


def meshtron_twin(model, folder: Path):
    """meshtron's Transformer read from the config.json transformers saves, holding `model`'s
    weights (the fused q/k/v and gate/up of Phi-3 split as Phi3's modeling code splits them)."""
    from meshtron.model.spec import resolve_model
    from meshtron.model.transformer import Transformer

    model.config.save_pretrained(folder)
    spec = resolve_model(folder / "config.json")
    ours = Transformer(spec, init_seed=0)
    state = {}
    mtype = model.config.model_type
    for name, p in model.state_dict().items():
        for key, value in _rename(mtype, name, p, spec):
            state[key] = value
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"output.weight"} and (not missing or spec.tied_embeddings), missing
    return ours.eval(), spec


def _rename(mtype: str, name: str, p: torch.Tensor, spec):
    name = name.replace("model.", "", 1) if name.startswith("model.") else name
    if name == "embed_tokens.weight":
        return [("tok_embeddings.weight", p)]
    if name.startswith("lm_head."):
        return [] if spec.tied_embeddings else [("output.weight", p)]
    if name.startswith("norm."):
        return [(name, p)]
    _, i, part, *rest = name.split(".")
    tail = ".".join(rest)
    pre = f"layers.{i}."
    if part == "self_attn":
        mod, leaf = tail.split(".", 1)
        if mod == "qkv_proj":  # Phi-3: q, k, v stacked by rows
            q, kv = spec.heads * spec.head_dim, spec.kv_dim
            wq, wk, wv = p.split([q, kv, kv])
            return [(pre + f"attention.{n}.{leaf}", t) for n, t in (("wq", wq), ("wk", wk),
                                                                    ("wv", wv))]
        names = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                 "q_norm": "q_norm", "k_norm": "k_norm"}
        return [(pre + f"attention.{names[mod]}.{leaf}", p)]
    if part == "mlp":
        mod, leaf = tail.split(".", 1)
        if mod == "gate_up_proj":  # Phi-3: gate rows first, then up
            gate, up = p.chunk(2)
            return [(pre + f"feed_forward.w1.{leaf}", gate), (pre + f"feed_forward.w3.{leaf}", up)]
        names = _MLP.get(mtype, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
        return [(pre + f"feed_forward.{names[mod]}.{leaf}", p)]
    norms = _NORMS.get(mtype, {"input_layernorm": "attention_norm",
                               "post_attention_layernorm": "ffn_norm"})
    return [(pre + f"{norms[part]}.{tail}", p)]
