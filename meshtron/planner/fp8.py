"""Which GEMMs run in FP8: one rule for the planner's costs and the runtime's conversion.

No torch here (the planner imports it). The runtime (meshtron/parallel/fp8.py) converts a
block's `nn.Linear` to torchao's `Float8Linear` exactly when `fp8_gemm` says so for its weight
shape; the planner prices a block GEMM at the FP8 peak under the same rule and in bf16
otherwise. The output head and the MoE router never run in FP8 (the head's logits feed the
loss directly and the router's scores decide routing: both stay bf16, as in torchtitan and
Megatron-Core's FP8 recipes).

It also says what quantising the FP8 operands moves (`cast_bytes`, `quantisation_bytes`): the
bytes per element each stack's casts read and write, from torchao's float8 code and its own
roofline (rowwise compiled: plus what torchao's own rowwise table measures beyond it), and from
Transformer Engine's documentation and modules; compute.py turns them into seconds at the
stack's streaming bandwidth. And which tensor-parallel collectives PyTorch's async TP cannot
fuse under a stack's casts (`async_tp_unfused`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshtron.model.mla_shapes import mla_projections

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
    if getattr(model, "is_mla", False):  # MLA's projections (model/mla.py), the "qkv" group
        out = [("qkv", f"attention.{name}", int(n), k)
               for name, n, k, _ in mla_projections(model, tp)]
        out += [("out", "attention.wo", h, model.out_width // tp),
                ("up", "feed_forward.w1", f // tp, h)]
    else:
        out = [("qkv", "attention.wq", q // tp, h), ("qkv", "attention.wk", kv // tp, h),
               ("qkv", "attention.wv", kv // tp, h), ("out", "attention.wo", h, q // tp),
               ("up", "feed_forward.w1", f // tp, h)]
    if model.gated_mlp:
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


# ---- what casting costs: HBM bytes per element of each GEMM operand --------------------------
FP8_SCALINGS = ("torchao", "torchao-rowwise", "torchao-tensorwise", "te-delayed", "te-current")
"""How a stack quantises its FP8 GEMM operands (compute.KernelOptions.fp8_scaling):
'torchao' = torchao float8 with the plan's fp8_recipe (meshtron's runtime); 'torchao-rowwise' /
'torchao-tensorwise' = torchao with that recipe whatever the plan says (torchtitan: its
float8 converter's recipe_name, None = tensorwise); 'te-delayed' / 'te-current' = Transformer
Engine's DelayedScaling / Float8CurrentScaling recipes (Megatron-Core's --fp8-recipe
'delayed', its default, or 'tensorwise')."""


@dataclass(frozen=True)
class CastBytes:
    """HBM bytes per element that quantising one GEMM operand moves, by when it happens. A
    Linear casts its input (forward: for `input @ weight.t()`; backward: along the other axis
    for the weight gradient), its output gradient (twice in the backward: for the input and the
    weight gradient) and its weight (forward, and transposed for the input gradient)."""

    input_fwd: float
    input_bwd: float
    grad_bwd: float
    weight_fwd: float
    """Per element of the local FP8 weights, every micro-batch."""
    weight_bwd: float
    weight_step: float = 0.0
    """Per element of the local FP8 weights, once per optimizer step (Transformer Engine
    caches the FP8 weight and its transpose across micro-batches)."""
    wgrad_out: float = 0.0
    """Per element of the weight gradient: a pass over the GEMM's output after it."""
    dgrad_out: float = 0.0
    """Per element of the input gradient: a pass over the GEMM's output after it."""
    normed_fwd: float | None = None
    """Per element of the inputs a norm produces (QKV, MLP-up) when the norm kernel writes them
    quantised instead of in bf16 (Transformer Engine's LayerNormLinear, with_quantized_norm):
    what that costs beyond the bf16 norm already priced; None: `input_fwd`."""
    gathers_fp8: bool = False
    """Sequence-parallel inputs and gradients are quantised on the local shard and gathered in
    FP8, the transposed copy made after the gather (Transformer Engine: "all-gather of
    transposed FP8 tensors is not supported [on Hopper]. The rowwise tensor is gathered
    first, then transposed", docs/features/low_precision_training/fp8_current_scaling)."""
    rescaled_bwd: bool = False
    """The backward GEMMs' outputs are scaled after the GEMM (torchao rowwise without fast
    accumulation: cuBLAS's tensorwise kernel, then `output *= post_inverse_scale`,
    float8_ops.py addmm_float8_unwrapped): a multiply sits between the input-gradient GEMM
    and the reduce-scatter of its result (`async_tp_unfused`)."""
    per_linear: bool = False
    """Each Linear casts its own input (eager: wq/wk/wv and w1/w3 cast the same tensor again);
    False: once per distinct input (a fused QKV / fc1 GEMM, or inductor's CSE of identical
    casts in one compiled graph)."""


