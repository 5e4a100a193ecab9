"""`python bench/X.py --help` for every bench script: exit 0, a usage line, the first line of the
script's docstring (what it measures), within a generous bound, and without importing torch
(the options are parsed before any heavy import), as a user types it.

The bound is a correctness check (--help must not run the benchmark, which takes minutes), not
a timing claim: 30 s per script on the shared, loaded CI machine.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))
BOUND_S = 30.0

# Scripts whose --help may import torch, and why. Empty: every script parses its options
# before importing torch (an entry here must say why it cannot).
TORCH_BEFORE_PARSE: dict[str, str] = {}


def _first_doc_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    return doc.strip().splitlines()[0].strip() if doc.strip() else ""


def _help(path: Path) -> tuple[subprocess.CompletedProcess, float]:
    # -X importtime lists every module imported (on stderr), so the run shows whether --help
    # pulled in torch without changing what the script does.
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-X", "importtime", str(path.relative_to(ROOT)),
                               "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=BOUND_S * 4)
    except subprocess.TimeoutExpired as exc:  # ran the benchmark instead: that script fails
        proc = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", exc.stderr or "")
    return proc, time.perf_counter() - t


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    # A few at a time: each is a Python start plus imports; more would only queue on 2 cores
    # and stretch every measured time.
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip((p.name for p in SCRIPTS), pool.map(_help, SCRIPTS)))


def test_scripts_found():
    assert len(SCRIPTS) >= 30, [p.name for p in SCRIPTS]
    assert set(TORCH_BEFORE_PARSE) <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_help(path: Path, helps):
    proc, seconds = helps[path.name]
    out = proc.stdout
    assert proc.returncode == 0, \
        f"{path.name} --help: exit {proc.returncode} after {seconds:.1f} s\n{proc.stderr[-2000:]}"
    assert out.startswith("usage: "), f"{path.name} --help printed:\n{out[:500]}"
    first = _first_doc_line(path)
    assert first, f"{path.name} has no docstring saying what it measures"
    # whitespace aside: argparse's default formatter re-wraps a description
    assert " ".join(first.split()) in " ".join(out.split()), \
        f"{path.name} --help does not show its docstring's first line {first!r}"
    assert "-h, --help" in out
    assert seconds < BOUND_S, f"{path.name} --help took {seconds:.1f} s (bound {BOUND_S:.0f} s)"
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    if path.name not in TORCH_BEFORE_PARSE:
        assert "torch" not in imported, f"{path.name} --help imports torch"
