"""Single-device measurements: GEMM throughput by shape, eager element-wise bandwidth, kernel
launch overhead, device memory bandwidth. Every rank runs them at once (so ranks contend for
cores, memory and power as in training); the caller keeps the slowest rank's figures.

Shapes (`gemm_shapes`): the matrix multiplies of a transformer layer for a hidden size h and a
micro-batch of `tokens` rows: QKV (tokens x 3h x h), the attention output projection
(tokens x h x h), the MLP up and down projections (tokens x 4h x h, tokens x h x 4h), and the
column shard of an 8-way tensor-parallel MLP (tokens x h/2 x h): the narrow GEMMs tensor
parallelism produces, which run furthest from peak.

Element-wise ops (`measure_elementwise`): RMSNorm, the SwiGLU product silu(a) * b and softmax,
each run as eager PyTorch runs it; the bandwidth is the bytes its kernels read and write divided
by its time (RMSNorm: one read and one write per element when fused, the composite path's
intermediates otherwise, counted as `bytes_moved` says; silu(a)*b: two kernels, 5 tensor
passes; softmax: one read and one write). This is the achieved HBM bandwidth the planner's
per-operation model of non-matmul work needs.

Kernel overhead (`measure_kernel_overhead`): the time of a tiny op issued back to back, i.e. the
per-operation cost of eager dispatch plus kernel launch that memory-bound small ops never hide.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` calls (after one warm-up call), seconds."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def sustained_time(fn: Callable[[], object], device: torch.device, seconds: float) -> float:
    """Seconds per call of `fn` run back to back for about `seconds` (after one warm-up call).

    Sustained, not best-of: when ranks share cores (more CPU ranks than cores), a short burst
    can land on an idle core and report a rate no rank keeps up during training."""
    fn()
    sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0:
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return elapsed / calls


def measure_matmul(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best sustained TFLOP/s over square GEMMs (the largest reach the achievable ceiling)."""
    sizes = [256, 512, 1024] if device.type == "cpu" else [2048, 4096, 8192]
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = sustained_time(lambda: a @ b, device, seconds)
        best = max(best, 2 * n**3 / t / 1e12)
    return best


def gemm_shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """(m, n, k) of a transformer layer's GEMMs (module docstring)."""
    tokens, h = (512, 256) if device.type == "cpu" else (8192, 4096)
    return [(tokens, 3 * h, h), (tokens, h, h), (tokens, 4 * h, h), (tokens, h, 4 * h),
            (tokens, h // 2, h)]


def measure_gemm_shapes(device: torch.device, dtype: torch.dtype,
                        seconds: float = 0.2) -> list[dict[str, float]]:
    """Sustained TFLOP/s of each transformer GEMM shape."""
    out = []
    for m, n, k in gemm_shapes(device):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = sustained_time(lambda: a @ b, device, seconds)
        out.append({"m": m, "n": n, "k": k, "tflops": 2.0 * m * n * k / t / 1e12})
    return out


def measure_memory_bandwidth(device: torch.device) -> float:
    """Copy bandwidth (read + write), GB/s."""
    nbytes = 64 * 2**20 if device.type == "cpu" else 1 * 2**30
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), device, repeats=3)
    return 2 * nbytes / t / 1e9


def measure_elementwise(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Achieved GB/s of eager RMSNorm, silu(a)*b and softmax (module docstring)."""
    rows, h = (512, 1024) if device.type == "cpu" else (8192, 8192)
    x = torch.randn(rows, h, device=device, dtype=dtype)
    y = torch.randn(rows, h, device=device, dtype=dtype)
    w = torch.ones(h, device=device, dtype=dtype)
    elt = x.element_size()
    n = x.numel()
    # composite rms_norm (CPU, or 16-bit on some paths) moves more; count the fused passes only,
    # so a slow composite path shows up as lower bandwidth, which is what the model needs
    cases = {
        "rms_norm": (lambda: F.rms_norm(x, (h,), w, 1e-5), 2 * n * elt),
        "silu_mul": (lambda: F.silu(x) * y, 5 * n * elt),
        "softmax": (lambda: torch.softmax(x, dim=-1), 2 * n * elt),
    }
    return {name: nbytes / best_time(fn, device, repeats=5) / 1e9
            for name, (fn, nbytes) in cases.items()}


def measure_kernel_overhead(device: torch.device, calls: int = 200) -> float:
    """Microseconds per tiny eager op issued back to back (dispatch + launch)."""
    x = torch.zeros(1, device=device)

    def burst() -> None:
        for _ in range(calls):
            x.add_(1.0)

    return best_time(burst, device, repeats=3) / calls * 1e6
