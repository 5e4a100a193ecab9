"""Which GEMMs run in FP8: one rule for the planner's costs and the runtime's conversion.

No torch here (the planner imports it). The runtime (meshtron/parallel/fp8.py) converts a
block's `nn.Linear` to torchao's `Float8Linear` exactly when `fp8_gemm` says so for its weight
shape; the planner prices a block GEMM at the FP8 peak under the same rule and in bf16
otherwise. The output head and the MoE router never run in FP8 (the head's logits feed the
loss directly and the router's scores decide routing: both stay bf16, as in torchtitan and
Megatron-Core's FP8 recipes).
"""

from __future__ import annotations

from typing import Any

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


NEVER_FP8 = ("router", "gate", "output")
"""Module names that stay bf16 whatever their shape (see the module doc): the MoE router (its
gate Linear) and the output head."""

GEMM_GROUPS = ("qkv", "out", "up", "down")
"""The block GEMMs the planner prices (compute.layer_cost): fused QKV, attention output, MLP up
(with SwiGLU's gate), MLP down."""


def fp8_linear(fqn: str, out_features: int, in_features: int, recipe: str = "rowwise",
               emulate: bool = False) -> bool:
    """The one rule: does the block Linear named `fqn` (relative to a block list, e.g.
    'layers.0.attention.wq') with this weight shape run in FP8? Never for NEVER_FP8 names;
    emulated (CPU, numerics only) for every aligned shape; else `fp8_gemm`. (The planner
    prices other frameworks, which convert every aligned Linear, with emulate=True: see
    FP8_FILTERS.)"""
    if any(part in NEVER_FP8 for part in fqn.split(".")):
        return False
    if emulate:
        return fp8_aligned(out_features, in_features)
    return fp8_gemm(out_features, in_features, recipe)


def block_linears(model: Any, tp: int = 1) -> list[tuple[str, str, int, int]]:
    """(GEMM group, module path in a dense block, out_features, in_features) of every Linear of
    one dense block as meshtron/model/transformer.py builds it, the shapes a rank multiplies
    under Megatron tensor parallelism (column-parallel wq/wk/wv/w1/w3 split their outputs,
    row-parallel wo/w2 their inputs: the local GEMM is what the FP8 kernel runs)."""
    h, q, kv, f = model.hidden, model.heads * model.head_dim, model.kv_dim, model.ffn_hidden
    if getattr(model, "is_moe", False):
        # a mixture of experts: the MLP GEMMs judged on one expert's Linear (shared experts'
        # are multiples of it); the router's gate is NEVER_FP8. (meshtron's routed experts are
        # grouped GEMMs, not nn.Linear: torchao never converts them, see fp8_fractions.)
        f = model.moe_ffn_hidden
    out = [("qkv", "attention.wq", q // tp, h), ("qkv", "attention.wk", kv // tp, h),
           ("qkv", "attention.wv", kv // tp, h), ("out", "attention.wo", h, q // tp),
           ("up", "feed_forward.w1", f // tp, h)]
    if model.mlp == "swiglu":
        out.append(("up", "feed_forward.w3", f // tp, h))
    out.append(("down", "feed_forward.w2", h, f // tp))
    return out


FP8_FILTERS = ("torchao", "all")
"""Which block Linears a framework runs in FP8 (compute.KernelOptions.fp8_filter): 'torchao'
= `fp8_gemm`'s size thresholds (meshtron's runtime on a GPU); 'all' = every aligned one
(Transformer Engine's fp8_autocast converts every te.Linear; torchtitan's float8 converter
skips only `filter_fqns`, default the output head; DeepSeek-V3's FP8 framework, section 3.3,
every GEMM of the blocks)."""


def fp8_fractions(model: Any, tp: int = 1, recipe: str = "rowwise",
                  fp8_filter: str = "torchao") -> dict[str, float]:
    """Per GEMM group, the fraction of its FLOPs whose Linears run in FP8 under `fp8_linear`
    (e.g. Llama-3-8B rowwise: wk and wv, N = 1024, stay bf16, so qkv is 4096/6144 FP8);
    fp8_filter='all': every aligned Linear."""
    total = dict.fromkeys(GEMM_GROUPS, 0.0)
    fp8 = dict.fromkeys(GEMM_GROUPS, 0.0)
    routed_bf16 = fp8_filter == "torchao" and getattr(model, "is_moe", False)
    for group, name, n, k in block_linears(model, tp):
        total[group] += n * k
        if routed_bf16 and group in ("up", "down"):
            continue  # the active MLP is mostly routed experts: bf16 grouped GEMMs here
        if fp8_linear(name, n, k, recipe, emulate=fp8_filter == "all"):
            fp8[group] += n * k
    return {g: fp8[g] / total[g] if total[g] else 0.0 for g in GEMM_GROUPS}
