"""torchao's float8 rowwise Linear against its own published H100 table (side-by-side ratios,
nothing timed here): what a compiled rowwise Float8Linear costs beyond the roofline's casts.

Published: pytorch/ao torchao/float8/README.md "Performance / Rowwise scaling", the image
docs/static/fp8-rowwise-perf.png (at 6243040, the torchao commit of torchtitan's June 2025
async-TP benchmark): speedup of LayerNorm -> Linear -> Sigmoid, forward + backward, compiled,
dynamic rowwise scaling against bf16, PyTorch 2.8.0a0, H100, by the forward's M, K, N
(benchmarks/float8/float8_roofline.py --shape_gen_name sweep). Transcribed below for M >= 4096.

The planner's side of each cell: the layer norm (its forward and backward, 10 bytes per input
element), the sigmoid (10 per output element), the three GEMMs (bf16; FP8: the forward with
fast accumulation, the two backward ones without, compute.fp8_tile_scale) and torchao's
compiled rowwise cast bytes (planner/fp8.py `cast_bytes`) on Meta's 500 W H100
(bench/published/table.py `grand_teton_h100_500w`, as bench/fp8_gemm_vs_published.py).
The time the published speedup implies beyond that, per element of the Linear's input, is
what fp8.ROWWISE_COMPILED_EXCESS charges (the median over M >= 8192; it grows with M x K and
hardly with N, the input's size: column "excess").

    python bench/fp8_rowwise_vs_published.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published.table import grand_teton_h100_500w  # noqa: E402
from meshtron.planner import compute as C  # noqa: E402
from meshtron.planner.fp8 import ROWWISE_COMPILED_EXCESS, cast_bytes  # noqa: E402

N_COLS = (1024, 2048, 4096, 8192, 16384, 32768)
# M -> K -> speedup for N in N_COLS
TABLE = {
    4096: {1024: (.45, .47, .57, .66, .72, .76), 2048: (.43, .53, .70, .83, .90, .91),
           4096: (.44, .64, .84, 1.01, 1.01, 1.04), 8192: (.53, .72, .91, 1.01, 1.07, 1.13),
           16384: (.53, .74, .92, 1.05, 1.10, 1.18), 32768: (.54, .75, .93, 1.02, 1.17, 1.18)},
    8192: {1024: (.48, .52, .65, .77, .83, .84), 2048: (.45, .64, .82, 1.01, 1.03, 1.06),
           4096: (.52, .76, 1.00, 1.13, 1.17, 1.19), 8192: (.59, .85, 1.05, 1.20, 1.31, 1.41),
           16384: (.58, .82, 1.03, 1.22, 1.37, 1.40), 32768: (.59, .82, 1.04, 1.30, 1.36, 1.46)},
    16384: {1024: (.48, .58, .73, .86, .85, .89), 2048: (.51, .70, .90, 1.05, 1.07, 1.15),
            4096: (.57, .79, 1.02, 1.20, 1.26, 1.40), 8192: (.61, .87, 1.08, 1.33, 1.39, 1.49),
            16384: (.59, .83, 1.07, 1.34, 1.42, 1.55),
            32768: (.60, .85, 1.16, 1.35, 1.48, 1.72)},
    32768: {1024: (.51, .62, .77, .87, .88, .94), 2048: (.54, .73, .91, 1.08, 1.14, 1.27),
            4096: (.59, .81, 1.04, 1.28, 1.35, 1.49), 8192: (.63, .87, 1.11, 1.41, 1.50, 1.62),
            16384: (.60, .83, 1.16, 1.39, 1.49, 1.73),
            32768: (.63, .93, 1.16, 1.48, 1.70, 1.52)},
}


def cells() -> list[tuple[int, int, int, float]]:
    """(M, K, N, published speedup) of every transcribed cell."""
    return [(m, k, n, s) for m, ks in TABLE.items() for k, row in ks.items()
            for n, s in zip(N_COLS, row)]


def layer_times(m: int, k: int, n: int) -> tuple[float, float, float]:
    """(bf16 s, FP8 s without the measured excess, bytes/s of the casts) of the benchmark's
    LayerNorm -> Linear -> Sigmoid forward + backward, as the planner prices it."""
    cl = grand_teton_h100_500w(1)
    bw = C.membound_bytes_per_s(cl, "compiled")
    opts = C.KernelOptions()
    fast, slow = C.fp8_tile_scale(opts), C.fp8_tile_scale(opts, backward=True)
    fp8 = cl.at_dtype("fp8")
    norm_sigmoid = (10.0 * m * k + 10.0 * m * n) / bw
    bf16 = norm_sigmoid + 3 * C.cluster_gemm_time(m, n, k, cl.at_dtype("bf16"))
    gemms = (C.cluster_gemm_time(m, n, k, fp8, C.FP8, fast)
             + C.cluster_gemm_time(m, k, n, fp8, C.FP8, slow)
             + C.cluster_gemm_time(n, k, m, fp8, C.FP8, slow))
    cb = cast_bytes("torchao", "rowwise", compiled=True)
    moved = ((cb.input_fwd + cb.input_bwd - ROWWISE_COMPILED_EXCESS) * m * k
             + cb.grad_bwd * m * n + (cb.weight_fwd + cb.weight_bwd + cb.wgrad_out) * n * k)
    return bf16, norm_sigmoid + gemms + moved / bw, bw


def main() -> int:
    print(f"{'M':>6} {'K':>6} {'N':>6} {'published':>9} {'roofline':>9} {'planner':>8} "
          f"{'excess B/elem':>14}")
    implied = []
    for m, k, n, pub in cells():
        bf16, fp8, bw = layer_times(m, k, n)
        excess = (bf16 / pub - fp8) * bw / (m * k)
        if m >= 8192:
            implied.append(excess)
        with_excess = fp8 + ROWWISE_COMPILED_EXCESS * m * k / bw
        print(f"{m:6} {k:6} {n:6} {pub:9.2f} {bf16 / fp8:9.2f} {bf16 / with_excess:8.2f} "
              f"{excess:14.1f}")
    q = statistics.quantiles(implied, n=4)
    print(f"\nexcess per input element, M >= 8192 ({len(implied)} cells): median "
          f"{statistics.median(implied):.1f} bytes (quartiles {q[0]:.1f}, {q[2]:.1f}); "
          f"fp8.ROWWISE_COMPILED_EXCESS = {ROWWISE_COMPILED_EXCESS}")
    return 0


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    raise SystemExit(main())
