"""Step-time overhead of meshtron doctor's collective recorder (goal: ratio <= 1.02).

The recorder is meshtron's recording gloo process group (meshtron/doctor/backend.py): every
collective goes through a Python method that records it and wraps its Work. Two measurements,
each side by side in one run:

1. Step time, one multi-rank gloo launch (`testkit.multiproc`, ranks on the recording group as
   `meshtron train` ranks are): same ranks, model, optimizer and batches; rounds alternate
   OFF / ON / STACKS / ... so that machine noise (other jobs on a shared machine) hits every
   side alike. A round is `--steps` optimizer steps of the engine `meshtron train` runs
   (`ParallelEngine.train_step`); its step time is the slowest rank's median. ON: a recorder
   attached, as a training rank runs for its whole run; OFF: none attached (the group then only
   counts sequence numbers and forwards); STACKS: attached with a Python stack and a progress
   callback per collective (MESHTRON_DOCTOR_STACKS=1). Printed per layout: the ratio ON/OFF of
   the median step times over all rounds, the median of the per-pair ratios with quartiles,
   the collectives recorded per step, and the same ratio of CPU seconds per step summed over
   ranks ("cpu ON": gloo threads included, barely affected by other jobs).
2. The cost per collective of the group itself, in one process (a 1-rank world, so no peer's
   scheduling enters): main-thread CPU microseconds per `dist.all_reduce` (the c10d path FSDP2
   and the pipeline use) and per functional all-reduce + wait (DTensor's path) on a plain gloo
   group, on the recording group with no recorder and with one, rounds alternating. OFF in (1)
   already pays the group's forwarding; "vs gloo" adds it back: (ON step time + collectives
   per step x (forwarding cost)) / OFF step time, the step-time ratio against a run on plain
   gloo groups (`meshtron train --no-recorder`).

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


def add_arguments(ap: argparse.ArgumentParser, pairs: int, pairs_help: str) -> None:
    """The flags of both overhead benches (this one and timeline_overhead.py)."""
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--pairs", type=int, default=pairs, help=pairs_help)


def on_two_ranks(rank_bench, layout: str, args: argparse.Namespace) -> dict:
    """`rank_bench` of `layout` with the command line's figures, on two ranks of the recording
    gloo group (as `meshtron train` ranks are): rank 0's result."""
    from testkit.multiproc import run_on_ranks

    with tempfile.TemporaryDirectory() as tmp:
        return run_on_ranks(rank_bench, 2, layout, args.model, args.seq_len, args.global_batch,
                            args.steps, args.pairs, tmp, timeout=1800, backend="recorded")[0]


def bench_engine(layout: str, model: str, seq_len: int, global_batch: int, rounds: int):
    """This rank's `ParallelEngine` (the engine `meshtron train` runs) for `layout`, its shard
    of one fixed batch, warmed up (lazy init, first all-gathers): (engine, inputs, targets).
    `rounds` x (steps + 1) + 2 steps are configured (the schedule's length)."""
    import torch

    from meshtron.config import config_from_dict
    from meshtron.planner.plan import Plan
    from meshtron.train.parallel import ParallelEngine

    cfg = config_from_dict({"model": model, "data": {"seq_len": seq_len,
                                                     "global_batch": global_batch},
                            "train": {"steps": rounds}})
    plan = Plan.from_dict(_plan(layout, global_batch))
    engine = ParallelEngine(cfg, plan, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab, (global_batch, seq_len), generator=g)
    rows = global_batch // plan.dp
    r = engine.dp_rank
    inputs, targets = x[r * rows:(r + 1) * rows], x[r * rows:(r + 1) * rows].roll(1, 1)
    for _ in range(2):
        engine.train_step(inputs, targets)
    return engine, inputs, targets


