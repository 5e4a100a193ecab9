"""memory_pipeline's walks (held_bytes, peak_outputs) against a step-by-step walk of the
interleaved 1F1B order written independently here: equal to the last bit, for random layer
counts and byte sizes (the planner's answers must not move when the walks are sped up).

Walks of many micro-batches (m a multiple of p, beyond `walked_microbatches`) agree to rounding,
not to the bit: the running sums of one repeat of the order and the next differ in their last
bits (x + a - a is not always x), so the walk of all m micro-batches may find its peak a few ulps
from the walk of a few rounds (under 1e-13 of a stage's bytes)."""

from __future__ import annotations

import functools
import random

import pytest

from meshtron.planner import memory_pipeline


def _reference(p, v, m, s, layers, act, grad, out, extra):
    """(most bytes held, outputs held at that moment): forward k, then backward k - warm;
    a chunk's gradients appear at its first backward; a chunk that sends holds its output
    from its forward and the received gradient during its backward."""
    per_round = m // max(1, m // p)
    total = m * v
    warm = min((v - 1) * per_round + 2 * (p - 1 - s) + extra, total)
    sends = [c * p + s != p * v - 1 for c in range(v)]
    seen = set()
    moments = []  # (bytes, outputs) after each step
    now, outs = 0.0, 0

    def step(delta, d_outs):
        nonlocal now, outs
        now += delta
        outs += d_outs
        moments.append((now, outs))

    for k in range(total + warm):
        if k < total:
            c = (k // per_round) % v
            step(act * layers[c] + (out if sends[c] else 0.0), 1 if sends[c] else 0)
        b = k - warm
        if 0 <= b < total:
            c = v - 1 - (b // per_round) % v
            first = c not in seen
            seen.add(c)
            g = grad * layers[c] if first else 0.0
            if sends[c]:
                step(g + out, 1)
                step(-act * layers[c] - 2.0 * out, -2)
            else:
                step(g, 0)
                step(-act * layers[c], 0)
    best, best_outs = 0.0, 0
    for x, o in moments:  # the first moment of the largest
        if x > best:
            best, best_outs = x, o
    return best, best_outs


@pytest.mark.parametrize("seed", range(4))
def test_walks_equal_a_step_by_step_walk(seed):
    rng = random.Random(seed)
    for _ in range(300):
        p, v = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 6])
        m, s = rng.randint(1, 5 * p + 3), rng.randrange(p)
        layers = [rng.randint(0, 4) for _ in range(v)]
        act, out = rng.uniform(0.1, 3.0), rng.uniform(0.0, 2.0)
        grad = rng.choice([0.0, rng.uniform(0.0, 5.0)])
        extra = rng.choice([0, 1])
        held, _ = _reference(p, v, m, s, layers, act, grad, 0.0, extra)
        got = memory_pipeline.held_bytes(p, v, m, s, layers, act, grad, extra)
        assert got == (held if memory_pipeline.walked_microbatches(p, v, m, extra) == m
                       else pytest.approx(held, rel=1e-13))  # the module docstring
        _, outs = _reference(p, v, m, s, layers, act, grad, out, 0)
        assert memory_pipeline.peak_outputs(p, v, m, s, layers, act, grad, out) == outs


def test_half_recomputation_odd_chunks_hold_a_stored_block_more():
    """meshtron's `half` stores blocks 0, 2, ... of each model part (parallel/recompute.py),
    so a chunk of 3 layers holds 2 stored and 1 checkpointed block per micro-batch, half a
    (stored - checkpointed) block above 3 x their mean: the walk adds `odd` per chunk-micro-
    batch of an odd chunk and nothing for even ones. Pipeline rank 0 of p=2, v=2, m=4 holds
    warm-up (1 round of 2 + 2) + 1 = 5 chunk-micro-batches at its peak."""
    none, full = 10.0, 2.0
    odd = memory_pipeline.half_odd_bytes(none, full)
    assert odd == 4.0  # (2 x 10 + 2) - 3 x 6: what a 3-block part holds beyond the mean
    mean = (none + full) / 2
    base = memory_pipeline.held_bytes(2, 2, 4, 0, [3, 3], act=mean)
    assert base == 5 * 3 * mean
    assert memory_pipeline.held_bytes(2, 2, 4, 0, [3, 3], act=mean, odd=odd) == base + 5 * odd
    assert (memory_pipeline.held_bytes(2, 2, 4, 0, [4, 4], act=mean, odd=odd)
            == memory_pipeline.held_bytes(2, 2, 4, 0, [4, 4], act=mean))


