"""`meshtron calibrate --nproc N`: measure N local ranks and write a cluster TOML for the planner."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from meshtron.argtypes import output_file, positive_int
from meshtron.errors import UserError

DEFAULT_DIR = Path("runs/calibration")


def default_cluster_path(nproc: int) -> Path:
    return DEFAULT_DIR / f"local-{nproc}.toml"


def check_out(out: Path) -> None:
    """The cluster file can be written: checked before anything is measured."""
    if out.is_dir():
        raise UserError(f"--out={str(out)!r}: is a folder; expected a file path")
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out={str(out)!r}: {str(existing)!r} is not a writable folder")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from meshtron.launch import check_nproc, current_world, launch_local

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
        out.with_suffix(".json").write_text(json.dumps(dataclasses.asdict(cal), indent=2))
        print(f"calibrated {world.world_size} rank(s) on {cal.device}/{cal.backend}: "
              f"matmul {cal.matmul_tflops * 1e3:.1f} GFLOP/s per rank, memory "
              f"{cal.memory_gb_per_s:.1f} GB/s, collectives alpha {cal.latency_us:.1f} us "
              f"per step, {cal.bandwidth_gb_per_s:.2f} GB/s; p2p {cal.p2p_latency_us:.1f} us, "
              f"{cal.p2p_gb_per_s:.2f} GB/s -> {out}")
    if world.source != "single":
        shutdown_rank(0)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a cluster file",
                       description="Measure matmul throughput, memory bandwidth and collective "
                                   "latency/bandwidth across N local ranks over the real backend; "
                                   "write a cluster TOML that `meshtron plan --cluster` accepts.")
    p.add_argument("--nproc", type=positive_int, default=1,
                   help="local ranks to measure (default 1)")
    p.add_argument("--out", type=output_file,
                   help=f"cluster TOML to write (default {DEFAULT_DIR}/local-N.toml)")
    p.set_defaults(func=cmd_calibrate)
