"""One evaluated plan broken into per-operation costs for the step-level simulator
(meshtron/simulate): `StepPieces` and `step_pieces`. Every data-parallel cost is the
Evaluator's own choice (`Evaluator.stage_dp`, which the planner's step time calls too;
pipeline.reduce_after_drain for FSDP2 under torch.distributed.pipelining), the parameters per
rank and the tied embedding's all-reduce its `block_params` and `tied_embedding_s`: the
simulator places the planner's pieces on its event graph and prices nothing itself.
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtron.planner import comm, composer_metrics, fp8_amax, moe_memory, offload, pipeline
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
    fold_s: list[float]
    """Per device stage: exposed ZeRO-3 / FSDP per-unit communication per micro-batch (the
    planner's per-unit overlap model), added to each micro-batch's work."""
    drain_s: list[float]
    """Per device stage: FSDP2's gradient reductions under torch.distributed.pipelining (raw
    collective seconds, all the device's chunks), issued after each chunk's last backward with
    the compute stream waiting for them (pipeline.reduce_after_drain): an equal share per chunk
    stalls the device there. 0 where the reduction is inside `dp_s`."""
    dp_s: list[float]
    """Per device stage: the rest of its exposed data-parallel time (the planner's `_dp_time`
    less what `fold_s` and `drain_s` place), one synchronous event after its last backward."""
    tied_s: float
    """The tied word embedding's gradient all-reduce between the first and the last stage
    after the backward (pipeline.tied_embedding_reduce; 0 without tied embeddings or pp)."""
    optimizer_s: list[float]
    """Per device stage: optimizer step (on the host with offload, its copies included:
    offload.offload_cost), and the gradient accumulation passes of its micro-batches
    (`Evaluator.accumulation_s`), the step's end host work (TimeBreakdown.step_host) and the
    FP8 amax all-reduces of delayed scaling (TimeBreakdown.fp8_sync)."""


def step_pieces(ev: Evaluator, est: Estimate) -> StepPieces:
    """Break an evaluated plan into per-operation costs, with the same formulas and layer split
    as `ev.evaluate` (stage times, pipeline hop, data-parallel collectives, optimizer)."""
    cfg, n = est.config, est.stage_layers
    tp, pp, zero = cfg.tp, cfg.pp, cfg.zero
    m = est.num_microbatches
    c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather = ev._micro(tp, cfg.micro_batch, cfg.sp,
                                                                    cfg.recompute, cfg.cp,
                                                                    cfg.dtype, cfg.ep,
                                                                    cfg.fp8_recipe, cfg.etp)
    head = ev.head_for(cfg, head)
    t_layer = c_l + tpc_l
    fwd = [k * f_l for k in n]
    # `half` on an odd part (a stage, or a chunk): half a replayed block less, as `evaluate`
    rep = ev.half_replay(cfg, (c_l, tpc_l, w_l))
    x = [ev.part_excess(cfg.recompute, (k,)) for k in n]
    tot = [k * t_layer + e * (rep[0] + rep[1]) for k, e in zip(n, x)]
    wg = [k * w_l + e * rep[2] for k, e in zip(n, x)]
    fwd[0] += emb.fwd
    tot[0] += emb.compute + emb.tp
    fwd[-1] += head.fwd
    tot[-1] += head.compute + head.tp
    wg[-1] += head.wgrad
    groups = ev._groups(cfg)
    hop = 0.0
    if pp > 1:
        hop = comm.send(p2p_bytes, groups["pp_hop_crosses_nodes"], ev.fab) + gather
    # the stages each rank holds (torch's V: r and 2p-1-r) and the head's rank (rank 0 there)
    held = [pipeline.stages_of_rank(pp, cfg.virtual_stages, cfg.schedule, i) for i in range(pp)]
    last = pipeline.head_rank(pp, cfg.virtual_stages, cfg.schedule)
    device_layers = [sum(n[j] for j in held[i]) for i in range(pp)]
    p_layer, p_emb, p_head, _, p_exp = ev.block_params(tp, pp, cfg.ep, ev.mem.framework,
                                                       cfg.etp)
    # as `evaluate` adds it to pp_comm
    tied = ev.tied_embedding_s(tp, groups["pp_hop_crosses_nodes"]) if pp > 1 else 0.0
    flags = ev.dp_flags(cfg)
    fold, drain_s, dp_s, opt = [], [], [], []
    # Composer's train-metric sync at the step's end, every rank (`evaluate`'s step_host)
    host_s = composer_metrics.sync_s(ev.opts.train_metrics, cfg.gpus, ev.cluster)
    for i, k in enumerate(device_layers):
        params = k * p_layer + (p_emb if i == 0 else 0.0) + (p_head if i == last else 0.0)
        # ZeRO's shard group: HSDP replicates over dp_replicate (`evaluate`'s shard_dp)
        shard = cfg.dp // cfg.dp_replicate * cfg.cp
        local = params / shard if zero >= 1 else params
        if k * p_exp:  # experts' states over the ranks holding the same experts
            local += (k * p_exp / moe_memory.expert_dp(cfg, shard) if zero >= 1
                      else k * p_exp)
        # the micro-batches' gradient accumulation passes ride with the step's optimizer work
        # (and Transformer Engine's once-per-step FP8 weight casts, as `evaluate` adds them)
        step = ev.optimizer_step_s(local, k, i == 0, i == last,
                                   shard if zero >= 1 else 1, tp)
        if cfg.offload != "none":  # the host's step and the host-link copies, as `evaluate`
            oc = offload.offload_cost(cfg.offload, local, zero, m, flags["reduce_once"],
                                      ev.cluster.host_link_bytes_per_s,
                                      ev.cluster.host_memory_bytes_per_s)
            step = oc.host_step_s + oc.transfer_s
        # Transformer Engine's delayed-scaling amax all-reduces of the rank's blocks, as
        # `evaluate`'s fp8_sync (fp8_amax.py; blocking, laid at the step's end like host_s)
        fp8_sync = fp8_amax.delayed_amax_step_s(ev.opts, cfg.dtype, m, cfg.virtual_stages, k,
                                                ev.model, cfg.ep, groups["amax"], ev.fab)
        opt.append(step + ev.accumulation_s(cfg, k, i, m, flags)
                   + k * ev._fp8_step(tp, cfg.dtype, cfg.fp8_recipe) + host_s + fp8_sync)
        stage_f = sum(fwd[j] for j in held[i])
        stage_b = sum(tot[j] for j in held[i]) - stage_f
        kept = p_head if i == last else 0.0  # FSDP's [norm, head]: not re-gathered
        fo, dr, rest = _stage_dp(ev, cfg, i, k, (params, k * p_exp, kept), m, stage_f, stage_b,
                                 flags, groups)
        fold.append(fo)
        drain_s.append(dr)
        dp_s.append(rest)
    return StepPieces(fwd=fwd, bwd=[t - f for t, f in zip(tot, fwd)], wgrad=wg, hop_s=hop,
                      hop_crosses_nodes=bool(pp > 1 and groups["pp_hop_crosses_nodes"]),
                      fold_s=fold, drain_s=drain_s, dp_s=dp_s, tied_s=tied, optimizer_s=opt)


def _stage_dp(ev: Evaluator, cfg, i: int, k: int, held: tuple[float, float, float], m: int,
              stage_f: float, stage_b: float, flags: dict,
              groups: dict) -> tuple[float, float, float]:
    """(per micro-batch fold, drained reduction, rest) of pipeline rank i's exposed
    data-parallel time: the planner's own (`ev.stage_dp`), split by where the simulator
    places it. `held`: the rank's (parameters, expert parameters, parameters of its last unit
    kept gathered)."""
    dp = ev.stage_dp(cfg, i, k, held, m, stage_f, stage_b, flags, groups)
    if dp.path != "dense":
        return 0.0, 0.0, dp.total
    if ev.per_unit_each_microbatch(cfg.zero, flags["reduce_once"], flags["gather_once"]):
        return dp.total / m, 0.0, 0.0  # spread over the micro-batches' work
    if dp.drain is None or (cfg.zero >= 2 and not flags["reduce_once"]):
        return 0.0, 0.0, dp.total
    # FSDP2 under pipelining: the raw reductions stall the device after each chunk's last
    # backward (the event graph then exposes what reduce_after_drain says); the rest (the
    # gathers, the interference of the hidden part) after the last backward
    units = ev.fsdp_units(k, i == 0, i == cfg.pp - 1)
    raw = ev.once_per_step(held[0], min(cfg.zero, 2), groups, flags["gsize"], flags["wsize"],
                           units)[0]
    return 0.0, raw, dp.total - pipeline.reduce_after_drain(raw, *dp.drain, 0.0)
