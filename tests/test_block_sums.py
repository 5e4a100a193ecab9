"""Sums over a model's blocks are taken per kind of block (dense first blocks, then routed
ones: `ModelSpec.block_kinds`), never block by block, so that a config.json with a billion
layers is priced at once. Each closed form must equal the block-by-block sum it replaces, for a
dense model, a MoE with dense first blocks (DeepSeek-V3's layout) and a MoE routed in every
block with qk-norm (Qwen3-MoE's)."""

from __future__ import annotations

import pytest

from meshtron.cli import main
from meshtron.model.mla_shapes import mla_replicated_params
from meshtron.model.spec import PRESETS
from meshtron.planner import memory, moe_memory
from meshtron.planner.compute import recompute_flops_per_token

SHAPES = ["llama3-8b", "deepseek-v3", "qwen3-30b-a3b"]


def _blocks(model):
    return range(model.layers)


def _matmul_by_block(model) -> int:
    return sum(model.attention_params() + model.ffn_params(i, active=True)
               for i in _blocks(model))


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_and_flop_counts_equal_the_block_by_block_sums(name):
    model = PRESETS[name]
    for active in (False, True):
        by_block = sum(model.layer_params(i, active) for i in _blocks(model))
        assert model.num_params(active) == (model.embedding_params() + by_block
                                            + model.head_params())
    assert model.block_matmul_params() == _matmul_by_block(model)
    # QK^T at the q/k head size, PV at the value head size (equal for all but MLA)
    width = model.heads * (model.head_dim + model.v_dim)
    assert model.flops_per_token(4096) == (6.0 * (_matmul_by_block(model)
                                                  + model.vocab * model.hidden)
                                           + 6.0 * model.layers * width * 4096)


@pytest.mark.parametrize("name", SHAPES)
def test_recompute_flops_equal_the_block_by_block_sum(name):
    model = PRESETS[name]
    seq = 4096
    # the core runs at the heads' width: MLA at its (padded) q/k head size (nope + rope)
    width = model.heads * model.head_dim  # Qwen3: its own head_dim, not hidden / heads
    core = 4.0 * model.layers * width * seq
    for recompute, share in (("full", 1.0), ("half", 0.5)):
        got = recompute_flops_per_token(model, seq, recompute, "flash")
        # a causal flash kernel runs half of the square (no sliding windows in these shapes)
        assert got == share * (2.0 * _matmul_by_block(model) + 0.5 * core)
    assert recompute_flops_per_token(model, seq, "selective", "unfused") == core
    assert recompute_flops_per_token(model, seq, "selective", "flash") == 0.0


@pytest.mark.parametrize("name", SHAPES)
def test_mean_and_largest_block_equal_the_block_by_block_ones(name):
    model = PRESETS[name]
    sizes = [model.layer_params(i) for i in _blocks(model)]
    # the norms and MLA's down-projections (with their latent norms) are replicated over tp
    norms = 2 * model.norm_params + mla_replicated_params(model)
    for pp, per in ((1, sum(sizes) / len(sizes)), (4, max(sizes))):
        want = (per - norms) / 2 + norms if model.is_moe else \
            (model.attention_params() + model.mlp_params() + 2 * model.norm_params
             - norms) / 2 + norms
        assert memory.layer_params_local(model, 2, pp) == pytest.approx(want, rel=1e-12)
    if model.is_moe:
        blocks = [moe_memory._block(model, i, 2, 4, "megatron") for i in _blocks(model)]
        want = tuple(sum(b[part] for b in blocks) / len(blocks) for part in (0, 1))
        got = moe_memory.block_params(model, 2, 1, 4, "megatron")
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", SHAPES)
def test_a_stage_mean_block_equals_the_block_by_block_mean(name):
    """Spans across the dense/routed boundary (a pipeline rank's stages, interleaved: two
    ranges), one within, and none."""
    model = PRESETS[name]
    cases = [[range(0, 5), range(30, 34)], [range(2, 9)], [range(10, 10)], []]
    for spans in cases:
        blocks = [i for span in spans for i in span]
        got = moe_memory.stage_blocks(model, spans, 2, 4, "megatron")
        if not blocks:
            assert got == (0.0, 0.0, 0.0)
            continue
        sizes = [moe_memory._block(model, i, 2, 4, "megatron") for i in blocks]
        share = sum(model.is_moe_layer(i) for i in blocks) / len(blocks)
        want = (sum(s[0] for s in sizes) / len(blocks), sum(s[1] for s in sizes) / len(blocks),
                share)
        assert got == pytest.approx(want, rel=1e-12)
        assert model.moe_blocks_in(spans[0]) == sum(model.is_moe_layer(i) for i in spans[0])


def test_a_billion_block_moe_is_planned_through_the_command(tmp_path, capsys):
    """The user's path: `meshtron plan` on a model table of 10^9 blocks (three dense first)
    answers, here that nothing fits, naming the model, instead of summing block by block."""
    path = tmp_path / "huge.toml"
    path.write_text('[model]\nname = "huge-moe"\nlayers = 1000000000\nhidden = 64\nheads = 4\n'
                    'kv_heads = 4\nmax_seq = 128\nffn_hidden = 128\nvocab = 256\n'
                    'moe_experts = 8\nmoe_top_k = 2\nmoe_ffn_hidden = 32\nmoe_dense_layers = 3\n')
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100:2",
                 "--layout", "pp=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("meshtron plan: error: model=huge-moe: fits on no layout")


def test_a_billion_block_dense_model_is_planned_through_the_command(tmp_path, capsys):
    """The same for a dense model: `ModelSpec.moe_block_index`, which `block_kinds` asks for
    whatever the model, walked every block of a dense one (session 56: the fuzzed config.json
    fields of tests/test_fuzz_cli.py spent 8 of their 10 CPU seconds there)."""
    path = tmp_path / "huge.toml"
    path.write_text('[model]\nname = "huge-dense"\nlayers = 1000000000\nhidden = 64\nheads = 4\n'
                    'kv_heads = 4\nmax_seq = 128\nffn_hidden = 128\nvocab = 256\n')
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100:2",
                 "--layout", "pp=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("meshtron plan: error: model=huge-dense: fits on no layout")
