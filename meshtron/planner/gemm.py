"""Time of one GEMM on one GPU (a roofline with tile saturation, or a calibrated cluster's
measured efficiency), the bandwidth memory-bound kernels reach, and the host cost of issuing a
kernel: the timing primitives planner/compute.py prices layers with.

Timing. Each GEMM (m x k) @ (k x n) is timed with a roofline:
    t = max(2mnk / (peak * ceiling * s(m) s(n) s(k)),  2(mk + kn + mn) bytes / HBM bandwidth)
where `ceiling` is the GPU's maximum achievable matmul fraction (cluster.py) and
s(x) = x / (x + d) models tile quantisation and SM under-occupancy of small dimensions: cuBLAS
tiles are 64-256 wide, so on A100 (d = 128) a 1024-wide shard loses about 11% per small dimension
and a 128-wide one (an attention head) about half (e.g. NVIDIA's "Matrix Multiplication
Background" guide on tile and wave quantisation). d grows with the GPU's FLOP-per-byte balance
(`REFERENCE_RIDGE`): about 240 on H100, about 110 on V100. Small per-GPU shards (large tp)
therefore run less efficiently, more so on newer GPUs.
A calibrated cluster (`cluster.gemm_efficiency`, measured by `meshtron calibrate`) replaces the
ceiling and the saturation term by the measured efficiency of the nearest measured shape
(`measured_gemm_efficiency`); the bandwidth bound stays.
Backward runs two GEMMs of the forward's shape per weight (input gradient and weight gradient).
FP8 GEMMs (1-byte operands, bf16 output) run at the FP8 peak with the same model, its widths
counted as the kernels tile them: Hopper's FP8 tiles are as wide in m and n as bf16's and twice
as deep in k, the same 128 bytes per k-step (the cuBLAS kernels profiled on one H200,
bench/results/gpu_check_h200_2026-12-04.json: FP8 nvjet_sm90_qqtst_128x128_128x6 against bf16
nvjet_sm90_tst_128x256_64x4; CUTLASS's Hopper examples: 54_hopper_fp8_warp_specialized_gemm
TileShape 64x128x128 for FP8, 48_hopper_warp_specialized_gemm 128x128x32 for 4-byte TF32). Each operand byte feeds twice the FLOPs at twice the peak, so m
and n saturate at the bf16 width d (in elements); the k loop runs half the steps per element of
k for the same prologue and bf16 epilogue, so k saturates at the width the FP8 balance gives,
2d (`gemm_time` operand_bytes). Published rates agree: cuBLASLt's tensorwise FP8 GEMMs ran
1.94-2.54x bf16's on four training shapes (meta-pytorch/float8_experimental#100), where this
model gives 1.6-1.9x (bench/fp8_gemm_vs_published.py). Blockwise-scaled FP8 GEMMs
(KernelOptions.fp8_gemm 'blockwise': DeepSeek-V3's 1x128 / 128x128 scales, the partial sums
promoted to CUDA cores every 128 k-elements, its report's section 3.3.2) add that promotion
to every k-step of every output tile; DeepGEMM's published throughput (its first README table,
H800, M = 4096: 0.79-1.08 of this) matches m and n saturating at the FP8 balance's width too,
which is how they are priced (`fp8_tile_scale`).
"""

from __future__ import annotations

import math

from meshtron.planner import host
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.kernel_options import KernelOptions
from meshtron.planner.overlap import sm_count

SAT_DIM = 128.0
"""Half-efficiency dimension of the GEMM shape model s(x) = x / (x + d) on the reference GPU."""
REFERENCE_RIDGE = 0.80 * 312e12 / 2.039e12
"""Achieved FLOP per HBM byte of the reference GPU (A100 80GB: its matmul ceiling times peak over
bandwidth) at which SAT_DIM holds. A GEMM tile of width x reuses each operand byte in proportion
to x, so the width at which feeding the tensor cores costs as much as the math grows with the
machine balance: d = SAT_DIM * ridge / REFERENCE_RIDGE (about 240 on H100 SXM, whose peak grew
3.2x over A100 and its bandwidth 1.6x; this is why Hopper kernels use 128x256 tiles)."""
HBM_EFFICIENCY = 0.8
"""Fraction of HBM bandwidth reached by memory-bound elementwise kernels."""
BF16 = 2
"""Bytes per bf16 element."""
FP8 = 1
"""Bytes per FP8 element (e4m3 / e5m2 GEMM operands)."""
DISPATCH_S = 10e-6
"""Host-side cost of issuing one operation from Python (planner/elementwise.py's docstring);
fused stacks issue fewer kernels per layer, Megatron still dispatches them from Python."""


