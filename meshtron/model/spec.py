"""ModelSpec: the one description of a decoder's shapes, shared by the planner and the runtime.

A ModelSpec says everything needed to count parameters and FLOPs and to build the plain
`nn.Module` in `meshtron.model.transformer`. Presets cover the usual public models; Hugging Face
`config.json` files (llama, mistral, qwen2, gpt_neox, gpt2) map onto the same fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshtron.argtypes import existing_file
from meshtron.errors import UserError

MLPKind = Literal["swiglu", "gelu"]
NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned"]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and architectural choices of a decoder-only transformer."""

    name: str
    """Preset or file name, for display only."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model (residual stream) width."""
    heads: int
    """Query attention heads."""
    kv_heads: int
    """Key/value heads; fewer than `heads` is grouped-query attention (Ainslie et al. 2023)."""
    ffn_hidden: int
    """Inner width of the MLP."""
    vocab: int
    """Vocabulary size (rows of the embedding table)."""
    max_seq: int
    """Longest sequence the position encoding is built for."""
    mlp: MLPKind = "swiglu"
    """'swiglu' (gated SiLU, three matrices, Llama) or 'gelu' (two matrices, GPT)."""
    norm: NormKind = "rmsnorm"
    """'rmsnorm' (weight only) or 'layernorm' (weight and bias)."""
    position: PositionKind = "rope"
    """'rope' rotary embeddings (no parameters) or 'learned' absolute position table (GPT-2/3)."""
    tied_embeddings: bool = False
    """Output projection shares the input embedding matrix."""
    bias: bool = False
    """Linear layers carry biases (GPT-2, GPT-NeoX) or not (Llama)."""
    qkv_bias: bool = False
    """Only the q/k/v projections carry biases (Qwen2)."""
    parallel_residual: bool = False
    """Attention and MLP read the same input and are summed (GPT-NeoX/GPT-J) instead of chained."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model.{field}={value!r}: must be a positive integer")
        if self.hidden % self.heads:
            raise UserError(
                f"model.heads={self.heads}: must divide model.hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise UserError(
                f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise UserError(
                f"model.hidden/heads={self.head_dim}: rotary embeddings need an even head size")
        for field in ("rope_theta", "norm_eps"):
            value = getattr(self, field)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise UserError(f"model.{field}={value!r}: must be a positive finite number")
        for field in ("tied_embeddings", "bias", "qkv_bias", "parallel_residual"):
            if not isinstance(getattr(self, field), bool):
                raise UserError(f"model.{field}={getattr(self, field)!r}: must be true or false")
        _check_choice("model.mlp", self.mlp, ("swiglu", "gelu"))
        _check_choice("model.norm", self.norm, ("rmsnorm", "layernorm"))
        _check_choice("model.position", self.position, ("rope", "learned"))

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # ---- exact parameter counts -----------------------------------------------------------
    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        weights = h * h + 2 * h * kv + h * h  # q, k, v, o
        biases = 0
        if self.bias:
            biases = h + 2 * kv + h
        elif self.qkv_bias:
            biases = h + 2 * kv
        return weights + biases

    def mlp_params(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        if self.mlp == "swiglu":
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two norms)."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params

    def embedding_params(self) -> int:
        """Token embedding plus learned position table, if any."""
        pos = self.max_seq * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + pos

    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied)."""
        out = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.norm_params + out

    def num_params(self) -> int:
        """Exact trainable parameter count (tied weights counted once)."""
        return self.embedding_params() + self.layers * self.layer_params() + self.head_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token: 6 x (matmul params) plus attention scores.

        6N counts a multiply-add as 2 FLOPs and backward as twice forward (Kaplan et al. 2020);
        the attention term 12 * layers * hidden * seq is QK^T and AV (Narayanan et al. 2021, eq. 3),
        counting a full (non-causal) square as Megatron does.
        """
        matmul_params = self.layers * (self.attention_params() + self.mlp_params())
        matmul_params += self.vocab * self.hidden  # LM head
        return 6.0 * matmul_params + 12.0 * self.layers * self.hidden * seq_len

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise UserError(f"{field}={value!r}: allowed values are {', '.join(allowed)}")


# ---- presets ----------------------------------------------------------------------------------
def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, max_seq, theta=10000.0, eps=1e-5):
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=ffn, vocab=vocab, max_seq=max_seq, rope_theta=theta, norm_eps=eps)


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
        ModelSpec(name="tiny-gpt", layers=4, hidden=256, heads=8, kv_heads=8, ffn_hidden=1024,
                  vocab=259, max_seq=512, mlp="gelu", norm="layernorm", position="learned",
                  tied_embeddings=True, bias=True),
    ]
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(
            f"model={name!r}: unknown preset; allowed: {', '.join(PRESETS)} "
            "or a path to a Hugging Face config.json") from None


# ---- Hugging Face config.json -----------------------------------------------------------------
_HF_LLAMA_LIKE = ("llama", "mistral", "qwen2")
_HF_TYPES = _HF_LLAMA_LIKE + ("gpt_neox", "gpt2")


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` into a ModelSpec."""
    path = existing_file(path, "model")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"model={str(path)!r}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"model={str(path)!r}: config.json must hold a JSON object")
    return from_hf_dict(cfg, name=path.parent.name or path.stem)


