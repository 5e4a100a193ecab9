"""Multi-head latent attention's shapes (DeepSeek-V2, DeepSeek-AI 2024, section 2.1; DeepSeek-V3):
the checks and the exact parameter count of ModelSpec's MLA fields, kept beside model/shapes.py
so that the one description stays short. Torch-free (the planner imports it).

MLA compresses the keys and values of a token into one latent of `kv_lora_rank` numbers plus one
rotary key of `qk_rope_head_dim` numbers shared by every head; each head's key is its own
`qk_nope_head_dim` up-projection of the latent joined with the shared rotary key, its value a
`v_head_dim` up-projection. Queries go through a `q_lora_rank` latent too (0: one plain
projection, DeepSeek-V2-Lite). Weights (HF `DeepseekV3Attention` names):

    q_a_proj [q_lora_rank, hidden], q_a_layernorm [q_lora_rank],
    q_b_proj [heads * (nope + rope), q_lora_rank]        (or q_proj [heads * (nope + rope), hidden])
    kv_a_proj_with_mqa [kv_lora_rank + rope, hidden], kv_a_layernorm [kv_lora_rank],
    kv_b_proj [heads * (nope + v), kv_lora_rank], o_proj [hidden, heads * v]
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import UserError

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


def check_mla(spec: Any) -> None:
    """MLA fields: all zero without MLA (kv_lora_rank 0); with it, positive head sizes, an even
    rotary part, RoPE positions, one key/value head per query head and none of GQA's options
    that MLA's weights have no place for."""
    for field in MLA_FIELDS:
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"model.{field}={value!r}: must be a non-negative integer")
    if not spec.kv_lora_rank:
        for field in MLA_FIELDS:
            if getattr(spec, field):
                raise UserError(f"model.{field}={getattr(spec, field)}: multi-head latent "
                                 "attention fields need model.kv_lora_rank > 0; set it to 0")
        return
    for field in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(spec, field) <= 0:
            raise UserError(f"model.{field}={getattr(spec, field)}: must be a positive "
                             "integer with multi-head latent attention (kv_lora_rank > 0)")
    if spec.qk_rope_head_dim % 2:
        raise UserError(f"model.qk_rope_head_dim={spec.qk_rope_head_dim}: rotary embeddings "
                         "need an even size")
    if spec.v_head_dim > spec.qk_nope_head_dim + spec.qk_rope_head_dim:
        # model/mla.py pads V to the query/key head size for the flash kernels
        raise UserError(f"model.v_head_dim={spec.v_head_dim}: must be at most "
                         f"qk_nope_head_dim + qk_rope_head_dim = "
                         f"{spec.qk_nope_head_dim + spec.qk_rope_head_dim}")
    if spec.kv_heads != spec.heads:
        raise UserError(f"model.kv_heads={spec.kv_heads}: must equal model.heads={spec.heads} "
                         "with multi-head latent attention (every head has its own key and "
                         "value, up-projected from the shared latent)")
    for field, allowed in (("head_size", None), ("position", "rope"), ("bias", False),
                           ("qkv_bias", False), ("qk_norm", False)):
        if getattr(spec, field) != allowed:
            raise UserError(f"model.{field}={getattr(spec, field)!r}: must be "
                             f"{allowed!r} with multi-head latent attention (kv_lora_rank > 0)")


def mla_attention_params(spec: Any) -> int:
    """One block's MLA weights (no biases; the two latent RMSNorms' weights included)."""
    h, heads, qr, kvr = spec.hidden, spec.heads, spec.q_lora_rank, spec.kv_lora_rank
    qk, rope, v = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.qk_rope_head_dim, \
        spec.v_head_dim
    q = h * qr + qr + qr * heads * qk if qr else h * heads * qk
    kv = h * (kvr + rope) + kvr + kvr * heads * (spec.qk_nope_head_dim + v)
    return q + kv + heads * v * h


def mla_replicated_params(spec: Any) -> int:
    """The MLA weights tensor parallelism replicates (the down-projections wq_a and wkv_a and
    the two latent norms; torchtitan's NoParallel): every tp rank holds and computes them.
    0 without MLA."""
    if not spec.kv_lora_rank:
        return 0
    h, qr, kvr = spec.hidden, spec.q_lora_rank, spec.kv_lora_rank
    return (h * qr + qr if qr else 0) + h * (kvr + spec.qk_rope_head_dim) + kvr


def mla_projections(spec: Any, tp: int) -> list[tuple[str, float, int, bool]]:
    """(name, output width on one tp rank, input width, sharded by heads) of each of MLA's
    input-side GEMMs, in forward order (the out-projection wo is heads x v_head_dim -> hidden,
    row-parallel)."""
    h, heads, qr, kvr = spec.hidden, spec.heads, spec.q_lora_rank, spec.kv_lora_rank
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    q = ([("wq_a", qr, h, False), ("wq_b", heads * qk / tp, qr, True)] if qr
         else [("wq", heads * qk / tp, h, True)])
    return q + [("wkv_a", kvr + spec.qk_rope_head_dim, h, False),
                ("wkv_b", heads * (spec.qk_nope_head_dim + spec.v_head_dim) / tp, kvr, True)]
