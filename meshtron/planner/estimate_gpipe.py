"""GPipe stages priced at their own moments (estimate.Evaluator's mixin).

Under torch's ScheduleGPipe (and on a 1F1B rank whose warm-up is the whole step: m <= p - s)
every forward runs before any backward, so FSDP2's accumulated gradients do not exist at the
fullest moment (all m micro-batches' activations, the first
backward), and the last stage keeps every micro-batch's loss tensors until then
(memory_gpipe.py). The linear model the split is chosen with (memory.stage_memory: m
micro-batches beside every gradient, one micro-batch's loss) is priced again once the split is
known, at the largest of the moments of memory_gpipe.gpipe_moments, each written as an
in-flight multiplier beside every layer's gradients (as memory_pipeline.weighted_in_flight
converts the interleaved walk) and the moment's working set (memory.MOMENTS). Looped BFS
(gpipe with v > 1, torch's ScheduleLoopedBFS) runs that order chunk by chunk: each chunk's
moments beside the other chunks' activations and gradients (memory_gpipe.looped_moments,
`_looped_rank`).
"""

from __future__ import annotations

import dataclasses

from meshtron.planner import memory_gpipe, memory_peak
from meshtron.planner.estimate_work import Work


class GPipeMoments:
    """`_gpipe_walked` (which plans), `_gpipe_bound` (the linear model an upper bound),
    `_gpipe_fits` (a split tried at its moments) and `_gpipe_stages` (the ranks' moments:
    `_gpipe_rank`, and `_looped_rank` for looped BFS, v > 1)."""

    def _gpipe_ranks(self, w: Work) -> list[bool]:
        """Per pipeline rank, whether it runs every forward of the step before its first
        backward with FSDP2 accumulating unsharded gradients over the step (`w.accum`):
        every rank of torch's ScheduleGPipe (one stage per rank), and a 1F1B rank whose
        warm-up is all the step's micro-batches (Schedule1F1B: min(m, p - s) forwards
        first; rehearsed, 'mid' pp 4, m 4, stage 0: +12.3% at m micro-batches beside every
        gradient), every rank of torch's ScheduleLoopedBFS (gpipe with v > 1: the same order
        chunk by chunk; rehearsed, 'mid' pp 2, v 2, m 4: rank 0 +12.3%, rank 1 -12.8% with
        the linear model), and a rank without a pipeline that runs one micro-batch per
        step: its one forward, then its one backward, which makes the gradients (optimizer.zero_grad
        (set_to_none=True) freed the last step's; rehearsed, tiny-moe-ds dp 8 ZeRO-0: +17.0% at
        the loss beside every gradient). There ZeRO-1..3's sharded gradients are made too, by
        each unit's reduce-scatter after its backward (the step's only micro-batch syncs:
        parallel/data_parallel.py `set_microbatch_policy`; rehearsed, 'mid' dp 8 ZeRO-1, the
        head's backward: the head's shard alone, +5.0% beside every shard)."""
        pp, m, schedule, mem = w.pp, w.m_run, w.cfg.schedule, w.mem_opts
        # ZeRO-0 accumulates in its states' gradient (memory_peak.embedding_accum_bytes)
        zero0 = w.zero == 0 and not (w.shard_dp == 1 and mem.dtype == "fp32")
        # v > 1: torch's ScheduleLoopedBFS, GPipe's order chunk by chunk (`_looped_rank`)
        looped = w.v > 1 and pp > 1 and schedule == "gpipe"
        # one micro-batch: FSDP2's reduce-scatter per unit (compressed ZeRO-1 reduces itself)
        sharded = pp == 1 and m == 1 and (w.zero >= 2 or w.fsdp_zero1)
        if not ((pp > 1 or m == 1) and (w.v == 1 or looped) and (w.accum > 0.0 or zero0 or sharded)
                and mem.framework == "fsdp2"):
            return [False] * pp
        if pp == 1:
            return [True]
        if schedule == "gpipe":
            return [True] * pp
        return [schedule == "1f1b" and m <= pp - s for s in range(pp)]

    def _gpipe_walked(self, w: Work) -> bool:
        """Whether `_gpipe_stages` prices some rank of the plan (`_gpipe_ranks`)."""
        return any(self._gpipe_ranks(w))

    def _gpipe_saved(self, w: Work) -> float:
        """Bytes one micro-batch's loss keeps on the last stage (memory_gpipe.py)."""
        return memory_gpipe.loss_saved_bytes(self.model, w.tp, w.mb, self.seq // w.cp,
                                             w.mem_opts)

    def _gpipe_bound(self, w: Work) -> None:
        """Under `_gpipe_walked`, the head's stage in the linear model the split is chosen
        with also holds the other m - 1 micro-batches' loss tensors (with m micro-batches
        and every gradient: above each moment, so a split it fits fits at the moments)."""
        r = w.head_rank
        if not self._gpipe_ranks(w)[r]:
            return
        w.outputs = list(w.outputs)
        w.outputs[r] += (w.m_run - 1) * self._gpipe_saved(w)
        w.per_layer, w.fixed = self._stage_memories(w, w.inflight, [r])

    def _gpipe_fits(self, w: Work, n: list[int], halved: bool) -> bool:
        """Whether the split `n`, over budget by the linear model, fits at its moments
        (`_half_stages` first where it applies, as `_split` runs them); `w` is left as it
        was."""
        trial = dataclasses.replace(w, n=list(n), budget=self._budget(w.ep))
        if halved:
            self._half_stages(trial)
        self._gpipe_stages(trial)
        return trial.fits

    def _gpipe_stages(self, w: Work) -> None:
        """Every rank of the split `w.n` that `_gpipe_ranks` names at the largest of its
        GPipe moments: its in-flight multiplier, kept outputs, moment and block (w.inflight,
        w.outputs, w.moments, w.blocks), then the stages' memory and whether the split fits
        (w.fits)."""
        pp, m = w.pp, w.m_run
        saved = self._gpipe_saved(w)
        walked = self._gpipe_ranks(w)
        # copies: the evaluator's cached lists; the head's outputs without `_gpipe_bound`'s
        # loss tensors, which each moment counts for itself
        inflight, outputs, blocks = list(w.inflight), list(w.outputs), list(w.blocks)
        if walked[w.head_rank]:
            outputs[w.head_rank] -= (m - 1) * saved
        moments = list(w.moments) if w.moments else [None] * pp
        rank = self._gpipe_rank if w.v == 1 else self._looped_rank
        for r, k in enumerate(w.n):
            if walked[r] and k and w.blocks[r][2]:  # a layer to carry the multiplier
                inflight[r], outputs[r], moments[r], blocks[r] = rank(
                    w, r, k, saved, inflight, outputs, moments)
        w.inflight, w.outputs, w.moments, w.blocks = inflight, outputs, moments, blocks
        w.per_layer, w.fixed = self._stage_memories(w, w.inflight)
        w.fits = all(k * a + f <= w.budget for k, a, f in zip(w.n, w.per_layer, w.fixed))

    def _gpipe_gradients(self, w: Work, r: int, k: int) -> tuple[float, float, float]:
        """Of rank `r` with `k` blocks, (its blocks' accumulated gradients, its roots', the
        gradients the linear model counts that no GPipe moment holds), bytes. The states'
        gradients: ZeRO-0's are its accumulator (made at the first backward, as `accum`'s),
        ZeRO-2/3's the shards the reduce-scatter makes after the last backward
        (optimizer.zero_grad(set_to_none=True) freed the last step's): at none of these
        moments; ZeRO-1's are `accum` (estimate.py `_states`)."""
        b = w.blocks[r]
        gb, egb = w.states[1], (w.e_states or w.states)[1]
        states = gb * (b[0] * k + w.roots[r]) + egb * b[1] * k
        extra = w.grad_extra * w.extra_accum if r == 0 else 0.0
        if w.accum:
            return w.accum * (b[0] + b[1]) * k, w.accum * w.roots[r] + extra, states
        return states - gb * w.roots[r], gb * w.roots[r] + extra, 0.0

    def _gpipe_head_grads(self, w: Work, r: int) -> float:
        """Bytes of the head's gradient on rank `r` (`_gpipe_gradients`' roots, the head's
        part): made at the loss's moment (memory_gpipe.gpipe_moments). Not under torch's
        `loss_parallel` (tp > 1, memory_acts.logits_bytes' 16 bytes per logit): there the
        head's gradient is made by the head's own backward, after the loss's backward has
        freed its fp32 working set and left the 16-bit logits' gradient (2 bytes per logit
        beside the head's 4 per weight: below the loss's peak while the rank's tokens exceed
        0.3 x hidden); rehearsed, 'mid' tp 2 + sp, one micro-batch, ZeRO-0: 2.873 GiB, the
        planner +6.2% with it at the loss, +2.0% without (tests/test_rehearse.py ONE_MB)."""
        if r != w.head_rank or w.tp > 1 and w.mem_opts.loss_kind not in (
                "vocab-parallel", "inplace", "flash-ce"):
            return 0.0
        return (w.accum or w.states[1]) * w.p_head

    def _gpipe_rank(self, w: Work, r: int, k: int, saved: float, inflight: list[float],
                    outputs: list[float], moments: list) -> tuple:
        """(multiplier, kept outputs, moment, block) of rank `r` at its fullest GPipe moment
        (memory_gpipe.gpipe_moments), each priced by `_stage_memories`."""
        pp, m, out, mem = w.pp, w.m_run, w.out_bytes, w.mem_opts
        b = w.blocks[r]
        act = b[2]
        # one micro-batch's activations (with `half`'s stored extra, _half_stages)
        per_mb = w.inflight[r] * act * k / m
        grads, roots, absent = self._gpipe_gradients(w, r, k)
        torch_stage = not mem.engine.startswith("deepspeed")
        # B: mb 0's stage output gone from torch's cache, its received input buffer no
        # longer a saved block input (memory_pipeline.receive_buffers counted it so)
        later = outputs[r] - (out if torch_stage and r < pp - 1 else 0.0) + (
            out if torch_stage and r > 0 and mem.fused_norm else 0.0)
        stored, replayed = self._gpipe_replay(w, r, k)
        resharded = self._gpipe_resharded(w, b)
        one_step = pp == 1  # the embedding's gradient made after every block's
        first = self._gpipe_first_block(w, r, b) if one_step else 0.0
        best: tuple = ()
        kept_blocks = w.blocks
        try:
            for held, moment in memory_gpipe.gpipe_moments(
                    m, k, per_mb, grads, roots, saved, r == w.head_rank,
                    r == 0 and w.grad_extra > 0.0, stored, self._gpipe_head_grads(w, r),
                    resharded, first, one_step):
                block = replayed if moment == "replay" else b
                moment = "block" if moment == "replay" else moment
                mult = (held - grads - roots - absent) / (act * k)
                kept = later if moment is None else outputs[r]
                total = self._moment_total(w, r, k, kept_blocks, block, (mult, kept, moment),
                                           (inflight, outputs, moments))
                if not best or total > best[0]:
                    best = (total, mult, kept, moment, block)
        finally:
            w.blocks = kept_blocks
        return best[1:]

    def _moment_total(self, w: Work, r: int, k: int, kept_blocks: list, block: tuple,
                      at: tuple, ranks: tuple) -> float:
        """Rank r's total at one moment of its walk: `block` its working set, `at` = (its
        micro-batches in flight, stage outputs kept, moment), `ranks` = every rank's (in
        flight, outputs, moments) from which r's are replaced. Leaves `w.blocks` with r's
        block: the caller restores it."""
        mult, kept, moment = at
        inflight, outputs, moments = ranks
        w.blocks = kept_blocks[:r] + [block] + kept_blocks[r + 1:]
        per_layer, fixed = self._stage_memories(
            w, inflight[:r] + [mult] + inflight[r + 1:], [r],
            outputs[:r] + [kept] + outputs[r + 1:],
            moments[:r] + [moment] + moments[r + 1:])
        return k * per_layer[r] + fixed[r]

    def _gpipe_resharded(self, w: Work, b: tuple) -> tuple[float, float]:
        """(the head's unit, a block `b`'s) compute copies freed after their backward
        (memory_gpipe.resharded_after_backward: one micro-batch without a pipeline)."""
        return memory_gpipe.resharded_after_backward(
            w.m_run, w.pp, w.zero, self._gpipe_resharded_units(w), w.mem_opts.compute_bytes,
            w.p_head, b[0] + b[1])

    @staticmethod
    def _gpipe_resharded_units(w: Work) -> bool:
        """Whether every block's compute copy is in the stage's per-layer bytes (FSDP2 units
        kept gathered from their forward: memory._stage_parts' `fsdp_all`)."""
        mem = w.mem_opts
        return (mem.framework == "fsdp2" and not (w.shard_dp == 1 and mem.dtype == "fp32")
                and not (w.zero == 3 and w.shard_dp > 1 and not w.keep))

    def _gpipe_first_block(self, w: Work, r: int, b: tuple) -> float:
        """What rank `r`'s block moment (memory_peak.block_moment, the larger of the first
        block's backward in backward order and a later one's) holds beyond the first one's,
        bytes: the previous unit's reduce-scatter input less a layer's activations, where the
        later one wins (full recomputation: a layer's stored input is small). The head's first
        block follows the head's unit, whose buffer is released by then (rehearsed, 'mid' dp
        8 ZeRO-1 full: 1.3363 GiB priced at block 1 with block 0's moment's 0.168 GiB fp32
        gradient, which only block 0's backward runs beside)."""
        mem = w.mem_opts
        fsdp_all = self._gpipe_resharded_units(w)
        args = (mem, w.zero, w.shard_dp, 0 if fsdp_all else 3, b[0] + b[1], w.roots[r],
                w.largest, self.grad_bytes, w.keep, w.root_units[r])
        return (memory_peak.block_moment(*args, w.reduce_bytes, b[2])
                - memory_peak.backward_gathered_bytes(*args))

    def _gpipe_replay(self, w: Work, r: int, k: int) -> tuple[float, tuple]:
        """Under meshtron's `half` on a stage of an odd layer count (whose block moment
        `_half_stages` priced without a replayed block, its backward starting on a stored
        one), (the stored last block's activations, the block with the replayed block's
        working set): the first backward replays block k - 2 once block k - 1's backward has
        freed its tensors and made its gradient (memory_gpipe.gpipe_moments "replay"). (0, the
        block) elsewhere; dense blocks only (a MoE stage keeps the moment it had)."""
        b = w.blocks[r]
        if not (self._half_unwalked(w) and k % 2 and k > 1 and not w.p_exp
                and not self.model.is_moe and b[3] < w.work):
            return 0.0, b
        cfg = w.cfg
        none = self._memory_pieces(w.tp, w.mb, cfg.sp, "none", cfg.dtype, w.cp, w.ep, w.pp,
                                   cfg.fp8_recipe, cfg.etp)[1]
        return none, (b[0], b[1], b[2], w.work)

    def _looped_rank(self, w: Work, r: int, k: int, saved: float, inflight: list[float],
                     outputs: list[float], moments: list) -> tuple:
        """`_gpipe_rank` of a looped-BFS rank (gpipe with v > 1): the largest of its chunks'
        GPipe moments in torch's order (memory_gpipe.looped_moments), each chunk with its
        own layers (the split's, `_chunks`), `half`'s odd-chunk extra and replay, and the
        chunk outputs and receive buffers held then. torch's stage keeps a chunk's output
        until that micro-batch's backward (PipelineStage.fwd_cache) and its m receive
        buffers all step (memory_pipeline.receive_buffers), the inputs among them a saved
        block input while their micro-batch is held (a fused norm saves it): a chunk whose
        micro-batches are gone holds fewer outputs, more uncounted input buffers."""
        pp, v, m, out, mem = w.pp, w.v, w.m_run, w.out_bytes, w.mem_opts
        b = w.blocks[r]
        act = b[2]
        chunks = self._chunks(w)
        layers = [chunks[c * pp + r] for c in range(v)]
        odd, plain = self._half_odd(w)
        per_mb = [act * n + (odd if n % 2 else 0.0) for n in layers]
        grads, roots, absent = self._gpipe_gradients(w, r, k)
        # an odd chunk's backward starts on a stored block (no replayed block beside the
        # saved ones), then replays the checkpointed one below into its space
        # (`_gpipe_replay`; dense blocks only, as there)
        dense = not w.p_exp and not self.model.is_moe
        replay = plain is not None and dense
        none = self._gpipe_replay_bytes(w) if replay else 0.0
        stored = [none if replay and n % 2 and n > 1 else 0.0 for n in layers]
        lowered = b if plain is None else (b[0], b[1], b[2], min(b[3], plain))
        torch_stage = not mem.engine.startswith("deepspeed")
        last = pp * v - 1
        # per chunk, what one held micro-batch adds to the kept outputs (linear: all m):
        # its output (the last virtual stage sends none), less its input buffer where the
        # block saves it (the first virtual stage receives none)
        per_out = [out * ((c * pp + r != last) - (mem.fused_norm and c * pp + r != 0))
                   if torch_stage else 0.0 for c in range(v)]
        best: tuple = ()
        kept_blocks = w.blocks
        try:
            for held, c, count, moment in memory_gpipe.looped_moments(
                    m, layers, per_mb, [grads * n / k for n in layers], roots, saved,
                    r == w.head_rank, r == 0 and w.grad_extra > 0.0, stored,
                    self._gpipe_head_grads(w, r)):
                block = b if moment == "replay" or not layers[c] % 2 else lowered
                moment = "block" if moment == "replay" else moment
                mult = (held - grads - roots - absent) / (act * k)
                # chunks above c are done, c holds `count`, those below all m
                kept = outputs[r] + sum(per_out[j] * ((count if j == c else 0) - m)
                                        for j in range(c, v))
                total = self._moment_total(w, r, k, kept_blocks, block, (mult, kept, moment),
                                           (inflight, outputs, moments))
                if not best or total > best[0]:
                    best = (total, mult, kept, moment, block)
        finally:
            w.blocks = kept_blocks
        return best[1:]

    def _gpipe_replay_bytes(self, w: Work) -> float:
        """One stored block's activations (recomputation none) under `half`: what an odd
        stage's or chunk's last block frees before the checkpointed one is replayed."""
        cfg = w.cfg
        return self._memory_pieces(w.tp, w.mb, cfg.sp, "none", cfg.dtype, w.cp, w.ep, w.pp,
                                   cfg.fp8_recipe, cfg.etp)[1]
