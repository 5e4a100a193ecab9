"""A Mistral config.json that leaves `sliding_window` out has transformers' MistralConfig
default, a 4096-token window (not full attention): `meshtron train` sees the window."""

from __future__ import annotations

import contextlib
import io
import json

from meshtron.cli import main

MISTRAL = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 300}
"""A hand-written config.json: only the shapes, every other key transformers' default."""


def test_mistral_without_sliding_window_key_has_the_default_window(tmp_path):
    """Packed documents are not built with a window (hf_variants.runtime_problem): a sequence
    past 4096 tokens is refused naming the window, which a model read as full attention
    would have trained."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MISTRAL))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--model", str(path), "--attention-mask", "document",
                     "--seq-len", "4112", "--global-batch", "1", "--steps", "1",
                     "--eval-every", "0", "--run-dir", str(tmp_path / "run")])
    line = err.getvalue().strip()
    assert code == 2 and "model.sliding_window=4096" in line, line
    assert len(line.splitlines()) == 1 and not (tmp_path / "run").exists()