_HF_KEYS = {
    "llama": {"layers": "num_hidden_layers", "hidden": "hidden_size",
              "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
              "ffn_hidden": "intermediate_size", "vocab": "vocab_size",
              "max_seq": "max_position_embeddings"},
    "gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "kv_heads": "n_head",
             "ffn_hidden": "n_inner", "vocab": "vocab_size", "max_seq": "n_positions"},
}
_HF_KEYS["gpt_neox"] = dict(_HF_KEYS["llama"], kv_heads="num_attention_heads")


def from_hf_dict(cfg: dict[str, Any], name: str = "hf") -> ModelSpec:
    """A ModelSpec from a config.json's keys; errors name the config's keys (`hidden_size`),
    not ModelSpec's fields (`model.hidden`)."""
    try:
        return _from_hf_dict(cfg, name)
    except UserError as exc:
        keys = _HF_KEYS.get("llama" if cfg.get("model_type") in _HF_LLAMA_LIKE
                            else str(cfg.get("model_type")), {})
        text = re.sub(r"model\.(\w+)", lambda m: f"config.json {keys[m.group(1)]}"
                      if m.group(1) in keys else m.group(0), str(exc))
        raise UserError(text) from None


def _from_hf_dict(cfg: dict[str, Any], name: str) -> ModelSpec:
    mtype = cfg.get("model_type")
    if mtype not in _HF_TYPES:
        raise UserError(
            f"config.json model_type={mtype!r}: supported model types are {', '.join(_HF_TYPES)}")

    def need(key: str) -> Any:
        if key not in cfg:
            raise UserError(f"config.json {key}: missing (required for model_type {mtype!r})")
        return _hf_int(cfg, key, None, required=True)

    def num(key: str, default: float) -> float:
        value = cfg.get(key, default)
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise UserError(f"config.json {key}={value!r}: must be a positive number")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = cfg.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"config.json {key}={value!r}: must be true or false")
        return value

    def opt_int(key: str, default: Any) -> Any:
        return _hf_int(cfg, key, default)

    if mtype in _HF_LLAMA_LIKE:
        _check_hf_attention(cfg, mtype)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is "
                             f"supported for model_type {mtype!r}")
        heads = need("num_attention_heads")
        return ModelSpec(
            name=name, layers=need("num_hidden_layers"), hidden=need("hidden_size"), heads=heads,
            kv_heads=opt_int("num_key_value_heads", None) or heads,
            ffn_hidden=need("intermediate_size"), vocab=need("vocab_size"),
            max_seq=opt_int("max_position_embeddings", 4096),
            tied_embeddings=flag("tie_word_embeddings", False),
            qkv_bias=(mtype == "qwen2") or _no_out_bias(flag("attention_bias", False)),
            rope_theta=_hf_rope_theta(cfg, "rope_theta", num),
            norm_eps=num("rms_norm_eps", 1e-6 if mtype == "qwen2" else 1e-5),
        )
    if mtype == "gpt_neox":
        hidden = need("hidden_size")
        rotary_pct = cfg.get("rotary_pct", 1.0)
        if not _is_number(rotary_pct) or rotary_pct != 1.0:
            raise UserError(f"config.json rotary_pct={rotary_pct!r}: partial rotary embeddings "
                             "(RoPE on part of each head, as in Pythia) are not supported by "
                             "meshtron's model; only rotary_pct = 1.0")
        return ModelSpec(
            name=name, layers=need("num_hidden_layers"), hidden=hidden,
            heads=need("num_attention_heads"), kv_heads=need("num_attention_heads"),
            ffn_hidden=opt_int("intermediate_size", 4 * hidden), vocab=need("vocab_size"),
            max_seq=opt_int("max_position_embeddings", 2048), mlp="gelu", norm="layernorm",
            position="rope", tied_embeddings=flag("tie_word_embeddings", False),
            bias=True, parallel_residual=flag("use_parallel_residual", True),
            rope_theta=_hf_rope_theta(cfg, "rotary_emb_base", num),
            norm_eps=num("layer_norm_eps", 1e-5),
        )
    # gpt2
    hidden = need("n_embd")
    return ModelSpec(
        name=name, layers=need("n_layer"), hidden=hidden, heads=need("n_head"),
        kv_heads=need("n_head"), ffn_hidden=opt_int("n_inner", None) or 4 * hidden,
        vocab=need("vocab_size"), max_seq=opt_int("n_positions", 1024), mlp="gelu",
        norm="layernorm", position="learned", tied_embeddings=True, bias=True,
        norm_eps=num("layer_norm_epsilon", 1e-5),
    )


