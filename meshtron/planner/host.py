"""What the host (CPU) and NCCL's kernels cost the GPU's compute: the launch-bound part of a
layer, and the SMs a collective takes from the GEMMs it overlaps. Torch-free.

Host launch overhead. Eager PyTorch issues every kernel from the host: the forward runs Python
module code, the dispatcher, autograd's graph recording and cudaLaunchKernel per operation
(about 10 us: H. He, "Making Deep Learning Go Brrrr From First Principles", 2022; `meshtron
calibrate` measured 10.2 us per tiny eager op on one H200, bench/results, calibration data);
the backward is replayed by autograd's C++ engine, which skips Python: one backward kernel
costs the host 0.93 of a forward one (BACKWARD_HOST_FRACTION, from bench/host_dispatch.py's
CPU measurement plus the launch), and the backward issues 1.25 times the forward's kernels
(BACKWARD_LAUNCHES, counted on meshtron's Block). The launches are asynchronous: the host
runs ahead of the GPU through the stream's queue, so over a stretch of work between two host
synchronisations the GPU finishes after max(host issue time, device time) (plus the first
launch). A transformer stack is periodic (every layer issues the same
kernels), so per layer and pass the stretch rule reads max(issue, device): the GPU idles only
when a layer's kernels are shorter on average than their launches, i.e. small per-GPU work
(small models, large tp, small micro-batches). Each collective call is one more launch on the
host (c10d's collectives are dispatcher operations since PyTorch 2.0), and the device time of
the stretch includes the collectives the stream waits on. What differs per stack is the kernel
count (elementwise.py `kernels_per_layer`: eager issues every element-wise operation, Megatron /
Transformer Engine and per-block torch.compile fuse them). Every stack is charged the eager
per-launch cost: Megatron/TE modules and inductor's generated wrapper still launch each kernel
from Python (CUDA graphs, which would remove it, are no stack's default here).

Host synchronisations. meshtron's step reads loss, gradient norm and time once per step
(train/loop.py `read_values`, one device-to-host copy), and the MoE dispatch reads its split
sizes once per MoE layer and micro-batch forward (parallel/expert.py `.tolist()`): after a
sync the queue is empty and the GPU waits for the next launch, SYNC_S each.

NCCL SM contention. An NCCL collective runs one CTA per channel, and a CTA holds its SM for the
kernel's whole life (NCCL never shares an SM with compute: nccl#689, nccl#1656). NCCL launches
two CTAs per NVLink to saturate NVLink with large messages (nccl#1703; 24 CTAs on a DGX A100's
12 NVLinks, nccl#1225), capped by its channel limit (MAXCHANNELS 32, NCCL <= 2.22); across
nodes two per NIC (nccl#689: 16 SMs on a DGX with 8 NICs; nccl#1453's 3-node H100 log
lists 16 ring channels; one NIC per GPU assumed). A GEMM
beside it runs on the remaining SMs: over the hidden part h of a collective the compute
progresses at (sms - ctas) / sms of its rate, so it finishes h * ctas / sms later
(`sm_interference`). Copy-engine transfers (Transformer Engine's ring exchange, PyTorch async
TP) take no SM and keep overlap.OVERLAP_INTERFERENCE (HBM sharing).
"""

from __future__ import annotations

from meshtron.planner.cluster import ClusterSpec, gpu_type
from meshtron.planner.overlap import DEFAULT_SMS, sm_count

