"""What torch's split backward recomputes: zero bubble's W under activation checkpointing.

torch 2.13's zero-bubble stages (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) run a
non-first stage's backward in two passes (pipelining/_backward.py): B, `stage_backward_input`,
one `autograd.grad` to the stage input that keeps the graph (retain_graph=True); then W,
`stage_backward_weight`, one `autograd.grad` per parameter group (`get_param_groups`: the
parameters reached from one intermediate node, i.e. one per parameterized op of a block:
a Linear's weight and bias share theirs). A non-reentrant checkpoint (`checkpoint_wrapper`,
what `recompute = "full"` / `"half"` wraps a block in) recomputes the block's forward once per
graph task that unpacks its saved tensors (torch/utils/checkpoint.py: the recomputed tensors
are kept per graph task id, and each `autograd.grad` is a new task): once in B, and once more
in every W group's task. Measured on CPU (meshtron's 'tiny' blocks, fp32, FlopCounterMode
around B and W of a middle stage, torch 2.13.0): 9 groups per block (two norms, q, k, v, o, w1,
w3, w2); without recomputation F : B : W = 1 : 1 : 1; with "full" 1 : 1.76 : 7.81 (B runs one
recompute, W nine; each stops early at the block's last saved tensor, so one costs 0.76 of
the forward there); with "half" 1 : 1.38 : 4.41. The first stage's W is a whole backward
(stage.py `backward_weight_one_chunk`, stage 0), one recomputation, as without zero bubble.

Selective recomputation (a checkpoint with an op policy) does not run at all under the split
backward: torch refuses the second backward through the cached region ("Trying to backward an
extra time. You are only allowed to backward once on any region computed under selective
activation checkpoint", measured on the same blocks); plan_rules_runtime.py refuses the plan.

The planner prices each W group's recomputation as B's (the whole block's forward: the same
approximation as `compute.LayerCost.per_microbatch` makes for B; the early stop saves the
work after the block's last saved tensor, w2's GEMM and the residual add here).
"""

from __future__ import annotations

SPLIT_BACKWARD_SCHEDULES = ("zb",)
"""meshtron's schedules that run torch's split backward (parallel/pipeline.py build_schedule:
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)."""


def weight_groups(model) -> int:
    """Parameter groups of one dense block under torch's `get_param_groups`: one per
    parameterized op (a norm, a Linear; weight and bias of one op are one group): the two
    norms, q/k/v/o, the MLP's two or three matrices, and q/k norms where the model has them.
    (A mixture-of-experts block's router and expert matrices are counted as a dense MLP's.)"""
    norms = 2 + (2 if model.qk_norm else 0)
    mlp = 3 if model.mlp == "swiglu" else 2
    return norms + 4 + mlp


def weight_recompute_share(recompute: str) -> float:
    """Blocks recomputed per block: 1 with 'full', 0.5 with 'half' (every second block), 0
    otherwise."""
    return {"full": 1.0, "half": 0.5}.get(recompute, 0.0)


def weight_pass_recompute(model, recompute: str, schedule: str, pp: int, framework: str,
                          fwd: float) -> float:
    """Seconds W adds per layer and micro-batch on a non-first stage under torch's zero
    bubble with checkpointed blocks: one recomputed forward (`fwd`, the layer's forward
    seconds, or its tensor-parallel part) per parameter group (module docstring); 0 for
    other schedules, frameworks (FSDP2 under torch.distributed.pipelining only) and
    recompute modes."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES or pp <= 1 or framework != "fsdp2":
        return 0.0
    return weight_groups(model) * weight_recompute_share(recompute) * fwd
