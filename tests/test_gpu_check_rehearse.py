"""The rehearsal's GPU path (real tensors, a timed compute-only step) run on the CPU at toy
size, device injected: the code `meshtron rehearse --device cuda` runs on a GPU, which no GPU
has run yet. Several rehearsals in one process (each releases its mesh and DTensor's caches
of it: a second one got the first one's destroyed groups before)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RUN = r"""
import json, sys
from meshtron.model import preset
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.plan import load_plan
from meshtron.rehearse.run import rehearse
model = preset("tiny")
plan = load_plan(sys.argv[1]).validate(8, model)
out = [rehearse(model, plan, resolve_cluster("dgx-h100:1"), "cpu", int(rank),
                real=tensors == "real")
       for rank, tensors in (x.split(":") for x in sys.argv[2:])]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rehearse") / "plan.toml"
    subprocess.run([sys.executable, "-m", "meshtron", "plan", "--model", "tiny", "--cluster",
                    "dgx-h100:1", "--global-batch", "8", "--seq-len", "64", "--layout",
                    "tp=2,pp=2", "--save", str(path)], check=True, capture_output=True,
                   timeout=120)
    return path


def _rehearse(plan_file, *runs: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", RUN, str(plan_file), *runs],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 7])
# the last pipeline stage (loss, a received input) by default; the first one in -m slow
def test_real_tensors_time_the_step_and_match_the_fake_rehearsal(plan_file, rank):
    real, fake = _rehearse(plan_file, f"{rank}:real", f"{rank}:fake")
    assert real["measured"] == "real tensors, torch memory tracker, step timed"
    assert real["step_s"] > 0 and real["planner_compute_s"] > 0
    assert "step_s" not in fake and fake["measured"].startswith("fake tensors")
    assert real["pp_rank"] == fake["pp_rank"] == (0 if rank == 0 else 1)
    # the same rank, the same tracker: real and fake tensors hold the same bytes
    got = {r["row"]: r["rehearsal_gib"] for r in real["memory"]}
    want = {r["row"]: r["rehearsal_gib"] for r in fake["memory"]}
    assert got == pytest.approx(want, rel=0.02)