FORWARD_DISPATCH_US = 3.6
"""Host time of one eager forward op that records autograd's graph, without the CUDA launch:
bench/host_dispatch.py on CPU (torch 2.13, 8-element tensors, fastest of 41 runs of 500 ops:
3.58-3.66 us on this project's 2-core machine)."""
NO_GRAD_DISPATCH_US = 2.87
"""The same op without autograd recording (2.85-2.89 us)."""
BACKWARD_NODE_US = 2.87
"""One backward node run by autograd's C++ engine (2.84-2.97 us)."""
LAUNCH_US = 10.2 - NO_GRAD_DISPATCH_US
"""cudaLaunchKernel and the CUDA dispatch path, which the CPU run lacks: `meshtron calibrate`'s
no-grad op on one H200 (10.2 us, calibration data, bench/results) less its dispatch."""
BACKWARD_HOST_FRACTION = (BACKWARD_NODE_US + LAUNCH_US) / (FORWARD_DISPATCH_US + LAUNCH_US)
"""Host cost of one backward kernel over one forward kernel (0.93): the C++ engine saves the
Python frame and the recording, both pay the launch."""
AUTOGRAD_RECORD = (FORWARD_DISPATCH_US + LAUNCH_US) / (NO_GRAD_DISPATCH_US + LAUNCH_US)
"""A training forward op over the no-grad op `meshtron calibrate` times (`x.add_(1)` back to
back, calibrate/kernels.py): 1.07. A calibrated cluster's per-kernel cost is scaled by it
(gemm.py `dispatch_s`); the constant DISPATCH_S already stands for a training op."""
BACKWARD_LAUNCHES = 1.25
"""Backward launches per forward launch of a layer, counted on meshtron's Block by
bench/host_kernel_count.py (torch 2.13, llama-style: 28 forward, 35 backward; two GEMMs per
forward GEMM, but views, casts and the RoPE tables' casts need no backward kernel).
Accumulating into existing gradients (micro-batches after the first) adds one add per
parameter tensor, not charged here."""
SYNC_S = 20e-6
"""GPU idle time one host synchronisation causes: the device-to-host copy's round trip and the
first launch after it (cudaStreamSynchronize wake-up plus one eager dispatch, about 2 x the
~10 us launch)."""
CTAS_PER_NVLINK = 2
"""NCCL CTAs per NVLink for large messages (nccl#1703)."""
CTAS_PER_NIC = 2
"""NCCL CTAs per NIC across nodes (nccl#689: 16 on 8 NICs)."""
NCCL_MAX_CTAS = 32
"""NCCL's channel cap (MAXCHANNELS 32, NCCL <= 2.22; NCCL_MAX_CTAS overrides)."""
NVLINK_LINK_GB_PER_S = {"B": 50.0}
"""Per-direction bandwidth of one NVLink: 25 GB/s for NVLink 2-4 (V100, A100, H100/H200), 50 GB/s
for NVLink 5 (Blackwell); keyed by the catalogue name's first letter, 25 otherwise."""


def nvlinks(cluster: ClusterSpec) -> int:
    """NVLinks per GPU: the cluster's intra-node bandwidth over one link's (V100 6, A100 12,
    H100 18, H800 8, B200 18)."""
    first = gpu_type(cluster.gpu).name[0] if cluster.gpu is not None else ""
    link = NVLINK_LINK_GB_PER_S.get(first, 25.0)
    return max(1, round(cluster.intra_node_gb_per_s / link))


def nccl_ctas(cluster: ClusterSpec, inter_node: bool) -> int:
    """SMs one NCCL collective holds while it runs: 2 per NIC across nodes (one NIC per GPU),
    2 per NVLink inside a node, at most NCCL_MAX_CTAS."""
    if inter_node:
        return min(NCCL_MAX_CTAS, CTAS_PER_NIC * cluster.gpus_per_node)
    return min(NCCL_MAX_CTAS, CTAS_PER_NVLINK * nvlinks(cluster))


def sm_interference(cluster: ClusterSpec, inter_node: bool) -> float:
    """Extra compute seconds per second of collective hidden beside it: ctas / sms."""
    sms = sm_count(cluster) or DEFAULT_SMS
    return min(1.0, nccl_ctas(cluster, inter_node) / sms)


def launch_bound(device_s: float, issue_s: float) -> float:
    """Seconds a periodic stretch of `device_s` GPU time whose kernels take `issue_s` to launch
    adds over its device time: the GPU waits on the host by the difference (module
    docstring)."""
    return issue_s - device_s if issue_s > device_s else 0.0


def layer_issue(kernels: int, collectives: int, per_kernel_s: float) -> tuple[float, float]:
    """(forward, backward) host seconds to launch one layer's work for one micro-batch:
    `kernels` forward kernels and `collectives` forward collective calls; the backward
    launches BACKWARD_LAUNCHES per forward kernel, each at BACKWARD_HOST_FRACTION of a forward
    launch (autograd's C++ engine), and one collective per forward one (the conjugates)."""
    fwd = (kernels + collectives) * per_kernel_s
    bwd = (BACKWARD_LAUNCHES * kernels + collectives) * per_kernel_s * BACKWARD_HOST_FRACTION
    return fwd, bwd


def tp_collectives(tp: int, sp: bool) -> int:
    """Tensor-parallel collective calls of one layer's forward: an all-reduce after the
    attention output and MLP-down projections; with sequence parallelism an all-gather
    before QKV and MLP-up and a reduce-scatter after the other two."""
    if tp <= 1:
        return 0
    return 4 if sp else 2
