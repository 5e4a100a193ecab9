"""The rehearsal's GPU path (real tensors, a timed compute-only step) run on the CPU at toy
size, device injected: the code `meshtron rehearse --device cuda` runs on a GPU, which no GPU
has run yet. Several rehearsals in one process, the test's own (each releases its mesh and
DTensor's caches of it: a second one got the first one's destroyed groups before; a child
process imported torch again, ~3.5 CPU s, until session 54): each must leave no process
group behind and the default dtype as it found it."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from testkit.cli_inproc import meshtron_main

    path = tmp_path_factory.mktemp("rehearse") / "plan.toml"
    code, _, err = meshtron_main("plan", "--model", "tiny", "--cluster", "dgx-h100:1",
                                 "--global-batch", "8", "--seq-len", "64", "--layout",
                                 "tp=2,pp=2", "--save", path)
    assert code == 0, err
    return path


def _rehearse(plan_file, *runs: str) -> list[dict]:
    """rehearse/run.py `rehearse` of the plan's ranks, "RANK:real" or "RANK:fake", here."""
    import torch
    import torch.distributed as dist

    from meshtron.model import preset
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.plan import load_plan
    from meshtron.rehearse.run import rehearse

    model = preset("tiny")
    plan = load_plan(plan_file).validate(8, model)
    out = []
    for rank, tensors in (x.split(":") for x in runs):
        out.append(json.loads(json.dumps(rehearse(model, plan, resolve_cluster("dgx-h100:1"),
                                                  "cpu", int(rank), real=tensors == "real"))))
        assert not dist.is_initialized() and torch.get_default_dtype() == torch.float32
    return out


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
