"""The planner's answers do not move when its search is made faster or its modules are cut.

A subset of bench/plan_answers.py (the quick cases: pinned layouts that fit and that do not,
MoE with ep, fp8, cp, offload, Megatron and a refusal), each `meshtron plan ... --json` run
through the CLI entry point and compared field by field with the reference saved before the
speed work (bench/results/plan_answers.json). A deliberate change of physics re-saves the
reference (`python bench/plan_answers.py --save`) in the same commit, with the reason.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from meshtron.model.spec import PRESETS

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("plan_answers", ROOT / "bench" / "plan_answers.py")
plan_answers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_answers)

QUICK = ["pinned-405b-nofit", "pinned-fp8-nofit", "pinned-moe-nofit", "pinned-70b-nofit-tp1",
         "70b-megatron2024-pinned", "deepseek-v3-pinned", "70b-cp-pinned", "8b-offload-fixed",
         "gpt3-zero3-replicate", "mixtral-open", "405b-open-nofit", "tiny-cpu-refused"]


@pytest.mark.parametrize("name", QUICK)
def test_answer_identical_to_reference(name):
    reference = json.loads(plan_answers.REFERENCE.read_text())[name]
    now = json.loads(json.dumps(plan_answers.answer(plan_answers.CASES[name])))
    assert plan_answers.first_difference(reference, now, name) is None


def test_reference_covers_the_kinds_of_answer():
    """The saved reference holds what it claims: pinned layouts that do not fit answered with a
    change that fits, plans that fit, and refusals."""
    reference = json.loads(plan_answers.REFERENCE.read_text())
    assert set(reference) == set(plan_answers.CASES)
    docs = [r["json"] for r in reference.values() if r["exit"] == 0]
    assert any(d["pinned"] and d["fit_change"] for d in docs)
    assert any(d["fits"] for d in docs)
    assert any(r["exit"] == 2 for r in reference.values())


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b", "llama3-8b", "gpt3-175b",
                                  "tiny-moe-ds"])
def test_block_sums_in_closed_form_are_exact(name):
    """ModelSpec sums its blocks by kind (dense first blocks, routed ones after), not block by
    block: the same integers as the per-block sum."""
    m = PRESETS[name]
    for active in (False, True):
        blocks = sum(m.layer_params(i, active) for i in range(m.layers))
        assert m.num_params(active) == m.embedding_params() + blocks + m.head_params()
    matmul = sum(m.attention_params() + m.ffn_params(i, active=True) for i in range(m.layers))
    matmul += m.vocab * m.hidden
    # QK^T at the q/k head size, PV at the value head size (the same for all but MLA)
    attn = 6.0 * m.layers * m.heads * (m.head_dim + m.v_dim) * 4096
    assert m.flops_per_token(4096) == 6.0 * matmul + attn
