"""Tolerances of bf16 runs (and emulated FP8, whose matmuls compute in bf16) against their
one-process reference, derived from bf16 arithmetic instead of read off one machine.

bf16 keeps 8 significant bits: one rounding moves a value by at most U = 2^-8 (3.9e-3) of it.
Which way a value rounds depends on the fp32 bits before the rounding, and those depend on the
order of every fp32 sum before it: GEMM blocking (vector width, thread count) and the order in
which ranks reduce. So the same bf16 computation can come out one rounding apart on another
machine, or on another layout. The tolerances:

- Step 1, layouts that run the reference's bf16 operations on the same rows (data and pipeline
  parallelism, in the reference's micro-batches): the weights are equal (fp32 master = the
  same deterministic init, so the same bf16 copy), every bf16 operation has the same inputs
  and shapes, and the reference runs with the ranks' one thread (`one_thread`), so the GEMMs
  block alike; only the fp32 accumulation of gradients over micro-batches and ranks differs:
  fp32 order, held to 1e-5 like every fp32 layout. This is what catches a precision bug (a
  bf16 reduction, fp32 compute, a missing cast): they show at step 1 by 1e-4 and more.
- Later steps: the fp32 master weights differ by that fp32 order (~1e-7 relative), which flips
  the bf16 rounding of the few weights that sit within that distance of a rounding boundary;
  such a weight moves by one rounding, and every value computed from it by at most one
  rounding more. Losses and gradient norms are sums of positive terms, each within a rounding
  of the reference's, and each step adds its own roundings to a stable run: step k within
  k*U relative (what `meshtron train` shows over 12 steps: tests/test_cli_issue28.py).
- Parameters (the fp32 master weights, the optimizer's own): within one bf16 rounding of the
  tensor's largest weight, U relative in `compare`'s metric (max |diff| / max |ref|): a
  gradient moved by a rounding moves AdamW's update of that element by at most that much of
  its lr-sized step. Measured: 1e-7 here, 7.5e-4 on the machine of issue 28.
- Tensor parallelism adds its bf16 partial sums (the row-parallel all-reduce in bf16) from
  step 1: losses and norms within U at step 1, k*U at step k; parameters can move by up to 2 lr per step
  where a rounding flips the sign of a near-zero gradient (AdamW's first steps turn any
  gradient into +-lr): held to TP_PARAM (measured 1.4e-2 and 1.45e-2 on two machines).
"""

from __future__ import annotations

import contextlib
from typing import Any

U = 2.0 ** -8
"""bf16 unit roundoff."""
FP32_ORDER = 1e-5
"""fp32 summation-order tolerance of every fp32 layout (tests/test_parallel.py TOL)."""
TP_PARAM = 5e-2
"""Parameter tolerance under tensor parallelism (sign flips of near-zero gradients)."""


@contextlib.contextmanager
def one_thread():
    """Run the one-process reference with the ranks' single thread (testkit/multiproc.py sets
    OMP_NUM_THREADS=1 on every rank): the same GEMM blocking, so the same bf16 roundings at
    step 1, on any machine."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def problems(layout: dict[str, Any], per_rank: list[dict[str, Any]], ref: dict[str, Any],
             report_row: dict[str, Any], same_ops: bool | None = None) -> list[str]:
    """Why a bf16 layout's results are off its reference by more than the bounds above
    (empty when within). `per_rank`: this layout's result from every rank
    (testkit.equivalence.parallel_rank_fn); `report_row`: its `compare` row; `same_ops`: the
    layout runs the reference's bf16 operations (default: unless tensor parallel; False for
    compiled blocks, whose fused kernels round once where eager rounds per op, like tensor
    parallelism's partial sums)."""
    tp = not same_ops if same_ops is not None else layout.get("tp", 1) > 1
    out = []
    for r in per_rank:
        for name in ("losses", "norms"):
            for step, (a, b) in enumerate(zip(r[name], ref[name]), 1):
                tol = FP32_ORDER if step == 1 and not tp else step * U
                rel = abs(a - b) / abs(b)
                if rel > tol:
                    out.append(f"{name[:-1]} at step {step}: {rel:.2e} > {tol:.1e}")
    limit = TP_PARAM if tp else U
    if report_row["param_rel"] > limit:
        out.append(f"parameter {report_row['worst_param']}: {report_row['param_rel']:.2e} > "
                   f"{limit:.1e}")
    if report_row["missing"] or report_row["extra"]:
        out.append(f"parameters missing {report_row['missing']} / extra {report_row['extra']}")
    return out
