"""FLOPs of a training step: model FLOPs, what recomputation executes again, and the dense
model a mixture of experts computes like (`active_equivalent`, what the layer cost prices).

Counting. Model FLOPs follow `ModelSpec.flops_per_token` (6N plus the attention square; Kaplan et
al. 2020; Narayanan et al. 2021, eq. 3). Hardware FLOPs add what recomputation executes again:
full recomputation repeats every layer's forward pass (Chen et al. 2016; Narayanan et al. 2021
count it as 4x forward instead of 3x), selective recomputation repeats only the attention core
QK^T / softmax / AV (Korthikanti et al. 2022, section 5), and recomputed up-projections
(MemoryOptions.recompute_up_proj) their GEMMs again. FlashAttention's own recomputation
inside its backward kernel is not counted as hardware FLOPs, as is customary.

MFU and HFU count the attention square differently. MFU keeps the model-FLOPs convention:
the full s x s square (Megatron-LM, PaLM appendix B), so it can exceed 100% where attention
dominates (a long sequence on a small model). HFU counts what the hardware executes: a
causal FlashAttention kernel skips the masked half of the square and the tiles outside a
sliding window (compute_core.window_share, the fraction the time model prices), the unfused
core computes the whole square (`executed_square_share`).
"""

from __future__ import annotations

from meshtron.model.mla_shapes import mla_projections
from meshtron.model.spec import ModelSpec
from meshtron.planner.compute_core import window_share
from meshtron.planner.compute_parts import recompute_share


def active_equivalent(model: ModelSpec) -> ModelSpec:
    """The dense model that computes what a token of `model` computes: a mixture of experts
    becomes one SwiGLU per block of the mean active width (top_k routed experts + shared
    experts, the router's E outputs as E/3 more columns of the three GEMMs: same FLOPs), so
    GEMM time, memory-bound traffic and saved activations count active parameters only
    (memory counts all of them: `memory.layer_params_local`). What the experts cost beyond
    it (grouped GEMMs of the per-expert rows, permutation copies, routing imbalance, the
    expert-parallel all-to-alls) is planner/moe_cost.py's. A dense model is returned
    unchanged."""
    if not model.is_moe:
        return model
    # the router's E outputs and the shared experts' gate (Qwen2-MoE: 1 output) as columns
    moe = (model.moe_top_k + model.moe_shared_experts) * model.moe_ffn_hidden \
        + (model.moe_experts + model.moe_shared_gate) / 3.0
    dense = model.layers - model.moe_layers  # first_k_dense_replace, decoder_sparse_step
    width = (dense * model.ffn_hidden + model.moe_layers * moe) / model.layers
    return model.replace(ffn_hidden=max(1, round(width)), mlp="swiglu", moe_experts=0,
                         moe_top_k=0, moe_ffn_hidden=0, moe_shared_experts=0,
                         moe_dense_layers=0, moe_aux_loss=0.0, moe_bias_update=0.0,
                         moe_layer_step=1, moe_mlp_only_layers=(), moe_shared_gate=False)


def model_flops_per_step(model: ModelSpec, tokens: float, seq: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recomputation)."""
    return model.flops_per_token(seq) * tokens


def executed_square_share(model: ModelSpec, seq: int, attention: str) -> float:
    """The share of ModelSpec.flops_per_token's full attention square the attention kernel
    executes: a causal flash kernel half of it, less the tiles outside sliding windows
    (compute_core.core_time prices the same 0.5 x window_share); the unfused core all of it."""
    return 0.5 * window_share(model, seq) if attention == "flash" else 1.0


def hardware_flops_per_step(model: ModelSpec, tokens: float, seq: int, attention: str) -> float:
    """Model FLOPs of one step with the attention square counted as executed
    (`executed_square_share`): HFU's numerator before recomputation is added."""
    total = model.flops_per_token(seq)
    square = total - model.flops_per_token(0)
    return (total - (1.0 - executed_square_share(model, seq, attention)) * square) * tokens


def recompute_flops_per_token(model: ModelSpec, seq: int, recompute: str, attention: str,
                              v_native: bool = False) -> float:
    """FLOPs executed again by recomputation, per token (see module docstring); `v_native`:
    the stack's attention kernel runs MLA's V at its own width (KernelOptions.v_width)."""
    # QK^T + AV forward, full square, at the heads' width (heads x head_dim: 2 x hidden for
    # Llama, not for Qwen3's explicit head_dim, e.g. Qwen3-4B 32 x 128 over hidden 2560, as
    # ModelSpec.flops_per_token counts it); MLA's QK^T runs at the q/k width, its PV at V's
    # where the kernel takes it, else at V zero-padded to the q/k width (model/mla.py)
    v = model.v_dim if v_native or not model.is_mla else model.head_dim
    width = model.heads * (model.head_dim + v)
    core = 2.0 * model.layers * width * seq * executed_square_share(model, seq, attention)
    share = recompute_share(recompute)
    if share:
        # active parameters only: recomputation replays the experts a token ran through
        return share * (2.0 * model.block_matmul_params(active=True) + core)
    if recompute == "selective" and attention == "unfused":
        return core
    return 0.0


def fine_recompute_flops_per_token(model: ModelSpec, recompute: str, up_proj: bool) -> float:
    """GEMM FLOPs per token the backward runs again for recomputed up-projections
    (MemoryOptions.recompute_up_proj: Megatron-Core core_v0.14.0 multi_latent_attention.py
    "mla_up_proj" checkpoints wq_b / wkv_b, or wq; DeepSeek-V3 report 3.2.3), in the blocks
    whose forward recomputation does not replay whole (compute_parts.recompute_share);
    without MLA the QKV projection. The recomputed norms and activation are memory-bound:
    no FLOPs counted, as for the forward's."""
    if not up_proj:
        return 0.0
    if model.is_mla:
        params = sum(n * k for _, n, k, split in mla_projections(model, 1) if split)
    else:
        params = model.hidden * (model.heads * model.head_dim + 2 * model.kv_dim)
    return (1.0 - recompute_share(recompute)) * 2.0 * model.layers * params
