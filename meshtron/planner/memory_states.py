"""Model states per GPU: bytes per parameter of the weights, gradients and optimizer states at
a ZeRO stage, and the parameters one tensor-parallel rank holds per block, embedding and head.

Model states, bytes per parameter (Rajbhandari et al. 2020, "ZeRO", sections 3 and 5):

* `fsdp2` (meshtron's own runtime, torchtitan): the parameters ARE the fp32 master weights
  (FSDP2's sharded parameters keep their dtype; MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32) only casts the all-gathered copy, FSDP2 docs), fp32 gradients (the sharded
  gradient takes the sharded parameter's dtype) and AdamW's two fp32 moments: 4 + 4 + 8 = 16 bytes
  in fp32 and in bf16 runs alike; 2 + 2 + 4 where the model itself is bf16 (NeMo AutoModel:
  MemoryOptions.param_dtype). The compute copy (2 bytes in bf16, 4 in fp32) exists only
  while a unit is all-gathered (see `gathered_bytes`).
* `megatron` / `deepspeed` (mixed-precision AdamW as in the ZeRO paper): 2-byte weights,
  2-byte gradients (4 with Megatron-LM's fp32 main_grad, `KernelOptions.fp32_grad_reduce`) and
  K = 12 bytes of fp32 master weights and moments; fp32 runs: 4 + 4 + 8.

Sharding over the data-parallel group: ZeRO-1 the optimizer states, ZeRO-2 also the gradients,
ZeRO-3 also the weights. meshtron's ZeRO-2 is FSDP2 without resharding after forward, so its
parameters are sharded at rest too; its ZeRO-1 keeps parameters and gradients whole and gives
each data-parallel rank the AdamW state of the parameters it owns.
"""

from __future__ import annotations

from meshtron.model.hf_variants import local_rope
from meshtron.model.mla_shapes import mla_replicated_params
from meshtron.model.spec import ModelSpec
from meshtron.planner.memory_options import DEFAULT, MemoryOptions

WEIGHT_BYTES = 2.0
"""bf16 weights (mixed-precision frameworks that keep 16-bit parameters)."""
GRAD_BYTES = 2.0
"""bf16 gradients (4.0 with an fp32 accumulation buffer)."""
OPTIMIZER_BYTES = 12.0
"""fp32 master weights + AdamW first and second moments (ZeRO's K = 12)."""
BF16_MOMENTS_OPTIMIZER_BYTES = 8.0
"""fp32 master weight (4) and AdamW's two moments in bf16 (2 + 2): DeepSeek-V3 report 3.3.3."""
MASTER_BYTES = {"fp32": 4.0, "bf16": 2.0, "remainders": 2.0, "none": 0.0}
"""Bytes per parameter of the master weights by MemoryOptions.master_weights: an fp32 copy; a
bf16 copy (Apex DistributedFusedAdam's param shards in its optimizer dtype bf16);
Apex DistributedFusedAdam's int16 remainders (its `param_remainders_shard`, torch.int16, beside
the bf16 parameter they complete); none (the bf16 parameter is the optimizer's own)."""


