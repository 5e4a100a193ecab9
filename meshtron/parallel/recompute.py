"""Activation checkpointing (recomputation), applied per transformer block from outside.

Modes, with the planner's meaning:

- "none": keep every activation.
- "full": keep only each block's input; the whole block is recomputed in backward
  (Chen et al. 2016; Megatron "full" recompute).
- "half": "full" on every second block (the 2nd, 4th, ... as torchtitan's layer-frequency
  selective AC, selective_ac_option = "2", counts them), the others keep everything.
- "selective": Korthikanti et al. 2022, section 4: recompute the attention core - QK^T,
  softmax, dropout and the product with V, whose activations grow with seq^2 and cost few FLOPs -
  and keep the outputs of every linear layer. Implemented as a non-reentrant checkpoint around
  each block with an op-level policy (`torch.utils.checkpoint.create_selective_checkpoint_contexts`):
  outputs of matrix multiplies and of collectives are saved (MUST_SAVE); everything else is
  recomputed in backward: the attention core (the SDPA kernel) and the cheap element-wise ops
  (norms, RoPE, SiLU/GELU products). So the recompute FLOPs are the paper's (attention core; the
  element-wise ops are negligible) and the memory kept is at most the paper's selective figure
  (element-wise outputs are recomputed rather than kept). Saving every op except the attention
  core is not safe with SAC: ops that are later mutated in place (RMSNorm's `add_` on its mean)
  would be replayed from a mutated cache. Collectives are saved, so recomputation under TP/SP
  issues no extra communication.

Applied after tensor parallelism and before FSDP2 (the torchtitan order). Blocks are wrapped
with `checkpoint_wrapper`, which keeps the ModuleDict key; its `_checkpoint_wrapped_module.`
prefix is stripped from state-dict keys by the wrapper's own hooks (and by DCP).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshtron.errors import UserError


SAVED_OPS = (
    # Linear layers; MoE experts: one grouped GEMM per matrix on CUDA (model/moe.py), per-expert
    # `mm` on the CPU, FP8 variants of both.
    ("aten", ("mm", "addmm", "_scaled_mm", "linear", "_grouped_mm", "grouped_mm",
              "_scaled_grouped_mm")),
    ("_c10d_functional", ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                          "all_to_all_single")),
)
"""(op namespace, names) whose outputs selective recompute keeps; names this torch lacks are
skipped (the grouped GEMMs are private and version-dependent)."""


def _saved_ops(ops_root=None) -> set:
    """Ops whose outputs selective recompute keeps: matrix multiplies of the linear layers and
    experts, and the collectives (so recomputation does no communication). `ops_root`:
    `torch.ops` (injectable: tests give one without the grouped GEMM)."""
    root = torch.ops if ops_root is None else ops_root
    ops = set()
    for ns, names in SAVED_OPS:
        space = getattr(root, ns)
        for name in names:
            try:
                ops.add(getattr(space, name).default)
            except (AttributeError, RuntimeError):
                pass
    return ops


def _selective_policy(saved_ops, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in saved_ops:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_selective_policy, _saved_ops()))


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Wrap each block of `model.layers` for recomputation ('none' | 'selective' | 'half' |
    'full'; 'half' wraps every second block)."""
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    if mode in ("full", "half"):
        wrap = partial(checkpoint_wrapper, preserve_rng_state=True)
    elif mode == "selective":
        wrap = partial(checkpoint_wrapper, context_fn=_selective_context, preserve_rng_state=True)
    else:
        raise UserError(f"plan.recompute={mode!r}: allowed values are none, selective, half, "
                        "full")
    for i, (key, block) in enumerate(list(model.layers.items())):
        if mode != "half" or i % 2 == 1:
            model.layers[key] = wrap(block)
    return model
