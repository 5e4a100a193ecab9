"""Long-context RoPE: tiny Llama and Qwen2 models with every supported `rope_scaling`
(llama3, yarn with and without an explicit attention factor, linear, dynamic NTK) written by
`transformers` (fp32, random weights), read by meshtron from config.json in both spellings
(transformers 5 `rope_parameters`, 4.x `rope_theta` + `rope_scaling`), loaded with the
`--init-from` reader, logits compared with transformers'; real Llama 3.1 and Qwen2.5
long-context configs parse; unknown rope types fail with one line; export writes a config
transformers reads back to the same frequencies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshtron.errors import UserError
from meshtron.model.hf_config import from_hf_dict

SHAPES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=128, max_position_embeddings=64)
SEQ = 96  # past the original length, so every scaled band is exercised
LOGIT_TOL = 1e-5

CASES = {
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32}),
    "yarn-mscale": ("llama", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                              "original_max_position_embeddings": 32, "mscale": 0.707,
                              "mscale_all_dim": 1.0}),
    "linear": ("llama", {"rope_type": "linear", "factor": 2.5}),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),
}


def _hf_model(kind: str, rope: dict):
    transformers = pytest.importorskip("transformers")
    params = dict(rope, rope_theta=500.0)
    shapes = dict(SHAPES, max_position_embeddings=64 if rope["rope_type"] == "dynamic" else 128)
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_parameters=params, **shapes)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(rope_parameters=params, tie_word_embeddings=False,
                                       **shapes)
        model = transformers.Qwen2ForCausalLM(cfg)
    return model.eval()


def _legacy(cfg: dict) -> dict:
    """The transformers 4.x spelling of the same config: flat rope_theta, rope_scaling with
    the older "type" key."""
    cfg = dict(cfg)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    return cfg


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    from meshtron.hf import load_into
    from meshtron.hf.names import hf_config
    from meshtron.model.transformer import Transformer

    kind, rope = CASES[case]
    torch.manual_seed(0)
    hf = _hf_model(kind, rope)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    spec = from_hf_dict(cfg, name=case)
    assert spec.rope_type == rope["rope_type"]
    assert from_hf_dict(_legacy(cfg), name=case) == spec
    assert spec.max_seq >= SEQ
    model = Transformer(spec, init_seed=1)
    load_into([model], tmp_path, spec)
    tokens = torch.randint(0, SHAPES["vocab_size"], (2, SEQ),
                           generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() < LOGIT_TOL
    # Shorter than the original length too (dynamic NTK is then the plain RoPE).
    with torch.no_grad():
        diff = (model(tokens[:, :20]) - hf(tokens[:, :20]).logits).abs().max().item()
    assert diff < LOGIT_TOL
    # What meshtron exports reads back to the same model, in meshtron and in transformers.
    exported = hf_config(spec)
    assert from_hf_dict(exported, name=case) == spec
    _same_frequencies(exported, spec)


def _same_frequencies(cfg: dict, spec) -> None:
    """transformers' inverse frequencies and attention factor for config.json `cfg` equal
    meshtron's for `spec` (dynamic NTK: at the original length, as transformers builds it)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from meshtron.model.rope import attention_factor, inv_freq

    cls = transformers.Qwen2Config if cfg["model_type"] == "qwen2" else transformers.LlamaConfig
    hf_cfg = cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    theirs, factor = ROPE_INIT_FUNCTIONS[spec.rope_type](hf_cfg, "cpu")
    assert torch.allclose(inv_freq(spec).float(), theirs, rtol=1e-6, atol=0)
    assert attention_factor(spec) == pytest.approx(factor)


LLAMA31_8B = {  # meta-llama/Llama-3.1-8B config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}

QWEN25_7B_128K = {  # Qwen/Qwen2.5-7B-Instruct config.json with its documented YaRN block
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}


def test_published_long_context_configs_load(tmp_path):
    from meshtron.model.rope import attention_factor, inv_freq

    llama = from_hf_dict(LLAMA31_8B, name="llama3.1-8b")
    assert (llama.rope_type, llama.rope_factor, llama.rope_original_max_seq,
            llama.max_seq) == ("llama3", 8.0, 8192, 131072)
    qwen = from_hf_dict(QWEN25_7B_128K, name="qwen2.5-7b")
    assert (qwen.rope_type, qwen.rope_original_max_seq, qwen.max_seq) == ("yarn", 32768, 131072)
    assert attention_factor(qwen) == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    _same_frequencies(LLAMA31_8B, llama)
    _same_frequencies(QWEN25_7B_128K, qwen)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 2.0},
     "config.json rope_scaling.rope_type='longrope': allowed values are default, linear, "
     "dynamic, llama3, yarn"),
    ({"type": "su"}, "config.json rope_scaling.rope_type='su': allowed values are"),
    ({"rope_type": "linear"}, "config.json rope_scaling.factor: missing"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "model.rope_high_freq_factor=1.0: must be at least"),
    ({"rope_type": "yarn", "factor": -1.0}, "config.json rope_scaling.factor=-1.0: must be a "
     "positive number"),
])
def test_bad_rope_scaling_is_one_line(rope, message):
    cfg = dict(LLAMA31_8B, rope_scaling=rope)
    with pytest.raises(UserError) as err:
        from_hf_dict(cfg)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_the_default_seq_len_note_says_where_a_scaled_context_comes_from(tmp_path, capsys):
    """Audit s54: with RoPE scaling the note called the scaled context (2048 positions x factor
    2 = 4096) the model's max_position_embeddings, which its config.json gives as 2048."""
    from meshtron.cli import main

    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
           "max_position_embeddings": 2048,
           "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--cluster", "dgx-h100:1",
                 "--global-batch", "8", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    said = next(n for n in notes if n.startswith("--seq-len not given"))
    assert "(4096: 2048 x its RoPE factor 2)" in said and "max_position_embeddings" not in said
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch",
                 "8", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("(max_position_embeddings 8192)" in n for n in notes), notes
