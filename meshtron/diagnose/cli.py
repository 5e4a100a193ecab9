"""`meshtron doctor RUN_DIR [--json]` and `meshtron doctor --nccl-log FILE...`."""

from __future__ import annotations

import argparse
import json

from meshtron.argtypes import positive_int
from meshtron.errors import UserError


EXIT_NCCL_PROBLEMS = 3
"""`doctor --nccl-log` exit code when the logs show at least one error-severity problem (0: none,
warnings allowed; 2: bad input; 1: a bug), so a script or CI step can gate on it."""


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.nccl_log:
        from meshtron.diagnose import nccl

        report = nccl.analyze_files(args.nccl_log, tp=args.tp)
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report.text())
        return EXIT_NCCL_PROBLEMS if report.errors() else 0
    if not args.run_dir:
        raise UserError("RUN_DIR: missing; give a run folder (or --nccl-log FILE...)")
    if args.timeline:
        return _timeline(args)
    from meshtron.diagnose.analyze import diagnose
    from meshtron.diagnose.trace import load_trace

    diagnosis = diagnose(load_trace(args.run_dir))
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
        return 0
    print(diagnosis.verdict)
    print()
    print(f"kind: {diagnosis.kind}; culprit ranks: {diagnosis.culprit_ranks or 'none'}")
    for line in diagnosis.evidence:
        print(f"  {line}")
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from meshtron.diagnose.timeline_view import build_report

    report = build_report(args.run_dir, png=not args.no_png)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="explain a hung or failed run (or NCCL logs)",
                       description="Read the trace a run's ranks dumped (RUN_DIR/trace: on a "
                                   "watchdog timeout, an exception, SIGTERM, SIGUSR1 or at the "
                                   "end) and say in one sentence which rank is the culprit, then "
                                   "the evidence. With --nccl-log, read NCCL_DEBUG=INFO logs.")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="the run folder")
    p.add_argument("--json", action="store_true",
                   help="machine-readable: verdict, kind, culprit_ranks, evidence")
    p.add_argument("--nccl-log", nargs="+", metavar="FILE",
                   help="NCCL_DEBUG=INFO/WARN log files (one per rank, or one merged); exit code "
                        "3 when they show a problem (error), 0 otherwise")
    p.add_argument("--tp", type=positive_int, metavar="N",
                   help="with --nccl-log: the tensor-parallel degree (communicators of this "
                        "size are read as tensor-parallel groups)")
    p.add_argument("--timeline", action="store_true",
                   help="per-rank compute/communication/idle of the last steps: writes "
                        "RUN_DIR/trace/timeline.json (Chrome trace / Perfetto) and timeline.png, "
                        "prints the fractions and the pipeline bubble beside the planner's")
    p.add_argument("--no-png", action="store_true", help="with --timeline: skip the plot")
    p.set_defaults(func=cmd_doctor)