# torchao float8 under torch.compile: the bytes torchao's own roofline counts per operand
# (pytorch/ao torchao/testing/training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s,
# with fuse_with_prev: "assume for float8 activations/gradients that torch.compile will fuse
# to the preceding op", benchmarks/float8/float8_roofline.py). rowwise (float8_linear.py:
# input and grad_output cast along dim -1 and again along dim 0, the weight along each dim):
#   activation: [fused read] -> fp8 dim0 (1) + bf16 transposed copy (2); copy (2) -> fp8 (1) = 6
#   weight: bf16 (2) -> fp8 (1); transpose bf16 (2 + 2); bf16 (2) -> fp8 (1) = 10
# the backward GEMMs of rowwise run without fast accumulation, which torchao sends to cuBLAS's
# tensorwise kernel and scales afterwards, `output *= post_inverse_scale` (float8_ops.py
# addmm_float8_unwrapped): the weight gradient's output is an extern GEMM's, read and written
# once more (2 + 2); the input gradient's scale fuses into its consumer under compile.
# tensorwise: max-abs fused into the producer, one cast writing both layouts (2 + 1 + 1) = 4
# per activation; the weight: max-abs (2), a cast per pass (2 + 1 each) = 8.
# What torchao's own rowwise table measures beyond that roofline: its compiled
# LayerNorm -> Linear -> Sigmoid (pytorch/ao torchao/float8/README.md "Rowwise scaling",
# docs/static/fp8-rowwise-perf.png at 6243040, PyTorch 2.8.0a0, H100) runs 0.45-0.63x bf16
# whenever N = 1024, however large M and K, where the roofline gives 1.0-1.15x; the time
# beyond the roofline grows with M x K (the Linear's input) and hardly with N
# (bench/fp8_rowwise_vs_published.py: median 21.6 bytes per input element over the 108 cells
# of M >= 8192, quartiles 15 and 38). Charged to the input's backward (dim-0) cast, the one
# tensorwise does not have: once per distinct input, like the roofline's bytes.
ROWWISE_COMPILED_EXCESS = 22.0
"""Bytes per element of an FP8 Linear's input that torchao's compiled rowwise casts move
beyond torchao's roofline (above): a published measurement, its kernels not identified."""
_TORCHAO_COMPILED = {
    "rowwise": CastBytes(input_fwd=1.0, input_bwd=5.0 + ROWWISE_COMPILED_EXCESS, grad_bwd=6.0,
                         weight_fwd=3.0, weight_bwd=7.0, wgrad_out=4.0, rescaled_bwd=True),
    "tensorwise": CastBytes(input_fwd=4.0, input_bwd=0.0, grad_bwd=4.0, weight_fwd=5.0,
                            weight_bwd=3.0, gathers_fp8=True),
}
# torchao float8 without compile: every step of a cast is its own ATen kernel, which is why
# torchao's speedups assume torch.compile (pytorch/ao#685: an FFN of width 4096 runs slower in
# eager FP8 than in bf16, 2x faster compiled; pytorch/torchtitan#778: float8 with only the
# Linears compiled, the casts not fused into their producers, loses to compiled bf16). The
# kernels of one cast (float8_utils.tensor_to_amax, float8_training_tensor._ToFloat8ConstrFunc,
# to_fp8_saturated): abs (2 + 2), amax (2), upcast to fp32 (2 + 4), scale (4 + 4), clamp
# (4 + 4), cast (4 + 1).
EAGER_CAST_BYTES = 33.0
"""Bytes per element of one eager torchao cast (above)."""
# float8_linear.py re-casts input, weight and grad_output for each GEMM that uses them (two
# casts per operand and recipe); the operands the backward GEMMs take transposed are copied to
# the layout _scaled_mm needs (float8_ops.py preprocess_addmm: 1 + 1 bytes); rowwise scales
# both backward GEMM outputs after them in place (2 + 2 each).
_TORCHAO_EAGER = {
    recipe: CastBytes(input_fwd=EAGER_CAST_BYTES, input_bwd=EAGER_CAST_BYTES + 2.0,
                      grad_bwd=2 * EAGER_CAST_BYTES + 2.0, weight_fwd=EAGER_CAST_BYTES,
                      weight_bwd=EAGER_CAST_BYTES + 2.0, wgrad_out=post, dgrad_out=post,
                      rescaled_bwd=post > 0, per_linear=True)
    for recipe, post in (("rowwise", 4.0), ("tensorwise", 0.0))}
