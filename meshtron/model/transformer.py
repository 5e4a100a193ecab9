"""A plain decoder-only transformer built from a ModelSpec; no parallel code inside.

Llama style (RMSNorm, RoPE, gated-SiLU MLP, grouped-query attention) and GPT style (LayerNorm,
GELU MLP, learned positions, biases) from the same classes. Parallelism is applied from outside
(`meshtron.parallel`); this module is the single-process reference.

Written to survive being sharded from outside, the way torchtitan's models are:
- attention infers its local head count from the projected tensor, so a column-parallel `wq`
  that holds heads/tp heads needs no change here;
- blocks live in a `ModuleDict` keyed by their global index, so a pipeline stage can delete the
  blocks it does not own and keep the names (and checkpoint keys) of the ones it does;
- `tok_embeddings`, `norm` and `output` may be set to None on middle pipeline stages, and the
  forward then passes hidden states through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.errors import UserError
from meshtron.model.attention import DocumentMask, attention, document_mask, window_attention
from meshtron.model.embedding import Embedding
from meshtron.model.loss import OutputHead, cross_entropy_loss
from meshtron.model.mla import MLAttention
from meshtron.model.rope import apply_rope, rope_cache, rope_table
from meshtron.model.shapes import runtime_refusal
from meshtron.model.spec import ModelSpec

__all__ = ["Transformer", "apply_rope", "cross_entropy_loss", "document_context", "document_positions"]


def _norm(spec: ModelSpec, width: int | None = None, kind: str | None = None) -> nn.Module:
    """The spec's norm over `width` (default hidden); `kind` overrides spec.norm (q/k norms
    are RMSNorms)."""
    width, kind = width or spec.hidden, kind or spec.norm
    if spec.norm_plus_one:
        return PlusOneRMSNorm(width, spec.norm_eps) if kind == "rmsnorm" else \
            PlusOneLayerNorm(width, spec.norm_eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=spec.norm_eps)
    return nn.LayerNorm(width, eps=spec.norm_eps)


class PlusOneRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight is stored zero-centred and applied as 1 + weight (Gemma's
    RMSNorm); initialised to 0 (meshtron/model/init.py), so it starts as the identity scale."""

    zero_centred = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class PlusOneLayerNorm(nn.LayerNorm):
    """LayerNorm with the weight applied as 1 + weight (Nemotron's LayerNorm1P)."""

    zero_centred = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class Attention(nn.Module):
    window_kernel: str | None = None
    """The sliding-window kernel (model/attention.py `window_attention`): None chooses by
    device (FlexAttention on CUDA, query chunks elsewhere); tests set "flex" to run the CUDA
    branch inside a compiled block on CPU."""

    def __init__(self, spec: ModelSpec, index: int = 0,
                 local_tables: dict[str, torch.Tensor] | None = None):
        super().__init__()
        # block `index` attends within a sliding window (ModelSpec.slides), else causally
        self.window = spec.sliding_window if spec.slides(index) else 0
        # Gemma 3's sliding blocks rotate with their own base (rope_local_base_freq) and no
        # scaling; the table is built on first use per device (derived, so not a buffer that
        # meta-device materialisation would have to rebuild). `local_tables`: one dict the
        # model's sliding blocks share (Transformer), so the model keeps one table per device,
        # as torchtitan keeps one freqs_cis, not one per block (52 x 128 MiB at Gemma-3-27B).
        self.local_spec = (spec.replace(rope_theta=spec.rope_local_theta, rope_type="default")
                           if self.window and spec.rope_local_theta is not None
                           and spec.rope_local_theta != spec.rope_theta else None)
        self._local_tables = {} if local_tables is None else local_tables
        self.head_dim = spec.head_dim
        self.use_rope = spec.position == "rope"
        qkv_bias = spec.bias or spec.qkv_bias
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=spec.bias)
        # per head (Qwen3, Gemma 3), or over the whole projection (OLMo 2: tp=1 only, a rule of
        # plan_rules.model_problems)
        self.qk_whole = spec.qk_norm_whole
        qw, kw = ((spec.heads * spec.head_dim, spec.kv_dim) if spec.qk_norm_whole
                  else (spec.head_dim, spec.head_dim))
        self.q_norm = _norm(spec, qw, "rmsnorm") if spec.qk_norm else None
        self.k_norm = _norm(spec, kw, "rmsnorm") if spec.qk_norm else None
        self.rope_dim = spec.rope_dim  # partial rotary (Nemotron): the first rope_dim rotate
        # a softmax scale other than SDPA's 1/sqrt(head_dim), applied to q (every attention
        # path: SDPA, documents, context parallelism, takes its default scale)
        self.q_factor = spec.q_factor

    def forward(self, x: torch.Tensor, rope: torch.Tensor | tuple | None) -> torch.Tensor:
        """`rope`: the RoPE table, or (per-token RoPE angles or None, DocumentMask) for
        packed documents (`document_context`), or a context-parallel `AttentionContext`
        (meshtron/parallel/context.py: this rank's RoPE angles and the attention function)."""
        mask = attend = cp_ctx = None
        if isinstance(rope, tuple):
            rope, mask = rope
        elif hasattr(rope, "attend"):  # the sliding blocks' own attention where it differs
            cp_ctx = rope
            rope = cp_ctx.angles
            attend = (cp_ctx.window_attend if self.window and cp_ctx.window_attend is not None
                      else cp_ctx.attend)
        bsz, seq, _ = x.shape
        if self.local_spec is not None and rope is not None:
            rope = self._local_angles(rope, mask, cp_ctx, seq)
        # -1 heads: under tensor parallelism each rank holds heads/tp of them.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None and self.qk_whole:  # OLMo 2: over the whole projection
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, seq, -1, self.head_dim)
        k = k.view(bsz, seq, -1, self.head_dim)
        v = v.view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_whole:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self._rope(q, rope), self._rope(k, rope)
        if self.q_factor is not None:
            q = q * self.q_factor
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attend is not None:  # context parallelism gathers the kv heads itself
            return self.wo(attend(q, k, v).transpose(1, 2).reshape(bsz, seq, -1))
        # Grouped-query attention natively (no K/V copies); document masks without S x S.
        out = (window_attention(q, k, v, self.window, self.window_kernel, mask)
               if self.window else attention(q, k, v, mask))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _local_angles(self, rope: torch.Tensor, mask: DocumentMask | None, cp_ctx,
                      seq: int) -> torch.Tensor:
        """Gemma 3's sliding-block RoPE for this forward: the local table itself, or its rows
        at the tokens' positions (inside their documents: `mask.positions`; under context
        parallelism: the context's `positions` of this rank's tokens)."""
        if cp_ctx is not None:
            table = self._local_table(rope.device, cp_ctx.seq)
            return table[:, cp_ctx.positions]
        table = self._local_table(rope.device, seq)
        return table if mask is None else table[:, mask.positions]

    def _local_table(self, device: torch.device, seq: int) -> torch.Tensor:
        """The shared local table with at least `seq` rows: the run's sequence length, not
        max_position_embeddings (torchtitan sizes freqs_cis to max_seq_len), rebuilt larger
        when a longer sequence comes (a host-side shape check: no sync)."""
        table = self._local_tables.get(str(device))
        if table is None or table.shape[1] < seq:
            table = self._local_tables[str(device)] = rope_table(self.local_spec, seq,
                                                                  device=device)
        return table

    def _rope(self, x: torch.Tensor, rope) -> torch.Tensor:
        if self.rope_dim == self.head_dim:
            return apply_rope(x, rope)
        d = self.rope_dim
        return torch.cat([apply_rope(x[..., :d], rope), x[..., d:]], dim=-1)


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind = spec.mlp
        self.gelu = spec.gelu_approximate  # 'tanh' or the erf form ('none')
        self.gated = spec.gated_mlp
        self.w1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.bias)
        self.w2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.bias)
        self.w3 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":  # SwiGLU, Shazeer 2020
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.kind == "geglu":  # GeGLU with tanh GELU (Gemma's gelu_pytorch_tanh)
            return self.w2(F.gelu(self.w1(x), approximate=self.gelu) * self.w3(x))
        if self.kind == "relu2":  # squared ReLU (So et al. 2021; Nemotron-4)
            return self.w2(torch.square(F.relu(self.w1(x))))
        return self.w2(F.gelu(self.w1(x), approximate=self.gelu))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0,
                 local_tables: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.parallel_residual = spec.parallel_residual
        self.residual_scale = spec.residual_scale if spec.residual_scale != 1 else None
        # pre-norms (none in OLMo 2's 'post' layout); norms after attention and the MLP before
        # the residual add ('sandwich': Gemma 2/3; 'post': OLMo 2)
        pre, post = spec.norm_layout != "post", spec.norm_layout != "pre"
        self.attention_norm = _norm(spec) if pre else None
        # DeepSeek's multi-head latent attention (meshtron/model/mla.py), or (grouped-query)
        # multi-head attention.
        self.attention = (MLAttention(spec) if spec.is_mla
                          else Attention(spec, index, local_tables))
        self.attention_post_norm = _norm(spec) if post else None
        self.ffn_norm = _norm(spec) if pre else None
        if spec.is_moe_layer(index):  # mixture of experts (meshtron/model/moe.py)
            from meshtron.model.moe import MoE

            self.feed_forward: nn.Module = MoE(spec)
        else:
            self.feed_forward = FeedForward(spec)
        self.ffn_post_norm = _norm(spec) if post else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        if self.parallel_residual:
            return x + self.attention(self.attention_norm(x), rope) + self.feed_forward(self.ffn_norm(x))
        x = x + self._branch(self.attention, self.attention_norm, self.attention_post_norm,
                             x, rope)
        return x + self._branch(self.feed_forward, self.ffn_norm, self.ffn_post_norm, x)

    def _branch(self, fn, pre, post, x: torch.Tensor, *args) -> torch.Tensor:
        """One residual branch: its norms where the layout has them, Granite's factor."""
        out = fn(pre(x) if pre is not None else x, *args)
        if post is not None:
            out = post(out)
        return out * self.residual_scale if self.residual_scale is not None else out


