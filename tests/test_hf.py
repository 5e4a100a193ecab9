"""Hugging Face weights in and out: tiny random Llama, Qwen2 and GPT-2 checkpoints written by
`transformers` (fp32), loaded with meshtron's sharded reader under tp=2 and pp=2 (each rank
reading only its slices), compared logit by logit with `transformers`; trained, exported from
the parallel layout, and reloaded in `transformers`; a tp=2 x pp=2 dry run (lr 0) through the
CLI exports every tensor bit-identical; damaged checkpoints fail with one line naming the tensor.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.cli import main
from testkit.multiproc import run_on_ranks


def _transformers():
    # Imported in the test process only: the ranks load this module too and need not pay for it.
    return pytest.importorskip("transformers")


def _st():
    return pytest.importorskip("safetensors.torch")

SHAPES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=4, vocab_size=320, max_position_embeddings=128)
VOCAB = SHAPES["vocab_size"]
LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """llama: sharded (index + 12 files), rope_theta 5000; qwen2: one file, q/k/v biases."""
    transformers = _transformers()
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=5000.0, **SHAPES))
    llama.save_pretrained(root / "llama", max_shard_size="60KB")
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False,
                                                                  **SHAPES))
    with torch.no_grad():  # non-zero biases, so a dropped bias shows in the logits
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.05)
    qwen.save_pretrained(root / "qwen2")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=0,
        eos_token_id=0))
    with torch.no_grad():  # q | k | v biases differ, so a wrong column offset shows
        for block in gpt2.transformer.h:
            block.attn.c_attn.bias.normal_(0.0, 0.05)
    gpt2.save_pretrained(root / "gpt2")
    return {"llama": root / "llama", "qwen2": root / "qwen2", "gpt2": root / "gpt2"}


def _hf_logits(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model, info = _transformers().AutoModelForCausalLM.from_pretrained(
        str(folder), output_loading_info=True, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits, info


def _tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


LAYOUTS = [dict(tp=2, dp=2, zero=3, sp=True), dict(pp=2, dp=2, zero=1, schedule="1f1b")]
TRAIN_STEPS = 1
"""AdamW steps between the loaded and the trained logits (hf_rank_fn)."""
ROUND_TRIP = dict(tp=2, pp=2, schedule="1f1b")  # one step at lr 0, then export


def parallel_logits(pm, tokens):
    """Full logits on the ranks that hold the last stage (None elsewhere): tp-sharded logits
    gathered; with pp=2 the hidden state goes from stage 0 to stage 1 by send/recv."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torch.distributed.fsdp import FSDPModule

    part = pm.model_parts[0]
    out = None
    with torch.no_grad():
        if not pm.is_pipelined:
            out = part(tokens)
            out = out.full_tensor() if isinstance(out, DTensor) else out
        elif pm.has_first_stage:
            group = pm.mesh["pp"].get_group()
            dist.send(part(tokens).contiguous(), dst=dist.get_global_rank(group, 1), group=group)
        else:
            group = pm.mesh["pp"].get_group()
            h = torch.empty(*tokens.shape, part.spec.hidden)
            dist.recv(h, src=dist.get_global_rank(group, 0), group=group)
            out = part(h)
    # A forward outside a training step leaves FSDP modules that keep parameters gathered
    # after forward (the pipeline root) unsharded: put the sharded parameters back.
    for m in part.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return out