def gemm_time(m: float, n: float, k: float, peak: float, hbm: float,
              operand_bytes: float = BF16, tile_scale: float = 1.0) -> float:
    """Roofline time of an (m x k) @ (k x n) GEMM with `operand_bytes`-byte inputs (BF16, or
    FP8 at the FP8 `peak`) and a bf16 output; `peak` already includes the ceiling. The k width
    follows the machine balance at this peak; m and n saturate at `tile_scale` times it
    (`fp8_tile_scale`: FP8 / BF16 for cuBLAS's FP8 kernels, whose operand bytes feed twice a
    bf16 byte's FLOPs; 1 for bf16 and blockwise FP8; module docstring)."""
    d_k = SAT_DIM * (peak / hbm) / REFERENCE_RIDGE
    d = d_k * tile_scale
    sat = (m / (m + d)) * (n / (n + d)) * (k / (k + d_k))
    t_flops = 2.0 * m * n * k / (peak * sat)
    t_bytes = (operand_bytes * (m * k + k * n) + BF16 * m * n) / hbm
    return t_flops if t_flops > t_bytes else t_bytes


def measured_gemm_efficiency(m: float, n: float, k: float, cluster: ClusterSpec) -> float:
    """Measured fraction of peak of the calibrated shape nearest to (m, n, k).

    Nearest in log space, |log(m/m_i)| + |log(n/n_i)| + |log(k/k_i)|: what costs a GEMM its
    efficiency (tile and wave quantisation, SM occupancy, operand reuse) acts per dimension and
    multiplies (the s(m)s(n)s(k) of the analytical model), so it depends on ratios of dimensions,
    not on differences: a 512-wide shard is as far from a 1024-wide one as 4096 from 8192.
    Nearest-neighbour rather than interpolation: a measured point is never averaged with one
    that runs in a different kernel regime, and a shape in the table gets exactly its measurement.
    """
    lm, ln, lk = math.log(m), math.log(n), math.log(k)
    best = min(cluster.gemm_efficiency,
               key=lambda g: (abs(lm - math.log(g.m)) + abs(ln - math.log(g.n))
                              + abs(lk - math.log(g.k)), -g.efficiency))
    return best.efficiency


def cluster_gemm_time(m: float, n: float, k: float, cluster: ClusterSpec,
                      operand_bytes: float = BF16, tile_scale: float = 1.0) -> float:
    """Time of an (m x k) @ (k x n) GEMM on `cluster` (`operand_bytes`, `tile_scale`: BF16 and
    1, or an FP8 GEMM's on a cluster at its FP8 peak, `gemm_time`): the measured efficiency of
    the nearest calibrated shape when the cluster has a `gemm_efficiency` table (the bandwidth
    bound still applies, for shapes less arithmetic-intense than any measured), else
    `gemm_time`."""
    if cluster.gemm_efficiency is None:
        return gemm_time(m, n, k, cluster.peak_flops * cluster.matmul_ceiling,
                         cluster.hbm_bytes_per_s, operand_bytes, tile_scale)
    t_flops = 2.0 * m * n * k / (cluster.peak_flops * measured_gemm_efficiency(m, n, k, cluster))
    t_bytes = (operand_bytes * (m * k + k * n) + BF16 * m * n) / cluster.hbm_bytes_per_s
    return t_flops if t_flops > t_bytes else t_bytes


def gemm_efficiency(m: float, n: float, k: float, cluster: ClusterSpec) -> float:
    """Fraction of peak the cost model uses for one GEMM shape (for display and tests)."""
    return 2.0 * m * n * k / cluster_gemm_time(m, n, k, cluster) / cluster.peak_flops


def membound_bytes_per_s(cluster: ClusterSpec, stack: str) -> float:
    """Bandwidth memory-bound (non-matmul) kernels reach: the calibrated eager element-wise
    bandwidth for the eager stack when measured, else HBM bandwidth * HBM_EFFICIENCY (fused
    kernels are not what `meshtron calibrate` times, so they keep the streaming figure)."""
    if stack == "eager" and cluster.elementwise_gb_per_s is not None:
        return cluster.elementwise_gb_per_s * 1e9
    return cluster.hbm_bytes_per_s * HBM_EFFICIENCY


