"""A config.json key one letter off a key meshtron reads (and did not find) is refused in one
line naming both (exit 2): read with the default instead, `num_key_value_head` would build an
80-layer Llama with full multi-head attention (79.9B) instead of GQA (70.6B). Keys foreign to
meshtron that Hugging Face configs carry stay accepted."""

from __future__ import annotations

import json

import pytest

from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
             "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
             "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192,
                              "rope_type": "llama3"},
             "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
             "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
             "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
             "pretraining_tp": 1, "use_cache": True, "initializer_range": 0.02,
             "transformers_version": "4.43.0.dev0", "_name_or_path": "meta-llama/x"}
ARGS = ["--cluster", "dgx-h100:8", "--global-batch", "64", "--seq-len", "8192", "--json",
        "--top", "1"]


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_real_config_with_foreign_keys_is_read(plan_cli, tmp_path):
    rc, out, err = plan_cli("--model", _write(tmp_path, LLAMA_70B), *ARGS)
    assert rc == 0, err
    assert json.loads(out)["model"]["kv_heads"] == 8


@pytest.mark.parametrize("wrong,right", [("num_key_value_head", "num_key_value_heads"),
                                         ("tie_word_embedding", "tie_word_embeddings"),
                                         ("intermediate_sizes", "intermediate_size")])
def test_near_miss_key_is_refused_naming_the_intended_one(plan_cli, tmp_path, wrong, right):
    cfg = dict(LLAMA_70B)
    cfg[wrong] = cfg.pop(right)
    rc, out, err = plan_cli("--model", _write(tmp_path, cfg), *ARGS)
    assert rc == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (f"meshtron plan: error: config.json {wrong}: not a key meshtron reads "
                        f"for model_type 'llama'; did you mean {right}? ({right} is absent: "
                        "rename the key)"), lines[0]
