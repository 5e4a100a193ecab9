"""What `meshtron plan` says its memory figure was checked against, per stack (report
.memory_check): only meshtron's runtime is rehearsed (tests/test_rehearse.py's 5% table); a
Megatron, DeepSpeed or torchtitan plan's text and JSON must not borrow that rehearsal's word."""

from __future__ import annotations

import json

import pytest

from meshtron.cli import main

ARGS = ["plan", "--model", "llama3-405b", "--cluster", "dgx-h100:2", "--layout",
        "tp=8,pp=2,dp=1", "--global-batch", "8", "--seq-len", "8192", "--recompute", "full",
        "--zero", "0"]


def _plan(capsys, framework: str) -> tuple[dict, str]:
    rc = main(ARGS + ["--framework", framework, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    return json.loads(out), err


@pytest.mark.parametrize("framework, checked, warned", [
    ("meshtron", "within 5% of a rehearsal of meshtron's runtime",
     "the memory model is within 5% of a rehearsal of meshtron's runtime; `--rehearse`"),
    ("torchtitan", "FSDP2's layout, which a rehearsal of meshtron's runtime checks within 5%; "
     "torchtitan@2025's own code is not rehearsed",
     "torchtitan@2025's memory is modelled, not rehearsed (checked: FSDP2's layout"),
    ("megatron", "term by term against Megatron-Core's and Transformer Engine's code, not "
     "against a rehearsal or a run",
     "megatron@2024's memory is modelled, not rehearsed (checked: term by term against "
     "Megatron-Core's"),
])
def test_each_stack_says_what_its_figure_was_checked_against(capsys, framework, checked,
                                                              warned):
    doc, err = _plan(capsys, framework)
    assert doc["fits"] is False and doc["memory_checked"] == checked
    assert warned in doc["warnings"][-1] and warned in err
    if framework != "meshtron":  # no stack but meshtron's own is vouched for by the 5%
        assert "the memory model is within 5%" not in err


def test_deepspeed_says_nothing_was_checked(capsys):
    doc, err = _plan(capsys, "deepspeed")
    assert doc["memory_checked"] is None
    assert all("rehearsal of meshtron" not in w for w in doc["warnings"])
