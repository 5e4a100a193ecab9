"""Time of the step-level simulation at 16,384 ranks and of a 64..131,072-GPU sweep, with the
sweep's conclusions for Llama-3-405B at a 16M-token batch (2048 x 8192).

    .venv/bin/python bench/simulate_scale.py [--quick]

Prints side by side: simulated vs analytical step time (ratio), the simulation's wall time per
perturbation (classes simulated), and per GPU count the plan, efficiency and marginal
throughput with the reason scaling degrades.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from meshtron.model.spec import resolve_model
from meshtron.planner import resolve_cluster, search_plans
from meshtron.planner.estimate import Evaluator
from meshtron.simulate.step import Perturbation, simulate_step
from meshtron.simulate.sweep import gpu_counts, stop_point, sweep, write_csv, write_plots


def step_at_16k() -> None:
    model, cluster = resolve_model("llama3-405b"), resolve_cluster("dgx-h100:2048")
    t0 = time.perf_counter()
    est = search_plans(model, cluster, 2048, 8192, None, top_k=1, explain=False).best
    print(f"plan search: {time.perf_counter() - t0:.2f} s -> {est.config.describe()} "
          f"({est.config.gpus:,} ranks, {est.num_microbatches} micro-batches)")
    ev = Evaluator(model, cluster, 2048, 8192)
    base = simulate_step(ev, est)
    print(f"{'case':34} {'step s':>8} {'x analytical':>13} {'x unperturbed':>14} "
          f"{'classes':>8} {'events':>7} {'sim s':>7} {'CPU s':>6}")
    cases = [("unperturbed", Perturbation()),
             ("one GPU 1.2x slow", Perturbation(stragglers=((0, 1.2),))),
             ("one GPU 2x slow", Perturbation(stragglers=((9000, 2.0),))),
             ("jitter sigma 0.02, every rank", Perturbation(jitter=0.02)),
             ("jitter sigma 0.05, every rank", Perturbation(jitter=0.05))]
    for name, pert in cases:
        c0 = time.process_time()
        r = simulate_step(ev, est, pert)
        cpu = time.process_time() - c0
        print(f"{name:34} {r.step_time_s:8.3f} {r.step_time_s / est.step_time_s:13.3f} "
              f"{r.step_time_s / base.step_time_s:14.3f} {r.classes:8d} {r.events:7d} "
              f"{r.seconds:7.2f} {cpu:6.2f}")


def sweep_405b(quick: bool) -> None:
    model, cluster = resolve_model("llama3-405b"), resolve_cluster("dgx-h100:1")
    counts = gpu_counts("512..16384" if quick else "64..131072")
    t0, c0 = time.perf_counter(), time.process_time()
    points = sweep(model, cluster, counts, 2048, 8192, growth_cap=16384)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"\nsweep {counts[0]}..{counts[-1]} GPUs, fixed and growing batch: {dt:.1f} s wall, "
          f"{cpu:.1f} s CPU ({len(points)} plans searched; wall > CPU on a shared machine)")
    print(f"{'series':8} {'GPUs':>7} {'batch':>6} {'eff':>6} {'MFU':>6} {'marginal':>9}  "
          "plan / why")
    for p in points:
        print(f"{p.series:8} {p.gpus:7d} {p.global_batch:6d} {p.scaling_efficiency:6.3f} "
              f"{p.mfu:6.3f} {p.marginal:9.4f}  {p.plan or '-'} | {p.cause}")
    for series in ("fixed", "growing"):
        pts = [p for p in points if p.series == series]
        half, low = stop_point(pts, 0.5), stop_point(pts, 0.001)
        print(f"{series}: added GPUs < 0.5 of a first-size GPU from "
              f"{half.gpus if half else 'never'}; < 0.1% from {low.gpus if low else 'never'}")
    with tempfile.TemporaryDirectory() as d:
        from pathlib import Path

        t0 = time.perf_counter()
        write_csv(points, Path(d) / "sweep.csv")
        write_plots(points, Path(d), "llama3-405b")
        print(f"CSV + 4 plots: {time.perf_counter() - t0:.2f} s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="sweep 512..16,384 GPUs instead of 64..131,072")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    step_at_16k()
    sweep_405b(args.quick)
