"""bench/gpu_check.py --dry-run: the GPU check kit's whole code path on CPU at toy size (the
real run needs one CUDA GPU; this keeps it from rotting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_writes_its_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["format"] == "meshtron-gpu-check/1"
    t = r["throughput"]
    assert t["tokens_per_step"] == r["global_batch"] * r["seq_len"]
    assert t["tokens_per_s"] > 0 and 0 < t["mfu"] and t["predicted_step_time_s"] > 0
    # the planner's exact per-rank states are what the runtime holds
    m = r["memory"]
    for k in ("params", "grads", "optimizer"):
        assert m["measured_bytes"][k] == m["planned_bytes"][k] > 0, k
    assert m["measured_peak_allocated_bytes"] is None  # CPU: no allocator peak
    c = r["checkpoint"]
    assert c["bytes"] > 0 and c["sync_save_s"] > 0 and c["async_total_s"] >= c["async_blocking_s"]
    assert r["recorder"]["step_time_on_s"] > 0 and r["recorder"]["step_time_off_s"] > 0
    # fp8: the tiny model's 4 blocks x 7 Linears in emulated FP8 next to bf16, same batches
    f = r["fp8"]
    assert f["emulated"] is True and f["fp8_linears"] == 28
    assert f["bf16"]["step_time_s"] > 0 and f["fp8"]["step_time_s"] > 0
    assert 0 < f["loss_delta_max_abs"] < 0.05  # e4m3 rounding, two steps (test_fp8_numerics)
    # offload: FSDP2 CPU offload moves tensors, so the losses are the same; the planner's
    # device memory drops by the offloaded states and reappears as host memory
    o = r["offload"]
    assert o["loss_max_abs_diff"] <= 1e-6
    assert o["offloaded"]["predicted_allocated_bytes"] < o["device"]["predicted_allocated_bytes"]
    assert o["offloaded"]["predicted_host_bytes_per_node"] > 0
    assert o["device"]["predicted_host_bytes_per_node"] == 0
    assert r["compile"]["compile_time_s"] > 0 and r["compile"]["step_time_s"] > 0
