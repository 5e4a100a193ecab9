"""argparse types shared by the subcommands: a bad value is refused while parsing, as one line
naming the flag (the parser's `error` raises `UserError`; see meshtron/cli.py)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import Any

from meshtron.errors import UserError


def positive_int(text: str) -> int:
    """An integer >= 1 (`--nproc 0` and `--nproc -1` are refused, not run as one rank)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (a seed: numpy's generators refuse a negative one with a traceback)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {low}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= {low}")
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


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (a price, a rate or a time that may be zero). Checked on the flag
    itself, so the refusal names the flag and the value typed, not a field it is scaled into
    (`--restart-min -1` used to read `restart_s=-60.0`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 0") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number >= 0")
    return value


def output_file(text: str) -> str:
    """A file to write: refused when it names an existing folder (checked before any work)."""
    if not text:
        raise argparse.ArgumentTypeError("'': expected a file path")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a folder; expected a file path")
    return text


def existing_file(path: str | Path, field: str) -> Path:
    """A file to read, as the one check every reader shares: a folder or a missing path is one
    line naming `field` and saying which it is (a folder is not "file does not exist")."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{field}={str(path)!r}: is a folder; expected a file")
    if not path.exists():
        raise UserError(f"{field}={str(path)!r}: file does not exist")
    if not path.is_file():  # /dev/null, a pipe: it exists (was "file does not exist")
        raise UserError(f"{field}={str(path)!r}: not a regular file (a device, pipe or "
                        "socket); expected a file")
    return path


def folder_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a folder, in the words every folder reader uses ("does not
    exist" / "is a file, not a folder"); None when it is one. A missing folder used to read
    "not a folder" (session-55 audit: `merge --experts runs/typo`)."""
    path = Path(path)
    if path.is_dir():
        return None
    return "is a file, not a folder" if path.exists() else "does not exist"


def read_text(path: str | Path, field: str) -> str:
    """The text of a file the user named: `existing_file`'s checks, then a file that is not
    UTF-8 text (a binary, a checkpoint shard) or cannot be read is one line naming `field`,
    not a UnicodeDecodeError traceback."""
    path = existing_file(path, field)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{field}={str(path)!r}: not a UTF-8 text file (byte "
                        f"0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{field}={str(path)!r}: cannot be read ({exc.strerror or exc})") from None


def writable_target(path: str | Path, field: str) -> Path:
    """An output path (file or folder) whose nearest existing parent is a folder this process can
    create files in: probed with a temporary file, removed at once (`os.access` says yes to root
    even on /proc). Checked before any work, so an unwritable output path is one line naming
    `field`, exit 2, nothing written."""
    import tempfile

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{field}={str(path)!r}: {str(folder)!r} is a file, so nothing can be "
                        "created under it")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UserError(f"{field}={str(path)!r}: cannot write in {str(folder)!r} "
                        f"({exc.strerror or exc})") from None
    return path


def take_from_plan(args: argparse.Namespace, plan, path: str, flags=("model", "cluster"),
                   require: bool = False) -> None:
    """Each of `flags` from the saved plan where the command line leaves it out (`cost --plan`,
    `simulate --step --plan`); a flag that contradicts the file is refused in one line, and with
    `require` so is a flag neither gives."""
    for flag in flags:
        given, saved = getattr(args, flag), getattr(plan, flag)
        dashed = flag.replace("_", "-")
        if given is not None and saved is not None and not _same_value(given, saved):
            raise UserError(f"{dashed}={given!r}: contradicts the plan {path}, made for "
                            f"{flag} {saved!r}; drop --{dashed} or re-plan")
        if require and given is None and saved is None:
            raise UserError(f"plan={path!r}: names no {flag}; give --{dashed}")
        setattr(args, flag, given or saved)


def _same_value(given: Any, saved: Any) -> bool:
    """A flag restates the plan's value: equal, or one file or folder spelled two ways
    (`--model ./config.json` beside a plan saved with its absolute path)."""
    if given == saved:
        return True
    if not (isinstance(given, str) and isinstance(saved, str) and given.strip()
            and saved.strip()):
        return False
    try:
        return Path(given).exists() and Path(saved).exists() and Path(given).samefile(saved)
    except OSError:
        return False


def literal_value(text: str) -> Any:
    """A --set value: TOML's true / false (what a run file says), a Python literal, else the
    text itself (train's and merge's --set KEY=VALUE)."""
    if text.strip() in ("true", "false"):
        return text.strip() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


NEGATIVE_VALUE = re.compile(r"^-\.?\d")
"""A command-line word that starts like a negative number ('-1T', '-2e12', '-8..16')."""


def negative_values_are_values(parser: argparse.ArgumentParser) -> None:
    """Read a word like '-1T' after a flag as that flag's value, so that its type refuses it
    in one line naming the flag and the value. argparse takes a word for a value only when it
    matches its negative-number pattern ('-1', '-.5': CPython 3.11 Lib/argparse.py
    `_parse_optional`, `_negative_number_matcher`), and answered '--tokens -1T' with "expected
    one argument". For parsers with no flag that itself looks like a negative number."""
    parser._negative_number_matcher = NEGATIVE_VALUE  # type: ignore[attr-defined]
