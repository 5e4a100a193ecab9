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
al. 2022); hardware TFLOP/s adds recomputed FLOPs (HFU).

The cost model's cached pieces are in estimate_pieces.py, the per-stage helpers in
estimate_stage.py, the data-parallel costs in dp_cost.py, the results in estimate_results.py.
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner import (comm, compression, compute, memory, memory_pipeline, memory_zb,
                              moe_memory, mtp, offload, pipeline, pipeline_dualpipe,
                              pipeline_split, zb_recompute)
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.dp_cost import (  # noqa: F401  (re-exported)
    LIST_HOST_S_PER_RANK, OVERLAP_INTERFERENCE, DataParallelCost, _exposed)
from meshtron.planner.estimate_pieces import (  # noqa: F401  (re-exported)
    CostPieces, MemoryPieces, MicroCosts, StageParams)
from meshtron.planner.estimate_results import Estimate, TimeBreakdown  # noqa: F401
from meshtron.planner.estimate_stage import StageCosts, given_partition
from meshtron.planner.estimate_time import StepTimes
from meshtron.planner.estimate_work import Work
from meshtron.planner.plan import Plan
from meshtron.planner.plan_rules_pipeline import split_problem

OPTIMIZER_BYTES_PER_PARAM = 28.0
"""Fused AdamW update traffic per local parameter (see module docstring)."""
EAGER_OPTIMIZER_BYTES_PER_PARAM = 86.0
"""torch.optim.AdamW without fusion (for-loop or foreach: multi-tensor launches, same bytes):
weight decay (4+4), first moment lerp (4+4+4), second moment scale and addcmul (4+4, 4+4+4),
sqrt, bias-correction divide and eps add (3 x (4+4)), addcdiv (4+4+4+4), then the bf16 copy
of the fp32 master (4+2): 86 bytes per parameter."""

