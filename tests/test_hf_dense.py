"""The dense Hugging Face types (model/hf_dense.py): public config.json files read into the
model card's parameter count (and transformers' own, exactly), planned through `meshtron
plan`; the runtime's model equal to transformers' logits for every trained type, trained
through `meshtron train`, tensor-parallel runs equal to one process; what the runtime does not
compute refused in one line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from meshtron.errors import UserError
from meshtron.model.hf_config import from_hf_dict
from testkit.hf_dense_ref import TINY
from testkit.hf_public_configs import PUBLIC
from testkit.plan_cli import commands_fixture, plan_cli  # noqa: F401  (fixture)

cli = commands_fixture("meshtron.planner.cli", "meshtron.train.cli")
STEPS = 3


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_config_has_the_cards_parameter_count(name):
    card, cfg = PUBLIC[name]
    spec = from_hf_dict(cfg)
    assert spec.num_params() == pytest.approx(card, rel=0.005), spec.num_params()


def test_nemotron_4_15b_split_as_the_paper_states():
    """Parmar et al. 2024: 12.5B non-embedding parameters (3.2B embedding, untied)."""
    spec = from_hf_dict(PUBLIC["Nemotron-4-15B"][1])
    assert spec.num_params() - 2 * spec.vocab * spec.hidden == pytest.approx(12.5e9, rel=0.005)
    assert (spec.mlp, spec.norm, spec.norm_plus_one, spec.rope_dim) == ("relu2", "layernorm",
                                                                        True, 64)


def test_counts_equal_transformers_exactly():
    """transformers' own model of each public config (on the meta device) has exactly
    ModelSpec.num_params() parameters."""
    transformers = pytest.importorskip("transformers")
    for name, (_, cfg) in PUBLIC.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**cfg))
        assert sum(p.numel() for p in model.parameters()) == from_hf_dict(cfg).num_params(), name


@pytest.mark.parametrize("mtype", sorted(TINY))
def test_logits_equal_transformers(mtype, tmp_path):
    """meshtron's plain model of the config.json transformers writes, holding the same weights
    (norm weights randomised: a 1 + w read as w, a missing post-norm or a wrong scale shows),
    computes transformers' logits."""
    pytest.importorskip("transformers")
    from testkit.hf_dense_ref import hf_model, meshtron_twin

    model = hf_model(mtype)
    ours, spec = meshtron_twin(model, tmp_path)
    tokens = torch.randint(0, spec.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(tokens).logits, ours(tokens)
    assert ref.abs().max() > 0.01  # not all-zero logits (Granite divides them by 4)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
    assert sum(p.numel() for p in ours.parameters()) == spec.num_params()


_QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)
"""Qwen's window from block max_window_layers on: block 1 of 2 slides (refused before)."""


@pytest.mark.parametrize("mtype, keys", [
    ("starcoder2", dict(sliding_window=16)), ("starcoder2", dict(sliding_window=7)),
    ("gemma3_text", dict(sliding_window=16)), ("phi3", dict(sliding_window=16)),
    # qwen3 (hf_dense's reader) -m slow: its reading is checked by the plan test below
    pytest.param("qwen3", _QWEN_WINDOW, marks=pytest.mark.slow),
    ("qwen2", dict(TINY["qwen3"], model_type="qwen2", head_dim=16, **_QWEN_WINDOW))],
    ids=["starcoder2-16", "starcoder2-7", "gemma3_text-16", "phi3-16", "qwen3-blocks",
         "qwen2-blocks"])
