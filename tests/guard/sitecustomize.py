"""The runtime half of tests/test_no_torch_patching.py (on PYTHONPATH only in that test's
`meshtron train` child processes): with MESHTRON_GUARD_OUT set, each rank (RANK set) imports
the torch modules meshtron imports, snapshots torch (testkit/torch_state.py) before any
meshtron code runs, and compares torch with that snapshot at every training batch (the doctor
session, recorder, watchdog and compiled blocks are all live by then), writing what changed to
MESHTRON_GUARD_OUT/rank_N.json. The hook itself wraps meshtron's own TrainLoader, as the fault
hooks of tests/faults/sitecustomize.py do.

Only the ranks themselves (`python -m meshtron`, as torchrun starts them) are guarded: the
processes they start inherit RANK too (inductor's compile workers under `--compile`), and a
snapshot there (torch plus every torch module meshtron imports, in each worker) guards nothing
and tripled the compiled run's wall time (47 s against 14 s on 2 cores, measured)."""

import json
import os
import sys
from pathlib import Path

_OUT = os.environ.get("MESHTRON_GUARD_OUT")


def _is_rank() -> bool:
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b == "meshtron" for a, b in zip(argv, argv[1:]))


if _OUT and os.environ.get("RANK") is not None and _is_rank():
    _ROOT = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(_ROOT))
    import torch  # noqa: F401

    from testkit import torch_state

    torch_state.preload(_ROOT / "meshtron")
    _BEFORE = torch_state.snapshot()
    _SEEN = {"checks": 0, "changes": []}

    from meshtron.data.dataset import TrainLoader

    _next = TrainLoader.next_batch

    def next_batch(self):
        found = torch_state.changes(_BEFORE)
        _SEEN["checks"] += 1
        _SEEN["changes"] = sorted(set(_SEEN["changes"]) | set(found))
        path = Path(_OUT) / f"rank_{os.environ['RANK']}.json"
        path.write_text(json.dumps(_SEEN))
        return _next(self)

    TrainLoader.next_batch = next_batch
