"""What a pipelined rank holds, counted once each: the rehearsal's tracker on a rank of
several stages (torch's V), and torch's PipelineStage receive buffers (rehearse/,
planner/memory_pipeline.py). Small models: each rehearsal is a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODEL = dict(name="small", layers=6, hidden=512, heads=8, kv_heads=4, ffn_hidden=1408,
             vocab=8000, max_seq=1024)
BASE = dict(tp=1, pp=2, dp=4, zero=1, micro_batch=2, recompute="none", sp=False,
            dtype="bf16", global_batch=32, seq_len=512, model="small")

RAW = """
import json, sys
import meshtron.rehearse.step as step
from meshtron.model.spec import ModelSpec
from meshtron.planner.plan import as_plan
from meshtron.rehearse.memory import state_bytes
from meshtron.rehearse.rank import rehearse_rank
model, base, knobs, rank = json.loads(sys.argv[1])
raw, states = {}, []
folded, held = step.categories, step.state_bytes
def spy(snapshot, host=()):  # the tracker's own categories at the peak, read, not changed
    for snap in snapshot.values():
        raw.update({getattr(k, "value", k): v for k, v in snap.items()})
    return folded(snapshot, host)
def spy_states(optimizer):
    states.append(held(optimizer))
    return states[-1]
step.categories, step.state_bytes = spy, spy_states
spec = ModelSpec(**model)
plan = as_plan({**base, **knobs}).validate(8, spec)
r = rehearse_rank(spec, plan, rank, "cpu")
print("RESULT" + json.dumps(dict(raw=raw, states=states[-1], peak=r["peak_bytes"],
                                 stages=r["stages"])))
"""


def _raw(knobs: dict, rank: int) -> dict:
    out = subprocess.run([sys.executable, "-c", RAW, json.dumps([MODEL, BASE, knobs, rank])],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_a_second_stage_parameters_are_counted_once():
    """On a rank of two stages (torch's V, pp=2: stages 1 and 2 on pipeline rank 1) the
    tracker files the second stage's parameter shards as parameters, not as optimizer states
    (where AdamW's in-place updates would first show them), and nothing adds them again:
    its optimizer category is AdamW's states exactly (before: states + the second stage's
    shards, 5.6 MiB here, and the same shards added again as `untracked`)."""
    r = _raw(dict(schedule="zbv"), rank=4)
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
