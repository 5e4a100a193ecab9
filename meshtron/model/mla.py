"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, section 2.1; DeepSeek-V3),
a plain module beside model/transformer.py's `Attention`, built from ModelSpec's MLA fields
(shapes and checks: model/mla_shapes.py).

Per token x [hidden]:
- queries: wq_a (hidden -> q_lora_rank), RMSNorm, wq_b (-> heads x (nope + rope)); or one wq
  when q_lora_rank is 0 (DeepSeek-V2-Lite);
- keys and values: wkv_a (hidden -> kv_lora_rank + rope) gives the latent and one rotary key
  shared by every head; RMSNorm(latent), wkv_b (-> heads x (nope + v)) gives each head's
  non-rotary key and its value;
- RoPE (model/rope.py's table, qk_rope_head_dim wide) on the queries' rotary part and on the
  shared key; each head's key is [its nope key, the shared rotary key];
- the attention core of model/attention.py (causal SDPA or document masks, no S x S tensor),
  with query/key heads nope + rope wide; SDPA's default scale 1/sqrt(nope + rope) is MLA's.
  The value heads (v_head_dim, narrower) are zero-padded to the query/key width and the
  output cut back: SDPA's flash kernels (CUDA's FlashAttention-2 and the CPU's) need one head
  size for q, k and v (torch's sdp_utils `check_head_dim_size_flash`; otherwise SDPA falls
  back to the math kernel, which keeps the S x S probabilities). Zero columns of V give zero
  output columns, so the cut output is exact; the cost is PV at the q/k width (kernels that
  take V's own width, Transformer Engine's fused attention or FlashAttention-3, do not pay it:
  the planner's KernelOptions.v_width);
- wo: heads x v -> hidden.

The names (wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo) are torchtitan's; `wo` is a residual
output projection for model/init.py's scaled initialization, as in `Attention`. Tensor
parallelism (parallel/tensor.py) shards wq/wq_b and wkv_b by heads and wo by rows, replicates
the down-projections and their norms; this module infers its local head count from the tensor
shapes. `k_rope_shared` is an identity where tensor parallelism makes the shared rotary key's
gradient a sum over the head shards (each rank's heads contribute a part of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.model.attention import attention
from meshtron.model.rope import apply_rope
from meshtron.model.shapes import ModelSpec


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.nope, self.rope_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.v_dim, self.kv_rank = spec.v_head_dim, spec.kv_lora_rank
        q_out = spec.heads * (self.nope + self.rope_dim)
        if spec.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(spec.hidden, spec.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(spec.q_lora_rank, eps=spec.norm_eps)
            self.wq_b = nn.Linear(spec.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(spec.hidden, q_out, bias=False)
        self.wkv_a = nn.Linear(spec.hidden, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=spec.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, spec.heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(spec.heads * self.v_dim, spec.hidden, bias=False)
        self.k_rope_shared = nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | tuple | None) -> torch.Tensor:
        """`rope`: the RoPE table, or (per-token RoPE angles, DocumentMask) for packed
        documents (model/transformer.py's `document_context`), or a context-parallel
        `AttentionContext` (meshtron/parallel/context.py), as `Attention` takes them."""
        mask = attend = None
        if isinstance(rope, tuple):
            rope, mask = rope
        elif hasattr(rope, "attend"):  # context parallelism: this rank's angles, its attention
            rope, attend = rope.angles, rope.attend
        bsz, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism each rank holds heads/tp of them.
        q = q.view(bsz, seq, -1, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = self.k_rope_shared(k_rope)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope)
        k_rope = apply_rope(k_rope[:, :, None, :], rope)  # one rotary key for every head
        heads = q.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1).transpose(1, 2)
        pad = q.shape[-1] - self.v_dim  # >= 0: model/mla_shapes.py's check
        v = F.pad(v, (0, pad)) if pad else v
        v = v.transpose(1, 2)
        # context parallelism gathers K and V (every head, V padded) over the cp ranks itself
        out = attend(q, k, v) if attend is not None else attention(q, k, v, mask)
        out = out[..., :self.v_dim]  # [b, h, seq, v_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