def test_sliding_window_logits_equal_transformers(mtype, keys, tmp_path, monkeypatch):
    """Windows shorter than the 48 tokens (odd too; Gemma 3's every other block, Qwen's
    blocks from max_window_layers on): the runtime's banded attention computes transformers'
    logits, which differ from full causal attention."""
    pytest.importorskip("transformers")
    import testkit.hf_dense_ref as ref_kit

    monkeypatch.setitem(ref_kit.TINY, mtype, dict(TINY.get(mtype, {}), **keys))
    model = ref_kit.hf_model(mtype)
    ours, spec = ref_kit.meshtron_twin(model, tmp_path)
    assert spec.sliding_window == keys["sliding_window"]
    if mtype.startswith("qwen"):
        assert spec.window_blocks == (1,) and spec.sliding_blocks == 1
    tokens = torch.randint(0, spec.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(tokens).logits, ours(tokens)
        for block in ours.layers.values():
            block.attention.window = 0
        full = ours(tokens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
    assert (full - ref).abs().max() > 5e-5  # 25x the tolerance above: the window matters


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [6, 7, 40])
def test_window_attention_cuda_path_is_the_cpu_band(window):
    """The CUDA branch (window_attention's own FlexAttention block mask, kernel 'flex'), run
    eagerly on CPU tensors (forward only: FlexAttention has no CPU backward), equals the
    chunked band and the dense sliding-window mask; a window as long as the sequence is
    causal attention."""
    from meshtron.model.attention import window_attention

    g = torch.Generator().manual_seed(0)
    seq = 40
    q, k, v = (torch.randn(1, h, seq, 16, generator=g) for h in (4, 2, 2))
    i = torch.arange(seq)
    band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band,
                                                             enable_gqa=True)
    flex = window_attention(q, k, v, window, kernel="flex")
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(window_attention(q, k, v, window, kernel="chunks"), dense,
                               rtol=1e-5, atol=1e-6)
    if window < seq:  # the band is not causal attention, so the comparison could fail
        causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=True)
        assert (causal - dense).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_meshtron_plan_prices_each_public_config(name, plan_cli, tmp_path):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(PUBLIC[name][1]))
    rc, out, err = plan_cli("--model", str(path), "--cluster", "dgx-h100:2", "--seq-len", "4096",
                            "--global-batch", "256", "--top", "1", "--json")
    assert rc == 0, err
    best = json.loads(out)["plans"][0]
    assert best["step_time_s"] > 0 and best["fits"]


@pytest.mark.parametrize("name, refused", [("gemma-2-9b", "model.attn_softcap=50.0"),
                                            ("Qwen3-4B", None)])
def test_meshtron_plan_says_when_train_refuses_the_model(name, refused, plan_cli, tmp_path):
    """A model `meshtron train` refuses whatever the layout (Gemma 2's soft-capping) is priced,
    but the plan says so in a note and at --save, instead of 'meshtron train --plan trains in
    it'."""
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(PUBLIC[name][1]))
    args = ("--model", str(path), "--cluster", "dgx-h100:2", "--seq-len", "4096",
            "--global-batch", "256", "--top", "1")
    rc, out, err = plan_cli(*args, "--json")
    assert rc == 0, err
    notes = [n for n in json.loads(out)["notes"] if "meshtron train refuses" in n]
    assert len(notes) == (refused is not None)
    assert refused is None or refused in notes[0]
    rc, out, err = plan_cli(*args, "--save", str(tmp_path / "plan.toml"))
    assert rc == 0, err
    saved = " ".join(out[out.index("Saved the best plan"):].split())
    assert ("`meshtron train` will refuse this plan" in saved) == (refused is not None), saved
    assert refused is None or refused in saved


def _layer(spec, seq: int):
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import layer_cost
    from meshtron.planner.kernel_options import KernelOptions

    return layer_cost(spec, resolve_cluster("dgx-h100:1"), 1, 1, seq, False, KernelOptions())


def test_sliding_window_blocks_are_priced_at_the_window():
    """StarCoder2-15B at 16k tokens, window 4096 in every block: the flash core computes
    sum_i min(i, w) of the s(s+1)/2 causal pairs; Gemma 2 (every other block) the mean."""
    s, w = 16384, 4096
    sc2 = from_hf_dict(PUBLIC["starcoder2-15b"][1])
    full = _layer(sc2.replace(sliding_window=0), s).core_fwd
    share = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
    assert _layer(sc2, s).core_fwd == pytest.approx(full * share, rel=1e-9)
    g2 = from_hf_dict(PUBLIC["gemma-2-9b"][1])
    g_full, s = _layer(g2.replace(sliding_window=0, window_every=0), 8192).core_fwd, 8192
    share = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
    assert _layer(g2, s).core_fwd == pytest.approx(g_full * (1 + share) / 2, rel=1e-9)
    assert _layer(g2, 4096).core_fwd == _layer(g2.replace(sliding_window=0, window_every=0),
                                               4096).core_fwd


