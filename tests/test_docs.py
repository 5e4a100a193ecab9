"""The documentation site builds with warnings as errors (a broken link, an anchor that does not
exist or a page left out of the navigation fails), its reference pages are generated from the
code, and the README's links point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strict_with_generated_reference(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    cli = (site / "reference/cli/index.html").read_text()
    from meshtron.cli import COMMANDS
    for name in COMMANDS:  # every subcommand's own usage line, from its parser
        assert f"usage: meshtron {name}" in cli, name
    config = (site / "reference/config/index.html").read_text()
    for key in ("data.seq_len", "optim.warmup_steps", "train.steps", "model.kv_heads",
                "grad_compression"):
        assert key in config, key
    assert "Sequences per optimizer step, summed over all data-parallel ranks." in config
    api = (site / "reference/api/index.html").read_text()
    for name in ("parallelize", "build_mesh", "search_plans", "Plan"):
        assert f"meshtron.{name}" in api, name


def test_readme_links_exist_and_readme_is_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160, "the README is an entry point; details go in docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    for link in local:
        assert (ROOT / link).exists(), link
