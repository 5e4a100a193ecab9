"""The data inputs a user audit found wrong, through the `meshtron train` command as typed:
text that is not UTF-8 (refused above 1% damaged bytes, a warning below), a source too small
for a held-out sequence (no held-out sequence needed with evaluation off; the advice names what
helps), a 50k-vocabulary shard (the message names `--tokenizer`, a flag that exists), and every
flag and config key that a data or config error message names exists.

Through `meshtron.cli.main` in this process; the runs are 2-3 steps of the debug model.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from meshtron.cli import main
from testkit.plan_cli import refused
from meshtron.config import RunConfig
from meshtron.data import write_token_shard

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog. " * 400
TRAIN = ["train", "--model", "debug", "--steps", "2", "--seq-len", "16", "--global-batch", "4"]


@pytest.mark.parametrize("name, raw, says", [
    ("u16.txt", TEXT.encode("utf-16"),
     "not UTF-8 text (UTF-16?): 2 undecodable UTF-8 sequences (0.00556% of its bytes) and "
     "18000 NUL bytes (50%)"),
    ("latin.txt", ("Les élèves étaient très nombreux. " * 300).encode("latin-1"),
     "not UTF-8 text (LATIN1?): 1200 undecodable UTF-8 sequences (11.8% of its bytes)"),
    ("u16.jsonl", (json.dumps({"text": TEXT}) + "\n").encode("utf-16"),
     "not UTF-8 text (UTF-16?)"),
])
def test_text_that_is_not_utf8_is_refused(capsys, tmp_path, name, raw, says):
    (tmp_path / name).write_bytes(raw)
    run_dir = tmp_path / "run"
    line = refused(capsys, *TRAIN, "--data", tmp_path / name, "--run-dir", run_dir)
    assert f"data.source='{tmp_path / name}': {says}" in line, line
    assert "allowed: UTF-8 text with at most 1% damaged bytes" in line, line
    assert not run_dir.exists()


def test_a_stray_byte_trains_with_one_warning_per_file(capsys, tmp_path):
    """Below 1% the run trains; each file's count is said once (the first 5 files, then how
    many more), by the launching process only."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(7):
        (folder / f"d{i}.txt").write_bytes(TEXT.encode() + b"\xe9" + TEXT.encode())
    capsys.readouterr()
    assert main([*TRAIN, "--data", str(folder), "--run-dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "U+FFFD" in line or "more files" in line]
    assert warned == [f"meshtron train: warning: data.source='{folder / f'd{i}.txt'}': 1 "
                      "undecodable UTF-8 sequence (0.00278% of its bytes), read as U+FFFD (the "
                      "file is not clean UTF-8)" for i in range(5)] + [
        "meshtron train: warning: 2 more files like these"], err


def test_small_data_trains_with_eval_off_and_says_what_helps(capsys, tmp_path):
    folder = tmp_path / "sp ace"
    folder.mkdir()
    source = folder / "my data.txt"
    source.write_text("hello world, tiny data here.\n")  # 29 tokens + EOS: held-out holds 0
    small = ["train", "--model", "debug", "--steps", "2", "--data", source, "--seq-len", "4",
             "--global-batch", "4"]
    line = refused(capsys, *small, "--run-dir", tmp_path / "on")
    assert line.endswith(
        f"error: data.seq_len=4: the held-out split of '{source}' (the last 1/50 of its tokens) "
        "holds 0 tokens, fewer than one sequence of seq_len+1=5; add data, or turn evaluation "
        "off (--eval-every 0: the held-out split is then never read)"), line
    assert "shorter" not in line and "--seq-len" not in line  # it could not help here
    capsys.readouterr()
    run_dir = tmp_path / "off"
    assert main([str(a) for a in small] + ["--eval-every", "0", "--run-dir", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2, summary


def test_big_vocabulary_shard_names_the_tokenizer_flag(capsys, tmp_path):
    shard = write_token_shard(tmp_path / "big.bin", np.arange(5000) % 50_000, 50_257)
    line = refused(capsys, *TRAIN, "--data", shard, "--run-dir", tmp_path / "run")
    assert "holds ids of a 50257-token vocabulary" in line and "--tokenizer FILE.json" in line
    assert "tokenizer_path" not in line
    line = refused(capsys, *TRAIN, "--data", shard, "--tokenizer", "bpe",
                   "--run-dir", tmp_path / "run")
    assert "--tokenizer FILE.json" in line and "tokenizer_path" not in line, line


# ---- every flag and key a message names exists ---------------------------------------------

MESSAGE_FILES = [*sorted((ROOT / "meshtron" / "data").glob("*.py")), ROOT / "meshtron/config.py",
                 *(ROOT / "meshtron" / "train" / f for f in ("loop.py", "cli.py", "job.py"))]


KEY = r"(?<![\w.])((?:data|optim|train|model)\.[a-z_]+)(?=[=:' ])"
"""A config key as messages name it: `data.seq_len=4`, `train.init_from:` ..."""


def _message_text(path: Path) -> list[str]:
    """The literal text of every `UserError(...)` raised in `path` (f-string parts joined)."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "UserError":
            parts = [n.value for arg in node.args for n in ast.walk(arg)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            texts.append("".join(parts))
    return texts


def test_every_flag_and_key_a_data_message_names_exists():
    from meshtron.cli import build_parser

    train = build_parser("train")._subparsers._group_actions[0].choices["train"]
    flags = set(train._option_string_actions)
    keys = {f"{s}.{f.name}" for s in ("data", "optim", "train", "model")
            for f in dataclasses.fields(getattr(RunConfig(), s))}
    found_flags, found_keys, bad = set(), set(), []
    for path in MESSAGE_FILES:
        for text in _message_text(path):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text):
                found_flags.add(flag)
                if flag not in flags:
                    bad.append(f"{path.name}: {flag} in {text!r}")
            for key in re.findall(KEY, text):
                found_keys.add(key)
                if key not in keys:
                    bad.append(f"{path.name}: {key} in {text!r}")
    assert not bad, bad
    # The scan reads real messages (an empty scan would pass anything).
    assert {"--tokenizer", "--eval-every", "--global-batch"} <= found_flags, found_flags
    assert {"data.seq_len", "data.source", "data.tokenizer"} <= found_keys, found_keys


def test_documented_shard_workflow_trains(capsys, tmp_path):
    """docs/guides/train.md, "Token shards": a tokenizer.json, the text readers, a shard
    written with the tokenizer's fingerprint, then `meshtron train --data train.bin
    --tokenizer tokenizer.json`."""
    tk = pytest.importorskip("tokenizers")
    from meshtron.data import read_text_files
    from meshtron.data.tokenizer import HFTokenizer

    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    backend.train_from_iterator([TEXT] * 4, trainer=tk.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"d{i}.txt").write_text(TEXT.replace("fox", f"fox {i}"))

    tok = HFTokenizer.load(tmp_path / "tokenizer.json")
    ids = tok.encode_documents(list(read_text_files(tmp_path / "corpus")))
    shard = write_token_shard(tmp_path / "train.bin", ids, tok.vocab_size,
                              meta={"tokenizer": tok.fingerprint})
    run_dir = tmp_path / "run"
    argv = [*TRAIN, "--data", shard, "--tokenizer", tmp_path / "tokenizer.json",
            "--run-dir", run_dir]
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_tokenize_writes_a_shard_that_train_reads(capsys, tmp_path):
    """`meshtron tokenize --data SOURCE --out NAME.bin`, then `meshtron train --data NAME.bin`;
    the same UTF-8 check as train's, one line for a bad --out."""
    source = tmp_path / "corpus.txt"
    source.write_text(TEXT)
    shard = tmp_path / "train.bin"
    capsys.readouterr()
    assert main(["tokenize", "--data", str(source), "--out", str(shard)]) == 0
    said = capsys.readouterr().out.strip()
    assert said == (f"{shard}: 18,001 tokens of 1 document, vocabulary 259; train on it: "
                    f"meshtron train --data {shard}"), said
    side = json.loads((tmp_path / "train.bin.json").read_text())
    assert side["num_tokens"] == 18_001 and side["meta"]["tokenizer"] == "byte-259-v1", side
    assert shard.stat().st_size == 2 * 18_001  # uint16 ids
    run_dir = tmp_path / "run"
    assert main([*TRAIN, "--data", str(shard), "--run-dir", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2

    line = refused(capsys, "tokenize", "--data", source, "--out", shard)
    assert line.endswith(f"error: --out='{shard}': exists; --overwrite replaces it"), line
    line = refused(capsys, "tokenize", "--data", source, "--out", tmp_path / "x.txt")
    assert "must end in .bin" in line, line
    line = refused(capsys, "tokenize", "--data", source, "--out", source / "x.bin")
    assert "a folder on its path is a file" in line, line
    (tmp_path / "u16.txt").write_bytes(TEXT.encode("utf-16"))
    line = refused(capsys, "tokenize", "--data", tmp_path / "u16.txt", "--out", tmp_path / "u.bin")
    assert "not UTF-8 text (UTF-16?)" in line and not (tmp_path / "u.bin").exists(), line
    line = refused(capsys, "tokenize", "--data", shard, "--out", tmp_path / "again.bin")
    assert "a token shard holds ids, not documents" in line, line
    # session-52 user audit: asked for "the tokenizer file it was written with" (there is none)
    line = refused(capsys, *TRAIN, "--data", shard, "--tokenizer", "bpe", "--run-dir",
                   tmp_path / "bpe")
    assert line.endswith(f"error: data.tokenizer='bpe': shard '{shard}' was written with the "
                         "byte tokenizer (259 ids); allowed: --tokenizer byte (the default: "
                         "drop --tokenizer)"), line
    assert not (tmp_path / "bpe").exists()
    # the sidecar given for the shard was read as JSON Lines ("invalid JSON ... column 2")
    line = refused(capsys, *TRAIN, "--data", f"{shard}.json", "--run-dir", tmp_path / "side")
    assert line.endswith(f"error: data.source='{shard}.json': the sidecar of the token shard "
                         f"'{shard}' (its dtype and vocabulary); allowed: the shard itself, "
                         f"--data {shard}"), line
    assert not (tmp_path / "side").exists()


def test_json_lines_file_named_json_trains_on_its_text(capsys, tmp_path):
    """Hugging Face datasets' `to_json` writes JSON Lines to a `.json` file: its `text`
    fields are the documents (read as plain text it trained on the JSON syntax)."""
    lines = "".join(json.dumps({"text": TEXT[:200 + i], "id": i}) + "\n" for i in range(30))
    for name in ("rows.jsonl", "rows.json"):
        (tmp_path / name).write_text(lines)
        assert main(["tokenize", "--data", str(tmp_path / name), "--out",
                     str(tmp_path / f"{name}.bin")]) == 0
    counts = [json.loads((tmp_path / f"{n}.bin.json").read_text())["num_tokens"]
              for n in ("rows.jsonl", "rows.json")]
    assert counts[0] == counts[1] == sum(200 + i + 1 for i in range(30)), counts


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_table_file_is_refused_not_read_as_text(capsys, tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    path.write_bytes(b"PAR1" + TEXT.encode() + b"PAR1")  # a table whose column is UTF-8
    line = refused(capsys, *TRAIN, "--data", path, "--run-dir", tmp_path / "run")
    assert f"data.source='{path}': a {suffix} table is not read" in line, line
    assert not (tmp_path / "run").exists()


def test_json_key_names_the_text_field(capsys, tmp_path):
    """Datasets keep their text under `content`, `story`...: `--json-key FIELD` (data.json_key,
    Megatron's --json-keys) reads it; a field the first record lacks is refused before any
    reading, naming the keys it has; a later record without it is named by file and line."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "content": TEXT[:300 + i]}) + "\n"
                            for i in range(40)))
    run_dir = tmp_path / "run"
    line = refused(capsys, *TRAIN, "--data", rows, "--run-dir", run_dir)
    assert line.endswith(f"error: data.json_key='text': not a field of the first record of "
                         f"{rows} (its keys: 'id', 'content'); allowed: one of those "
                         "(--json-key FIELD)"), line
    line = refused(capsys, *TRAIN, "--data", rows, "--json-key", "story", "--run-dir", run_dir)
    assert "data.json_key='story': not a field" in line, line
    line = refused(capsys, *TRAIN, "--json-key", "content", "--run-dir", run_dir)
    assert "data.json_key='content': names the text field of JSON Lines records, but " \
           "data.source='stdlib' holds none" in line, line
    assert not run_dir.exists()
    assert main([*TRAIN, "--data", str(rows), "--json-key", "content",
                 "--run-dir", str(run_dir)]) == 0, capsys.readouterr().err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    # the documents are the `content` strings (each followed by EOS), and a resume keeps it
    assert main(["tokenize", "--data", str(rows), "--json-key", "content",
                 "--out", str(tmp_path / "rows.bin")]) == 0
    side = json.loads((tmp_path / "rows.bin.json").read_text())
    assert side["num_tokens"] == sum(300 + i + 1 for i in range(40)), side
    assert 'json_key = "content"' in (run_dir / "run.toml").read_text()
    with rows.open("a") as fh:
        fh.write(json.dumps({"id": 40, "text": "no content"}) + "\n")
    line = refused(capsys, *TRAIN, "--data", rows, "--json-key", "content",
                   "--run-dir", tmp_path / "run2")
    assert f"data.source line {rows}:41: no 'content' field (keys: 'id', 'text')" in line, line
