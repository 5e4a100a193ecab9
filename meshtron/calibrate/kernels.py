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

Every figure is timed the same way (`repeat_times`, stats.py): a warm-up, then 10 blocks of
back-to-back calls; the figure is the lower quartile of the per-call times and the spread (their
interquartile range / median) goes with it, so a figure measured under outside load says so.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from meshtron.calibrate.stats import MIN_REPEATS, REPEATS, Timing, summarize


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def repeat_times(fn: Callable[[], object], device: torch.device, seconds: float,
                 repeats: int = REPEATS, timer: Callable[[], float] = time.perf_counter
                 ) -> list[float]:
    """Seconds per call of `fn` in each of `repeats` blocks of back-to-back calls, about
    `seconds` in all (stats.py: the practice of torch.utils.benchmark's blocked_autorange and
    triton's do_bench). One sync per block, so neither the timer's resolution nor the sync is
    timed on small kernels. `timer`: injected by tests.

    Warm-up: blocks of 1, then up to 10x more calls, until one lasts half a block's share of
    `seconds`; that block's mean sets the calls of every timed block. Not one probe call: on a
    loaded machine a single call can run 10-100x faster than the rest, and blocks sized from
    it overran the budget 10x. Past 3x `seconds` (a machine that slowed down meanwhile), the
    repeats so far are kept, at least MIN_REPEATS."""
    fn()  # first call: allocation, dispatch caches, thread-pool start
    sync(device)
    target = seconds / repeats
    calls = 1
    while True:
        per_call, block = _block(fn, device, calls, timer)
        if block >= target / 2:
            break
        calls = min(10 * calls, max(calls + 1, round(target / per_call)))
    calls = max(1, round(target / per_call))
    times, start = [], timer()
    while len(times) < repeats:
        times.append(_block(fn, device, calls, timer)[0])
        if len(times) >= MIN_REPEATS and timer() - start > 3 * seconds:
            break
    return times


def _block(fn: Callable[[], object], device: torch.device, calls: int,
           timer: Callable[[], float]) -> tuple[float, float]:
    """(seconds per call, seconds) of `calls` back-to-back calls and one sync."""
    t0 = timer()
    for _ in range(calls):
        fn()
    sync(device)
    elapsed = max(timer() - t0, 1e-12)
    return elapsed / calls, elapsed


def measure(fn: Callable[[], object], device: torch.device, seconds: float) -> Timing:
    """The figure (lower-quartile time per call) and spread of `fn`'s repeats."""
    return summarize(repeat_times(fn, device, seconds))


def measure_matmul(device: torch.device, dtype: torch.dtype,
                   seconds: float = 0.3) -> tuple[float, float]:
    """(TFLOP/s, spread) of the fastest square GEMM (the largest reach the achievable
    ceiling)."""
    sizes = [256, 512, 1024] if device.type == "cpu" else [2048, 4096, 8192]
    rates = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = measure(lambda: a @ b, device, seconds)
        rates.append((2 * n**3 / t.seconds / 1e12, t.spread))
    return max(rates)


def gemm_shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """(m, n, k) of a transformer layer's GEMMs (module docstring)."""
    tokens, h = (512, 256) if device.type == "cpu" else (8192, 4096)
    return [(tokens, 3 * h, h), (tokens, h, h), (tokens, 4 * h, h), (tokens, h, 4 * h),
            (tokens, h // 2, h)]


def measure_gemm_shapes(device: torch.device, dtype: torch.dtype,
                        seconds: float = 0.2) -> list[dict[str, float]]:
    """TFLOP/s and spread of each transformer GEMM shape."""
    out = []
    for m, n, k in gemm_shapes(device):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = measure(lambda: a @ b, device, seconds)
        out.append({"m": m, "n": n, "k": k, "tflops": 2.0 * m * n * k / t.seconds / 1e12,
                    "spread": t.spread})
    return out


def measure_memory_bandwidth(device: torch.device, seconds: float = 0.2) -> tuple[float, float]:
    """(copy bandwidth (read + write) GB/s, spread)."""
    nbytes = 64 * 2**20 if device.type == "cpu" else 1 * 2**30
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), device, seconds)
    return 2 * nbytes / t.seconds / 1e9, t.spread


def measure_elementwise(device: torch.device, dtype: torch.dtype,
                        seconds: float = 0.1) -> dict[str, tuple[float, float]]:
    """(achieved GB/s, spread) of eager RMSNorm, silu(a)*b and softmax (module docstring)."""
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
    out = {}
    for name, (fn, nbytes) in cases.items():
        t = measure(fn, device, seconds)
        out[name] = (nbytes / t.seconds / 1e9, t.spread)
    return out


def measure_kernel_overhead(device: torch.device, seconds: float = 0.1) -> tuple[float, float]:
    """(microseconds per tiny eager op issued back to back (dispatch + launch), spread): a
    block of `repeat_times` is such a run of calls, synced once."""
    x = torch.zeros(1, device=device)
    t = measure(lambda: x.add_(1.0), device, seconds)
    return t.seconds * 1e6, t.spread
