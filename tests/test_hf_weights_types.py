"""Hugging Face weights of the types beyond Llama's (meshtron/hf/layouts.py): a tiny random
checkpoint transformers saves (save_pretrained: config.json + model.safetensors) loads through
meshtron's reader with transformers' logits, every weight read once; exported back (with the
checkpoint's config.json kept, as `--init-from ... --export` does, and with meshtron's own
config.json) transformers reloads it without a missing or unexpected tensor, bit-identical, to
the same logits. Phi-3's fused q/k/v and gate/up rows, Granite MoE's fused experts and
Qwen2-MoE's gated shared expert are read as boxes of the fused tensors; `meshtron train
--init-from --export` round-trips them; what no type holds is one line, exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from meshtron.cli import main
from meshtron.errors import UserError

DENSE = ["nemotron", "phi3", "granite", "starcoder2", "gemma3_text", "olmo2"]
MOE = ["qwen2_moe", "olmoe", "granitemoe"]
TOL = dict(rtol=1e-5, atol=2e-6)


def _hf_model(mtype: str, **changes):
    """A tiny fp32 transformers model of `mtype` (tests' TINY configs with `changes`), its
    1-D weights (norms, biases) randomised so that a norm read as w where it is 1 + w, or a
    dropped bias, shows."""
    transformers = pytest.importorskip("transformers")
    from testkit.hf_dense_ref import TINY
    from tests.test_hf_moe_logits import TINY as TINY_MOE

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**dict({**TINY, **TINY_MOE}[mtype], **changes))
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.1 if "norm" in name and mtype in DENSE else 1.0, 0.2)
    return model


def _logits(folder, tokens):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model(tokens).logits


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


CASES = [(m, {}, m, m) for m in DENSE + MOE] + [
    # full rotary: the fields read as Llama's; the folder's config.json says phi3 (its names)
    ("phi3", dict(partial_rotary_factor=1.0), "phi3", "llama"),
    # Granite MoE with one shared expert (GraniteMoeSharedMLP, its gate | up rows fused)
    ("granitemoe", dict(model_type="granitemoeshared", shared_intermediate_size=64),
     "granitemoeshared", "granitemoeshared"),
]
PARAMS = [pytest.param(*c, id=c[2] + ("-" + c[3] if c[2] != c[3] else "")) for c in CASES] + [
    # Qwen's window on block 1 of 2 (max_window_layers 1), 7 tokens under 24: exported as
    # layer_types (-m slow: Qwen2-MoE's TINY has one on its even blocks, in the default run)
    pytest.param("qwen3", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),
                 "qwen3", "qwen3", id="qwen3-window", marks=pytest.mark.slow)]


@pytest.mark.parametrize("base, changes, mtype, inferred", PARAMS)
def test_load_logits_and_export_round_trip(base, changes, mtype, inferred, tmp_path):
    from meshtron.hf.export import save_hf
    from meshtron.hf.load import load_into
    from meshtron.hf.names import check_supported, sources
    from meshtron.model.init import named_unique_parameters
    from meshtron.model.spec import resolve_model
    from meshtron.model.transformer import Transformer

    _hf_model(base, **changes).save_pretrained(tmp_path / "in")
    spec = resolve_model(tmp_path / "in")
    assert check_supported(spec, "x") == inferred  # what the fields alone read as
    assert check_supported(spec, "x", mtype) == mtype  # the folder's type holds them
    ours = Transformer(spec, init_seed=0)
    assert set(sources(spec)) == {n for n, _ in named_unique_parameters([ours])}
    assert load_into([ours], tmp_path / "in", spec) == 4 * spec.num_params()
    tokens = torch.randint(0, spec.vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = _logits(tmp_path / "in", tokens)
    assert ref.abs().max() > 0.01
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), ref, **TOL)
    state = {n: p.detach() for n, p in ours.named_parameters()}
    source = json.loads((tmp_path / "in" / "config.json").read_text())
    want = _tensors(tmp_path / "in")
    for out, config, kind in (("kept", source, mtype), ("own", None, inferred)):
        save_hf(state, spec, tmp_path / out, config)
        written = json.loads((tmp_path / out / "config.json").read_text())
        assert written["model_type"] == kind
        got = _tensors(tmp_path / out)
        if kind == mtype:  # the same names: every tensor bit-identical
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        torch.testing.assert_close(_logits(tmp_path / out, tokens), ref, **TOL)
    # meshtron reads its own config.json back to a model of the same function
    again = resolve_model(tmp_path / "own")
    assert again.num_params() == spec.num_params() and check_supported(again, "x") == inferred


def _run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("mtype", ["phi3", "granitemoe"])
def test_cli_init_from_lr0_export_is_bit_identical(mtype, tmp_path):
    """The user's path: `meshtron train --init-from DIR --lr 0 --steps 1 --export OUT` gives
    the input's tensors back (Phi-3's fused rows, Granite MoE's fused experts)."""
    _hf_model(mtype, vocab_size=320).save_pretrained(tmp_path / "in")  # the tokenizer's 259
    code, err = _run_main(["train", "--init-from", str(tmp_path / "in"), "--lr", "0",
                           "--steps", "1", "--seq-len", "16", "--global-batch", "2",
                           "--eval-every", "0", "--run-dir", str(tmp_path / "run"),
                           "--export", str(tmp_path / "out")])
    assert code == 0, err[-3000:]
    want, got = _tensors(tmp_path / "in"), _tensors(tmp_path / "out")
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == mtype


def test_a_box_of_fused_rows_reads_only_its_part(tmp_path):
    """Phi-3's k rows of qkv_proj and Granite MoE's up rows of experts 1..2 of input_linear,
    read as a tensor-parallel / expert-parallel rank reads them."""
    from safetensors import safe_open

    from meshtron.hf.load import Checkpoint
    from meshtron.hf.names import sources
    from meshtron.model.spec import resolve_model

    for mtype, name, box, offset, want in [
        ("phi3", "layers.1.attention.wk.weight", (16, 64), (16, 0),
         lambda t, s: t[s.heads * s.head_dim + 16:s.heads * s.head_dim + 32]),
        ("granitemoe", "layers.1.feed_forward.experts.w3.weight", (2, 32, 64), (1, 0, 0),
         lambda t, s: t[1:3, s.moe_ffn_hidden:]),
    ]:
        folder = tmp_path / mtype
        _hf_model(mtype).save_pretrained(folder)
        spec = resolve_model(folder)
        src = sources(spec)[name]
        target = torch.empty(box)
        assert Checkpoint(folder).read_into(src, target, offset, 1 << 20) == target.numel() * 4
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert torch.equal(target, want(f.get_tensor(src.name), spec)), mtype


def test_a_type_that_cannot_hold_the_model_is_one_line_exit_2(tmp_path):
    """The checkpoint's config.json names OLMo 2 but the model (--model) is Llama's: no
    reading of OLMo 2's tensors computes it."""
    _hf_model("phi3", partial_rotary_factor=1.0).save_pretrained(tmp_path / "in")
    cfg = json.loads((tmp_path / "in" / "config.json").read_text())
    shutil.copytree(tmp_path / "in", tmp_path / "olmo")
    (tmp_path / "olmo" / "config.json").write_text(json.dumps(dict(cfg, model_type="olmo2")))
    model = tmp_path / "llama" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps(dict(cfg, model_type="llama")))
    code, err = _run_main(["train", "--model", str(model), "--init-from",
                           str(tmp_path / "olmo"), "--steps", "1", "--seq-len", "16",
                           "--run-dir", str(tmp_path / "run")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "config.json model_type='olmo2' does not hold model" in err
    assert "read as model_type 'llama'" in err and "Traceback" not in err


@pytest.mark.parametrize("changes, match", [
    (dict(attn_softcap=50.0), "soft-capping (Gemma 2"),
    (dict(parallel_residual=True), "GPT-NeoX's per-head fused q/k/v"),
    (dict(qk_norm=True, qkv_bias=True), "no supported type combines"),
])
def test_what_no_type_holds_is_one_line(changes, match):
    from meshtron.hf.names import check_supported
    from meshtron.model.hf_config import from_hf_dict
    from testkit.hf_dense_ref import TINY

    spec = from_hf_dict(TINY["granite"]).replace(**changes)
    with pytest.raises(UserError) as err:
        check_supported(spec, "train.init_from")
    text = str(err.value)
    assert text.startswith("train.init_from: ") and match in text and "\n" not in text


def fused_rank_fn(cases: list[tuple[str, str, dict]], out_dir: str) -> list[dict]:
    """tests/test_hf.py's load, train 3 steps, export, per (type, folder, layout)."""
    from tests.test_hf import hf_rank_fn

    return [row for kind, folder, layout in cases
            for row in hf_rank_fn({kind: folder}, [layout], out_dir, False)]


def test_fused_tensors_load_train_and_export_sharded(tmp_path):
    """Phi-3 under tp=2 (each rank reads its heads' rows of qkv_proj and its rows of
    gate_up_proj), Granite MoE under ep=2 (each rank its two experts of input_linear): the
    logits transformers computes after loading; trained, exported from the sharded layout,
    transformers reloads the trained model."""
    from testkit.multiproc import run_on_ranks
    from tests.test_hf import _check_layouts

    folders = {}
    for mtype in ("phi3", "granitemoe"):
        folders[mtype] = tmp_path / mtype
        _hf_model(mtype, vocab_size=320).save_pretrained(folders[mtype])
    cases = [("phi3", str(folders["phi3"]), dict(tp=2)),
             ("granitemoe", str(folders["granitemoe"]), dict(dp=2, ep=2))]
    results = run_on_ranks(fused_rank_fn, 2, cases, str(tmp_path / "out"), timeout=600)
    _check_layouts(results, folders)


def test_mistral_window_trains_beyond_it(tmp_path):
    """Mistral's sliding_window (16 here) no longer caps max_seq: a checkpoint loads with
    transformers' logits on 48 tokens (which differ from full causal attention's), exports as
    mistral with its window, and `meshtron train` runs 64-token sequences."""
    transformers = pytest.importorskip("transformers")
    from meshtron.hf.export import save_hf
    from meshtron.hf.load import load_into
    from meshtron.model.spec import resolve_model
    from meshtron.model.transformer import Transformer
    from testkit.hf_dense_ref import SHAPES

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**dict(SHAPES, sliding_window=16, vocab_size=320))
    transformers.MistralForCausalLM(cfg).float().save_pretrained(tmp_path / "in")
    spec = resolve_model(tmp_path / "in")
    assert (spec.sliding_window, spec.max_seq) == (16, 128)
    ours = Transformer(spec, init_seed=0)
    load_into([ours], tmp_path / "in", spec)
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(3))
    ref = _logits(tmp_path / "in", tokens)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), ref, **TOL)
        full = Transformer(spec.replace(sliding_window=0), init_seed=0)
        full.load_state_dict(ours.state_dict())
        assert (full.eval()(tokens) - ref).abs().max() > 1e-4  # the window matters here
    save_hf({n: p.detach() for n, p in ours.named_parameters()}, spec, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["sliding_window"]) == ("mistral", 16)
    torch.testing.assert_close(_logits(tmp_path / "out", tokens), ref, **TOL)
    code, err = _run_main(["train", "--model", str(tmp_path / "in" / "config.json"), "--steps",
                           "2", "--seq-len", "64", "--global-batch", "2", "--eval-every", "0",
                           "--run-dir", str(tmp_path / "run")])
    assert code == 0, err[-3000:]