# torchao's tensor parallelism gathers FP8 for tensorwise scaling only
# (float8_tensor_parallel.py: Float8ColwiseParallel casts the input shard before its
# all-gather, "currently assumes tensorwise scaling"; torchtitan applies it to tensorwise)
_TORCHAO_EAGER["tensorwise"] = dataclasses.replace(_TORCHAO_EAGER["tensorwise"],
                                                   gathers_fp8=True)
# Transformer Engine on Hopper (docs/features/low_precision_training/: performance
# considerations, FP8 current / delayed scaling): a fused cast-transpose reads the bf16 tensor
# once and writes the rowwise and the transposed (columnwise) FP8 copies (2 + 1 + 1); current
# scaling first reads the tensor for its amax ("two tensor reads per quantization"), delayed
# scaling takes the scale from the amax history (one read). te.Linear casts the weight only on
# the first micro-batch of a step (is_first_microbatch, which Megatron-Core's forward_step
# sets through model.set_is_first_microbatch()) and reuses the cached FP8 weight after.
# Megatron-Core's QKV and fc1 are TELayerNormColumnParallelLinear: with a delayed scale known
# before the kernel runs, the norm writes its output straight in FP8 (module/layernorm_linear.py,
# with_quantized_norm), rowwise, and the columnwise copy is a transpose of that FP8 tensor
# after the kernel (common/normalization/rmsnorm/rmsnorm_api.cpp and layernorm/ln_api.cpp:
# "Compute FP8 transpose if required", nvte_transpose): 1 + (1 + 1) bytes in place of the 2
# the bf16 norm output costs, 1 beyond it. Current scaling needs the output's amax
# before it can scale: since TE 2.7 (NVIDIA/TransformerEngine#2013, "Fuse amax computation into
# normalization kernel for current scaling"; pytorch/csrc/extensions/normalization.cpp
# Impl::FUSED_NORM_AMAX_FP8) the norm kernel writes its bf16 output and the amax in one pass,
# and `quantize_with_amax` reads it once and writes both FP8 layouts (2 + 1 + 1): the separate
# amax read of the unfused cast is gone for the norm-fed inputs. Megatron-Core's MLP
# activation stays its own bias-SwiGLU kernel (gpt_layer_specs.py use_te_activation_func
# defaults to False), so fc2's input pays the unfused current-scaling cast.
_TE = {
    "te-delayed": CastBytes(input_fwd=4.0, input_bwd=0.0, grad_bwd=4.0, weight_fwd=0.0,
                            weight_bwd=0.0, weight_step=4.0, normed_fwd=1.0, gathers_fp8=True),
    "te-current": CastBytes(input_fwd=6.0, input_bwd=0.0, grad_bwd=6.0, weight_fwd=0.0,
                            weight_bwd=0.0, weight_step=6.0, normed_fwd=4.0, gathers_fp8=True),
}