def _last_rank_reference(p, v, m, layers, act, grad, out, extra):
    """The last rank's (fullest, loss) moments as (held, outputs), step by step: forward k,
    then backward k - warm; the loss moment is the start of a backward of chunk v - 1 (the
    last virtual stage), before its first backward makes its gradients; chunks 0 .. v - 2
    hold their outputs from forward to backward (the received gradients are the receive
    buffers', not counted here). Each kind's first moment of the largest held + outputs."""
    per_round = m // max(1, m // p)
    total = m * v
    warm = min((v - 1) * per_round + extra, total)
    held, outs, seen = 0.0, 0, set()
    fullest, loss = [], []
    for k in range(total + warm):
        if k < total:
            c = (k // per_round) % v
            held += act * layers[c]
            outs += c != v - 1
            fullest.append((held, outs))
        b = k - warm
        if 0 <= b < total:
            c = v - 1 - (b // per_round) % v
            if c == v - 1:
                loss.append((held, outs))
            if c not in seen:
                seen.add(c)
                held += grad * layers[c]
                fullest.append((held, outs))
            held -= act * layers[c]
            outs -= c != v - 1

    def largest(moments):
        best = moments[0]
        for x in moments:
            if x[0] + x[1] * out > best[0] + best[1] * out:
                best = x
        return best

    return largest(fullest), largest(loss)


@pytest.mark.parametrize("seed", range(3))
def test_last_rank_moments_equal_a_step_by_step_walk(seed):
    """memory_pipeline.last_rank_moments against the reference above, for random schedules,
    layer counts and byte sizes; its fullest moment holds what held_bytes finds on that rank
    (without outputs), and no loss moment holds more than the fullest."""
    rng = random.Random(seed)
    for _ in range(300):
        p, v = rng.choice([2, 3, 4, 8]), rng.choice([2, 3, 4, 6])
        m = rng.randint(1, 5 * p + 3)
        layers = [rng.randint(0, 4) for _ in range(v)]
        act, out = rng.uniform(0.1, 3.0), rng.choice([0.0, rng.uniform(0.0, 2.0)])
        grad, extra = rng.choice([0.0, rng.uniform(0.0, 5.0)]), rng.choice([0, 1])
        got = memory_pipeline.last_rank_moments(p, v, m, layers, act, grad, out, extra)
        want = _last_rank_reference(p, v, m, layers, act, grad, out, extra)
        flat = [x for moment in got for x in moment]
        assert flat == pytest.approx([x for moment in want for x in moment], rel=1e-12), (
            p, v, m, layers, act, grad, out, extra)
        (held, _), (at_loss, _) = memory_pipeline.last_rank_moments(p, v, m, layers, act, grad,
                                                                    0.0, extra)
        assert held == memory_pipeline.held_bytes(p, v, m, p - 1, layers, act, grad, extra)
        assert at_loss <= held


def test_the_uneven_rows_last_rank_holds_less_at_its_loss():
    """tests/test_rehearse.py's 'pp interleaved, uneven chunks' last rank (p 2, v 2, m 12,
    chunks of 2 and 1 layers): its fullest moment holds 6 layer-micro-batches and 3 outputs,
    its loss moments 5 and 2 (the one-layer last chunk's forward comes when a two-layer
    micro-batch of the first chunk has left; hand-walked in docs/measurements.md, ilvlast),
    every chunk's gradients made by then: what the planner adds to the loss's bytes."""
    fullest, loss = memory_pipeline.last_rank_moments(2, 2, 12, [2, 1], 1.0, 0.5, 0.01)
    assert fullest == (6 + 1.5, 3) and loss == (5 + 1.5, 2)


def test_the_last_rank_is_priced_at_its_loss_or_its_fullest_moment():
    """Through the evaluator, the uneven row's plan (6 layers in chunks 1, 2, 2, 1; pipeline
    rank 1 holds the 2- and the 1-layer chunk, the loss on the latter): with a large
    vocabulary its loss moment is the larger and the rank holds its logits beside 5
    layer-micro-batches and 2 kept outputs; with a tiny one its fullest moment is, with no
    logits, 6 and 3 (`test_the_uneven_rows_last_rank_holds_less_at_its_loss`). Against the
    evaluator's own activation and output bytes: the two differ by one layer-micro-batch and
    one output, every other byte the rank holds beside them (receive buffers) the same."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    plan = Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute="none", sp=False,
                schedule="interleaved", virtual_stages=2, dtype="bf16",
                stage_layers=(1, 2, 2, 1))
    held, ev = {}, None
    for vocab in (128000, 512):
        spec = ModelSpec(name="mid", layers=6, hidden=2048, heads=16, kv_heads=4,
                         ffn_hidden=5632, vocab=vocab, max_seq=4096)
        ev = Evaluator(spec, preset_cluster("dgx-h100", 1), 96, 2048)
        bd = ev.evaluate(plan, stage=1).memory
        held[vocab] = ((bd.activations + bd.in_flight) * 2 ** 30, bd.logits, bd.recompute)
    assert held[128000][1] > 0 and held[128000][2] == 0  # the loss's moment: no recompute
    assert held[512][1] == 0  # a block's: no logits
    act = ev._memory_pieces(1, 2, False, "none", "bf16", 1, 1, 2).activations
    out = memory_pipeline.stage_output_bytes(2048, 1, False, 2, 2048, 2.0)
    assert held[512][0] - held[128000][0] == pytest.approx(act + out, rel=1e-9)

def test_half_recomputes_first_only_in_even_chunks():
    """A part of an odd layer count ends in a stored block (blocks 1, 3, ... checkpointed),
    so its backward frees that block before recomputing the checkpointed one; an even one
    ends in a checkpointed block, recomputed before anything is freed."""
    first = memory_pipeline.half_recomputes_first
    assert first(2) and first(4) and not first(1) and not first(3) and not first(0)


def _reference_work(p, v, m, s, layers, works, act, grad, odd):
    """The most (held + the running backward's working set) over the backward moments of
    `_reference`'s order, less the walk's peak."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + 2 * (p - 1 - s), m * v)
    order = [c for c in range(v) for _ in range(per_round)] * (m * v)
    fwd = order[:m * v]
    held = [act * n + (odd if n % 2 else 0.0) for n in layers]
    now = peak = top = 0.0
    seen = set()
    steps = [("F", c) for c in fwd[:warm]]
    for k in range(warm, m * v + warm):
        if k < m * v:
            steps.append(("F", fwd[k]))
        steps.append(("B", v - 1 - fwd[k - warm]))
    for kind, c in steps:
        if kind == "F":
            now += held[c]
        else:
            if c not in seen:  # its first backward makes the chunk's gradients
                seen.add(c)
                now += grad * layers[c]
            peak = max(peak, now)
            top = max(top, now + works[c])
            now -= held[c]
        peak = max(peak, now)
    return top - peak


def test_backward_work_is_the_backward_with_the_peak():
    """`backward_work` against the order walked step by step here, for random chunks whose
    backwards hold different working sets (clamped between the smallest and the largest)."""
    rng = random.Random(7)
    for _ in range(400):
        p, v = rng.randint(2, 5), rng.randint(2, 4)
        m, s = rng.randint(1, 4 * p), rng.randrange(p)
        layers = [rng.randint(0, 5) for _ in range(v)]
        works = [rng.uniform(0.0, 3.0) for _ in range(v)]
        act, grad, odd = rng.uniform(0.1, 2.0), rng.choice([0.0, 1.5]), rng.uniform(0, 1)
        got = memory_pipeline.backward_work(p, v, m, s, layers, works, act, grad, 0, odd)
        want = _reference_work(p, v, m, s, layers, works, act, grad, odd)
        assert min(works) <= got <= max(works)
        assert got == min(max(want, min(works)), max(works))  # to the bit: session 48


def _half_rank(layers: int, rank: int, recompute: str = "half"):
    """The planner's breakdown of pipeline rank `rank` of the rehearsal table's half row
    (tests/test_rehearse.py: 'mid', pp=2 dp=4 ZeRO-1 interleaved:2, m = 4) at `layers`, with
    meshtron's runtime options on the CPU's kernels, as `meshtron rehearse` asks."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.plan import as_plan
    from meshtron.rehearse import compare

    spec = ModelSpec(name="mid", layers=layers, hidden=2048, heads=16, kv_heads=4,
                     ffn_hidden=5632, vocab=32000, max_seq=4096)
    plan = as_plan(dict(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute=recompute,
                        sp=False, dtype="bf16", global_batch=32, seq_len=2048, model="mid",
                        schedule="interleaved", virtual_stages=2)).validate(8, spec)
    plan = compare.with_layer_split(plan, spec)
    return compare.planner_estimate(spec, resolve_cluster("dgx-h100:1"), plan, "cpu",
                                    stage=rank).memory


def test_odd_half_chunks_recompute_into_a_freed_stored_block():
    """Pipeline rank 0 of the half row (chunks of 3): its block moment holds no recomputed
    block beside the stored ones, only the backward's own temporaries, as without
    recomputation (rehearsed: 6.994 GiB, the peak in block 1's recomputed MLP backward;
    the planner read 7.347 with the recomputed block, 6.978 without); chunks of 4 end in a
    checkpointed block, recomputed before anything is freed: kept."""
    odd, plain = _half_rank(12, 0), _half_rank(12, 0, "none")
    assert odd.recompute == pytest.approx(plain.recompute) and plain.recompute > 0
    even, full = _half_rank(16, 0), _half_rank(16, 0, "full")
    assert even.recompute == pytest.approx(full.recompute)  # a whole block replayed
    assert even.recompute > odd.recompute + 0.3  # GiB: the 'mid' block's saved tensors
    # 14 layers, rank 0's chunks of 3 and 4: the peak comes in the 3-layer chunk's backward
    # (rehearsed 7.43 GiB; 7.757 with the 4-layer chunk's recomputed block, 7.387 now);
    # 10 layers, chunks of 2 and 3: in the 2-layer chunk's (rehearsed 5.861, as priced)
    assert _half_rank(14, 0).recompute == pytest.approx(plain.recompute)
    assert _half_rank(10, 0).recompute == pytest.approx(full.recompute)


@pytest.mark.parametrize("vocab,seq,mb,moment", [(256000, 256, 1, "loss"),
                                                 (512, 128, 2, "block")])
def test_the_last_ranks_moments_read_no_negative_memory(vocab, seq, mb, moment):
    """The interleaved last rank priced at one of its moments (estimate_moments.py), with
    short sequences (a layer's fp32 gradient outweighs its activations many times). At the
    loss, which comes before its last chunk's gradients are made, its multiplier beside every
    layer's gradients is negative; at a block's backward, the working set is (the gradients
    it makes outweigh its temporaries, memory_acts.backward_working_bytes). The breakdown
    counts both off the compute copies and accumulated gradients (`gathered`, as
    `peak_moment` does a negative working set), not as negative activations or recompute:
    every part >= 0 (describe() leaves negative ones out), and the parts add up to the
    figure the fit is decided on (`Evaluator._stage_memories`, bit for bit)."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner import memory
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    spec = ModelSpec(name="short", layers=13, hidden=2048, heads=16, kv_heads=8,
                     ffn_hidden=7168, vocab=vocab, max_seq=4096)
    plan = Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=mb, recompute="none", sp=False,
                schedule="interleaved", virtual_stages=2, dtype="bf16")
    ev = Evaluator(spec, preset_cluster("dgx-h100", 1), 8 * mb, seq)
    w = ev._inputs(plan)
    ev._states(w)
    ev._memory_model(w)
    ev._split(w, True, False)
    ev._interleaved_memory(w, True)
    assert w.moments[-1] == moment  # the cases this is about:
    assert w.inflight[-1] < 0 if moment == "loss" else w.blocks[-1][3] < 0
    bd = ev.evaluate(plan, stage=1).memory
    assert min(gib for _, gib in bd.parts()) >= 0, bd.describe()
    assert bd.allocated * memory.GIB == w.n[1] * w.per_layer[1] + w.fixed[1]


def test_walks_of_many_micro_batches_are_those_of_all_of_them():
    """With m a multiple of p the walks read `walked_microbatches` (a few rounds of p) instead
    of m: the same answers as the step-by-step walks of all m micro-batches, to the bit, for
    m up to 24 p (the searches of 32,768 micro-batches walked each rank whole: minutes)."""
    rng = random.Random(54)
    for _ in range(120):
        p, v = rng.choice([2, 3, 4, 8]), rng.choice([2, 3, 4, 6])
        m, s = p * rng.randint(5, 24), rng.randrange(p)
        assert memory_pipeline.walked_microbatches(p, v, m) < m
        layers = [rng.randint(0, 4) for _ in range(v)]
        act, out = rng.uniform(0.1, 3.0), rng.uniform(0.0, 2.0)
        grad, extra = rng.choice([0.0, rng.uniform(0.0, 5.0)]), rng.choice([0, 1, 2 * p * v])
        held, _ = _reference(p, v, m, s, layers, act, grad, 0.0, extra)
        close = functools.partial(pytest.approx, rel=1e-13)  # the module docstring
        assert memory_pipeline.held_bytes(p, v, m, s, layers, act, grad, extra) == close(held)
        _, outs = _reference(p, v, m, s, layers, act, grad, out, 0)
        assert memory_pipeline.peak_outputs(p, v, m, s, layers, act, grad, out) == outs
        got = memory_pipeline.last_rank_moments(p, v, m, layers, act, grad, out, extra)
        want = _last_rank_reference(p, v, m, layers, act, grad, out, extra)
        assert [x for g in got for x in g] == close([x for g in want for x in g])
        works, odd = [rng.uniform(0.0, 3.0) for _ in range(v)], rng.uniform(0, 1)
        want_work = _reference_work(p, v, m, s, layers, works, act, grad, odd)
        assert memory_pipeline.backward_work(p, v, m, s, layers, works, act, grad, 0, odd) == \
            pytest.approx(min(max(want_work, min(works)), max(works)), rel=1e-12, abs=1e-12)

