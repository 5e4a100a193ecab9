"""Measure this machine the way the planner models it, over the real backend.

Run on every rank at once (so ranks contend for cores, memory and links as in training):
- matrix-multiply throughput per rank (best of a few square GEMMs: the planner's `peak_tflops`
  with `matmul_efficiency = 1`; its shape model then discounts small GEMMs);
- memory bandwidth per rank (a large copy: the planner's `hbm_gb_per_s` roofline);
- all-reduce, all-gather, reduce-scatter and send/recv times over a range of sizes, fitted to the
  planner's own alpha-beta ring formulas (`meshtron.planner.comm`) by least squares, so the
  fitted latency and bandwidth are exactly the parameters the planner's formulas take.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

SIZES_BYTES = [2**k for k in range(12, 23, 2)]  # 4 KiB .. 4 MiB


@dataclass
class Calibration:
    """What `meshtron calibrate` measured (also written as JSON beside the cluster file)."""

    world_size: int
    device: str
    backend: str
    dtype: str
    matmul_tflops: float
    """Slowest rank's best GEMM throughput, TFLOP/s."""
    memory_gb_per_s: float
    """Slowest rank's copy bandwidth (read + write), GB/s."""
    memory_gib: float
    """Memory available to one rank, GiB."""
    latency_us: float = 0.0
    """Fitted per-ring-step latency of the collectives, microseconds."""
    bandwidth_gb_per_s: float = 0.0
    """Fitted per-rank link bandwidth of the collectives, GB/s per direction."""
    p2p_latency_us: float = 0.0
    p2p_gb_per_s: float = 0.0
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Raw (bytes, median seconds) per collective."""

    def cluster_dict(self, name: str = "local") -> dict[str, Any]:
        """The cluster TOML keys the planner reads (meshtron/planner/cluster.py)."""
        return {
            "name": name,
            "peak_tflops": round(self.matmul_tflops, 6),
            "matmul_efficiency": 1.0,
            "memory_gib": round(self.memory_gib, 3),
            "hbm_gb_per_s": round(self.memory_gb_per_s, 3),
            "gpus_per_node": self.world_size,
            "nodes": 1,
            "intra_node_gb_per_s": round(self.bandwidth_gb_per_s, 6),
            "inter_node_gb_per_s": round(self.bandwidth_gb_per_s, 6),
            "intra_node_latency_us": round(self.latency_us, 3),
            "inter_node_latency_us": round(self.latency_us, 3),
            "bandwidth_efficiency": 1.0,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _sustained_time(fn, device: torch.device, seconds: float) -> float:
    """Seconds per call of `fn` run back to back for about `seconds` (after one warm-up call).

    Sustained, not best-of: when ranks share cores (more CPU ranks than cores), a short burst
    can land on an idle core and report a rate no rank keeps up during training."""
    fn()
    _sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return elapsed / calls


def measure_matmul(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best sustained TFLOP/s over square GEMMs (the largest sizes reach the achievable
    ceiling), measured while every rank runs the same loop."""
    sizes = [256, 512, 1024] if device.type == "cpu" else [2048, 4096, 8192]
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = _sustained_time(lambda: a @ b, device, seconds)
        best = max(best, 2 * n**3 / t / 1e12)
    return best


def measure_memory_bandwidth(device: torch.device) -> float:
    nbytes = 64 * 2**20 if device.type == "cpu" else 1 * 2**30
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), device, repeats=3)
    return 2 * nbytes / t / 1e9  # read + write


def _time_collective(fn, group, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    # Every rank waits for the slowest: the collective's time is the max over ranks.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_collectives(group, device: torch.device, dtype: torch.dtype,
                        repeats: int = 5) -> dict[str, list[tuple[int, float]]]:
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    elem = torch.tensor([], dtype=dtype).element_size()
    out: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [],
                                               "reduce_scatter": [], "send_recv": []}
    for nbytes in SIZES_BYTES:
        numel = max(n, nbytes // elem // n * n)
        full = torch.ones(numel, device=device, dtype=dtype)
        shard = torch.ones(numel // n, device=device, dtype=dtype)
        out["all_reduce"].append(
            (numel * elem, _time_collective(lambda: dist.all_reduce(full, group=group),
                                            group, device, repeats)))
        out["all_gather"].append(
            (numel * elem, _time_collective(
                lambda: dist.all_gather_single(full, shard, group=group),
                group, device, repeats)))
        out["reduce_scatter"].append(
            (numel * elem, _time_collective(
                lambda: dist.reduce_scatter_single(shard, full, group=group),
                group, device, repeats)))

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
                                                                repeats) / 2))
    return out


