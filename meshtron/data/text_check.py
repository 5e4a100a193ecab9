"""Is a text source really UTF-8 text? Counted while decoding, before a byte is tokenized.

A file in another encoding decodes without an error (undecodable bytes become U+FFFD), so a
Latin-1 or UTF-16 file would train on damaged text without a word. Two counts tell it:
undecodable UTF-8 sequences (Latin-1/cp1252 accents, binary data) and NUL bytes (UTF-16/32
puts one beside almost every ASCII character; real text has none). Above
`REFUSE_SHARE` of a file's bytes the file is refused in one line; below it (a stray byte in a
scraped page) the run goes on and the count is reported as a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshtron.errors import UserError

REFUSE_SHARE = 0.01
"""Undecodable sequences or NUL bytes above this share of a file's bytes: not UTF-8 text."""

_REPLACEMENT = "\ufffd"
_REPLACEMENT_UTF8 = _REPLACEMENT.encode("utf-8")


@dataclass
class TextDamage:
    """What decoding one file as UTF-8 met: undecodable sequences and NULs, over its bytes."""

    path: Path
    size: int = 0
    undecodable: int = 0
    nuls: int = 0

    def add(self, raw: bytes, text: str) -> None:
        """Count one decoded chunk (`text` = `raw` decoded with errors='replace')."""
        self.size += len(raw)
        self.nuls += raw.count(b"\x00")
        # U+FFFD already in the file is text, not damage.
        self.undecodable += text.count(_REPLACEMENT) - raw.count(_REPLACEMENT_UTF8)

    def share(self) -> float:
        return max(self.undecodable, self.nuls) / self.size if self.size else 0.0

    def describe(self) -> str:
        parts = []
        if self.undecodable:
            plural = "s" if self.undecodable > 1 else ""
            parts.append(f"{self.undecodable} undecodable UTF-8 sequence{plural} "
                         f"({100 * self.undecodable / self.size:.3g}% of its bytes)")
        if self.nuls:
            plural = "s" if self.nuls > 1 else ""
            parts.append(f"{self.nuls} NUL byte{plural} ({100 * self.nuls / self.size:.3g}%)")
        return " and ".join(parts)

    def check(self, warnings: list[str] | None) -> None:
        """Refuse the file above REFUSE_SHARE; below it, append a warning to `warnings`."""
        if not (self.undecodable or self.nuls):
            return
        if self.share() > REFUSE_SHARE:
            wide = self.nuls * 4 > self.size  # UTF-16/32: a NUL beside most ASCII letters
            guess = "UTF-16" if wide else "LATIN1"
            raise UserError(
                f"data.source='{self.path}': not UTF-8 text ({guess}?): {self.describe()}; "
                f"allowed: UTF-8 text with at most {REFUSE_SHARE:.0%} damaged bytes (convert "
                f"it, e.g. `iconv -f {guess} -t UTF-8 FILE`)")
        if warnings is not None:
            warnings.append(f"data.source='{self.path}': {self.describe()}, read as U+FFFD "
                            "(the file is not clean UTF-8)")


def decode_file(path: Path, warnings: list[str] | None = None) -> str:
    """A text file's contents as UTF-8, refused or warned about as `TextDamage.check` says."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    damage = TextDamage(path)
    damage.add(raw, text)
    damage.check(warnings)
    return text


def warning_lines(warnings: list[str], most: int = 5) -> list[str]:
    """What to print of a source's warnings: the first `most`, then how many more files."""
    more = [f"{len(warnings) - most} more files like these"] if len(warnings) > most else []
    return warnings[:most] + more
