"""Where a ModelSpec comes from: the presets of the usual public models, and `resolve_model`,
which turns a preset name or a Hugging Face `config.json` (model/hf_config.py) into one.

ModelSpec itself (model/shapes.py: the one description of a decoder's shapes, shared by the
planner and the runtime) is imported from here by the rest of meshtron, with the presets.
"""

from __future__ import annotations

from pathlib import Path

from meshtron.errors import UserError
from meshtron.model.hf_config import from_hf_config
from meshtron.model.shapes import ModelSpec


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, max_seq, theta=10000.0, eps=1e-5):
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=ffn, vocab=vocab, max_seq=max_seq, rope_theta=theta, norm_eps=eps)


def _qwen3_moe(name, layers, hidden, heads, kv_heads, head_size, expert):
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=6144 if hidden == 2048 else 12288, vocab=151936, max_seq=40960,
                     rope_theta=1e6, norm_eps=1e-6, head_size=head_size, qk_norm=True,
                     moe_experts=128, moe_top_k=8, moe_ffn_hidden=expert, moe_aux_loss=0.001)


def _deepseek_moe(name, heads, experts, groups, topk_groups, dense, vocab, scale):
    return ModelSpec(name=name, layers=61, hidden=7168, heads=heads, kv_heads=heads,
                     q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=18432, vocab=vocab,
                     max_seq=4096, norm_eps=1e-6,
                     moe_experts=experts, moe_top_k=8, moe_ffn_hidden=2048, moe_shared_experts=1,
                     moe_dense_layers=dense, moe_router="sigmoid", moe_groups=groups,
                     moe_topk_groups=topk_groups, moe_route_scale=scale, moe_bias_update=1e-3)


PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, eps=1e-5),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, eps=1e-5),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, eps=1e-5),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, theta=500000.0),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, theta=500000.0),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, theta=500000.0),
        ModelSpec(name="gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96,
                  ffn_hidden=4 * 12288, vocab=50257, max_seq=2048, mlp="gelu", norm="layernorm",
                  position="learned", tied_embeddings=True, bias=True),
        # Small models that train on a CPU in seconds. Byte-level vocab (256) plus a few
        # specials; odd sizes on purpose so sharding edge cases show up.
        ModelSpec(name="tiny", layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=688,
                  vocab=259, max_seq=512),
        ModelSpec(name="debug", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=176,
                  vocab=259, max_seq=128),
        # Mixtures of experts (meshtron/model/moe.py). Values from each model's config.json.
        ModelSpec(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                  ffn_hidden=14336, vocab=32000, max_seq=32768, rope_theta=1e6,
                  moe_experts=8, moe_top_k=2, moe_ffn_hidden=14336, moe_aux_loss=0.02),
        _qwen3_moe("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 768),
        _qwen3_moe("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 1536),
        # DeepSeek-V3 and Kimi K2: multi-head latent attention (meshtron/model/mla.py) with
        # DeepSeek-V3's ranks; values from each model's config.json.
        _deepseek_moe("deepseek-v3", heads=128, experts=256, groups=8, topk_groups=4,
                      dense=3, vocab=129280, scale=2.5),
        _deepseek_moe("kimi-k2", heads=64, experts=384, groups=1, topk_groups=1, dense=1,
                      vocab=163840, scale=2.827),
        # Tiny MoEs that train on a CPU in seconds: Mixtral-style (softmax top-2, auxiliary
        # loss) and DeepSeek-style (sigmoid, 4 groups, shared expert, first block dense).
        ModelSpec(name="tiny-moe", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=344,
                  vocab=259, max_seq=512, moe_experts=8, moe_top_k=2, moe_ffn_hidden=96,
                  moe_aux_loss=0.01),
        ModelSpec(name="tiny-moe-ds", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=344,
                  vocab=259, max_seq=512, moe_experts=8, moe_top_k=2, moe_ffn_hidden=64,
                  moe_shared_experts=1, moe_dense_layers=1, moe_router="sigmoid",
                  moe_groups=4, moe_topk_groups=2, moe_route_scale=2.5, moe_bias_update=1e-3),
        # A tiny DeepSeek-style MoE with multi-head latent attention (q and kv latents).
        ModelSpec(name="tiny-mla", layers=4, hidden=128, heads=4, kv_heads=4, ffn_hidden=344,
                  vocab=259, max_seq=512, q_lora_rank=48, kv_lora_rank=32,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                  moe_experts=8, moe_top_k=2, moe_ffn_hidden=64,
                  moe_shared_experts=1, moe_dense_layers=1, moe_router="sigmoid",
                  moe_groups=4, moe_topk_groups=2, moe_route_scale=2.5, moe_bias_update=1e-3),
        ModelSpec(name="tiny-gpt", layers=4, hidden=256, heads=8, kv_heads=8, ffn_hidden=1024,
                  vocab=259, max_seq=512, mlp="gelu", norm="layernorm", position="learned",
                  tied_embeddings=True, bias=True),
    ]
}


def not_a_preset_name(spec: ModelSpec) -> ModelSpec:
    """`spec`, renamed '<name>-custom' when it bears a preset's name but not that preset's
    shapes: a config.json in a folder called llama3-8b (`--local-dir llama3-8b`), a file
    configs/debug.json, or a preset with overrides (a run file's [model] preset plus fields).
    A plan or run records a model by its name, and `cost`, `simulate`, `rehearse` and
    `train --plan` resolve that name to the preset: priced as the preset, accepted as the
    same model (audit s54). The same shapes keep the name (notes aside)."""
    same = PRESETS.get(spec.name)
    if same is None:
        return spec
    ignore = {"name": "", "train_notes": ()}
    if {**spec.to_dict(), **ignore} == {**same.to_dict(), **ignore}:
        return spec
    return spec.replace(name=f"{spec.name}-custom")


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(
            f"model={name!r}: unknown preset; allowed: {', '.join(PRESETS)} "
            "or a path to a Hugging Face config.json") from None


def resolve_model(model: str | Path) -> ModelSpec:
    """A preset name, or a path to a HF config.json (or a directory holding one)."""
    text = str(model)
    if text in PRESETS:
        return PRESETS[text]
    if not text.strip():  # Path('') is '.', the current folder: refused as the preset it is not
        return preset(text)
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model={text!r}: the folder holds no config.json (give a preset "
                            f"or a Hugging Face model folder or config.json)")
        return not_a_preset_name(from_hf_config(path / "config.json"))
    if text.endswith(".json") or path.exists() or "/" in text or text.startswith("."):
        # a path, not a preset: say what is wrong with the file
        return not_a_preset_name(from_hf_config(path))
    return preset(text)
