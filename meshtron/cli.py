"""The `meshtron` command line: one subcommand per concern, each registered by its own package.

User errors (`UserError`) end as one line on stderr and exit code 2, never a traceback; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from meshtron.errors import RunFailed, UserError
from meshtron.launch import ARGV_ENV

# Each module exposes `register(subparsers)`, which adds its subcommand(s) and sets `func`.
# Imports are lazy inside the commands so that `meshtron plan` does not pay for `import torch`.
COMMAND_MODULES = [
    "meshtron.train.cli",
    "meshtron.calibrate.cli",
    "meshtron.planner.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshtron",
        description="Plan, run, protect and explain LLM training across many GPUs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None and os.environ.get(ARGV_ENV) and len(sys.argv) == 1:
        argv = json.loads(os.environ[ARGV_ENV])  # a rank started by meshtron.launch
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"meshtron {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an unwritable run folder, a full disk: the user's to fix
        print(f"meshtron {args.command}: error: {exc.strerror or exc}: "
              f"{exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"meshtron {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"meshtron {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
