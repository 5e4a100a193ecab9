"""What the FP8 experts of a mixture-of-experts layer spend beyond their dense equivalent's
casts: quantising the routed rows (`expert_cast_bytes`) and, for Megatron-Core's
Transformer Engine experts, padding each expert's rows to the FP8 GEMMs' alignment and back
(`fp8_pad_passes`). Torch-free; planner/moe_cost.py adds both to the experts' time."""

from __future__ import annotations

import math

FP8_ROW_ALIGN = 16
"""Rows per expert an FP8 grouped GEMM needs a multiple of: Transformer Engine's Fp8Padding
aligns each split to 16 (32 for MXFP8; transformer_engine/pytorch/module/fp8_padding.py at
v2.8, `align_size`), the FP8 GEMMs' row alignment."""


def fp8_pad_passes(per_expert: bool, dispatch: str, capacity: float, tokens: float,
                   top_k: int, experts: int, ep: int, etp: int, is_folded: bool) -> float:
    """Memory-bound passes (each a read and a write of the routed rows) one MoE layer's FP8
    experts make in one direction padding their rows: Megatron-Core's TEGroupedMLP pads every
    local expert's rows to FP8_ROW_ALIGN before fc1 (Fp8Padding: the input, and the probs)
    and unpads fc2's output (Fp8Unpadding), a fused_multi_row_padding / _unpadding copy each,
    whose backward runs the other (moe/experts.py `TEGroupedMLP.forward`: fp8_padding at
    core_v0.12.2 / core_v0.14.0 / core_v0.15.0, quantization_padding at d7288711; TE
    fp8_padding.py at v2.8). Fp8Padding returns its input untouched when every split is
    already aligned: with token drop padded to `capacity` (KernelOptions.expert_capacity
    with expert_capacity_pad; callers pass 0 for token drop without padding)
    each local expert gets the same ceil(capacity T k / E) rows from each of the ep (x etp
    gathered) ranks (token_dispatcher.py `get_capacity`, the dispatcher's drop_and_pad
    splits), aligned or not by arithmetic; dropless the splits are whatever the router
    chose (Megatron-Core's force-balanced routing draws random logits), so a copy, unless the
    dispatcher pads: HybridEP's permute pads each expert's rows itself (token_dispatcher.py
    `_HybridEPManager.dispatch` passes pad_multiple, d7288711), and the routing map padded
    by moe_router_padding_for_fp8 (no recipe of the table sets it). DeepEP's permute ('deepep')
    pads too from core_r0.17 (`_DeepepManager.get_permuted_hidden_states_by_experts` passes
    align_size at d7288711) but not at core_v0.14.0-v0.16.0, the Megatron-Core of the
    megatron-bridge@2025 preset's 25.x containers: priced as copying. 0 for stacks whose expert
    GEMMs are not Transformer Engine's per-expert GroupedLinear (`per_expert`), and where the
    rows arrive quantised by an FP8 dispatch (`dispatch` 'fp8': DeepSeek-V3's stack, whose
    grouped GEMMs are its own, report section 3.3; Megatron-Core's dispatchers send BF16)."""
    if not per_expert or dispatch in ("hybridep", "fp8"):
        return 0.0
    if capacity > 0:
        rows = math.ceil(capacity * tokens * top_k / experts) * ep * (etp if is_folded else 1)
        if rows % FP8_ROW_ALIGN == 0:
            return 0.0
    return 2.0


def expert_cast_bytes(scaling: str, routed: float, dense: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes the FP8 expert GEMMs spend quantising beyond what the
    dense equivalent's casts were charged (fp8.quantisation_bytes). `routed`: elements of the
    T*k routed rows of width h (fullest rank), `dense`: the T*h of the dense equivalent.
    Forward, fc1's input: Transformer Engine's GroupedLinear quantises the permuted bf16 rows,
    both layouts for the weight gradient (split_quantize; fp8.CastBytes.input_fwd: 4 bytes
    delayed scaling, 6 current: its amax pass reads the rows once more), where the dense
    equivalent's fc1 input is a norm's output (CastBytes.normed_fwd: what TELayerNormLinear's
    fused norm adds to write FP8, 1 byte delayed, 4 current) -- a MoE layer's norm cannot:
    the router and the permutation take it in bf16. Backward: fc2's output gradient, the routed rows
    against the dense T*h, at CastBytes.grad_bwd (and input_bwd, dgrad_out for stacks that
    re-cast). fc2's input and fc1's output gradient have the dense equivalent's element
    counts (T*k*fe): already charged."""
    from meshtron.planner.fp8 import cast_bytes

    cb = cast_bytes(scaling)
    normed = cb.input_fwd if cb.normed_fwd is None else cb.normed_fwd
    fwd = cb.input_fwd * routed - normed * dense
    bwd = (cb.grad_bwd + cb.input_bwd + cb.dgrad_out) * (routed - dense)
    return max(0.0, fwd), max(0.0, bwd)
