"""Data-parallel collectives per optimizer step, counted on real gloo steps: one table per
source tree, so the runtime before and after a change can be compared side by side.

    .venv/bin/python bench/dp_collectives.py                    # this tree
    .venv/bin/python bench/dp_collectives.py --tree /tmp/old    # another checkout (git archive)

4 ranks, the equivalence model (tests/test_dp_collectives.py's rank function: the collective
recorder's dispatch mode around `forward_backward` of the second step), 4 micro-batches per
step: dp=4 with ZeRO-0..3, and dp=2 x pp=2 (1F1B) with ZeRO-0/1/3. Per layout and rank 0:
each gradient/parameter collective kind on the data axis, how many per step and the bytes of
its unsharded side (scalar loss reductions and pipeline send/recv left out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYOUTS = [dict(dp=4, zero=z, micro_batch=1) for z in (0, 1, 2, 3)] + [
    dict(dp=2, pp=2, zero=z, schedule="1f1b", micro_batch=2) for z in (0, 1, 3)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=str(ROOT), help="source tree whose meshtron to count")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))  # the rank function (imports meshtron lazily)
    sys.path.insert(0, args.tree)
    import test_dp_collectives as t

    sys.path.append(str(Path(__file__).resolve().parent.parent))  # testkit/
    from testkit.multiproc import run_on_ranks

    import meshtron

    results = run_on_ranks(t._rank_fn, 4, t.CFG, LAYOUTS, timeout=1800)
    print(f"tree {args.tree} (meshtron from {Path(meshtron.__file__).parent})")
    print(f"{'layout':<44} {'collective':<24} {'axis':<13} {'dtype':<9} {'per step':>8} "
          f"{'MB/step':>8}")
    for got in results[0]:
        lay = ",".join(f"{k}={v}" for k, v in got["layout"].items())
        rows = sorted((k, v) for k, v in got["counted"].items()
                      if k[1] in ("dp", "dp_shard", "dp_replicate"))
        for (op, axis, dtype), n in rows:
            mb = got["bytes"][(op, axis, dtype)] / 1e6
            print(f"{lay:<44} {op:<24} {axis:<13} {dtype:<9} {n:>8} {mb:>8.3f}")
            lay = ""
    return 0


if __name__ == "__main__":
    sys.exit(main())
