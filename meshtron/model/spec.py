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
from typing import Any, Callable, Literal

from meshtron.argtypes import existing_file
from meshtron.errors import UserError

MLPKind = Literal["swiglu", "gelu"]
NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned"]
RopeKind = Literal["default", "linear", "dynamic", "llama3", "yarn"]
RouterKind = Literal["softmax", "sigmoid"]
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


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
    rope_type: RopeKind = "default"
    """RoPE scaling for long context (meshtron/model/rope.py): 'default' (none), 'linear'
    (position interpolation), 'dynamic' (dynamic NTK), 'llama3' (Llama 3.1), 'yarn' (YaRN)."""
    rope_factor: float = 1.0
    """Context extension factor of the scaled variants."""
    rope_original_max_seq: int | None = None
    """Context length the model was pre-trained at (HF `original_max_position_embeddings`;
    for 'dynamic', HF `max_position_embeddings`); required by dynamic, llama3 and yarn."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above original/low_freq_factor are fully interpolated."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below original/high_freq_factor are kept."""
    rope_beta_fast: float = 32.0
    """yarn: rotation count at the original length above which dimensions extrapolate."""
    rope_beta_slow: float = 1.0
    """yarn: rotation count below which dimensions interpolate."""
    rope_attention_factor: float | None = None
    """yarn: factor on cos and sin (None: 0.1 ln(factor) + 1, as the paper and transformers)."""
    rope_truncate: bool = True
    """yarn: round the ramp's end dimensions to integers (transformers' default)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    head_size: int | None = None
    """Attention head size when it is not hidden/heads (Qwen3: 128 with hidden 2048, 32 heads)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3, OLMo 2)."""
    # ---- mixture of experts (meshtron/model/moe.py); moe_experts = 0: a dense model ----------
    moe_experts: int = 0
    """Routed experts per MoE layer (0: every feed-forward is dense)."""
    moe_top_k: int = 0
    """Routed experts each token uses (the active experts)."""
    moe_ffn_hidden: int = 0
    """Inner width of one routed expert (SwiGLU); `ffn_hidden` stays the dense layers' width."""
    moe_shared_experts: int = 0
    """Shared experts every token uses (DeepSeek); one SwiGLU of width shared * moe_ffn_hidden."""
    moe_dense_layers: int = 0
    """The first k blocks keep a dense feed-forward (DeepSeek `first_k_dense_replace`)."""
    moe_router: RouterKind = "softmax"
    """'softmax' top-k (Mixtral, Qwen3-MoE) or 'sigmoid' with group-limited top-k and
    bias-based balancing (DeepSeek-V3)."""
    moe_norm_topk: bool = True
    """Renormalise the top-k weights to sum to 1 (Mixtral always; Qwen3 `norm_topk_prob`)."""
    moe_route_scale: float = 1.0
    """Factor on the routed experts' weights (DeepSeek-V3 `routed_scaling_factor` 2.5)."""
    moe_groups: int = 1
    """Expert groups of group-limited routing (DeepSeek-V3 `n_group` 8)."""
    moe_topk_groups: int = 1
    """Groups a token may route into (DeepSeek-V3 `topk_group` 4)."""
    moe_aux_loss: float = 0.0
    """Coefficient of the load-balancing auxiliary loss (Switch Transformer; 0: none)."""
    moe_bias_update: float = 0.0
    """Bias update speed of auxiliary-loss-free balancing (DeepSeek-V3 gamma 0.001; sigmoid)."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model.{field}={value!r}: must be a positive integer")
        if self.head_size is None and self.hidden % self.heads:
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
        _check_rope_scaling(self)
        _check_moe(self)

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` has a routed feed-forward (after the first `moe_dense_layers`)."""
        return self.is_moe and index >= self.moe_dense_layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.moe_dense_layers if self.is_moe else 0

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # ---- exact parameter counts -----------------------------------------------------------
    def attention_params(self) -> int:
        h, kv, q = self.hidden, self.kv_dim, self.heads * self.head_dim
        weights = h * q + 2 * h * kv + q * h  # q, k, v, o
        biases = 0
        if self.bias:
            biases = q + 2 * kv + h
        elif self.qkv_bias:
            biases = q + 2 * kv
        return weights + biases + (2 * self.head_dim if self.qk_norm else 0)

    def mlp_params(self, width: int | None = None) -> int:
        """A dense feed-forward of inner width `width` (default `ffn_hidden`)."""
        h, f = self.hidden, self.ffn_hidden if width is None else width
        if self.mlp == "swiglu":
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    def moe_params(self, active: bool = False) -> int:
        """One MoE feed-forward: router, routed experts (all, or the top_k a token uses when
        `active`), shared experts. The balancing bias is a buffer-like constant, not counted."""
        routed = self.moe_top_k if active else self.moe_experts
        shared = self.mlp_params(self.moe_shared_experts * self.moe_ffn_hidden) \
            if self.moe_shared_experts else 0
        return self.hidden * self.moe_experts + routed * self.mlp_params(self.moe_ffn_hidden) \
            + shared

    def ffn_params(self, index: int, active: bool = False) -> int:
        return self.moe_params(active) if self.is_moe_layer(index) else self.mlp_params()

    def layer_params(self, index: int = 0, active: bool = False) -> int:
        """Parameters of block `index` (attention, feed-forward, two norms); `active`: those a
        token computes with (MoE: top_k of the routed experts)."""
        return self.attention_params() + self.ffn_params(index, active) + 2 * self.norm_params

    def embedding_params(self) -> int:
        """Token embedding plus learned position table, if any."""
        pos = self.max_seq * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + pos

    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied)."""
        out = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.norm_params + out

    def num_params(self, active: bool = False) -> int:
        """Exact trainable parameter count (tied weights counted once); `active`: the
        parameters one token uses (MoE: top_k routed experts per layer)."""
        blocks = self._blocks_sum(lambda i: self.layer_params(i, active))
        return self.embedding_params() + blocks + self.head_params()

    def _blocks_sum(self, per_block: Callable[[int], int]) -> int:
        """sum(per_block(i) for i in range(layers)) for a function of the block's kind only
        (dense or routed feed-forward): two calls, not one per block, so a config.json with a
        million layers is priced (and refused) at once. Integer arithmetic: exactly the sum."""
        moe = max(0, self.layers - self.moe_dense_layers) if self.is_moe else 0
        dense = self.layers - moe  # the first blocks (is_moe_layer)
        return ((dense * per_block(0) if dense else 0)
                + (moe * per_block(self.layers - 1) if moe else 0))

    def active_params(self) -> int:
        return self.num_params(active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token: 6 x (matmul params) plus attention scores.

        6N counts a multiply-add as 2 FLOPs and backward as twice forward (Kaplan et al. 2020);
        the attention term 12 * layers * hidden * seq is QK^T and AV (Narayanan et al. 2021, eq. 3),
        counting a full (non-causal) square as Megatron does (heads * head_dim for hidden).
        MoE: the active parameters only (router, top_k experts, shared experts), as
        DeepSeek-V3's and Megatron-Core's MoE MFU count; norms and biases are not matmuls.
        """
        matmul_params = self._blocks_sum(
            lambda i: self.attention_params() + self.ffn_params(i, active=True))
        matmul_params += self.vocab * self.hidden  # LM head
        attn_width = self.heads * self.head_dim
        return 6.0 * matmul_params + 12.0 * self.layers * attn_width * seq_len

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rope_scaling(spec: ModelSpec) -> None:
    _check_choice("model.rope_type", spec.rope_type, ROPE_TYPES)
    if spec.rope_type == "default":
        return
    for field in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_beta_fast", "rope_beta_slow"):
        value = getattr(spec, field)
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise UserError(f"model.{field}={value!r}: must be a positive finite number")
    if spec.rope_type in ("dynamic", "yarn") and spec.rope_factor < 1:
        raise UserError(f"model.rope_factor={spec.rope_factor!r}: must be at least 1 for "
                         f"rope_type {spec.rope_type!r}")
    original = spec.rope_original_max_seq
    if spec.rope_type != "linear" and (not isinstance(original, int) or isinstance(original, bool)
                                       or original <= 0):
        raise UserError(f"model.rope_original_max_seq={original!r}: must be a positive integer "
                         f"for rope_type {spec.rope_type!r}")
    if spec.rope_type == "llama3" and spec.rope_high_freq_factor <= spec.rope_low_freq_factor:
        raise UserError(f"model.rope_high_freq_factor={spec.rope_high_freq_factor!r}: must "
                         f"exceed model.rope_low_freq_factor={spec.rope_low_freq_factor!r}")
    factor = spec.rope_attention_factor
    if factor is not None and (not _is_number(factor) or not math.isfinite(factor) or factor <= 0):
        raise UserError(f"model.rope_attention_factor={factor!r}: must be a positive number")
    if not isinstance(spec.rope_truncate, bool):
        raise UserError(f"model.rope_truncate={spec.rope_truncate!r}: must be true or false")


