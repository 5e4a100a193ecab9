"""What a pipelined rank holds, counted once each: the rehearsal's tracker on a rank of
several stages (torch's V), and torch's PipelineStage receive buffers (rehearse/,
planner/memory_pipeline.py). Small models: each rehearsal is a few seconds."""

from __future__ import annotations

import pytest


# torch's own zero-bubble backward (pipelining/_backward.py) reads a non-leaf .grad: said once
# by the rehearsal of torch's V, which runs in this process
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")

MODEL = dict(name="small", layers=6, hidden=512, heads=8, kv_heads=4, ffn_hidden=1408,
             vocab=8000, max_seq=1024)
BASE = dict(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute="none", sp=False,
            dtype="bf16", global_batch=32, seq_len=512, model="small")

def _raw_rehearsal(model: dict, base: dict, knobs: dict, rank: int) -> dict:
    """One rank's rehearsal with the tracker's own categories at the peak and the optimizer's
    state bytes, read through two wrapped functions of meshtron.rehearse.step (restored
    after: the rehearsal runs in this process, suite time, not a child's torch import)."""
    import meshtron.rehearse.step as step
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.plan import as_plan
    from meshtron.rehearse.rank import rehearse_rank

    raw, states = {}, []
    folded, held = step.categories, step.state_bytes

    def spy(snapshot, host=()):  # the tracker's categories at the peak, read, not changed
        for snap in snapshot.values():
            raw.update({getattr(k, "value", k): v for k, v in snap.items()})
        return folded(snapshot, host)

    def spy_states(optimizer):
        states.append(held(optimizer))
        return states[-1]

    spec = ModelSpec(**model)
    plan = as_plan({**base, **knobs}).validate(8, spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step, "categories", spy)
        mp.setattr(step, "state_bytes", spy_states)
        r = rehearse_rank(spec, plan, rank, "cpu")
    return dict(raw=raw, states=states[-1], peak=r["peak_bytes"], stages=r["stages"])


RECEIVE_CASES = {"m=4": (dict(schedule="1f1b", global_batch=32), 4),
                 "m=8": (dict(schedule="1f1b", global_batch=64), 4)}


@pytest.fixture(scope="module")
def rehearsals() -> dict:
    """Both tests' rehearsals, in this process (a child imported torch again; suite time)."""
    return {"receive buffers": _peaks(dict(MODEL, layers=2), BASE, RECEIVE_CASES),
            "raw zbv rank 4": _raw_rehearsal(MODEL, BASE, dict(schedule="zbv"), 4)}


def test_a_second_stage_parameters_are_counted_once(rehearsals):
    """On a rank of two stages (torch's V, pp=2: stages 1 and 2 on pipeline rank 1) the
    tracker files the second stage's parameter shards as parameters, not as optimizer states
    (where AdamW's in-place updates would first show them), and nothing adds them again:
    its optimizer category is AdamW's states exactly (before: states + the second stage's
    shards, 5.6 MiB here, and the same shards added again as `untracked`)."""
    r = rehearsals["raw zbv rank 4"]
    assert r["stages"] == [1, 2]
    raw, peak = r["raw"], r["peak"]
    # the states and nothing else (AdamW's 4-byte step counters are tracked as states too)
    assert raw["OptState"] == pytest.approx(r["states"], abs=4096)
    assert peak["optimizer"] == pytest.approx(r["states"], abs=4096)
    # every parameter shard of both stages is a parameter: fp32 shards, AdamW's two fp32
    # states per element, so the parameters are half the states (plus the buffers)
    assert raw["Sharded Param"] == pytest.approx(r["states"] / 2, abs=4096)
    assert peak["params"] == raw["Sharded Param"] + raw["Buffer"]
    assert peak["total"] == raw["Total"]


def _peaks(model: dict, base: dict, cases: dict) -> dict:
    """Each case's rehearsed peak total (exact) of one rank."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.plan import as_plan
    from meshtron.rehearse.rank import rehearse_rank

    out = {}
    for name, (knobs, rank) in cases.items():
        spec = ModelSpec(**model)
        plan = as_plan({**base, **knobs}).validate(8, spec)
        out[name] = rehearse_rank(spec, plan, rank, "cpu", exact=True)["peak_bytes"]["total"]
    return out


def test_a_stage_holds_a_receive_buffer_per_micro_batch(rehearsals):
    """torch's PipelineStage makes one input buffer per micro-batch of the step on a
    non-first stage and keeps them all (rehearse/pipeline_step.py `ReceiveBuffers`): the
    last stage of a 2-stage 1F1B pipeline holds the same at its peak whatever m, except 4
    more [2, 512, 512] bf16 buffers (1 MiB each) for 4 more micro-batches, and the batch's
    4 more rows of token ids and targets (int64). Before, received inputs were freed after
    their backward: only the token ids grew."""
    r = rehearsals["receive buffers"]
    buffer = 2 * 512 * 512 * 2
    ids = 2 * (4 * 2) * 512 * 8  # tokens and targets: 4 micro-batches of 2 rows more
    assert r["m=8"] - r["m=4"] == pytest.approx(4 * buffer + ids, abs=4096)


def test_planner_counts_the_receive_buffers_torch_keeps():
    """memory_pipeline.receive_buffers: per rank, m inputs per non-first stage and m output
    gradients per non-last stage, less those counted elsewhere."""
    from meshtron.planner.memory_pipeline import receive_buffers

    # 1F1B, 2 ranks, m = 8: rank 0 receives 8 gradients (one already counted beside the
    # kept outputs), rank 1 keeps 8 inputs; with a fused norm the 2 in flight on rank 1 are
    # the first block's saved inputs already
    assert receive_buffers(2, 1, 8, "1f1b", [2.0, 1.0], False, [1.0, 0.0]) == [7.0, 8.0]
    assert receive_buffers(2, 1, 8, "1f1b", [2.0, 1.0], True, [1.0, 0.0]) == [7.0, 7.0]
    # torch's V, 2 ranks: rank 0 holds stages 0 and 3 (3 receives inputs, 0 gradients),
    # rank 1 stages 1 and 2 (both receive both)
    assert receive_buffers(2, 2, 8, "zb", [0.0, 0.0], False, [0.0, 0.0]) == [16.0, 32.0]
    assert receive_buffers(1, 1, 8, "1f1b", [1.0], False, [0.0]) == [0.0]
