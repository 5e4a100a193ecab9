"""A `--data` folder of JSON Lines shards (what Hugging Face datasets' `to_json` writes) is read
as JSON Lines, shard by shard in sorted order; a folder mixing shards and text files is refused
in one line (data/sources.py read_folder)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from meshtron.cli import main
from meshtron.data.pipeline import read_documents


def _shard(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))


def _docs(tag: str, n: int) -> list[str]:
    return [f"{tag} document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(40))
            for i in range(n)]


def _train(data: Path, run: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--data", str(data), "--steps", "2", "--seq-len", "32",
                     "--global-batch", "2", "--eval-every", "0", "--run-dir", str(run)])
    return code, err.getvalue()


def test_folder_of_shards_trains_as_the_one_file_they_split(tmp_path):
    """The folder (shards in a subfolder too) trains exactly as one .jsonl holding the shards'
    lines in sorted path order: same documents, same order, same losses."""
    first, second, third = _docs("a", 12), _docs("b", 9), _docs("c", 10)
    folder = tmp_path / "shards"
    _shard(folder / "train-00001-of-00002.jsonl", second)
    _shard(folder / "train-00000-of-00002.jsonl", first)
    _shard(folder / "z" / "extra.jsonl", third)
    (folder / "dataset_info.json").write_text('{\n  "features": {}\n}\n')  # not JSON Lines
    assert read_documents(folder) == first + second + third
    whole = tmp_path / "whole.jsonl"
    _shard(whole, first + second + third)
    code, err = _train(folder, tmp_path / "run_folder")
    assert code == 0, err
    code, err = _train(whole, tmp_path / "run_file")
    assert code == 0, err
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl")
               .read_text().splitlines() if '"loss"' in line]
              for run in ("run_folder", "run_file")]
    assert losses[0] and losses[0] == losses[1]


def test_bad_line_in_a_shard_is_named(tmp_path):
    folder = tmp_path / "shards"
    _shard(folder / "part-0.jsonl", _docs("a", 5))
    (folder / "part-1.jsonl").write_text('{"text": "fine"}\n{"content": "no text"}\n')
    code, err = _train(folder, tmp_path / "run")
    assert code == 2
    assert "part-1.jsonl:2" in err and "'text'" in err, err


def test_shards_beside_text_files_are_refused(tmp_path):
    folder = tmp_path / "shards"
    _shard(folder / "train-00000.jsonl", _docs("a", 5))
    (folder / "README.md").write_text("# dataset card\n")
    code, err = _train(folder, tmp_path / "run")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "train-00000.jsonl" in lines[0] and "README.md" in lines[0], err
    assert "Traceback" not in err