def _check_moe(spec: ModelSpec) -> None:
    """MoE fields: all zero for a dense model; otherwise experts, top_k, width consistent."""
    for field in ("moe_experts", "moe_top_k", "moe_ffn_hidden", "moe_shared_experts",
                  "moe_dense_layers"):
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative integer")
    if spec.head_size is not None and (not isinstance(spec.head_size, int)
                                       or isinstance(spec.head_size, bool) or spec.head_size <= 0):
        raise UserError(f"model.head_size={spec.head_size!r}: must be a positive integer or null")
    if not isinstance(spec.qk_norm, bool):
        raise UserError(f"model.qk_norm={spec.qk_norm!r}: must be true or false")
    if not spec.is_moe:
        return
    if spec.mlp != "swiglu":
        raise UserError(f"model.mlp={spec.mlp!r}: MoE experts are SwiGLU; use mlp 'swiglu'")
    if not 1 <= spec.moe_top_k <= spec.moe_experts:
        raise UserError(f"model.moe_top_k={spec.moe_top_k!r}: must be between 1 and "
                         f"model.moe_experts={spec.moe_experts}")
    if spec.moe_ffn_hidden <= 0:
        raise UserError(f"model.moe_ffn_hidden={spec.moe_ffn_hidden!r}: must be a positive "
                         "integer for an MoE model")
    if spec.moe_dense_layers >= spec.layers:
        raise UserError(f"model.moe_dense_layers={spec.moe_dense_layers}: must be below "
                         f"model.layers={spec.layers}")
    _check_choice("model.moe_router", spec.moe_router, ("softmax", "sigmoid"))
    for field in ("moe_groups", "moe_topk_groups"):
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"model.{field}={value!r}: must be a positive integer")
    if spec.moe_experts % spec.moe_groups:
        raise UserError(f"model.moe_groups={spec.moe_groups}: must divide "
                         f"model.moe_experts={spec.moe_experts}")
    if spec.moe_topk_groups > spec.moe_groups:
        raise UserError(f"model.moe_topk_groups={spec.moe_topk_groups}: must be at most "
                         f"model.moe_groups={spec.moe_groups}")
    if spec.moe_topk_groups * (spec.moe_experts // spec.moe_groups) < spec.moe_top_k:
        raise UserError(f"model.moe_topk_groups={spec.moe_topk_groups}: the chosen groups hold "
                         f"fewer experts than model.moe_top_k={spec.moe_top_k}")
    if spec.moe_groups > 1 and spec.moe_router != "sigmoid":
        raise UserError(f"model.moe_groups={spec.moe_groups}: group-limited routing is "
                         "implemented for moe_router 'sigmoid' (DeepSeek-V3) only")
    for field in ("moe_route_scale", "moe_aux_loss", "moe_bias_update"):
        value = getattr(spec, field)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative number")
    if spec.moe_bias_update and spec.moe_router != "sigmoid":
        raise UserError(f"model.moe_bias_update={spec.moe_bias_update}: bias-based balancing "
                         "needs moe_router 'sigmoid'")


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise UserError(f"{field}={value!r}: allowed values are {', '.join(allowed)}")


# ---- presets ----------------------------------------------------------------------------------
def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, max_seq, theta=10000.0, eps=1e-5):
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=ffn, vocab=vocab, max_seq=max_seq, rope_theta=theta, norm_eps=eps)