class Transformer(nn.Module):
    """The plain model. Initial values come from `init_seed` alone (meshtron/model/init.py:
    a function of the seed, the parameter's name and the element's index), so any shard of a
    meta-device copy can be materialized to exactly these values. `init_seed=None` draws one
    number from torch's global CPU generator, so `torch.manual_seed(s); Transformer(spec)` is
    reproducible and consumes the same randomness on every device, meta included.

    Built under `with torch.device("meta")` (or with `device="meta"`) the model allocates
    nothing; `parallelize` then materializes only this rank's shards, and the single-process
    engine the whole model, the same way (`meshtron.model.init.materialize`)."""

    def __init__(self, spec: ModelSpec, init_seed: int | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        from meshtron.model.hf_variants import check_runtime

        check_runtime(spec)  # soft-capping, chunked attention: not built here
        problem = runtime_refusal(spec)
        if problem:  # planned-only features (ModelSpec.train_refusals): never built inexactly
            raise UserError(problem)
        self.spec = spec
        self.init_seed = (int(torch.randint(0, 2**62, (), device="cpu")) if init_seed is None
                          else int(init_seed))
        # `device` names where the model lives; without it the default device does (the CPU,
        # or "meta" under `with torch.device("meta")`, the only context meshtron itself uses).
        target = torch.device(device) if device is not None else torch.get_default_device()
        # Modules are created on meta (no memory, no throw-away default init), then allocated
        # once on the target device and initialized by `init_weights`.
        with torch.device("meta"):
            # fp32-summed weight gradient on every device (meshtron/model/embedding.py)
            self.tok_embeddings: nn.Embedding | None = Embedding(spec.vocab, spec.hidden)
            self.pos_embeddings: nn.Embedding | None = (
                Embedding(spec.max_seq, spec.hidden) if spec.position == "learned" else None)
            local_tables: dict[str, torch.Tensor] = {}  # Gemma 3's local RoPE, shared
            self.layers = nn.ModuleDict({str(i): Block(spec, i, local_tables)
                                         for i in range(spec.layers)})
            self.norm: nn.Module | None = _norm(spec)
            self.output: nn.Linear | None = OutputHead(spec.hidden, spec.vocab, bias=False)
            if spec.tied_embeddings:
                self.output.weight = self.tok_embeddings.weight
            # Not persistent: derived from the spec, so checkpoints hold only trainable state.
            self.register_buffer("rope", rope_cache(spec) if spec.position == "rope" else None,
                                 persistent=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init from `init_seed` (values in meshtron/model/init.py)."""
        from meshtron.model.init import init_parameters, retie_embeddings

        retie_embeddings(self)
        init_parameters([self], self.init_seed, self.spec.layers)
        if self.rope is not None:
            self.rope = rope_cache(self.spec, self.rope.device)

    def rope_for(self, seq_len: int) -> torch.Tensor | None:
        """The RoPE table for sequences of `seq_len` tokens: the buffer's first `seq_len` rows,
        or, with dynamic NTK scaling past the pre-training length, a table computed for that
        length. Rows, not the whole buffer: FSDP2's mixed precision casts a block's floating
        inputs to bf16 (cast_forward_inputs), and `x * cos` saves that copy for backward, so
        each block kept a bf16 copy of the whole [2, max_seq, rope_dim] table (64 MiB a block
        at max_seq 131072, head 128: rehearsed); a slice is a view, no copy."""
        spec = self.spec
        if self.rope is None:
            return None
        if spec.rope_type != "dynamic" or seq_len <= spec.rope_original_max_seq:
            return self.rope[:, :seq_len]
        return rope_cache(spec, self.rope.device, seq_len)

    document_eos: int | None = None
    """Set (to the tokenizer's end-of-text id) for packed documents: attention stays inside
    each document and RoPE positions restart at 0 after every end-of-text token."""

    document_kernel: str | None = None
    """The document masks' kernel (model/attention.py `document_mask`): None by device
    (FlexAttention block masks on CUDA); tests set "flex" to run the CUDA branch on CPU
    (eager, forward only)."""

    sequence_shards: int = 1
    """Set by `meshtron.parallel.tensor.apply_tensor_parallel` under sequence parallelism: a
    pipeline stage without the embedding receives hidden states of 1/sequence_shards of the
    sequence, which attention gathers whole."""

    context_parallel = None
    """Set by `meshtron.parallel.context.apply_context_parallel`: `tokens` are then this rank's
    chunks of each sequence and attention runs over the whole sequence."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab] (or hidden states on a pipeline
        stage that lacks the embedding or the output head). With `targets` [batch, seq] (and
        the output head here): the mean cross-entropy instead, without whole logits
        (`loss`)."""
        # the sequence's length: token ids, or a later stage's hidden states (sequence shards)
        seq = tokens.shape[1] * (1 if tokens.dim() == 2 else self.sequence_shards)
        rope = self.rope_for(seq)
        if self.context_parallel is not None:
            rope = self.context_parallel.context(tokens, self)
        elif self.document_eos is not None:
            rope = document_context(tokens, self.document_eos, rope, self.spec,
                                    self.document_kernel)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.tok_embeddings is not None and self.spec.embed_scale != 1:
            h = h * self.spec.embed_scale  # Gemma: sqrt(hidden); Granite: embedding_multiplier
        if self.pos_embeddings is not None:
            # The full sequence length: under sequence parallelism `h` holds a sequence shard,
            # and the position table's output is sharded the same way (tensor.py's plan).
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos_embeddings(positions)
        for block in self.layers.values():
            h = block(h, rope)
        if self.norm is not None:
            h = self.norm(h)
            if self.spec.logit_scale != 1:  # Granite's 1/logits_scaling: W(h s) = (W h) s
                h = h * self.spec.logit_scale
        if self.output is not None:
            if targets is not None:
                return self.loss(h, targets)
            h = self.output(h)
        return h

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the head on final hidden states `h`. Chunked over tokens
        (meshtron/model/loss.py); a tensor-parallel head (vocabulary-sharded DTensor logits)
        keeps the whole-logits loss, which the caller runs under `loss_parallel()`: its
        per-rank logits are already 1/tp of the vocabulary, and chunking the tokens of a
        sequence-sharded DTensor is not something loss_parallel supports."""
        # Asked of the module, not of its weight: under FSDP2 the weight is a sharded DTensor
        # here (gathered only inside the head's own call) without any tensor parallelism, and
        # a DTensor test sent every FSDP2 run to whole logits (`meshtron rehearse` measured
        # 12 bytes per logit on a tp=1 ZeRO-3 rank, where the chunked loss holds none).
        if getattr(self.output, "vocab_parallel", False):  # set by parallel/tensor.py
            return cross_entropy_loss(self.output(h), targets)
        return self.output(h, targets)


def document_positions(tokens: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position inside the document), each [batch, seq], of packed tokens:
    a document starts at position 0 and after every `eos` token (which ends its document)."""
    seq = tokens.shape[1]
    ends = tokens == eos
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    doc = starts.long().cumsum(dim=1)
    idx = torch.arange(seq, device=tokens.device).expand_as(tokens)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return doc, idx - first


def document_context(tokens: torch.Tensor, eos: int, rope: torch.Tensor | None,
                     spec: ModelSpec | None = None, kernel: str | None = None
                     ) -> tuple[torch.Tensor | None, DocumentMask]:
    """What attention needs for packed documents: per-token RoPE angles at the positions inside
    each document (None without RoPE) and the DocumentMask that lets a token see only earlier
    tokens of its own document (meshtron/model/attention.py; no [seq, seq] tensor), and in
    `spec`'s sliding blocks only the last sliding_window of them. `kernel`: document_mask's."""
    doc, pos = document_positions(tokens, eos)
    angles = rope[:, pos] if rope is not None else None  # [2, batch, seq, hd]
    slides = spec is not None and spec.sliding_blocks > 0
    return angles, document_mask(doc, kernel, window=spec.sliding_window if slides else 0,
                                 positions=pos,
                                 every_block_slides=slides and spec.sliding_blocks == spec.layers)
