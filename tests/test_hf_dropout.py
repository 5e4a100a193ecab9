"""A config.json's non-zero dropout (GPT-2's *_pdrop, Llama's attention_dropout): meshtron's
model has none, so `meshtron train` says so in one warning line and trains; a value that is
no probability is refused in one line (model/hf_config.py dropout_notes)."""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from pathlib import Path

from meshtron.cli import main


def _gpt2_config(tmp_path: Path, **keys) -> Path:
    cfg = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300,
           "n_positions": 64, **keys}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _train(config: Path, run: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--model", str(config), "--steps", "1", "--seq-len", "32",
                     "--global-batch", "2", "--eval-every", "0", "--run-dir", str(run)])
    return code, err.getvalue()


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "meshtron train: warning:" in line]


def test_gpt2_pdrop_trains_with_one_warning(tmp_path):
    """resid_pdrop given, embd_pdrop 0, attn_pdrop absent: transformers' GPT2Config reads the
    absent key as 0.1, so the one line names it beside the given one, as a default."""
    config = _gpt2_config(tmp_path, resid_pdrop=0.1, embd_pdrop=0.0)
    code, err = _train(config, tmp_path / "run")
    assert code == 0, err
    (line,) = [w for w in _warnings(err) if "dropout" in w]
    assert "resid_pdrop=0.1" in line and "attn_pdrop=0.1" in line, line
    assert "(attn_pdrop absent: transformers' default for model_type 'gpt2')" in line, line
    assert "embd_pdrop" not in line, line  # 0: nothing to drop
    assert "trains without it" in line, line
    # the run trained: its resolved model carries the note (resume prints it again)
    spec = tomllib.loads((tmp_path / "run" / "run.toml").read_text())["model"]
    assert spec["train_notes"] == [line.split("warning: ", 1)[1]]


def test_plan_of_gpt2_config_without_pdrop_keys_says_the_warning(tmp_path):
    """A GPT-2 config.json with no *_pdrop key (transformers: 0.1 each): `meshtron plan` says
    in a note the warning `meshtron train` will print."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", "--model", str(_gpt2_config(tmp_path)), "--cluster",
                     "dgx-h100:1", "--top", "1"])
    assert code == 0
    text = " ".join(out.getvalue().split())  # the table wraps its notes
    assert ("meshtron train warns: config.json embd_pdrop=0.1, attn_pdrop=0.1, "
            "resid_pdrop=0.1 (embd_pdrop, attn_pdrop, resid_pdrop absent: transformers' "
            "default for model_type 'gpt2')") in text, text


def test_zero_dropout_warns_nothing(tmp_path):
    config = _gpt2_config(tmp_path, resid_pdrop=0.0, embd_pdrop=0, attn_pdrop=0.0)
    code, err = _train(config, tmp_path / "run")
    assert code == 0, err
    assert not [w for w in _warnings(err) if "dropout" in w], err


def test_llama_attention_dropout_warns(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 300, "max_position_embeddings": 64, "attention_dropout": 0.05,
        "hidden_dropout": 0.3}))  # not a key LlamaAttention reads: not named
    code, err = _train(path, tmp_path / "run")
    assert code == 0, err
    (line,) = [w for w in _warnings(err) if "dropout" in w]
    assert "attention_dropout=0.05" in line and "hidden_dropout" not in line, line


def test_dropout_not_a_probability_is_refused(tmp_path, capsys):
    config = _gpt2_config(tmp_path, resid_pdrop=1.5)
    code, err = _train(config, tmp_path / "run")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "resid_pdrop=1.5" in lines[0], err
    assert "Traceback" not in err


def test_init_from_a_gpt2_checkpoint_warns(tmp_path):
    """transformers' GPT2Config writes its 0.1 defaults into config.json: `--init-from` the
    saved checkpoint trains, saying once that it trains without them."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300,
                                  n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--init-from", str(tmp_path / "gpt2"), "--steps", "1",
                     "--seq-len", "32", "--global-batch", "2", "--eval-every", "0",
                     "--run-dir", str(tmp_path / "run")])
    assert code == 0, err.getvalue()
    (line,) = [w for w in _warnings(err.getvalue()) if "dropout" in w]
    assert all(f"{key}=0.1" in line for key in ("embd_pdrop", "attn_pdrop", "resid_pdrop"))