def cast_bytes(scaling: str = "torchao", recipe: str = "rowwise",
               compiled: bool = False) -> CastBytes:
    """What quantising the FP8 GEMM operands moves under `scaling` (FP8_SCALINGS), the plan's
    torchao `recipe` (FP8_RECIPES, used by 'torchao') and whether inductor compiles the blocks
    (torchao only: Transformer Engine's kernels are fused either way)."""
    if scaling in _TE:
        return _TE[scaling]
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8_scaling={scaling!r}")
    if scaling != "torchao":
        recipe = scaling.split("-", 1)[1]
    return (_TORCHAO_COMPILED if compiled else _TORCHAO_EAGER)[recipe]


def fp8_input_casts(model: Any, tp: int = 1, recipe: str = "rowwise",
                    fp8_filter: str = "torchao") -> dict[str, int]:
    """Per GEMM group, how many of its Linears run in FP8 under `fp8_linear`: how often a stack
    that casts per Linear (CastBytes.per_linear) quantises the group's shared input (Llama's
    separate wq/wk/wv and w1/w3 read the same normed activation)."""
    n = dict.fromkeys(GEMM_GROUPS, 0)
    for group, name, out_f, in_f in block_linears(model, tp):
        if fp8_linear(name, out_f, in_f, recipe, emulate=fp8_filter == "all"):
            n[group] += 1
    return n


def async_tp_unfused(cb: CastBytes | None) -> frozenset[str]:
    """Tensor-parallel collectives (overlap.tp_exposed's 'ag_in', 'ag', 'red') that PyTorch's
    async TP leaves whole under this FP8 casting (None: bf16). Its inductor pass
    (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses an all-gather only into the
    mm / _scaled_mm consuming the gathered tensor (`_find_consumer_matmuls`) and a
    reduce-scatter only into the mm / _scaled_mm producing it (`_find_producer_matmul`). A
    stack that gathers bf16 and casts after (not cb.gathers_fp8: torchao rowwise, whose
    tensor parallelism communicates in high precision, torchtitan docs/float8.md) puts the
    cast between every all-gather and its GEMM, forward ('ag_in') and backward ('ag'); a
    rescaled input gradient (cb.rescaled_bwd) puts the multiply between that GEMM and its
    reduce-scatter ('red'). The forward reduce-scatters stay fused (rowwise's forward GEMM
    scales inside the kernel)."""
    if cb is None:
        return frozenset()
    out = set() if cb.gathers_fp8 else {"ag_in", "ag"}
    if cb.rescaled_bwd:
        out.add("red")
    return frozenset(out)


def fp8_gathers_fp8(scaling: str, recipe: str, param_gather: bool = False,
                    sharding: str = "fsdp", fsdp_gather: bool = False) -> bool:
    """The parameter all-gathers move the FP8 Linears' weights in FP8 (1 byte per element).
    torchao: FSDP2 (`sharding` 'fsdp') with WeightWithDynamicFloat8CastTensor,
    enable_fsdp_float8_all_gather: tensorwise scales only, a rowwise scale being per row of
    the gathered weight; meshtron's runtime turns it on for tensorwise plans on CUDA
    (meshtron/parallel/fp8.py `fp8_all_gather`), torchtitan leaves it off by default (its
    float8 config's enable_fsdp_float8_all_gather = False). Transformer Engine: with FP8
    parameters (`param_gather`, compute.KernelOptions.fp8_param_gather: Megatron-Core's
    --fp8-param-gather), whatever the sharding (distributed optimizer or Megatron-FSDP).
    `fsdp_gather` (KernelOptions.fp8_fsdp_gather): a stack with fixed tensorwise scaling that
    turns torchao's FP8 all-gather on (OLMo-core's Float8Config)."""
    if scaling in _TE:
        return param_gather
    if sharding != "fsdp":
        return False
    if scaling == "torchao-tensorwise":
        return fsdp_gather
    return scaling == "torchao" and recipe == "tensorwise"


