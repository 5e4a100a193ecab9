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
  2021, section 4.1; already split with sequence parallelism), re-gathered over NVLink;
  KernelOptions(p2p_scatter_gather=False) sends the whole activation from every tensor rank
  and p2p_blocking=True pays a stage's receive and its send per direction (DeepSpeed's
  pipeline engine: blocking transfers in each stage's instruction stream). Megatron and
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
  buffer); foreach / for-loop AdamW ('foreach') makes a pass per arithmetic step, 86 bytes;
  both at 80% of HBM bandwidth. What the optimizer runs is the framework's choice, not the
  kernel stack's: compiling the blocks leaves it alone.
* gradient accumulation (in compute): unless the weight-gradient GEMM accumulates in place
  (Megatron's gradient accumulation fusion), every micro-batch's gradients are added to the
  accumulated ones by a memory-bound pass of their own (`Evaluator.accumulation_s`).

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
from meshtron.planner import (comm, compression, compute, memory, memory_pipeline,
                              moe_memory, offload, pipeline, pipeline_split)
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.dp_cost import (  # noqa: F401  (re-exported)
    LIST_HOST_S_PER_RANK, OVERLAP_INTERFERENCE, DataParallelCost, _exposed)
from meshtron.planner.estimate_pieces import (  # noqa: F401  (re-exported)
    CostPieces, MemoryPieces, MicroCosts, StageParams)
from meshtron.planner.estimate_results import Estimate, TimeBreakdown  # noqa: F401
from meshtron.planner.estimate_stage import StageCosts, _given_partition
from meshtron.planner.plan import Plan
from meshtron.planner.plan_rules_pipeline import split_problem

OPTIMIZER_BYTES_PER_PARAM = 28.0
"""Fused AdamW update traffic per local parameter (see module docstring)."""
EAGER_OPTIMIZER_BYTES_PER_PARAM = 86.0
"""torch.optim.AdamW without fusion (for-loop or foreach: multi-tensor launches, same bytes):
weight decay (4+4), first moment lerp (4+4+4), second moment scale and addcmul (4+4, 4+4+4),
sqrt, bias-correction divide and eps add (3 x (4+4)), addcdiv (4+4+4+4), then the bf16 copy
of the fp32 master (4+2): 86 bytes per parameter."""

class Evaluator(StageCosts, CostPieces, DataParallelCost):
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
        self.tensor_budget = (self.capacity - self.ws_fixed) / (1.0 + memory.FRAGMENTATION)
        tokens = global_batch * seq_len
        self.tokens = tokens
        self.model_flops = compute.model_flops_per_step(model, tokens, seq_len)
        self.n_gpus = cluster.num_gpus
        self.hbm = cluster.hbm_bytes_per_s * compute.HBM_EFFICIENCY
        # fp32 gradient accumulation buffer (Megatron's main_grad) or bf16 gradients
        self.grad_bytes = 4.0 if self.opts.fp32_grad_reduce else memory.GRAD_BYTES
        # AdamW traffic per local parameter: 24 bytes of fp32 master + moments read and written,
        # bf16 weight written (2), gradient read (2 or 4)
        if self.opts.optimizer == "foreach":
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
        than `cutoff` seconds per step come back as None (the search has no use for them).`stage`: the memory
        breakdown of that pipeline stage instead of the fullest (`meshtron rehearse --rank`)."""
        self.evaluated += 1
        model, seq = self.model, self.seq
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
                                                          ep, pp)
        flags = self.dp_flags(cfg)
        # ZeRO shards and gradient reductions span dp x cp ranks (FSDP over dp_shard x cp)
        shard_dp = dp * cp
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
        if pp == 1:
            e_first, e_last = e_first + e_last, 0.0
        p_layer, p_emb, p_head, largest = self._params(tp, pp)
        full_states = compression.with_state_bytes(
            cfg, memory.state_bytes(zero, shard_dp, self.grad_bytes, mem_opts, fsdp_zero1))
        if fsdp_zero1 and accum:
            # the sharded gradients of meshtron's ZeRO-1 appear unit by unit as the last
            # micro-batch's accumulated ones are reduced and freed (`accum` holds them)
            full_states = (full_states[0], 0.0, full_states[2])
        states = offload.device_states(cfg.offload, full_states)  # what stays on the device
        moved = sum(full_states) - sum(states)  # bytes per parameter on the host
        # expert parallelism: a rank holds E/ep experts per block, their ZeRO states spread
        # over the dp*cp/ep ranks holding the same experts (moe_cost.py)
        p_exp, e_states, e_moved = 0.0, None, 0.0
        if model.is_moe:  # where the stack keeps the MoE parameters (moe_memory.py)
            p_layer, p_exp = moe_memory.block_params(model, tp, pp, ep, mem_opts.framework)
            if ep == 1:
                p_layer, p_exp = p_layer + p_exp, 0.0
        if ep > 1:
            e_full = memory.state_bytes(zero, max(1, shard_dp // ep), self.grad_bytes, mem_opts)
            if fsdp_zero1 and accum:  # as the dense states above: `accum` holds them
                e_full = (e_full[0], 0.0, e_full[2])
            e_states = offload.device_states(cfg.offload, e_full)
            e_moved = sum(e_full) - sum(e_states)
        # memory of stage i = n_i * per_layer[i] + fixed[i] (memory.stage_memory)
        inflight = self._in_flight(cfg.schedule, pp, v, m)
        if (mem_opts.framework == "megatron" and cfg.schedule == "interleaved" and v > 1
                and ep > 1 and self.opts.ep_overlap):
            # Megatron-Core's A2A overlap adds a warm-up forward (memory_pipeline.py)
            inflight = memory_pipeline.a2a_overlap_in_flight(inflight, v, m)
        roots = [0.0] * pp
        roots[0] += p_emb
        roots[-1] += p_head
        # FSDP2 units outside the blocks: the embedding and [norm, head], wrapped apart
        root_units = [0.0] * pp
        root_units[0] = p_emb
        root_units[-1] = max(root_units[-1], p_head)
        grad_extra = memory.embedding_grad_extra(model, tp)  # the first stage's embedding
        # a block's backward runs beside the previous block's reduce-scatter input, except
        # under pipelining (reduced after the last backward: memory.previous_gradient_bytes)
        reduce_bytes = flags["gsize"] if pp == 1 else 0.0
        # the chunk outputs torch's pipelining keeps until their backward (memory_pipeline.py;
        # Megatron-LM frees their data once sent, deallocate_pipeline_outputs)
        out_bytes = memory_pipeline.stage_output_bytes(model.hidden, tp, cfg.sp, mb, seq // cp,
                                                       mem_opts.compute_bytes)
        outputs = [k * out_bytes if mem_opts.framework == "fsdp2" else 0.0
                   for k in memory_pipeline.held_outputs(pp, v, inflight)]
        if mem_opts.engine.startswith("deepspeed"):  # DeepSpeed's engine's own buffers
            outputs = [k * out_bytes for k in memory_pipeline.deepspeed_pipe_buffers(pp, m)]

        # per pipeline rank: (block parameters, experts, activations, recompute working set)
        # of its mean block; every block a MoE block's until the layer split is known
        blocks = [(p_layer, p_exp, act, work)] * pp
        # Transformer Engine's cached FP8 weights (memory_acts.te_weight_cache_bytes): the
        # block's GEMM weights, not its norms or router
        cache_b = memory.te_weight_cache_bytes(self.opts, mem_opts)
        not_gemm = 2 * model.norm_params + (model.hidden * model.moe_experts
                                            if model.is_moe else 0)

        def cache_of(i: int) -> float:
            return cache_b * max(0.0, blocks[i][0] + blocks[i][1] - not_gemm)

        def stage_memories(inflight: list[float]) -> tuple[list[float], list[float]]:
            sms = [memory.stage_memory(mem_opts, zero, shard_dp, states, blocks[i][0], roots[i],
                                       largest, blocks[i][2], inflight[i], blocks[i][3],
                                       logits if i == pp - 1 else 0.0, self.grad_bytes, keep,
                                       accum, blocks[i][1], e_states, root_units[i],
                                       reduce_bytes, grad_extra if i == 0 else 0.0, outputs[i],
                                       cache_of(i))
                   for i in range(pp)]
            return [sm.per_layer for sm in sms], [sm.fixed for sm in sms]

        per_layer, fixed = stage_memories(inflight)
        budget = self.tensor_budget
        given = _given_partition(cfg, model.layers)
        if given is None and pp > 1:  # the search never asks; a direct caller is told
            problem = split_problem(self.mem.split_rule, model.layers, pp, v)
            if problem:
                raise UserError(problem)
        weights = (p_emb, p_layer + p_exp, p_head)  # DeepSpeed's 'parameters' partition
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
                if not keep_infeasible:
                    return None
                stack = self._time_partition(pp, v, t_layer, e_first, e_last, None, weights)
                if self.mem.split_rule != "any" and stack is not None:
                    n = stack  # the stack's own split is what would run out of memory
                elif exact_memory:
                    _, n = pipeline.min_memory_partition(model.layers, per_layer, fixed, v)
                else:
                    n = stack or pipeline.min_memory_partition(model.layers, per_layer, fixed,
                                                               v)[1]

        if model.is_moe and pp > 1 and n is not None:
            # the stages' own blocks: dense first blocks hold no experts (moe_memory.py)
            chunks = list(cfg.stage_layers) if given else (
                list(n) if v == 1 else pipeline_split.chunks(self.mem.split_rule, n, v))
            moe_act, moe_work = self._moe_memory(tp, mb, cfg.sp, rec, seq // cp, mem_opts, ep,
                                                 cfg.dtype)
            blocks = moe_memory.stage_pieces(model, cfg, chunks, (p_layer, p_exp, act, work),
                                             moe_act, moe_work, mem_opts.framework)
            per_layer, fixed = stage_memories(inflight)
            fits = fits and all(k * a + f <= budget for k, a, f in zip(n, per_layer, fixed))
            if not fits and not keep_infeasible:
                return None

        # ---- time -------------------------------------------------------------------------
        stage_t = [k * t_layer for k in n]
        stage_w = [k * w_l for k in n]
        stage_f = [k * f_l for k in n]
        stage_c = [k * c_l for k in n]
        stage_t[0] += e_first
        stage_c[0] += emb.compute
        stage_f[0] += emb.fwd
        stage_t[-1] += e_last if pp > 1 else 0.0
        stage_c[-1] += head.compute
        stage_f[-1] += head.fwd
        stage_w[-1] += head.wgrad
        crit = max(range(pp), key=stage_t.__getitem__)
        compute_t = (m * stage_c[crit] + self.accumulation_s(cfg, n[crit], crit, m, flags)
                     + n[crit] * self._fp8_step(tp, cfg.dtype, cfg.fp8_recipe))
        # exactly zero without tensor parallelism (the difference of sums leaves rounding)
        ep_t = m * n[crit] * ep_l
        tp_t = m * (stage_t[crit] - stage_c[crit]) - ep_t if tp > 1 else 0.0
        bubble = pipeline.bubble_time(cfg.schedule, v, stage_t, stage_w, m)
        groups = self._groups(cfg)
        pp_t = 0.0
        if pp > 1:
            cross = groups["pp_hop_crosses_nodes"]
            hop = comm.send(p2p_bytes, cross, self.fab) + gather
            pp_t = pipeline.p2p_time(hop, pp, v, m, self.opts.p2p_blocking,
                                     self.opts.p2p_overlap and v > 1)
            if model.tied_embeddings:
                word = model.vocab * model.hidden / tp  # the tied table, vocabulary-parallel
                pp_t += pipeline.tied_embedding_reduce(self.grad_bytes * word, cross, self.fab)
        dp_t = 0.0
        opt_t = 0.0
        off_t = 0.0
        # chunk-slots a looped schedule idles at each chunk change (pipeline.bubble_time)
        looped = v > 1 and (cfg.schedule == "interleaved" or cfg.schedule == "gpipe")
        idle = max(0, pp - m) if looped else 0
        host_gpu = 0.0  # bytes one GPU keeps in host memory (its fullest stage)
        seen: set[tuple[int, bool, bool]] = set()
        for i, k in enumerate(n):
            first, last = i == 0, i == pp - 1
            if (k, first, last) in seen:
                continue  # an earlier identical stage hides less: it dominates
            seen.add((k, first, last))
            params_i = k * p_layer + (p_emb if first else 0.0) + (p_head if last else 0.0)
            local = params_i / shard_dp if zero >= 1 else params_i
            experts_i = k * p_exp
            if experts_i:
                local += experts_i / max(1, shard_dp // ep) if zero >= 1 else experts_i
            host_gpu = max(host_gpu, params_i * moved + experts_i * e_moved)
            if cfg.offload == "none":
                opt_t = max(opt_t, self.opt_bytes * local / self.hbm)
            else:  # host-link copies and the optimizer step on the host
                oc = offload.offload_cost(cfg.offload, local, zero, m, flags["reduce_once"],
                                          self.cluster.host_link_bytes_per_s,
                                          self.cluster.host_memory_bytes_per_s)
                opt_t = max(opt_t, oc.host_step_s)
                off_t = max(off_t, oc.transfer_s)
            if shard_dp > 1:
                bwd = stage_t[i] - stage_f[i]
                # FSDP2 under torch.distributed.pipelining reduces after the stage's last
                # backward (pipeline.reduce_after_drain); DDP-style stacks during it
                drain = (v, i, bwd, idle) if pp > 1 and self.opts.sharding == "fsdp" else None
                # stage i finishes its last backward about i stage-backwards before stage 0
                args = (params_i, groups, m, stage_f[i], bwd if zero >= 2 else (1 + i) * bwd,
                        k, rec == "full" and self.opts.recompute_regathers)
                units = self.fsdp_units(k, first, last)
                kept = p_head if last else 0.0  # FSDP's [norm, head]: not re-gathered
                if compression.changes_dp(cfg):  # gradient compression or DiLoCo
                    dp_t = max(dp_t, compression.dp_time(self, cfg, *args, units=units,
                                                         kept=kept))
                elif experts_i:
                    dp_t = max(dp_t, self._dp_with_experts(params_i, experts_i, zero, args,
                                                           units, kept, {**flags,
                                                                         "drain": drain},
                                                           groups))
                else:
                    dp_t = max(dp_t, self._dp_time(args[0], zero, *args[1:], units=units,
                                                   kept=kept, drain=drain, **flags))
        times = TimeBreakdown(compute=compute_t, tp_comm=tp_t, pp_comm=pp_t, dp_comm=dp_t,
                              bubble=bubble, optimizer=opt_t, ep_comm=ep_t, offload=off_t)
        step = times.total
        if fits and step > cutoff and not keep_infeasible:
            # too slow whatever the walk below finds: fitting, over the cutoff; not fitting,
            # not wanted (the walk only adds memory, the step time does not depend on it)
            return None
        if (cfg.schedule == "interleaved" and v > 1 and n is not None
                and mem_opts.framework == "fsdp2"):
            # the rank's first chunks hold more micro-batches than its last: weighted by their
            # own layer counts (memory_pipeline.py), which FSDP2 runtimes cut as the plan says
            # (Megatron-LM requires equal chunks: the even spread is exact there), at the
            # moment they are largest beside the gradients accumulated so far
            chunks = list(cfg.stage_layers) if given else \
                pipeline_split.chunks(self.mem.split_rule, n, v)
            grad = accum * (p_layer + p_exp)
            weighted = self._weighted_in_flight(pp, v, m, chunks, inflight, act, grad)
            # the chunk outputs held at that moment, not at the even spread's most (the last
            # rank's peak is its loss, whose moment the walk does not single out: as spread)
            walked = [out_bytes * self._peak_outputs(
                pp, v, m, r, [chunks[c * pp + r] for c in range(v)], act, grad, out_bytes)
                if r < pp - 1 else outputs[r] for r in range(pp)]
            if weighted != inflight or walked != outputs:
                inflight, outputs[:] = weighted, walked
                per_layer, fixed = stage_memories(inflight)
                fits = fits and all(k * a + f <= budget for k, a, f in zip(n, per_layer, fixed))
                if not fits and not keep_infeasible:
                    return None

        if fits and step > cutoff:
            return None

        # ---- memory breakdown of the fullest stage -------------------------------------------
        totals = [k * a + f for k, a, f in zip(n, per_layer, fixed)]
        worst = max(range(pp), key=totals.__getitem__) if stage is None else stage
        b_layer, b_exp, b_act, b_work = blocks[worst]
        mem = memory.breakdown(mem_opts, zero, shard_dp, states, n[worst], b_layer,
                               roots[worst], largest, b_act, inflight[worst], b_work,
                               logits if worst == pp - 1 else 0.0, self.capacity, worst,
                               self.grad_bytes, keep, accum, b_exp, e_states,
                               root_units[worst], reduce_bytes,
                               grad_extra if worst == 0 else 0.0, outputs[worst],
                               cache_of(worst))
        if cfg.offload != "none" or cfg.offload_activations:
            mem = self._with_host(mem, cfg, host_gpu)
            fits = fits and mem.host_fits
            if not fits and not keep_infeasible:
                return None
        hw_flops = self.model_flops + self._recompute_flops(rec) * self.tokens
        peak = self.cluster.peak_flops
        per_gpu = step * self.n_gpus
        stage_layers = (list(cfg.stage_layers) if given else
                        n if v == 1 else pipeline_split.chunks(self.mem.split_rule, n, v))
        return Estimate(
            config=cfg, stage_layers=list(stage_layers), num_microbatches=m, memory=mem,
            time=times, tokens_per_s=self.tokens / step,
            model_tflops_per_gpu=self.model_flops / per_gpu / 1e12,
            hardware_tflops_per_gpu=hw_flops / per_gpu / 1e12,
            mfu=self.model_flops / per_gpu / peak, hfu=hw_flops / per_gpu / peak, fits=fits)
