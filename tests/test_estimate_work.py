"""`Work` (planner/estimate_work.py), what the steps of `Evaluator.evaluate` hand each other:
every name the steps read or write is a declared field, and a misspelt one fails where it is
written, not when a later step reads it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from meshtron.model.spec import preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.estimate_work import Work
from meshtron.planner.plan import Plan

PLANNER = Path(__file__).resolve().parent.parent / "meshtron" / "planner"
STEPS = ("estimate.py", "estimate_time.py", "estimate_stage.py")


def test_every_name_the_steps_use_is_declared():
    """Read and written attributes of `w` in the evaluate steps, by their source text: a
    name only a rare branch touches (a MoE pipeline, offload) is checked without running it."""
    declared = {f.name for f in dataclasses.fields(Work)} | {
        n for n, v in vars(Work).items() if isinstance(v, property)}  # derived: m_run, ...
    used: set[str] = set()
    for name in STEPS:
        used |= set(re.findall(r"\bw\.(\w+)", (PLANNER / name).read_text()))
    assert used, "no w.<field> found: the steps were renamed, this test reads nothing"
    assert used - declared == set()


def test_a_misspelt_field_fails_where_it_is_written():
    ev = Evaluator(preset("llama3-8b"), preset_cluster("dgx-h100", 1), 64, 2048)
    w = ev._inputs(Plan(tp=2, pp=2, dp=2, zero=1, micro_batch=1))
    with pytest.raises(AttributeError):
        w.host_gpus = 1.0  # host_gpu
    w.host_gpu = 1.0
    assert w.host_gpu == 1.0 and w.m == 64 // (2 * 1)