def quantisation_bytes(model: Any, tp: int, frac: dict[str, float] | None = None,
                       cb: CastBytes | None = None, casts: dict[str, int] | None = None,
                       sp: bool = False) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token an FP8 layer spends quantising GEMM activations:
    each FP8 group's input (forward, and again for the weight gradient) and its Linears' output
    gradients (backward), at the bytes per element of `cb` (`cast_bytes`:
    torchao's casts, eager or compiled, or Transformer Engine's cast-transpose; default
    torchao rowwise, eager). A stack casting per Linear (cb.per_linear) quantises a group's
    input once per FP8 Linear in it (`casts`, `fp8_input_casts`), else once.
    `frac`: `fp8_fractions` (all FP8 when None); the output gradients in
    proportion. With sequence parallelism a stack that gathers FP8 (cb.gathers_fp8) quantises
    the gathered tensors (the column-parallel inputs forward, the row-parallel output
    gradients backward) on its 1/tp shard, rowwise only, and transposes the gathered FP8 for
    the weight gradient (1 + 1 bytes on the whole tensor)."""
    cb = cb or cast_bytes()
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    up = 2 * f if model.gated_mlp else f
    fr = frac or dict.fromkeys(GEMM_GROUPS, 1.0)
    copies = {g: max(1, (casts or {}).get(g, 1)) if cb.per_linear else 1 for g in GEMM_GROUPS}
    on = {g: copies[g] if fr[g] > 0 else 0 for g in GEMM_GROUPS}
    # elements per token of the cast inputs: qkv in, out-proj in, mlp-up in, mlp-down in (the
    # first and third a norm's output)
    normed = on["qkv"] * h + on["up"] * h
    ins = normed + on["out"] * h / tp + on["down"] * f / tp
    # and of their output gradients
    qkv_out = (h + 2 * kv) / tp
    if getattr(model, "is_mla", False):  # MLA: its latents are the up-projections' inputs
        ins += on["qkv"] * (model.q_lora_rank + model.kv_lora_rank)
        qkv_out = sum(n for _, n, _, _ in mla_projections(model, tp))
    outs = (fr["qkv"] * qkv_out + fr["out"] * h + fr["up"] * up / tp
            + fr["down"] * h)
    norm_b = cb.input_fwd if cb.normed_fwd is None else cb.normed_fwd
    fwd = cb.input_fwd * (ins - normed) + norm_b * normed
    bwd = (cb.input_bwd + cb.dgrad_out) * ins + cb.grad_bwd * outs
    if sp and tp > 1 and cb.gathers_fp8:
        # gathered, then transposed: the columnwise byte moves from the shard's cast to a
        # transpose of the whole gathered tensor (read 1, write 1)
        fwd += ((norm_b - 1.0) / tp + 2.0 - norm_b) * normed
        row_out = fr["out"] * h + fr["down"] * h  # row-parallel outputs' gradients
        bwd += ((cb.grad_bwd - 1.0) / tp + 2.0 - cb.grad_bwd) * row_out
    return fwd, bwd


def fp8_weight_elements(model: Any, tp: int, frac: dict[str, float]) -> float:
    """Elements of one layer's local weights whose GEMMs run in FP8 (`frac` per group)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    up = 2 * f if model.gated_mlp else f
    qkv, out = h * (h + 2 * kv), h * h
    if getattr(model, "is_mla", False):  # (the replicated down-projections: whole on each rank)
        qkv = tp * sum(n * k for _, n, k, _ in mla_projections(model, tp))
        out = h * model.out_width
    return (frac["qkv"] * qkv + frac["out"] * out
            + frac["up"] * h * up + frac["down"] * h * f) / tp