def test_qwen_window_from_max_window_layers_is_planned(plan_cli, tmp_path):
    """Qwen3-4B with `use_sliding_window` (refused before): blocks 18..35 slide (transformers'
    layer_types from max_window_layers), so the attention core is priced as half full, half
    at the window; `meshtron plan` plans it, faster than the same model without the window."""
    s, w = 16384, 4096
    keys = dict(PUBLIC["Qwen3-4B"][1], use_sliding_window=True, sliding_window=w,
                max_window_layers=18)
    spec = from_hf_dict(keys)
    assert spec.window_blocks == tuple(range(18, 36)) and spec.sliding_blocks == 18
    full = _layer(spec.replace(sliding_window=0, window_blocks=()), s).core_fwd
    share = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
    assert _layer(spec, s).core_fwd == pytest.approx(full * (1 + share) / 2, rel=1e-9)
    steps = []
    for name, cfg in (("window", keys), ("full", PUBLIC["Qwen3-4B"][1])):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        rc, out, err = plan_cli("--model", str(path), "--cluster", "dgx-h100:1", "--seq-len",
                                str(s), "--global-batch", "64", "--layout", "tp=1,pp=1,dp=8",
                                "--json")
        assert rc == 0, err
        steps.append(json.loads(out)["plans"][0]["step_time_s"])
    assert steps[0] < steps[1], steps


def test_q_width_is_heads_times_head_dim():
    """Qwen3-4B's q projection is 32 x 128 = 4096 wide (not 2560): its GEMMs cost what a model
    whose hidden/heads is 128 costs on the q and out projections."""
    q4b = from_hf_dict(PUBLIC["Qwen3-4B"][1])
    narrow = q4b.replace(head_size=None, heads=20, kv_heads=4)  # 20 x 128 = 2560
    gemm = dict((k, f) for k, f, _ in _layer(q4b, 4096).parts)["gemm"]
    assert gemm > dict((k, f) for k, f, _ in _layer(narrow, 4096).parts)["gemm"] * 1.05


def _write(tmp_path, mtype: str, **changes) -> str:
    path = tmp_path / f"{mtype}-{len(changes)}" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(TINY[mtype], **changes)))
    return str(path)


REFUSED = [
    ("gemma2", dict(model_type="gemma2", head_dim=16, sliding_window=64), (),
     "model.attn_softcap=50.0"),
]
"""(Sliding windows and Gemma 3's local RoPE with packed documents were refused here before:
tests/test_window_documents.py, tests/test_cp_train.py.)"""


@pytest.mark.parametrize("mtype, changes, extra, match", REFUSED, ids=[r[0] for r in REFUSED])
def test_train_refuses_what_the_runtime_does_not_compute(mtype, changes, extra, match, cli,
                                                         tmp_path):
    base = "gemma3_text" if mtype == "gemma2" else mtype
    run_dir = tmp_path / "run"
    rc, out, err = cli("train", "--model", _write(tmp_path, base, **changes), "--steps", "1",
                       "--seq-len", "32", "--run-dir", str(run_dir), *extra)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and match in err, err
    assert not run_dir.exists()


def test_plan_prices_what_train_refuses(plan_cli, tmp_path):
    """Gemma 2's soft-capping is priced (the planner plans it) though the runtime refuses it."""
    path = _write(tmp_path, "gemma3_text", model_type="gemma2", head_dim=16)
    rc, out, err = plan_cli("--model", path, "--cluster", "dgx-h100:1", "--seq-len", "128",
                            "--global-batch", "16", "--top", "1")
    assert rc == 0, err


def test_gemma3_sliding_blocks_share_one_local_table_of_the_sequence():
    """Audit 47 item 3: each sliding block built its own fp32 local RoPE table of
    max_position_embeddings rows (52 x 128 MiB at Gemma-3-27B); now one table for the model,
    of the sequence's rows, rebuilt longer when a longer sequence comes (a resumed run with a
    longer --seq-len), its values those of the rows the old table had."""
    from meshtron.model.rope import rope_cache
    from meshtron.model.transformer import Transformer

    spec = from_hf_dict(dict(TINY["gemma3_text"], num_hidden_layers=4, max_position_embeddings=256,
                             layer_types=["sliding_attention"] * 3 + ["full_attention"]))
    model = Transformer(spec, init_seed=0)
    for seq in (16, 40):
        with torch.no_grad():
            model(torch.zeros(1, seq, dtype=torch.long))
        tables = {id(t) for b in model.layers.values() for t in b.attention._local_tables.values()}
        table = next(iter(model.layers["0"].attention._local_tables.values()))
        assert len(tables) == 1 and table.shape[1] == seq
    local = model.layers["0"].attention.local_spec
    assert torch.equal(table, rope_cache(local)[:, :40])


