"""ModelSpec presets, exact parameter counts, HF config.json reading, and the plain model."""

import json

import pytest
import torch

from meshtron.model import PRESETS, Transformer, from_hf_config, resolve_model
from meshtron.model.spec import ModelSpec

KNOWN_TOTALS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name,total", KNOWN_TOTALS.items())
def test_parameter_counts_match_published_totals(name, total):
    assert PRESETS[name].num_params() == total


def test_gpt3_175b_is_175b():
    assert abs(PRESETS["gpt3-175b"].num_params() / 1e9 - 174.6) < 0.1


@pytest.mark.parametrize("name", ["tiny", "debug", "tiny-gpt"])
def test_module_parameter_count_equals_spec(name):
    spec = PRESETS[name]
    model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_hf_llama_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
           "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
    spec = from_hf_config(_write(tmp_path, cfg))
    assert spec.num_params() == 8_030_261_248
    assert spec.kv_heads == 8 and spec.rope_theta == 500000.0


def test_hf_gpt2_config_matches_gpt2_small(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
           "vocab_size": 50257, "n_positions": 1024}
    assert from_hf_config(_write(tmp_path, cfg)).num_params() == 124_439_808


def test_hf_gpt_neox_config_matches_pythia_160m(tmp_path):
    cfg = {"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072,
           "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 50304,
           "max_position_embeddings": 2048, "rotary_pct": 1.0, "tie_word_embeddings": False,
           "use_parallel_residual": True}
    spec = from_hf_config(_write(tmp_path, cfg))
    # Pythia-160m's published count (HF num_parameters) is 162,322,944.
    assert spec.num_params() == 162_322_944
    assert spec.parallel_residual


def test_hf_qwen2_and_mistral(tmp_path):
    qwen = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
            "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768}
    # Qwen2-0.5B: 494,032,768 parameters.
    assert from_hf_config(_write(tmp_path, qwen)).num_params() == 494_032_768
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
               "vocab_size": 32000}
    # Mistral-7B-v0.1: 7,241,732,096 parameters.
    assert from_hf_config(_write(tmp_path, mistral)).num_params() == 7_241_732_096


@pytest.mark.parametrize("cfg,needle", [
    ({"model_type": "bert"}, "model_type='bert'"),
    ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 1,
      "intermediate_size": 8, "vocab_size": 10}, "heads=5"),
])
def test_hf_config_errors_name_the_field(tmp_path, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        from_hf_config(_write(tmp_path, cfg))


def test_malformed_json_and_unknown_preset(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(bad))
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_model("llama9-1t")


def test_spec_validation():
    with pytest.raises(ValueError, match="kv_heads=3"):
        ModelSpec(name="x", layers=1, hidden=64, heads=4, kv_heads=3, ffn_hidden=8, vocab=10, max_seq=8)
    with pytest.raises(ValueError, match="layers=0"):
        ModelSpec(name="x", layers=0, hidden=64, heads=4, kv_heads=2, ffn_hidden=8, vocab=10, max_seq=8)


@pytest.mark.parametrize("name", ["debug", "tiny-gpt"])
def test_model_is_causal_and_deterministic(name):
    spec = PRESETS[name].replace(layers=2)
    torch.manual_seed(0)
    a = Transformer(spec)
    torch.manual_seed(0)
    b = Transformer(spec)
    x = torch.randint(0, spec.vocab, (2, 12))
    out = a(x)
    assert torch.equal(out, b(x))
    # Changing a future token must not change earlier logits.
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % spec.vocab
    assert torch.allclose(a(y)[:, :-1], out[:, :-1], atol=1e-6)
    assert not torch.allclose(a(y)[:, -1], out[:, -1])


def test_gqa_equals_explicit_repeated_heads():
    """GQA with kv_heads=2 equals MHA whose k/v projections repeat each kv head's rows."""
    spec = PRESETS["debug"]  # heads 4, kv_heads 2
    torch.manual_seed(0)
    gqa = Transformer(spec)
    mha = Transformer(spec.replace(kv_heads=spec.heads))
    sd = gqa.state_dict()
    hd = spec.head_dim
    for key in list(sd):
        if key.endswith(("wk.weight", "wv.weight")):
            w = sd[key].view(spec.kv_heads, hd, spec.hidden)
            sd[key] = w.repeat_interleave(spec.heads // spec.kv_heads, dim=0).reshape(-1, spec.hidden)
    mha.load_state_dict(sd)
    x = torch.randint(0, spec.vocab, (2, 10))
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)