def hf_rank_fn(checkpoints: dict[str, str], layouts: list[dict], out_dir: str,
               round_trip: bool) -> list[dict]:
    """Per checkpoint and layout: logits after loading, then one AdamW step, the logits again
    and an export of the trained weights. Last (`round_trip`): the llama checkpoint on
    tp=2 x pp=2, one step with lr 0, exported. One step (three before session 53): what is
    checked is that the export carries the trained shards, not the loaded ones; one update
    moves every weight (AdamW's first step is ~lr per element), more steps only repeated it
    (training equivalence is tests/test_parallel.py's)."""
    import torch.distributed as dist

    from meshtron.hf import export_parallel, load_into
    from meshtron.model.spec import from_hf_config
    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import data_mesh, release_mesh

    tokens = _tokens()
    g = torch.Generator().manual_seed(5)
    batch = torch.randint(0, VOCAB, (3, 4, 17), generator=g)
    out = []
    for kind, folder in checkpoints.items():
        spec = from_hf_config(Path(folder) / "config.json")
        for i, layout in enumerate(layouts):
            if spec.tied_embeddings and layout.get("pp", 1) > 1:
                continue  # tied embeddings cannot be split across stages (GPT-2)
            mesh = build_mesh(layout, dist.get_world_size(), device_type="cpu", spec=spec)
            with torch.device("meta"):
                model = Transformer(spec)
            pm = parallelize(model, layout, mesh,
                             fill=lambda parts: load_into(parts, folder, spec))
            loaded = parallel_logits(pm, tokens)
            opt = build_optimizer(pm, lr=1e-3)
            dp, r = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
            rows = batch.shape[1] // dp
            for step in range(TRAIN_STEPS):
                x = batch[step, r * rows:(r + 1) * rows]
                pm.forward_backward(x[:, :-1], x[:, 1:])
                opt.step()
                opt.zero_grad()
            trained = parallel_logits(pm, tokens)
            target = Path(out_dir) / f"{kind}-{i}"
            export_parallel(pm, spec, target)
            out.append({"kind": kind, "layout": i, "loaded": loaded, "trained": trained,
                        "export": str(target)})
            del pm, opt, model
            release_mesh(mesh)
    if round_trip:
        out.append(_round_trip(checkpoints["llama"], str(Path(out_dir) / "round-trip"), batch))
    return out


def _round_trip(folder: str, target: str, batch: torch.Tensor) -> dict:
    import torch.distributed as dist

    from meshtron.hf import export_parallel, load_into
    from meshtron.model.spec import from_hf_config
    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import release_mesh

    spec = from_hf_config(Path(folder) / "config.json")
    mesh = build_mesh(ROUND_TRIP, dist.get_world_size(), device_type="cpu", spec=spec)
    with torch.device("meta"):
        model = Transformer(spec)
    pm = parallelize(model, ROUND_TRIP, mesh, fill=lambda parts: load_into(parts, folder, spec))
    opt = build_optimizer(pm, lr=0.0, weight_decay=0.1)
    pm.forward_backward(batch[0, :, :-1], batch[0, :, 1:])
    opt.step()
    export_parallel(pm, spec, target)
    # A DCP checkpoint of the same state, as a run saves it, for `meshtron export`.
    import torch.distributed.checkpoint as dcp

    from meshtron.checkpoint import store

    root = Path(target) / "run" / "checkpoints"
    tmp = root / (store.TMP_PREFIX + store.step_name(1))
    dcp.save({"model": pm.state_dict()}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:  # committed as meshtron.checkpoint commits: manifest, rename
        store.write_json(tmp / store.META, {"step": 1})
        store.write_manifest(tmp, 1)
        store.commit(root, 1)
    dist.barrier()
    release_mesh(mesh)
    return {"export": target}


def _check_layouts(results: list[list[dict]], checkpoints: dict[str, Path]) -> None:
    tokens = _tokens()
    for j, first in enumerate(results[0]):
        ref, _ = _hf_logits(checkpoints[first["kind"]], tokens)
        rows = [r[j] for r in results if r[j]["loaded"] is not None]
        assert rows, first
        for row in rows:
            # Loaded under tp=2 / pp=2: the same function as transformers' model.
            assert (row["loaded"] - ref).abs().max() <= LOGIT_TOL, (first["kind"], j)
            assert (row["trained"] - ref).abs().max() > 1e-3  # training moved the weights
        # The export of the trained model loads cleanly and computes meshtron's logits.
        got, info = _hf_logits(Path(first["export"]), tokens)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys",
                                         "mismatched_keys")), info
        assert (got - rows[0]["trained"]).abs().max() <= LOGIT_TOL, (first["kind"], j)


def test_load_train_export_under_tp_and_round_trip_under_tp_pp(checkpoints, tmp_path):
    results = run_on_ranks(hf_rank_fn, 4, {k: str(v) for k, v in checkpoints.items()},
                           LAYOUTS[:1], str(tmp_path), True, timeout=600)
    # tp=2 x pp=2, one step at lr 0: every exported tensor is bit-identical to the input.
    want, got = _tensors(checkpoints["llama"]), _tensors(Path(results[0][-1]["export"]))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # `meshtron export RUN_DIR`: the tp x pp checkpoint consolidated in one process.
    run_dir = Path(results[0][-1]["export"]) / "run"
    from meshtron.model.spec import from_hf_config

    spec = from_hf_config(checkpoints["llama"] / "config.json")
    (run_dir / "config.json").write_text(json.dumps({"model": spec.to_dict(),
                                                    "data": {"seq_len": 16}}))
    code, err = _run_main(["export", str(run_dir), "--to", str(tmp_path / "cli-export")])
    assert code == 0, err
    got = _tensors(tmp_path / "cli-export")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    code, err = _run_main(["export", str(run_dir), "--step", "7", "--to", str(tmp_path / "x")])
    assert code == 2 and "--step=7" in err and len(err.strip().splitlines()) == 1, err
    _check_layouts([r[:-1] for r in results], checkpoints)