def test_plan_counts_the_rope_tables_the_runtime_keeps(plan_cli, tmp_path):
    """Audit 47 item 3: the runtime keeps the model's fp32 RoPE table of max_position_embeddings
    rows and one local table of the run's sequence shared by Gemma 3's sliding blocks
    (model/transformer.py); `meshtron plan` priced neither (tests/test_rehearse_models.py
    checks the totals against a rehearsal)."""
    params = {}
    for max_pos in (4096, 131072):
        path = _write(tmp_path / str(max_pos), "gemma3_text", max_position_embeddings=max_pos)
        rc, out, err = plan_cli("--model", path, "--cluster", "dgx-h100:1", "--seq-len", "128",
                                "--global-batch", "16", "--layout", "tp=1,pp=1,dp=8",
                                "--zero", "3", "--micro-batch", "2", "--recompute", "none",
                                "--json")
        assert rc == 0, err
        params[max_pos] = json.loads(out)["plans"][0]["memory_gib"]["params"]
    table_row = 2 * 4 * 32  # cos and sin, fp32, head_dim 32
    assert (params[131072] - params[4096]) * 2**30 == pytest.approx(
        (131072 - 4096) * table_row)


def test_sliding_window_is_planned_with_context_parallelism(plan_cli, tmp_path):
    """Refused for meshtron's runtime before (a plan rule); the runtime now runs the window
    under context parallelism (parallel/context.py), and the planner prices its core at the
    window as for Transformer Engine's all-gather: sum_i min(i, w) of the causal pairs."""
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import layer_cost
    from meshtron.planner.frameworks import preset

    path = _write(tmp_path, "starcoder2", sliding_window=16)
    rc, out, err = plan_cli("--model", path, "--cluster", "dgx-h100:1", "--seq-len", "128",
                            "--global-batch", "16", "--layout", "tp=1,cp=2,pp=1,dp=4")
    assert rc == 0, err
    s, w = 16384, 4096
    sc2 = from_hf_dict(PUBLIC["starcoder2-15b"][1])
    opts = preset("meshtron").kernel

    def core(spec):
        return layer_cost(spec, resolve_cluster("dgx-h100:1"), 1, 1, s, False, opts,
                          cp=2).core_fwd

    share = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
    assert core(sc2) == pytest.approx(core(sc2.replace(sliding_window=0)) * share, rel=1e-9)


def test_olmo2_whole_qk_norm_is_planned_on_one_tensor_rank(plan_cli, tmp_path):
    path = _write(tmp_path, "olmo2")
    rc, out, err = plan_cli("--model", path, "--cluster", "dgx-h100:1", "--seq-len", "128",
                            "--global-batch", "16", "--layout", "tp=2,pp=1,dp=4")
    assert rc == 2 and err.strip().count("\n") == 0
    assert "plan.tp=2: model.qk_norm_whole=true" in err


@pytest.mark.parametrize("cfg, match", [
    (dict(PUBLIC["gemma-2-9b"][1], hidden_activation="gelu"),
     "config.json hidden_activation='gelu': only 'gelu_pytorch_tanh'"),
    (dict(PUBLIC["Nemotron-4-15B"][1], partial_rotary_factor=1.5),
     "config.json partial_rotary_factor=1.5: must be in (0, 1]"),
    (dict(PUBLIC["Phi-3-mini-4k"][1], rope_scaling={"type": "longrope", "short_factor": [1.0]}),
     "config.json rope_scaling.rope_type='longrope': allowed values are"),
    (dict(PUBLIC["granite-3.0-8b"][1], attention_bias=True),
     "config.json attention_bias=true: biases on only the attention"),
    (dict(PUBLIC["gemma-3-1b"][1], layer_types=["sliding_attention", "full_attention",
                                                 "full_attention"]),
     "config.json layer_types="),
    # a pattern, but not one entry per block (26): transformers refuses it, meshtron read it
    (dict(PUBLIC["gemma-3-1b"][1], layer_types=["sliding_attention", "full_attention"]),
     "one per block (26)"),
])
def test_bad_config_is_one_line(cfg, match):
    with pytest.raises(UserError) as err:
        from_hf_dict(cfg)
    assert match in str(err.value) and "\n" not in str(err.value)


TRAINED = [(m, {}) for m in sorted(TINY)] + [("starcoder2", dict(sliding_window=16))]


@pytest.mark.parametrize("mtype, changes", TRAINED,
                         ids=[m + ("-window" if c else "") for m, c in TRAINED])
