"""The MoE Hugging Face types meshtron's runtime trains (model/hf_moe_types.py: Qwen2-MoE with
its gated shared expert and dense blocks between MoE blocks, OLMoE's whole-projection q/k norms,
Granite MoE's multipliers) compute transformers' own logits: the runtime's model of the
config.json transformers writes, holding the same weights."""

from __future__ import annotations

import pytest
import torch

SHAPES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=128, num_experts_per_tok=2)
TINY = {
    # blocks 1 and 3 routed (decoder_sparse_step 2), block 3 listed dense: 1 MoE, 3 dense;
    # a 5-token window on the even blocks below max_window_layers: blocks 0 and 2
    "qwen2_moe": dict(SHAPES, model_type="qwen2_moe", num_hidden_layers=4, intermediate_size=96,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3],
                      norm_topk_prob=False, use_sliding_window=True, sliding_window=5,
                      max_window_layers=3),
    "olmoe": dict(SHAPES, model_type="olmoe", num_hidden_layers=2, intermediate_size=32,
                  num_experts=4, norm_topk_prob=False),
    "granitemoe": dict(SHAPES, model_type="granitemoe", num_hidden_layers=2,
                       intermediate_size=32, num_local_experts=4, embedding_multiplier=3.0,
                       attention_multiplier=0.09, residual_multiplier=0.5, logits_scaling=4.0),
    # MixtralAttention's window in every block, shorter than the 24 tokens (refused before)
    "mixtral": dict(SHAPES, model_type="mixtral", num_hidden_layers=2, intermediate_size=32,
                    num_local_experts=4, sliding_window=7),
}
_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm",
         "k_norm": "k_norm"}
_DENSE = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _rename(name: str, p: torch.Tensor):
    """transformers' name of one tensor -> meshtron's (name, tensor) pairs."""
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return [("tok_embeddings.weight" if name.startswith("embed") else "output.weight", p)]
    if name.startswith("norm."):
        return [(name, p)]
    _, i, part, rest = name.split(".", 3)
    pre = f"layers.{i}."
    if part == "self_attn":
        mod, leaf = rest.split(".", 1)
        return [(pre + f"attention.{_ATTN[mod]}.{leaf}", p)]
    if part in ("input_layernorm", "post_attention_layernorm"):
        norm = "attention_norm" if part == "input_layernorm" else "ffn_norm"
        return [(pre + f"{norm}.{rest}", p)]
    ff = pre + "feed_forward."
    if rest in ("gate.weight", "router.weight"):  # Qwen2-MoE / OLMoE, Granite MoE
        return [(ff + "router.gate.weight", p)]
    if rest == "experts.gate_up_proj":  # [E, 2 fe, h]: the gate's rows, then the up's
        gate, up = p.chunk(2, dim=1)
        return [(ff + "experts.w1.weight", gate), (ff + "experts.w3.weight", up)]
    if rest == "experts.down_proj":
        return [(ff + "experts.w2.weight", p)]
    if rest == "shared_expert_gate.weight":
        return [(ff + "shared.gate.weight", p)]
    mod, leaf = rest.split(".", 1)
    if mod == "shared_expert":
        sub, leaf = leaf.split(".", 1)
        return [(ff + f"shared.{_DENSE[sub]}.{leaf}", p)]
    return [(ff + f"{_DENSE[mod]}.{leaf}", p)]  # a dense block's MLP


@pytest.mark.parametrize("mtype", sorted(TINY))
def test_moe_logits_equal_transformers(mtype, tmp_path):
    transformers = pytest.importorskip("transformers")
    from meshtron.model.spec import resolve_model
    from meshtron.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**TINY[mtype])
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms away from 1 (a norm over the wrong width shows)
                p.normal_(1.0, 0.2)
    model.config.save_pretrained(tmp_path)
    spec = resolve_model(tmp_path / "config.json")
    ours = Transformer(spec, init_seed=0)
    state = dict(pair for name, p in model.state_dict().items() for pair in _rename(name, p))
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "expert_bias" not in m], missing
    ours.eval()
    tokens = torch.randint(0, spec.vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(tokens).logits, ours(tokens)
        for block in ours.layers.values():
            block.attention.window = 0
        full = ours(tokens)
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)
    assert spec.sliding_window == TINY[mtype].get("sliding_window", 0)
    assert spec.window_blocks == ((0, 2) if mtype == "qwen2_moe" else ())
    if spec.sliding_window:  # the window matters: full causal attention is another function
        assert (full - ref).abs().max() > 1e-3
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == spec.num_params()


_MINIMAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=12,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
_MOE = {"qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "olmoe": dict(num_experts=4, num_experts_per_tok=2),
        "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
        "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2,
                                 shared_intermediate_size=512),
        "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
        "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1)}
_UNREAD: set[str] = set()
_UNREAD_TYPE = {"gpt_oss": {"rope_theta", "rope_type", "rope_factor", "rope_original_max_seq",
                            "rope_truncate"}}  # YaRN's defaults: not taken (planned only)


@pytest.mark.parametrize("mtype", ["llama", "mistral", "qwen2", "qwen3", "nemotron", "gemma2",
                                   "gemma3_text", "phi3", "olmo2", "granite", "starcoder2",
                                   "gpt_neox", *_MOE])
def test_absent_keys_take_transformers_defaults(mtype):
    """A config.json that leaves keys out reads as the config transformers completes from it
    (AutoConfig's defaults): Nemotron's half rotary, Gemma 3's 1e6 base, OLMoE's 0.01
    auxiliary loss, Granite MoE's untied embeddings, gpt-oss's 128-token window, Llama 4's
    dense width, head size, base and chunks were not; nor Llama's and Mistral's 1e-6 norm
    epsilon, Mistral's 4096-token window, Mixtral's 1e6 base, Qwen2-MoE's shared expert, each
    class's max_position_embeddings (hf_config.CLASS_DEFAULTS)."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from meshtron.model.hf_config import from_hf_dict

    minimal = dict(_MINIMAL, model_type=mtype, **_MOE.get(mtype, {}))
    full = transformers.AutoConfig.for_model(**minimal).to_dict()
    got, want = (dataclasses.asdict(from_hf_dict(c)) for c in (minimal, full))
    skip = _UNREAD | _UNREAD_TYPE.get(mtype, set())
    assert {k: got[k] for k in got if k not in skip} == {k: want[k] for k in want
                                                          if k not in skip}
