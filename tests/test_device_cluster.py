"""--plan auto on a GPU node without a cluster file: the device's name -> the planner's GPU
catalogue, its memory, the launcher's world (pure functions of the device properties)."""

from __future__ import annotations

import pytest

from meshtron.calibrate.device import catalogue_gpu, detected_cluster
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
