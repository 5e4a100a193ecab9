"""tests/conftest.py: a test sees neither the checkout's `runs/` nor the caller's environment."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, outside_env


def test_each_test_starts_in_an_empty_folder_outside_the_checkout():
    here = Path.cwd().resolve()
    assert ROOT not in here.parents and here != ROOT
    assert list(here.iterdir()) == []


def test_no_outside_switch_reaches_a_test_or_its_subprocesses():
    assert outside_env(os.environ) == [] and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    probe = "import os, testkit; print(os.getcwd()); print(sorted(os.environ))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert out[0] == os.getcwd()  # testkit imported from outside the checkout (PYTHONPATH)
    assert outside_env(ast.literal_eval(out[1])) == []


def test_outside_env_names_what_steers_meshtron_and_torch():
    given = {"MESHTRON_SNAPSHOT_DIR": "/x", "RANK": "3", "LOCAL_WORLD_SIZE": "2",
             "TORCHELASTIC_RUN_ID": "r", "TORCH_LOGS": "+dynamo", "OMP_NUM_THREADS": "4",
             "MESHTRON_TEST_FRESH_RANKS": "1", "TORCHINDUCTOR_CACHE_DIR": "/c", "HOME": "/h"}
    assert outside_env(given) == ["LOCAL_WORLD_SIZE", "MESHTRON_SNAPSHOT_DIR", "OMP_NUM_THREADS",
                                  "RANK", "TORCHELASTIC_RUN_ID", "TORCH_LOGS"]


def test_a_calibration_in_the_tests_folder_is_read_and_none_is_found_in_a_fresh_one():
    """The train path reads `runs/calibration/local-N.toml` relative to the current folder
    (meshtron/train/planning.py `cluster_choice`): a test's own folder has none, and one written
    there is what the plan uses."""
    from meshtron.calibrate.device import NodeDevice
    from meshtron.calibrate.cli import default_cluster_path
    from meshtron.train.planning import choose_cluster

    here = Path.cwd().resolve()
    assert here != ROOT and ROOT not in here.parents  # never writes into the checkout
    cpu = NodeDevice("cpu", "cpu")
    assert choose_cluster(2, None, cpu, default_cluster_path(2)).source.startswith(
        "nominal CPU figures")
    path = default_cluster_path(2)
    path.parent.mkdir(parents=True)
    path.write_text(CLUSTER)
    chosen = choose_cluster(2, None, cpu, path)
    assert chosen.source.endswith(f"({path})") and chosen.cluster.memory_gib == 3.0


CLUSTER = """name = "local-2"
peak_tflops = 0.05
matmul_efficiency = 1.0
memory_gib = 3.0
hbm_gb_per_s = 12.0
gpus_per_node = 2
nodes = 1
intra_node_gb_per_s = 1.0
inter_node_gb_per_s = 1.0
intra_node_latency_us = 600.0
inter_node_latency_us = 600.0
"""