def timed_round(engine, inputs, targets, steps: int, attached=()) -> tuple[float, float]:
    """`steps` optimizer steps with `attached` installed (in order, removed in reverse): the
    slowest rank's median step seconds and the median CPU seconds per step summed over ranks
    (gloo threads included)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    for a in attached:
        a.install()
    wall, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        float(engine.train_step(inputs, targets).loss)
        wall.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    for a in reversed(attached):
        a.uninstall()
    w = torch.tensor([statistics.median(wall)], dtype=torch.float64)
    c = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    dist.all_reduce(c)
    return float(w), float(c)


def rank_bench(layout: str, model: str, seq_len: int, global_batch: int, steps: int,
               pairs: int, trace_dir: str):
    import torch.distributed as dist

    from meshtron.doctor import DoctorSession
    from meshtron.doctor.backend import is_recording_group
    from meshtron.doctor.recorder import CollectiveRecorder

    assert is_recording_group(dist.group.WORLD)
    session = DoctorSession(trace_dir, dist.get_rank(), dist.get_world_size(),
                            watchdog_timeout_s=600, recorder=False).start()
    engine, inputs, targets = bench_engine(layout, model, seq_len, global_batch,
                                           (steps + 1) * pairs * 3 + 2)
    recorder = CollectiveRecorder(dist.get_rank(), capacity=2000)
    stacked = CollectiveRecorder(dist.get_rank(), capacity=2000, stacks=True,
                                 on_issue=lambda: time.time())
    attach = {"off": (), "on": (recorder,), "stacks": (stacked,)}
    times = {"off": [], "on": [], "stacks": []}
    cpu = {"off": [], "on": [], "stacks": []}
    for pair in range(pairs):
        order = ("off", "on", "stacks") if pair % 2 == 0 else ("stacks", "on", "off")
        for side in order:
            wall, cpu_s = timed_round(engine, inputs, targets, steps, attach[side])
            times[side].append(wall)
            cpu[side].append(cpu_s)
    per_step = len(recorder.records) / (steps * pairs)
    assert per_step > 0 and all(s["state"] == "completed" for s in recorder.snapshot())
    session.close(final_dump=False)
    engine.release()
    return {"times": times, "cpu": cpu, "collectives_per_step": per_step}


def per_call(rounds: int = 8, calls: int = 2000) -> dict[str, tuple[float, float]]:
    """Main-thread CPU microseconds per collective (c10d, functional): plain gloo group,
    recording group without and with a recorder (a 1-rank world on the recording group)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from meshtron.doctor.backend import is_recording_group
    from meshtron.doctor.recorder import CollectiveRecorder

    assert is_recording_group(dist.group.WORLD)
    groups = {"gloo": dist.new_group([0], backend="gloo"), "detached": dist.group.WORLD,
              "on": dist.group.WORLD}
    t = torch.ones(16)
    wait = torch.ops._c10d_functional.wait_tensor
    out: dict[str, list] = {k: [] for k in groups}
    rec = CollectiveRecorder(0)
    for r in range(rounds):
        for side in (list(groups) if r % 2 == 0 else list(reversed(groups))):
            group = groups[side]
            if side == "on":
                rec.install()
            for _ in range(100):  # warm-up
                dist.all_reduce(t, group=group)
            # The main thread's CPU time: the recorder runs there; gloo's threads do not.
            c0 = time.thread_time()
            for _ in range(calls):
                dist.all_reduce(t, group=group)
            c1 = time.thread_time()
            for _ in range(calls):
                wait(funcol.all_reduce(t, "sum", group))
            c2 = time.thread_time()
            rec.uninstall()
            out[side].append(((c1 - c0) / calls * 1e6, (c2 - c1) / calls * 1e6))
    assert len(rec.records) > 0
    # The fastest round: machine noise only ever adds time.
    return {k: (min(a for a, _ in v), min(b for _, b in v)) for k, v in out.items()}


def _per_call_table() -> dict[str, tuple[float, float]]:
    from testkit.multiproc import run_on_ranks

    import recorder_overhead

    res = run_on_ranks(recorder_overhead.per_call, 1, timeout=1800, backend="recorded")[0]
    gloo = res["gloo"]
    print("main-thread CPU microseconds per collective (fastest of 8 rounds): c10d all_reduce, "
          "functional all_reduce + wait; added = over the plain gloo group")
    for side, (a, b) in res.items():
        print(f"{side:<10}{a:>10.1f}{b:>10.1f}   added {a - gloo[0]:>7.1f} {b - gloo[1]:>7.1f}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, 6, "OFF/ON round pairs")
    ap.add_argument("--per-call", action="store_true", help="cost per collective only")
    args = ap.parse_args()
    calls = _per_call_table()
    if args.per_call:
        return 0
    # The group's own forwarding, which OFF already pays: the dearer of the two paths.
    forward_s = max(calls["detached"][i] - calls["gloo"][i] for i in (0, 1)) / 1e6
    import recorder_overhead

    print(f"\nmodel {args.model}, seq {args.seq_len}, batch {args.global_batch}, "
          f"{args.pairs} pairs x {args.steps} steps; ratio = step time ON / OFF (goal <= 1.02)")
    print(f"{'layout':<22}{'OFF s/step':>12}{'ON s/step':>12}{'ratio':>8}"
          f"{'pair ratio (q1-q3)':>24}{'colls/step':>12}{'vs gloo':>9}{'stacks':>8}"
          f"{'cpu ON':>8}{'cpu stk':>8}")
    for layout in args.layouts:
        res = on_two_ranks(recorder_overhead.rank_bench, layout, args)
        off, on = (statistics.median(res["times"][k]) for k in ("off", "on"))
        c = res["cpu"]
        ratios = sorted(b / a for a, b in zip(res["times"]["off"], res["times"]["on"]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        n = res["collectives_per_step"]
        print(f"{layout:<22}{off:>12.4f}{on:>12.4f}{on / off:>8.3f}"
              f"{q[1]:>10.3f} ({q[0]:.3f}-{q[2]:.3f}){n:>12.1f}"
              f"{(on + n * max(forward_s, 0.0)) / off:>9.3f}"
              f"{statistics.median(res['times']['stacks']) / off:>8.3f}"
              f"{statistics.median(c['on']) / statistics.median(c['off']):>8.3f}"
              f"{statistics.median(c['stacks']) / statistics.median(c['off']):>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