def _qwen3_moe(name, layers, hidden, heads, kv_heads, head_size, expert):
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=6144 if hidden == 2048 else 12288, vocab=151936, max_seq=40960,
                     rope_theta=1e6, norm_eps=1e-6, head_size=head_size, qk_norm=True,
                     moe_experts=128, moe_top_k=8, moe_ffn_hidden=expert, moe_aux_loss=0.001)


def _deepseek_moe(name, heads, experts, groups, topk_groups, dense, vocab, scale):
    return ModelSpec(name=name, layers=61, hidden=7168, heads=heads, kv_heads=2, head_size=128,
                     ffn_hidden=18432, vocab=vocab, max_seq=4096, norm_eps=1e-6,
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
        # DeepSeek-V3 and Kimi K2 use multi-head latent attention (MLA), which meshtron's model
        # does not implement: these presets replace it by GQA with MLA's head count and a
        # 128-wide head, 2 KV heads (a 512-wide K and V per token against MLA's 576-wide
        # latent cache). MoE fields are exact; attention has more parameters than MLA (see
        # docs/guides/moe.md: 674.6B instead of 671B total for DeepSeek-V3).
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
_HF_MOE = ("mixtral", "qwen3_moe")
_HF_TYPES = _HF_LLAMA_LIKE + _HF_MOE + ("gpt_neox", "gpt2")


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
        keys = _HF_KEYS.get("llama" if cfg.get("model_type") in _HF_LLAMA_LIKE + _HF_MOE
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
            tied_embeddings=flag("tie_word_embeddings", False),
            qkv_bias=(mtype == "qwen2") or _no_out_bias(flag("attention_bias", False)),
            # Mistral's sliding window caps the exact length (see _hf_max_seq).
            **_hf_rope(cfg, "rope_theta", num,
                       _hf_max_seq(cfg, mtype, opt_int("max_position_embeddings", 4096))),
            norm_eps=num("rms_norm_eps", 1e-6 if mtype == "qwen2" else 1e-5),
        )
    if mtype in _HF_MOE:
        return _hf_moe(cfg, mtype, name, need, num, flag, opt_int)
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
            mlp="gelu", norm="layernorm",
            position="rope", tied_embeddings=flag("tie_word_embeddings", False),
            bias=True, parallel_residual=flag("use_parallel_residual", True),
            **_hf_rope(cfg, "rotary_emb_base", num, opt_int("max_position_embeddings", 2048)),
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


def _hf_moe(cfg: dict[str, Any], mtype: str, name: str, need, num, flag, opt_int) -> ModelSpec:
    """Mixtral (Jiang et al. 2024) and Qwen3-MoE config.json files."""
    qwen = mtype == "qwen3_moe"
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is "
                         f"supported for model_type {mtype!r}")
    if cfg.get("use_sliding_window") is True or (not qwen and cfg.get("sliding_window")):
        raise UserError(f"config.json sliding_window={cfg.get('sliding_window')!r}: "
                         "sliding-window attention is not supported; set it to null")
    _no_out_bias(flag("attention_bias", False))
    if qwen:
        sparse_step, dense_only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
        if sparse_step != 1 or dense_only:
            raise UserError(f"config.json decoder_sparse_step={sparse_step!r}, mlp_only_layers="
                             f"{dense_only!r}: only every layer an MoE layer (1, []) is supported")
    experts_key = "num_experts" if qwen and "num_experts" in cfg else "num_local_experts"
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = opt_int("head_dim", None)
    return ModelSpec(
        name=name, layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
        kv_heads=opt_int("num_key_value_heads", None) or heads,
        ffn_hidden=need("intermediate_size"), vocab=need("vocab_size"),
        tied_embeddings=flag("tie_word_embeddings", False),
        head_size=head_dim if head_dim not in (None, hidden // heads) or qwen else None,
        qk_norm=qwen,
        **_hf_rope(cfg, "rope_theta", num, opt_int("max_position_embeddings", 4096)),
        norm_eps=num("rms_norm_eps", 1e-6 if qwen else 1e-5),
        moe_experts=need(experts_key), moe_top_k=need("num_experts_per_tok"),
        moe_ffn_hidden=need("moe_intermediate_size") if qwen else need("intermediate_size"),
        moe_norm_topk=flag("norm_topk_prob", False) if qwen else True,
        moe_aux_loss=float(cfg.get("router_aux_loss_coef", 0.001)),
    )


def _hf_rope(cfg: dict[str, Any], key: str, num, max_pos: int) -> dict[str, Any]:
    """ModelSpec's RoPE fields (and max_seq) from `rope_parameters` (transformers >= 5) or the
    flat `rope_theta` / `key` with `rope_scaling` (transformers 4.x), read as transformers reads
    them (`modeling_rope_utils`): original_max_position_embeddings defaults to the top-level key,
    then to max_position_embeddings; YaRN's mscale/mscale_all_dim become its attention factor."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise UserError(f"config.json {field}={value!r}: must be an object")
    field, rope = "rope_parameters", params or {}
    if _rope_kind(rope) == "default" and scaling:
        field, rope = "rope_scaling", scaling
    kind = _rope_kind(rope)
    if kind not in ROPE_TYPES:
        raise UserError(f"config.json {field}.rope_type={kind!r}: allowed values are "
                         f"{', '.join(ROPE_TYPES)}")

    def value(name: str, default: Any, integer: bool = False) -> Any:
        got = rope.get(name)
        if got is None:
            return default
        if integer and (not isinstance(got, int) or isinstance(got, bool) or got <= 0):
            raise UserError(f"config.json {field}.{name}={got!r}: must be a positive integer")
        if not _is_number(got) or not math.isfinite(got) or got <= 0:
            raise UserError(f"config.json {field}.{name}={got!r}: must be a positive number")
        return got if integer else float(got)

    partial = (params or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(f"config.json partial_rotary_factor={partial!r}: partial rotary "
                         "embeddings are not supported; only 1.0")
    theta = (value("rope_theta", None) if isinstance(params, dict) and "rope_theta" in params
             else num(key, 10000.0))
    out: dict[str, Any] = {"rope_theta": theta, "max_seq": max_pos}
    if kind == "default":
        return out
    out.update(rope_type=kind, rope_factor=value("factor", None))
    original = value("original_max_position_embeddings",
                     _hf_int(cfg, "original_max_position_embeddings", max_pos), integer=True)
    if kind == "dynamic":
        original = max_pos  # transformers' dynamic NTK scales from max_position_embeddings
    if out["rope_factor"] is None:
        if kind != "yarn":
            raise UserError(f"config.json {field}.factor: missing (required for rope_type {kind!r})")
        out["rope_factor"] = max_pos / original  # transformers: implied by the two lengths
    factor = out["rope_factor"]
    if kind != "linear":
        out["rope_original_max_seq"] = original
    if kind == "llama3":
        out.update(rope_low_freq_factor=value("low_freq_factor", 1.0),
                   rope_high_freq_factor=value("high_freq_factor", 4.0))
    if kind in ("dynamic", "yarn"):  # the point of both: run past the pre-training length
        out["max_seq"] = max(max_pos, int(factor * original))
    if kind == "yarn":
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = value("attention_factor", None)
        if attention is None and mscale and mscale_all:  # DeepSeek's variant of YaRN's mscale
            attention = 1.0 if factor <= 1 else ((0.1 * mscale * math.log(factor) + 1)
                                                 / (0.1 * mscale_all * math.log(factor) + 1))
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise UserError(f"config.json {field}.truncate={truncate!r}: must be true or false")
        out.update(rope_beta_fast=value("beta_fast", 32.0), rope_beta_slow=value("beta_slow", 1.0),
                   rope_attention_factor=attention, rope_truncate=truncate)
    return out


def _rope_kind(rope: dict[str, Any]) -> Any:
    return rope.get("rope_type", rope.get("type", "default"))


def _no_out_bias(attention_bias: bool) -> bool:
    """Llama's `attention_bias` puts biases on q, k, v and the output projection; meshtron's
    model has q/k/v biases only (Qwen2), so that variant is refused."""
    if attention_bias:
        raise UserError("config.json attention_bias=true: biases on the attention output "
                         "projection are not supported; only q/k/v biases (model_type qwen2)")
    return False


def _hf_max_seq(cfg: dict[str, Any], mtype: str, max_pos: int) -> int:
    """The longest sequence meshtron computes exactly: Mistral's sliding window (every token
    attends to at most `sliding_window` predecessors) equals full causal attention on sequences
    no longer than the window, so the window caps max_seq and longer sequences are refused
    there (`seq_len ... max_seq`), not the model."""
    window = cfg.get("sliding_window") if mtype == "mistral" else None
    if isinstance(window, int) and not isinstance(window, bool) and 0 < window < max_pos:
        return window
    return max_pos


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
        window = cfg.get("sliding_window")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise UserError(f"config.json sliding_window={window!r}: must be a positive "
                             "integer or null")
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
