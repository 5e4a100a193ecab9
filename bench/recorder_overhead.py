"""Step-time overhead of meshtron doctor's collective recorder (goal: ratio <= 1.02).

Same ranks, same model and optimizer, same batches; rounds alternate recorder OFF / ON / OFF /
ON ... inside one multi-rank gloo launch (`testkit.multiproc`), so machine noise (other
jobs on a shared machine) hits both sides alike. A round is `--steps` optimizer steps of the
engine `meshtron train` runs (`ParallelEngine.train_step`); its step time is the slowest rank's
median. ON installs the recorder (`CollectiveRecorder.install`) as a training rank does for
its whole run; the session's watchdog thread runs in every round. STACKS (column "stacks")
installs it with a Python stack per collective and a progress callback per collective, what
every collective paid before stacks became a debugging option (MESHTRON_DOCTOR_STACKS=1).

Printed per layout: the ratio ON/OFF of the median step times over all rounds, the median of
the per-pair ratios with its quartiles, the collectives recorded per step, the same ratio of
CPU seconds per step summed over ranks ("cpu ON": process CPU time, gloo threads included,
barely affected by other jobs on a shared machine, so it isolates the recorder's own cost), and
(columns "mode", "cpu mode") the ratios with the recorder as a
TorchDispatchMode instead (every operator through Python: the reference path, not what a
rank runs). The installed recorder must record at least what the mode records (asserted).

`--per-call` measures the recorder's own cost per collective instead, in one process (a
1-rank gloo group, so no peer's scheduling enters): CPU microseconds per `dist.all_reduce`
(the c10d path FSDP2 and the pipeline use) and per functional all-reduce + wait (DTensor's
path), rounds OFF / ON / STACKS alternating; a machine too loaded for step-time ratios still
gives these.

    .venv/bin/python bench/recorder_overhead.py
    .venv/bin/python bench/recorder_overhead.py --layouts tp=2 --pairs 6 --model tiny
    .venv/bin/python bench/recorder_overhead.py --per-call
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
    stacked = CollectiveRecorder(dist.get_rank(), capacity=2000, stacks=True,
                                 on_issue=lambda: time.time())
    mode = CollectiveRecorder(dist.get_rank(), capacity=2000)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab, (global_batch, seq_len), generator=g)
    dp = plan.dp
    rows = global_batch // dp
    r = engine.dp_rank
    inputs, targets = x[r * rows:(r + 1) * rows], x[r * rows:(r + 1) * rows].roll(1, 1)
    for _ in range(2):  # warm-up: lazy init, first all-gathers
        engine.train_step(inputs, targets)
    times = {"off": [], "on": [], "stacks": [], "mode": []}
    cpu = {"off": [], "on": [], "stacks": [], "mode": []}
    for pair in range(pairs):
        order = ("off", "on", "stacks", "mode") if pair % 2 == 0 else \
            ("mode", "stacks", "on", "off")
        for side in order:
            dist.barrier()
            if side == "on":
                recorder.install()
            elif side == "stacks":
                stacked.install()
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
            stacked.uninstall()
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


def per_call(rounds: int = 8, calls: int = 2000) -> dict[str, tuple[float, float]]:
    """Main-thread CPU microseconds per collective (c10d, functional), off / on / stacks."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from meshtron.doctor.recorder import CollectiveRecorder

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(16)
    wait = torch.ops._c10d_functional.wait_tensor
    out: dict[str, list] = {"off": [], "on": [], "stacks": []}
    for r in range(rounds):
        for side in (("off", "on", "stacks") if r % 2 == 0 else ("stacks", "on", "off")):
            rec = None
            if side != "off":
                rec = CollectiveRecorder(0, stacks=side == "stacks",
                                         on_issue=(lambda: time.time()) if side == "stacks"
                                         else None)
                rec.install()
            for _ in range(100):  # warm-up after a switch (dispatcher tables rebuilt)
                dist.all_reduce(t)
            # The main thread's CPU time: the recorder runs there; gloo's threads do not.
            c0 = time.thread_time()
            for _ in range(calls):
                dist.all_reduce(t)
            c1 = time.thread_time()
            for _ in range(calls):
                wait(funcol.all_reduce(t, "sum", dist.group.WORLD))
            c2 = time.thread_time()
            if rec is not None:
                rec.uninstall()
            out[side].append(((c1 - c0) / calls * 1e6, (c2 - c1) / calls * 1e6))
    dist.destroy_process_group()
    # The fastest round: machine noise only ever adds time.
    return {k: (min(a for a, _ in v), min(b for _, b in v)) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--pairs", type=int, default=6, help="OFF/ON round pairs")
    ap.add_argument("--per-call", action="store_true", help="cost per collective, one process")
    args = ap.parse_args()
    if args.per_call:
        res = per_call()
        off = res["off"]
        print("main-thread CPU microseconds per collective (fastest of 8 rounds): c10d all_reduce, "
              "functional all_reduce + wait")
        for side, (a, b) in res.items():
            print(f"{side:<8}{a:>10.1f}{b:>10.1f}   added {a - off[0]:>7.1f} {b - off[1]:>7.1f}")
        return 0
    from testkit.multiproc import run_on_ranks

    import recorder_overhead

    print(f"model {args.model}, seq {args.seq_len}, batch {args.global_batch}, "
          f"{args.pairs} pairs x {args.steps} steps; ratio = step time ON / OFF (goal <= 1.02)")
    print(f"{'layout':<22}{'OFF s/step':>12}{'ON s/step':>12}{'ratio':>8}"
          f"{'pair ratio (q1-q3)':>24}{'colls/step':>12}{'stacks':>8}{'mode':>8}"
          f"{'cpu ON':>8}{'cpu stk':>8}{'cpu mode':>9}")
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
              f"{statistics.median(res['times']['stacks']) / statistics.median(off):>8.3f}"
              f"{statistics.median(mode) / statistics.median(off):>8.3f}"
              f"{statistics.median(c['on']) / statistics.median(c['off']):>8.3f}"
              f"{statistics.median(c['stacks']) / statistics.median(c['off']):>8.3f}"
              f"{statistics.median(c['mode']) / statistics.median(c['off']):>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
