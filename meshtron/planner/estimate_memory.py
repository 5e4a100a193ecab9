"""The stages' memory model and the layer split (estimate.Evaluator's mixin).

Steps of `Evaluator.evaluate` between its inputs and its step time: the model states per
parameter kept on the device and moved to the host (`_states`), what every pipeline stage holds
beside its blocks (`_memory_model`: micro-batches in flight, root parameters, held chunk
outputs, receive buffers), the stages' bytes per layer and fixed bytes (`_stage_memories`:
memory.stage_memory's terms) and the layers per pipeline rank within memory (`_split`). The
interleaved and zero-bubble walks that refine the stages' memory once the split is known are in
estimate_walks.py; `half` on odd stages in estimate_half.py. Moved from estimate.py unchanged.
"""

from __future__ import annotations

from meshtron.errors import UserError
from meshtron.planner import (compression, memory, memory_pipeline, moe_deepep, moe_memory,
                              mtp, offload, pipeline, pipeline_split)
from meshtron.planner.estimate_half import half_cap
from meshtron.planner.estimate_stage import given_partition
from meshtron.planner.estimate_work import Work
from meshtron.planner.plan_rules_pipeline import split_problem


class StageMemories:
    """`_states`, `_memory_model`, `_te_cache`, `_stage_memories` and `_split`; the walks
    (estimate_walks.MemoryWalks) and `half` (estimate_half.HalfRecompute) reprice ranks
    through `_stage_memories`."""

    def _codec_runs(self, cfg) -> bool:
        """Whether the plan's gradient codec runs on its data-parallel reduction here
        (compression.compresses: not under compress_scope='inter_node' inside one node);
        DiLoCo's residual is its outer all-reduce's, over dp_replicate."""
        if not compression.changes_dp(cfg) or cfg.dp * cfg.cp <= 1:
            return True
        groups = self._groups(cfg)
        group = groups.get("dp_replicate", groups["dp"]) if cfg.diloco else groups["dp"]
        return compression.compresses(cfg, group)

    def _states(self, w: Work) -> None:
        """Parameters per tensor rank (w.p_layer, p_emb, p_head, largest, p_exp) and the bytes
        per parameter of their states kept on the device and moved to the host, dense
        (w.states, moved) and routed experts' (w.e_states, e_moved)."""
        cfg, mem_opts = w.cfg, w.mem_opts
        tp, pp, ep, zero, shard_dp = w.tp, w.pp, w.ep, w.zero, w.shard_dp
        fsdp_zero1, accum = w.fsdp_zero1, w.accum
        p_layer, p_emb, p_head, largest, p_exp = self.block_params(tp, pp, ep,
                                                                   mem_opts.framework,
                                                                   cfg.etp)
        full_states = compression.with_state_bytes(
            cfg, memory.state_bytes(zero, shard_dp, self.grad_bytes, mem_opts, fsdp_zero1),
            self._codec_runs(cfg))
        if (fsdp_zero1 or mem_opts.grads_at_first_backward) and accum:
            # the sharded gradients of meshtron's ZeRO-1 appear unit by unit as the last
            # micro-batch's accumulated ones are reduced and freed (`accum` holds them); a
            # ZeRO framework's buffer made at the first backward is `accum` too
            full_states = (full_states[0], 0.0, full_states[2])
        states = offload.device_states(cfg.offload, full_states,  # what stays on the device
                                       mem_opts.host_offload)
        moved = sum(full_states) - sum(states)  # bytes per parameter on the host
        # expert parallelism: a rank holds E/ep experts per block, their ZeRO states spread
        # over the dp*cp/ep ranks holding the same experts (moe_cost.py)
        e_states, e_moved = None, 0.0
        if ep > 1:
            e_full = memory.state_bytes(zero, moe_memory.expert_dp(cfg, shard_dp),
                                        self.grad_bytes, mem_opts)
            if (fsdp_zero1 or mem_opts.grads_at_first_backward) and accum:  # as above
                e_full = (e_full[0], 0.0, e_full[2])
            e_states = offload.device_states(cfg.offload, e_full, mem_opts.host_offload)
            e_moved = sum(e_full) - sum(e_states)
            # a one-rank expert-data-parallel group left out of FSDP2 (AutoModel): the
            # experts' gradients are their states', accumulated in place
            w.loose = (mem_opts.experts_outside_fsdp and mem_opts.framework == "fsdp2"
                       and shard_dp // ep <= 1)
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
        # a pipeline's in-flight micro-batches and receive buffers are those of one schedule
        # call (Plan.pipeline_runs: m / runs micro-batches each)
        inflight = self._in_flight(cfg.schedule, pp, v, w.m_run)
        if (mem_opts.framework == "megatron" and cfg.schedule == "interleaved" and v > 1
                and ep > 1 and self.opts.ep_overlap):
            # Megatron-Core's A2A overlap adds a warm-up forward (memory_pipeline.py)
            inflight = memory_pipeline.a2a_overlap_in_flight(inflight, v, w.m_run)
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
        # (DTensor's whole embedding gradient: FSDP2's accumulator only, not a ZeRO
        # framework's buffer made at the first backward, MemoryOptions.grads_at_first_backward)
        w.extra_accum = memory.embedding_accum_bytes(
            mem_opts, cfg.zero, w.accum if mem_opts.framework == "fsdp2" else 0.0,
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
                pp, v, w.m_run, cfg.schedule, inflight, mem_opts.fused_norm, counted)]
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
        # the RoPE tables every stage of meshtron's runtime keeps (its preset's zero_stages
        # 'all', or no stack named), counted with its parameters
        w.buffers = memory.rope_table_bytes(model, self.seq, mem_opts.framework == "fsdp2"
                                            and mem_opts.zero_stages in (None, "all"))
        w.per_layer, w.fixed = self._stage_memories(w, inflight)
        self._gpipe_bound(w)  # GPipe's last stage: every micro-batch's loss tensors

    def _ep_buffers(self, ep: int) -> float:
        """Bytes DeepEP preallocates outside PyTorch's allocator for the plan's ep group
        (moe_deepep.deepep_buffer_bytes; KernelOptions.ep_dispatch 'deepep'), else 0."""
        # HybridEP registers its own buffers (DeepEP branch hybrid-ep, csrc/hybrid_ep/
        # allocator), not sized here: DeepEP's allowance stands in for them, as it did when the
        # planner priced HybridEP as DeepEP
        if self.opts.ep_dispatch not in moe_deepep.DEDUPLICATED or not self.model.is_moe:
            return 0.0
        return moe_deepep.deepep_buffer_bytes(self.model.hidden, ep)

    def _budget(self, ep: int) -> float:
        """Tensor bytes a GPU may hold (Evaluator.tensor_budget) less DeepEP's fixed buffers,
        which the caching allocator's fragmentation does not scale."""
        return self.tensor_budget - self._ep_buffers(ep) / (1.0 + self.mem.fragmentation)

    @staticmethod
    def _loose(w: Work, experts: float) -> tuple[float]:
        """(experts held outside FSDP2,) of a block holding `experts` routed expert parameters:
        all of them where the plan's experts sit outside FSDP2 (`w.loose`), else none (they
        are memory.stage_memory's `p_expert`, passed as 0 here when loose)."""
        return (experts if w.loose else 0.0,)

    def _te_cache(self, w: Work, i: int) -> float:
        """Bytes of Transformer Engine's cached FP8 weights on pipeline rank `i`."""
        return w.cache_b * max(0.0, w.blocks[i][0] + w.blocks[i][1] - w.not_gemm)

    def _stage_memories(self, w: Work, inflight: list[float],
                        ranks: list[int] | None = None, outputs: list[float] | None = None,
                        moments: list[str | None] | None = None
                        ) -> tuple[list[float], list[float]]:
        """(bytes per layer, fixed bytes) of every pipeline stage (memory.stage_memory);
        `ranks`: only those recomputed, the others kept from w.per_layer / w.fixed (a walk
        that changed some ranks' in-flight count or held outputs leaves the rest as they were);
        `outputs`, `moments`: per rank, instead of w.outputs and w.moments."""
        pp, blocks = w.pp, w.blocks
        per_layer = list(w.per_layer) if ranks is not None else [0.0] * pp
        fixed = list(w.fixed) if ranks is not None else [0.0] * pp
        # memory.stage_memory's terms, what every rank shares read once (the search asks
        # this for every rank of every plan it evaluates)
        terms = memory.stage_terms
        head, mem_opts, zero, dp, states, largest = (w.head_rank, w.mem_opts, w.zero,
                                                     w.shard_dp, w.states, w.largest)
        grad_bytes, keep, accum, e_states = self.grad_bytes, w.keep, w.accum, w.e_states
        roots, root_units, reduce_bytes = w.roots, w.root_units, w.reduce_bytes
        outputs = w.outputs if outputs is None else outputs
        moments = (w.moments or [None] * pp) if moments is None else moments
        cache_b, not_gemm = w.cache_b, w.not_gemm  # `_te_cache`, written out
        for i in range(pp) if ranks is None else ranks:
            b = blocks[i]
            per_layer[i], fixed[i] = terms(
                mem_opts, zero, dp, states, b[0], roots[i], largest, b[2], inflight[i], b[3],
                w.logits if i == head else 0.0, grad_bytes, keep, accum,
                0.0 if w.loose else b[1], e_states,
                root_units[i], reduce_bytes, w.grad_extra if i == 0 else 0.0, outputs[i],
                cache_b * max(0.0, b[0] + b[1] - not_gemm), w.extra_accum, moments[i],
                *self._loose(w, b[1]))
            fixed[i] += w.buffers
        return per_layer, fixed

    def _split(self, w: Work, keep_infeasible: bool, exact_memory: bool) -> bool:
        """The layers per pipeline rank (w.n: the plan's own, else the stack's time-balanced
        split within memory, else the split that would run out of memory) and whether it fits
        (w.fits); False when it does not and `keep_infeasible` is False."""
        cfg, model = w.cfg, self.model
        pp, v, per_layer, fixed = w.pp, w.v, w.per_layer, w.fixed
        t_layer, e_first, e_last = w.t_layer, w.e_first, w.e_last
        budget = self._budget(w.ep)
        # under an interleaved schedule the walk decides what fits (_interleaved_memory), and it
        # can hold less than the even spread: a split the spread rejects is rejected here only
        # when a lower bound of the walk does not fit either (`_walk_may_fit`)
        walked = cfg.schedule == "interleaved" and v > 1
        # meshtron's `half`: a stage of an odd layer count holds `odd[i]` beyond its memory at
        # the mean per layer (more or less: estimate_half.py), so the split is chosen and
        # checked with it, and priced exactly once known (`_half_stages`, which decides the
        # fit: kept until then, as the walk's)
        halved = self._half_unwalked(w)
        odd = self._half_deltas(w) if halved else [0.0] * pp
        gpipe = self._gpipe_walked(w)  # priced at its moments once split (estimate_gpipe.py)
        keep = keep_infeasible or walked or halved or gpipe
        given = given_partition(cfg, model.layers)
        if given is None and pp > 1:  # the search never asks; a direct caller is told
            problem = split_problem(self.mem.split_rule, model.layers, pp, v)
            if problem:
                raise UserError(problem)
        weights = (w.p_emb, w.p_layer + w.p_exp, w.p_head)  # DeepSpeed's 'parameters' partition
        n = given or self._time_partition(pp, v, t_layer, e_first, e_last, None, weights)
        fits = n is not None and all(
            k * a + f + (d if k % 2 else 0.0) <= budget
            for k, a, f, d in zip(n, per_layer, fixed, odd))
        if not fits and gpipe and n is not None:  # the linear model is GPipe's upper bound
            fits = self._gpipe_fits(w, n, halved)
        w.split_by = "given" if given else "rule"
        if not fits and given is None:
            caps = [int((budget - f) // a) if budget > f else 0 for a, f in zip(per_layer, fixed)]
            if halved:
                caps = [half_cap(c, a, f, d, budget)
                        for c, a, f, d in zip(caps, per_layer, fixed, odd)]
            free = n
            if sum(caps) >= model.layers:
                n = self._time_partition(pp, v, t_layer, e_first, e_last, caps, weights)
            else:
                n = None
            fits = n is not None
            w.split_by = "memory" if fits else "unfit"
            if fits and free is not None:  # the rule's own split, over memory on some ranks
                w.split_free, w.split_caps = tuple(free), tuple(caps)
                w.split_over = tuple(i for i, (k, c) in enumerate(zip(free, caps)) if k > c)
            if n is None:
                if not keep:
                    return False
                stack = self._time_partition(pp, v, t_layer, e_first, e_last, None, weights)
                if self.mem.split_rule != "any" and stack is not None:
                    n = stack  # the stack's own split is what would run out of memory
                elif exact_memory:
                    _, n = pipeline.min_memory_partition(model.layers, per_layer, fixed, v)
                    w.split_by = "least"
                else:
                    n = stack or pipeline.min_memory_partition(model.layers, per_layer, fixed,
                                                               v)[1]
                    w.split_by = "unfit" if stack else "least"
        w.budget, w.given, w.n, w.fits = budget, given, n, fits
        if model.is_moe and pp > 1 and n is not None:
            # the stages' own blocks: dense first blocks hold no experts (moe_memory.py)
            chunks = list(cfg.stage_layers) if given else (
                list(n) if v == 1 else pipeline_split.chunks(self.mem.split_rule, n, v,
                                                               cfg.schedule))
            moe_act, moe_work = self._moe_memory(w.tp, w.mb, cfg.sp, w.rec, self.seq // w.cp,
                                                 w.mem_opts, w.ep, cfg.dtype, cfg.etp)
            w.blocks = moe_memory.stage_pieces(model, cfg, chunks,
                                               (w.p_layer, w.p_exp, w.act, w.work), moe_act,
                                               moe_work, w.mem_opts.framework)
            w.per_layer, w.fixed = per_layer, fixed = self._stage_memories(w, w.inflight)
            w.fits = fits and all(k * a + f <= budget for k, a, f in zip(n, per_layer, fixed))
            if not w.fits and not keep:
                return False
        if walked and not w.fits and not keep_infeasible and not self._walk_may_fit(w):
            return False
        if halved and n is not None:
            self._half_stages(w)
        if gpipe and n is not None:
            self._gpipe_stages(w)
        if (halved or gpipe) and not w.fits and not keep_infeasible:
            return False
        return True
