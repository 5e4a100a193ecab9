"""The MoE config.json types of meshtron/model/hf_moe_types.py (qwen2_moe, olmoe, granitemoe,
gpt_oss, qwen3_moe with dense blocks between MoE blocks): parameter counts against the model
cards, the dense/MoE block pattern the planner counts in closed form, `meshtron plan` through
the command (without torch), `meshtron train` on a tiny Qwen2-MoE (sigmoid-gated shared expert,
dense blocks between MoE blocks) and its 2-rank gloo layouts against one process, and the
one-line refusals of what the runtime does not compute."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from meshtron.errors import UserError
from meshtron.model.hf_config import from_hf_dict
from meshtron.model.shapes import ModelSpec, runtime_refusal
from tests import hf_moe_configs as C

# (config, total, active) in billions, as each model card states them
CARDS = [
    ("qwen1.5-moe-a2.7b", C.QWEN15_MOE_A27B, 14.3, 2.7),  # Qwen1.5-MoE-A2.7B card
    ("qwen2-57b-a14b", C.QWEN2_57B_A14B, 57.4, 14.2),  # Qwen2 report: 57.41B total, 14B act.
    ("olmoe-1b-7b", C.OLMOE_1B_7B, 6.9, 1.3),  # OLMoE paper Table 1: 6.9B total, 1.3B active
    ("granite-3.0-1b-a400m", C.GRANITE_MOE_1B, 1.3, 0.4),  # Granite 3.0 card: 1.3B, 400M
]


@pytest.mark.parametrize("name,cfg,total,active", CARDS, ids=[c[0] for c in CARDS])
def test_parameter_counts_match_the_model_cards(name, cfg, total, active):
    spec = from_hf_dict(cfg)
    assert round(spec.num_params() / 1e9, 1) == total
    assert round(spec.active_params() / 1e9, 1) == active


def test_llama4_counts_match_metas_card():
    """Meta's Llama 4 card: Scout 17B active / 109B total (with its 1.7B-ish vision encoder,
    which a text_config does not describe: the text model is 107.8B), Maverick 17B / 400B;
    Maverick's blocks alternate dense (intermediate_size_mlp) and MoE (128 experts + 1 shared)."""
    scout, maverick = from_hf_dict(C.LLAMA4_SCOUT), from_hf_dict(C.LLAMA4_MAVERICK)
    assert round(scout.num_params() / 1e9, 1) == 107.8
    assert round(maverick.num_params() / 1e9) == 401  # the card's "400B"
    for spec in (scout, maverick):
        assert round(spec.active_params() / 1e9) == 17
        assert spec.moe_shared_experts == 1 and spec.moe_top_k == 1
        assert runtime_refusal(spec).startswith("config.json model_type='llama4_text'")
    assert (scout.moe_layers, maverick.moe_layers) == (48, 24)
    assert [maverick.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    listed = from_hf_dict(dict(C.LLAMA4_MAVERICK, moe_layers=list(range(1, 48, 2))))
    assert listed.num_params() == maverick.num_params()


def test_llama3_rope_with_equal_band_factors_is_a_step():
    """Scout's rope_scaling (low_freq_factor = high_freq_factor = 1): wavelengths above the
    original length are divided by the factor, the others kept, none interpolated (as
    transformers' llama3 rule gives with an empty band)."""
    import math

    import torch

    from meshtron.model.rope import _llama3

    spec = from_hf_dict(C.LLAMA4_SCOUT)
    freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    long = 2 * math.pi / freq > 8192
    got = _llama3(spec, freq)
    assert torch.isfinite(got).all() and 0 < int(long.sum()) < 64
    assert torch.equal(got, torch.where(long, freq / 16.0, freq))


@pytest.mark.parametrize("cfg,total,active", [(C.GPT_OSS_20B, 20.9, 3.6),
                                              (C.GPT_OSS_120B, 116.8, 5.1)])
def test_gpt_oss_counts_match_openais_card(cfg, total, active):
    """OpenAI's gpt-oss card (Table 1): 20.9B / 3.6B and 116.8B / 5.1B; its active count holds
    the vocabulary matrix once (the embedding's rows a token reads are not a matmul)."""
    spec = from_hf_dict(cfg)
    assert round(spec.num_params() / 1e9, 1) == total
    assert round((spec.active_params() - spec.vocab * spec.hidden) / 1e9, 1) == active
    # what the count is made of: biases on q, k, v, o, router and experts, one sink a head
    assert spec.bias and spec.attn_sinks and spec.head_dim == 64 and spec.rope_type == "yarn"
    assert spec.max_seq == 131072
    without = spec.replace(bias=False, attn_sinks=False)
    attention = (64 * 64 + 2 * 8 * 64 + 2880) + 64  # q, k, v, o biases; one sink a head
    experts = spec.moe_experts * (2 * 2880 + 2880) + spec.moe_experts  # gate/up, down, router
    assert spec.num_params() - without.num_params() == spec.layers * (attention + experts)


def test_gpt_oss_windows_are_priced_at_the_window():
    """gpt-oss's 128-token window on the even blocks (layer_types): the planner's flash core
    of the mean block is (1 + share) / 2 of full causal attention, share = the window's part
    of the s(s+1)/2 causal pairs (hfmore's `sliding_window` / `window_every` pricing)."""
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import layer_cost
    from meshtron.planner.kernel_options import KernelOptions

    spec = from_hf_dict(C.GPT_OSS_20B)
    assert (spec.sliding_window, spec.window_every, spec.sliding_blocks) == (128, 2, 12)
    assert [spec.slides(i) for i in range(4)] == [True, False, True, False]

    def core(m, s):
        return layer_cost(m, resolve_cluster("dgx-h100:1"), 1, 1, s, False,
                          KernelOptions()).core_fwd

    s, w = 4096, 128
    share = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
    full = core(spec.replace(sliding_window=0, window_every=0), s)
    assert core(spec, s) == pytest.approx(full * (1 + share) / 2, rel=1e-9)
    with pytest.raises(UserError, match="layer_types=.*allowed: sliding_attention on even"):
        from_hf_dict(dict(C.GPT_OSS_20B, layer_types=["full_attention"] * 24))


def test_qwen2_moe_reads_the_gated_shared_expert():
    spec = from_hf_dict(C.QWEN15_MOE_A27B)
    # 5632 = 4 routed experts' width, gated by sigmoid(x . w): hidden weights a block
    assert (spec.moe_shared_experts, spec.moe_shared_gate, spec.qkv_bias) == (4, True, True)
    assert not spec.moe_norm_topk and runtime_refusal(spec) is None
    assert spec.moe_params() - spec.replace(moe_shared_gate=False).moe_params() == 2048


def test_qwen3_moe_dense_blocks_between_moe_blocks():
    """decoder_sparse_step 2 and mlp_only_layers [5] (transformers' rule: MoE when (i+1) %
    step == 0 and i not listed): blocks 1, 3, 7, ... are MoE, the rest keep the dense MLP of
    intermediate_size."""
    base = from_hf_dict(C.QWEN3_30B_A3B)
    spec = from_hf_dict(dict(C.QWEN3_30B_A3B, decoder_sparse_step=2, mlp_only_layers=[5, 6]))
    moe = [i for i in range(48) if spec.is_moe_layer(i)]
    assert moe == [i for i in range(1, 48, 2) if i != 5] and spec.moe_layers == 23
    dense = 48 - 23
    assert spec.num_params() == base.num_params() - dense * (
        base.moe_params() - base.mlp_params())
    assert base.moe_layers == 48 and base.block_kinds() == ((48, 47),)


PATTERNS = [dict(moe_layer_step=2), dict(moe_layer_step=3, moe_mlp_only_layers=(2, 4, 8)),
            dict(moe_dense_layers=2, moe_layer_step=2, moe_mlp_only_layers=(0, 1, 9)),
            dict(moe_mlp_only_layers=(0, 10)), dict(moe_dense_layers=3)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_block_pattern_closed_forms_equal_the_block_by_block_count(pattern):
    """moe_blocks_in (the planner's stage counts), moe_layers, block_kinds and the two
    representative indices against is_moe_layer block by block."""
    spec = ModelSpec(name="p", layers=11, hidden=64, heads=4, kv_heads=2, ffn_hidden=96,
                     vocab=131, max_seq=32, moe_experts=4, moe_top_k=2, moe_ffn_hidden=32,
                     **pattern)
    flags = [spec.is_moe_layer(i) for i in range(11)]
    for a in range(12):
        for b in range(a, 12):
            assert spec.moe_blocks_in(range(a, b)) == sum(flags[a:b]), (pattern, a, b)
    kinds = dict((spec.is_moe_layer(i), n) for n, i in spec.block_kinds())
    assert kinds == {k: flags.count(k) for k in (False, True) if flags.count(k)}
    assert spec.num_params() == spec.embedding_params() + spec.head_params() + sum(
        spec.layer_params(i) for i in range(11))


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from meshtron.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("cfg,nodes", [(C.QWEN15_MOE_A27B, 2), (C.OLMOE_1B_7B, 2),
                                       (C.GPT_OSS_20B, 2), (C.GRANITE_MOE_1B, 2),
                                       (dict(C.QWEN3_30B_A3B, decoder_sparse_step=2), 2),
                                       (C.LLAMA4_MAVERICK, 16)],
                         ids=["qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "qwen3_moe_step2",
                              "llama4_text"])
def test_plan_prices_each_type_through_the_command(cfg, nodes, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    proc = _cli("plan", "--model", str(path), "--cluster", f"dgx-h100:{nodes}",
                "--global-batch", "256" if nodes > 2 else "64",
                "--seq-len", "4096", "--save", str(tmp_path / "plan.toml"))
    assert proc.returncode == 0, proc.stderr
    assert "Best plan" in proc.stdout
    assert (tmp_path / "plan.toml").is_file()


def test_pattern_changes_the_planned_memory(tmp_path):
    """The dense blocks between MoE blocks reach the planner: every other block of
    Qwen3-30B-A3B dense holds half the experts, so the plan's parameter memory drops."""
    from meshtron.planner.memory import layer_params_local

    base = from_hf_dict(C.QWEN3_30B_A3B)
    half = from_hf_dict(dict(C.QWEN3_30B_A3B, decoder_sparse_step=2))
    assert layer_params_local(half, 1, 1) < 0.6 * layer_params_local(base, 1, 1)


def _train(tmp_path, cfg, *extra, run=None):
    """`meshtron train` on `cfg` as a config.json. One process: the command's entry point
    (`meshtron.cli.main`) in this process, as tests/test_hf.py's one-process run (a child
    process would add ~5 s of torch import to each run and refusal); ranks: the command."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ["train", "--model", str(path), "--steps", "3", "--seq-len", "32", "--global-batch",
            "4", "--log-every", "1", "--run-dir", str(run or tmp_path / "run"), *extra]
    if "--nproc" in extra:
        return subprocess.run([sys.executable, "-m", "meshtron", *argv], capture_output=True,
                              text=True, timeout=600)
    from meshtron.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _losses(run) -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    return [r["loss"] for r in lines]


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_train_tiny_qwen2_moe_through_the_command_and_on_two_ranks(tmp_path):
    """The user's path: one process, then tp=2 (the MoE replicated over the tensor ranks) and
    dp=2 x ep=2 (each rank two of the four experts) on 2 gloo ranks; the ranks' losses equal
    the single process's within fp32 summation order."""
    proc = _train(tmp_path, C.TINY_QWEN2_MOE)
    assert proc.returncode == 0, proc.stderr
    ref = _losses(tmp_path / "run")
    assert all(0 < x < 10 for x in ref) and ref[-1] < ref[0]
    for layout in ("tp=2", "dp=2,ep=2"):
        run = tmp_path / layout.replace(",", "_").replace("=", "")
        proc = _train(tmp_path, C.TINY_QWEN2_MOE, "--nproc", "2", "--plan", layout, run=run)
        assert proc.returncode == 0, proc.stderr
        assert _losses(run) == pytest.approx(ref, rel=1e-5), layout
        # the planner's per-rank states (gate, dense and MoE blocks) are the runtime's bytes
        memory = json.loads((run / "memory.json").read_text())
        keys = ("params", "grads", "optimizer")
        assert [[r[k] for k in keys] for r in memory["measured_bytes_per_rank"]] == \
            [[r[k] for k in keys] for r in memory["predicted"]["bytes_per_rank"]], layout


TINY_OLMOE = dict(C.OLMOE_1B_7B, hidden_size=64, intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=128, vocab_size=259)
TINY_GRANITE_MOE = dict(C.GRANITE_MOE_1B, hidden_size=64, intermediate_size=32,
                        num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=128, vocab_size=259)


@pytest.mark.parametrize("cfg", [TINY_OLMOE, TINY_GRANITE_MOE], ids=["olmoe", "granitemoe"])
def test_train_tiny_olmoe_and_granitemoe_through_the_command(cfg, tmp_path):
    """OLMoE's whole-projection q/k norms and Granite's four multipliers (dense variants'
    runtime, model/transformer.py) around routed experts."""
    spec = from_hf_dict(cfg)
    assert spec.qk_norm_whole or spec.embed_scale == 12.0
    proc = _train(tmp_path, cfg)
    assert proc.returncode == 0, proc.stderr
    losses = _losses(tmp_path / "run")
    assert all(0 < x < 10 for x in losses)


REFUSALS = [
    (C.GPT_OSS_20B, "config.json swiglu_limit=7.0"),
    (C.LLAMA4_SCOUT, "config.json model_type='llama4_text': its router"),
    (dict(C.OLMOE_1B_7B, clip_qkv=8.0), "config.json clip_qkv=8.0"),
]


@pytest.mark.parametrize("cfg,match", REFUSALS, ids=["gpt_oss", "llama4_text", "olmoe_clip"])
def test_train_refuses_planned_only_types_in_one_line(cfg, match, tmp_path):
    spec = from_hf_dict(cfg)
    assert runtime_refusal(spec).startswith(match)
    proc = _train(tmp_path, cfg)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and match in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_the_model_refuses_to_build_a_planned_only_spec():
    import torch

    from meshtron.model import Transformer

    spec = from_hf_dict(dict(C.GPT_OSS_20B, num_hidden_layers=2, hidden_size=64,
                             intermediate_size=32, num_local_experts=4, vocab_size=131,
                             layer_types=None, sliding_window=None))
    with torch.device("meta"), pytest.raises(UserError, match="swiglu_limit"):
        Transformer(spec)
    # a run file's model table reaches the same fields without config.json's refusals
    plain = spec.replace(train_refusals=(), bias=False)
    with torch.device("meta"), pytest.raises(UserError, match="model.attn_sinks=true"):
        Transformer(plain)
    # expert and router biases (gpt-oss) are counted by the planner, not built
    with torch.device("meta"), pytest.raises(UserError, match="model.bias=true with routed"):
        Transformer(spec.replace(train_refusals=(), attn_sinks=False))


@pytest.mark.parametrize("change,match", [
    (dict(shared_expert_intermediate_size=5000),
     "shared_expert_intermediate_size=5000: .* allowed: a multiple of 1408"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0: must be a positive integer"),
    (dict(decoder_sparse_step=25), "decoder_sparse_step=25, mlp_only_layers=.*keep at least"),
    (dict(mlp_only_layers=[3, 24]), r"mlp_only_layers=\[3, 24\]: .* from 0 to 23"),
    (dict(mlp_only_layers=list(range(24))), "keep at least one"),
    (dict(use_sliding_window="yes"), "use_sliding_window=.yes.: must be true or false"),
    (dict(use_sliding_window=True, sliding_window=1.5), "sliding_window=1.5: must be a positive"),
    (dict(use_sliding_window=True, sliding_window=64, layer_types=["full_attention"]),
     r"layer_types=\[.full_attention.\]: .* one per block \(24\)"),
    (dict(router_aux_loss_coef=-1), "router_aux_loss_coef=-1"),
])
def test_bad_qwen2_moe_keys_are_one_line(change, match):
    with pytest.raises(UserError, match=match) as err:
        from_hf_dict(dict(C.QWEN15_MOE_A27B, **change))
    assert "\n" not in str(err.value)


# ---- the runtime: the gated shared expert and the block pattern against one process ------

MODEL = dict(name="equiv-qwen2-moe", moe_experts=4, moe_top_k=2, moe_ffn_hidden=32,
             moe_shared_experts=2, moe_shared_gate=True, moe_layer_step=2, qkv_bias=True,
             moe_norm_topk=False, moe_aux_loss=0.01)
OLMOE = dict(name="equiv-olmoe", moe_experts=4, moe_top_k=2, moe_ffn_hidden=32,
             moe_norm_topk=False, qk_norm=True, qk_norm_whole=True, moe_aux_loss=0.01)
GRANITE = dict(name="equiv-granitemoe", moe_experts=4, moe_top_k=2, moe_ffn_hidden=32,
               embed_scale=12.0, attn_scale=0.015625, residual_scale=0.22, logit_scale=1 / 6)
LAYOUTS = [dict(model=MODEL, micro_batch=1, zero=3, dp=2, ep=2),
           # tp=2 without FSDP: the MoE's plain tensors beside the tp DTensors
           # (parallel/optimizer.py `_one_kind_per_group`)
           dict(model=MODEL, micro_batch=1, zero=0, tp=2),
           dict(model=OLMOE, micro_batch=1, zero=3, dp=2, ep=2),
           dict(model=GRANITE, micro_batch=1, zero=3, dp=2, ep=2),
           dict(model=dict(MODEL, moe_layer_step=1, moe_mlp_only_layers=(0, 2)), micro_batch=1,
                zero=0, pp=2, schedule="1f1b")]


def test_shared_gate_and_pattern_in_the_module():
    import torch

    from meshtron.model import Transformer
    from meshtron.model.moe import MoE
    from meshtron.planner.memory_ranks import param_shapes

    spec = from_hf_dict(C.TINY_QWEN2_MOE)
    with torch.device("meta"):
        model = Transformer(spec)
    kinds = [isinstance(b.feed_forward, MoE) for b in model.layers.values()]
    assert kinds == [False, True, False, True, False]
    for cfg in (C.TINY_QWEN2_MOE, TINY_OLMOE, TINY_GRANITE_MOE):  # the planner's tensors
        one = from_hf_dict(cfg)
        with torch.device("meta"):
            built = Transformer(one)
        real = [(n, tuple(p.shape)) for n, p in built.named_parameters()]
        assert param_shapes(one, range(one.layers), True, True) == real, cfg["model_type"]
        assert sum(p.numel() for p in built.parameters()) == one.num_params()
    # the gate scales the shared experts' output by sigmoid(x . w) per token
    torch.manual_seed(0)
    moe = Transformer(spec, device="cpu").layers["1"].feed_forward
    x = torch.randn(5, spec.hidden)
    sh = moe.shared
    plain = sh.w2(torch.nn.functional.silu(sh.w1(x)) * sh.w3(x))
    assert torch.allclose(sh(x), plain * torch.sigmoid(x @ sh.gate.weight.T))


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_gated_shared_expert_and_pattern_layouts_match_one_process():
    """Losses, gradient norms and every parameter of dp=2 x ep=2 (ZeRO-3; Qwen2-MoE, OLMoE and
    Granite-MoE shapes), tp=2 and a 1F1B pp=2 split of dense blocks 0, 2 and MoE blocks 1, 3
    equal one process."""
    from testkit.equivalence import DEFAULT_CFG, compare, format_report, layout_cfg, \
        parallel_rank_fn, reference_run
    from testkit.multiproc import run_on_ranks

    cfg = dict(DEFAULT_CFG, micro_batch=1)
    refs: dict = {}

    def ref_for(layout):
        one, _ = layout_cfg(cfg, layout)
        key = json.dumps(one["spec"], sort_keys=True, default=list)
        if key not in refs:
            refs[key] = reference_run(one)
        return refs[key]

    results = run_on_ranks(parallel_rank_fn, 2, cfg, LAYOUTS, timeout=600)
    report = compare(ref_for, results)
    bad = [r for r in report if r["missing"] or r["extra"]
           or max(r["loss_rel"], r["norm_rel"], r["param_rel"]) > 1e-5]
    assert not bad, format_report(bad)


def _core(spec, seq: int, cp: int = 1, **opts):
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import layer_cost
    from meshtron.planner.kernel_options import KernelOptions

    return layer_cost(spec, resolve_cluster("dgx-h100:1"), 1, 1, seq, False,
                      KernelOptions(**opts), cp=cp).core_fwd


def test_llama4_chunked_blocks_are_priced_at_their_chunks():
    """Llama-4-Scout at 32k tokens: 36 of its 48 blocks (all but every 4th, its NoPE blocks)
    attend within 8192-token chunks (transformers' chunked_overlay: 4 causal squares of 8192
    instead of one of 32768); at 8192 tokens a chunk is the whole sequence. Under context
    parallelism (cp=2) the ring's core carries the same share."""
    spec = from_hf_dict(C.LLAMA4_SCOUT)
    assert (spec.attn_chunk, spec.chunk_every, spec.chunked_blocks) == (8192, 4, 36)
    full = spec.replace(attn_chunk=0, chunk_every=0)
    s, c = 32768, 8192
    share = (36 * (4 * c * (c + 1) / 2) / (s * (s + 1) / 2) + 12) / 48
    assert _core(spec, s) == pytest.approx(_core(full, s) * share, rel=1e-9)
    assert _core(spec, s, cp=2) == pytest.approx(_core(full, s, cp=2) * share, rel=1e-9)
    assert _core(spec, 8192) == _core(full, 8192)
    explicit = dict(C.LLAMA4_SCOUT, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)])
    assert from_hf_dict(explicit) == spec  # the list transformers writes reads the same


def test_sliding_windows_under_context_parallelism_are_priced_at_the_window():
    """Mistral-7B-v0.1's window of 4096 at 16k tokens, cp=2 (Transformer Engine's windowed
    calls per chunk): the window's share of the ring's core; torch's ring attention (SDPA's
    causal kernel on every step, no window) is priced whole."""
    spec = from_hf_dict(MISTRAL_7B)
    full = spec.replace(sliding_window=0)
    s, w = 16384, 4096
    share = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
    assert _core(spec, s, cp=2) == pytest.approx(_core(full, s, cp=2) * share, rel=1e-9)
    assert _core(spec, s, cp=2, torch_ring=True) == _core(full, s, cp=2, torch_ring=True)


MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "sliding_window": 4096}


@pytest.mark.parametrize("changes, match", [
    (dict(no_rope_layers=[1, 0] * 24 + [1]), "config.json no_rope_layers="),
    (dict(no_rope_layers=[1, 1, 0, 1] * 12), "a 0 (full attention) every N blocks"),
    (dict(attention_chunk_size=-1), "config.json attention_chunk_size=-1: must be a positive"),
])
def test_llama4_chunk_keys_are_checked_in_one_line(changes, match):
    with pytest.raises(UserError) as err:
        from_hf_dict(dict(C.LLAMA4_SCOUT, **changes))
    assert match in str(err.value) and "\n" not in str(err.value)
