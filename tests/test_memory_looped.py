"""Looped BFS's memory (gpipe with v > 1; planner/memory_gpipe.py `looped_moments`,
estimate_gpipe.py `_looped_rank`): each rank runs every forward of its first chunk, then of
the next, ..., then the backwards chunk by chunk in reverse, so its fullest moment holds every
chunk's activations and no accumulated gradient, and the last rank every micro-batch's loss
tensors. Checked against a block-by-block walk of torch's own order
(ScheduleLoopedBFS._calculate_single_rank_operations) and, end to end, by the rehearsal rows
of tests/test_rehearse.py (LOOPED_STAGES fast, LOOPED_SLOW)."""

from __future__ import annotations

import itertools

import pytest

from meshtron.model.spec import ModelSpec
from meshtron.planner import memory, memory_gpipe
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan

MID = ModelSpec(name="mid", layers=8, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
                vocab=32000, max_seq=4096)
PLAN = Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute="none", schedule="gpipe",
            virtual_stages=2, dtype="bf16")


def _torch_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, local chunk, micro-batch) of pipeline rank `rank` under torch 2.13's
    ScheduleLoopedBFS: its own per-rank list, made without stages or a process group."""
    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS

    sched = object.__new__(ScheduleLoopedBFS)
    sched._stages, sched.pp_group_size, sched._n_microbatches = [None] * v, p, m
    out = []
    for a in sched._calculate_single_rank_operations(rank):
        if a is not None:
            kind = "F" if str(a.computation_type).endswith("FORWARD") and \
                "BACKWARD" not in str(a.computation_type) else "B"
            out.append((kind, a.stage_index // p, a.microbatch_index))
    return out


def _walk(order, layers: list[int], act: float, grad: float) -> float:
    """Most bytes of stored activations and accumulated gradients held at the start of a
    block's backward, walking `order` block by block: a forward stores `act` per block of its
    chunk, a backward runs the chunk's blocks from the last down, each making its gradient
    accumulator at the chunk's first backward (FSDP2's post-backward) and freeing its
    activations."""
    now = best = 0.0
    done = set()
    for kind, c, _ in order:
        if kind == "F":
            now += act * layers[c]
            continue
        for _ in range(layers[c]):
            best = max(best, now)
            now += grad if c not in done else 0.0
            now -= act
        done.add(c)
    return best


def test_looped_moments_are_the_walk_of_torchs_order():
    """The largest held of looped_moments is the block walk of torch's own order, for uneven
    chunks and regimes where activations or gradients dominate; the first backward never
    holds a gradient beside every micro-batch (the linear model's moment)."""
    for (p, v), m, layers, act, grad in itertools.product(
            ((2, 2), (2, 3), (4, 2), (3, 4)), (1, 2, 4, 7), ((2, 2, 3, 1), (1, 3, 2, 2)),
            (1.0, 5.0), (0.5, 3.0, 9.0)):
        chunks = list(layers[:v]) + [2] * max(0, v - len(layers))
        for rank in (0, p - 1):
            got = memory_gpipe.looped_moments(
                m, chunks, [act * n for n in chunks], [grad * n for n in chunks], 0.0, 0.0,
                False, False, [0.0] * v)
            walk = _walk(_torch_order(p, v, m, rank), chunks, act, grad)
            assert max(h for h, *_ in got) == pytest.approx(walk), (p, v, m, chunks, rank)
            linear = m * act * sum(chunks) + grad * sum(chunks)
            assert all(h < linear for h, *_ in got)


def test_every_chunks_moment_is_beside_what_the_others_hold():
    """Chunk c's GPipe moments (gpipe_moments) sit on all m micro-batches of the chunks below
    it and the gradients of those above; the last chunk's carries the loss, the head's
    gradient is beside every earlier chunk's moment, and a chunk's second backward holds one
    micro-batch fewer (its count, which the kept outputs follow)."""
    m, layers, per_mb, grads = 4, [2, 3], [10.0, 15.0], [4.0, 6.0]
    got = memory_gpipe.looped_moments(m, layers, per_mb, grads, 2.0, 3.0, True, False,
                                      [0.0, 0.0], head_grads=1.0)
    last = [(h, n, mo) for h, c, n, mo in got if c == 1]
    first = [(h, n, mo) for h, c, n, mo in got if c == 0]
    below = m * per_mb[0]
    assert last[0] == (below + m * 15.0 + (m - 1) * 3.0 + 1.0, m, "loss")
    assert last[-1] == (below + (m - 1) * 15.0 + 6.0 + 2.0 + (m - 2) * 3.0, m - 1, None)
    assert first[0] == (m * 10.0 + 6.0 + 2.0, m, "block")
    assert first[-1] == ((m - 1) * 10.0 + 4.0 + 6.0 + 2.0, m - 1, "block")


def _evaluator(batch: int = 32, seq: int = 2048) -> Evaluator:
    return Evaluator(MID, preset_cluster("dgx-h100", 1), batch, seq)


def _work(ev: Evaluator, plan: Plan):
    w = ev._inputs(plan)
    ev._states(w)
    ev._memory_model(w)
    ev._split(w, True, False)
    return w


def test_last_rank_grows_by_each_micro_batch_loss_tensors():
    """Doubling the micro-batches (4 -> 8) adds to the last rank, at its last chunk's first
    backward, each new micro-batch's activations of every local layer and its loss tensors
    (loss_saved_bytes: meshtron's chunked loss, its fp32 weight-gradient accumulator and
    input gradient, the final norm's saved input), and the first chunk's output and its
    output gradient's receive buffer: the linear model of a looped rank held one micro-batch's loss (rehearsed with the
    whole-logits loss the last stage ran before branch ppfix, 'mid' pp 2, v 2, m 4 -> 8:
    11.533 -> 20.936 GiB; the old planner 10.053 -> 16.214, that one 11.578 -> 20.669)."""
    small, large = (_evaluator(b).evaluate(PLAN, stage=1).memory for b in (32, 64))
    w = _work(_evaluator(), PLAN)
    # the fp32 accumulator, the bf16 input gradient and the final (fused) norm's saved input
    saved = 4.0 * MID.vocab * MID.hidden + 2 * (2.0 * 2 * 2048 * MID.hidden)
    assert memory_gpipe.loss_saved_bytes(MID, 1, 2, 2048, w.mem_opts) == saved
    per_mb = w.n[1] * w.act + saved
    grew = (large.allocated - small.allocated) * memory.GIB
    assert 4 * per_mb * (1 - 1e-12) <= grew <= 4 * (per_mb + 2 * w.out_bytes) + 1.0


def test_first_rank_holds_no_gradient_at_its_fullest_moment():
    """At long sequences the first rank's peak is its last chunk's first backward: every
    chunk's m micro-batches and no accumulated gradient, the in-flight multiplier below m by
    exactly the gradients the linear model counted (rehearsed, 'mid' pp 2, v 2, m 4: 7.484
    GiB; the old planner +12.3%, this one +0.1%)."""
    ev = _evaluator()
    w = _work(ev, PLAN)
    assert w.moments[0] == "block"
    grads = w.accum * (w.p_layer + w.p_exp) * w.n[0]
    assert w.inflight[0] * w.act * w.n[0] == pytest.approx(
        w.m * w.act * w.n[0] - grads - w.accum * w.roots[0], rel=1e-9)
    assert w.inflight[0] < w.m  # the linear model's multiplier: m beside every gradient
