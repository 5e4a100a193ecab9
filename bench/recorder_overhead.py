"""Step-time overhead of meshtron doctor's collective recorder (goal: ratio <= 1.02).

Same ranks, same model and optimizer, same batches; rounds alternate recorder OFF / ON / OFF /
ON ... inside one multi-rank gloo launch (`meshtron.testing.multiproc`), so machine noise (other
jobs on a shared machine) hits both sides alike. A round is `--steps` optimizer steps of the
engine `meshtron train` runs (`ParallelEngine.train_step`); its step time is the slowest rank's
median. ON installs the recorder (`CollectiveRecorder.install`) as a training rank does for
its whole run; the session's watchdog thread runs in every round.

Printed per layout: the ratio ON/OFF of the median step times over all rounds, the median of
the per-pair ratios with its quartiles, the collectives recorded per step, the same ratio of
CPU seconds per step summed over ranks ("cpu ON": process CPU time, gloo threads included,
barely affected by other jobs on a shared machine, so it isolates the recorder's own cost), and
(columns "mode", "cpu mode") the ratios with the recorder as a
TorchDispatchMode instead (every operator through Python: the reference path, not what a
rank runs). The installed recorder must record at least what the mode records (asserted).

    .venv/bin/python bench/recorder_overhead.py
    .venv/bin/python bench/recorder_overhead.py --layouts tp=2 --pairs 6 --model tiny
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

DEFAULT_LAYOUTS = ["dp=2,zero=3", "tp=2", "pp=2,schedule=1f1b"]


def _plan(text: str, global_batch: int) -> dict:
    plan: dict = {"global_batch": global_batch}
    for part in text.split(","):
        k, v = part.split("=")
        plan[k] = v if k == "schedule" else int(v)
    dp = plan.get("dp", 1)
    # Pipelines: 2 micro-batches per step; otherwise one micro-batch per data-parallel rank.
    plan["micro_batch"] = global_batch // dp // (2 if plan.get("pp", 1) > 1 else 1)
    return plan


def rank_bench(layout: str, model: str, seq_len: int, global_batch: int, steps: int,
               pairs: int, trace_dir: str):
    import torch
    import torch.distributed as dist

    from meshtron.config import config_from_dict
    from meshtron.doctor import DoctorSession
    from meshtron.doctor.recorder import CollectiveRecorder
    from meshtron.planner.plan import Plan
    from meshtron.train.parallel import ParallelEngine

    cfg = config_from_dict({"model": model, "data": {"seq_len": seq_len,
                                                     "global_batch": global_batch},
                            "train": {"steps": (steps + 1) * pairs * 3 + 2}})
    plan = Plan.from_dict(_plan(layout, global_batch))
    session = DoctorSession(trace_dir, dist.get_rank(), dist.get_world_size(),
                            watchdog_timeout_s=600, recorder=False).start()
    engine = ParallelEngine(cfg, plan, torch.device("cpu"))
    recorder = CollectiveRecorder(dist.get_rank(), capacity=2000)
    mode = CollectiveRecorder(dist.get_rank(), capacity=2000)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab, (global_batch, seq_len), generator=g)
    dp = plan.dp
    rows = global_batch // dp
    r = engine.dp_rank
    inputs, targets = x[r * rows:(r + 1) * rows], x[r * rows:(r + 1) * rows].roll(1, 1)
    for _ in range(2):  # warm-up: lazy init, first all-gathers
        engine.train_step(inputs, targets)
    times = {"off": [], "on": [], "mode": []}
    cpu = {"off": [], "on": [], "mode": []}
    for pair in range(pairs):
        order = ("off", "on", "mode") if pair % 2 == 0 else ("mode", "on", "off")
        for side in order:
            dist.barrier()
            if side == "on":
                recorder.install()
            # One untimed step after each switch: re-registering the kernels makes the
            # dispatcher rebuild its tables (a rank installs once, at start).
            engine.train_step(inputs, targets)
            step_times, cpu_times = [], []
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                if side == "mode":
                    with mode:
                        out = engine.train_step(inputs, targets)
                else:
                    out = engine.train_step(inputs, targets)
                float(out.loss)
                step_times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
            recorder.uninstall()
            t = torch.tensor([statistics.median(step_times), 0.0], dtype=torch.float64)
            t[1] = statistics.median(cpu_times)
            wall = t[:1].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's wall time
            dist.all_reduce(t)  # CPU seconds of all ranks (gloo threads included)
            times[side].append(float(wall))
            cpu[side].append(float(t[1]))
    per_step = len(recorder.records) / ((steps + 1) * pairs)
    # The installed recorder also sees what DTensor issues inside its operator handlers,
    # where the mode is suspended (tests/test_doctor_recorder.py).
    assert len(recorder.records) >= len(mode.records), (len(recorder.records), len(mode.records))
    session.close(final_dump=False)
    engine.release()
    return {"times": times, "cpu": cpu, "collectives_per_step": per_step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--pairs", type=int, default=6, help="OFF/ON round pairs")
    args = ap.parse_args()
    from meshtron.testing.multiproc import run_on_ranks

    import recorder_overhead

    print(f"model {args.model}, seq {args.seq_len}, batch {args.global_batch}, "
          f"{args.pairs} pairs x {args.steps} steps; ratio = step time ON / OFF (goal <= 1.02)")
    print(f"{'layout':<22}{'OFF s/step':>12}{'ON s/step':>12}{'ratio':>8}"
          f"{'pair ratio (q1-q3)':>24}{'colls/step':>12}{'mode':>10}{'cpu ON':>10}"
          f"{'cpu mode':>10}")
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as tmp:
            res = run_on_ranks(recorder_overhead.rank_bench, 2, layout, args.model,
                               args.seq_len, args.global_batch, args.steps, args.pairs, tmp,
                               timeout=1800)[0]
        off, on, mode = (res["times"][k] for k in ("off", "on", "mode"))
        c = res["cpu"]
        ratios = sorted(b / a for a, b in zip(off, on))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{layout:<22}{statistics.median(off):>12.4f}{statistics.median(on):>12.4f}"
              f"{statistics.median(on) / statistics.median(off):>8.3f}"
              f"{q[1]:>10.3f} ({q[0]:.3f}-{q[2]:.3f})"
              f"{res['collectives_per_step']:>12.1f}"
              f"{statistics.median(mode) / statistics.median(off):>10.3f}"
              f"{statistics.median(c['on']) / statistics.median(c['off']):>10.3f}"
              f"{statistics.median(c['mode']) / statistics.median(c['off']):>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
