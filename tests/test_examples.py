"""The documentation's Python API example is a file that runs: `examples/train_loop.py` under
torchrun on 2 gloo ranks (ZeRO-3) trains (the loss falls; slow), and the guide
(docs/guides/train.md) shows exactly that file (default suite)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_loop.py"


def test_docs_show_the_example_file():
    guide = (ROOT / "docs" / "guides" / "train.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert EXAMPLE.read_text() in blocks


@pytest.mark.slow  # ~18 CPU-s (2 ranks start-up); the default suite's budget goes to DiLoCo parity
def test_example_trains_on_two_ranks():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(EXAMPLE)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2, proc.stdout
    assert losses[1] < 0.7 * losses[0], losses
