"""`meshtron doctor RUN_DIR [--json]` and `meshtron doctor --nccl-log FILE...`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshtron.argtypes import positive_int
from meshtron.errors import UserError
from meshtron.train import earlier


EXIT_FOUND = 3
"""A problem found: a verdict other than `none`, `no_dump` or `preempted` (a culprit rank
named, or an exception a rank raised, in any attempt of a restarted run) or, with --nccl-log,
at least one error-severity problem in the logs."""
EXIT_NO_DUMP = 4
"""No rank has dumped (killed from outside, interrupted, or the run is still going): nothing
was judged."""
NOT_PROBLEMS = ("none", "no_dump", "preempted")
"""Verdicts that name no problem: a preemption is the scheduler's, not the run's."""
EXIT_CODES = ("exit code 0: nothing wrong found (a preemption included); 3: a problem found "
              "(a culprit rank named, an exception a rank raised, or NCCL log errors); 4: no "
              "rank has dumped, nothing to judge; 2: bad input; 1: a bug")


def cmd_doctor(args: argparse.Namespace) -> int:
    _check_options(args)
    if args.nccl_log:
        from meshtron.diagnose import nccl

        report = nccl.analyze_files(args.nccl_log, tp=args.tp)
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report.text())
        return EXIT_FOUND if report.errors() else 0
    if not args.run_dir:
        raise UserError("RUN_DIR: missing; give a run folder (or --nccl-log FILE...)")
    if args.timeline:
        return _timeline(args)
    return _judge(args)


def _judge(args: argparse.Namespace) -> int:
    """The verdict of every attempt of the launch judged (the current one, or --earlier N);
    for the current one, a line naming the earlier launches a --resume kept."""
    from meshtron.diagnose.analyze import diagnose
    from meshtron.diagnose.trace import load_attempts

    kept = {} if args.earlier else earlier.launches(_run_folder(args.run_dir))
    try:
        traces = load_attempts(_evidence_dir(args))
    except UserError as exc:  # nothing to judge now (a resume that failed at its start)
        if not kept:
            raise
        raise UserError(f"{exc}; {_earlier_line(args.run_dir, kept).strip()}") from None
    for trace in traces:  # judged from the other files; said once, on stderr
        for name, why in trace.unreadable.items():
            print(f"meshtron doctor: warning: {trace.trace_dir / name}: {why}; judged from "
                  "the other files", file=sys.stderr)
    found = [(trace.attempt, diagnose(trace)) for trace in traces]
    if args.json:
        latest, diagnosis = found[-1]
        doc = {**diagnosis.to_dict(), "attempt": latest}
        if len(found) > 1:
            doc["attempts"] = [{"attempt": n, **d.to_dict()} for n, d in found]
        if kept:
            doc["earlier"] = {str(n): str(path) for n, path in kept.items()}
        print(json.dumps(doc, indent=2))
    else:
        _print_attempts(found)
        if kept:
            print(_earlier_line(args.run_dir, kept))
    return exit_code([d for _, d in found])


def _run_folder(run_dir: str) -> Path:
    """RUN_DIR, also when given as RUN_DIR/trace (as `meshtron doctor` accepts it)."""
    path = Path(run_dir)
    return path.parent if path.name == "trace" and not (path / "trace").is_dir() else path


def _evidence_dir(args: argparse.Namespace):
    """The folder judged: RUN_DIR (its current launch), or with --earlier N the launch a
    --resume kept in RUN_DIR/earlier/N (train/earlier.py)."""
    if not args.earlier:
        return args.run_dir
    kept = earlier.launches(_run_folder(args.run_dir))
    if args.earlier not in kept:
        have = (f"it keeps {', '.join(str(n) for n in kept)}" if kept else
                "it keeps none (only a --resume of a launch that left a trace keeps one)")
        raise UserError(f"--earlier={args.earlier}: no earlier launch {args.earlier} in "
                        f"{earlier.root(_run_folder(args.run_dir))}; {have}")
    return kept[args.earlier]


def _earlier_line(run_dir: str, kept: dict) -> str:
    """One line: the launches before a --resume exist, and how to read them (the verdict
    above is the current launch's only, and so is the exit code)."""
    return (f"\nearlier launches (before a --resume): {len(kept)}, kept in "
            f"{earlier.root(_run_folder(run_dir))}; the one just before this: meshtron doctor "
            f"{run_dir} --earlier {max(kept)}")


def exit_code(diagnoses) -> int:
    """EXIT_FOUND when any attempt's verdict names a problem; EXIT_NO_DUMP when the latest
    attempt left no dump and no earlier one names a problem; 0 otherwise."""
    if any(d.kind not in NOT_PROBLEMS for d in diagnoses):
        return EXIT_FOUND
    return EXIT_NO_DUMP if diagnoses[-1].kind == "no_dump" else 0


def _print_attempts(found) -> None:
    for i, (n, diagnosis) in enumerate(found):
        indent = ""
        if len(found) > 1:
            when = "latest" if i == len(found) - 1 else "ended; torchrun restarted the ranks"
            print(("\n" if i else "") + f"attempt {n} ({when}):")
            indent = "  "
        print(indent + diagnosis.verdict)
        print()
        print(f"{indent}kind: {diagnosis.kind}; culprit ranks: "
              f"{diagnosis.culprit_ranks or 'none'}")
        for line in diagnosis.evidence:
            print(f"{indent}  {line}")


def _check_options(args: argparse.Namespace) -> None:
    """Options that only mean something with another one: one line, not silently ignored."""
    if args.tp is not None and not args.nccl_log:
        raise UserError(f"--tp={args.tp}: only with --nccl-log FILE... (the tensor-parallel "
                        "degree of the logs' communicators)")
    if args.no_png and not args.timeline:
        raise UserError("--no-png: only with --timeline (it skips the timeline's plot)")
    if args.earlier and (args.timeline or args.nccl_log):
        raise UserError(f"--earlier={args.earlier}: not with --timeline or --nccl-log (it "
                        "judges an earlier launch's trace)")
    if args.timeline and args.nccl_log:
        raise UserError("--timeline: not with --nccl-log (one reads a run folder, the other "
                        "NCCL logs)")


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
                                   "the evidence (each attempt's, after --max-restarts "
                                   "restarts). With --nccl-log, read NCCL_DEBUG=INFO logs. "
                                   + EXIT_CODES + ".")
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
    p.add_argument("--earlier", type=positive_int, metavar="N",
                   help="judge the earlier launch N that a `meshtron train --resume` kept "
                        "(RUN_DIR/earlier/N: its trace and failure notes; 1 the first) instead "
                        "of the current one")
    p.set_defaults(func=cmd_doctor)


