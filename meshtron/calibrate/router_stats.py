"""`meshtron calibrate --router-stats RUN/metrics.jsonl`: the planner's expert imbalance measured
from a run's router statistics, written as a framework [options] table for `meshtron plan
--options`. Torch-free.

What a run logs (meshtron/train/router.py `router_record`, every logging step): per MoE layer the
load of every expert summed over the data-parallel ranks, reduced to max/mean over the experts;
`moe_imbalance_mean` is that ratio averaged over the layers. The planner's `expert_imbalance`
(planner/moe_cost.py) is the fullest expert-parallel rank's routed tokens over the mean. A rank
holds E/ep experts, and a sum of E/ep loads is never more unbalanced than its fullest expert,
so the per-expert ratio is an upper bound of the per-rank one (equal at ep = E): the planner
prices the run as at least this unbalanced. The first WARMUP_FRACTION of the logged steps are
skipped (routers start unbalanced and the balancing loss or bias settles them).
"""

from __future__ import annotations

import json
from pathlib import Path

from meshtron.argtypes import read_text
from meshtron.errors import UserError

WARMUP_FRACTION = 0.1
"""Share of the logged steps left out at the start (router warm-up)."""
KEY = "moe_imbalance_mean"
"""metrics.jsonl field read (per-layer max/mean expert load, averaged over the layers)."""


def measured_imbalance(path: str | Path) -> tuple[float, int]:
    """(mean imbalance over the logged steps after warm-up, steps used) of a metrics.jsonl."""
    p = Path(path)
    values = []
    for n, line in enumerate(read_text(p, "router-stats").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"router-stats={str(p)!r}: line {n} is not JSON") from None
        v = rec.get(KEY) if isinstance(rec, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1.0:
            values.append(float(v))
    if not values:
        raise UserError(f"router-stats={str(p)!r}: no {KEY} records (a run of a "
                        "mixture-of-experts model logs them at every logging step)")
    skip = int(len(values) * WARMUP_FRACTION)
    kept = values[skip:]
    return sum(kept) / len(kept), len(kept)


def options_toml(imbalance: float, source: str, steps: int) -> str:
    """An [options] table for `meshtron plan --options`."""
    import tomli_w

    return (f"# expert imbalance measured by meshtron calibrate from {source} "
            f"({steps} logged steps after warm-up)\n"
            + tomli_w.dumps({"options": {"expert_imbalance": round(max(1.0, imbalance), 4)}}))