def _hf_rope_theta(cfg: dict[str, Any], key: str, num) -> float:
    """RoPE base: `rope_parameters.rope_theta` (transformers >= 5) or the flat key; scaled
    variants (llama3, yarn, linear, dynamic) are refused rather than silently run unscaled."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"config.json {field}={value!r}: must be an object")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise UserError(f"config.json {field}.rope_type={kind!r}: scaled rotary "
                             "embeddings are not supported by meshtron's model; only 'default'")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        if not _is_number(theta) or not math.isfinite(theta) or theta <= 0:
            raise UserError(f"config.json rope_parameters.rope_theta={theta!r}: must be a "
                             "positive number")
        return float(theta)
    return num(key, 10000.0)


def _no_out_bias(attention_bias: bool) -> bool:
    """Llama's `attention_bias` puts biases on q, k, v and the output projection; meshtron's
    model has q/k/v biases only (Qwen2), so that variant is refused."""
    if attention_bias:
        raise UserError("config.json attention_bias=true: biases on the attention output "
                         "projection are not supported; only q/k/v biases (model_type qwen2)")
    return False


def _check_hf_attention(cfg: dict[str, Any], mtype: str) -> None:
    """Refuse what meshtron's attention does not compute: a head size other than
    hidden/heads, sliding-window attention, biases beyond q/k/v."""
    hd = cfg.get("head_dim")
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if (hd is not None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0
            and hd != hidden // heads):
        raise UserError(f"config.json head_dim={hd!r}: meshtron's attention needs "
                         f"hidden_size/num_attention_heads={hidden // heads}")
    if cfg.get("use_sliding_window") is True:
        raise UserError("config.json use_sliding_window=true: sliding-window attention is not "
                         "supported; only full attention")
    if mtype == "mistral" and cfg.get("sliding_window") not in (None, 0):
        window, max_pos = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
        if not (isinstance(window, int) and isinstance(max_pos, int) and window >= max_pos):
            raise UserError(f"config.json sliding_window={window!r}: sliding-window attention "
                             "is not supported; set it to null (full attention)")
    if cfg.get("mlp_bias") is True:
        raise UserError("config.json mlp_bias=true: MLP biases are not supported for "
                         f"model_type {mtype!r}")


def _hf_int(cfg: dict[str, Any], key: str, default: Any, required: bool = False) -> Any:
    """A positive integer field of config.json; absent or null gives `default` unless
    `required`."""
    value = cfg.get(key)
    if value is None and not required:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json {key}={value!r}: must be a positive integer")
    return value


def resolve_model(model: str | Path) -> ModelSpec:
    """A preset name, or a path to a HF config.json (or a directory holding one)."""
    text = str(model)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model={text!r}: the folder holds no config.json (give a preset "
                            f"or a Hugging Face model folder or config.json)")
        return from_hf_config(path / "config.json")
    if text.endswith(".json") or path.exists() or "/" in text or text.startswith("."):
        return from_hf_config(path)  # a path, not a preset: say what is wrong with the file
    return preset(text)
