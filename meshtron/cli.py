"""The `meshtron` command line: one subcommand per concern, each registered by its own package.

User errors (`UserError`, and flags argparse refuses) end as one line on stderr and exit code 2,
never a traceback; `RunFailed` (a job that started and could not finish) as one line and exit
code 1; any other exception is a bug and keeps its traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from meshtron.errors import RunFailed, UserError

# Each module exposes `register(subparsers)`, which adds its subcommand(s) and sets `func`.
# Imports are lazy inside the commands so that `meshtron plan` does not pay for `import torch`.
COMMAND_MODULES = [
    "meshtron.train.cli",
    "meshtron.calibrate.cli",
    "meshtron.planner.cli",
    "meshtron.diagnose.cli",
    "meshtron.hf.cli",
    "meshtron.cost.cli",
    "meshtron.simulate.cli",
    "meshtron.modular.cli",
    "meshtron.rehearse.cli",
    "meshtron.tokenize_cli",
]


COMMANDS = {"train": "meshtron.train.cli", "demo": "meshtron.train.cli",
            "calibrate": "meshtron.calibrate.cli", "plan": "meshtron.planner.cli",
            "doctor": "meshtron.diagnose.cli", "export": "meshtron.hf.cli",
            "cost": "meshtron.cost.cli", "simulate": "meshtron.simulate.cli",
            "merge": "meshtron.modular.cli", "rehearse": "meshtron.rehearse.cli",
            "tokenize": "meshtron.tokenize_cli"}
"""The module that registers each subcommand: `meshtron plan ...` builds only the planner's
parser, so it does not import the training, checkpoint and launcher modules that `train`'s
flags need (about half of a plain `plan`'s start-up on a loaded machine; bench/planner_speed.py
--startup). `--help` and unknown commands build them all."""


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors raised as `UserError` (one line, exit code 2) instead of
    a usage dump and `sys.exit`; `--help` still prints and exits 0."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or only of `command`'s module when it is a known one."""
    parser = Parser(prog="meshtron",
                    description="Plan, run, protect and explain LLM training across many GPUs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    only = COMMANDS.get(command or "")
    for name in [only] if only in COMMAND_MODULES else COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from meshtron.launch import bind_to_parent, leave_on_interrupt, rank_argv

        argv = rank_argv()
        if argv is not None:  # a rank `launch_local` started: it ends with torchrun's agent
            bind_to_parent()
            leave_on_interrupt()
        argv = argv or sys.argv[1:]
    argv = list(argv)
    name = f"meshtron {argv[0]}" if argv and not argv[0].startswith("-") else "meshtron"
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        if getattr(args, "rehearse", False) is True:  # `plan --rehearse`: the runtime's part
            from meshtron.rehearse.run import print_report, rehearse_best

            args.rehearsal = (rehearse_best, print_report)
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"{name}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `meshtron plan | head`: the reader left; no traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it


if __name__ == "__main__":
    sys.exit(main())
