"""What torchao's FP8 all-gather under FSDP2 moves out of the Linears and into the gathers.
Torch-free.

With `enable_fsdp_float8_all_gather` (torchao Float8LinearConfig; OLMo-core's Float8Config
default, meshtron's runtime for tensorwise plans on CUDA: planner/fp8.py `fp8_gathers_fp8`)
each FP8 Linear's weight is a WeightWithDynamicFloat8CastTensor, and the cast to FP8 happens
in FSDP2's pre-all-gather hook on the rank's shard, not in the Linear (pytorch/ao v0.6.1,
torchao/float8/fsdp_utils.py `fsdp_pre_all_gather`, the precomputed-scale branch that
`precompute_float8_dynamic_scale_for_fsdp` selects: `hp_tensor_and_scale_to_float8` of
`self._tensor`, the sharded high-precision parameter). So:

* in the Linear (float8_linear.py v0.6.1 `cast_weight_to_float8_t`: "if isinstance(weight,
  Float8Tensor): return weight.t()", and `get_weight_scale` returns None for an FP8 weight)
  the forward casts nothing and computes no max-abs; the input-gradient GEMM
  (`manual_float8_matmul_with_args_in_float8.backward`: grad_output @ weight_fp8_t.t())
  takes the gathered FP8 weight in its row-major layout, which `_scaled_mm` cannot take as
  its second operand: float8_ops.py `preprocess_addmm` copies it column-major
  (`b_data.t().contiguous().t()`): 1 + 1 bytes per weight element, each micro-batch;
* in the pre-all-gather hook, on the shard, once per all-gather (FSDP2's hooks run outside
  the compiled blocks: torch._dynamo.config.skip_fsdp_hooks), `_ToFloat8ConstrFunc.forward`
  runs eagerly: `tensor.to(torch.float32) * scale` (an upcast where the shard is not fp32,
  then the multiply: read 4, write 4), `to_fp8_saturated` (float8_utils.py: clamp, read 4
  write 4; `.to(float8_dtype)`, read 4 write 1).

The same on pytorch/ao main of 2026-08 (36027d82d: fsdp_utils.py `fsdp_pre_all_gather`,
float8_linear.py `tensor_already_casted_to_fp8(weight_hp_t)`), the torchao 0.18 meshtron's
runtime installs (meshtron/parallel/fp8.py precomputes the scales too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.planner.fp8 import CastBytes, fp8_gathers_fp8

FP8_WEIGHT_TRANSPOSE_BYTES = 2.0
"""Bytes per element of the column-major copy of a gathered FP8 weight for the input-gradient
GEMM (float8_ops.py `preprocess_addmm`, above): read 1, write 1."""
SCALE_CLAMP_CAST_BYTES = 8.0 + 8.0 + 5.0
"""Bytes per shard element of the eager FP8 cast in the pre-all-gather hook from an fp32
tensor (above): multiply by the scale (4 + 4), clamp (4 + 4), cast (4 + 1)."""


def torchao_gathers_fp8(opts: Any, recipe: str) -> bool:
    """The plan's FP8 Linears get their weights from torchao's FP8 all-gather (FSDP2 with
    enable_fsdp_float8_all_gather): torchao scaling and `fp8_gathers_fp8` (Transformer
    Engine's FP8 parameters are another mechanism, not this one)."""
    return opts.fp8_scaling.startswith("torchao") and fp8_gathers_fp8(
        opts.fp8_scaling, recipe, opts.fp8_param_gather, opts.sharding, opts.fp8_fsdp_gather)


def gathered_weight_casts(cb: CastBytes) -> CastBytes:
    """`cb` with the weight's per-micro-batch bytes of a Linear whose weight arrives in FP8
    (module doc): nothing in the forward, the column-major copy in the backward."""
    return dataclasses.replace(cb, weight_fwd=0.0, weight_bwd=FP8_WEIGHT_TRANSPOSE_BYTES)


def pre_gather_cast_bytes(shard_bytes: float) -> float:
    """Bytes per shard element of torchao's eager cast before each FP8 all-gather (module doc),
    from a shard of `shard_bytes` per element (an upcast to fp32 first where it is not)."""
    upcast = 0.0 if shard_bytes >= 4.0 else shard_bytes + 4.0
    return upcast + SCALE_CLAMP_CAST_BYTES
