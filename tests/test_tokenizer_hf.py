"""Hugging Face tokenizers (`--tokenizer PATH`) and the run's tokenizer files: the model's
vocabulary follows a tokenizer.json, the files are kept in RUN_DIR/tokenizer and exported with
the weights (transformers reads both back); the locally trained BPE is trained once, by the
main rank, and loaded by the others."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.config import config_from_dict
from meshtron.data import tokenizer as tokmod
from meshtron.data.tokenizer import HFTokenizer, follow_tokenizer
from meshtron.errors import UserError
from meshtron.train.loop import build_run_data

tk = pytest.importorskip("tokenizers")

CODE = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"


def _corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(40):
        (folder / f"f{i}.txt").write_text(CODE.replace("add", f"add{i}") * 3)
    return folder


def _hf_tokenizer(tmp_path: Path, eos: str | None = "<|endoftext|>") -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    tok.train_from_iterator([CODE] * 20, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    if eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return folder


def _run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        return main(argv), err.getvalue()


def test_hf_tokenizer_sets_vocab_is_kept_and_exported(tmp_path):
    tok_dir = _hf_tokenizer(tmp_path)
    tok = HFTokenizer.load(tok_dir)
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>") and tok.vocab_size <= 300
    run, out = tmp_path / "run", tmp_path / "export"
    code, err = _run(["train", "--model", "debug", "--tokenizer", str(tok_dir / "tokenizer.json"),
                      "--data", str(_corpus(tmp_path)), "--steps", "2", "--seq-len", "32",
                      "--global-batch", "4", "--eval-every", "0", "--run-dir", str(run),
                      "--export", str(out)])
    assert code == 0, err
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert (run / "tokenizer" / "tokenizer_config.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == tok.vocab_size  # the model follows the tokenizer
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert hf_tok.encode(CODE) == tok.encode(CODE)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out),
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.config.vocab_size == tok.vocab_size


def test_tokenizer_without_end_of_text_is_one_line(tmp_path):
    tok_dir = _hf_tokenizer(tmp_path, eos="<nope>")
    (tok_dir / "tokenizer_config.json").unlink()
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|endoftext|>"]
    tok["model"]["vocab"].pop("<|endoftext|>")
    (tok_dir / "tokenizer.json").write_text(json.dumps(tok))
    code, err = _run(["train", "--model", "debug", "--tokenizer", str(tok_dir), "--steps", "1",
                      "--seq-len", "32",
                      "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "no end-of-text token" in err and len(err.strip().splitlines()) == 1
    code, err = _run(["train", "--tokenizer", str(tmp_path / "missing.json"), "--steps", "1",
                      "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "data.tokenizer=" in err


def test_bpe_is_trained_once_by_the_main_rank(tmp_path, monkeypatch):
    cfg = config_from_dict({"model": {"preset": "debug", "vocab": 300},
                            "data": {"source": str(_corpus(tmp_path)), "tokenizer": "bpe",
                                     "bpe_vocab": 300, "seq_len": 32, "global_batch": 4},
                            "train": {"run_dir": str(tmp_path / "run")}})
    calls = []
    main_data = build_run_data(cfg, main=True, barrier=lambda: calls.append("main"))
    saved = tmp_path / "run" / "tokenizer" / "tokenizer.json"
    assert saved.is_file() and calls == ["main"]

    def no_training(*args, **kwargs):
        raise AssertionError("a non-main rank trained the tokenizer")

    monkeypatch.setattr(tokmod.BPETokenizer, "train", classmethod(no_training))
    other = build_run_data(cfg, dp_rank=1, dp_size=2, main=False,
                           barrier=lambda: calls.append("other"))
    assert calls == ["main", "other"]
    assert other.tokenizer.fingerprint == main_data.tokenizer.fingerprint
    # A tokenizer.json path makes the model's vocabulary follow it (the BPE file is one too).
    followed = follow_tokenizer(config_from_dict({"model": "debug", "data": {
        "tokenizer": str(saved), "seq_len": 32}}))
    assert followed.model.vocab == other.tokenizer.vocab_size
    with pytest.raises(UserError, match="data.tokenizer='nope'"):
        config_from_dict({"data": {"tokenizer": "nope"}})


def _llama_folder(tmp_path: Path) -> Path:
    """A Hugging Face checkpoint folder as a team brings it: weights, config.json and the
    tokenizer its embedding rows were trained with."""
    transformers = pytest.importorskip("transformers")
    folder = _hf_tokenizer(tmp_path)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=320, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_init_from_folder_brings_its_tokenizer(tmp_path):
    """`meshtron train --init-from DIR` without --tokenizer trains on DIR's tokenizer.json (the
    byte tokenizer's ids would index unrelated rows of the pretrained embedding) and exports
    it; an explicit --tokenizer byte is kept."""
    import tomllib

    folder = _llama_folder(tmp_path)
    common = ["--data", str(_corpus(tmp_path)), "--steps", "1", "--seq-len", "32",
              "--global-batch", "2", "--eval-every", "0"]
    run, out = tmp_path / "run", tmp_path / "export"
    code, err = _run(["train", "--init-from", str(folder), *common, "--run-dir", str(run),
                      "--export", str(out)])
    assert code == 0, err
    assert tomllib.loads((run / "run.toml").read_text())["data"]["tokenizer"] == str(folder)
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    code, err = _run(["train", "--init-from", str(folder), "--tokenizer", "byte", *common,
                      "--run-dir", str(tmp_path / "bytes")])
    assert code == 0, err
    recorded = tomllib.loads((tmp_path / "bytes" / "run.toml").read_text())["data"]
    assert recorded["tokenizer"] == "byte"


def test_init_from_folder_with_only_a_sentencepiece_model_is_one_line(tmp_path):
    """A folder whose tokenizer is a SentencePiece tokenizer.model only (no tokenizer.json)
    is refused rather than trained on byte ids."""
    folder = _llama_folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")
    code, err = _run(["train", "--init-from", str(folder), "--steps", "1", "--seq-len", "32",
                      "--run-dir", str(tmp_path / "run")])
    line = err.strip()
    assert code == 2 and len(line.splitlines()) == 1, err
    assert f"train.init_from={str(folder)!r}" in line and "tokenizer.model" in line, line
    assert not (tmp_path / "run").exists()
