"""One evaluated plan broken into per-operation costs for the step-level simulator
(meshtron/simulate): `StepPieces` and `step_pieces`. Its per-unit FSDP parts come from the
Evaluator's own `_dp_time`. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtron.planner import comm
from meshtron.planner.dp_cost import _exposed
from meshtron.planner.estimate_results import Estimate

if TYPE_CHECKING:
    from meshtron.planner.estimate import Evaluator


@dataclass(frozen=True)
class StepPieces:
    """One plan's costs per operation, for the step-level simulator (meshtron/simulate): the
    numbers `Evaluator.evaluate` adds up, before it adds them up."""

    fwd: list[float]
    """Forward of one micro-batch per virtual stage (pipeline order), tp comm included."""
    bwd: list[float]
    """Backward of one micro-batch per virtual stage (input + weight gradients, recomputation
    and tp comm included)."""
    wgrad: list[float]
    """Weight-gradient part of `bwd` (zero-bubble schedules defer it)."""
    hop_s: float
    """One pipeline transfer between neighbouring stages."""
    hop_crosses_nodes: bool
    """The transfer leaves the node (shares the NIC with data-parallel traffic)."""
    reduce_s: list[float]
    """Per device stage: one gradient reduction over the data-parallel group (raw collective
    time; 0 where `fold_s` carries the data-parallel cost)."""
    reduce_every_microbatch: bool
    """Gradients are reduced after every micro-batch (FSDP-style), not once per step."""
    fold_s: list[float]
    """Per device stage: exposed ZeRO-3 / FSDP per-unit communication per micro-batch (the
    planner's per-unit overlap model), added to each micro-batch's work."""
    tail_s: list[float]
    """Per device stage: exposed communication after the optimizer (ZeRO-1 parameter
    all-gather or owners' broadcast)."""
    optimizer_s: list[float]
    """Per device stage: optimizer step, and the gradient accumulation passes of its
    micro-batches (`Evaluator.accumulation_s`)."""
    interference: float
    """Fraction of hidden data-parallel communication charged to compute (the dp group's
    NCCL CTAs over the GPU's SMs: `Evaluator.dp_interference`)."""


def step_pieces(ev: Evaluator, est: Estimate) -> StepPieces:
    """Break an evaluated plan into per-operation costs, with the same formulas and layer split
    as `ev.evaluate` (stage times, pipeline hop, data-parallel collectives, optimizer)."""
    cfg, n = est.config, est.stage_layers
    tp, pp, v, zero = cfg.tp, cfg.pp, cfg.virtual_stages, cfg.zero
    m = est.num_microbatches
    c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather = ev._micro(tp, cfg.micro_batch, cfg.sp,
                                                                    cfg.recompute, cfg.cp,
                                                                    cfg.dtype, cfg.ep,
                                                                    cfg.fp8_recipe)
    head = ev.head_for(cfg, head)
    t_layer = c_l + tpc_l
    nv = len(n)
    fwd = [k * f_l for k in n]
    tot = [k * t_layer for k in n]
    wg = [k * w_l for k in n]
    fwd[0] += emb.fwd
    tot[0] += emb.compute + emb.tp
    fwd[-1] += head.fwd
    tot[-1] += head.compute + head.tp
    wg[-1] += head.wgrad
    groups = ev._groups(cfg)
    hop = 0.0
    if pp > 1:
        hop = comm.send(p2p_bytes, groups["pp_hop_crosses_nodes"], ev.fab) + gather
    device_layers = [sum(n[j] for j in range(i, nv, pp)) for i in range(pp)]
    p_layer, p_emb, p_head, _ = ev._params(tp, pp)
    flags = ev.dp_flags(cfg)
    gsize = flags["gsize"]
    fsdp = ev.opts.sharding == "fsdp"
    shard_dp = cfg.dp * cfg.cp
    # per-unit ZeRO-3 / FSDP ZeRO-2 collectives are folded into every micro-batch's work (the
    # evaluator's per-unit overlap model); accumulated ones (reduce_once / gather_once) too,
    # spread over the micro-batches
    per_unit = zero == 3 or (zero == 2 and fsdp)
    reduce_s, fold, tail, opt = [], [], [], []
    for i, k in enumerate(device_layers):
        params = k * p_layer + (p_emb if i == 0 else 0.0) + (p_head if i == pp - 1 else 0.0)
        local = params / shard_dp if zero >= 1 else params
        # the micro-batches' gradient accumulation passes ride with the step's optimizer work
        # (and Transformer Engine's once-per-step FP8 weight casts, as `evaluate` adds them)
        opt.append(ev.opt_bytes * local / ev.hbm + ev.accumulation_s(cfg, k, i, m, flags)
                   + k * ev._fp8_step(tp, cfg.dtype, cfg.fp8_recipe))
        red = tl = fo = 0.0
        if shard_dp > 1 and per_unit:
            stage_f = sum(fwd[j] for j in range(i, nv, pp))
            stage_t = sum(tot[j] for j in range(i, nv, pp))
            fo = ev._dp_time(params, zero, groups, m, stage_f, stage_t - stage_f, k,
                             cfg.recompute == "full" and ev.opts.recompute_regathers,
                             units=ev.fsdp_units(k, i == 0, i == pp - 1),
                             kept=p_head if i == pp - 1 else 0.0, **flags) / m
        elif shard_dp > 1:
            # the evaluator's own collectives; the simulator overlaps the reduction itself, the
            # parameter all-gather hides behind the next forward as in the evaluator
            red, gather = ev.once_per_step(params, zero, groups, gsize, flags["wsize"],
                                           ev.fsdp_units(k, i == 0, i == pp - 1) if fsdp
                                           else 1)
            stage_f = sum(fwd[j] for j in range(i, nv, pp))
            tl = _exposed(gather, stage_f, ev.dp_interference(groups)) if gather else 0.0
        reduce_s.append(red)
        fold.append(fo)
        tail.append(tl)
    # ZeRO-0/1/2 with raw reductions reduce once per step, in every framework
    every = False
    return StepPieces(fwd=fwd, bwd=[t - f for t, f in zip(tot, fwd)], wgrad=wg, hop_s=hop,
                      hop_crosses_nodes=bool(pp > 1 and groups["pp_hop_crosses_nodes"]),
                      reduce_s=reduce_s, reduce_every_microbatch=every, fold_s=fold,
                      tail_s=tail, optimizer_s=opt,
                      interference=ev.dp_interference(groups))
