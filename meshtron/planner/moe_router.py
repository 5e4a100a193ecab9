"""What a Megatron-Core MoE router's gating GEMM costs in fp32 beyond a bf16 one
(KernelOptions.router_dtype 'fp32', the recipes' moe_router_dtype). Torch-free;
planner/moe_cost.py adds it to the layer's extra time.

The active equivalent (compute_flops.active_equivalent) charges the router as E/3 more columns
of the block's MLP GEMMs, in the MLP's dtype; the gating GEMM is [T, h] x [h, E] on the tokens
a rank routes. In fp32 Megatron-Core runs it as `router_gating_linear` (moe/moe_utils.py
`RouterGatingLinearFunction`, core_v0.14.0 and d7288711): forward one Transformer Engine GEMM
of the bf16 input and weight with an fp32 output (te_general_gemm, out_dtype fp32: the bf16
GEMM's time); backward the input cast to fp32 (`inp.to(router_dtype)`: a read of 2 bytes and a
write of 4 per element), the input-gradient and weight-gradient GEMMs on fp32 operands, which
Transformer Engine runs on TF32 tensor cores ("Use TF32 only for pure FP32 GEMM":
common/gemm/cublaslt_gemm.cu at v2.8, CUBLAS_COMPUTE_32F_FAST_TF32), and the input gradient
cast back to bf16 (`.to(ctx.input_dtype)`: 4 + 2 bytes). At core_v0.12.2 (NeMo 25.04) the
forward was an fp32 `F.linear` of the cast input too, on TF32 under the NGC PyTorch
containers' TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1: one cast and a TF32 GEMM more in the forward,
not priced (a few hundredths of a millisecond per layer). What the bf16 gating GEMM costs
against the equivalent's columns is not priced either.
"""

from __future__ import annotations

from typing import Any

FP32_CAST_BYTES = 2.0 + 4.0
"""HBM bytes per element of one cast between bf16 and fp32 (a read and a write)."""


def fp32_router_extra(tokens: float, hidden: int, experts: int, cluster: Any,
                      membound_bytes_per_s: float) -> float:
    """Backward seconds one MoE layer's fp32 gating GEMM adds over a bf16 one for `tokens`
    routed rows (module docstring): its two backward GEMMs at TF32 against bf16, and the two
    casts between bf16 and fp32 of the [tokens, hidden] input and its gradient. The forward's
    bf16 GEMM with an fp32 output costs what a bf16 one does."""
    from meshtron.planner import compute

    tf32, bf16 = cluster.at_dtype("fp32"), cluster.at_dtype("bf16")

    def backward(cl: Any, operand_bytes: float) -> float:
        dgrad = compute.cluster_gemm_time(tokens, hidden, experts, cl, operand_bytes)
        wgrad = compute.cluster_gemm_time(experts, hidden, tokens, cl, operand_bytes)
        return dgrad + wgrad

    casts = 2 * FP32_CAST_BYTES * tokens * hidden / membound_bytes_per_s
    return max(0.0, backward(tf32, 4.0) - backward(bf16, compute.BF16)) + casts
