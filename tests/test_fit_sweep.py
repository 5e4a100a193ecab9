"""The planner never rejects a plan whose rehearsal fits (issue 30, item 2), on a small sweep.

bench/fit_sweep.py's quick setting (llama3-8b, one DGX H100 node, tp=8, 8 x 8,192 tokens):
the search's candidates nearest the capacity on either side of its fit decision, each
rehearsed on CPU (one rank, fake tensors). A plan the planner rejects must not fit once
rehearsed: its rehearsed tensors plus the workspace and fragmentation allowance the planner
claims (memory.workspace_bytes) exceed the device. Both sides on the CPU's kernels (the
planner's `fits` as `meshtron rehearse` reports it), and on the GPU's kernels the search
decided on (the rehearsal less the planner's own CPU-only fp32 norm copies, an estimate).

The second test perturbs the fit decision (a tensor budget 10% below the planner's) and checks
that the same check then fails: the sweep can see a wrong rejection. Each rehearses two
plans, ~20-60 s on a loaded machine: slow.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fit_sweep  # noqa: E402


def wrongly_rejected(rows: list[dict]) -> list[dict]:
    """Rows the planner rejects although the rehearsal plus the allowance fits: on the
    rehearsal's (CPU) kernels, or on the GPU's as the sweep carries the rehearsal there."""
    return [r for r in rows if (not r["planner_fits"] and r["rehearsal_fits"])
            or r["gpu_flag"] == "REJECTED-FITS"]


def _sweep() -> list[dict]:
    warnings.filterwarnings("ignore")
    return fit_sweep.sweep([fit_sweep.QUICK], margin=0.10, per_side=1)


@pytest.mark.slow
def test_no_rejected_plan_fits_when_rehearsed():
    rows = _sweep()
    bad = wrongly_rejected(rows)
    assert not bad, "\n".join(fit_sweep.format_row(r) for r in bad)
    sides = {r["side"] for r in rows}
    assert sides == {"rejected", "accepted"}, rows  # the sweep found both near misses
    for r in rows:
        assert r["rehearsal_gib"] > 0.0 and r["capacity_gib"] == 80.0, r


@pytest.mark.slow
def test_check_fails_when_the_fit_decision_is_perturbed(monkeypatch):
    from meshtron.planner.estimate import Evaluator

    init = Evaluator.__init__

    def stingy(self, *args, **kwargs):  # the planner's rule, 10% less room for tensors
        init(self, *args, **kwargs)
        self.tensor_budget *= 0.90

    monkeypatch.setattr(Evaluator, "__init__", stingy)
    rows = _sweep()
    assert wrongly_rejected([r for r in rows if r["side"] == "rejected"]), rows
