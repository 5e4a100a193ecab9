"""argparse types shared by the subcommands: a bad value is refused while parsing, as one line
naming the flag (the parser's `error` raises `UserError`; see meshtron/cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer >= 1 (`--nproc 0` and `--nproc -1` are refused, not run as one rank)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, e.g. `--watchdog-timeout`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def output_file(text: str) -> str:
    """A file to write: refused when it names an existing folder (checked before any work)."""
    if not text:
        raise argparse.ArgumentTypeError("'': expected a file path")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a folder; expected a file path")
    return text
