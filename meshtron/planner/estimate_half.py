"""meshtron's `half` recomputation on model parts of an odd layer count (estimate.Evaluator's
mixin).

meshtron checkpoints blocks 1, 3, ... of each model part (parallel/recompute.py: `i % 2 == 1`
over the part's own `layers`), so a part of an odd count n stores (n + 1) / 2 blocks whole, not
n / 2 (memory_pipeline.half_odd_bytes), and ends in a stored block: its backward frees that
block's saved tensors before torch's non-reentrant checkpoint replays block n - 2 into their
space (memory_pipeline.half_recomputes_first), so its fullest backward moment holds no
replayed block beside the saved ones. The two move together: the stored extra on every
micro-batch the part holds, the working-set drop on its block moment only.

* an interleaved rank's chunks (`_half_blocks`, with the walk of memory_pipeline.py:
  branch ilvhalf, docs/measurements.md "`half` on odd interleaved chunks");
* a 1F1B or GPipe stage and an unpipelined model (`_half_stages`): the stage's in-flight
  micro-batches each hold the extra, the block moment drops to the plain working set.
  Rehearsed ('mid', half, ZeRO-1; docs/measurements.md "`half` on odd 1F1B stages"): pp 1 with
  5 and 7 layers peaks at its loss (the head's backward) with every block's tensors stored,
  -3.7% and -3.0% at the mean per layer; pp 2 1F1B, 10 layers (stages of 5), the last stage
  at its loss -2.6%, the first in block 3's recomputed MLP after block 4's backward.

Only for stacks that count `half` per model part (MemoryOptions.half_per_part: meshtron's
rule, the default of FSDP2 stacks); torchtitan's rank-wide counter and Megatron's and
DeepSpeed's `half` keep the mean.
"""

from __future__ import annotations

from meshtron.planner import memory_pipeline
from meshtron.planner.estimate_work import Work
from meshtron.planner.plan import Plan


