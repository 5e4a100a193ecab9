"""`meshtron export` killed (SIGKILL) just before its commit, the rename of the weights to
model.safetensors: config.json and export.json are already there, no model.safetensors; the
same command again is accepted and leaves a complete folder (no shard or temporary file). A
finished export is still refused. Real processes, a real SIGKILL (tests/faults)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAULTS = str(Path(__file__).parent / "faults")


def _meshtron(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_killed_export_leaves_a_folder_a_rerun_accepts(tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    train = _meshtron("train", "--model", "debug", "--steps", "2", "--checkpoint-every", "2",
                      "--seq-len", "32", "--global-batch", "8", "--eval-every", "0",
                      "--run-dir", str(run))
    assert train.returncode == 0, train.stderr[-2000:]
    killed = _meshtron("export", str(run), "--to", str(out),
                       env={"PYTHONPATH": os.pathsep.join([FAULTS, os.environ["PYTHONPATH"]]),
                            "MESHTRON_TEST_KILL_AT_COMMIT": "1"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == \
        ["config.json", "export.json", "model-00000.safetensors"]
    again = _meshtron("export", str(run), "--to", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == \
        ["config.json", "export.json", "model.safetensors"]
    refused = _meshtron("export", str(run), "--to", str(out))
    assert refused.returncode == 2 and "already holds *.safetensors weights" in refused.stderr