def state_bytes(zero: int, dp: int, grad_bytes: float = GRAD_BYTES,
                mem: MemoryOptions | None = None,
                fsdp_zero1: bool = True) -> tuple[float, float, float]:
    """Bytes per parameter held by one GPU for (weights, gradients, optimizer) at a ZeRO stage.

    Mixed-precision frameworks (megatron, deepspeed): `grad_bytes` is 4 with an fp32 gradient
    buffer (Megatron-LM's main_grad): 2 + 4 + 12 = 18 bytes per parameter, 6 + 12/d with the
    distributed optimizer (the table of Megatron-LM's docs/distrib_optimizer.md). fsdp2: fp32
    parameters and gradients, 8 bytes of moments (module docstring). meshtron's ZeRO-1 is
    FSDP2 over the whole data axis (`fsdp_zero1`; parallel/data_parallel.py): parameters and
    gradients are sharded at rest like the states, and the gradients of a step's micro-batches
    accumulate unsharded (the caller's `accum`); False: compressed ZeRO-1 / DiLoCo, whole
    parameters and gradients, states by owner."""
    mem = mem or DEFAULT
    if mem.framework == "fsdp2":
        # the sharded parameters' dtype (MemoryOptions.param_dtype): the gradients and
        # torch's Adam moments take it too
        pb = 2.0 if mem.param_dtype == "bf16" else 4.0
        w, g, o = pb, pb, 2 * pb / dp if zero >= 1 else 2 * pb
        if zero >= 2 or (zero == 1 and fsdp_zero1):  # FSDP2 shards parameters at rest
            w, g = w / dp, g / dp
        return w, g, o
    if mem.dtype == "fp32":
        w, g, o = 4.0, 4.0, 8.0
        w = w / dp if zero >= 3 else w
    else:
        w, g, o = WEIGHT_BYTES, grad_bytes, OPTIMIZER_BYTES
        if mem.bf16_moments:  # fp32 master, bf16 moments (MemoryOptions.bf16_moments)
            o = BF16_MOMENTS_OPTIMIZER_BYTES
        # the master copy as the optimizer keeps it (MemoryOptions.master_weights)
        o += MASTER_BYTES[mem.master_weights] - MASTER_BYTES["fp32"]
        w = w / dp if zero >= 3 else w
    g = g / dp if zero >= 2 else g
    o = o / dp if zero >= 1 else o
    return w, g, o


def layer_params_local(model: ModelSpec, tp: int, pp: int = 1) -> float:
    """Parameters of one layer held by one tensor-parallel rank (norm weights replicated).

    Mixtures of experts hold ALL their experts (`ModelSpec.layer_params`, total parameters;
    only the active ones compute, `compute.active_equivalent`). With dense first layers
    (DeepSeek-V3) the blocks differ: without pipelining the mean block (the stage's total is
    exact), with it the largest (the fullest stage holds MoE blocks only)."""
    # MLA's down-projections and latent norms are replicated over tp (parallel/tensor.py)
    rep = 2 * model.norm_params + mla_replicated_params(model)
    if model.is_moe:
        per = (model.blocks_sum(model.layer_params) / model.layers if pp == 1
               else max(model.layer_params(i) for _, i in model.block_kinds()))
        return (per - rep) / tp + rep
    return (model.attention_params() + model.mlp_params() + 2 * model.norm_params - rep) / tp \
        + rep


def embedding_params_local(model: ModelSpec, tp: int) -> float:
    """Vocabulary-parallel token embedding (+ vocabulary-parallel learned position table)."""
    return model.embedding_params() - model.vocab * model.hidden + model.vocab * model.hidden / tp


def head_params_local(model: ModelSpec, tp: int, pp: int) -> float:
    """Final norm + LM head on the last stage; a tied head needs its own copy when pp > 1."""
    out = model.vocab * model.hidden / tp
    if model.tied_embeddings and pp == 1:
        out = 0.0
    return model.norm_params + out


def largest_param_local(model: ModelSpec, tp: int) -> float:
    """Elements of the largest single weight matrix of a layer on one tensor rank."""
    return max(model.hidden * model.ffn_hidden, model.hidden * model.hidden) / tp



def rope_table_bytes(model: ModelSpec, seq: int, meshtron: bool = True) -> float:
    """Bytes of the RoPE tables meshtron's runtime keeps on every GPU (model/transformer.py),
    fp32 cos and sin: the model's [2, max_seq, rope_dim] buffer, and for a model whose sliding
    blocks rotate with their own base (Gemma 3) one more [2, seq, head_dim] table that all of
    them share (sized to the run's sequence, as torchtitan's freqs_cis). Learned positions are
    parameters, counted with them. `meshtron`: False for another stack (0: its tables are not
    modelled; transformers' rotary embedding computes cos and sin per forward)."""
    if model.position != "rope" or not meshtron:
        return 0.0
    table = 2 * 4 * model.max_seq * model.rope_dim
    if local_rope(model):
        table += 2 * 4 * seq * model.head_dim
    return float(table)
