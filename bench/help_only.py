"""The command line of a bench script that takes no options: `--help` prints its docstring
(what it measures) instead of running it; anything else is argparse's one-line error."""

from __future__ import annotations

import argparse


def help_only(doc: str | None, argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)


if __name__ == "__main__":  # a module of the bench scripts; as a script it only describes itself
    help_only(__doc__)
