"""`meshtron plan`, `cost`, `simulate` (each run and its `--help`), `rehearse --help`,
`merge --help` and `--help` must start without importing torch (the CLI builds every
subcommand's parser; a torch import costs 2-4 s per command)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
from meshtron.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code or 0)
"""


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["plan", "--help"],
    ["cost", "--help"],
    ["simulate", "--help"],
    ["merge", "--help"],
    ["rehearse", "--help"],
    ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--global-batch", "64",
     "--seq-len", "4096", "--top", "1"],
    ["cost", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--tokens", "1T",
     "--global-batch", "64", "--seq-len", "4096"],
    ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--step",
     "--global-batch", "64", "--seq-len", "4096"],
])
def test_command_does_not_import_torch(argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    last = out.stdout.strip().splitlines()[-1]
    assert last.split() == ["NO-TORCH", "0"], (argv, out.stdout[-500:], out.stderr[-500:])


def test_plan_builds_only_the_planner_parser():
    """`meshtron plan` registers only the planner's subcommand (meshtron/cli.py COMMANDS): the
    training, checkpoint and launcher modules that `train`'s flags import stay unimported, and
    rich is imported only to draw tables (not for --json)."""
    probe = ("import sys; from meshtron.cli import main; rc = main(sys.argv[1:]); "
             "bad = sorted(m for m in ('meshtron.train.job', 'meshtron.checkpoint', 'rich') "
             "if m in sys.modules); print('IMPORTED', *bad, rc)")
    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--global-batch", "64",
            "--seq-len", "4096", "--top", "1", "--json"]
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "IMPORTED 0", out.stderr[-500:]
