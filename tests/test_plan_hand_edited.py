"""Hand-edited plan files: `meshtron train --plan` checks what `meshtron cost --plan` checks
(the stack and options resolved by frameworks.for_plan), refuses an option that contradicts
the plan's own field (stack = "compiled" without compile, reduce_dtype), and trains a plan
priced with grad_clip = false unclipped (or refuses a run that clips)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from testkit.plan_cli import commands_fixture


cli = commands_fixture("meshtron.planner.cli")

TINY = ["--model", "tiny", "--cluster", "dgx-h100:1", "--global-batch", "16", "--seq-len", "256",
        "--layout", "dp=8", "--top", "1"]


def _meshtron(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", *argv], capture_output=True,
                          text=True, timeout=600)


def _edited(cli, tmp_path: Path, framework: str | None, options: str = "") -> Path:
    """A saved tiny dp=8 plan with `framework` and a [framework_options] table written in."""
    path = tmp_path / "plan.toml"
    rc, _, err = cli("plan", *TINY, "--save", str(path))
    assert rc == 0, err
    text = path.read_text()
    if framework:
        text = text.replace('model = "tiny"\n', f'model = "tiny"\nframework = "{framework}"\n')
    if options:
        text += f"\n[framework_options]\n{options}\n"
    path.write_text(text)
    return path


def _refused(done: subprocess.CompletedProcess, *words: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.mark.parametrize("framework, options, words", [
    ("meshtron@2099", "", ("plan.framework='meshtron@2099'", "allowed values")),
    ("bogus", "", ("plan.framework='bogus'", "allowed values")),
    ("meshtron@2026", "expert_imbalance = -3.0", ("expert_imbalance=-3.0", "from 1")),
    ("meshtron@2026", 'dtype = "bf16"', ("plan.framework_options.dtype", "unknown option")),
    ("meshtron@2026", 'stack = "compiled"', ("options.stack='compiled'",
                                             "plan.compile=false")),
    (None, 'reduce_dtype = "bf16"', ("reduce_dtype='bf16'", "plan.reduce_dtype='fp32'")),
])
def test_train_refuses_what_cost_refuses(cli, tmp_path, framework, options, words):
    path = _edited(cli, tmp_path, framework, options)
    run_dir = tmp_path / "run"
    train = _refused(_meshtron("train", "--plan", str(path), "--steps", "1", "--run-dir",
                               str(run_dir)), *words)
    assert "priced for that stack" not in train and "no decision" not in train
    assert not run_dir.exists()  # nothing written
    cost = _refused(_meshtron("cost", "--plan", str(path)), *words)
    assert cost.split("error: ", 1)[1] == train.split("error: ", 1)[1]


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_a_plan_priced_unclipped_trains_unclipped_or_refuses_clipping(cli, tmp_path):
    path = _edited(cli, tmp_path, "meshtron@2026", "grad_clip = false")
    clipped = tmp_path / "clipped"
    _refused(_meshtron("train", "--plan", str(path), "--steps", "1", "--run-dir", str(clipped),
                       "--set", "optim.grad_clip=1.0"), "optim.grad_clip=1.0",
             "grad_clip = false")
    assert not clipped.exists()
    run_dir = tmp_path / "run"
    done = _meshtron("train", "--plan", str(path), "--steps", "1", "--nproc", "8",
                     "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    run = tomllib.loads((run_dir / "run.toml").read_text())
    assert run["optim"]["grad_clip"] == 0.0
