"""One evaluated plan's step time by kind of GPU work: what the planner expects a profiler to
see (GEMMs, attention core, memory-bound kernels, FP8 casts, optimizer, the GPU waiting on the
host's launches, exposed communication). Torch-free.

The kinds are the parts `Evaluator.evaluate` adds up, taken apart with the same formulas: the
layers' and edges' `parts` (compute_parts.py PART_KINDS), times the critical stage's micro-batches
and layers, recomputation included; the gradient accumulation passes; the optimizer step; the
exposed collectives and the pipeline bubble as the step's TimeBreakdown has them. They add up
to the step time (`step_categories` checks it). bench/h200_categories.py sets them beside
a torch.profiler window of the same plan on one H200.

Single pipeline stage only (pp = 1): the profile windows this answers are one GPU's, and a
pipelined step's bubble and transfers are not kernels one rank's profiler can split the same way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshtron.planner.compute import PART_KINDS
from meshtron.planner.estimate_results import Estimate

if TYPE_CHECKING:
    from meshtron.planner.estimate import Evaluator

KINDS = PART_KINDS + ("moe", "grad_accumulation", "optimizer", "communication", "bubble",
                      "offload")
"""Every kind `step_categories` reports: compute.PART_KINDS, the MoE layers' work beyond their
dense equivalent, the gradient accumulation passes, the optimizer step, exposed tensor / data /
expert / pipeline communication, the pipeline bubble and host-link offload copies."""


def step_categories(ev: Evaluator, est: Estimate) -> dict[str, float]:
    """Seconds per optimizer step of `est` (evaluated by `ev`) by kind (KINDS); they add up to
    est.time.total. Raises ValueError for a pipelined plan (module docstring)."""
    cfg = est.config
    if cfg.pp != 1:
        raise ValueError(f"pp={cfg.pp}: step categories are priced for one pipeline stage only")
    key = (cfg.tp, cfg.micro_batch, cfg.sp, cfg.recompute, cfg.cp, cfg.dtype, cfg.ep,
           cfg.fp8_recipe)
    micro = ev._micro(*key, cfg.etp)  # also caches the layer's LayerCost under ("layer", ...)
    lc = ev._cache[("layer",) + key]
    emb, head = micro[4], ev.head_for(cfg, micro[5])
    m, layers = est.num_microbatches, est.stage_layers[0]
    out = dict.fromkeys(KINDS, 0.0)
    per_layer = lc.parts_per_microbatch(cfg.recompute, ev.opts.attention)
    extra = (_selective_extra(ev, lc, cfg.recompute), ev.fine_recompute(lc, cfg.recompute))
    for kind, s in (item for d in extra for item in d.items()):
        per_layer[kind] = per_layer.get(kind, 0.0) + s
    moe_c = ev._moe(cfg.micro_batch, cfg.recompute, cfg.cp, cfg.dtype, cfg.ep, cfg.tp,
                    (lc.fwd, lc.bwd), cfg.etp)[0]
    per_layer["moe"] = per_layer.get("moe", 0.0) + moe_c
    for kind, s in per_layer.items():
        out[kind] += m * layers * s
    for kind, s in emb.parts + head.parts:
        out[kind] += m * s
    t = est.time
    flags = ev.dp_flags(cfg)
    out["grad_accumulation"] = ev.accumulation_s(cfg, layers, 0, m, flags)
    out["fp8_cast"] += layers * ev._fp8_step(cfg.tp, cfg.dtype, cfg.fp8_recipe)
    out["optimizer"] = t.optimizer
    out["communication"] = t.tp_comm + t.dp_comm + t.ep_comm + t.pp_comm + t.fp8_sync
    out["bubble"], out["offload"] = t.bubble, t.offload
    out["host_wait"] += t.step_host  # the idle GPU waits on the step's host work
    total = sum(out.values())
    if not math.isclose(total, t.total, rel_tol=1e-9, abs_tol=1e-12):
        raise AssertionError(f"step categories add up to {total!r} s, the step is {t.total!r} s")
    return out


def _selective_extra(ev: Evaluator, lc, recompute: str) -> dict[str, float]:
    """What a flash layer's selective recomputation repeats beyond `parts_per_microbatch`, as
    `Evaluator._micro` prices it: the framework's saved-tensor policy decides (memory.py)."""
    if recompute != "selective" or ev.opts.attention != "flash":
        return {}
    fwd = {kind: f for kind, f, _ in lc.parts}
    saved = ev.mem.saved
    if saved == "eager":  # everything but the matmuls runs again
        return {k: s for k, s in fwd.items() if k != "gemm"}
    if saved == "alternate-matmul":  # every other matmul too, not the attention kernel
        extra = {k: s for k, s in fwd.items() if k not in ("gemm", "attention")}
        extra["gemm"] = 0.5 * fwd.get("gemm", 0.0)
        return extra
    if saved == "korthikanti":  # Megatron-Core's checkpointed core: its forward again
        return {"attention": lc.core_fwd}
    return {}


__all__ = ["KINDS", "step_categories"]
