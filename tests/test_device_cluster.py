"""--plan auto on a GPU node without a cluster file: the device's name -> the planner's GPU
catalogue, its memory, the launcher's world (pure functions of the device properties)."""

from __future__ import annotations

import pytest

from meshtron.calibrate.device import catalogue_gpu, detected_cluster, no_gpu_here
from meshtron.errors import UserError

GIB = 2**30


@pytest.mark.parametrize("name, mem_gib, want", [
    ("NVIDIA H100 80GB HBM3", 79.6, "H100-SXM5-80GB"),
    ("NVIDIA H200", 139.8, "H200-SXM-141GB"),
    ("NVIDIA GH200 480GB", 94.5, "H200-SXM-141GB"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-SXM4-80GB"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-SXM4-40GB"),
    ("NVIDIA A100 80GB PCIe", 79.2, "A100-SXM4-80GB"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-SXM2-32GB"),
    ("NVIDIA B200", 178.0, "B200"),
    ("NVIDIA H100 PCIe", 79.6, None),   # lower peak than the catalogue's SXM part
    ("NVIDIA H100 NVL", 93.6, None),
    ("NVIDIA GeForce RTX 4090", 23.6, None),
])
def test_device_name_to_catalogue(name, mem_gib, want):
    assert catalogue_gpu(name, int(mem_gib * GIB)) == want


def test_no_gpu_here_reads_the_visible_devices_then_the_driver_files(tmp_path):
    """What the launcher asks before it would import torch (real files, an injected env)."""
    driver = tmp_path / "nvidiactl"
    present, absent = (str(driver),), (str(tmp_path / "kfd"),)
    driver.write_text("")
    assert no_gpu_here({}, absent)  # no driver: no GPU, whatever the environment says
    assert no_gpu_here({"CUDA_VISIBLE_DEVICES": "0"}, absent)
    assert not no_gpu_here({}, present)  # a driver: torch decides (it may still find none)
    assert not no_gpu_here({"CUDA_VISIBLE_DEVICES": "0,1"}, (*absent, *present))
    for hidden in ("", " ", "-1"):  # CUDA's "no device visible"
        assert no_gpu_here({"CUDA_VISIBLE_DEVICES": hidden}, present)


def test_cluster_from_fake_device_properties():
    from meshtron.planner.cluster import GPU_CATALOGUE

    c = detected_cluster("NVIDIA H200", int(139.8 * GIB), world_size=16, gpus_per_node=8)
    g = GPU_CATALOGUE["H200-SXM-141GB"]
    assert (c.gpu, c.nodes, c.gpus_per_node, c.num_gpus) == (g.name, 2, 8, 16)
    assert c.memory_gib == pytest.approx(139.8)  # the device's, not the catalogue's 141
    assert c.peak_tflops == g.peak_tflops and c.intra_node_gb_per_s == g.nvlink_gb_per_s
    one = detected_cluster("NVIDIA H100 80GB HBM3", 80 * GIB, world_size=1, gpus_per_node=8)
    assert (one.nodes, one.gpus_per_node, one.peak_tflops) == (1, 1, 989.0)
    with pytest.raises(UserError, match=r"GPU 'NVIDIA H100 PCIe' is not in the catalogue.*"
                                        r"--cluster"):
        detected_cluster("NVIDIA H100 PCIe", 80 * GIB, 8, 8)


def test_plan_auto_fits_a_real_model_on_the_detected_gpu():
    """What `--plan auto` now plans for on an 8-GPU H100 node: llama3-8b fits (it did not on
    the nominal CPU figures, 4 GiB per rank)."""
    from meshtron.model import preset
    from meshtron.planner.search import search_plans

    c = detected_cluster("NVIDIA H100 80GB HBM3", int(79.6 * GIB), 8, 8)
    best = search_plans(preset("llama3-8b"), c, 64, 4096, {"dtype": "bf16"}, top_k=1,
                        explain=False).best
    assert best is not None and best.memory.total <= c.memory_gib


# ---- which cluster --plan auto plans for: a calibration of this device, else the catalogue ----
def _calibration(folder, device_name, device="cuda", gpu="H200-SXM-141GB", matmul=654.0):
    """What `meshtron calibrate` leaves: the cluster TOML and the record beside it."""
    import json

    import tomli_w

    from meshtron.calibrate.measure import Calibration, Level

    cal = Calibration(world_size=1, device=device, backend="none", dtype="bfloat16",
                      matmul_tflops=matmul, memory_gb_per_s=4134.0, memory_gib=140.4,
                      gpu=gpu, device_name=device_name,
                      intra=Level(group_size=1, latency_us=1.0, bandwidth_gb_per_s=4134.0))
    path = folder / "local-1.toml"
    path.write_text(tomli_w.dumps(cal.cluster_dict(name="local-1")))
    record = {k: v for k, v in vars(cal).items() if k not in ("intra", "inter")}
    path.with_suffix(".json").write_text(json.dumps(record))
    return path


def _node(name="NVIDIA H200", mem_gib=140.4, kind="cuda"):
    from meshtron.calibrate.device import NodeDevice

    return NodeDevice(kind, name, int(mem_gib * GIB), 1)


def test_plan_auto_uses_the_calibration_of_this_gpu_and_says_so(tmp_path):
    """The H200's measured 654 TFLOP/s (66% of its 989 peak) is what --plan auto predicts
    with, not the catalogue's ceiling: a slower predicted step, and the source says where."""
    from meshtron.model import preset
    from meshtron.planner.search import search_plans
    from meshtron.train.planning import choose_cluster

    path = _calibration(tmp_path, "NVIDIA H200")
    got = choose_cluster(1, None, _node(), path)
    assert got.cluster.name == "local-1" and got.cluster.matmul_efficiency == pytest.approx(
        654 / 989, abs=1e-4)
    assert got.source.startswith("calibrated on NVIDIA H200: matmul 654 TFLOP/s, memory "
                                 "4134 GB/s") and str(path) in got.source
    catalogue = choose_cluster(1, None, _node(), tmp_path / "absent.toml")
    assert catalogue.cluster.name.startswith("detected-H200")
    assert catalogue.source.startswith("catalogue figures for the detected NVIDIA H200")

    def step(cluster):
        return search_plans(preset("llama3-8b"), cluster, 8, 4096, {"dtype": "bf16"},
                            top_k=1, explain=False).best.step_time_s

    assert step(got.cluster) > step(catalogue.cluster)


def test_a_calibration_of_another_device_is_not_used_and_the_plan_says_why(tmp_path):
    from meshtron.train.planning import choose_cluster

    path = _calibration(tmp_path, "NVIDIA A100-SXM4-80GB", gpu="A100-SXM4-80GB", matmul=250.0)
    got = choose_cluster(1, None, _node(), path)
    assert got.cluster.name.startswith("detected-H200")
    assert f"{path} is calibrated on NVIDIA A100-SXM4-80GB" in got.source
    assert got.source.endswith("not this node's NVIDIA H200: not used")
    # a GPU's calibration on a CPU machine (a run folder copied off the node): nominal figures
    cpu = choose_cluster(1, None, _node("cpu", 0, "cpu"), path)
    assert cpu.cluster.name == "nominal-cpu:1" and "not used" in cpu.source
    # --cluster wins over everything
    given = choose_cluster(1, "dgx-h100:1", _node(), path)
    assert given.source == "--cluster dgx-h100:1" and given.cluster.gpu == "H100-SXM5-80GB"


def test_calibrations_without_a_device_name_match_by_kind_and_catalogue_gpu(tmp_path):
    """Files written before calibrate recorded the device's name: the kind and the catalogue
    GPU decide; a hand-written cluster file in the default path (no record) is the user's."""
    from meshtron.calibrate.saved import applies

    old = {"device": "cuda", "gpu": "H200-SXM-141GB"}
    assert applies(old, _node()) and applies(old, _node("NVIDIA GH200 480GB", 94.5))
    assert not applies(old, _node("NVIDIA H100 80GB HBM3", 79.6))
    assert not applies({"device": "cpu"}, _node())
    assert applies({"device": "cpu", "device_name": "cpu"}, _node("cpu", 0, "cpu"))
    assert applies(None, _node())
    assert applies({"device": "cuda", "device_name": "nvidia  h200"}, _node())


def test_calibrate_records_the_device_it_measured(tmp_path):
    """`meshtron calibrate` (one rank, real measurements) writes the device's name into its
    record, so --plan auto on this machine then plans with it (the CPU here; the GPU kit runs
    this test on a GPU node too). The command's argv through `meshtron.cli.main` in this
    process (testkit/cli_inproc.py; suite time: a child's torch import); `--nproc 2` runs as
    the command in tests/test_train_launch.py."""
    import json

    from meshtron.calibrate.device import this_node
    from meshtron.train.planning import choose_cluster
    from testkit.cli_inproc import meshtron_main

    out = tmp_path / "local-1.toml"
    code, _, stderr = meshtron_main("calibrate", "--out", str(out))
    assert code == 0, stderr[-2000:]
    record = json.loads(out.with_suffix(".json").read_text())
    node = this_node()
    assert record["device_name"] == node.name and record["device"] == node.kind
    got = choose_cluster(1, None, node, out)
    assert got.source.startswith(f"calibrated on {node.name}: matmul ")
    assert got.cluster.name == "local-1"
    # every figure's spread over its repeats is in the file; a wide one is said, once
    spread = dict(got.cluster.measurement_spread)
    gemms = [f"gemm {g.m}x{g.n}x{g.k}" for g in got.cluster.gemm_efficiency]
    assert set(spread) == {"matmul", "memory", "rms_norm", "silu_mul", "softmax", "eager_op",
                           *gemms} and all(v >= 0 for v in spread.values())
    noisy = [k for k, v in spread.items() if v > 0.25]
    assert stderr.count("warning: noisy calibration") == (1 if noisy else 0)
    assert not noisy or max(noisy, key=spread.get) in stderr  # the widest is named
    assert (got.cluster.noise_note() is not None) == bool(noisy)


class _Props:
    """`torch.cuda`'s device query as a GPU node answers it (injected: the CUDA branch of what
    `meshtron calibrate` records runs on this CPU machine)."""

    def __init__(self, name: str, total_memory: int):
        self.name, self.total_memory = name, total_memory

    def get_device_properties(self, device):
        return self


def test_calibrate_cuda_branch_records_what_plan_auto_matches():
    """On a CUDA device `meshtron calibrate` measures in bf16 and records the device's own
    memory, catalogue entry and name; that record is then the one `--plan auto` takes for the
    same GPU (saved.applies) and not for another one or the CPU."""
    import torch

    from meshtron.calibrate.measure import device_figures
    from meshtron.calibrate.saved import applies

    h200 = device_figures(torch.device("cuda", 0), 8, _Props("NVIDIA H200", int(139.8 * GIB)))
    assert h200 == {"dtype": torch.bfloat16, "memory_gib": pytest.approx(139.8),
                    "gpu": "H200-SXM-141GB", "device_name": "NVIDIA H200"}
    record = {"device": "cuda", **{k: v for k, v in h200.items() if k != "dtype"}}
    assert applies(record, _node("NVIDIA H200", 139.8))
    assert not applies(record, _node("NVIDIA H100 80GB HBM3", 79.6))
    assert not applies(record, _node("cpu", 0, "cpu"))
    pcie = device_figures(torch.device("cuda", 1), 8, _Props("NVIDIA H100 PCIe", 80 * GIB))
    assert pcie["gpu"] is None and pcie["device_name"] == "NVIDIA H100 PCIe"
    cpu = device_figures(torch.device("cpu"), 2)
    assert (cpu["dtype"], cpu["gpu"], cpu["device_name"]) == (torch.float32, None, "cpu")
    assert cpu["memory_gib"] > 0