def test_meshtron_train_tiny_config_three_steps(mtype, changes, tmp_path):
    """The user's path: `meshtron train --model tiny.json --steps 3` with its defaults (a
    window of 16 under 32-token sequences: the banded attention), through the command's entry
    point (`meshtron.cli.main`) in this process, as tests/test_hf.py's one-process run (a
    child process added a torch import, ~5 s, to each of the nine)."""
    from meshtron.cli import main

    run_dir = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--model", _write(tmp_path, mtype, **changes),
                     "--steps", str(STEPS), "--seq-len", "32", "--run-dir", str(run_dir)])
    assert code == 0, err.getvalue()[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= STEPS and all(0 < x < 10 for x in losses)


def _cfg(model: str):
    from testkit.engine_runs import train_cfg

    return train_cfg(model, STEPS, dtype="fp32")


def _batches(vocab: int):
    from testkit.engine_runs import token_batches

    return token_batches(vocab, STEPS)


def _plan(model: str, **kw):
    from meshtron.planner.plan import Plan

    kw = {"tp": 1, "pp": 1, "dp": 1, **kw}
    return Plan(model=model, cluster="test", global_batch=8, seq_len=32, micro_batch=2,
                recompute="none", dtype="fp32", **kw)


def _two_rank(cases) -> list[dict]:
    from testkit.engine_runs import engine_runs

    return engine_runs([(_cfg(model), _plan(model, **kw)) for model, kw in cases], _batches)


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_tensor_parallel_equals_one_process(tmp_path):
    """tp 2 (with sequence parallelism for the sandwich, post and plus-one norms) against one
    process; OLMo 2's whole-projection q/k norm (tp=1 only) as ZeRO-3 over dp 2. A per-head
    q/k norm's weight gradient summed over one rank's heads only, or a post-norm under sp
    reduced like a replicated module, changes the second and third losses."""
    from meshtron.planner.memory_ranks import rank_states
    from meshtron.train.loop import LocalEngine
    from testkit.bf16 import one_thread
    from testkit.multiproc import run_on_ranks

    layouts = [("qwen3", {}, dict(tp=2)), ("nemotron", {}, dict(tp=2, sp=True)),
               ("gemma3_text", dict(sliding_window=8), dict(tp=2, sp=True)),
               ("phi3", {}, dict(tp=2)), ("granite", {}, dict(tp=2, sp=True)),
               ("starcoder2", dict(sliding_window=8), dict(tp=2, sp=True)),
               ("olmo2", {}, dict(dp=2, zero=3)), ("gpt_neox", {}, dict(tp=2, sp=True))]
    cases = [(_write(tmp_path, m, **changes), kw) for m, changes, kw in layouts]
    results = run_on_ranks(_two_rank, 2, cases, timeout=900)
    for i, (model, kw) in enumerate(cases):
        with one_thread():  # the ranks' one thread: the same GEMM blocking on any machine
            engine = LocalEngine(_cfg(model))
            ref = [float(engine.train_step(t[:, :-1], t[:, 1:]).loss)
                   for t in _batches(_cfg(model).model.vocab)]
        planned = rank_states(_cfg(model).model, _plan(model, **kw), "fp32")
        for rank in range(2):
            assert results[rank][i]["losses"] == pytest.approx(ref, rel=1e-5), (model, kw, rank)
            # the planner's per-rank states (post-norms, q/k norms, GeGLU's third matrix) are
            # the bytes the runtime holds
            st = planned[rank]
            assert results[rank][i]["states"] == [st.params, st.grads, st.optimizer], (model, rank)


@pytest.mark.parametrize("changes, match", [
    (dict(norm_layout="middle"), "model.norm_layout='middle': allowed values are pre, sandwich"),
    (dict(rope_fraction=0), "model.rope_fraction=0: must be in (0, 1]"),
    (dict(rope_fraction=0.3), "model.rope_fraction=0.3: rotates 9 of head_dim 32; must be even"),
    (dict(window_every=2), "model.window_every=2: needs a sliding_window"),
    (dict(qk_norm=False, qk_norm_whole=True), "model.qk_norm_whole=true: needs model.qk_norm"),
    (dict(attn_softcap=-1.0), "model.attn_softcap=-1.0: must be a non-negative number"),
    (dict(mlp="swish"), "model.mlp='swish': allowed values are swiglu, gelu, geglu, relu2"),
])
def test_bad_variant_fields_are_one_line(changes, match):
    spec = from_hf_dict(TINY["qwen3"])
    with pytest.raises(UserError) as err:
        spec.replace(**changes)
    assert match in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mtype", sorted(TINY))
def test_eager_kernel_count_is_what_the_block_launches(mtype):
    """The planner's `kernels_per_layer` against the ATen calls one eager forward of each
    type's block makes on CPU (norms as LayerNorm, standing in for CUDA's one-kernel RMSNorm,
    as tests/test_planner_host.py counts the Llama block): squared ReLU's two kernels, partial
    rotary's concatenations, the sandwich's four norms, Granite's factors, the scale on q, the
    1 + weight of zero-centred norms."""
    import dataclasses

    from meshtron.model.rope import rope_cache
    from meshtron.model.transformer import Block
    from meshtron.planner import compute as C
    from testkit.kernel_count import KernelCount as Count
    from tests.test_planner_host import EAGER

    spec = dataclasses.replace(from_hf_dict(TINY[mtype]), norm="layernorm", qk_norm=False,
                               qk_norm_whole=False)
    block = Block(spec, 0).to_empty(device="cpu").to(torch.bfloat16)
    x, rope = torch.randn(1, 32, spec.hidden, dtype=torch.bfloat16), rope_cache(spec)
    block(x, rope)  # Gemma 3's local RoPE table is built on the first call, once
    with Count() as fwd:
        block(x, rope)
    assert sum(fwd.ops.values()) == C.kernels_per_layer(spec, EAGER), dict(fwd.ops)


def test_qwen3_weights_load_and_export_round_trip(tmp_path):
    """A Qwen3 checkpoint transformers saves (head_dim 32 over a 64-wide residual, q/k norms
    randomised) loads into meshtron's model with transformers' logits, every weight read once;
    exported back, transformers reloads it to the same logits."""
    pytest.importorskip("transformers")
    import transformers

    from meshtron.hf.export import save_hf
    from meshtron.hf.load import load_into
    from meshtron.model.spec import resolve_model
    from meshtron.model.transformer import Transformer
    from testkit.hf_dense_ref import hf_model

    hf_model("qwen3").save_pretrained(tmp_path / "in")
    spec = resolve_model(tmp_path / "in")
    ours = Transformer(spec, init_seed=0)
    assert load_into([ours], tmp_path / "in", spec) == 4 * spec.num_params()
    tokens = torch.randint(0, spec.vocab, (2, 24), generator=torch.Generator().manual_seed(3))

    def logits(folder):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                                  dtype=torch.float32)
        with torch.no_grad():
            return model(tokens).logits

    ref = logits(tmp_path / "in")
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), ref, rtol=1e-5, atol=2e-6)
    save_hf({n: p.detach() for n, p in ours.named_parameters()}, spec, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"
    torch.testing.assert_close(logits(tmp_path / "out"), ref, rtol=1e-5, atol=2e-6)


def test_weights_of_gemma2_are_refused_in_one_line(tmp_path):
    """Gemma 2's soft-capping is not trained by the runtime: its weights are not read."""
    from meshtron.hf.names import check_supported

    with pytest.raises(UserError) as err:
        check_supported(from_hf_dict(dict(TINY["gemma3_text"], model_type="gemma2")),
                        "train.init_from")
    assert "train.init_from: Hugging Face weights of model" in str(err.value)
    assert "soft-capping (Gemma 2" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("count, text", [(999.9e6, "1B"), (999_960, "1M"), (999.4, "999"),
                                         (1234, "1.23K"), (6.7e9, "6.7B"), (9.995e11, "1T")])
def test_parameter_counts_print_with_their_unit(count, text):
    """Gemma 3 1B (999.9M parameters) printed '1e+03M params' in the plan's first line."""
    from meshtron.planner.report import fmt_count

    assert fmt_count(count) == text


@pytest.mark.parametrize("mtype", ["gemma2", "gemma3_text"])
def test_gemma_softmax_scale_default_is_transformers(mtype):
    """Without query_pre_attn_scalar transformers scales by 256**-0.5 whatever head_dim is (its
    config default); meshtron read head_dim's (here 128) instead."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(PUBLIC["gemma-2-9b" if mtype == "gemma2" else "gemma-3-1b"][1], head_dim=128)
    del cfg["query_pre_attn_scalar"]
    want = transformers.AutoConfig.for_model(**cfg).query_pre_attn_scalar ** -0.5
    assert from_hf_dict(cfg).attn_scale == pytest.approx(want, rel=1e-12)
