"""meshtron's `half` recomputation on a 1F1B stage and an unpipelined model of an odd layer
count (planner/estimate_half.py `_half_stages`): what the planner prices, checked against
counts made here from the same plan under `none` and `full` (the two kinds of block `half`
mixes), not from the code under test. The rehearsal rows are tests/test_rehearse.py's
HALF_STAGES (slow)."""

from __future__ import annotations

import pytest

from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.plan import as_plan
from meshtron.rehearse import compare


def _stage(layers: int, pp: int, rank: int, recompute: str, schedule: str = "1f1b"):
    """The planner's breakdown of pipeline rank `rank` of 'mid' (the rehearsal table's model)
    at `layers`, ZeRO-1 over 8 GPUs, micro-batch 2, global batch 32, with meshtron's runtime
    options on the CPU's kernels, as `meshtron rehearse` asks."""
    spec = ModelSpec(name="mid", layers=layers, hidden=2048, heads=16, kv_heads=4,
                     ffn_hidden=5632, vocab=32000, max_seq=4096)
    plan = as_plan(dict(tp=1, pp=pp, dp=8 // pp, zero=1, micro_batch=2, recompute=recompute,
                        sp=False, dtype="bf16", global_batch=32, seq_len=2048, model="mid",
                        schedule=schedule)).validate(8, spec)
    plan = compare.with_layer_split(plan, spec)
    est = compare.planner_estimate(spec, resolve_cluster("dgx-h100:1"), plan, "cpu",
                                   stage=rank)
    return est.memory, est.stage_layers[rank]


def _held(bd) -> float:
    """Stored activations of every in-flight micro-batch plus the kept chunk outputs, GiB."""
    return bd.activations + bd.in_flight


@pytest.mark.parametrize("layers, pp, rank, schedule", [
    (5, 1, 0, "1f1b"), (7, 1, 0, "1f1b"), (6, 1, 0, "1f1b"),
    (10, 2, 0, "1f1b"), (10, 2, 1, "1f1b"), (12, 2, 0, "1f1b"),
    (12, 4, 0, "1f1b"), (12, 4, 3, "1f1b")])
def test_half_stage_stores_its_even_blocks_whole(layers, pp, rank, schedule):
    """Blocks 0, 2, ... of the stage stored whole (as under `none`), 1, 3, ... by their
    input (as under `full`), on every micro-batch the stage holds (1F1B: p - s of them,
    unpipelined one), beside the same kept outputs as under `none`. (GPipe's stages are
    priced at their own moments, whose in-flight row also carries the gradients not yet
    made: tests/test_memory_gpipe.py.)"""
    none, n = _stage(layers, pp, rank, "none", schedule)
    full, _ = _stage(layers, pp, rank, "full", schedule)
    half, _ = _stage(layers, pp, rank, "half", schedule)
    m = 32 // (8 // pp * 2)
    micro = 1 if pp == 1 else m if schedule == "gpipe" else min(m, pp - rank)
    a_none, a_full = none.activations / n, full.activations / n  # one block, one micro-batch
    outputs = _held(none) - micro * n * a_none
    stored = (n + 1) // 2 * a_none + n // 2 * a_full
    assert _held(half) == pytest.approx(micro * stored + outputs, rel=1e-9)


@pytest.mark.parametrize("layers, pp, rank", [(10, 2, 0), (12, 4, 0), (12, 4, 1)])
def test_odd_half_stage_replays_no_block_beside_the_stored_ones(layers, pp, rank):
    """A stage of an odd count ends in a stored block, whose backward frees its tensors
    before the checkpointed block before it is replayed: the block moment's working set is
    the one without recomputation (rehearsed, pp 2, 10 layers, rank 0: the peak in block
    3's recomputed MLP, after block 4's backward); an even count replays its last block
    before anything is freed: a whole block, as under `full`. Ranks without the loss, whose
    peak is a block's backward."""
    half, n = _stage(layers, pp, rank, "half")
    none, _ = _stage(layers, pp, rank, "none")
    assert n % 2 == 1 and half.logits == 0.0
    assert half.recompute == pytest.approx(none.recompute)
    even, k = _stage(layers + pp, pp, rank, "half")
    full, _ = _stage(layers + pp, pp, rank, "full")
    assert k % 2 == 0
    assert even.recompute == pytest.approx(full.recompute)
    assert even.recompute > half.recompute + 0.3  # GiB: the 'mid' block's saved tensors


@pytest.mark.parametrize("pp, rank", [(1, 0), (2, 0), (2, 1), (4, 0)])
def test_half_stage_memory_grows_with_its_layers(pp, rank):
    """The split's caps assume it (estimate_half.half_cap): one layer more never holds less,
    odd or even, here on the rank's stage given 1 to 9 layers (the others 3 each)."""
    totals = []
    for k in range(1, 10):
        spec = ModelSpec(name="mid", layers=k + 3 * (pp - 1), hidden=2048, heads=16,
                         kv_heads=4, ffn_hidden=5632, vocab=32000, max_seq=4096)
        split = [3] * pp
        split[rank] = k
        knobs = dict(stage_layers=split) if pp > 1 else {}
        plan = as_plan(dict(tp=1, pp=pp, dp=8 // pp, zero=1, micro_batch=2, recompute="half",
                            sp=False, dtype="bf16", global_batch=32, seq_len=2048,
                            model="mid", schedule="1f1b", **knobs)).validate(8, spec)
        est = compare.planner_estimate(spec, resolve_cluster("dgx-h100:1"), plan, "cpu",
                                       stage=rank)
        assert est.stage_layers[rank] == k
        totals.append(est.memory.total)
    assert all(b > a for a, b in zip(totals, totals[1:])), totals
