"""Measure this machine the way the planner models it, over the real backend.

Run on every rank at once (so ranks contend for cores, memory and links as in training):

- single-device figures (`kernels.py`): matrix-multiply throughput (best square GEMM) and the
  efficiency of a transformer layer's GEMM shapes, copy bandwidth, the achieved bandwidth of
  eager element-wise ops, and the per-op overhead of eager dispatch + kernel launch;
- collectives per fabric level. Node membership comes from the hostnames and LOCAL_WORLD_SIZE
  (`node_of_ranks`): "intra" groups are the ranks of one node, "inter" groups take one rank per
  node (the same local rank on every node: with one NIC per GPU, rail-aligned, that is the path
  a data-parallel ring's inter-node hops take). Every group of a level runs at once. All-reduce,
  all-gather and reduce-scatter times over a sweep of message sizes (4 KiB to 256 MiB on GPU, to
  4 MiB on CPU) are fitted by least squares to the formulas the planner costs them with
  (`meshtron.planner.comm.level_terms`, NCCL's tuning model): t = baseLat + steps(n) * hwLat +
  bytes_factor(n) * B / bw, the fastest of ring and tree for an all-reduce across more than two
  nodes. baseLat, the fixed latency of one call, is fitted on the intra level (its all-reduce
  has twice the steps of its all-gather, which tells baseLat from hwLat) and kept for the inter
  level, whose fit gives that level's hwLat and bw; the cluster file carries all of them
  (`collective_base_latency_us`, `*_node_latency_us`, `*_node_gb_per_s`), so the planner
  reproduces the measured times. Send/recv is fitted on its own (alpha + B / bw) for the report.
  With a single node the inter level is not measured and the cluster file repeats the intra
  figures (the planner needs both fields; no group will cross nodes).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshtron.calibrate.kernels import (measure_elementwise, measure_gemm_shapes,
                                        measure_kernel_overhead, measure_matmul,
                                        measure_memory_bandwidth, sync)
from meshtron.calibrate.saved import device_name
from meshtron.planner import comm
from meshtron.planner.comm import Group
from meshtron.torch_compat import all_gather_into, reduce_scatter_into

CPU_SIZES = [2**k for k in range(12, 23, 2)]   # 4 KiB .. 4 MiB
GPU_SIZES = [2**k for k in range(12, 29, 2)]   # 4 KiB .. 256 MiB


@dataclass
class Level:
    """Fitted collective model of one fabric level."""

    group_size: int = 0
    """Ranks per group at this level (0: not measured)."""
    latency_us: float = 0.0
    """Fitted per-ring-step latency (alpha, NCCL's hwLat), microseconds."""
    base_latency_us: float = 0.0
    """Fixed latency of one collective call (NCCL's baseLat), microseconds: fitted on the intra
    level, carried over to the inter level."""
    bandwidth_gb_per_s: float = 0.0
    """Fitted per-rank bandwidth per direction, GB/s."""
    p2p_latency_us: float = 0.0
    """Fitted send/recv latency, microseconds."""
    p2p_gb_per_s: float = 0.0
    """Fitted send/recv bandwidth, GB/s."""
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Raw (bytes, slowest rank's median seconds) per collective."""


@dataclass
class Calibration:
    """What `meshtron calibrate` measured (also written as JSON beside the cluster file)."""

    world_size: int
    device: str
    backend: str
    dtype: str
    matmul_tflops: float
    """Slowest rank's best square-GEMM throughput, TFLOP/s."""
    memory_gb_per_s: float
    """Slowest rank's copy bandwidth (read + write), GB/s."""
    memory_gib: float
    """Memory available to one rank, GiB."""
    gpus_per_node: int = 1
    """Ranks per node (from hostnames / LOCAL_WORLD_SIZE)."""
    nodes: int = 1
    """Nodes the ranks span."""
    gpu: str | None = None
    """Catalogue name of the device when recognised (CUDA)."""
    device_name: str = ""
    """The device as its driver names it ("NVIDIA H200"; "cpu"): `--plan auto` uses this
    calibration only on that device (calibrate/saved.py)."""
    gemm: list[dict[str, float]] = field(default_factory=list)
    """Transformer GEMM shapes: m, n, k and the slowest rank's TFLOP/s."""
    elementwise_gb_per_s: dict[str, float] = field(default_factory=dict)
    """Achieved bandwidth of eager RMSNorm, silu(a)*b, softmax (slowest rank), GB/s."""
    kernel_overhead_us: float = 0.0
    """Per tiny eager op (dispatch + launch), slowest rank, microseconds."""
    spread: dict[str, float] = field(default_factory=dict)
    """Per single-device figure, the widest rank's interquartile range / median of its
    repeats (stats.py): "matmul", "memory", "gemm MxNxK", each element-wise op, "eager_op"."""
    intra: Level = field(default_factory=Level)
    """Collectives inside a node."""
    inter: Level = field(default_factory=Level)
    """Collectives across nodes (measured only when the ranks span several nodes)."""

    # kept for readers of the version-1 JSON (tests, scripts): the intra-node figures
    @property
    def latency_us(self) -> float:
        return self.intra.latency_us

    @property
    def bandwidth_gb_per_s(self) -> float:
        return self.intra.bandwidth_gb_per_s

    @property
    def samples(self) -> dict[str, list[tuple[int, float]]]:
        return self.intra.samples

    def peak(self) -> float:
        """Peak TFLOP/s the cluster file states: the catalogue's for a recognised GPU (so MFU is
        against the datasheet), else the measured best GEMM."""
        if self.gpu is not None:
            from meshtron.planner.cluster import gpu_type

            return gpu_type(self.gpu).peak_tflops
        return self.matmul_tflops

    def cluster_dict(self, name: str = "local") -> dict[str, Any]:
        """The cluster TOML keys the planner reads (meshtron/planner/cluster.py)."""
        peak = self.peak()
        inter = self.inter if self.inter.group_size else self.intra
        out: dict[str, Any] = {"name": name}
        if self.gpu is not None:
            out["gpu"] = self.gpu
        out.update({
            "peak_tflops": round(peak, 6),
            "matmul_efficiency": round(min(1.0, self.matmul_tflops / peak), 4),
            "memory_gib": round(self.memory_gib, 3),
            "hbm_gb_per_s": round(self.memory_gb_per_s, 3),
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "intra_node_gb_per_s": round(self.intra.bandwidth_gb_per_s, 6),
            "inter_node_gb_per_s": round(inter.bandwidth_gb_per_s, 6),
            "intra_node_latency_us": round(self.intra.latency_us, 3),
            "inter_node_latency_us": round(inter.latency_us, 3),
            "collective_base_latency_us": round(self.intra.base_latency_us
                                                if self.intra.group_size > 1
                                                else inter.base_latency_us, 3),
            "bandwidth_efficiency": 1.0,
        })
        if self.gemm:
            out["gemm_efficiency"] = [
                {"m": g["m"], "n": g["n"], "k": g["k"],
                 "efficiency": round(min(1.0, g["tflops"] / peak), 4)} for g in self.gemm]
        if self.elementwise_gb_per_s:
            out["elementwise_gb_per_s"] = round(
                statistics.median(self.elementwise_gb_per_s.values()), 3)
        if self.kernel_overhead_us > 0:
            out["eager_kernel_overhead_us"] = round(self.kernel_overhead_us, 3)
        if self.spread:
            out["measurement_spread"] = {k: round(v, 3) for k, v in self.spread.items()}
        if self.device == "cpu":  # a rank's memory is the host's: no host offload (cluster.cpu)
            out["cpu"] = True
        return out


# ---- nodes and groups --------------------------------------------------------------------------
def node_of_ranks(hostnames: list[str], local_world_size: int) -> list[int]:
    """Node index of every rank: ranks on different hosts are on different nodes; on one host,
    LOCAL_WORLD_SIZE consecutive ranks form a node (torchrun and Slurm number ranks node by
    node). Nodes are numbered by their lowest rank."""
    keys = [(host, r // max(1, local_world_size)) for r, host in enumerate(hostnames)]
    index: dict[tuple[str, int], int] = {}
    return [index.setdefault(k, len(index)) for k in keys]


def level_groups(nodes: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(intra groups: the ranks of each node; inter groups: the i-th rank of every node)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    intra = list(by_node.values())
    if len(intra) == 1 or len({len(g) for g in intra}) > 1:
        return intra, []  # one node, or nodes of unequal size: no rail-aligned inter groups
    return intra, [[g[i] for g in intra] for i in range(len(intra[0]))]


def _my_group(groups: list[list[int]], rank: int):
    """Create every group (a collective call: all ranks create all groups); return this rank's."""
    mine = None
    for members in groups:
        pg = dist.new_group(members)
        if rank in members:
            mine = pg
    return mine


# ---- collectives -------------------------------------------------------------------------------
def _time_collective(fn, group, device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    # Every rank waits for the slowest: the collective's time is the max over ranks.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_collectives(group, device: torch.device, dtype: torch.dtype, sizes: list[int],
                        repeats: int = 5) -> dict[str, list[tuple[int, float]]]:
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    elem = torch.tensor([], dtype=dtype).element_size()
    out: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [],
                                               "reduce_scatter": [], "send_recv": []}
    for nbytes in sizes:
        numel = max(n, nbytes // elem // n * n)
        full = torch.ones(numel, device=device, dtype=dtype)
        shard = torch.ones(numel // n, device=device, dtype=dtype)
        reps = repeats if nbytes <= 2**24 else 3
        out["all_reduce"].append(
            (numel * elem, _time_collective(lambda: dist.all_reduce(full, group=group),
                                            group, device, reps)))
        out["all_gather"].append(
            (numel * elem, _time_collective(
                lambda: all_gather_into(full, shard, group=group), group, device, reps)))
        out["reduce_scatter"].append(
            (numel * elem, _time_collective(
                lambda: reduce_scatter_into(shard, full, group=group), group, device,
                reps)))

        def ping_pong() -> None:
            # Ranks pair up (0<->1, 2<->3, ...); half a round trip is one transfer.
            peer = rank ^ 1
            if peer >= n:
                return
            dst = peer if group is None else dist.get_global_rank(group, peer)
            if rank % 2 == 0:
                dist.send(full, dst, group=group)
                dist.recv(full, dst, group=group)
            else:
                dist.recv(full, dst, group=group)
                dist.send(full, dst, group=group)

        out["send_recv"].append((numel * elem, _time_collective(ping_pong, group, device,
                                                                reps) / 2))
    return out


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def fit_level(samples: dict[str, list[tuple[int, float]]], group: Group,
              base: float | None = None) -> tuple[float, float, float]:
    """Least-squares fit of the planner's collective formulas (`comm.level_terms`) to the
    all-reduce, all-gather and reduce-scatter samples of one level's `group`; returns
    (baseLat seconds, per-step latency seconds, bandwidth bytes/s). `base` given: baseLat is
    held at it and only the other two are fitted. Where NCCL may choose between ring and tree
    (all-reduce across > 2 nodes) each sample is assigned the algorithm the current fit makes
    faster, and the fit repeated until the assignment settles (as the planner takes the min)."""
    rows = [(terms, float(t)) for op in COLLECTIVES for b, t in samples[op]
            for terms in [comm.level_terms(op, b, group)]]
    choice = [0] * len(rows)
    for _ in range(8):
        a = [terms[c] for (terms, _), c in zip(rows, choice)]
        ts = [t for _, t in rows]
        if base is None:
            x = _nonneg_lstsq(a, ts, ts)
            params = (x[0], x[1], x[2])
        else:
            x = _nonneg_lstsq([r[1:] for r in a], [t - r[0] * base for r, t in zip(a, ts)], ts)
            params = (base, x[0], x[1])
        new = [min(range(len(terms)), key=lambda i: _predict(terms[i], params))
               for terms, _ in rows]
        if new == choice:
            break
        choice = new
    inv_bw = params[2]
    return params[0], params[1], 1.0 / inv_bw if inv_bw > 0 else 1e15


def _predict(terms: tuple[float, ...], params: tuple[float, float, float]) -> float:
    return sum(c * p for c, p in zip(terms, params))


def fit_p2p(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """One transfer: t = alpha + B / bw; returns (alpha seconds, bw bytes/s)."""
    ts = [t for _, t in samples]
    alpha, inv_bw = _nonneg_lstsq([(1.0, float(b)) for b, _ in samples], ts, ts)
    return alpha, 1.0 / inv_bw if inv_bw > 0 else 1e15


def _nonneg_lstsq(rows: list[tuple[float, ...]], ts: list[float],
                  scale: list[float]) -> list[float]:
    """Solve t = rows @ x with x >= 0, weighting each row by 1/scale (its measured time) so small
    and large messages count alike. Few unknowns: if the unconstrained solution has a negative
    entry, take the best solution over every subset of the unknowns (the rest held at 0) that
    is itself non-negative."""
    import itertools

    import numpy as np

    a = np.array(rows, dtype=np.float64)
    t = np.array(ts, dtype=np.float64)
    w = 1.0 / np.maximum(np.array(scale, dtype=np.float64), 1e-9)
    aw, tw = a * w[:, None], t * w
    x, *_ = np.linalg.lstsq(aw, tw, rcond=None)
    if (x < 0).any():
        best = (float(tw @ tw), np.zeros(a.shape[1]))
        for r in range(1, a.shape[1]):
            for cols in itertools.combinations(range(a.shape[1]), r):
                xs, *_ = np.linalg.lstsq(aw[:, cols], tw, rcond=None)
                if (xs < 0).any():
                    continue
                xx = np.zeros(a.shape[1])
                xx[list(cols)] = xs
                res = float(((aw @ xx - tw) ** 2).sum())
                if res < best[0]:
                    best = (res, xx)
        x = best[1]
    return [float(v) for v in x]


def measure_level(group, device: torch.device, dtype: torch.dtype, sizes: list[int],
                  shape: Group, base: float | None = None) -> Level:
    """Sweep, then fit, one fabric level on this rank's group of it (all groups at once).
    `shape`: where the group's members sit (one node, or one per node); `base`: baseLat fitted
    on another level, seconds (None: fit it here)."""
    n = dist.get_world_size(group)
    samples = measure_collectives(group, device, dtype, sizes)
    # every group of the level ran at once; keep the slowest group's times
    for name, rows in samples.items():
        t = torch.tensor([s for _, s in rows], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples[name] = [(b, float(s)) for (b, _), s in zip(rows, t.tolist())]
    base, alpha, bw = fit_level(samples, shape, base)
    p_alpha, p_bw = fit_p2p(samples["send_recv"])
    return Level(group_size=n, latency_us=alpha * 1e6, base_latency_us=base * 1e6,
                 bandwidth_gb_per_s=bw / 1e9, p2p_latency_us=p_alpha * 1e6,
                 p2p_gb_per_s=p_bw / 1e9, samples=samples)


# ---- the whole calibration ---------------------------------------------------------------------
def device_figures(device: torch.device, local_ranks: int, gpu=None) -> dict[str, Any]:
    """What a calibration records about its device: the dtype it measures in, the memory per
    rank, the catalogue entry of a CUDA device (calibrate/device.py's name and memory rules,
    the same ones `--plan auto` detects it by) and the device's name. `gpu`: the CUDA device
    query API (`get_device_properties`; default `torch.cuda`), injectable so that the CUDA
    branch runs on a CPU machine."""
    if device.type != "cuda":
        from meshtron.planner.machine_memory import machine_memory_bytes

        total = machine_memory_bytes()  # physical, or a container's / Slurm job's limit
        return {"dtype": torch.float32, "memory_gib": total / local_ranks / 2**30, "gpu": None,
                "device_name": device_name(device)}
    from meshtron.calibrate.device import catalogue_gpu

    props = (torch.cuda if gpu is None else gpu).get_device_properties(device)
    return {"dtype": torch.bfloat16, "memory_gib": props.total_memory / 2**30,
            "gpu": catalogue_gpu(props.name, props.total_memory), "device_name": props.name}


def _across_ranks(values: list[float], device: torch.device, op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def _single_device(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The single-device figures, the slowest rank's (rates: MIN, the eager op's time: MAX),
    and each figure's widest spread over the ranks (MAX): same on every rank."""
    gemm = measure_gemm_shapes(device, dtype)
    elementwise = measure_elementwise(device, dtype)
    figures = {"matmul": measure_matmul(device, dtype),
               "memory": measure_memory_bandwidth(device),
               **{f"gemm {g['m']}x{g['n']}x{g['k']}": (g["tflops"], g.pop("spread"))
                  for g in gemm},
               **elementwise}
    overhead, overhead_spread = measure_kernel_overhead(device)
    rates = _across_ranks([r for r, _ in figures.values()], device, dist.ReduceOp.MIN)
    overhead = _across_ranks([overhead], device, dist.ReduceOp.MAX)[0]
    spreads = _across_ranks([s for _, s in figures.values()] + [overhead_spread], device,
                            dist.ReduceOp.MAX)
    by_name = dict(zip(figures, rates))
    for g in gemm:
        g["tflops"] = by_name[f"gemm {g['m']}x{g['n']}x{g['k']}"]
    return {"matmul_tflops": by_name["matmul"], "memory_gb_per_s": by_name["memory"],
            "gemm": gemm, "elementwise_gb_per_s": {k: by_name[k] for k in elementwise},
            "kernel_overhead_us": overhead,
            "spread": dict(zip([*figures, "eager_op"], spreads))}


def calibrate(device: torch.device, sizes: list[int] | None = None) -> Calibration:
    """Collective over the default group: every rank calls it; same result on every rank.
    `sizes`: message sizes of the collective sweep (default: CPU_SIZES or GPU_SIZES)."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    hosts: list[Any] = [socket.gethostname()] * n
    if n > 1:
        dist.all_gather_object(hosts, socket.gethostname())
    nodes = node_of_ranks(hosts, local_ws)
    intra, inter = level_groups(nodes)
    figures = device_figures(device, len(intra[0]))
    dtype = figures.pop("dtype")
    if n > 1:
        dist.barrier()  # measure all ranks at once: they share cores and memory
    single = _single_device(device, dtype)
    cal = Calibration(world_size=n, device=device.type,
                      backend=dist.get_backend() if n > 1 else "none",
                      dtype=str(dtype).removeprefix("torch."),
                      gpus_per_node=min(len(g) for g in intra), nodes=len(intra),
                      **figures, **single)
    sizes = sizes or (CPU_SIZES if device.type == "cpu" else GPU_SIZES)
    if len(intra[0]) > 1:
        group = _my_group(intra, rank) if len(intra) > 1 else None
        cal.intra = measure_level(group, device, dtype, sizes, Group(len(intra[0]), len(intra[0])))
    if inter:
        base = cal.intra.base_latency_us * 1e-6 if cal.intra.group_size else None
        cal.inter = measure_level(_my_group(inter, rank), device, dtype, sizes,
                                  Group(len(inter[0]), 1), base)
    if not cal.intra.group_size:
        # One rank per node never talks inside a node; any finite figures keep the formulas
        # defined (no group is costed on this level).
        cal.intra = Level(group_size=1, latency_us=1.0,
                          bandwidth_gb_per_s=cal.memory_gb_per_s)
    return cal
