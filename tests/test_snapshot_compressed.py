"""The planner's snapshot host memory (planner/snapshot_memory.py) against what a real
`meshtron train --nproc 2 --snapshot-every 1` run's snapshots hold with gradient compression
or DiLoCo: their error-feedback residuals, the group's mean residual and DiLoCo's outer copy
and momentum travel in every snapshot beside the parameters and AdamW's moments
(memory_compress.snapshot_extra_bytes).

Default: DiLoCo with int8 (the per-local-parameter mean residual, the branch ZeRO-0/1 share,
plus the outer copy and momentum); int8 at ZeRO-3 (the per-unit padded reduce-scatter input of
ZeRO-2/3) is checked by default on tests/test_snapshot.py's killed run (dp=2, ZeRO-3, int8,
block 64, one rank per node: this file's int8-zero3 flags), through
`check_planned_snapshot_bytes`. Slow (suite time, a 2-rank launch each): int8 at ZeRO-3 here
(session 57), and int8 at ZeRO-1, whose residuals take the branch the DiLoCo case runs by
default; its own residual bytes (compress_bytes) are measured against the prediction by
default in tests/test_compress_priced.py::
test_memory_json_counts_the_compression_state_on_both_sides."""

import json

import pytest

from meshtron.config import config_from_dict, load_toml
from meshtron.planner.memory_compress import snapshot_extra_bytes
from meshtron.planner.plan import load_plan
from meshtron.planner.cluster import nominal_cpu_cluster
from meshtron.planner.search import search_plans
from meshtron.planner.snapshot_memory import snapshot_host_bytes, snapshot_host_gib

from tests.test_checkpoint_cli import _run

COMPRESSED = {
    "int8-zero1": ["--plan", "dp=2", "--zero", "1", "--grad-compression", "int8"],
    "int8-zero3": ["--plan", "dp=2", "--zero", "3", "--grad-compression", "int8",
                   "--grad-compression-block", "64"],
    "diloco-int8": ["--plan", "dp=2", "--diloco", "2", "--grad-compression", "int8"],
}


SLOW = {"int8-zero1", "int8-zero3"}
"""Suite time: int8-zero3's flags and checks run by default on tests/test_snapshot.py's killed
run (`SNAP`); int8-zero1's branch is the DiLoCo case's."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW
                                  else n for n in sorted(COMPRESSED)])
def test_planned_snapshot_bytes_count_the_compression_state(tmp_path, name):
    run_dir = tmp_path / name
    code, out = _run(run_dir, "--nproc", "2", "--ranks-per-node", "1", "--snapshot-every",
                     "1", "--max-restarts", "1", "--steps", "2", *COMPRESSED[name])
    assert code == 0, out[-4000:]
    check_planned_snapshot_bytes(run_dir)


def check_planned_snapshot_bytes(run_dir) -> None:
    """The snapshot bytes a finished compressed run measured (summary.json) against the
    planner's, with its compression state and without, and the host line `meshtron plan`
    prints for the run's pinned plan."""
    measured = json.loads((run_dir / "summary.json").read_text())["snapshot"]["bytes_per_rank"]
    cfg = config_from_dict(load_toml(run_dir / "run.toml"))
    spec = cfg.model
    plan = load_plan(run_dir / "plan.toml")
    extra = snapshot_extra_bytes(spec, plan)
    planned = snapshot_host_bytes(spec, plan)
    assert len(planned) == len(measured) == 2
    for p, b, x in zip(planned, measured, extra):
        # the compression state is no rounding error: leaving it out misses the measurement
        assert b["own"] - (p["own"] - x) > 0.01 * p["own"], (p, b, x)
        assert 0 <= b["own"] - p["own"] <= 0.01 * p["own"], (p, b)  # + step counters, alignment
        assert 0 <= b["host_total"] - p["host_total"] <= 0.01 * p["host_total"], (p, b)
    # the line `meshtron plan` prints for the pinned plan (its fullest GPU, per GPU)
    best = search_plans(spec, nominal_cpu_cluster(2), plan.global_batch, cfg.data.seq_len,
                        fixed=plan, top_k=1).plans[0]
    line_gib = snapshot_host_gib(best.memory, best.config)
    most = max(b["host_total"] for b in measured) / 2**30
    assert 0 <= most - line_gib <= 0.01 * most, (line_gib, most)