class Evaluator(StepTimes, StageCosts, CostPieces, DataParallelCost):
    """Cost model bound to one model, cluster and batch; evaluates Plans (cached pieces)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 opts: KernelOptions | None = None,
                 mem: memory.MemoryOptions | None = None) -> None:
        self.model, self.cluster = model, cluster
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
        self.n_gpus = cluster.num_gpus
        self.hbm = cluster.hbm_bytes_per_s * compute.HBM_EFFICIENCY
        # fp32 gradient accumulation buffer (Megatron's main_grad) or bf16 gradients
        self.grad_bytes = 4.0 if self.opts.fp32_grad_reduce else memory.GRAD_BYTES
        # AdamW traffic per local parameter: 24 bytes of fp32 master + moments read and written,
        # bf16 weight written (2), gradient read (2 or 4)
        if self.opts.optimizer != "fused":  # foreach and for-loop: the same passes
            self.opt_bytes = EAGER_OPTIMIZER_BYTES_PER_PARAM
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
                                                                          cfg.fp8_recipe)
        head = self.head_for(cfg, head)
        window = self._cache[("window", tp, mb, cfg.sp, rec, cp, cfg.dtype, ep, cfg.fp8_recipe)]
        ep_l = self._moe(mb, rec, cp, cfg.dtype, ep, tp, window)[2]
        mem_opts, act, work, logits = self._memory_pieces(tp, mb, cfg.sp, rec, cfg.dtype, cp,
                                                          ep, pp, cfg.fp8_recipe)
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
        keep = flags["gather_once"] and mem_opts.framework == "fsdp2"
        fsdp_zero1 = zero == 1 and not compression.changes_dp(cfg)
        # unsharded gradients accumulated over the micro-batches (FSDP2 keeps them in the
        # reduce dtype): ZeRO-2/3 reduced once per step, and meshtron's ZeRO-1 (FSDP2 over dp,
        # gradient sync on the last micro-batch only: data_parallel.accumulation_policy)
        accum = flags["gsize"] if mem_opts.framework == "fsdp2" and (
            flags["reduce_once"] or (fsdp_zero1 and (m > 1 or pp > 1))) else 0.0
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
                    e_last=e_last, head_rank=head_rank)

    def _states(self, w: Work) -> None:
        """Parameters per tensor rank (w.p_layer, p_emb, p_head, largest, p_exp) and the bytes
        per parameter of their states kept on the device and moved to the host, dense
        (w.states, moved) and routed experts' (w.e_states, e_moved)."""
        cfg, mem_opts = w.cfg, w.mem_opts
        tp, pp, ep, zero, shard_dp = w.tp, w.pp, w.ep, w.zero, w.shard_dp
        fsdp_zero1, accum = w.fsdp_zero1, w.accum
        p_layer, p_emb, p_head, largest, p_exp = self.block_params(tp, pp, ep,
                                                                   mem_opts.framework)
        full_states = compression.with_state_bytes(
            cfg, memory.state_bytes(zero, shard_dp, self.grad_bytes, mem_opts, fsdp_zero1))
        if fsdp_zero1 and accum:
            # the sharded gradients of meshtron's ZeRO-1 appear unit by unit as the last
            # micro-batch's accumulated ones are reduced and freed (`accum` holds them)
            full_states = (full_states[0], 0.0, full_states[2])
        states = offload.device_states(cfg.offload, full_states,  # what stays on the device
                                       mem_opts.host_offload)
        moved = sum(full_states) - sum(states)  # bytes per parameter on the host
        # expert parallelism: a rank holds E/ep experts per block, their ZeRO states spread
        # over the dp*cp/ep ranks holding the same experts (moe_cost.py)
        e_states, e_moved = None, 0.0
        if ep > 1:
            e_full = memory.state_bytes(zero, max(1, shard_dp // ep), self.grad_bytes, mem_opts)
            if fsdp_zero1 and accum:  # as the dense states above: `accum` holds them
                e_full = (e_full[0], 0.0, e_full[2])
            e_states = offload.device_states(cfg.offload, e_full, mem_opts.host_offload)
            e_moved = sum(e_full) - sum(e_states)
        w.p_layer, w.p_emb, w.p_head, w.largest, w.p_exp = p_layer, p_emb, p_head, largest, p_exp
        w.states, w.moved, w.e_states, w.e_moved = states, moved, e_states, e_moved

    def _memory_model(self, w: Work) -> None:
        """What every pipeline stage holds beside its blocks: micro-batches in flight, root
        parameters, held chunk outputs, the blocks' pieces (w.blocks); then the stages' memory
        per layer and fixed (w.per_layer, w.fixed)."""
        cfg, model, mem_opts = w.cfg, self.model, w.mem_opts
        tp, pp, v, m, ep, cp, mb = w.tp, w.pp, w.v, w.m, w.ep, w.cp, w.mb
        p_emb, p_head = w.p_emb, w.p_head
        # memory of stage i = n_i * per_layer[i] + fixed[i] (memory.stage_memory)
        inflight = self._in_flight(cfg.schedule, pp, v, m)
        if (mem_opts.framework == "megatron" and cfg.schedule == "interleaved" and v > 1
                and ep > 1 and self.opts.ep_overlap):
            # Megatron-Core's A2A overlap adds a warm-up forward (memory_pipeline.py)
            inflight = memory_pipeline.a2a_overlap_in_flight(inflight, v, m)
            w.extra_warm = 1
        roots = [0.0] * pp
        roots[0] += p_emb
        roots[w.head_rank] += p_head + mtp.params(model.mtp_depth, w.p_layer + w.p_exp,
                                                  model.hidden, tp)
        # FSDP2 units outside the blocks: the embedding and [norm, head], wrapped apart
        root_units = [0.0] * pp
        root_units[0] = p_emb
        root_units[w.head_rank] = max(root_units[w.head_rank], p_head)
        w.grad_extra = memory.embedding_grad_extra(model, tp)  # the first stage's embedding
        w.extra_accum = memory.embedding_accum_bytes(mem_opts, cfg.zero, w.accum,
                                                     w.flags["gsize"], m, pp, w.shard_dp)
        # a block's backward runs beside the previous block's reduce-scatter input, except
        # under pipelining (reduced after the last backward: memory.previous_gradient_bytes)
        w.reduce_bytes = w.flags["gsize"] if pp == 1 else 0.0
        # the chunk outputs torch's pipelining keeps until their backward (memory_pipeline.py;
        # Megatron-LM frees their data once sent, deallocate_pipeline_outputs)
        out_bytes = memory_pipeline.stage_output_bytes(model.hidden, tp, cfg.sp, mb,
                                                       self.seq // cp, mem_opts.compute_bytes)
        outputs = [k * out_bytes if mem_opts.framework == "fsdp2" else 0.0
                   for k in memory_pipeline.held_outputs(pp, v, inflight)]
        if mem_opts.engine.startswith("deepspeed"):  # DeepSpeed's engine's own buffers
            outputs = [k * out_bytes for k in memory_pipeline.deepspeed_pipe_buffers(pp, m)]
        if self._torch_zb(w):  # torch's split backward keeps a micro-batch to its W
            per_stage = (model.layers / (pp * v),) * (pp * v)  # the split comes later
            inflight, outputs = self._zb_held(w, per_stage, out_bytes)
        w.recv = [0.0] * pp
        if mem_opts.framework == "fsdp2" and not mem_opts.engine.startswith("deepspeed"):
            # torch's stages keep a receive buffer per micro-batch (memory_pipeline.py)
            counted = [0.0 if self._torch_zb(w) else g for g in
                       memory_pipeline.held_outputs(pp, v, [0.0] * pp)]
            w.recv = [k * out_bytes for k in memory_pipeline.receive_buffers(
                pp, v, m, cfg.schedule, inflight, mem_opts.fused_norm, counted)]
            outputs = [o + r for o, r in zip(outputs, w.recv)]
        outputs = mtp.with_activations(outputs, w.head_rank, model.mtp_depth, w.act)
        w.inflight, w.roots, w.root_units, w.out_bytes, w.outputs = (inflight, roots, root_units,
                                                                     out_bytes, outputs)
        # per pipeline rank: (block parameters, experts, activations, recompute working set)
        # of its mean block; every block a MoE block's until the layer split is known
        w.blocks = [(w.p_layer, w.p_exp, w.act, w.work)] * pp
        # Transformer Engine's cached FP8 weights (memory_acts.te_weight_cache_bytes): the
        # block's GEMM weights, not its norms or router
        w.cache_b = memory.te_weight_cache_bytes(self.opts, mem_opts)
        w.not_gemm = 2 * model.norm_params + (model.hidden * model.moe_experts
                                              if model.is_moe else 0)
        w.per_layer, w.fixed = self._stage_memories(w, inflight)

    def _te_cache(self, w: Work, i: int) -> float:
        """Bytes of Transformer Engine's cached FP8 weights on pipeline rank `i`."""
        return w.cache_b * max(0.0, w.blocks[i][0] + w.blocks[i][1] - w.not_gemm)

    def _stage_memories(self, w: Work, inflight: list[float],
                        ranks: list[int] | None = None) -> tuple[list[float], list[float]]:
        """(bytes per layer, fixed bytes) of every pipeline stage (memory.stage_memory);
        `ranks`: only those recomputed, the others kept from w.per_layer / w.fixed (a walk
        that changed some ranks' in-flight count or held outputs leaves the rest as they were)."""
        pp, blocks = w.pp, w.blocks
        per_layer = list(w.per_layer) if ranks is not None else [0.0] * pp
        fixed = list(w.fixed) if ranks is not None else [0.0] * pp
        # memory.stage_memory's terms, what every rank shares read once (the search asks
        # this for every rank of every plan it evaluates)
        terms = memory.stage_terms
        head, mem_opts, zero, dp, states, largest = (w.head_rank, w.mem_opts, w.zero,
                                                     w.shard_dp, w.states, w.largest)
        grad_bytes, keep, accum, e_states = self.grad_bytes, w.keep, w.accum, w.e_states
        roots, root_units, outputs, reduce_bytes = (w.roots, w.root_units, w.outputs,
                                                    w.reduce_bytes)
        cache_b, not_gemm = w.cache_b, w.not_gemm  # `_te_cache`, written out
        for i in range(pp) if ranks is None else ranks:
            b = blocks[i]
            per_layer[i], fixed[i] = terms(
                mem_opts, zero, dp, states, b[0], roots[i], largest, b[2], inflight[i], b[3],
                w.logits if i == head else 0.0, grad_bytes, keep, accum, b[1], e_states,
                root_units[i], reduce_bytes, w.grad_extra if i == 0 else 0.0, outputs[i],
                cache_b * max(0.0, b[0] + b[1] - not_gemm), w.extra_accum)
        return per_layer, fixed

    def _split(self, w: Work, keep_infeasible: bool, exact_memory: bool) -> bool:
        """The layers per pipeline rank (w.n: the plan's own, else the stack's time-balanced
        split within memory, else the split that would run out of memory) and whether it fits
        (w.fits); False when it does not and `keep_infeasible` is False."""
        cfg, model = w.cfg, self.model
        pp, v, per_layer, fixed = w.pp, w.v, w.per_layer, w.fixed
        t_layer, e_first, e_last = w.t_layer, w.e_first, w.e_last
        budget = self.tensor_budget
        # under an interleaved schedule the walk decides what fits (_interleaved_memory), and it
        # can hold less than the even spread: a split the spread rejects is rejected here only
        # when a lower bound of the walk does not fit either (`_walk_may_fit`)
        walked = cfg.schedule == "interleaved" and v > 1
        keep = keep_infeasible or walked
        given = given_partition(cfg, model.layers)
        if given is None and pp > 1:  # the search never asks; a direct caller is told
            problem = split_problem(self.mem.split_rule, model.layers, pp, v)
            if problem:
                raise UserError(problem)
        weights = (w.p_emb, w.p_layer + w.p_exp, w.p_head)  # DeepSpeed's 'parameters' partition
        n = given or self._time_partition(pp, v, t_layer, e_first, e_last, None, weights)
        fits = n is not None and all(
            k * a + f <= budget for k, a, f in zip(n, per_layer, fixed))
        if not fits and given is None:
            caps = [int((budget - f) // a) if budget > f else 0 for a, f in zip(per_layer, fixed)]
            if sum(caps) >= model.layers:
                n = self._time_partition(pp, v, t_layer, e_first, e_last, caps, weights)
            else:
                n = None
            fits = n is not None
            if n is None:
                if not keep:
                    return False
                stack = self._time_partition(pp, v, t_layer, e_first, e_last, None, weights)
                if self.mem.split_rule != "any" and stack is not None:
                    n = stack  # the stack's own split is what would run out of memory
                elif exact_memory:
                    _, n = pipeline.min_memory_partition(model.layers, per_layer, fixed, v)
                else:
                    n = stack or pipeline.min_memory_partition(model.layers, per_layer, fixed,
                                                               v)[1]
        w.budget, w.given, w.n, w.fits = budget, given, n, fits
        if model.is_moe and pp > 1 and n is not None:
            # the stages' own blocks: dense first blocks hold no experts (moe_memory.py)
            chunks = list(cfg.stage_layers) if given else (
                list(n) if v == 1 else pipeline_split.chunks(self.mem.split_rule, n, v,
                                                               cfg.schedule))
            moe_act, moe_work = self._moe_memory(w.tp, w.mb, cfg.sp, w.rec, self.seq // w.cp,
                                                 w.mem_opts, w.ep, cfg.dtype)
            w.blocks = moe_memory.stage_pieces(model, cfg, chunks,
                                               (w.p_layer, w.p_exp, w.act, w.work), moe_act,
                                               moe_work, w.mem_opts.framework)
            w.per_layer, w.fixed = per_layer, fixed = self._stage_memories(w, w.inflight)
            w.fits = fits and all(k * a + f <= budget for k, a, f in zip(n, per_layer, fixed))
            if not w.fits and not keep:
                return False
        if walked and not w.fits and not keep_infeasible and not self._walk_may_fit(w):
            return False
        return True

    def _chunks(self, w: Work) -> list[int]:
        """Layers of the p v virtual stages of the split `w.n` (the plan's own when given)."""
        return list(w.cfg.stage_layers) if w.given else \
            pipeline_split.chunks(self.mem.split_rule, w.n, w.v)

    def _walk_may_fit(self, w: Work) -> bool:
        """Whether the interleaved walk could find `w.n` fitting: every rank's memory with a
        lower bound of the walk's in-flight multiplier (memory_pipeline.held_lower_bound) and
        no chunk outputs torch's pipelining holds (the walk counts them at its peak, >= 0)
        fits. Stage memory is linear in both (memory.stage_memory: act x in_flight per layer,
        the outputs in the fixed part), so the bound is the stages' memory less those terms'
        shortfall, and a rank over budget here is over it after the walk."""
        low = self._in_flight_lower_bound(w.pp, w.v, w.m, self._chunks(w), w.act,
                                          w.accum * (w.p_layer + w.p_exp), w.extra_warm)
        fsdp2 = w.mem_opts.framework == "fsdp2"
        for r, (k, a, f) in enumerate(zip(w.n, w.per_layer, w.fixed)):
            a_low = a + w.blocks[r][2] * (low[r] - w.inflight[r])
            f_low = f - (w.outputs[r] if fsdp2 and r < w.pp - 1 else 0.0)
            if k * a_low + f_low > w.budget:
                return False
        return True

    def _torch_zb(self, w: Work) -> bool:
        """Whether the plan runs torch's zero-bubble schedules (meshtron, torchtitan: FSDP2
        under torch.distributed.pipelining), whose split backward memory_zb.py walks."""
        return (w.cfg.schedule == "zb" and w.pp > 1 and w.mem_opts.framework == "fsdp2")

    def _zb_held(self, w: Work, per_stage: tuple, out_bytes: float) -> tuple[list, list]:
        """(in flight, held output bytes) per pipeline rank under torch's zero bubble
        (memory_zb.in_flight) for layers `per_stage` per virtual stage."""
        tokens = w.mb * self.seq // w.cp
        cb, fused = w.mem_opts.compute_bytes, w.mem_opts.fused_norm
        grad = memory_zb.captured_grad_bytes(self.model, w.tp, w.cfg.sp, tokens, cb, fused)
        head = memory_zb.head_grad_bytes(self.model, w.tp, tokens, cb, fused, kept_output=True)
        # W's gradients wait for the next B where FSDP2 upcasts them into its accumulator
        pending = cb * (w.p_layer + w.p_exp) if w.accum not in (0.0, cb) else 0.0
        work = memory_zb.input_backward_bytes(self.model, w.tp, w.cfg.sp, tokens, cb, fused)
        every = {"full": 1, "half": 2}.get(w.cfg.recompute, 0)
        kept = (memory_zb.weight_recompute_kept_bytes(self.model, w.tp, w.cfg.sp, tokens, cb,
                                                       fused) if every else 0.0)
        return memory_zb.in_flight(w.pp, w.v, w.m, tuple(per_stage), w.act, grad, out_bytes,
                                   head, w.logits, pending, work, kept, max(every, 1))

    def _interleaved_memory(self, w: Work, keep_infeasible: bool) -> bool:
        """Under an interleaved schedule, the stages' memory at the walked peak
        (memory_pipeline.py) instead of the even spread; False when that does not fit and
        `keep_infeasible` is False."""
        cfg, pp, v, m, n = w.cfg, w.pp, w.v, w.m, w.n
        if self._torch_zb(w) and n is not None:
            return self._zb_memory(w, keep_infeasible)
        if cfg.schedule == "dualpipe" and pp > 1 and n is not None:
            return self._dualpipe_memory(w, keep_infeasible)
        if not (cfg.schedule == "interleaved" and v > 1 and n is not None):
            return True
        inflight, outputs, act, out_bytes = w.inflight, w.outputs, w.act, w.out_bytes
        # the rank's first chunks hold more micro-batches than its last: weighted by their
        # own layer counts (memory_pipeline.py; uneven under the time-balanced split and
        # Megatron-Core's account_for_embedding/loss), at the moment they are largest beside
        # the gradients FSDP2 has accumulated so far (Megatron's buffer is in the states)
        chunks = self._chunks(w)
        grad = w.accum * (w.p_layer + w.p_exp)
        odd = self._half_odd(w)
        weighted = self._weighted_in_flight(pp, v, m, chunks, inflight, act, grad,
                                            w.extra_warm, odd)
        # the chunk outputs torch's pipelining holds at that moment, not at the even spread's
        # most (the last rank's peak is its loss, whose moment the walk does not single out:
        # as spread); Megatron frees them once sent (deallocate_output_tensor): none
        walked = [out_bytes * self._peak_outputs(
            pp, v, m, r, [chunks[c * pp + r] for c in range(v)], act, grad, out_bytes, odd)
            + w.recv[r] if r < pp - 1 and w.mem_opts.framework == "fsdp2" else outputs[r]
            for r in range(pp)]
        if weighted != inflight or walked != outputs:
            changed = [r for r in range(pp)
                       if weighted[r] != inflight[r] or walked[r] != outputs[r]]
            w.inflight, outputs[:] = weighted, walked
            w.per_layer, w.fixed = per_layer, fixed = self._stage_memories(w, w.inflight,
                                                                           changed)
            # the walk can also lower a rank's memory (a light first chunk): the split's
            # memory is what it holds now
            w.fits = all(k * a + f <= w.budget for k, a, f in zip(n, per_layer, fixed))
        # the walk's figure is the fit decision, the search's as the pinned answer's
        return w.fits or keep_infeasible

    def _half_odd(self, w: Work) -> float:
        """Under `half` recomputation, what a chunk of an odd layer count holds beyond `act`
        per layer (memory_pipeline.half_odd_bytes: the part's blocks 0, 2, ... stored).
        meshtron's rule (FSDP2 stacks); Megatron's and DeepSpeed's `half` are priced at the
        mean as before (their own per-chunk rules not checked here)."""
        if w.rec != "half" or w.mem_opts.framework != "fsdp2":
            return 0.0
        cfg = w.cfg
        none, full = (self._memory_pieces(w.tp, w.mb, cfg.sp, r, cfg.dtype, w.cp, w.ep, w.pp,
                                          cfg.fp8_recipe)[1] for r in ("none", "full"))
        return memory_pipeline.half_odd_bytes(none, full)

    def _zb_memory(self, w: Work, keep_infeasible: bool) -> bool:
        """Under torch's zero bubble, the walk of memory_zb.py on the split's own layers per
        virtual stage; False when that does not fit and `keep_infeasible` is False."""
        chunks = (list(w.cfg.stage_layers) if w.given else
                  pipeline_split.chunks(self.mem.split_rule, list(w.n), w.v, "zb"))
        inflight, outputs = self._zb_held(w, tuple(chunks), w.out_bytes)
        outputs = [o + r for o, r in zip(outputs, w.recv)]  # torch's receive buffers
        outputs = mtp.with_activations(outputs, w.head_rank, self.model.mtp_depth, w.act)
        changed = [r for r in range(w.pp)
                   if inflight[r] != w.inflight[r] or outputs[r] != w.outputs[r]]
        w.inflight, w.outputs = inflight, outputs
        w.per_layer, w.fixed = self._stage_memories(w, w.inflight, changed)
        w.fits = all(k * a + f <= w.budget for k, a, f in zip(w.n, w.per_layer, w.fixed))
        return w.fits or keep_infeasible

    def _dualpipe_memory(self, w: Work, keep_infeasible: bool) -> bool:
        """DualPipe's in-flight count on the split's own two stages per rank
        (pipeline_dualpipe.rank_in_flight), not the README's equal chunks."""
        chunks = (list(w.cfg.stage_layers) if w.given else
                  pipeline_split.chunks(self.mem.split_rule, list(w.n), w.v, "dualpipe"))
        w.inflight = pipeline_dualpipe.rank_in_flight(chunks, w.pp)
        w.per_layer, w.fixed = self._stage_memories(w, w.inflight)
        w.fits = all(k * a + f <= w.budget for k, a, f in zip(w.n, w.per_layer, w.fixed))
        return w.fits or keep_infeasible

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
                               self.grad_bytes, w.keep, w.accum, b_exp, w.e_states,
                               w.root_units[worst], w.reduce_bytes,
                               w.grad_extra if worst == 0 else 0.0, w.outputs[worst],
                               self._te_cache(w, worst), w.extra_accum)
        if cfg.offload != "none" or cfg.offload_activations:
            mem = self._with_host(mem, cfg, w.host_gpu)
            fits = fits and mem.host_fits
            if not fits and not keep_infeasible:
                return None
        hw_flops = self.model_flops + self._recompute_flops(w.rec) * self.tokens
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
            mfu=self.model_flops / per_gpu / peak, hfu=hw_flops / per_gpu / peak, fits=fits)
