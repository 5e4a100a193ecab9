"""Hugging Face Mixtral and Qwen3-MoE in and out: tiny random checkpoints written by
`transformers` (fp32), read into meshtron's model (config.json -> ModelSpec, per-expert tensors
stacked), logits equal to transformers'; a box read of experts 1..2 touches only their tensors;
saved back with `save_hf` and reloaded by transformers with the same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHAPES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=2, vocab_size=320, max_position_embeddings=128,
              num_experts_per_tok=2)
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hfmoe")
    torch.manual_seed(0)
    mix = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, rope_theta=5000.0, **SHAPES))
    mix.save_pretrained(root / "mixtral")
    qwen = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True, **SHAPES))
    with torch.no_grad():  # non-trivial q/k norms, so a skipped norm shows in the logits
        for layer in qwen.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.2)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.2)
    qwen.save_pretrained(root / "qwen3_moe")
    return {"mixtral": root / "mixtral", "qwen3_moe": root / "qwen3_moe"}


def _hf_logits(folder: Path, tokens):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def _meshtron(folder: Path):
    from meshtron.hf.load import load_into
    from meshtron.model.spec import resolve_model
    from meshtron.model.transformer import Transformer

    spec = resolve_model(folder)
    model = Transformer(spec, init_seed=0)
    read = load_into([model], folder, spec)
    return model.eval(), spec, read


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_logits_equal_transformers_and_export_round_trip(checkpoints, kind, tmp_path):
    from meshtron.hf.export import save_hf

    folder = checkpoints[kind]
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(3))
    model, spec, read = _meshtron(folder)
    assert spec.is_moe and spec.moe_top_k == 2
    assert read == 4 * spec.num_params()  # every fp32 weight read exactly once
    with torch.no_grad():
        ours = model(tokens)
    ref = _hf_logits(folder, tokens)
    assert (ours - ref).abs().max() < TOL * ref.abs().max().clamp_min(1)
    state = {n: p.detach() for n, p in model.named_parameters()}
    save_hf(state, spec, tmp_path / "out")
    back = _hf_logits(tmp_path / "out", tokens)
    assert (back - ref).abs().max() < TOL * ref.abs().max().clamp_min(1)


def test_a_rank_reads_only_its_experts(checkpoints):
    """The box of experts 1..2 of one stacked tensor: the bytes of those two experts only,
    equal to the transformers tensors."""
    from safetensors import safe_open

    from meshtron.hf.load import Checkpoint
    from meshtron.hf.names import sources
    from meshtron.model.spec import resolve_model

    folder = checkpoints["qwen3_moe"]
    spec = resolve_model(folder)
    src = sources(spec)["layers.1.feed_forward.experts.w2.weight"]
    target = torch.empty(2, spec.hidden, spec.moe_ffn_hidden)
    read = Checkpoint(folder).read_into(src, target, (1, 0, 0), 1 << 20)
    assert read == target.numel() * 4
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for j, e in enumerate((1, 2)):
            assert torch.equal(target[j], f.get_tensor(f"model.layers.1.mlp.experts.{e}.down_proj.weight"))
