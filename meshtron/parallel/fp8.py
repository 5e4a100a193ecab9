"""FP8 training with torchao's float8 (`plan.dtype = "fp8"`): the blocks' Linear layers become
`torchao.float8.Float8Linear`, everything else trains as in bf16.

What an FP8 run computes: FSDP2's bf16 MixedPrecisionPolicy (as for `dtype="bf16"`, see
meshtron/parallel/data_parallel.py) with, inside each converted Linear, both GEMM operands
cast to float8 e4m3 with dynamic scales (rowwise: one scale per row of each operand, torchao's
"rowwise" recipe; tensorwise: one per tensor, e5m2 for the output gradient) and the product
accumulated in higher precision. The master weights, gradients and AdamW states stay fp32.

Which Linears (meshtron/planner/fp8.py `fp8_linear`, the rule the planner prices): the blocks'
attention and MLP projections (dense and the MoE's shared experts) whose shape is a multiple of
16 and above torchao's published size thresholds; the output head, the embeddings and the MoE
router stay bf16. With torchao's emulation (CPU: no FP8 GEMM kernels) every aligned block Linear
is converted: emulation exists to check numerics, not speed, and the thresholds would leave a
small test model with nothing converted.

Order (torchtitan's float8 converter): conversion first, on the plain (possibly meta) model,
then tensor parallelism, recomputation and FSDP2. With the tensorwise recipe on CUDA, FSDP2
all-gathers the weights in FP8 (`enable_fsdp_float8_all_gather`) and the scales are computed
for all weights in one pass after each optimizer step (`precompute_float8_dynamic_scale_for_fsdp`);
gloo rejects float8 tensors in collectives, so on CPU the gather stays bf16.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from meshtron.errors import UserError
from meshtron.planner.fp8 import FP8_RECIPES, fp8_linear

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with FP8 tensor cores (Ada 8.9, Hopper 9.0, Blackwell 10.x)."""

QUIET_AT_IMPORT = ("torchao", "torch.utils._pytree")
"""Loggers quieted while torchao.float8 is imported: the CPU wheel logs one warning per CUDA
kernel library it cannot load (expected on a CPU build), and torchao's registration of its
KernelPreference enum as a pytree constant logs torch 2.13's deprecation warning on every rank,
in the middle of the run's console; neither is the user's to act on."""


def _torchao_float8():
    """torchao.float8, imported with QUIET_AT_IMPORT's loggers at ERROR (restored after: only
    this import is quieted, no process-wide setting)."""
    logs = [logging.getLogger(name) for name in QUIET_AT_IMPORT]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
    except ImportError as e:  # pragma: no cover - torchao is a pinned dependency
        raise UserError(f"plan.dtype='fp8': needs torchao ({e})") from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return f8


def fp8_emulated(device: torch.device, gpu=None) -> bool:
    """Whether FP8 runs emulated on `device` (CPU), natively (CUDA >= 8.9), or not at all: raises
    UserError (one line, exit 2) for a CUDA device without FP8 tensor cores or another device.
    `gpu`: the device query API (`get_device_capability`, `get_device_name`; default
    `torch.cuda`), injectable so that the CUDA branch runs on a CPU machine."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        gpu = torch.cuda if gpu is None else gpu
        cap = gpu.get_device_capability(device)
        if tuple(cap) < MIN_CAPABILITY:
            raise UserError(f"dtype='fp8': {gpu.get_device_name(device)} has compute "
                            f"capability {cap[0]}.{cap[1]}; FP8 training needs >= "
                            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper, Blackwell); "
                            "use bf16")
        return False
    raise UserError(f"dtype='fp8': device {device.type!r} has no FP8 support in torchao; "
                    "use cuda (capability >= 8.9) or cpu (emulation)")


def fp8_all_gather(recipe: str, device: torch.device, dp_shard: int) -> bool:
    """FSDP2 gathers the weights in FP8: tensorwise scaling only (a rowwise scale is per row of
    the *gathered* weight, so it cannot be applied to a shard), on CUDA (gloo refuses float8
    tensors), with something to gather."""
    return recipe == "tensorwise" and device.type == "cuda" and dp_shard > 1


def fp8_config(recipe: str, emulate: bool, all_gather: bool = False):
    """torchao's Float8LinearConfig for `recipe`, emulated or not."""
    if recipe not in FP8_RECIPES:
        raise UserError(f"plan.fp8_recipe={recipe!r}: allowed values are "
                        f"{', '.join(FP8_RECIPES)}")
    f8 = _torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def fp8_chooser(recipe: str, emulate: bool):
    """torchao's module filter: an nn.Linear converts exactly when the planner's rule
    (meshtron/planner/fp8.py `fp8_linear`, also behind the planner's FP8 GEMM cost) says so."""
    def choose(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        out_f, in_f = module.weight.shape
        return fp8_linear(fqn, out_f, in_f, recipe, emulate)

    return choose


def convert_to_fp8(model: nn.Module, recipe: str, device: torch.device,
                   all_gather: bool = False) -> list[str]:
    """Swap the chosen Linears of `model`'s blocks (`model.layers`) for Float8Linear, in place
    (parameters are kept: an optimizer or a bf16 copy built before still holds them). Returns
    the converted modules' names (relative to `model`). Call before TP, recompute and FSDP2."""
    emulate = fp8_emulated(device)
    config = fp8_config(recipe, emulate, all_gather)
    f8 = _torchao_float8()
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    choose = fp8_chooser(recipe, emulate)
    done: list[str] = []

    def record(module: nn.Module, fqn: str) -> bool:
        ok = choose(module, fqn)
        if ok:
            done.append(f"layers.{fqn}")
        return ok

    f8.convert_to_float8_training(layers, module_filter_fn=record, config=config)
    return done


def after_optimizer_step(parts: list[nn.Module]) -> None:
    """With FP8 all-gather: every weight's scale in one pass (one all-reduce of amaxes), instead
    of one per weight at its next gather (torchtitan's float8 post-optimizer hook)."""
    f8 = _torchao_float8()
    for part in parts:
        f8.precompute_float8_dynamic_scale_for_fsdp(part)
