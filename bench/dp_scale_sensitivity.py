"""How much the data-parallel collectives' physics moves the scale-dependent calibration rows.

Issue 30 item 3: through the command line, llm-foundry's MPT rows (PyTorch FSDP) grow more
optimistic with the GPU count (MPT-7b +8% on 8 H100, +14% on 128, +21% on 512), and DeepSpeed
0.3's ZeRO-3 rows are 25-31% optimistic at 530B. Before pricing a new term, this asks the
cost model which of its collective parameters could carry such a pattern at all: every row is
run as `bench/planner_cli_table.py` runs it (`meshtron plan`, the row's layout pinned), once
as published and once per variant of its cluster:

* `nccl<2.18`: the network step latency of NCCL 2.7-2.11 and 2.14-2.17 (tuning.cc hwLat NET
  ring Simple 9.6 us; 2.12-2.13 had 28) instead of the default's 14.0 (NCCL >= 2.18);
* `2x latency`: both per-step latencies doubled (a ring step twice as slow as NCCL's model);
* `half bw`: half the collective bandwidth (`bandwidth_efficiency` 0.45, e.g. a congested
  fabric).

A row whose error barely moves under `2x latency` and `half bw` has its collectives hidden
behind compute in the model: what it misses at scale is not the collectives' duration.

Only calibration rows are run (validation rows are reported by planner_cli_table.py, never
examined): the script refuses any other.

    python bench/dp_scale_sensitivity.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planner_cli_table import run_row  # noqa: E402
from bench.published.runs import published_runs  # noqa: E402

ROWS = ("LF MPT-7b s2048 8xH100", "LF MPT-7b s2048 128xH100", "LF MPT-7b s2048 512xH100",
        "LF MPT-3b s2048 512xH100", "LF MPT-1b s2048 512xH100", "LF MPT-70b s2048 128xH100",
        "LF MPT-70b s2048 512xH100", "N21 ZeRO-3 175B 384", "N21 ZeRO-3 175B 1536",
        "N21 ZeRO-3 530B 640", "N21 ZeRO-3 530B 2240", "GPT-NeoX 20B 96")
"""The rows issue 30 item 3 names (all calibration)."""


def variants(cluster) -> dict[str, dict]:
    """Cluster field overrides per variant (module docstring)."""
    return {"published": {},
            "nccl<2.18": {"inter_node_latency_us": 9.6},
            "2x latency": {"inter_node_latency_us": 2 * cluster.inter_node_latency_us,
                           "intra_node_latency_us": 2 * cluster.intra_node_latency_us},
            "half bw": {"bandwidth_efficiency": 0.45}}


def main() -> int:
    runs = {r.name: r for r in published_runs()}
    print(f"{'row':28} " + " ".join(f"{k:>11}" for k in variants(runs[ROWS[0]].cluster)))
    for name in ROWS:
        run = runs[name]
        if run.part != "calibration":
            raise SystemExit(f"{name}: part {run.part!r}; only calibration rows are examined")
        cells = []
        for over in variants(run.cluster).values():
            row = run_row(dataclasses.replace(
                run, cluster=dataclasses.replace(run.cluster, **over)))
            cells.append(f"{row['error']:+.1%}" if "error" in row else row["status"])
        print(f"{name:28} " + " ".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    raise SystemExit(main())