class HalfRecompute:
    """`_half_odd`, `_half_blocks` (interleaved ranks), `_half_stages` (the others); the time
    of odd parts: `half_replay`, `part_excess`."""

    def half_replay(self, cfg: Plan, mean: tuple[float, ...]) -> tuple[float, ...]:
        """Under meshtron's `half` (FSDP2 stacks), the seconds one replayed block adds per
        micro-batch to each of `mean`: the plan's per-layer (compute, tensor-parallel
        communication, weight-gradient part, expert all-to-alls), or a prefix of them, which
        count half a replay per block (compute_parts.recompute_share; zero bubble's W groups,
        zb_recompute.weight_pass_recompute, and the MoE part, estimate_pieces._moe, alike):
        twice their excess over no recomputation. A part's seconds are then its blocks at the
        mean plus `part_excess` of these. Zeros for other modes and stacks (Megatron's and
        DeepSpeed's `half` stays the mean, as its memory does: `_half_odd`)."""
        if cfg.recompute != "half" or not self.mem.half_per_part:
            return (0.0,) * len(mean)
        args = (cfg.tp, cfg.micro_batch, cfg.sp, "none", cfg.cp, cfg.dtype, cfg.ep,
                cfg.fp8_recipe)
        none = self._micro(*args, cfg.etp)
        window = self._cache[("window", *args)]
        a2a = self._moe(cfg.micro_batch, "none", cfg.cp, cfg.dtype, cfg.ep, cfg.tp, window,
                        cfg.etp)[2]
        base = (none.layer, none.layer_tp, none.layer_wgrad, a2a)
        return tuple(2.0 * (x - y) for x, y in zip(mean, base))

    @staticmethod
    def part_excess(rec: str, parts) -> float:
        """Blocks replayed beyond the mean by model parts of `parts` blocks each (one pipeline
        rank's chunks): compute_parts.replayed_blocks, -1/2 per odd part under `half`, none
        under the other modes (asked per rank and chunk of every evaluation: counted here
        directly; tests/test_half_time.py holds it to replayed_blocks)."""
        if rec != "half":
            return 0.0
        return -0.5 * sum(k & 1 for k in parts)

    def _half_odd(self, w: Work) -> tuple[float, float | None]:
        """Under `half` recomputation, (what a chunk of an odd layer count holds beyond `act`
        per layer, memory_pipeline.half_odd_bytes: the part's blocks 0, 2, ... stored; the
        block moment's working set of a backward that starts on a stored block, the one
        without recomputation: `_half_blocks`). meshtron's rule (FSDP2 stacks); Megatron's
        and DeepSpeed's `half` are priced at the mean as before (their own per-chunk rules
        not checked here): (0, None)."""
        if w.rec != "half" or not w.mem_opts.half_per_part:
            return 0.0, None
        cfg = w.cfg
        none, full = (self._memory_pieces(w.tp, w.mb, cfg.sp, r, cfg.dtype, w.cp, w.ep, w.pp,
                                          cfg.fp8_recipe, cfg.etp) for r in ("none", "full"))
        return memory_pipeline.half_odd_bytes(none[1], full[1]), none[2]

    def _half_blocks(self, w: Work, chunks: list[int], walk: bool = True, act: float = 0.0,
                     grad: float = 0.0, odd: float = 0.0) -> list:
        """w.blocks with each pipeline rank's block moment under meshtron's `half`: a chunk
        of an odd layer count (or none) runs its backward without a recomputed block beside
        its saved activations, its checkpointed block recomputed into the space its stored
        last block's tensors left (memory_pipeline.half_recomputes_first); on a rank of
        both kinds the walk finds whose backward comes with the peak
        (memory_pipeline.backward_work, with the walk's `act`, `grad` and `odd`), or, not
        `walk`, the smaller (a lower bound: `_walk_may_fit`)."""
        plain = self._half_odd(w)[1]
        if plain is None:
            return w.blocks
        p, v, out = w.pp, w.v, []
        for r, b in enumerate(w.blocks):
            layers = [chunks[c * p + r] for c in range(v)]
            works = [b[3] if memory_pipeline.half_recomputes_first(n) else min(b[3], plain)
                     for n in layers]
            if len(set(works)) > 1:
                work = (memory_pipeline.backward_work(p, v, w.m_run, r, layers, works, act, grad,
                                                      w.extra_warm, odd)
                        if walk else min(works))
            else:
                work = works[0]
            out.append(b if work == b[3] else (b[0], b[1], b[2], work))
        return out

    def _half_unwalked(self, w: Work) -> bool:
        """Whether `_half_stages` prices the plan: meshtron's `half` on one model part per
        rank (no interleaved walk; torch's zero bubble walks its own, memory_zb.py)."""
        return (w.v == 1 and w.rec == "half" and w.mem_opts.half_per_part
                and not (w.cfg.schedule == "zb" and w.pp > 1))

    def _half_deltas(self, w: Work) -> list[float]:
        """Per pipeline rank under `_half_unwalked`, the bytes a stage of an odd layer count
        holds beyond its memory at the mean per layer (`w.per_layer`, `w.fixed`): the stored
        extra on each micro-batch in flight, less the block moment's drop (its fixed part
        with the plain working set; the fixed part is the larger of the loss's and the
        block's moments, so the drop is zero where the loss's is the peak). What `_split`
        chooses and checks the layer split with (`half_cap`)."""
        odd, plain = self._half_odd(w)
        kept = w.blocks
        w.blocks = [(b[0], b[1], b[2], min(b[3], plain)) for b in kept]
        try:
            fixed = self._stage_memories(w, w.inflight)[1]
        finally:
            w.blocks = kept
        return [k * odd + f - f0 for k, f, f0 in zip(w.inflight, fixed, w.fixed)]

    def _half_stages(self, w: Work) -> None:
        """Every rank of an odd layer count (`w.n`) under `_half_unwalked`: its in-flight
        multiplier with the stored extra per micro-batch (`half_odd_bytes`, as a share of
        the rank's `act` x layers, as memory_pipeline.weighted_in_flight converts it) and
        its block moment's working set without a replayed block; then the stages' memory
        and whether the split fits (w.fits)."""
        odd, plain = self._half_odd(w)
        changed = [r for r, k in enumerate(w.n) if k % 2 and w.blocks[r][2]]
        if not changed:
            return
        # copies: `w.inflight` is the evaluator's cached list, `w.blocks` may be shared
        w.inflight, w.blocks = list(w.inflight), list(w.blocks)
        for r in changed:
            b = w.blocks[r]
            w.inflight[r] *= 1.0 + odd / (b[2] * w.n[r])
            w.blocks[r] = (b[0], b[1], b[2], min(b[3], plain))
        w.per_layer, w.fixed = self._stage_memories(w, w.inflight, changed)
        w.fits = all(k * a + f <= w.budget for k, a, f in zip(w.n, w.per_layer, w.fixed))


def half_cap(cap: int, per_layer: float, fixed: float, odd: float, budget: float) -> int:
    """The most layers a stage fits under meshtron's `half` (`budget` bytes), from `cap`, the
    most at the mean per layer: with an odd count the stage holds `odd` more
    (`HalfRecompute._half_deltas`). Memory still grows with the count (an odd count holds
    less than the even one above it: a checkpointed block, not a stored one, is missing;
    more than the even one below: it adds a stored block on every micro-batch in flight,
    whose saved tensors are at least the working set's drop, a replayed block's), so every
    count up to the cap fits (tests/test_memory_half.py walks it)."""
    if cap % 2 and cap * per_layer + fixed + odd > budget:
        return cap - 1
    if not cap % 2 and (cap + 1) * per_layer + fixed + odd <= budget:
        return cap + 1
    return cap