@pytest.mark.slow
def test_load_train_export_under_pp(checkpoints, tmp_path):
    """pp=2 x dp=2 (ZeRO-1): logits after loading, training, export. (The default suite loads
    under pipelining through the tp=2 x pp=2 round trip above.)"""
    kinds = {k: str(v) for k, v in checkpoints.items() if k != "gpt2"}  # tied: no pipeline
    results = run_on_ranks(hf_rank_fn, 4, kinds, LAYOUTS[1:], str(tmp_path), False,
                           timeout=600)
    _check_layouts(results, checkpoints)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        out.update(_st().load_file(str(f)))
    return out


@pytest.mark.slow
def test_cli_round_trip_tp2_pp2_lr0_is_bit_identical(checkpoints, tmp_path):
    """--init-from, one step with lr 0 on tp=2 x pp=2 (4 ranks, the CLI), --export. (The
    same through the Python API runs in the default suite, in the launch above.)"""
    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "meshtron", "train", "--nproc", "4", "--plan", "tp=2,pp=2",
           "--init-from", str(checkpoints["llama"]), "--lr", "0", "--steps", "1",
           "--seq-len", "32", "--global-batch", "4", "--eval-every", "0",
           "--run-dir", str(tmp_path / "run"), "--export", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = _tensors(checkpoints["llama"]), _tensors(out)
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["rope_parameters"]["rope_theta"] == 5000.0


def test_cli_one_process_lr0_is_bit_identical(checkpoints, tmp_path):
    """The single-process engine builds on meta and materializes with the checkpoint as its
    fill (no initialization first): --init-from, one step at lr 0, --export gives the input."""
    out = tmp_path / "export"
    code, err = _run_main(["train", "--init-from", str(checkpoints["qwen2"]), "--lr", "0",
                           "--steps", "1", "--seq-len", "32", "--global-batch", "2",
                           "--eval-every", "0", "--run-dir", str(tmp_path / "run"),
                           "--export", str(out)])
    assert code == 0, err[-3000:]
    want, got = _tensors(checkpoints["qwen2"]), _tensors(out)
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def _damaged(checkpoints, tmp_path, how: str) -> Path:
    if how == "missing shard":
        folder = tmp_path / "llama"
        shutil.copytree(checkpoints["llama"], folder)
        (folder / "model-00003-of-00012.safetensors").unlink()
        return folder
    folder = tmp_path / "qwen2"
    shutil.copytree(checkpoints["qwen2"], folder)
    path = folder / "model.safetensors"
    if how == "truncated":  # was a safetensors traceback in the ranks
        path.write_bytes(path.read_bytes()[:-100])
        return folder
    tensors = _st().load_file(str(path))
    if how == "wrong shape":
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(97, 64)
    elif how == "unknown name":
        tensors["model.layers.0.self_attn.rotary_proj.weight"] = torch.zeros(2)
    else:
        del tensors["model.norm.weight"]
    _st().save_file(tensors, str(path))
    return folder


@pytest.mark.parametrize("how, names", [
    ("missing shard", "model-00003-of-00012.safetensors"),
    ("wrong shape", "model.layers.1.mlp.up_proj.weight has shape [97, 64]; the model needs [96, 64]"),
    ("unknown name", "unknown tensor model.layers.0.self_attn.rotary_proj.weight"),
    ("missing tensor", "tensor model.norm.weight (meshtron norm.weight) is missing"),
    ("truncated", "model.safetensors' is truncated"),
])
def test_damaged_checkpoint_is_one_line_exit_2(checkpoints, tmp_path, how, names):
    folder = _damaged(checkpoints, tmp_path, how)
    code, err = _run_main(["train", "--init-from", str(folder), "--steps", "1", "--seq-len", "32",
                           "--run-dir", str(tmp_path / "run")])
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert names in err and "Traceback" not in err, err
