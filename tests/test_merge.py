"""`meshtron merge`: sparse upcycling reproduces the dense model's logits for every router kind;
Branch-Train-MiX of two trained branches loads and trains; bad input is one line, exit 2, and
leaves nothing behind."""

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from meshtron.cli import main
from meshtron.model import PRESETS, Transformer
from meshtron.model.init import named_unique_parameters
from meshtron.modular.branches import describe, load_state
from meshtron.modular.upcycle import load_state as fill
from meshtron.modular.upcycle import merge_states, moe_spec

DENSE = PRESETS["debug"]


def _dense_model():
    """A dense model whose MLPs matter: w2 scaled up so that dropping the MLPs moves the
    logits by far more than the tolerance."""
    model = Transformer(DENSE, init_seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("feed_forward.w2.weight"):
                p.mul_(40)
            if name.endswith("norm.weight"):
                p.add_(torch.rand_like(p))
    return model


ROUTERS = {
    "softmax-top2": (2, {}),
    "softmax-top1": (1, {}),
    "softmax-unnormalised": (2, {"moe_norm_topk": False}),
    "sigmoid-deepseek": (2, {"moe_router": "sigmoid", "moe_groups": 2, "moe_topk_groups": 1,
                             "moe_shared_experts": 1, "moe_dense_layers": 1,
                             "moe_route_scale": 2.5, "moe_bias_update": 1e-3}),
    "sigmoid-unnormalised": (2, {"moe_router": "sigmoid", "moe_norm_topk": False,
                                 "moe_shared_experts": 2}),
}


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_upcycled_logits_equal_dense(kind):
    top_k, fields = ROUTERS[kind]
    dense = _dense_model()
    state = {n: p.detach().clone() for n, p in named_unique_parameters([dense])}
    spec = moe_spec(DENSE, 4, top_k, fields)
    merged, init = merge_states([state], spec, copies=4, seed=1)
    moe = Transformer(spec, init_seed=0)
    fill(moe, merged)
    tokens = torch.randint(0, DENSE.vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = dense(tokens)
        got = moe(tokens)
        no_mlp = Transformer(DENSE, init_seed=3)
        fill(no_mlp, {n: (torch.zeros_like(t) if ".w2." in n else t) for n, t in state.items()})
        far = (no_mlp(tokens) - ref).abs().max()
    assert init.gate == ("random" if top_k > 1 and fields.get("moe_norm_topk", True) else "zero")
    assert far > 1.0  # the MLPs carry the logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _write_text(folder, text, files=12):
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"doc{i:02d}.txt").write_text(text * (20 + i))
    return folder


def _train(*args):
    assert main(["train", "--seq-len", "32", "--global-batch", "4", "--eval-every", "0",
                 "--warmup-steps", "1", *args]) == 0


@pytest.fixture(scope="module")
def branches(tmp_path_factory):
    """A base (trained 3 steps, exported) and two branches of it on different text."""
    root = tmp_path_factory.mktemp("btx")
    code = _write_text(root / "code", "def add(a, b):\n    return a + b\n\n")
    prose = _write_text(root / "prose", "The quick brown fox jumps over the lazy dog. ")
    _train("--model", "debug", "--data", str(prose), "--steps", "2", "--run-dir",
           str(root / "base"), "--export", str(root / "base_w"), "--checkpoint-every", "2")
    for name, data in (("a", code), ("b", prose)):
        _train("--init-from", str(root / "base_w"), "--data", str(data), "--steps", "3",
               "--run-dir", str(root / name), "--checkpoint-every", "3")
    return root


def test_btx_merge_loads_and_trains(branches, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge", "--experts", str(branches / "a"), str(branches / "b"),
                 "--to", str(out), "--top-k", "1"]) == 0
    doc = json.loads((out / "merge.json").read_text())
    assert doc["method"] == "branch-train-mix" and doc["router"]["gate"] == "random"
    scale = doc["router"]["routed_w2"]  # top-1 of a softmax over 2: weights start near 1/2
    assert scale == pytest.approx(2.0)
    bases = [b["base"] for b in doc["branches"]]
    assert bases[0] == bases[1] and bases[0].startswith("init:")  # base_w's weights' digest
    assert [(b["run"], b["step"]) for b in doc["branches"]] == [
        (str((branches / n).resolve()), 3) for n in ("a", "b")]
    merged = load_state(describe(out))
    a, b = (load_state(describe(branches / n)) for n in ("a", "b"))
    for i in range(DENSE.layers):
        p = f"layers.{i}.feed_forward."
        for w in ("w1", "w2", "w3"):  # expert 0 = branch a's MLP, expert 1 = branch b's
            f = scale if w == "w2" else 1.0
            for e, branch in enumerate((a, b)):
                torch.testing.assert_close(merged[f"{p}experts.{w}.weight"][e],
                                           branch[f"{p}{w}.weight"] * f, rtol=0, atol=0)
    for name in ("tok_embeddings.weight", "layers.1.attention.wq.weight", "norm.weight"):
        torch.testing.assert_close(merged[name], (a[name] + b[name]) / 2)
    run = tmp_path / "run"
    _train("--init-from", str(out), "--data", str(branches / "code"), "--steps", "6",
           "--lr", "3e-3", "--run-dir", str(run), "--checkpoint-every", "6")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"] - 0.05, summary
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "moe_imbalance_max" in lines[-1]
    # the MoE's export says how many tensors its files hold (one per expert), not meshtron's
    # count of stacked experts (audit 47: "(51 tensors)" for a file of 231)
    capsys.readouterr()
    assert main(["export", str(run), "--to", str(tmp_path / "run_w")]) == 0
    held = describe(tmp_path / "run_w")
    from meshtron.hf.load import Checkpoint

    written = len(Checkpoint(tmp_path / "run_w").shapes)
    assert written > len(load_state(held)) and f"({written} tensors)" in capsys.readouterr().out
    # the merge's output is a Hugging Face folder already: said so, pointing to --init-from
    # (was "no complete checkpoint ... save some with --checkpoint-every")
    assert main(["export", str(out), "--to", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a Hugging Face folder already" in err, err
    assert f"train --init-from {out}" in err and not (tmp_path / "again").exists()


def test_upcycle_through_the_cli_keeps_logits(branches, tmp_path):
    out = tmp_path / "up"
    assert main(["merge", "--experts", str(branches / "base_w"), "--copies", "4",
                 "--to", str(out)]) == 0
    dense_b, moe_b = describe(branches / "base_w"), describe(out)
    assert moe_b.spec.moe_experts == 4 and moe_b.spec.moe_top_k == 2
    dense, moe = Transformer(dense_b.spec, init_seed=0), Transformer(moe_b.spec, init_seed=0)
    fill(dense, load_state(dense_b))
    fill(moe, load_state(moe_b))
    tokens = torch.randint(0, DENSE.vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens), dense(tokens), rtol=1e-5, atol=1e-5)


def _weights(folder, spec, seed):
    """An exported weights folder of a fresh model (save_hf, as `meshtron export` writes)."""
    from meshtron.hf.export import save_hf

    model = Transformer(spec, init_seed=seed)
    save_hf(dict(named_unique_parameters([model])), spec, folder)
    return str(folder)


def test_bad_input_one_line_exit_2(branches, tmp_path, capsys):
    other = _weights(tmp_path / "other", DENSE.replace(ffn_hidden=128), 0)  # another shape
    fresh = _weights(tmp_path / "fresh", DENSE, 5)  # no recorded base, far from the branches
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    a, b = str(branches / "a"), str(branches / "b")
    cases = {
        "model.ffn_hidden=128": [a, other],
        "must share one base": [a, str(branches / "base")],  # from the seed, not base_w
        "given twice": [a, a],
        "neither a meshtron run folder": [a, str(tmp_path / "full")],
        "is one checkpoint of a run": [a, str(branches / "b" / "checkpoints" / "step_00000003")],
        "--copies E": [a],
        "not branches of one base": [a, fresh],
    }
    out = tmp_path / "out"
    for needle, experts in cases.items():
        assert main(["merge", "--experts", *experts, "--to", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    for needle, extra in {"--to='/proc/x'": ["--to", "/proc/x"],
                          "not an empty folder": ["--to", str(tmp_path / "full")],
                          "--top-k=3": ["--to", str(out), "--top-k", "3"],
                          # more experts than host memory holds: was an allocator traceback
                          "--copies=1000000: 2,000,000 experts": ["--to", str(out), "--copies",
                                                                  "1000000"],
                          "--seed: '-1'": ["--to", str(out), "--seed", "-1"],
                          "model.hidden": ["--to", str(out), "--set", "model.hidden=8"],
                          "a sigmoid router": ["--to", str(out), "--set",
                                                "model.moe_router=sigmoid"]}.items():
        assert main(["merge", "--experts", a, b, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_one_model_twice_is_refused(branches, tmp_path, monkeypatch, capsys):
    """A run, its exports (train --export, meshtron export, two of one step), other spellings
    of its path and a copy of its export are one model: one line naming both inputs as typed,
    exit 2, nothing written."""
    base = branches / "base"
    e1, e2, e3 = (str(tmp_path / n) for n in ("e1", "e2", "e3"))
    assert main(["export", str(base), "--to", e1]) == 0
    assert main(["export", str(base), "--to", e2, "--step", "2"]) == 0
    for folder in (e1, str(branches / "base_w")):  # the run and step they are of, recorded
        origin = json.loads((tmp_path / folder / "export.json").read_text())
        assert (origin["run"], origin["step"]) == (str(base.resolve()), 2), origin
    (tmp_path / "link").symlink_to(base)
    shutil.copytree(branches / "base_w", e3)
    (tmp_path / "e3" / "export.json").unlink()  # a copy no record links: same tensors
    monkeypatch.chdir(branches)
    capsys.readouterr()
    out = tmp_path / "out"
    cases = [("base", "base_w"), ("base", e1), (e1, e2), ("base", str(tmp_path / "link")),
             ("base", f"{base}/"), ("base", "./base"), ("base_w", e3)]
    for first, second in cases:
        assert main(["merge", "--experts", first, second, "--to", str(out)]) == 2, second
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{first!r} and {second!r}" in err, err
        assert "given twice" in err, err
        # known before a tensor is read (the copy without a record: as its tensors are read)
        assert ("hold the same weights" if second == e3 else "are one model (run ") in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    # an export records its base, so a branch and its own base are refused as runs are
    assert main(["merge", "--experts", "a", "base_w", "--to", str(out)]) == 2
    assert "must share one base" in capsys.readouterr().err


def _damage(folder, how):
    """A copy of an input damaged one way (what a user's disk or hands do to a folder)."""
    if how == "truncated weights":
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-1000])
    elif how == "padded weights":
        with open(folder / "model.safetensors", "ab") as f:
            f.write(b"\0" * 64)
    elif how == "bad config.json":
        (folder / "config.json").write_text("{not json")
    elif how == "bad export.json":
        (folder / "export.json").write_text('{"format": "meshtron-export/1", "run": 3}')
    elif how == "bad run.toml":
        (folder / "run.toml").write_text("[model\n")
    elif how == "every checkpoint damaged":
        for shard in (folder / "checkpoints").glob("step_*/*.distcp"):
            os.truncate(shard, 100)
    return str(folder)


DAMAGE = {"truncated weights": ("base_w", "is truncated"),
          "padded weights": ("base_w", "longer than its tensors"),
          "bad config.json": ("base_w", "is not valid JSON"),
          "bad export.json": ("base_w", "export.json is damaged"),
          "bad run.toml": ("b", "not valid TOML"),
          "every checkpoint damaged": ("b", "no complete checkpoint")}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_input_is_one_line_naming_it(branches, tmp_path, capsys, how):
    source, needle = DAMAGE[how]
    bad = tmp_path / "bad"
    shutil.copytree(branches / source, bad)
    bad = _damage(bad, how)
    out = tmp_path / "out"
    code = main(["merge", "--experts", str(branches / "a"), bad, "--to", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"merge --experts={bad!r}" in err.replace(f"{bad}/run.toml", bad), err
    assert needle in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_export_never_replaces_a_runs_record(branches, tmp_path, capsys):
    """`meshtron export RUN --to RUN` and `train --export` into its own run folder wrote the
    weights' config.json over the run's own: both refused in one line, nothing written; a
    run's --export records the run and step, and merging a run with its own export is
    refused. (A 2-rank run's --export, written by rank 0, records them as well: tests/
    test_compress_priced.py's DiLoCo runs; here one process, in this process: suite time.)"""
    run = tmp_path / "run"
    shutil.copytree(branches / "a", run)
    before = (run / "config.json").read_text()
    assert main(["export", str(run), "--to", str(run)]) == 2
    assert "is a meshtron run folder" in capsys.readouterr().err
    assert (run / "config.json").read_text() == before and not list(run.glob("*.safetensors"))
    fresh = tmp_path / "fresh"
    assert main(["train", "--model", "debug", "--steps", "1", "--run-dir", str(fresh),
                 "--export", str(fresh)]) == 2
    assert "train.export" in capsys.readouterr().err and not fresh.exists()
    two = tmp_path / "two"
    _train("--model", "debug", "--steps", "2", "--checkpoint-every", "2", "--run-dir",
           str(two), "--export", str(two / "weights"))
    origin = json.loads((two / "weights" / "export.json").read_text())
    assert (origin["run"], origin["step"], origin["seed"]) == (str(two.resolve()), 2, 0)
    capsys.readouterr()
    assert main(["merge", "--experts", str(two), str(two / "weights"), "--to",
                 str(tmp_path / "m")]) == 2
    assert "given twice" in capsys.readouterr().err


def test_merge_into_the_current_empty_folder(branches, tmp_path, monkeypatch):
    """`--to .` in an empty folder was an OSError traceback (the folder was removed to rename
    the result into place): the finished files are moved into it instead."""
    here = tmp_path / "here"
    here.mkdir()
    copy = tmp_path / "copy"
    shutil.copytree(branches / "base_w", copy)
    (copy / "export.json").unlink()
    monkeypatch.chdir(here)
    # refused as the tensors are read (staged inside '.' by then): '.' is left empty
    assert main(["merge", "--experts", str(branches / "base_w"), str(copy), "--to", "."]) == 2
    assert list(here.iterdir()) == []
    assert main(["merge", "--experts", str(branches / "a"), str(branches / "b"),
                 "--to", "."]) == 0
    assert sorted(p.name for p in here.iterdir()) == ["config.json", "merge.json",
                                                      "model.safetensors"]
    assert describe(here).spec.moe_experts == 2


def test_relative_init_from_is_read_where_the_run_was_trained(branches, tmp_path, monkeypatch):
    """run.toml keeps `--init-from base_w` as typed; merging or exporting from another folder
    resolved it against today's working folder, so a branch's base became a path that does
    not exist and an export of one base was refused as 'must share one base'."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "base_w").symlink_to(branches / "base_w")
    monkeypatch.chdir(work)
    _train("--init-from", "base_w", "--data", str(branches / "code"), "--steps", "2",
           "--checkpoint-every", "2", "--run-dir", "rel")
    monkeypatch.chdir(tmp_path)
    assert main(["export", "work/rel", "--to", "rel_w"]) == 0
    origin = json.loads((tmp_path / "rel_w" / "export.json").read_text())
    assert origin["init_from"] == str((branches / "base_w").resolve()), origin
    assert main(["merge", "--experts", str(branches / "b"), "rel_w", "--to", "m"]) == 0
    bases = {b["base"] for b in json.loads((tmp_path / "m" / "merge.json").read_text())
             ["branches"]}
    assert len(bases) == 1 and bases.pop().startswith("init:")


def _export_as_elsewhere(branches, out, name, **record):
    """`meshtron export` of branch `name` to `out`, its export.json then saying what the same
    command on another machine would have: `record`'s fields (another run folder, base path)."""
    assert main(["export", str(branches / name), "--to", str(out)]) == 0
    path = out / "export.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **record}))
    return str(out)


def test_other_runs_of_one_folder_and_moved_bases_merge(branches, tmp_path, capsys):
    """Two branches trained at one path (/scratch/run on two machines, or a folder reused with
    --overwrite) to one step were refused as 'one model given twice' by their export.json's run
    and step; an export whose base folder is not on this machine (trained elsewhere) was
    refused as 'must share one base' against a run of that same base here."""
    scratch = str(tmp_path / "scratch" / "run")  # the path both were trained at
    ea = _export_as_elsewhere(branches, tmp_path / "ea", "a", run=scratch)
    eb = _export_as_elsewhere(branches, tmp_path / "eb", "b", run=scratch)
    origins = [json.loads((Path(e) / "export.json").read_text()) for e in (ea, eb)]
    assert origins[0]["step"] == origins[1]["step"] == 3
    assert origins[0]["config"] != origins[1]["config"]  # their own data: two runs
    assert main(["merge", "--experts", ea, eb, "--to", str(tmp_path / "m1")]) == 0, \
        capsys.readouterr().err
    moved = _export_as_elsewhere(branches, tmp_path / "moved", "a",
                                 init_from="/elsewhere/base_w")
    assert main(["merge", "--experts", moved, str(branches / "b"),
                 "--to", str(tmp_path / "m2")]) == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "m2" / "merge.json").read_text())
    assert [b["base"][:5] for b in doc["branches"]] == ["path:", "init:"]
    # one run's export, moved with its record, is still that run at that step
    assert main(["merge", "--experts", str(branches / "a"), moved,
                 "--to", str(tmp_path / "m3")]) == 2
    assert "given twice" in capsys.readouterr().err


def test_run_id_names_a_run_wherever_its_folder_moved(branches, tmp_path, capsys):
    """Two exports of one run at one step are one model by its id even after the run folder was
    moved (renamed): they used to pass the records' check (two run paths) and be caught only as
    their tensors were read. Two runs are two models by their ids even where path, step and
    run.toml digest agree (one path and one run file on two machines, other data there)."""
    run_id = tomllib.loads((branches / "a" / "run.toml").read_text())["train"]["run_id"]
    assert main(["export", str(branches / "a"), "--to", str(tmp_path / "e1")]) == 0
    moved = tmp_path / "moved" / "renamed"
    shutil.copytree(branches / "a", moved)  # the run folder, moved (the fixture's stays)
    assert main(["export", str(moved), "--to", str(tmp_path / "e2")]) == 0
    origins = [json.loads((tmp_path / e / "export.json").read_text()) for e in ("e1", "e2")]
    assert [o["run_id"] for o in origins] == [run_id, run_id]
    assert origins[0]["run"] != origins[1]["run"]
    capsys.readouterr()
    out = tmp_path / "out"
    for second in (str(tmp_path / "e2"), str(moved)):
        assert main(["merge", "--experts", str(tmp_path / "e1"), second, "--to", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"are one model (run {run_id} at step 3)" in err, err
    assert not out.exists()
    same = dict(run=str(tmp_path / "scratch"), config="sha256:" + "0" * 64)
    ea = _export_as_elsewhere(branches, tmp_path / "ea", "a", **same)
    eb = _export_as_elsewhere(branches, tmp_path / "eb", "b", **same)
    assert main(["merge", "--experts", ea, eb, "--to", str(tmp_path / "m")]) == 0, \
        capsys.readouterr().err
    doc = json.loads((tmp_path / "m" / "merge.json").read_text())
    assert [b["run_id"] for b in doc["branches"]][0] == run_id
    assert len({b["run_id"] for b in doc["branches"]}) == 2
