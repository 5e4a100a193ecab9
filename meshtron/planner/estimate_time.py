"""The step time of one plan (estimate.Evaluator's time step; the terms are described in
estimate.py's module docstring): the stages' compute and tensor-parallel time on the critical
stage, the bubble, pipeline transfers, and per stage the exposed data-parallel reduction, the
optimizer step and host offload.
"""

from __future__ import annotations

from meshtron.planner import (comm, composer_metrics, fp8_amax, moe_memory, offload,
                              optimizer_loop, pipeline, pipeline_split, pipeline_zb)
from meshtron.planner.estimate_results import TimeBreakdown
from meshtron.planner.estimate_work import Work


class StepTimes:
    """Mixin of `estimate.Evaluator`: needs what CostPieces, StageCosts and
    dp_cost.DataParallelCost give and self.model, self.cluster, self.opts, self.fab,
    self.grad_bytes, self.opt_bytes, self.hbm."""

    def _times(self, w: Work) -> TimeBreakdown:
        """The step time by part on the split w.n (w.stage_t, w.stage_f: the stages' times,
        their forward parts; w.host_gpu: what one GPU keeps in host memory)."""
        cfg, model, n = w.cfg, self.model, w.n
        tp, pp, v, m, emb, head = w.tp, w.pp, w.v, w.m, w.emb, w.head
        stage_t = [k * w.t_layer for k in n]
        stage_w = [k * w.w_l for k in n]
        stage_f = [k * w.f_l for k in n]
        stage_c = [k * w.c_l for k in n]
        stage_t[0] += w.e_first
        stage_c[0] += emb.compute
        stage_f[0] += emb.fwd
        h = w.head_rank  # the last rank's, or rank 0's on torch's V (e_first holds its time)
        stage_t[h] += w.e_last if h else 0.0
        stage_c[h] += head.compute
        stage_f[h] += head.fwd
        stage_w[h] += head.wgrad
        # `half` replays each model part's blocks 1, 3, ...: an odd part half a block less
        # than the mean per layer above (HalfRecompute.half_replay)
        excess = [0.0] * pp
        if any(w.replay):
            c_r, tp_r, w_r, _ = w.replay
            excess = [self.part_excess(w.rec, ks) for ks in self._rank_parts(w)]
            for r, x in enumerate(excess):
                stage_t[r] += x * (c_r + tp_r)
                stage_c[r] += x * c_r
                stage_w[r] += x * w_r
        crit = max(range(pp), key=stage_t.__getitem__)
        compute_t = (m * stage_c[crit] + self.accumulation_s(cfg, n[crit], crit, m, w.flags)
                     + n[crit] * self._fp8_step(tp, cfg.dtype, cfg.fp8_recipe))
        # the layers' collectives: tensor parallelism's and context parallelism's K/V exchange
        # (compute.layer_cost); exactly zero without either (the difference of sums leaves
        # rounding). The expert all-to-alls are a part of their own.
        ep_t = m * (n[crit] * w.ep_l + excess[crit] * w.replay[3])
        tp_t = m * (stage_t[crit] - stage_c[crit]) - ep_t if tp > 1 or w.cp > 1 else 0.0
        chunked = self._chunk_times(w) if v > 1 and pp > 1 and cfg.schedule in (
            "zb", "interleaved") else None
        if chunked and cfg.schedule == "interleaved" and not self._unequal(chunked[3], pp):
            chunked = None  # equal chunks: the formula is the order's walk
        w.groups = groups = self._groups(cfg)
        pp_t = 0.0
        # DualPipe hides its transfers in the overlapped chunks (pipeline_dualpipe.py)
        if pp > 1 and cfg.schedule != "dualpipe":
            cross = groups["pp_hop_crosses_nodes"]
            hop = comm.send(w.p2p_bytes, cross, self.fab) + w.gather
            if self.opts.p2p_grads_whole and w.gather:
                # activations split over the tensor group, gradients sent whole: the mean of
                # the two directions (each crosses every boundary the same number of times);
                # the gradient's receiver first re-gathers its own split output to run the
                # backward on it (DeepSpeed v0.3.15-v0.5.3 pipe/engine.py _exec_recv_grads:
                # PartitionedTensor.full() before p2p.recv), a gather in both directions
                hop = 0.5 * (hop + comm.send(w.p2p_bytes * tp, cross, self.fab)) + 0.5 * w.gather
            # each schedule call (Plan.pipeline_runs) fills and drains its own chain
            pp_t = w.runs * pipeline.p2p_time(hop, pp, v, w.m_run, self.opts.p2p_blocking,
                                              self.opts.p2p_overlap and v > 1)
            if model.tied_embeddings:
                pp_t += self.tied_embedding_s(tp, cross)
        w.stage_t, w.stage_f = stage_t, stage_f
        dp_t, opt_t, off_t = self._stage_sync(w)
        # Transformer Engine's delayed-scaling amax all-reduces over the stage's dp x tp x cp
        # ranks, two per micro-batch and model chunk, blocking (fp8_amax.py): exposed, a part
        # of their own (not data-parallel traffic: TimeBreakdown.fp8_sync)
        fp8_t = fp8_amax.delayed_amax_step_s(self.opts, cfg.dtype, m, v, n[crit],
                                             model, cfg.ep, groups["amax"], self.fab)
        # Composer's train-metric sync over every rank at the batch's end (composer_metrics)
        host_t = composer_metrics.sync_s(self.opts.train_metrics, cfg.gpus, self.cluster)
        parts = dict(compute=compute_t, tp_comm=tp_t, pp_comm=pp_t, dp_comm=dp_t,
                     optimizer=opt_t, ep_comm=ep_t, offload=off_t, step_host=host_t,
                     fp8_sync=fp8_t)
        # every schedule call (Plan.pipeline_runs) pays its own fill and drain: the bubble of
        # one call of m / runs micro-batches, once per call (torchtitan trainer.py, NeMo
        # AutoModel train_ft.py: a schedule.step per gradient-accumulation batch)
        runs, m_run = w.runs, w.m_run
        if not chunked or TimeBreakdown(bubble=0.0, **parts).total > w.cutoff:
            # the per-rank bubble (pipeline.bubble_time; for 'zb' the walk of stage_bubble):
            # only where the chunk-level walk below does not replace it
            bubble = runs * pipeline.bubble_time(cfg.schedule, v, stage_t, stage_w, m_run,
                                                 stage_f)
        else:
            # torch's order walked chunk by chunk (a step already over the search's cutoff
            # without any bubble is dropped whatever the walk finds)
            if cfg.schedule == "zb":
                bubble = runs * pipeline_zb.chunk_bubble(v, m_run, *chunked[:3])
            else:  # a rank's chunks differ: (sum t - max t) / v is not the order's walk
                f, b, wg, _ = chunked
                whole = tuple(x + y for x, y in zip(b, wg))
                bubble = runs * pipeline_zb.interleaved_idle_floor(m_run, f, whole, pp)
                if TimeBreakdown(bubble=bubble, **parts).total <= w.cutoff:
                    # the walk (>= that floor) can only matter for a step under the cutoff
                    bubble = runs * pipeline_zb.interleaved_bubble(m_run, f, whole, pp)
        return TimeBreakdown(bubble=bubble, **parts)

    def _chunk_times(self, w: Work) -> tuple[tuple[float, ...], ...]:
        """Per virtual stage (stage order, the split's own chunks: `pipeline_split.chunks`
        places them as the runtime does), one micro-batch's forward, input gradient and weight
        gradient, and the chunks' layers; the embedding on stage 0, the head on the last stage
        (rank 0 on the V)."""
        chunks = self._chunks(w)
        f = [k * w.f_l for k in chunks]
        t = [k * w.t_layer for k in chunks]
        wg = [k * w.w_l for k in chunks]
        if any(w.replay):  # `half` on odd chunks, as `_times` (the walks run per config)
            rep_t, rep_w = w.replay[0] + w.replay[1], w.replay[2]
            for j, k in enumerate(chunks):
                e = self.part_excess(w.rec, (k,))
                t[j] += e * rep_t
                wg[j] += e * rep_w
        f[0] += w.emb.fwd
        t[0] += w.emb.compute + w.emb.tp
        f[-1] += w.head.fwd
        t[-1] += w.head.compute + w.head.tp
        wg[-1] += w.head.wgrad
        return (tuple(f), tuple(x - y - z for x, y, z in zip(t, f, wg)), tuple(wg),
                tuple(chunks))

    def _chunks(self, w: Work) -> list[int]:
        """Layers per virtual stage (stage order) as the runtime places them."""
        chunks = (list(w.cfg.stage_layers) if w.given else
                  pipeline_split.chunks(self.mem.split_rule, list(w.n), w.v, w.cfg.schedule))
        if len(chunks) != w.pp * w.v:  # a plan whose own split is per rank
            chunks = pipeline.split_virtual(list(w.n), w.v, w.cfg.schedule)
        return chunks

    def _rank_parts(self, w: Work) -> list[list[int]]:
        """Per pipeline rank, the layers of each model part it holds (its chunks)."""
        if w.v == 1:
            return [[k] for k in w.n]
        chunks, sched = self._chunks(w), w.cfg.schedule or "1f1b"
        return [[chunks[s] for s in pipeline.stages_of_rank(w.pp, w.v, sched, r)]
                for r in range(w.pp)]

    @staticmethod
    def _unequal(chunks: tuple[int, ...], pp: int) -> bool:
        """Whether some rank's chunks (stage j on rank j % pp) hold different layer counts."""
        return any(len(set(chunks[r::pp])) > 1 for r in range(pp))

    def optimizer_step_s(self, local: float, layers: int, first: bool, last: bool,
                         shard: int, tp: int) -> float:
        """Seconds of the optimizer step of a stage of `layers` blocks whose rank holds
        `local` parameters, its states sharded over `shard` ranks: memory-bound
        (`optimizer_bytes()` per parameter at HBM speed, clipping included), and for a
        per-tensor Python loop ('for-loop': Composer's DecoupledAdamW) launch-bound on the
        busiest rank's tensors (optimizer_loop.py)."""
        device = self.optimizer_bytes() * local / self.hbm
        if self.opts.optimizer != "for-loop":
            return device
        units = [(optimizer_loop.layer_tensors(self.model, tp), layers),
                 (optimizer_loop.outer_tensors(self.model, tp, first, last), 1)]
        return optimizer_loop.step_s(units, shard, device, self.cluster)

    def _stage_sync(self, w: Work) -> tuple[float, float, float]:
        """(exposed data-parallel time, optimizer step, host-link transfers) of the slowest
        stage for each, and w.host_gpu."""
        cfg, n, zero, m, pp = w.cfg, w.n, w.zero, w.m, w.pp
        shard_dp, ep, flags, groups = w.shard_dp, w.ep, w.flags, w.groups
        p_layer, p_emb, p_head, p_exp = w.p_layer, w.p_emb, w.p_head, w.p_exp
        stage_t, stage_f = w.stage_t, w.stage_f
        dp_t = 0.0
        opt_t = 0.0
        off_t = 0.0
        host_gpu = 0.0  # bytes one GPU keeps in host memory (its fullest stage)
        seen: set[tuple[int, bool, bool]] = set()
        for i, k in enumerate(n):
            first, last = i == 0, i == w.head_rank
            if (k, first, last) in seen:
                continue  # an earlier identical stage hides less: it dominates
            seen.add((k, first, last))
            params_i = k * p_layer + (p_emb if first else 0.0) + (p_head if last else 0.0)
            local = params_i / shard_dp if zero >= 1 else params_i
            experts_i = k * p_exp
            if experts_i:
                local += (experts_i / moe_memory.expert_dp(cfg, shard_dp) if zero >= 1
                          else experts_i)
            host_gpu = max(host_gpu, params_i * w.moved + experts_i * w.e_moved)
            if cfg.offload == "none":
                opt_t = max(opt_t, self.optimizer_step_s(local, k, first, last,
                                                         shard_dp if zero >= 1 else 1, w.tp))
            else:  # host-link copies and the optimizer step on the host
                oc = offload.offload_cost(cfg.offload, local, zero, m, flags["reduce_once"],
                                          self.cluster.host_link_bytes_per_s,
                                          self.cluster.host_memory_bytes_per_s)
                opt_t = max(opt_t, oc.host_step_s)
                off_t = max(off_t, oc.transfer_s)
            kept = p_head if last else 0.0  # FSDP's [norm, head]: not re-gathered
            dp_t = max(dp_t, self.stage_dp(cfg, i, k, (params_i, experts_i, kept), m,
                                           stage_f[i], stage_t[i] - stage_f[i], flags,
                                           groups).total)
        w.host_gpu = host_gpu
        return dp_t, opt_t, off_t