CAST_ADD_BYTES_PER_SM = 2.52e12 / 132
"""Bytes/s per SM an eager add of operands of different dtypes reaches (fp32 += bf16: gradient
accumulation into an fp32 buffer). PyTorch's TensorIterator vectorises (8-wide loads:
vectorized_elementwise_kernel<8, ...>) only when every operand has the result's dtype; otherwise
it runs unrolled_elementwise_kernel with a cast per element, whose narrower loads keep fewer
bytes in flight per SM, so by Little's law its rate is bytes in flight over the memory latency
per SM, not the HBM's. Measured on one H200 (132 SMs; bench/results/gpu_check_h200_2026-12-04
.json, top kernels of the eager and compile cases): unrolled_elementwise_kernel
<CUDAFunctor_add<float>> 191.7 / 194.0 ms per step for the 7 accumulating adds of 6.94e9
parameters (4 + 2 bytes read, 4 written: 486 GB), 2.50-2.53 TB/s, 0.52 of its HBM (the
same-dtype bf16 adds of that profile: about 0.7). Other GPUs: the same rate per SM (HBM latency
is alike from A100 to H200), capped by the streaming bandwidth (`cast_add_bytes_per_s`): an
A100's 108 SMs would reach 2.06 TB/s, above its 0.8 x 2.04, so there it streams."""


def cast_add_bytes_per_s(cluster: ClusterSpec) -> float:
    """Bandwidth of an eager add across dtypes (CAST_ADD_BYTES_PER_SM times the SMs), at most
    what streaming kernels reach (HBM_EFFICIENCY)."""
    return min(cluster.hbm_bytes_per_s * HBM_EFFICIENCY,
               sm_count(cluster) * CAST_ADD_BYTES_PER_SM)


def dispatch_s(cluster: ClusterSpec) -> float:
    """Host cost of issuing one kernel in a training forward: the calibrated
    `eager_kernel_overhead_us` (a no-grad op) with autograd's recording (host.AUTOGRAD_RECORD),
    else DISPATCH_S."""
    if cluster.eager_kernel_overhead_us is not None:
        return cluster.eager_kernel_overhead_us * 1e-6 * host.AUTOGRAD_RECORD
    return DISPATCH_S


def fp8_tile_scale(opts: KernelOptions, backward: bool = False) -> float:
    """Saturation width of an FP8 GEMM's m and n over its k width (`gemm_time` tile_scale):
    FP8 / BF16 for cuBLAS's per-tensor / per-row scaled kernels with fast accumulation (their
    tiles are bf16's, fed at half the bytes), 1 where the kernel promotes its partial sums out
    of the tensor cores every few k-steps: blockwise scaling (the per-128-k promotion on CUDA
    cores: DeepGEMM's published throughput, module docstring) and, with
    `opts.fp8_split_accum_bwd`, the two `backward` GEMMs (input and weight gradient) of the
    cuBLAS kind, which torchao and Transformer Engine run without fast accumulation
    (KernelOptions.fp8_split_accum_bwd cites both): the same promotion of the accumulator,
    DeepSeek-V3 report section 3.3.2."""
    if opts.fp8_gemm == "blockwise" or (backward and opts.fp8_split_accum_bwd):
        return 1.0
    return FP8 / BF16


def gemm_group(tokens: float, n: float, k: float, fp8_cl: ClusterSpec, bf16_cl: ClusterSpec,
                frac: dict[str, float] | None, group: str, split_n: bool,
                kernel: tuple[float, float] = (BF16, 1.0)) -> float:
    """One fused block GEMM [tokens, k] x [k, n]: at `fp8_cl`'s peak with `kernel` =
    (operand bytes, tile scale) (`gemm_time`; FP8's for dtype fp8) when `frac` is None (or all
    of its Linears are FP8), else split into its FP8 and bf16 parts (along n for the
    column-parallel fused QKV / MLP-up, whole for the single-Linear groups)."""
    f = 1.0 if frac is None else frac[group]
    if f >= 1.0:
        return cluster_gemm_time(tokens, n, k, fp8_cl, *kernel)
    if f <= 0.0:
        return cluster_gemm_time(tokens, n, k, bf16_cl)
    if not split_n:  # pragma: no cover - a one-Linear group is all or nothing
        raise AssertionError(group)
    return (cluster_gemm_time(tokens, n * f, k, fp8_cl, *kernel)
            + cluster_gemm_time(tokens, n * (1.0 - f), k, bf16_cl))

