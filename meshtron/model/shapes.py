"""ModelSpec: the one description of a decoder's shapes, shared by the planner and the runtime.

A ModelSpec says everything needed to count parameters and FLOPs and to build the plain
`nn.Module` in `meshtron.model.transformer`; its checks say which combinations a model may take.
Where specs come from (presets, a Hugging Face config.json, a name or path): model/spec.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

from meshtron.errors import UserError
from meshtron.model.hf_variants import check_variants
from meshtron.model.mla_shapes import check_mla, mla_attention_params
from meshtron.model.shape_checks import (  # noqa: F401  (ROPE_TYPES, is_number re-exported)
    ROPE_TYPES, check_choice, check_moe, check_rope_scaling, is_number)

MLPKind = Literal["swiglu", "gelu", "geglu", "relu2"]
NormKind = Literal["rmsnorm", "layernorm"]
NormLayout = Literal["pre", "sandwich", "post"]
GeluKind = Literal["tanh", "none"]
PositionKind = Literal["rope", "learned"]
RopeKind = Literal["default", "linear", "dynamic", "llama3", "yarn"]
RouterKind = Literal["softmax", "sigmoid"]


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
    """'swiglu' (gated SiLU, three matrices, Llama), 'geglu' (gated tanh-GELU, three matrices,
    Gemma), 'gelu' (tanh-GELU, two matrices, GPT) or 'relu2' (squared ReLU, two matrices,
    Nemotron-4: So et al. 2021 "Primer")."""
    gelu_approximate: GeluKind = "tanh"
    """The GELU of 'gelu' and 'geglu': 'tanh' (GPT-2's gelu_new, Gemma's gelu_pytorch_tanh) or
    'none', the erf form (GPT-NeoX / Pythia `hidden_act` 'gelu'); torch's `approximate`."""
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
    """RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)."""
    # ---- dense variants read from Hugging Face configs (model/hf_variants.py checks them) ----
    qk_norm_whole: bool = False
    """With qk_norm: one RMSNorm over the whole query projection (heads x head_dim wide) and
    one over the whole key projection (OLMo 2), not per head."""
    norm_plus_one: bool = False
    """Norm weights are stored zero-centred and applied as 1 + weight (Gemma's RMSNorm,
    Nemotron's LayerNorm1P); the same parameters, another reading of them."""
    norm_layout: NormLayout = "pre"
    """'pre' (a norm before attention and before the MLP), 'sandwich' (Gemma 2/3: also one
    after each, before the residual add: four per block) or 'post' (OLMo 2: only the norms
    after attention and after the MLP, before the residual add)."""
    rope_fraction: float = 1.0
    """Share of each query/key head that rotates (HF `partial_rotary_factor`: Nemotron 0.5);
    the first int(head_dim * fraction) dimensions, the rest pass through."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window blocks where it differs from `rope_theta` (Gemma 3
    `rope_local_base_freq`)."""
    attn_scale: float | None = None
    """Softmax scale of the attention scores (None: 1/sqrt(head_dim); Gemma
    query_pre_attn_scalar**-0.5, Granite `attention_multiplier`)."""
    embed_scale: float = 1.0
    """Factor on the token embeddings (Gemma sqrt(hidden), Granite `embedding_multiplier`)."""
    residual_scale: float = 1.0
    """Factor on attention's and the MLP's outputs before each residual add (Granite
    `residual_multiplier`)."""
    logit_scale: float = 1.0
    """Factor on the output logits (Granite 1 / `logits_scaling`)."""
    attn_softcap: float = 0.0
    """Soft-capping of attention scores, cap * tanh(score / cap) (Gemma 2 50.0); 0: none."""
    logit_softcap: float = 0.0
    """Soft-capping of the output logits (Gemma 2 30.0); 0: none."""
    sliding_window: int = 0
    """Keys a query attends to in a sliding-window block, itself included (Mistral,
    StarCoder2 4096, Gemma 2 4096); 0: every block attends to the whole causal prefix."""
    window_every: int = 0
    """With a sliding window: of every `window_every` consecutive blocks the last attends
    globally and the others slide (Gemma 2: 2, Gemma 3: 6); 0: every block slides."""
    window_blocks: tuple[int, ...] = ()
    """With a sliding window: the blocks that slide, where they follow no period (Qwen's
    `use_sliding_window`: transformers' layer_types from `max_window_layers`,
    model/hf_variants.py qwen_window); (): `window_every` decides."""
    attn_chunk: int = 0
    """Chunked attention (Llama 4 `attention_chunk_size` 8192): in a chunked block a query
    attends only to earlier keys of its own chunk of `attn_chunk` positions (transformers'
    masking_utils.chunked_overlay: kv_idx // chunk == q_idx // chunk); 0: none. Priced by the
    planner; meshtron's runtime does not compute it (hf_variants.runtime_problem)."""
    chunk_every: int = 0
    """With chunked attention: of every `chunk_every` consecutive blocks the last attends to
    the whole causal prefix (Llama 4's NoPE blocks, `no_rope_layer_interval` 4); 0: every
    block is chunked."""
    # ---- multi-head latent attention (meshtron/model/mla.py); kv_lora_rank = 0: none ---------
    q_lora_rank: int = 0
    """Width of the queries' latent (DeepSeek-V3 1536; 0: one plain q projection, V2-Lite)."""
    kv_lora_rank: int = 0
    """Width of the keys' and values' shared latent (DeepSeek-V3 512); 0: no MLA."""
    qk_nope_head_dim: int = 0
    """Per-head query/key part without rotary embedding (DeepSeek-V3 128)."""
    qk_rope_head_dim: int = 0
    """Per-head query part with rotary embedding, and the one rotary key all heads share (64)."""
    v_head_dim: int = 0
    """Per-head value width (DeepSeek-V3 128)."""
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
    moe_layer_step: int = 1
    """After the first `moe_dense_layers`, block i is routed only when (i + 1) % step == 0
    (Qwen2-MoE / Qwen3-MoE `decoder_sparse_step`, Llama 4 `interleave_moe_layer_step`); the
    others keep a dense feed-forward of width `ffn_hidden`."""
    moe_mlp_only_layers: tuple[int, ...] = ()
    """Blocks that keep a dense feed-forward besides those (Qwen `mlp_only_layers`)."""
    moe_shared_gate: bool = False
    """The shared experts' output is scaled by sigmoid(x . w), a per-token scalar gate of
    `hidden` weights (Qwen2-MoE `shared_expert_gate`)."""
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
    attn_sinks: bool = False
    """A learned logit per query head joins every softmax row and takes probability mass
    (gpt-oss `sinks`, Xiao et al. 2023): `heads` parameters a block. Planned; the runtime
    refuses it (`train_refusals`)."""
    train_refusals: tuple[str, ...] = ()
    """What a config.json asks for that meshtron's runtime does not compute and no other field
    describes (gpt-oss's clamped SwiGLU, Llama 4's router scaling the experts' input and its
    chunked attention, OLMoE's clip_qkv): one line each, naming the key, its value and what
    is allowed. They change no parameter count; the planner prices the model with the other
    fields (Llama 4's chunks as full causal attention, an upper bound); `meshtron train`
    refuses with the first (`runtime_refusal`)."""
    train_notes: tuple[str, ...] = ()
    """What a config.json asks for that meshtron's runtime trains without but that changes no
    function the trained weights compute (non-zero dropout: model/hf_config.py
    dropout_notes): one line each, naming the key(s) and value(s); `meshtron train` prints
    them as warnings before the run starts (RunConfig.warnings)."""
    mtp_depth: int = 0
    """Multi-token prediction modules trained beside the model (DeepSeek-V3 report section
    2.2: D sequential modules, each an RMSNorm pair, a 2h -> h projection, one block and the
    shared output head; D = 1 in section 4.2). Priced by the planner (planner/mtp.py);
    meshtron's runtime builds none and refuses it (plan_rules.model_problems)."""

    def __post_init__(self) -> None:
        if not isinstance(self.mtp_depth, int) or isinstance(self.mtp_depth, bool) \
                or self.mtp_depth < 0:
            raise UserError(f"model.mtp_depth={self.mtp_depth!r}: must be a non-negative "
                            "integer")
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model.{field}={value!r}: must be a positive integer")
        if self.head_size is None and not self.kv_lora_rank and self.hidden % self.heads:
            raise UserError(
                f"model.heads={self.heads}: must divide model.hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise UserError(
                f"model.kv_heads={self.kv_heads}: must divide model.heads={self.heads}")
        check_mla(self)
        check_variants(self)
        if self.position == "rope" and (self.rope_dim % 2 or not self.rope_dim):
            raise UserError(
                f"model.hidden/heads={self.head_dim}: rotary embeddings need an even head size"
                if self.rope_fraction == 1 else f"model.rope_fraction={self.rope_fraction}: "
                f"rotates {self.rope_dim} of head_dim {self.head_dim}; must be even, at least 2")
        for field in ("rope_theta", "norm_eps"):
            value = getattr(self, field)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise UserError(f"model.{field}={value!r}: must be a positive finite number")
        for field in ("tied_embeddings", "bias", "qkv_bias", "parallel_residual"):
            if not isinstance(getattr(self, field), bool):
                raise UserError(f"model.{field}={getattr(self, field)!r}: must be true or false")
        check_choice("model.mlp", self.mlp, ("swiglu", "gelu", "geglu", "relu2"))
        check_choice("model.norm", self.norm, ("rmsnorm", "layernorm"))
        check_choice("model.position", self.position, ("rope", "learned"))
        check_rope_scaling(self)
        check_moe(self)

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """The query/key head size: what QK^T contracts (MLA: nope + rope, DeepSeek-V3 192)."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def v_dim(self) -> int:
        """The value head size: what PV produces per head (MLA: v_head_dim, 128)."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def v_width(self) -> int:
        """Per-token width of V as attention reads it (GQA: kv_dim; MLA: heads x v_head_dim)."""
        return self.kv_heads * self.v_dim

    @property
    def out_width(self) -> int:
        """Per-token width of attention's output, the out-projection's input (heads x v)."""
        return self.heads * self.v_dim

    @property
    def rope_dim(self) -> int:
        """How many dimensions of a query/key head rotate (MLA: qk_rope_head_dim)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        # transformers: int(head_dim * partial_rotary_factor) (Nemotron, Phi-4-mini)
        return int(self.head_dim * self.rope_fraction)

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def q_factor(self) -> float | None:
        """Factor on q that turns SDPA's 1/sqrt(head_dim) into `attn_scale` (None: none)."""
        if self.attn_scale is None or self.attn_scale * self.head_dim ** 0.5 == 1.0:
            return None
        return self.attn_scale * self.head_dim ** 0.5

    @property
    def gated_mlp(self) -> bool:
        """The MLP's up projection is two matrices (gate and up: SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    @property
    def block_norms(self) -> int:
        """Norms of hidden width in one block (norm_layout: 'sandwich' has four)."""
        return 4 if self.norm_layout == "sandwich" else 2

    def check_seq_len(self, seq_len: int, field: str) -> None:
        """Refuse (one line naming `field`) a sequence longer than the model's positions: the
        RoPE table and learned positions hold `max_seq` rows, and a longer sequence failed deep
        in a rank's forward (a broadcast error) instead. One check for train and rehearse."""
        if seq_len > self.max_seq:
            raise UserError(f"{field}={seq_len}: exceeds the model's max_seq={self.max_seq}")

    def slides(self, index: int) -> bool:
        """Block `index` attends within `sliding_window` (Gemma: all but every
        `window_every`-th block, transformers' `(index + 1) % pattern`)."""
        if self.window_blocks:
            return bool(self.sliding_window) and index in self.window_blocks
        return bool(self.sliding_window) and (
            not self.window_every or (index + 1) % self.window_every != 0)

    @property
    def chunked_blocks(self) -> int:
        """How many blocks attend in chunks (closed form, as `sliding_blocks`)."""
        if not self.attn_chunk:
            return 0
        return self.layers - (self.layers // self.chunk_every if self.chunk_every else 0)

    @property
    def sliding_blocks(self) -> int:
        """How many blocks slide (closed form, as `blocks_sum`)."""
        if not self.sliding_window:
            return 0
        if self.window_blocks:
            return len(set(self.window_blocks))
        return self.layers - (self.layers // self.window_every if self.window_every else 0)

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` has a routed feed-forward: after the first `moe_dense_layers`, every
        `moe_layer_step`-th block, not in `moe_mlp_only_layers`."""
        return (self.is_moe and index >= self.moe_dense_layers
                and (index + 1) % self.moe_layer_step == 0
                and index not in self.moe_mlp_only_layers)

    def moe_blocks_in(self, span: range) -> int:
        """How many of the blocks `span` (consecutive indices) have a routed feed-forward:
        closed form, so a stage of a billion blocks is counted at once."""
        if not self.is_moe or not span:
            return 0
        start, step = max(span.start, self.moe_dense_layers), self.moe_layer_step
        # indices i in [start, stop) with (i + 1) % step == 0
        stepped = max(0, span.stop // step - start // step)
        listed = sum(1 for i in set(self.moe_mlp_only_layers)
                     if start <= i < span.stop and (i + 1) % step == 0)
        return stepped - listed

    @property
    def moe_layers(self) -> int:
        return self.moe_blocks_in(range(self.layers))

    def moe_router_params(self) -> int:
        """One MoE feed-forward's parameters besides the experts: the router's weights (and
        its bias when linear layers carry biases, gpt-oss) and the shared experts' gate."""
        return (self.hidden * self.moe_experts + (self.moe_experts if self.bias else 0)
                + (self.hidden if self.moe_shared_gate else 0))

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qk_norm_params(self) -> int:
        if not self.qk_norm:
            return 0
        return self.heads * self.head_dim + self.kv_dim if self.qk_norm_whole \
            else 2 * self.head_dim

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # ---- exact parameter counts -----------------------------------------------------------
    def attention_params(self) -> int:
        if self.is_mla:
            return mla_attention_params(self)
        h, kv, q = self.hidden, self.kv_dim, self.heads * self.head_dim
        weights = h * q + 2 * h * kv + q * h  # q, k, v, o
        biases = 0
        if self.bias:
            biases = q + 2 * kv + h
        elif self.qkv_bias:
            biases = q + 2 * kv
        return weights + biases + self.qk_norm_params + (self.heads if self.attn_sinks else 0)

    def mlp_params(self, width: int | None = None) -> int:
        """A dense feed-forward of inner width `width` (default `ffn_hidden`)."""
        h, f = self.hidden, self.ffn_hidden if width is None else width
        if self.gated_mlp:
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    def moe_params(self, active: bool = False) -> int:
        """One MoE feed-forward: router, routed experts (all, or the top_k a token uses when
        `active`), shared experts. The balancing bias is a buffer-like constant, not counted."""
        routed = self.moe_top_k if active else self.moe_experts
        shared = self.mlp_params(self.moe_shared_experts * self.moe_ffn_hidden) \
            if self.moe_shared_experts else 0
        return self.moe_router_params() + routed * self.mlp_params(self.moe_ffn_hidden) \
            + shared

    def ffn_params(self, index: int, active: bool = False) -> int:
        return self.moe_params(active) if self.is_moe_layer(index) else self.mlp_params()

    def layer_params(self, index: int = 0, active: bool = False) -> int:
        """Parameters of block `index` (attention, feed-forward, its norms); `active`: those a
        token computes with (MoE: top_k of the routed experts)."""
        return (self.attention_params() + self.ffn_params(index, active)
                + self.block_norms * self.norm_params)

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
        blocks = self.blocks_sum(lambda i: self.layer_params(i, active))
        return self.embedding_params() + blocks + self.head_params()

    def block_kinds(self) -> tuple[tuple[int, int], ...]:
        """(how many blocks, the index of one of them) for each kind of block the model has:
        the first blocks dense, the rest with a routed feed-forward (`is_moe_layer`); a kind
        with no block is left out. Every per-block figure that depends on the block's kind
        only is a sum or a max over these two, never over `layers` (a config.json with a
        billion layers is priced, and refused, at once)."""
        moe = self.moe_layers
        dense = self.layers - moe
        return tuple((n, i) for n, i in ((dense, self.dense_block_index()),
                                         (moe, self.moe_block_index())) if n)

    def moe_block_index(self) -> int:
        """The index of one block with a routed feed-forward (the last such; -1: none)."""
        if not self.is_moe:
            # not a walk down every block: a dense config.json with ten million layers took
            # 0.7 s per call here (block_kinds asks for it whatever the model), 8 of the 10
            # seconds of `meshtron plan` refusing it (session 56)
            return -1
        i = self.layers - 1 - (self.layers % self.moe_layer_step)
        while i >= self.moe_dense_layers and not self.is_moe_layer(i):
            i -= self.moe_layer_step  # skips `moe_mlp_only_layers`: at most len() steps
        return i if self.is_moe and i >= self.moe_dense_layers else -1

    def dense_block_index(self) -> int:
        """The index of one block with a dense feed-forward (the first; -1: none)."""
        if not self.is_moe:
            return 0
        if self.moe_dense_layers:
            return 0
        if self.moe_layer_step > 1:
            return 0  # (0 + 1) % step != 0
        listed = sorted(i for i in set(self.moe_mlp_only_layers) if 0 <= i < self.layers)
        return listed[0] if listed else -1

    def blocks_sum(self, per_block: Callable[[int], int]) -> int:
        """sum(per_block(i) for i in range(layers)) for a function of the block's kind only:
        one call a kind. Integer in, integer out: exactly the sum."""
        return sum(n * per_block(i) for n, i in self.block_kinds())

    def block_matmul_params(self, active: bool = True) -> int:
        """The blocks' matmul weights (attention and feed-forward; `active`: MoE top_k routed
        experts), without norms: what a forward pass multiplies a token with."""
        return self.blocks_sum(lambda i: self.attention_params() + self.ffn_params(i, active))

    def active_params(self) -> int:
        return self.num_params(active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token: 6 x (matmul params) plus attention scores.

        6N counts a multiply-add as 2 FLOPs and backward as twice forward (Kaplan et al. 2020);
        the attention term 12 * layers * hidden * seq is QK^T and AV (Narayanan et al. 2021, eq. 3),
        counting a full (non-causal) square as Megatron does (heads * head_dim for hidden; MLA:
        QK^T heads * (nope + rope) wide, PV heads * v_head_dim, 6 * (qk + v) for 12 * hd).
        MoE: the active parameters only (router, top_k experts, shared experts), as
        DeepSeek-V3's and Megatron-Core's MoE MFU count; norms and biases are not matmuls.
        """
        matmul_params = self.block_matmul_params() + self.vocab * self.hidden  # + LM head
        qk_v_width = self.heads * (self.head_dim + self.v_dim)
        return 6.0 * matmul_params + 6.0 * self.layers * qk_v_width * seq_len

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def runtime_refusal(spec: ModelSpec) -> str | None:
    """The first thing meshtron's runtime does not compute for `spec`, as one line (None:
    it builds the model exactly)."""
    if spec.train_refusals:
        return spec.train_refusals[0]
    if spec.is_moe and spec.bias:
        return ("model.bias=true with routed experts: meshtron's experts and router carry no "
                "biases (planned only); allowed: false")
    if spec.attn_sinks:
        return ("model.attn_sinks=true: meshtron's attention has no sink logits (planned "
                "only); allowed: false")
    return None
