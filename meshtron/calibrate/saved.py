"""Whether a saved calibration applies to this node, and the words that say where a plan's
cluster figures come from. train/planning.py's `choose_cluster` decides, in this order:
`--cluster` as given; else this node's calibration (`meshtron calibrate` wrote it to
`runs/calibration/local-N.toml` for N ranks, with what it measured in the `.json` beside it)
when it was measured on the device this node has; else, on a GPU node, the catalogue's figures
for the detected GPU (meshtron/calibrate/device.py); else the nominal CPU figures.

Why the device check: a calibration file is a measurement of one kind of device. The run
folder moves between machines (a laptop's CPU calibration, an A100 node's file on an H200
node); planning an H200 with an A100's GEMM efficiency is worse than the catalogue. Files
written before calibrate recorded the device name (no `device_name`) apply when the device
kind (cuda / cpu) and the catalogue GPU agree.

Pure functions of the node's device (device.py's `NodeDevice`) and the files: the tests inject
a device; only device.py's `this_node` asks torch (`meshtron plan/cost/simulate` never do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.calibrate.device import NodeDevice, catalogue_gpu


@dataclass(frozen=True)
class Chosen:
    """The cluster to plan for and where its figures come from (said on the plan line)."""

    cluster: Any
    """A planner ClusterSpec."""
    source: str
    """Where its figures come from, e.g. "calibrated on NVIDIA H200: ... (runs/...)"."""


def device_name(device) -> str:
    """What a calibration records as its device (a torch.device in, a name out)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).name
    return device.type


def _norm(name: str) -> str:
    return " ".join(name.lower().split())


def measured_on(path: Path) -> dict[str, Any] | None:
    """What the calibration beside the cluster file `path` recorded (its `.json`), or None."""
    try:
        return json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None


def applies(record: dict[str, Any] | None, node: NodeDevice) -> bool:
    """The calibration `record` was measured on the kind of device `node` has. A cluster file
    without a record (written by hand into the default path) is the user's: it applies."""
    if record is None:
        return True
    if record.get("device") not in (None, node.kind):
        return False
    if record.get("device_name"):
        return _norm(record["device_name"]) == _norm(node.name)
    if node.kind != "cuda":
        return True
    return record.get("gpu") == catalogue_gpu(node.name, node.memory_bytes or 0)


def describe(record: dict[str, Any] | None) -> str:
    """'calibrated on NVIDIA H200: matmul 654 TFLOP/s, memory 4134 GB/s'."""
    if record is None:
        return "a cluster file without a calibration record"
    rates = (f"matmul {record['matmul_tflops']:.4g} TFLOP/s, memory "
             f"{record['memory_gb_per_s']:.4g} GB/s" if "matmul_tflops" in record else "")
    name = record.get("device_name") or record.get("gpu") or record.get("device", "?")
    return f"calibrated on {name}" + (f": {rates}" if rates else "")
