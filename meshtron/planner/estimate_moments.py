"""The interleaved pipeline's last rank priced at its own moments (estimate.Evaluator's mixin).

That rank holds the loss (its chunk v - 1 is the last virtual stage). Its loss moment (the
logits and their gradients alive: memory_peak.moment_parts) comes when fewer micro-batches
are in flight than at its fullest moment, whose working set is a block's backward: priced at
both and their sum counted, the rank read +6.7% over `meshtron rehearse` ('mid', pp 2,
interleaved:2, m 12, chunks of 2 and 1 layers; docs/measurements.md, ilvlast). The walk of
torch 2.13's ScheduleInterleaved1F1B order (memory_pipeline.last_rank_moments) gives what the
rank holds at each; the larger of the two prices is the rank's (+0.6%).
"""

from __future__ import annotations

import functools

from meshtron.planner import memory_pipeline
from meshtron.planner.estimate_work import Work


class LastRankMoments:
    """`_last_rank_moment` and the rank it applies to (`_last_rank`); Evaluator's
    `_stage_memories` prices each moment."""

    def _last_rank(self, w: Work, chunks: list[int]) -> list[int] | None:
        """The layers of the interleaved last rank's chunks when its loss moment and its
        fullest one are priced apart (it holds the loss and some layers); else None."""
        r = w.pp - 1
        layers = [chunks[c * w.pp + r] for c in range(w.v)]
        return layers if w.head_rank == r and sum(layers) and w.logits and w.act else None

    def _last_rank_moment(self, w: Work, chunks: list[int], grad: float, odd: float,
                          weighted: list[float], walked: list[float]) -> list[str | None]:
        """The interleaved last rank at the larger of its loss moment and its fullest one
        (memory_pipeline.last_rank_moments: the loss comes when fewer micro-batches are in
        flight), each with its own multiplier, kept outputs and moment bytes
        (memory.MOMENTS): the winner's written into `weighted` and `walked`; returns the
        ranks' moments (empty: the last rank's peak is not priced apart)."""
        layers = self._last_rank(w, chunks)
        if layers is None:
            return []
        pp, r, n, act = w.pp, w.pp - 1, sum(layers), w.act
        fsdp2 = w.mem_opts.framework == "fsdp2"
        out = w.out_bytes if fsdp2 else 0.0  # Megatron frees them; DeepSpeed's as counted
        best: tuple = ()
        for moment, (held, outs) in zip(("block", "loss"), _last_rank_moments(
                pp, w.v, w.m_run, tuple(layers), act, grad, out, w.extra_warm, odd)):
            mult = (held - grad * n) / (act * n)  # beside every layer's gradients, as weighted
            kept = out * outs + w.recv[r] if fsdp2 else w.outputs[r]
            moments = [None] * r + [moment]
            per_layer, fixed = self._stage_memories(w, weighted[:r] + [mult], [r],
                                                    walked[:r] + [kept], moments)
            total = w.n[r] * per_layer[r] + fixed[r]
            if not best or total > best[0]:
                best = (total, mult, kept, moments)
        _, weighted[r], walked[r], moments = best
        return moments


@functools.lru_cache(maxsize=8192, typed=True)
def _last_rank_moments(pp: int, v: int, m: int, layers: tuple[int, ...], act: float,
                       grad: float, out: float, extra: int, odd: float) -> tuple:
    """memory_pipeline.last_rank_moments, memoised process-wide as estimate_pieces.py's walks
    are (the searches of one command repeat them)."""
    return memory_pipeline.last_rank_moments(pp, v, m, list(layers), act, grad, out, extra,
                                             odd)
