"""The shell commands the README and docs show, read mechanically (tests/test_docs.py runs them).

A command is a line of a fenced block with no language (or bash/sh/shell) whose first word is a
program we document (`.venv/bin/meshtron`, `meshtron`, `torchrun`, `srun`, `make`, `python`,
`pip`, `kill`); backslash continuations are joined, trailing comments and `&` dropped. Inline
spans (`meshtron plan ...` in the prose) are read apart: they are often fragments (`meshtron
train --plan` names a flag), so only their flags are checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "guides").glob("*.md"))]
PROGRAMS = (".venv/bin/meshtron", "meshtron", "torchrun", "srun", "make", "python", "pip", "kill")

# Placeholders the docs use, and what a parse or a run substitutes for them.
PLACEHOLDERS = {"RUN_DIR": "runs/x", "DIR": "out/", "N": "2", "G": "2", "HEAD:29400":
                "localhost:29400", "HOST:29500": "localhost:29500"}


@dataclass(frozen=True)
class Command:
    doc: str     # path relative to the repository root
    line: int    # 1-based line of the command's first line
    text: str    # the command as a user types it (continuations joined, comment dropped)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def words(self) -> list[str]:
        return shlex.split(self.text)


def _strip_comment(line: str) -> str:
    """`cmd   # why` -> `cmd` (a '#' after whitespace, outside quotes)."""
    out, quote = [], None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).rstrip()


def fenced_commands() -> list[Command]:
    """Every documented command in a fenced block, in document order."""
    cmds = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if m.group(1) not in ("", "bash", "sh", "shell"):
                continue
            first = text[:m.start(2)].count("\n") + 1
            lines = m.group(2).splitlines()
            i = 0
            while i < len(lines):
                start, line = i, _strip_comment(lines[i])
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1].rstrip() + " " + _strip_comment(lines[i]).strip()
                i += 1
                line = line.strip().removesuffix("&").strip()
                if line.split(" ", 1)[0] in PROGRAMS:
                    cmds.append(Command(str(path.relative_to(ROOT)), first + start, line))
    return cmds


def prose(text: str) -> str:
    """`text` with its fenced blocks blanked (newlines kept, so line numbers stay)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                  flags=re.S | re.M)


def inline_spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of the prose, whitespace collapsed; a span
    holding several commands (`a; b`) gives one per command."""
    text = prose(path.read_text())
    out = []
    for m in re.finditer(r"`([^`]+)`", text):
        line = text[:m.start()].count("\n") + 1
        out += [(line, part.strip()) for part in " ".join(m.group(1).split()).split(";")]
    return out


def inline_meshtron_spans() -> list[Command]:
    """`meshtron SUB ...` spans in the prose (a span may wrap over lines)."""
    out = []
    for path in DOCS:
        for line, span in inline_spans(path):
            if re.match(r"(?:\.venv/bin/)?meshtron [a-z]", span):
                out.append(Command(str(path.relative_to(ROOT)), line, span))
    return out


def meshtron_argv(cmd: Command) -> list[str] | None:
    """The meshtron arguments of a command (after `.venv/bin/meshtron`, `python -m meshtron`,
    `torchrun ... -m meshtron`, `srun ... meshtron`), placeholders substituted, `...` and the
    brackets of optional parts dropped, the first of `a|b` alternatives kept; None when the
    command does not run meshtron."""
    words = cmd.text.replace("[", " ").replace("]", " ").split()
    for i, w in enumerate(words):
        if w.endswith("meshtron") and (w in (".venv/bin/meshtron", "meshtron")
                                       or words[i - 1] == "-m"):
            rest = words[i + 1:]
            break
    else:
        return None
    argv = []
    for w in rest:
        if w == "..." and argv and argv[-1].startswith("--"):
            w = "auto"  # `--plan ...`: a flag whose value the doc leaves open
        elif w == "..." or w.startswith("<"):
            continue
        w = PLACEHOLDERS.get(w, w)
        if "|" in w and not w.startswith("-"):
            w = w.split("|")[0]
        argv.append(w)
    return argv
