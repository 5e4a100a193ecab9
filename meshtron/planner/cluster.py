"""GPU catalogue and ClusterSpec: what the planner knows about the machines.

A cluster is `nodes` x `gpus_per_node` identical GPUs. Inside a node the GPUs talk over NVLink /
NVSwitch (`intra_node_gb_per_s`), between nodes over InfiniBand / RoCE / Ethernet
(`inter_node_gb_per_s`). Both bandwidths are GB/s (1e9 bytes/s) per GPU per direction, the unit
ring-collective formulas need.

Sources of the catalogue (copied into the package so that `meshtron plan` needs nothing at run time):
peak dense bf16 tensor throughput, memory and HBM bandwidth from the vendors' datasheets (as listed in
`../shared/calibration/hardware.csv`); NVLink per direction = half the datasheet's bidirectional figure.
`matmul_ceiling` is the fraction of peak that a large, well-shaped bf16 GEMM sustains during
training: the "maximum achievable matmul FLOPS" of short public benchmarks (e.g. S. Bekman's
ml-engineering MAMF tables: about 86% on A100 SXM, about 80% on H100 SXM) times ~0.93 for the
clock a GPU holds under hours of dense tensor-core load at its power limit (NVIDIA quotes A100's
HPL Rpeak at 1305 MHz against a 1410 MHz boost clock). V100 and B200 values are our estimates.

Cluster TOML (`--cluster my.toml`)::

    gpu = "H100-SXM5-80GB"          # a catalogue name, or give peak_tflops and memory_gib instead
    # peak_tflops = 0.05            # dense 16-bit peak per device, TFLOP/s
    # memory_gib = 24               # device memory, GiB
    # hbm_gb_per_s = 20             # device memory bandwidth, GB/s (default: peak_tflops*1e12/150)
    # matmul_efficiency = 0.6       # measured fraction of peak of a large matmul (overrides ceiling)
    gpus_per_node = 8
    nodes = 16
    intra_node_gb_per_s = 450       # per GPU per direction
    inter_node_gb_per_s = 50        # per GPU per direction
    intra_node_latency_us = 3       # optional, per ring step
    inter_node_latency_us = 8       # optional, per ring step
    # collective_base_latency_us = 8.4  # optional, fixed latency per collective call
    # bandwidth_efficiency = 1.0    # optional: fraction of the stated bandwidths collectives reach
    price_per_gpu_hour = 2.5        # optional, currency units, for the cost column
    # host_link_gb_per_s = 450      # optional: host <-> GPU per direction (GH200 NVLink-C2C)
    # host_memory_gib = 3576        # optional: host memory per node (8 GH200: 8 x 447 GiB)
    # sustained_clock_mhz = 1620    # optional: SM clock under load (power cap, locked clock)
    # cpu = true                  # optional: the devices are CPU cores (no host offload)
    # measured by `meshtron calibrate` (optional):
    # elementwise_gb_per_s = 2400   # achieved bandwidth of eager element-wise ops, GB/s
    # eager_kernel_overhead_us = 6  # one tiny eager op (dispatch + launch), microseconds
    # gemm_efficiency = [{m = 8192, n = 12288, k = 4096, efficiency = 0.72}, ...]
    # measurement_spread = {matmul = 0.04, rms_norm = 1.3}  # repeats' IQR / median per figure
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.errors import UserError


@dataclass(frozen=True)
class GPUType:
    """One entry of the GPU catalogue."""

    name: str
    """Catalogue name, e.g. 'H100-SXM5-80GB'."""
    peak_tflops: float
    """Peak dense bf16/fp16 tensor-core throughput, TFLOP/s (datasheet, no sparsity)."""
    memory_gib: float
    """Device memory, GiB."""
    hbm_gb_per_s: float
    """Device memory bandwidth, GB/s (datasheet)."""
    nvlink_gb_per_s: float
    """NVLink bandwidth per GPU per direction, GB/s (half the datasheet's bidirectional figure)."""
    inter_node_gb_per_s: float
    """Typical network bandwidth per GPU per direction in the vendor's reference node, GB/s."""
    matmul_ceiling: float
    """Fraction of peak a large, well-shaped bf16 GEMM reaches (maximum achievable matmul FLOPS)."""
    tf32_tflops: float | None = None
    """Dense fp32 matmul peak, TFLOP/s: TF32 tensor cores where the GPU has them (A100 and
    later; PyTorch uses them for fp32 matmuls with torch.backends.cuda.matmul.allow_tf32, which
    meshtron's runtime sets on CUDA), CUDA-core FP32 on V100. None: same as peak_tflops."""
    fp8_tflops: float | None = None
    """Dense FP8 tensor-core peak, TFLOP/s (Hopper and later); None: the GPU has no FP8."""
    boost_clock_mhz: float | None = None
    """Maximum boost SM clock the datasheet peaks are quoted at, MHz (None: unknown)."""
    sms: int | None = None
    """Streaming multiprocessors (whitepapers: V100 80, A100 108, H100/H200 SXM 132, B200
    148): a communication kernel that takes SMs beside a GEMM slows it by sms / (sms - taken)
    (overlap.py `sm_margin`). None: unknown."""


# name, peak TFLOP/s, GiB, HBM GB/s, NVLink GB/s per direction, NIC GB/s per GPU, matmul ceiling
GPU_CATALOGUE: dict[str, GPUType] = {g.name: g for g in [
    # fp32 / FP8 dense peaks from the same datasheets (V100: 15.7 FP32; A100: 156 TF32;
    # H100/H200 SXM: 494.7 TF32, 1,979 FP8; B200: 1,100 TF32, 4,500 FP8 dense)
    # boost clocks: V100 SXM2 1530, A100 SXM 1410, H100/H200 SXM 1980 MHz (datasheets /
    # whitepapers: the clocks their peak TFLOP/s are computed at)
    GPUType("V100-SXM2-32GB", 125.0, 32.0, 900.0, 150.0, 12.5, 0.75, 15.7,  # ceiling: estimate
            boost_clock_mhz=1530.0, sms=80),
    GPUType("A100-SXM4-40GB", 312.0, 40.0, 1555.0, 300.0, 25.0, 0.80, 156.0,  # 0.86 x 0.93
            boost_clock_mhz=1410.0, sms=108),
    GPUType("A100-SXM4-80GB", 312.0, 80.0, 2039.0, 300.0, 25.0, 0.80, 156.0,  # 0.86 x 0.93
            boost_clock_mhz=1410.0, sms=108),
    GPUType("H100-SXM5-80GB", 989.0, 80.0, 3350.0, 450.0, 50.0, 0.75, 494.7, 1979.0, 1980.0,
            sms=132),
    GPUType("H200-SXM-141GB", 989.0, 141.0, 4800.0, 450.0, 50.0, 0.75, 494.7, 1979.0, 1980.0,
            sms=132),
    GPUType("B200", 2250.0, 180.0, 7700.0, 900.0, 50.0, 0.70, 1100.0, 4500.0,  # ceiling: est.
            sms=148),
]}
"""H100 ceiling: 0.80 MAMF x 0.93; H200: the same die as H100."""
CLOCK_UNDER_LOAD = 0.93
"""The share of the boost clock a GPU holds under hours of dense tensor-core load at its
datasheet power limit, folded into every `matmul_ceiling` (module docstring); a cluster's
`sustained_clock_mhz` replaces it by the clock it states."""


# Short aliases accepted on the command line and in TOML files.
GPU_ALIASES = {"V100": "V100-SXM2-32GB", "A100": "A100-SXM4-80GB", "A100-40GB": "A100-SXM4-40GB",
               "A100-80GB": "A100-SXM4-80GB", "H100": "H100-SXM5-80GB", "H200": "H200-SXM-141GB"}

# Cluster presets: `dgx-a100:N` etc. -> (GPU, latency intra us, latency inter us)
CLUSTER_PRESETS = {
    "dgx-a100": "A100-SXM4-80GB",
    "dgx-h100": "H100-SXM5-80GB",
    "dgx-h200": "H200-SXM-141GB",
}

# Default per-step latencies (alpha of the alpha-beta model): NCCL's own figures for a ring step
# with the Simple protocol (NVIDIA/nccl src/graph/tuning.cc, hwLat table): 3.4 us over NVLink
# (unchanged from v2.8 to master) and 14.0 us over the network, the value of every NCCL since
# v2.18.1 (2023: PyTorch 2.1 onwards, through master's ncclTunerConstantsDefaults; v2.7-2.11
# and v2.14-2.17 had 9.6, v2.12-2.13 28). A cluster file that ran an older NCCL states its
# own (2021's Selene runs: bench/published/rows_megatron.py `selene_2021`).
DEFAULT_INTRA_LATENCY_US = 3.4
DEFAULT_INTER_LATENCY_US = 14.0
# Device memory bandwidth assumed when only peak_tflops is given: ~150 FLOP per byte is the
# balance point of A100-class GPUs (312 TFLOP/s / 2.0 TB/s).
DEFAULT_FLOP_PER_BYTE = 150.0


# Host link per GPU per direction, GB/s (host offload). PCIe Gen5 x16: 32 GT/s x 16 lanes x
# 128/130 / 8 = 63 GB/s (PCI-SIG PCIe 5.0 base specification), the H100/H200 SXM datasheets'
# "PCIe Gen5: 128 GB/s" (both directions); A100 SXM: PCIe Gen4, 64 GB/s both directions
# (datasheet); V100 SXM2: PCIe Gen3, 32 GB/s (datasheet); HGX B200: PCIe Gen5. A GH200's
# NVLink-C2C is 900 GB/s both directions (NVIDIA GH200 Grace Hopper Superchip datasheet):
# give host_link_gb_per_s = 450 in its cluster file.
HOST_LINK_GB_PER_S = {"V100-SXM2-32GB": 16.0, "A100-SXM4-40GB": 32.0, "A100-SXM4-80GB": 32.0,
                      "H100-SXM5-80GB": 63.0, "H200-SXM-141GB": 63.0, "B200": 63.0}
DEFAULT_HOST_LINK_GB_PER_S = 32.0
"""A GPU outside the table: PCIe Gen4 x16."""
GH200_C2C_GB_PER_S = 450.0
"""NVLink-C2C per direction of a GH200 (datasheet: 900 GB/s total)."""
# Host (CPU) memory per node, GiB, of each GPU's reference node (what host offload may fill):
# DGX-1 with V100: 512 GB (DGX-1 datasheet); DGX A100 320GB: 1 TB, DGX A100 640GB: 2 TB (DGX
# A100 datasheet, "System Memory 1TB / 2TB"); DGX H100 and DGX H200: 2 TB (datasheets); DGX
# B200: 2 TB, configurable to 4 TB (datasheet). The DIMMs are binary sizes, so "2 TB" is 2 TiB.
HOST_MEMORY_GIB_PER_NODE = {"V100-SXM2-32GB": 512.0, "A100-SXM4-40GB": 1024.0,
                            "A100-SXM4-80GB": 2048.0, "H100-SXM5-80GB": 2048.0,
                            "H200-SXM-141GB": 2048.0, "B200": 2048.0}
GH200_HOST_MEMORY_GIB = 480e9 / 2**30
"""LPDDR5X of one GH200 superchip: up to 480 GB (NVIDIA GH200 Grace Hopper Superchip
datasheet) = 447 GiB; a GH200 node's host_memory_gib is this times its superchips."""
HOST_USABLE_FRACTION = 0.9
"""Share of a node's host memory offload may pin: the kernel, the CUDA driver, data loader
workers and the page cache keep the rest, and pinned pages cannot be swapped out."""
HOST_MEMORY_GB_PER_S = 77.0
"""Host memory bandwidth per GPU: a DGX H100 node's two Xeon 8480C sockets with 8 channels of
DDR5-4800 each (2 x 8 x 38.4 = 614 GB/s theoretical) shared by 8 GPUs."""


def gpu_type(name: str, field: str = "gpu") -> GPUType:
    """Look a GPU up by catalogue name or alias; unknown names are an error, never a fallback."""
    key = GPU_ALIASES.get(name, name)
    if key in GPU_CATALOGUE:
        return GPU_CATALOGUE[key]
    lowered = {k.lower(): v for k, v in GPU_CATALOGUE.items()}
    if key.lower() in lowered:
        return lowered[key.lower()]
    raise UserError(f"{field}={name!r}: unknown GPU; known: {', '.join(GPU_CATALOGUE)} "
                     "(or give peak_tflops and memory_gib instead of gpu)")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: `nodes` nodes of `gpus_per_node` GPUs."""

    name: str
    """Preset or file name, for display."""
    peak_tflops: float
    """Peak dense 16-bit throughput of one device, TFLOP/s."""
    memory_gib: float
    """Memory of one device, GiB."""
    gpus_per_node: int
    """Devices per node (tensor parallelism stays inside a node)."""
    nodes: int
    """Number of nodes."""
    intra_node_gb_per_s: float
    """Bandwidth between devices of one node, GB/s per device per direction (NVLink/NVSwitch)."""
    inter_node_gb_per_s: float
    """Bandwidth between nodes, GB/s per device per direction (IB/RoCE/Ethernet)."""
    intra_node_latency_us: float = DEFAULT_INTRA_LATENCY_US
    """Latency of one step of an intra-node collective, microseconds."""
    inter_node_latency_us: float = DEFAULT_INTER_LATENCY_US
    """Latency of one step of an inter-node collective, microseconds."""
    gpu: str | None = None
    """Catalogue name of the device, or None for a device described by numbers only."""
    hbm_gb_per_s: float | None = None
    """Device memory bandwidth, GB/s; None: peak_tflops*1e12/150 bytes/s."""
    matmul_efficiency: float | None = None
    """Measured sustained fraction of peak of a large matmul; overrides the catalogue's ceiling."""
    bandwidth_efficiency: float | None = None
    """Fraction of the stated bandwidths that collectives reach; None: 0.8 NVLink, 0.9 network."""
    price_per_gpu_hour: float | None = None
    """Optional price of one device-hour, for the cost column."""
    gemm_efficiency: tuple[GemmPoint, ...] | None = None
    """Measured fraction of peak_tflops reached by GEMM shapes (m x k times k x n), e.g. a
    transformer layer's; `meshtron calibrate` writes it. None: the roofline model's figure."""
    elementwise_gb_per_s: float | None = None
    """Achieved memory bandwidth of eager element-wise ops (RMSNorm, silu(a)*b, softmax), GB/s:
    what memory-bound non-matmul work reaches, below the copy bandwidth `hbm_gb_per_s`."""
    eager_kernel_overhead_us: float | None = None
    """Time of one tiny eager op issued back to back (Python dispatch + kernel launch), us:
    the floor under every small kernel of an eager (uncompiled) step."""
    collective_base_latency_us: float | None = None
    """Fixed latency of one collective call on top of its per-step latencies, us (NCCL's
    baseLat); `meshtron calibrate` fits it. None: NCCL's 8.4 us (comm.BASE_LATENCY_S)."""
    host_link_gb_per_s: float | None = None
    """Host <-> device bandwidth per GPU per direction, GB/s, for host offload: PCIe or
    NVLink-C2C (GH200: 450). None: the GPU's catalogue default (HOST_LINK_GB_PER_S), else
    PCIe Gen4 x16."""
    host_memory_gb_per_s: float | None = None
    """Host memory bandwidth one GPU's share of its node reaches, GB/s (the offloaded optimizer
    step is bound by it). None: HOST_MEMORY_GB_PER_S."""
    sustained_clock_mhz: float | None = None
    """SM clock the GPUs hold under training load, MHz: a power cap (torchtitan's 500 W H100s,
    Llama 3's clusters) or a locked clock. Large GEMMs scale with it: the matmul ceiling becomes
    the catalogue's short-benchmark MAMF x clock / boost clock instead of x CLOCK_UNDER_LOAD
    (needs a catalogue `gpu` with a boost clock; `matmul_efficiency` overrides both)."""
    host_memory_gib: float | None = None
    """Host (CPU) memory of one node, GiB: what the states host offload moves off all the
    node's GPUs must fit in (HOST_USABLE_FRACTION of it). None: the GPU's reference node
    (HOST_MEMORY_GIB_PER_NODE, e.g. DGX H100 2048); a GPU outside the table: not checked.
    GH200: 447 per superchip (GH200_HOST_MEMORY_GIB)."""
    measurement_spread: tuple[tuple[str, float], ...] | None = None
    """How much `meshtron calibrate`'s repeats of each figure disagreed (interquartile range /
    median; the TOML gives a table, figure -> fraction): past NOISY_SPREAD, plan and train say
    the figures are noisy (`noise_note`). Never changes a prediction."""
    cpu: bool = False
    """The devices are the host's CPU cores (`nominal-cpu`, `meshtron calibrate` on a CPU, a
    file's `cpu = true`): a rank's memory IS the host's, `memory_gib` its share of the
    machine, so host offload moves nothing off it and the search never offers it (an
    explicit --offload still runs: the runtime's code path, tested on CPU)."""
    file: str | None = dataclasses.field(default=None, compare=False, repr=False)
    """The cluster TOML it was read from, absolute (None: a preset or built in code): what a
    run's plan.toml records, so that `cost`, `simulate` and `rehearse --plan RUN/plan.toml`
    read the same figures again (the file's stem, its `name`, resolves nowhere). Not one of
    its figures: left out of `to_dict` and of comparisons."""

    def __post_init__(self) -> None:
        for field in ("peak_tflops", "memory_gib", "intra_node_gb_per_s", "inter_node_gb_per_s"):
            _positive(f"cluster.{field}", getattr(self, field))
        for field in ("gpus_per_node", "nodes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"cluster.{field}={value!r}: must be a positive integer")
        for field in ("intra_node_latency_us", "inter_node_latency_us"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise UserError(f"cluster.{field}={value!r}: must be a number >= 0")
        if self.hbm_gb_per_s is not None:
            _positive("cluster.hbm_gb_per_s", self.hbm_gb_per_s)
        for field in ("matmul_efficiency", "bandwidth_efficiency"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise UserError(f"cluster.{field}={value!r}: must be a fraction in (0, 1]")
        if self.elementwise_gb_per_s is not None:
            _positive("cluster.elementwise_gb_per_s", self.elementwise_gb_per_s)
        for field in ("eager_kernel_overhead_us", "collective_base_latency_us"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float))
                                          and not isinstance(value, bool) and 0 <= value < 1e6):
                raise UserError(f"cluster.{field}={value!r}: must be a number of "
                                 "microseconds >= 0")
        for field in ("host_link_gb_per_s", "host_memory_gb_per_s", "host_memory_gib"):
            if getattr(self, field) is not None:
                _positive(f"cluster.{field}", getattr(self, field))
        if not isinstance(self.cpu, bool):
            raise UserError(f"cluster.cpu={self.cpu!r}: must be true or false")
        if self.sustained_clock_mhz is not None:
            _positive("cluster.sustained_clock_mhz", self.sustained_clock_mhz)
            boost = gpu_type(self.gpu).boost_clock_mhz if self.gpu is not None else None
            if boost is None:
                raise UserError(f"cluster.sustained_clock_mhz={self.sustained_clock_mhz!r}: "
                                "needs gpu = a catalogue GPU with a known boost clock (or give "
                                "matmul_efficiency instead)")
            if self.sustained_clock_mhz > boost:
                raise UserError(f"cluster.sustained_clock_mhz={self.sustained_clock_mhz!r}: "
                                f"above {self.gpu}'s boost clock {boost:g} MHz")
        if self.gemm_efficiency is not None:
            object.__setattr__(self, "gemm_efficiency", _gemm_points(self.gemm_efficiency))
        if self.measurement_spread is not None:
            object.__setattr__(self, "measurement_spread", _spreads(self.measurement_spread))
        if self.price_per_gpu_hour is not None and not (
                isinstance(self.price_per_gpu_hour, (int, float)) and self.price_per_gpu_hour >= 0):
            raise UserError(f"cluster.price_per_gpu_hour={self.price_per_gpu_hour!r}: "
                             "must be a number >= 0")

    # ---- derived figures used by the cost model ----------------------------------------------
    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device_word(self) -> str:
        """One rank's device as the planner's lines name it: 'CPU rank' on a CPU machine (a
        plan said "memory of the fullest GPU" about CPU ranks), else 'GPU'."""
        return "CPU rank" if self.cpu else "GPU"

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def hbm_bytes_per_s(self) -> float:
        if self.hbm_gb_per_s is not None:
            return self.hbm_gb_per_s * 1e9
        return self.peak_flops / DEFAULT_FLOP_PER_BYTE

    @property
    def matmul_ceiling(self) -> float:
        """Fraction of peak sustained by a large GEMM (measured, catalogue, or 0.75)."""
        if self.matmul_efficiency is not None:
            return float(self.matmul_efficiency)
        if self.gpu is not None:
            g = gpu_type(self.gpu)
            if self.sustained_clock_mhz is not None and g.boost_clock_mhz:
                return (g.matmul_ceiling / CLOCK_UNDER_LOAD
                        * self.sustained_clock_mhz / g.boost_clock_mhz)
            return g.matmul_ceiling
        return 0.75

    @property
    def host_link_bytes_per_s(self) -> float:
        """Host <-> device bytes/s per GPU per direction (theoretical: PCIe's 128b/130b
        coding is in the figure; achieved pinned-memory copies reach ~80-90% of it)."""
        if self.host_link_gb_per_s is not None:
            return self.host_link_gb_per_s * 1e9
        return HOST_LINK_GB_PER_S.get(self.gpu or "", DEFAULT_HOST_LINK_GB_PER_S) * 1e9

    @property
    def host_memory_bytes_per_s(self) -> float:
        return (self.host_memory_gb_per_s or HOST_MEMORY_GB_PER_S) * 1e9

    @property
    def host_memory_per_node_gib(self) -> float | None:
        """Host memory of one node, GiB (the field, else the GPU's reference node), or None
        when unknown."""
        if self.host_memory_gib is not None:
            return float(self.host_memory_gib)
        return HOST_MEMORY_GIB_PER_NODE.get(self.gpu or "")

    def peak_tflops_for(self, dtype: str) -> float:
        """Dense matmul peak in the run's compute dtype: bf16 = peak_tflops; fp32 = TF32 (or
        FP32) from the catalogue; fp8 = the catalogue's FP8 peak. A cluster given by its numbers
        (no gpu name: CPUs, calibrated machines) reaches peak_tflops in whatever dtype it runs."""
        if dtype == "bf16" or self.gpu is None:
            if dtype == "fp8" and self.gpu is None:
                raise UserError(f"dtype='fp8': cluster {self.name} names no gpu, so its FP8 peak "
                                 "is unknown (give gpu = a catalogue name with FP8)")
            return self.peak_tflops
        g = gpu_type(self.gpu)
        scale = self.peak_tflops / g.peak_tflops  # a file may override the bf16 peak
        if dtype == "fp32":
            return (g.tf32_tflops or g.peak_tflops) * scale
        if dtype == "fp8":
            if g.fp8_tflops is None:
                raise UserError(f"dtype='fp8': {g.name} has no FP8 tensor cores (Hopper and "
                                 "later do); use bf16")
            return g.fp8_tflops * scale
        raise UserError(f"dtype={dtype!r}: allowed values are bf16, fp32, fp8")

    def at_dtype(self, dtype: str) -> "ClusterSpec":
        """This cluster with peak_tflops for matmuls in `dtype` (the cost model's view)."""
        peak = self.peak_tflops_for(dtype)
        return self if peak == self.peak_tflops else dataclasses.replace(self, peak_tflops=peak)

    def with_nodes(self, nodes: int) -> "ClusterSpec":
        return dataclasses.replace(self, nodes=nodes, name=re.sub(r":\d+$", f":{nodes}", self.name))

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items()
               if v is not None and k != "file" and not (k == "cpu" and v is False)}
        if self.gemm_efficiency is not None:
            out["gemm_efficiency"] = [dataclasses.asdict(g) for g in self.gemm_efficiency]
        if self.measurement_spread is not None:
            out["measurement_spread"] = dict(self.measurement_spread)
        return out

    def noise_note(self) -> str | None:
        """One line when the calibration behind these figures was noisy, else None."""
        words = noisy_figures(dict(self.measurement_spread or ()))
        if not words:
            return None
        return (f"the cluster figures are noisy: `meshtron calibrate`'s repeats of {words} "
                f"spread more than {NOISY_SPREAD:.0%} (interquartile range / median), so "
                "predicted step times may be off by as much (rerun it on an idle machine)")


NOISY_SPREAD = 0.25
"""A figure whose repeats' interquartile range exceeds this fraction of their median is not
trusted (torch.utils.benchmark's `_IQR_GROSS_WARN_THRESHOLD`; why: calibrate/stats.py)."""


def noisy_figures(spread: dict[str, float]) -> str:
    """'rms_norm 140%, matmul 41%': the figures spread past NOISY_SPREAD, widest first (three
    named, the rest counted, so that the warning stays one line)."""
    wide = sorted(((v, k) for k, v in spread.items() if v > NOISY_SPREAD), reverse=True)
    words = ", ".join(f"{k} {v:.0%}" for v, k in wide[:3])
    return words + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")


def _spreads(value: Any) -> tuple[tuple[str, float], ...]:
    """Validate `measurement_spread`: a table of figure name -> fraction >= 0."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        pairs = None
    if not pairs:
        raise UserError(f"cluster.measurement_spread={value!r}: must be a table of figure "
                         "name = fraction >= 0")
    for k, v in pairs:
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not 0 <= v < math.inf:
            raise UserError(f"cluster.measurement_spread.{k}={v!r}: must be a number >= 0 "
                             "(interquartile range / median of calibrate's repeats)")
    return tuple(sorted((k, float(v)) for k, v in pairs))


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM shape: (m x k) @ (k x n)."""

    m: int
    """Rows of the left operand (tokens)."""
    n: int
    """Columns of the result."""
    k: int
    """Reduction dimension."""
    efficiency: float
    """Achieved fraction of the cluster's peak_tflops, in (0, 1]."""


def _gemm_points(value: Any) -> tuple[GemmPoint, ...]:
    """Validate `gemm_efficiency`: a list of {m, n, k, efficiency} tables (or GemmPoints)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise UserError(f"cluster.gemm_efficiency={value!r}: must be a non-empty list of "
                         "{m, n, k, efficiency} tables")
    points = []
    for i, item in enumerate(value):
        if isinstance(item, GemmPoint):
            item = dataclasses.asdict(item)
        if not isinstance(item, dict) or set(item) != {"m", "n", "k", "efficiency"}:
            raise UserError(f"cluster.gemm_efficiency[{i}]={item!r}: must be a table with "
                             "exactly the keys m, n, k, efficiency")
        for key in ("m", "n", "k"):
            v = item[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"cluster.gemm_efficiency[{i}].{key}={v!r}: must be a "
                                 "positive integer")
        e = item["efficiency"]
        if not (isinstance(e, (int, float)) and not isinstance(e, bool) and 0 < e <= 1):
            raise UserError(f"cluster.gemm_efficiency[{i}].efficiency={e!r}: must be a "
                             "fraction in (0, 1]")
        points.append(GemmPoint(item["m"], item["n"], item["k"], float(e)))
    return tuple(points)


def _positive(field: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or not math.isfinite(value):
        raise UserError(f"{field}={value!r}: must be a positive number")


# The figures `meshtron train` plans with on an uncalibrated CPU machine; reports then say
# the prediction is nominal. Figures: one CPU core's fp32 GEMM rate and loopback gloo, the order
# of magnitude `meshtron calibrate` measures on a 2-core VM (meshtron's own measurement). The
# memory is not nominal: each rank gets its share of this machine's memory (physical, or the
# control group's limit where lower, as calibrate's device_figures records it), and host offload is not offered (`cpu`).
NOMINAL_CPU = "nominal-cpu"
NOMINAL_CPU_CLUSTER = {"name": NOMINAL_CPU, "peak_tflops": 0.05, "matmul_efficiency": 1.0,
                       "hbm_gb_per_s": 10.0, "intra_node_gb_per_s": 1.0,
                       "inter_node_gb_per_s": 1.0, "intra_node_latency_us": 500.0,
                       "inter_node_latency_us": 500.0, "bandwidth_efficiency": 1.0, "nodes": 1,
                       "cpu": True}


def machine_memory_gib() -> float:
    """This machine's memory, GiB: physical, or this process's control group's limit where
    lower (a container's or a Slurm job's: machine_memory.py)."""
    from meshtron.planner.machine_memory import machine_memory_bytes

    return machine_memory_bytes() / 2**30


def nominal_cpu_cluster(ranks: int, machine_gib: float | None = None) -> ClusterSpec:
    """`ranks` CPU ranks on one machine with the nominal figures, named `nominal-cpu:<ranks>`:
    the name a run prints is the `--cluster` value that plans on the same figures (on the same
    machine: each rank's memory is `machine_gib`, default this machine's, over `ranks`)."""
    total = machine_memory_gib() if machine_gib is None else machine_gib
    return cluster_from_dict({**NOMINAL_CPU_CLUSTER, "name": f"{NOMINAL_CPU}:{ranks}",
                              "gpus_per_node": ranks,
                              "memory_gib": round(total / ranks, 2)})


def _preset_words() -> str:
    return (", ".join(k + ":N" for k in CLUSTER_PRESETS)
            + f" (N nodes of 8 GPUs), {NOMINAL_CPU}:N (N CPU ranks on one machine)")


def preset_cluster(kind: str, nodes: int) -> ClusterSpec:
    """`dgx-a100`, `dgx-h100` or `dgx-h200` with `nodes` nodes of 8 GPUs; `nominal-cpu` with
    `nodes` CPU ranks on one machine (what an uncalibrated CPU run plans on)."""
    if kind == NOMINAL_CPU:
        return nominal_cpu_cluster(nodes)
    if kind not in CLUSTER_PRESETS:
        raise UserError(f"cluster={kind!r}: unknown preset; allowed: {_preset_words()} "
                        "or a TOML file")
    g = GPU_CATALOGUE[CLUSTER_PRESETS[kind]]
    return ClusterSpec(name=f"{kind}:{nodes}", gpu=g.name, peak_tflops=g.peak_tflops,
                       memory_gib=g.memory_gib, gpus_per_node=8, nodes=nodes,
                       intra_node_gb_per_s=g.nvlink_gb_per_s,
                       inter_node_gb_per_s=g.inter_node_gb_per_s, hbm_gb_per_s=g.hbm_gb_per_s)


_CLUSTER_KEYS = {"name", "gpu", "peak_tflops", "memory_gib", "gpus_per_node", "nodes",
                 "intra_node_gb_per_s", "inter_node_gb_per_s", "intra_node_latency_us",
                 "inter_node_latency_us", "hbm_gb_per_s", "matmul_efficiency",
                 "bandwidth_efficiency", "price_per_gpu_hour", "gemm_efficiency",
                 "elementwise_gb_per_s", "eager_kernel_overhead_us",
                 "collective_base_latency_us", "host_link_gb_per_s", "host_memory_gb_per_s",
                 "host_memory_gib", "sustained_clock_mhz", "measurement_spread", "cpu"}


def cluster_from_dict(data: dict[str, Any], name: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from the TOML keys documented in the module docstring."""
    if "cluster" in data and isinstance(data["cluster"], dict):
        data = data["cluster"]
    unknown = sorted(set(data) - _CLUSTER_KEYS)
    if unknown:
        raise UserError(f"cluster.{unknown[0]}: unknown key; allowed: {', '.join(sorted(_CLUSTER_KEYS))}")
    values = dict(data)
    values.setdefault("name", name)
    gpu = values.get("gpu")
    if gpu is not None:
        if not isinstance(gpu, str):
            raise UserError(f"cluster.gpu={gpu!r}: must be a GPU name string")
        g = gpu_type(gpu, "cluster.gpu")
        values["gpu"] = g.name
        values.setdefault("peak_tflops", g.peak_tflops)
        values.setdefault("memory_gib", g.memory_gib)
        values.setdefault("hbm_gb_per_s", g.hbm_gb_per_s)
    for key in ("peak_tflops", "memory_gib", "gpus_per_node", "nodes", "intra_node_gb_per_s",
                "inter_node_gb_per_s"):
        if key not in values:
            hint = " (or a known gpu name)" if key in ("peak_tflops", "memory_gib") else ""
            raise UserError(f"cluster.{key}: missing; required{hint}")
    return ClusterSpec(**values)


def load_cluster_toml(path: str | Path) -> ClusterSpec:
    from meshtron.config import load_toml

    spec = cluster_from_dict(load_toml(path, field="cluster"), name=Path(path).stem)
    return dataclasses.replace(spec, file=str(Path(path).resolve()))


def resolve_cluster(text: str | Path | ClusterSpec) -> ClusterSpec:
    """`dgx-h100:N` style preset, or a path to a cluster TOML file."""
    if isinstance(text, ClusterSpec):
        return text
    text = str(text)
    if not text.strip():  # Path('') is '.', which would be refused as a folder
        raise UserError(f"cluster={text!r}: expected a preset ({_preset_words()}) or a TOML "
                        "file path")
    m = re.fullmatch(r"([a-z0-9-]+):(\d+)", text.strip())
    if m and not Path(text).exists():
        nodes = int(m.group(2))
        if nodes <= 0:
            raise UserError(f"cluster={text!r}: node count must be a positive integer")
        return preset_cluster(m.group(1), nodes)
    if text.endswith(".toml") or Path(text).exists():
        return load_cluster_toml(text)
    raise UserError(f"cluster={text!r}: expected a preset ({_preset_words()}) or a TOML "
                    "file path")
