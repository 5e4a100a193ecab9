"""Which GEMMs run in FP8: one rule for the planner's costs and the runtime's conversion.

No torch here (the planner imports it). The runtime (meshtron/parallel/fp8.py) converts a
block's `nn.Linear` to torchao's `Float8Linear` exactly when `fp8_gemm` says so for its weight
shape; the planner prices a block GEMM at the FP8 peak under the same rule and in bf16
otherwise. The output head and the MoE router never run in FP8 (the head's logits feed the
loss directly and the router's scores decide routing: both stay bf16, as in torchtitan and
Megatron-Core's FP8 recipes).
"""

from __future__ import annotations

FP8_RECIPES = ("rowwise", "tensorwise")
"""torchao float8 scaling recipes meshtron runs (torchao.float8.Float8LinearConfig
.from_recipe_name): per-row scales (axiswise) or one scale per tensor."""

FP8_ALIGN = 16
"""FP8 tensor-core GEMMs (cuBLASLt / torch._scaled_mm) need every dimension a multiple of 16."""

# Below these sizes the casts cost more than the FP8 GEMM saves: torchao's published H100
# float8 training benchmarks (pytorch/ao torchao/float8/README.md, "Performance"), the
# thresholds torchao's own auto-filter encodes (float8_linear_utils._auto_filter_for_*).
# N = out_features, K = in_features of the Linear.
_ROWWISE_SKIP = ((2048, None), (None, 1024), (4096, 2048))
"""rowwise: skip when N <= 2048, or K <= 1024, or (N <= 4096 and K <= 2048)."""
_TENSORWISE_SKIP = ((1024, 4096),)
"""tensorwise: skip when N <= 1024 and K <= 4096."""


def fp8_aligned(out_features: int, in_features: int) -> bool:
    """Both dimensions are multiples of FP8_ALIGN (what the FP8 GEMM kernels accept)."""
    return out_features % FP8_ALIGN == 0 and in_features % FP8_ALIGN == 0


def fp8_gemm(out_features: int, in_features: int, recipe: str = "rowwise") -> bool:
    """A Linear of this weight shape is faster in FP8 than in bf16 on Hopper-class GPUs: aligned
    and above the recipe's size thresholds (see above)."""
    if not fp8_aligned(out_features, in_features):
        return False
    skips = _ROWWISE_SKIP if recipe == "rowwise" else _TENSORWISE_SKIP
    for n_max, k_max in skips:
        if (n_max is None or out_features <= n_max) and (k_max is None or in_features <= k_max):
            return False
    return True
