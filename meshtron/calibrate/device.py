"""The cluster of a GPU node that has no calibration file: the device's name looked up in the
planner's GPU catalogue (meshtron/planner/cluster.py), its memory as the device reports it, and
the world as the launcher gives it. `meshtron calibrate` refines this with measurements; the
nominal CPU figures are never used for a GPU.

The name -> catalogue mapping and the cluster are pure functions of the device properties
(tested on the names drivers report); only `this_node` (and `device_cluster` through it) asks
torch. calibrate/saved.py decides whether a calibration file applies to this node's device.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.errors import UserError


@dataclass(frozen=True)
class NodeDevice:
    """The device the ranks of this node train on."""

    kind: str
    """"cuda" or "cpu"."""
    name: str
    """As the driver reports it ("NVIDIA H200"); "cpu" on a CPU node."""
    memory_bytes: int | None = None
    """Device memory (CUDA), for the catalogue lookup."""
    local_ranks: int | None = None
    """Ranks per node the launcher gives (LOCAL_WORLD_SIZE), None: unknown."""


# Substrings of `torch.cuda.get_device_properties(i).name` (lower case) -> catalogue entry,
# first match wins. Names as the drivers report them: "NVIDIA H100 80GB HBM3" (SXM),
# "NVIDIA H200", "NVIDIA GH200 480GB" (the H100/H200 die), "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100 80GB PCIe", "Tesla V100-SXM2-32GB", "NVIDIA B200". Parts with a lower peak than
# their SXM sibling (H100 PCIe: 756 TFLOP/s, H100 NVL: 835) are not mapped: a plan for the
# wrong peak is worse than asking for a cluster file.
_NOT_CATALOGUED = ("h100 pcie", "h100 nvl", "h800", "a800")
_BY_NAME = (("gh200", "H200-SXM-141GB"), ("h200", "H200-SXM-141GB"),
            ("h100", "H100-SXM5-80GB"), ("b200", "B200"), ("v100", "V100-SXM2-32GB"))


def catalogue_gpu(device_name: str, total_memory_bytes: int) -> str | None:
    """The catalogue name for a CUDA device, or None when the catalogue has no such part.
    A100s are told apart by memory (40 vs 80 GB; the peak is the same for SXM and PCIe)."""
    name = " ".join(device_name.lower().split())
    if any(part in name for part in _NOT_CATALOGUED):
        return None
    if "a100" in name:
        return "A100-SXM4-80GB" if total_memory_bytes > 60 * 2**30 else "A100-SXM4-40GB"
    for key, gpu in _BY_NAME:
        if key in name:
            return gpu
    return None


def detected_cluster(device_name: str, total_memory_bytes: int, world_size: int,
                     gpus_per_node: int):
    """The ClusterSpec to plan for: the catalogue's figures for the device (peak, HBM,
    NVLink and NIC bandwidth of the vendor's reference node), the device's own memory, and
    `world_size` ranks in nodes of `gpus_per_node`. Unknown devices: UserError asking for a
    cluster file or a calibration."""
    from meshtron.planner.cluster import GPU_CATALOGUE, cluster_from_dict

    gpu = catalogue_gpu(device_name, total_memory_bytes)
    if gpu is None:
        raise UserError(f"cluster: GPU {device_name!r} is not in the catalogue "
                         f"({', '.join(GPU_CATALOGUE)}); pass --cluster FILE.toml or run "
                         "`meshtron calibrate` first")
    per_node = max(1, min(gpus_per_node, world_size))
    if world_size % per_node:
        per_node = world_size  # an uneven world: plan it as one node
    g = GPU_CATALOGUE[gpu]
    nodes = world_size // per_node
    return cluster_from_dict({
        "gpu": gpu, "memory_gib": total_memory_bytes / 2**30, "gpus_per_node": per_node,
        "nodes": nodes, "intra_node_gb_per_s": g.nvlink_gb_per_s,
        "inter_node_gb_per_s": g.inter_node_gb_per_s}, name=f"detected-{gpu}:{nodes}x{per_node}")


def device_cluster(world_size: int):
    """`detected_cluster` for this node's first visible GPU, nodes of LOCAL_WORLD_SIZE ranks
    (the launcher's), or None without CUDA."""
    node = this_node()
    if node.kind != "cuda":
        return None
    return detected_cluster(node.name, node.memory_bytes or 0, world_size,
                            node.local_ranks or world_size)


GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")
"""What a GPU kernel driver puts on a node: /proc/driver/nvidia and /dev/nvidiactl are the
NVIDIA driver's, /dev/kfd ROCm's; the container toolkits mount them into a GPU container."""


def no_gpu_here(environ=None, driver_paths: tuple[str, ...] = GPU_DRIVER_PATHS) -> bool:
    """No process started from here can use a GPU, known without importing torch (the launcher
    of a CPU run then starts its ranks without the 1-2 s of torch's import): CUDA_VISIBLE_DEVICES
    set empty or to -1 hides every device (CUDA's documented behaviour; torch then reports none),
    or none of `driver_paths` exists (no GPU kernel driver). False means "ask torch", not "there
    is a GPU". `environ`: os.environ when None."""
    import os

    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    return not any(os.path.exists(p) for p in driver_paths)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where `no_gpu_here` says no GPU."""
    if no_gpu_here():
        return False
    import torch

    return torch.cuda.is_available()


def default_dtype(cuda: bool | None = None) -> str:
    """The run's precision when none is given: bf16 mixed precision on CUDA (what the hardware
    is for; the planner plans bf16 by default), fp32 on CPU (bf16 matmuls are emulated and
    slower there)."""
    if cuda is None:
        cuda = cuda_available()
    return "bf16" if cuda else "fp32"


def this_node() -> NodeDevice:
    """This node's first visible GPU, or the CPU (imports torch unless `no_gpu_here`)."""
    import os

    if not cuda_available():
        return NodeDevice("cpu", "cpu")
    import torch

    if not torch.cuda.is_available():
        return NodeDevice("cpu", "cpu")
    props = torch.cuda.get_device_properties(0)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return NodeDevice("cuda", props.name, props.total_memory,
                      int(local) if local else torch.cuda.device_count())
