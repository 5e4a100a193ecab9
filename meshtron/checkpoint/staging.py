"""The wait for a state copy to host memory, shared by disk checkpoints
(meshtron/checkpoint/checkpointer.py) and in-memory snapshots (meshtron/heal/snapshot.py):
both copy on a background thread and hold back the next optimizer step, the first write to
the tensors being copied, until the copy is done (torchtitan's `maybe_wait_for_staging`)."""

from __future__ import annotations

import time
from typing import Any


def wait_staging(owner: Any) -> float:
    """Block until `owner._staging` (a Future, or None when nothing is in flight) is done,
    raising its error; returns the seconds blocked, added to the newest of `owner.stalls_s`
    (that save's stall)."""
    if owner._staging is None:
        return 0.0
    t0 = time.perf_counter()
    staging, owner._staging = owner._staging, None
    staging.result()
    waited = time.perf_counter() - t0
    if owner.stalls_s:
        owner.stalls_s[-1] += waited
    return waited
