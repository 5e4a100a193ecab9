"""Which tensor-core instructions a flash attention kernel issues, and the peak that leaves it on
the GPU it runs on (KernelOptions `flash_isa`). Torch-free.

An Ampere-generation kernel issues the warp-level `mma.sync` (m16n8k16 for bf16): 1024 dense
FMA per clock and SM on A100 (A100 whitepaper: 312 TFLOP/s = 108 SMs x 2048 FLOP x 1.41 GHz).
Hopper doubles the per-SM tensor rate (H100 whitepaper: 989 TFLOP/s = 132 SMs x 4096 FLOP x
1.83 GHz) only for the warpgroup-level asynchronous `wgmma` fed from shared memory; a kernel
compiled to `mma.sync` runs on Hopper at Ampere's per-SM rate, half the datasheet peak. Measured
on H100: FlashAttention-2 (CUTLASS 2 `mma.sync`) reaches at most about 35% of the bf16 peak
(Shah et al. 2024, FlashAttention-3, section 1 and Figures 5-6: 335-370 TFLOP/s forward at
long sequences), i.e. ~70% of that half-rate peak, the same share FlashAttention-2 reaches of
A100's peak (Dao 2023: 73% forward); microbenchmarks of Hopper's tensor-core instructions (mma and wgmma): Luo et al. 2025,
"Dissecting the NVIDIA Hopper Architecture through Microbenchmarking", arXiv 2501.12084.
With context parallelism the ring's per-step calls keep the native pricing
(ring_attention.py): no stack here runs an 'sm80' kernel under context parallelism.

'sm80': llm-foundry's `attn_impl: triton` (llmfoundry/models/layers/flash_attn_triton.py, the
HazyResearch Triton FlashAttention of late 2022, header "only tested on A100"), which needs
`triton-pre-mlir` (Triton 2.0.0.dev20221202 and vchiley's `triton_pre_mlir_sm90` fork that lets
it build for H100): the pre-MLIR compiler lowers `tl.dot` to `mma.sync` only (wgmma came with the
MLIR-based Triton's later Hopper backend). 'native': the core's GEMMs at the GPU's datasheet peak (the
kernel uses the GPU's own instructions, or no figure says otherwise).

flash-attn 2 issues `mma.sync` too, but it is left 'native' on purpose: the GEMM model prices
its causal core below its kernel benchmark on both A100 and H100 (213 TFLOP/s on H100 at
sequence 2048 against FlashAttention-3's measured 298 forward; the unmerged `attn` branch,
docs/measurements.md 2026-12-04), so halving its peak would widen a known gap, not close it.
"""

from __future__ import annotations

import dataclasses

from meshtron.planner.cluster import ClusterSpec, gpu_type

FLASH_ISAS = ("native", "sm80")
"""KernelOptions.flash_isa values (module docstring)."""

SM80_SHARE = {"H": 0.5}
"""Share of the datasheet bf16 peak an `mma.sync` kernel can issue at, by the catalogue GPU's
first letter: Hopper (H100, H200) 0.5 (module docstring). Ampere and older issue at their own
peak; Blackwell is not listed (no published `mma.sync` figure for it): 1."""


def core_cluster(cluster: ClusterSpec, isa: str) -> ClusterSpec:
    """`cluster` as the attention core's GEMMs see it: for an 'sm80' kernel on a GPU whose
    native tensor instructions are faster than `mma.sync` (SM80_SHARE), the peak it can issue
    at; otherwise `cluster` itself. A cluster given by its numbers (no catalogue GPU) is
    unchanged."""
    if isa != "sm80" or cluster.gpu is None:
        return cluster
    share = SM80_SHARE.get(gpu_type(cluster.gpu).name[0], 1.0)
    if share >= 1.0:
        return cluster
    return dataclasses.replace(cluster, peak_tflops=cluster.peak_tflops * share)
