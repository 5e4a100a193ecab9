"""A hand-written config.json that leaves keys out is the model transformers builds from it
(its configuration class's defaults, model/hf_config.py CLASS_DEFAULTS), through `meshtron
plan` and `meshtron train`: Mistral's 4096-token window, Qwen2-MoE's shared expert, Mixtral's
1e6 RoPE base."""

from __future__ import annotations

import contextlib
import io
import json
import tomllib

import pytest

from meshtron.cli import main

SHAPES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
"""Only the shapes: every other key transformers' default."""


def _meshtron(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue().strip()


def _config(tmp_path, **keys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SHAPES, **keys)))
    return path


def test_mistral_without_sliding_window_key_has_the_default_window(tmp_path):
    """The run trains and records MistralConfig's 4096-token window (a model read as full
    attention would record none); packed documents train with it (refused before a window
    was built for them: tests/test_window_documents.py)."""
    path = _config(tmp_path, model_type="mistral")
    run = tmp_path / "run"
    code, _, err = _meshtron("train", "--model", path, "--attention-mask", "document",
                             "--seq-len", "32", "--global-batch", "2", "--steps", "1",
                             "--eval-every", "0", "--run-dir", run)
    assert code == 0, err
    assert tomllib.loads((run / "run.toml").read_text())["model"]["sliding_window"] == 4096


def test_qwen2_moe_without_shared_expert_key_plans_transformers_model(tmp_path):
    """Qwen2MoeConfig's shared expert (5632 wide) is there when the key is absent: `meshtron
    plan` counts the parameters transformers' model has."""
    transformers = pytest.importorskip("transformers")
    keys = dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=64)
    code, out, err = _meshtron("plan", "--model", _config(tmp_path, **keys), "--cluster",
                               "dgx-h100:1", "--global-batch", "8", "--seq-len", "64", "--json")
    assert code == 0, err
    import torch

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**SHAPES, **keys))
    assert json.loads(out)["model"]["params"] == sum(p.numel() for p in model.parameters())


def test_mixtral_without_rope_theta_trains_at_transformers_base(tmp_path):
    """...and with a `sliding_window` shorter than the sequence (refused before): the window
    in every block (MixtralAttention), recorded in the run and written back by the export."""
    path = _config(tmp_path, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                   sliding_window=16)
    run = tmp_path / "run"
    code, _, err = _meshtron("train", "--model", path, "--seq-len", "32", "--global-batch", "2",
                             "--steps", "1", "--eval-every", "0", "--run-dir", run,
                             "--export", tmp_path / "export")
    assert code == 0, err
    model = tomllib.loads((run / "run.toml").read_text())["model"]
    assert model["rope_theta"] == 1e6 and model["sliding_window"] == 16, model
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["model_type"] == "mixtral" and exported["sliding_window"] == 16, exported
