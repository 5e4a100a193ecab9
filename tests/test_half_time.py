"""meshtron's `half` recomputation's TIME on model parts of an odd layer count: the runtime
checkpoints each part's blocks 1, 3, ... (parallel/recompute.py, `i % 2 == 1` over the part's
own blocks), so a part of n blocks replays n // 2 forwards, not n / 2 (the planner priced
half a block per layer before). Checked against counts made here from the same plan priced
under `none` and `full` (every block replayed once), not from the code under test: the
critical rank's compute under `half` exceeds `none`'s by replays / n of `full`'s excess.
The memory of such parts: tests/test_memory_half.py."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import ModelSpec
from meshtron.planner import frameworks
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute_parts import recompute_share, replayed_blocks
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan
from meshtron.planner.step_pieces import step_pieces


def _model(layers: int) -> ModelSpec:
    return ModelSpec(name="mid", layers=layers, hidden=2048, heads=16, kv_heads=4,
                     ffn_hidden=5632, vocab=32000, max_seq=4096)


def _estimates(split: tuple[int, ...], pp: int, schedule: str | None, v: int = 1,
               framework: str = "meshtron"):
    """(evaluator, {recompute: estimate}) of 'mid' cut as `split` (one entry per virtual
    stage), bf16, ZeRO-1 over the 8 GPUs of one DGX H100, micro-batch 1, 8 micro-batches."""
    fw = frameworks.preset(framework)
    ev = Evaluator(_model(sum(split)), resolve_cluster("dgx-h100:1"), 8 * (8 // pp), 2048,
                   fw.kernel, fw.memory)
    out = {}
    for rec in ("none", "half", "full"):
        plan = Plan(1, pp, 8 // pp, 1, 1, rec, False, schedule, v, dtype="bf16")
        cfg = dataclasses.replace(plan, stage_layers=split if pp > 1 else ())
        out[rec] = ev.evaluate(cfg)
    return ev, out


# (split per virtual stage, pp, schedule, v, forwards the critical rank replays, its blocks)
CASES = [
    ((7,), 1, None, 1, 3, 7),  # unpipelined, odd: 3 of 7 (the mean said 3.5)
    ((6,), 1, None, 1, 3, 6),  # even: unchanged
    ((5, 5), 2, "1f1b", 1, 2, 5),
    ((6, 6), 2, "1f1b", 1, 3, 6),
    ((5, 5), 2, "zb", 1, 2, 5),  # W's per-group replays (zb_recompute.py) too
    ((3, 3, 3, 3), 2, "interleaved", 2, 2, 6),  # two odd chunks per rank: 1 + 1 of 6
]


@pytest.mark.parametrize("split, pp, schedule, v, replays, n", CASES)
def test_half_replays_each_parts_odd_blocks_only(split, pp, schedule, v, replays, n):
    _, est = _estimates(split, pp, schedule, v)
    none, half, full = (est[r].time.compute for r in ("none", "half", "full"))
    assert full > none
    assert half - none == pytest.approx(replays / n * (full - none), rel=1e-9)


@pytest.mark.parametrize("split, pp, schedule, v", [
    ((5, 5), 2, "1f1b", 1), ((3, 3, 3, 3), 2, "interleaved", 2), ((7,), 1, None, 1)])
def test_simulator_pieces_replay_the_same_blocks(split, pp, schedule, v):
    """The simulator's per virtual stage backward (planner/step_pieces.py) counts the same
    replays as the planner: k // 2 of a chunk of k."""
    ev, est = _estimates(split, pp, schedule, v)
    bwd = {r: step_pieces(ev, e).bwd for r, e in est.items()}
    for j, k in enumerate(split):
        extra = bwd["full"][j] - bwd["none"][j]
        assert bwd["half"][j] - bwd["none"][j] == pytest.approx(k // 2 / k * extra, rel=1e-9)


def test_megatron_half_keeps_the_mean():
    """Megatron's `half` is priced at half a block per layer as before (its memory too:
    estimate_half._half_odd); no per-part rule of its is modelled."""
    _, est = _estimates((5, 5), 2, "1f1b", framework="megatron")
    none, half, full = (est[r].time.compute for r in ("none", "half", "full"))
    assert half - none == pytest.approx(0.5 * (full - none), rel=1e-9)


def test_part_excess_is_replayed_blocks_beyond_the_mean():
    """The evaluator's per-rank count (estimate_half.part_excess, written out for speed) is
    compute_parts.replayed_blocks less the mean share, for every mode and set of parts."""
    for rec in ("none", "selective", "half", "full"):
        for parts in ((7,), (6,), (3, 3), (0, 5, 2), (1, 1, 1, 4)):
            want = sum(replayed_blocks(rec, k) - recompute_share(rec) * k for k in parts)
            assert Evaluator.part_excess(rec, parts) == want