def fit_alpha_beta(samples: dict[str, list[tuple[int, float]]], n: int) -> tuple[float, float]:
    """Least-squares fit of t = steps(n)*alpha + bytes_factor(n)*B/bw to all three collectives,
    with the ring formulas of `meshtron.planner.comm`; returns (alpha seconds, bw bytes/s)."""
    rows, ts = [], []
    for name, (steps, factor) in {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
                                  "all_gather": (n - 1, (n - 1) / n),
                                  "reduce_scatter": (n - 1, (n - 1) / n)}.items():
        for nbytes, t in samples[name]:
            rows.append((steps, factor * nbytes))
            ts.append(t)
    return _nonneg_lstsq(rows, ts)


def fit_p2p(samples: list[tuple[int, float]]) -> tuple[float, float]:
    return _nonneg_lstsq([(1.0, float(b)) for b, _ in samples], [t for _, t in samples])


def _nonneg_lstsq(rows: list[tuple[float, float]], ts: list[float]) -> tuple[float, float]:
    """Solve t = x0*a + x1*b with x >= 0 (2 unknowns: try the unconstrained solution, then each
    single-variable one), weighting rows by 1/t so small and large messages count alike."""
    import numpy as np

    a = np.array(rows, dtype=np.float64)
    t = np.array(ts, dtype=np.float64)
    w = 1.0 / np.maximum(t, 1e-9)
    aw, tw = a * w[:, None], t * w
    x, *_ = np.linalg.lstsq(aw, tw, rcond=None)
    if (x < 0).any():
        candidates = []
        for j in (0, 1):
            col = aw[:, j]
            xj = max(0.0, float(col @ tw / (col @ col)))
            xx = np.zeros(2)
            xx[j] = xj
            candidates.append((float(((aw @ xx - tw) ** 2).sum()), xx))
        x = min(candidates, key=lambda c: c[0])[1]
    alpha = float(x[0])
    inv_bw = float(x[1])
    bw = 1.0 / inv_bw if inv_bw > 0 else 1e15
    return alpha, bw


def memory_per_rank_gib(device: torch.device, world_size: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / world_size / 2**30


def calibrate(device: torch.device, group=None) -> Calibration:
    """Collective: every rank of `group` must call it. Returns the same result on every rank."""
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if n > 1:
        dist.barrier(group=group)  # measure all ranks at once: they share cores and memory
    tflops = torch.tensor([measure_matmul(device, dtype),
                           measure_memory_bandwidth(device)], dtype=torch.float64, device=device)
    if n > 1:
        dist.all_reduce(tflops, op=dist.ReduceOp.MIN, group=group)
    cal = Calibration(world_size=n, device=device.type,
                      backend=dist.get_backend(group) if n > 1 else "none",
                      dtype=str(dtype).removeprefix("torch."), matmul_tflops=float(tflops[0]),
                      memory_gb_per_s=float(tflops[1]),
                      memory_gib=memory_per_rank_gib(device, n))
    if n > 1:
        cal.samples = measure_collectives(group, device, dtype)
        alpha, bw = fit_alpha_beta(cal.samples, n)
        cal.latency_us, cal.bandwidth_gb_per_s = alpha * 1e6, bw / 1e9
        p_alpha, p_bw = fit_p2p(cal.samples["send_recv"])
        cal.p2p_latency_us, cal.p2p_gb_per_s = p_alpha * 1e6, p_bw / 1e9
    else:
        # One rank never communicates; any finite figures keep the planner's formulas defined.
        cal.latency_us, cal.bandwidth_gb_per_s = 1.0, cal.memory_gb_per_s
    return cal
