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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recorder_overhead import _plan  # noqa: E402

DEFAULT_LAYOUTS = ["dp=2,zero=3", "tp=2", "pp=2,schedule=1f1b"]
SIDES = ("off", "rec", "rec+tl")


def rank_bench(layout: str, model: str, seq_len: int, global_batch: int, steps: int,
               pairs: int, trace_dir: str):
    import torch
    import torch.distributed as dist

    from meshtron.config import config_from_dict
    from meshtron.doctor.recorder import CollectiveRecorder
    from meshtron.doctor.timeline import TimelineCapture
    from meshtron.planner.plan import Plan
    from meshtron.train.parallel import ParallelEngine

    cfg = config_from_dict({"model": model, "data": {"seq_len": seq_len,
                                                     "global_batch": global_batch},
                            "train": {"steps": (steps + 1) * pairs * 3 + 2}})
    plan = Plan.from_dict(_plan(layout, global_batch))
    engine = ParallelEngine(cfg, plan, torch.device("cpu"))
    recorder = CollectiveRecorder(dist.get_rank(), capacity=2000)
    capture = TimelineCapture(recorder)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab, (global_batch, seq_len), generator=g)
    rows = global_batch // plan.dp
    r = engine.dp_rank
    inputs, targets = x[r * rows:(r + 1) * rows], x[r * rows:(r + 1) * rows].roll(1, 1)
    for _ in range(2):
        engine.train_step(inputs, targets)
    times = {s: [] for s in SIDES}
    cpu = {s: [] for s in SIDES}
    for pair in range(pairs):
        for side in (SIDES if pair % 2 == 0 else SIDES[::-1]):
            dist.barrier()
            if side != "off":
                recorder.install()
            if side == "rec+tl":
                capture.install()
            wall, cpus = [], []
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                float(engine.train_step(inputs, targets).loss)
                wall.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            capture.uninstall()
            recorder.uninstall()
            w = torch.tensor([statistics.median(wall)], dtype=torch.float64)
            c = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)
            times[side].append(float(w))
            cpu[side].append(float(c))
    waits = len(capture.waits) / (steps * pairs)
    engine.release()
    return {"times": times, "cpu": cpu, "waits_per_step": waits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--pairs", type=int, default=4, help="rounds of each side")
    args = ap.parse_args()
    from testkit.multiproc import run_on_ranks

    import timeline_overhead

    print(f"model {args.model}, seq {args.seq_len}, batch {args.global_batch}, "
          f"{args.pairs} rounds x {args.steps} steps per side")
    print(f"{'layout':<22}{'OFF s/step':>12}{'REC':>10}{'REC+TL':>10}{'REC/OFF':>9}"
          f"{'TL/OFF':>9}{'TL/REC':>9}{'cpu REC':>9}{'cpu TL':>9}{'waits/step':>11}")
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as tmp:
            res = run_on_ranks(timeline_overhead.rank_bench, 2, layout, args.model,
                               args.seq_len, args.global_batch, args.steps, args.pairs, tmp,
                               timeout=1800, backend="recorded")[0]
        t = {s: statistics.median(v) for s, v in res["times"].items()}
        c = {s: statistics.median(v) for s, v in res["cpu"].items()}
        print(f"{layout:<22}{t['off']:>12.4f}{t['rec']:>10.4f}{t['rec+tl']:>10.4f}"
              f"{t['rec'] / t['off']:>9.3f}{t['rec+tl'] / t['off']:>9.3f}"
              f"{t['rec+tl'] / t['rec']:>9.3f}{c['rec'] / c['off']:>9.3f}"
              f"{c['rec+tl'] / c['off']:>9.3f}{res['waits_per_step']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
