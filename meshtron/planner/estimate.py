"""Evaluate one fully specified plan: memory of the fullest GPU, step time and its breakdown.

Step time (per optimizer step, on the critical pipeline stage c):

    step = m * (compute_c + tp_comm_c) + bubble + pp_comm + dp_exposed + optimizer

* compute, tp_comm: per micro-batch times of the stage's layers and its embedding / LM head
  (compute.py), with recomputation (full: forward again incl. its tensor-parallel collectives;
  selective: the attention core again).
* bubble: pipeline.py (schedule dependent).
* pp_comm: every micro-batch crosses every (virtual) stage boundary forward and backward, and
  the fill adds the chain of the first micro-batch through the p*v virtual stages:
  (m*v + p*v - 1) * 2 * (alpha + bytes/bw) (pipeline.p2p_time); Megatron-Core's
  overlap_p2p_comm (interleaved schedule) hides the steady-state transfers behind the chunks'
  compute, leaving the fill and drain chains. Megatron sends the
  [micro_batch*s, h] activation split over the tensor group ("scatter/gather", Narayanan et al.
  2021, section 4.1; already split with sequence parallelism), re-gathered over NVLink
  (DeepSpeed's engine splits too; before v0.5.4 not the gradients: p2p_grads_whole);
  KernelOptions(p2p_scatter_gather=False) sends the whole activation from every tensor rank
  and p2p_blocking=True pays a stage's receive and its send per direction (DeepSpeed's
  pipeline engine: blocking transfers in each stage's instruction stream; without
  interleaving the walk of its TrainSchedule, pipeline.train_schedule_hops). Megatron and
  DeepSpeed add the tied word embedding's gradient all-reduce between the end stages
  (pipeline.tied_embedding_reduce).
* dp_exposed: gradient synchronisation over the data-parallel group (comm.py) overlapped with
  backward work (bucketed all-reduce as in PyTorch DDP, Li et al. 2020; Megatron's
  overlap_grad_reduce): ZeRO-0 all-reduces once per step, during the last micro-batch's backward;
  stage i finishes its backward i stage-backwards before stage 0, which hides more. FSDP2 under
  torch.distributed.pipelining (meshtron, torchtitan) reduces only after each stage's last
  backward instead (pipeline.reduce_after_drain): exposed on pipeline rank 0. ZeRO-1
  reduce-scatters instead and all-gathers updated bf16 weights, hidden behind the next step's
  first forward. ZeRO-2 must reduce-scatter after every micro-batch (gradients are not kept
  whole). That is DeepSpeed's and Megatron's way (KernelOptions.sharding='zero'); meshtron's
  runtime (sharding='fsdp', the default) reduces ZeRO-0/1 once per step too, one collective per
  FSDP unit (embedding, every block, [norm, head]: `fsdp_units`), runs ZeRO-1 as a distributed
  optimizer (reduce-scatter, all-gather in the compute dtype before the next forward) and
  ZeRO-2 with the parameters gathered once per step and a reduce-scatter per micro-batch
  (parallel/data_parallel.py): the list planner/collectives.py `step_collectives` counts.
  ZeRO-3 / FSDP is costed per wrapped unit (`_zero3_per_microbatch`): one all-gather
  before each unit's forward, one before its backward (two when recomputation re-gathers), one
  reduce-scatter after it, each an NCCL collective with its own latency over the shard group
  (then an all-reduce over the replica group under HSDP); prefetching hides a unit's collective
  behind the previous unit's compute only (Rajbhandari et al. 2020, section 7; FSDP, Zhao et al.
  2023, section 3.3), so per unit max(0, comm - compute) stays exposed, plus the first
  all-gather and the last reduce-scatter. Runtimes that reduce every parameter separately
  (DeepSpeed 0.3.x) pay more reduce-scatters than gathers (`reduce_units_per_layer`); those that
  pass lists of per-rank chunks to torch.distributed (DeepSpeed 0.3.x on PyTorch <= 1.10) also
  pay the host's walk over every rank of every call (`LIST_HOST_S_PER_RANK`), which grows with
  the group like NCCL's ring latency does.
* ep_comm: expert-parallel all-to-alls of the critical stage's MoE layers (moe_cost.py;
  exposed unless the framework overlaps them). The MoE layers' grouped GEMMs, imbalance and
  permutation copies are in compute; their dispatch buffers in activations.
* optimizer: AdamW is memory bound; fused (torch.optim.AdamW(fused=True), apex / Transformer
  Engine FusedAdam: KernelOptions.optimizer 'fused') it reads and writes fp32 master and two
  moments, reads the gradient and writes bf16 weights: 28 bytes (30 with an fp32 gradient
  buffer); foreach / for-loop AdamW ('foreach', 'for-loop') makes a pass per arithmetic step,
  86 bytes; both at 80% of HBM bandwidth. A Python loop over parameters ('for-loop': Composer's
  DecoupledAdamW) also launches every pass per tensor and reads a step counter per tensor:
  launch-bound on a small shard (optimizer_loop.py). Clipping by the global norm
  (KernelOptions.grad_clip, every preset's default) reads the gradients once more and scales
  them in place (`Evaluator.optimizer_bytes`). What the optimizer runs is the framework's
  choice, not the kernel stack's: compiling the blocks leaves it alone.
* gradient accumulation (in compute): unless the weight-gradient GEMM accumulates in place
  (Megatron's gradient accumulation fusion), every micro-batch's gradients are added to the
  accumulated ones by a memory-bound pass of their own (`Evaluator.accumulation_s`; into a
  wider dtype PyTorch's add is unvectorised: compute.CAST_ADD_BYTES_PER_SM).

Throughput figures: tokens/s = global_batch * seq / step; model TFLOP/s per GPU counts
ModelSpec.flops_per_token (no recomputation; MFU = that / peak, PaLM's definition, Chowdhery et
al. 2022); hardware TFLOP/s (HFU) adds recomputed FLOPs and, under token drop, the experts'
padded rows less the dropped ones (moe_capacity.py).

The cost model's cached pieces are in estimate_pieces.py, the per-stage helpers in
estimate_stage.py, the data-parallel costs in dp_cost.py, the results in estimate_results.py;
the states, the stages' memory model and the layer split in estimate_memory.py, the interleaved
and zero-bubble memory walks in estimate_walks.py, `half` on odd stages in estimate_half.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner import (comm, compression, compute, memory, pipeline, pipeline_dualpipe,
                              pipeline_split, zb_recompute)
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.dp_cost import (  # noqa: F401  (re-exported)
    LIST_HOST_S_PER_RANK, OVERLAP_INTERFERENCE, DataParallelCost, _exposed)
from meshtron.planner.estimate_pieces import (  # noqa: F401  (re-exported)
    CostPieces, MemoryPieces, MicroCosts, StageParams)
from meshtron.planner.estimate_results import Estimate, SplitChoice, TimeBreakdown  # noqa: F401
from meshtron.planner.estimate_gpipe import GPipeMoments
from meshtron.planner.estimate_half import HalfRecompute
from meshtron.planner.estimate_memory import StageMemories
from meshtron.planner.estimate_moments import LastRankMoments
from meshtron.planner.estimate_stage import StageCosts
from meshtron.planner.estimate_time import StepTimes
from meshtron.planner.estimate_walks import MemoryWalks
from meshtron.planner.estimate_work import Work
from meshtron.planner.plan import Plan

OPTIMIZER_BYTES_PER_PARAM = 28.0
"""Fused AdamW update traffic per local parameter (see module docstring)."""
EAGER_OPTIMIZER_BYTES_PER_PARAM = 86.0
"""torch.optim.AdamW without fusion (for-loop or foreach: multi-tensor launches, same bytes):
weight decay (4+4), first moment lerp (4+4+4), second moment scale and addcmul (4+4, 4+4+4),
sqrt, bias-correction divide and eps add (3 x (4+4)), addcdiv (4+4+4+4), then the bf16 copy
of the fp32 master (4+2): 86 bytes per parameter."""

class Evaluator(StepTimes, StageCosts, CostPieces, DataParallelCost, LastRankMoments,
                HalfRecompute, GPipeMoments, StageMemories, MemoryWalks):
    """Cost model bound to one model, cluster and batch; evaluates Plans (cached pieces)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 opts: KernelOptions | None = None,
                 mem: memory.MemoryOptions | None = None) -> None:
        self.model, self.cluster = model, cluster
        self.traffic_knobs: dict[str, Any] = {}
        """Data-parallel traffic knobs (gradient compression, DiLoCo: Plan.comm_knobs) every
        evaluated config takes (search.py sets them): the search then ranks the layouts with
        their residuals' memory and their traffic, not only its top k after it."""
        # what a token computes (a mixture of experts: its active experts); memory and the
        # data-parallel traffic count every parameter (self.model)
        self.active = compute.active_equivalent(model)
        self.global_batch, self.seq = global_batch, seq_len
        self.opts = opts or KernelOptions()
        # the framework decides the bytes (memory.py; default: meshtron's runtime), the plan's
        # dtype the precision
        self.mem = mem or memory.options_for(self.opts)
        self.fab = comm.Fabric.of(cluster)
        self.capacity = cluster.memory_bytes
        self.ws_fixed = memory.workspace_fixed(self.capacity)
        # Tensors must fit in what the allowance leaves: (tensors)(1 + frag) + fixed <= capacity.
        self.tensor_budget = (self.capacity - self.ws_fixed) / (1.0 + self.mem.fragmentation)
        tokens = global_batch * seq_len
        self.tokens = tokens
        self.model_flops = compute.model_flops_per_step(model, tokens, seq_len)
        # HFU's: the attention square as the kernel executes it (compute_flops.py)
        self.executed_flops = compute.hardware_flops_per_step(model, tokens, seq_len,
                                                              self.opts.attention)
        self.n_gpus = cluster.num_gpus
        self.hbm = cluster.hbm_bytes_per_s * compute.HBM_EFFICIENCY
        # fp32 gradient accumulation buffer (Megatron's main_grad) or bf16 gradients
        self.grad_bytes = 4.0 if self.opts.fp32_grad_reduce else memory.GRAD_BYTES
        # AdamW traffic per local parameter: 24 bytes of fp32 master + moments read and written,
        # bf16 weight written (2), gradient read (2 or 4)
        if self.opts.optimizer != "fused":  # foreach and for-loop: the same passes
            self.opt_bytes = EAGER_OPTIMIZER_BYTES_PER_PARAM
            if self.mem.param_dtype == "bf16":
                # a bf16 model (MemoryOptions.param_dtype): the same passes over bf16
                # parameters, gradients and moments, and no master-to-bf16 copy (4 + 2)
                self.opt_bytes = (EAGER_OPTIMIZER_BYTES_PER_PARAM - 6.0) / 2.0
        else:
            self.opt_bytes = OPTIMIZER_BYTES_PER_PARAM - memory.GRAD_BYTES + self.grad_bytes
        self._cache: dict[Any, Any] = {}
        self.evaluated = 0

    # ---- the cost model --------------------------------------------------------------------
    def evaluate(self, cfg: Plan, keep_infeasible: bool = True,
                 exact_memory: bool = True, cutoff: float = float("inf"),
                 stage: int | None = None) -> Estimate | None:
        """Estimate a config. Infeasible ones come back with fits == False and the memory they
        need under the most memory-balanced layer split (`exact_memory`; otherwise under the
        time-balanced split), or as None when `keep_infeasible` is False. Feasible ones slower
        than `cutoff` seconds per step come back as None (the search has no use for them).
        `stage`: the memory breakdown of that pipeline stage instead of the fullest
        (`meshtron rehearse --rank`). Steps: micro-batch inputs, states, the stages' memory
        model, the layer split, the step time (estimate_time.py), the interleaved schedule's
        walk, the result."""
        self.evaluated += 1
        if self.traffic_knobs:
            try:
                cfg = cfg.replace(**self.traffic_knobs)
            except UserError:  # a config they cannot act on (dp=1, DiLoCo's ZeRO rules)
                return None
        if pipeline_dualpipe.is_dualpipe(cfg):  # priced as the V it is per rank
            est = self.evaluate(pipeline_dualpipe.fold(cfg), keep_infeasible, exact_memory,
                                cutoff, stage)
            m = self.global_batch // (cfg.dp * cfg.micro_batch)
            return None if est is None else pipeline_dualpipe.unfold(est, cfg, m)
        w = self._inputs(cfg)
        if not keep_infeasible:  # nothing above it is returned: walks may be skipped
            w.cutoff = cutoff
        self._states(w)
        self._memory_model(w)
        if not self._split(w, keep_infeasible, exact_memory):
            return None
        times = self._times(w)
        step = times.total
        if step > cutoff and not keep_infeasible:
            # too slow whatever the walk below finds (the step time does not depend on it):
            # fitting, over the cutoff; not fitting, of no use
            return None
        if not self._interleaved_memory(w, keep_infeasible):
            return None
        if w.fits and step > cutoff:
            return None
        return self._result(w, times, step, stage, keep_infeasible)

    def _inputs(self, cfg: Plan) -> Work:
        """The plan's per micro-batch costs and memory pieces (estimate_pieces.py), its
        data-parallel flags, the gradients it accumulates and its edge stages' extra time."""
        tp, pp, dp, zero, mb, rec = cfg.tp, cfg.pp, cfg.dp, cfg.zero, cfg.micro_batch, cfg.recompute
        v = cfg.virtual_stages
        m = self.global_batch // (dp * mb)
        cp = cfg.cp
        ep = cfg.ep
        c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather = self._micro(tp, mb, cfg.sp, rec,
                                                                          cp, cfg.dtype, ep,
                                                                          cfg.fp8_recipe,
                                                                          cfg.etp)
        head = self.head_for(cfg, head)
        window = self._cache[("window", tp, mb, cfg.sp, rec, cp, cfg.dtype, ep, cfg.fp8_recipe)]
        ep_l = self._moe(mb, rec, cp, cfg.dtype, ep, tp, window, cfg.etp)[2]
        mem_opts, act, work, logits = self._memory_pieces(tp, mb, cfg.sp, rec, cfg.dtype, cp,
                                                          ep, pp, cfg.fp8_recipe, cfg.etp)
        flags = self.dp_flags(cfg)
        # torch's zero bubble runs W as one autograd pass per parameter group, and a
        # checkpointed block recomputes its forward in each (zb_recompute.py)
        lc = self._cache[("layer", tp, mb, cfg.sp, rec, cp, cfg.dtype, ep, cfg.fp8_recipe)]
        w_rec = [zb_recompute.weight_pass_recompute(self.model, rec, cfg.schedule, pp,
                                                    mem_opts.framework, t)
                 for t in (lc.fwd, lc.tp_fwd)]
        c_l, tpc_l, w_l = c_l + w_rec[0], tpc_l + w_rec[1], w_l + sum(w_rec)
        # ZeRO shards span dp_shard x cp ranks: FSDP2 shards over the mesh's ("dp_shard", "cp")
        # axes and replicates over "dp_replicate" (HSDP; parallel/data_parallel.py gives
        # fully_shard a 2-D mesh, torch/distributed/fsdp/_fully_shard/_fsdp_param.py shards
        # dim 0 over the shard axis only); dp_replicate is 1 below ZeRO-2
        shard_dp = dp // cfg.dp_replicate * cp
        # FSDP1's SHARD_GRAD_OP (flat_param) holds every unit gathered from its forward to its
        # backward too, though it gathers again each micro-batch (dp_flags)
        keep = (flags["gather_once"] or (zero == 2 and self.opts.flat_param)) \
            and mem_opts.framework == "fsdp2"
        fsdp_zero1 = zero == 1 and not compression.changes_dp(cfg)
        # unsharded gradients accumulated over the micro-batches (FSDP2 keeps them in the
        # reduce dtype): ZeRO-2/3 reduced once per step, and meshtron's ZeRO-1 (FSDP2 over dp,
        # gradient sync on the last micro-batch only: data_parallel.accumulation_policy)
        accum = flags["gsize"] if mem_opts.framework == "fsdp2" and (
            flags["reduce_once"] or (fsdp_zero1 and (m > 1 or pp > 1))) else 0.0
        if mem_opts.grads_at_first_backward and zero <= 1 and (m > 1 or pp > 1):
            # a ZeRO framework's gradient buffer made block by block at its first backward
            # (MemoryOptions.grads_at_first_backward): walked as FSDP2's, in its own bytes
            accum = self.grad_bytes
        t_layer = c_l + tpc_l
        e_first = emb.compute + emb.tp
        e_last = head.compute + head.tp
        head_rank = pipeline.head_rank(pp, v, cfg.schedule)
        if head_rank == 0:  # no pipeline, or torch's V: the head beside the embedding
            e_first, e_last = e_first + e_last, 0.0
        return Work(cfg=cfg, tp=tp, pp=pp, dp=dp, zero=zero, mb=mb, rec=rec, v=v, m=m, cp=cp,
                    ep=ep, c_l=c_l, tpc_l=tpc_l, f_l=f_l, w_l=w_l, emb=emb, head=head,
                    p2p_bytes=p2p_bytes, gather=gather, ep_l=ep_l, mem_opts=mem_opts, act=act,
                    work=work, logits=logits, flags=flags, shard_dp=shard_dp, keep=keep,
                    fsdp_zero1=fsdp_zero1, accum=accum, t_layer=t_layer, e_first=e_first,
                    e_last=e_last, head_rank=head_rank,
                    replay=self.half_replay(cfg, (c_l, tpc_l, w_l, ep_l)),
                    runs=cfg.pipeline_runs if pp > 1 else 1)

    def _result(self, w: Work, times: TimeBreakdown, step: float, stage: int | None,
                keep_infeasible: bool) -> Estimate | None:
        """The Estimate: the memory breakdown of the fullest stage (or `stage`), host memory
        under offload, throughput and FLOP/s."""
        cfg, pp, v, n, fits, mem_opts = w.cfg, w.pp, w.v, w.n, w.fits, w.mem_opts
        # ---- memory breakdown of the fullest stage -------------------------------------------
        totals = [k * a + f for k, a, f in zip(n, w.per_layer, w.fixed)]
        worst = max(range(pp), key=totals.__getitem__) if stage is None else stage
        b_layer, b_exp, b_act, b_work = w.blocks[worst]
        mem = memory.breakdown(mem_opts, w.zero, w.shard_dp, w.states, n[worst], b_layer,
                               w.roots[worst], w.largest, b_act, w.inflight[worst], b_work,
                               w.logits if worst == w.head_rank else 0.0, self.capacity, worst,
                               self.grad_bytes, w.keep, w.accum,
                               0.0 if w.loose else b_exp, w.e_states,
                               w.root_units[worst], w.reduce_bytes,
                               w.grad_extra if worst == 0 else 0.0, w.outputs[worst],
                               self._te_cache(w, worst), w.extra_accum,
                               w.moments[worst] if w.moments else None,
                               *self._loose(w, b_exp), fixed=self._ep_buffers(w.ep),
                               buffers=w.buffers)
        if self.cluster.cpu:
            mem = dataclasses.replace(mem, device=self.cluster.device_word)
        if cfg.offload != "none" or cfg.offload_activations:
            mem = self._with_host(mem, cfg, w.host_gpu)
            fits = fits and mem.host_fits
            if not fits and not keep_infeasible:
                return None
        hw_flops = self.executed_flops + (self._recompute_flops(w.rec)
                                       + self._capacity_flops(w.cfg)) * self.tokens
        peak = self.cluster.peak_flops
        per_gpu = step * self.n_gpus
        stage_layers = (list(cfg.stage_layers) if w.given else
                        n if v == 1 else pipeline_split.chunks(self.mem.split_rule, n, v,
                                                               cfg.schedule))
        return Estimate(
            config=cfg, stage_layers=list(stage_layers), num_microbatches=w.m, memory=mem,
            time=times, tokens_per_s=self.tokens / step,
            model_tflops_per_gpu=self.model_flops / per_gpu / 1e12,
            hardware_tflops_per_gpu=hw_flops / per_gpu / 1e12,
            mfu=self.model_flops / per_gpu / peak, hfu=hw_flops / per_gpu / peak, fits=fits,
            split=self._split_choice(w) if pp > 1 else None)

    def _split_choice(self, w: Work) -> SplitChoice:
        """How `_split` chose the layers per rank (the plan's explanation)."""
        return SplitChoice(w.split_by, self.mem.split_rule, self.model.layers, w.t_layer,
                           w.e_first, w.e_last, w.split_free, w.split_caps, w.split_over,
                           w.head_rank == 0)
