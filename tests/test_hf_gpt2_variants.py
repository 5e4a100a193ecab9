"""GPT-2 config.json keys that change the function transformers computes (GPT2MLP's
`activation_function`, GPT2Attention's `scale_attn_weights` / `scale_attn_by_inverse_layer_idx`):
trained as transformers computes them, or refused in one line by `meshtron train`, never
trained as another function."""

from __future__ import annotations

import contextlib
import io
import tomllib
from pathlib import Path

import pytest
import torch

from meshtron.cli import main

transformers = pytest.importorskip("transformers")


def _gpt2(tmp_path: Path, name: str, **keys) -> Path:
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300,
                                  n_positions=64, **keys)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # MLP inputs of order 1, where the erf and tanh GELUs part
        for block in model.transformer.h:
            block.mlp.c_fc.weight.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


def _train(*argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        return main(["train", *map(str, argv)]), err.getvalue()


def test_erf_gelu_gpt2_exports_what_meshtron_trained(tmp_path):
    """activation_function 'gelu' (the erf form): the run's model computes transformers'
    logits on the exported weights."""
    from meshtron.config import config_from_dict
    from meshtron.hf import load_into
    from meshtron.model.transformer import Transformer

    src, run, out = _gpt2(tmp_path, "erf", activation_function="gelu"), tmp_path / "run", \
        tmp_path / "out"
    code, err = _train("--init-from", src, "--steps", "1", "--lr", "0", "--seq-len", "32",
                       "--global-batch", "2", "--eval-every", "0", "--run-dir", run,
                       "--export", out)
    assert code == 0, err
    spec = config_from_dict(tomllib.loads((run / "run.toml").read_text())).model
    ours = Transformer(spec).eval()
    load_into([ours], out, spec)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("keys, named", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"scale_attn_weights": False}, "scale_attn_weights=false"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true")])
def test_gpt2_attention_and_activation_variants_are_one_line(tmp_path, keys, named):
    src = _gpt2(tmp_path, "variant", **keys)
    code, err = _train("--init-from", src, "--steps", "1", "--seq-len", "32",
                       "--run-dir", tmp_path / "run")
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
