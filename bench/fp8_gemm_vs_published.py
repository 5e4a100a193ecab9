"""The planner's FP8 GEMM and float8 Linear against published H100 microbenchmarks (issue 30,
FP8 pattern). Side-by-side ratios only; no timing here, nothing fitted.

Published figures (Meta's H100 machines: 96 GB HBM2e at 2.4 TB/s, 500 W, priced as
bench/published/table.py `grand_teton_h100_500w`; pytorch/ao's roofline_utils.py names the
same variant):

* GEMM only, cuBLASLt tensorwise `torch._scaled_mm` against bf16 `torch.mm`, four Llama-2-70B
  shapes at tp 8 and 16,384 tokens (meta-pytorch/float8_experimental#100, 2023,
  benchmarks/bench_matmul.py): FP8 / bf16 speedup 2.54, 1.94, 2.34, 2.32.
* A whole compiled torchao Float8Linear, forward + backward (three GEMMs and every cast),
  rowwise recipe as torchao runs it (cuBLAS tensorwise kernel + rescale), same shapes
  (pytorch/ao#2185, 2025-05, benchmarks/float8/bench_linear_float8.py, fast accumulation):
  bf16 and FP8 seconds below.

* GEMM only, DeepSeek's blockwise FP8 (1x128 activation / 128x128 weight scales, promoted to
  CUDA cores every 128 k-elements: DeepSeek-V3 report section 3.3.2) on H800 (H100 compute),
  DeepGEMM's first README table (deepseek-ai/DeepGEMM a6d97a1, 2025-02-25, "Normal GEMMs for
  dense models", M = 4096 rows): TFLOP/s of short benchmarks at boost clock, so the planner's
  figure is shown also without its clock-under-load factor (cluster.CLOCK_UNDER_LOAD).

The planner's side: three GEMMs per Linear (compute.cluster_gemm_time, bf16 and at the FP8
peak with cuBLAS's FP8 tiling; DeepGEMM's with blockwise tiling, compute.fp8_tile_scale) and, for the Linear, torchao's compiled rowwise cast bytes (planner/fp8.py
`cast_bytes`) with what a lone Linear cannot fuse: its input and output gradient are leaves
(no producer to take the first read: +2 bytes each) and the input gradient's rescale has no
consumer (its own pass, 2 + 2).

    python bench/fp8_gemm_vs_published.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published.table import grand_teton_h100_500w  # noqa: E402
from meshtron.planner import compute as C  # noqa: E402
from meshtron.planner.cluster import CLOCK_UNDER_LOAD, preset_cluster  # noqa: E402
from meshtron.planner.fp8 import cast_bytes  # noqa: E402

# name: (M, K, N) of the forward, float8_experimental#100 GEMM-only speedup,
# pytorch/ao#2185 (bf16 s, fp8 s) of the compiled Linear forward + backward
PUBLISHED = {
    "attn.wqkv": ((16384, 8192, 1280), 2.544, (0.001954, 0.001757)),
    "attn.w0": ((16384, 1024, 8192), 1.941, (0.001701, 0.001193)),
    "ffn.w13": ((16384, 8192, 7168), 2.344, (0.009871, 0.005707)),
    "ffn.w2": ((16384, 3584, 8192), 2.325, (0.005192, 0.003034)),
}


# (M, N, K): DeepGEMM TFLOP/s
DEEPGEMM = {(4096, 2112, 7168): 1058.0, (4096, 24576, 1536): 990.0, (4096, 32768, 512): 590.0,
            (4096, 7168, 16384): 1358.0, (4096, 4096, 7168): 1304.0, (4096, 7168, 2048): 1025.0}


def predicted(m: int, k: int, n: int) -> tuple[float, float, float]:
    """(bf16 Linear s, FP8 GEMMs s, FP8 casts s) of one Linear's forward + backward."""
    cl = grand_teton_h100_500w(1)
    bf16 = 3 * C.cluster_gemm_time(m, n, k, cl.at_dtype("bf16"))
    cublas = C.fp8_tile_scale(C.KernelOptions())  # torch._scaled_mm: cuBLAS, per-tensor scales
    fp8 = 3 * C.cluster_gemm_time(m, n, k, cl.at_dtype("fp8"), C.FP8, cublas)
    cb = cast_bytes("torchao", "rowwise", compiled=True)
    moved = ((cb.input_fwd + cb.input_bwd + 2.0 + 4.0) * m * k + (cb.grad_bwd + 2.0) * m * n
             + (cb.weight_fwd + cb.weight_bwd + cb.wgrad_out) * n * k)
    return bf16, fp8, moved / C.membound_bytes_per_s(cl, "compiled")


def main() -> int:
    print(f"{'linear':10} {'M,K,N':20} {'GEMM fp8/bf16 speedup':>24} "
          f"{'Linear fwd+bwd speedup':>24} {'bf16 Linear meas/pred':>22}")
    print(f"{'':31} {'published':>11} {'planner':>9} {'published':>13} {'planner':>9}")
    for name, ((m, k, n), gemm_pub, (t_bf16, t_fp8)) in PUBLISHED.items():
        bf16, fp8, casts = predicted(m, k, n)
        print(f"{name:10} {f'{m},{k},{n}':20} {gemm_pub:11.2f} {bf16 / fp8:9.2f} "
              f"{t_bf16 / t_fp8:13.2f} {bf16 / (fp8 + casts):9.2f} {t_bf16 / bf16:16.2f}")
    h800 = preset_cluster("dgx-h100", 1).at_dtype("fp8")
    block = C.fp8_tile_scale(C.KernelOptions(fp8_gemm="blockwise"))
    print(f"\n{'DeepGEMM M,N,K':20} {'published TFLOP/s':>18} {'planner':>8} "
          f"{'planner at boost':>17} {'published/boost':>16}")
    for (m, n, k), tflops in DEEPGEMM.items():
        pred = 2.0 * m * n * k / C.cluster_gemm_time(m, n, k, h800, C.FP8, block) / 1e12
        boost = pred / CLOCK_UNDER_LOAD
        print(f"{f'{m},{n},{k}':20} {tflops:18.0f} {pred:8.0f} {boost:17.0f} "
              f"{tflops / boost:16.2f}")
    return 0


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    raise SystemExit(main())
