"""The pipeline schedules' memory walks (estimate.Evaluator's mixin).

Under an interleaved schedule the stages' memory is priced at the walked peak of each rank's
chunks (memory_pipeline.py: `_interleaved_memory`), not at the even spread, and a split the
spread rejects is rejected before the walk only when a lower bound of it does not fit either
(`_walk_may_fit`); under torch's zero-bubble schedules the split backward's walk of
memory_zb.py (`_torch_zb`, `_zb_held`, `_zb_memory`); under DeepSeek's DualPipe the in-flight
count on the split's own two stages per rank (`_dualpipe_memory`, pipeline_dualpipe.py). Each
walk reprices the ranks it changes through `_stage_memories` (estimate_memory.py). Moved from
estimate.py unchanged (the DualPipe walk and the MTP module's activations: branch dsv3r).
"""

from __future__ import annotations

from meshtron.planner import (
    memory, memory_peak, memory_zb, mtp, pipeline_dualpipe, pipeline_split)
from meshtron.planner.estimate_work import Work


class MemoryWalks:
    """`_chunks`, `_walk_may_fit`, `_torch_zb`, `_zb_held`, `_interleaved_memory`, `_zb_memory`
    and `_dualpipe_memory`."""

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
        chunks = self._chunks(w)
        low = self._in_flight_lower_bound(w.pp, w.v, w.m_run, chunks, w.act,
                                          w.accum * w.accumulating, w.extra_warm)
        fsdp2 = w.mem_opts.framework == "fsdp2"
        # the walk's lower block moment on ranks of odd chunks under `half` (`_half_blocks`):
        # the fixed part drops by at most the working set's drop (`peak_moment` is a max)
        lowered = self._half_blocks(w, chunks, walk=False)
        last = w.pp - 1 if self._last_rank(w, chunks) else None
        for r, (k, a, f) in enumerate(zip(w.n, w.per_layer, w.fixed)):
            a_low = a + w.blocks[r][2] * (low[r] - w.inflight[r])
            if r == last:
                # priced at the larger of its loss and its fullest moment: the loss's walk
                # can hold less than `low`, the fullest's never (memory_pipeline.
                # last_rank_moments), so its bytes alone, with no outputs walked but the
                # receive buffers
                f = self._stage_memories(w, w.inflight, [r], moments=[None] * r + ["block"])
                f_low = f[1][r] - (w.outputs[r] - w.recv[r] if fsdp2 else 0.0)
            else:
                f_low = f - (w.outputs[r] if fsdp2 and r < w.pp - 1 else 0.0)
            f_low -= w.blocks[r][3] - lowered[r][3]
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
        # meshtron's chunked loss (tp = 1): kept from F to W per micro-batch, no logits
        chunked = w.mem_opts.loss_kind == "chunked" and w.tp == 1
        saved = memory.chunked_loss_held_bytes(self.model, tokens, w.mem_opts) if chunked else 0.0
        head = memory_zb.head_grad_bytes(self.model, w.tp, tokens, cb, fused, chunked)
        # W's gradients wait for the next B where FSDP2 upcasts them into its accumulator,
        # or for W's end where the stack folds them itself (fold_after_weight_pass)
        pending = cb * (w.p_layer + w.p_exp) if w.accum not in (0.0, cb) else 0.0
        work = memory_zb.input_backward_bytes(self.model, w.tp, w.cfg.sp, tokens, cb, fused)
        every = {"full": 1, "half": 2}.get(w.cfg.recompute, 0)
        kept = (memory_zb.weight_pass(self.model, w.tp, w.cfg.sp, tokens, cb, fused, every,
                                      pending) if every else None)
        # away from the loss the last stage's rank still runs a block's backward (B, W:
        # their recomputation), which the memory model's logits stood for (memory_peak.
        # peak_moment): only the logits beyond that working set are gone there
        loss = max(0.0, w.logits - w.work)
        return memory_zb.in_flight(w.pp, w.v, w.m_run, tuple(per_stage), w.act, grad, out_bytes,
                                   head, loss, pending, work, kept, self._half_odd(w)[0],
                                   saved, w.mem_opts.fold_after_weight_pass, self._zb_idle(w))

    @staticmethod
    def _zb_idle(w: Work) -> list[tuple[float, float]]:
        """Per pipeline rank, (FSDP2's unsharded gradient unit, a block's whole-backward working
        set) its stage memory counts, which no B of a folding stack holds (memory_zb.held's
        `idle`)."""
        out = []
        for r, (b_layer, b_exp, _, b_work) in enumerate(w.blocks):
            p_layer = b_layer + (0.0 if w.loose else b_exp)
            out.append((memory_peak.gradient_unit_bytes(w.mem_opts, w.shard_dp, p_layer,
                                                        w.roots[r], w.root_units[r]), b_work))
        return out

    def _interleaved_memory(self, w: Work, keep_infeasible: bool) -> bool:
        """Under an interleaved schedule, the stages' memory at the walked peak
        (memory_pipeline.py) instead of the even spread; False when that does not fit and
        `keep_infeasible` is False."""
        cfg, pp, v, m, n = w.cfg, w.pp, w.v, w.m_run, w.n
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
        grad = w.accum * w.accumulating
        odd = self._half_odd(w)[0]
        weighted = self._weighted_in_flight(pp, v, m, chunks, inflight, act, grad,
                                            w.extra_warm, odd)
        # the chunk outputs torch's pipelining holds at that moment, not at the even spread's
        # most (the last rank's: at its own moments, below); Megatron frees them once sent
        # (deallocate_output_tensor): none
        walked = [out_bytes * self._peak_outputs(
            pp, v, m, r, [chunks[c * pp + r] for c in range(v)], act, grad, out_bytes, odd)
            + w.recv[r] if r < pp - 1 and w.mem_opts.framework == "fsdp2" else outputs[r]
            for r in range(pp)]
        # a backward that starts on a stored block holds no recomputed block (set first: the
        # last rank's moments below are priced with it)...
        blocks = self._half_blocks(w, chunks, act=act, grad=grad, odd=odd)
        reblocked = [r for r in range(pp) if blocks[r] != w.blocks[r]]
        w.blocks = blocks
        # ...and the last rank's at the larger of its loss moment and its fullest one
        moments = self._last_rank_moment(w, chunks, grad, odd, weighted, walked)
        if weighted != inflight or walked != outputs or moments or reblocked:
            changed = [r for r in range(pp) if weighted[r] != inflight[r]
                       or walked[r] != outputs[r] or (moments and moments[r])
                       or r in reblocked]
            w.inflight, outputs[:], w.moments = weighted, walked, moments
            w.per_layer, w.fixed = per_layer, fixed = self._stage_memories(w, w.inflight,
                                                                           changed)
            # the walk can also lower a rank's memory (a light first chunk): the split's
            # memory is what it holds now
            w.fits = all(k * a + f <= w.budget for k, a, f in zip(n, per_layer, fixed))
        # the walk's figure is the fit decision, the search's as the pinned answer's
        return w.fits or keep_infeasible

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
