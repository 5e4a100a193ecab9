"""`meshtron calibrate --nproc N`: measure N local ranks and write a cluster TOML for the planner."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from meshtron.argtypes import output_file, positive_int, writable_target
from meshtron.errors import UserError

DEFAULT_DIR = Path("runs/calibration")


def default_cluster_path(nproc: int) -> Path:
    return DEFAULT_DIR / f"local-{nproc}.toml"


def check_out(out: Path) -> None:
    """The cluster file can be written: checked before anything is measured."""
    if out.is_dir():
        raise UserError(f"--out={str(out)!r}: is a folder; expected a file path")
    writable_target(out, "--out")


def cmd_router_stats(args: argparse.Namespace) -> int:
    """--router-stats: the expert imbalance of a run, as a plan [options] file."""
    from meshtron.calibrate.router_stats import measured_imbalance, options_toml

    value, steps = measured_imbalance(args.router_stats)
    out = Path(args.out) if args.out else DEFAULT_DIR / "router-options.toml"
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(options_toml(value, args.router_stats, steps))
    print(f"expert imbalance {value:.3f} (max/mean expert load, {steps} logged steps after "
          f"warm-up) -> {out}; use: meshtron plan --options {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from meshtron.launch import check_nproc, current_world, launch_local

    if getattr(args, "router_stats", None):
        return cmd_router_stats(args)

    world = current_world()
    out = Path(args.out) if args.out else None
    if world.rank == 0:
        check_out(out or default_cluster_path(world.world_size if world.source != "single"
                                              else args.nproc))
    if world.source == "single" and args.nproc > 1:
        check_nproc(args.nproc)
        argv = ["calibrate", "--nproc", str(args.nproc)] + (["--out", args.out] if args.out else [])
        return launch_local(args.nproc, argv)
    return run_calibration(world, out)


def run_calibration(world, out: Path | None) -> int:
    import tomli_w

    from meshtron.calibrate.measure import calibrate
    from meshtron.calibrate.stats import warning_line
    from meshtron.runtime import init_rank, shutdown_rank

    device = init_rank(world)
    cal = calibrate(device)
    if world.rank == 0:
        out = out or default_cluster_path(world.world_size)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        try:
            tmp.write_text(tomli_w.dumps(cal.cluster_dict(name=f"local-{world.world_size}")))
            tmp.replace(out)  # never a half-written cluster file
        finally:
            tmp.unlink(missing_ok=True)
        raw = {**dataclasses.asdict(cal), "samples": cal.intra.samples}  # v1 key: intra level
        out.with_suffix(".json").write_text(json.dumps(raw, indent=2))
        print(summary_line(cal, out))
        noisy = warning_line(cal.spread)
        if noisy:  # written all the same: the spread is in the file, plan/train repeat it
            print(noisy, file=sys.stderr, flush=True)
    if world.source != "single":
        shutdown_rank(0)
    return 0


def summary_line(cal, out: Path) -> str:
    """One line per fabric level: what was measured and where it went."""
    levels = []
    for name, lv in (("intra-node", cal.intra), ("inter-node", cal.inter)):
        if lv.group_size > 1:
            levels.append(f"{name} ({lv.group_size} ranks) alpha {lv.latency_us:.1f} us, "
                          f"{lv.bandwidth_gb_per_s:.2f} GB/s; p2p {lv.p2p_latency_us:.1f} us, "
                          f"{lv.p2p_gb_per_s:.2f} GB/s")
    elementwise = ", ".join(f"{k} {v:.1f}" for k, v in cal.elementwise_gb_per_s.items())
    return (f"calibrated {cal.world_size} rank(s) on {cal.nodes} node(s), {cal.device}/"
            f"{cal.backend}: matmul {cal.matmul_tflops * 1e3:.1f} GFLOP/s per rank, memory "
            f"{cal.memory_gb_per_s:.1f} GB/s, element-wise GB/s: {elementwise}, eager op "
            f"{cal.kernel_overhead_us:.1f} us; " + ("; ".join(levels) or "no collectives")
            + f" -> {out}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a cluster file",
                       description="Measure GEMM throughput by shape, memory and element-wise "
                                   "bandwidth, eager op overhead, and collective latency/"
                                   "bandwidth per fabric level (inside a node, across nodes) "
                                   "over the real backend; write a cluster TOML that "
                                   "`meshtron plan --cluster` accepts.")
    p.add_argument("--nproc", type=positive_int, default=1,
                   help="local ranks to measure (default 1)")
    p.add_argument("--out", type=output_file,
                   help=f"cluster TOML to write (default {DEFAULT_DIR}/local-N.toml)")
    p.add_argument("--router-stats", metavar="METRICS.jsonl", default=None,
                   help="instead of measuring the machine: read a MoE run's router statistics "
                        "and write the planner's expert_imbalance as an [options] TOML "
                        "(--out; default runs/calibration/router-options.toml)")
    p.set_defaults(func=cmd_calibrate)
