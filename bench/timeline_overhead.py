"""Step-time overhead of the recorder and of the timeline's wait capture (meshtron doctor).

Same ranks (on meshtron doctor's recording gloo group, as `meshtron train` ranks), model,
optimizer and batches; rounds alternate OFF (no recorder attached) / REC (the collective
recorder, as a rank runs it) / REC+TL (recorder plus `TimelineCapture`, which keeps the waits
the recorded Works report: what `meshtron train` runs by default), in alternating order inside
one 2-rank gloo launch so that machine noise hits every side alike. A round's step
time is the slowest rank's median; printed: medians and the ratios REC/OFF and REC+TL/OFF, and
the same ratios of CPU seconds per step summed over ranks (less sensitive to other jobs).

    .venv/bin/python bench/timeline_overhead.py
    .venv/bin/python bench/timeline_overhead.py --layouts pp=2,schedule=1f1b --pairs 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recorder_overhead import add_arguments, bench_engine, on_two_ranks, timed_round  # noqa: E402

SIDES = ("off", "rec", "rec+tl")


def rank_bench(layout: str, model: str, seq_len: int, global_batch: int, steps: int,
               pairs: int, trace_dir: str):
    import torch.distributed as dist

    from meshtron.doctor.recorder import CollectiveRecorder
    from meshtron.doctor.timeline import TimelineCapture

    engine, inputs, targets = bench_engine(layout, model, seq_len, global_batch,
                                           (steps + 1) * pairs * 3 + 2)
    recorder = CollectiveRecorder(dist.get_rank(), capacity=2000)
    capture = TimelineCapture(recorder)
    attach = {"off": (), "rec": (recorder,), "rec+tl": (recorder, capture)}
    times = {s: [] for s in SIDES}
    cpu = {s: [] for s in SIDES}
    for pair in range(pairs):
        for side in (SIDES if pair % 2 == 0 else SIDES[::-1]):
            wall, cpu_s = timed_round(engine, inputs, targets, steps, attach[side])
            times[side].append(wall)
            cpu[side].append(cpu_s)
    waits = len(capture.waits) / (steps * pairs)
    engine.release()
    return {"times": times, "cpu": cpu, "waits_per_step": waits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, 4, "rounds of each side")
    args = ap.parse_args()
    import timeline_overhead

    print(f"model {args.model}, seq {args.seq_len}, batch {args.global_batch}, "
          f"{args.pairs} rounds x {args.steps} steps per side")
    print(f"{'layout':<22}{'OFF s/step':>12}{'REC':>10}{'REC+TL':>10}{'REC/OFF':>9}"
          f"{'TL/OFF':>9}{'TL/REC':>9}{'cpu REC':>9}{'cpu TL':>9}{'waits/step':>11}")
    for layout in args.layouts:
        res = on_two_ranks(timeline_overhead.rank_bench, layout, args)
        t = {s: statistics.median(v) for s, v in res["times"].items()}
        c = {s: statistics.median(v) for s, v in res["cpu"].items()}
        print(f"{layout:<22}{t['off']:>12.4f}{t['rec']:>10.4f}{t['rec+tl']:>10.4f}"
              f"{t['rec'] / t['off']:>9.3f}{t['rec+tl'] / t['off']:>9.3f}"
              f"{t['rec+tl'] / t['rec']:>9.3f}{c['rec'] / c['off']:>9.3f}"
              f"{c['rec+tl'] / c['off']:>9.3f}{res['waits_per_step']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
