"""The launch-bound note of `meshtron plan`: when the best plan's layers spend a visible share of
their time with the GPU waiting on the host's kernel launches (planner/host.py), say so and
what recovers it.

Apart from host.py because it prices layers (compute.py), which itself imports host.py: kept
here, the two form no import circle."""

from __future__ import annotations

import dataclasses

from meshtron.planner import compute, fp8_amax

NOTE_SHARE = 0.10
"""Launch-bound share of the layers' time from which the note is shown (below it, the
difference is inside the planner's usual error)."""


def launch_share(result) -> float:
    """Share of the best plan's per-layer forward + backward time the GPU waits on kernel
    launches: 1 - device time / time, the device time being the same layer with (almost) free
    launches. 0 without a plan."""
    best = result.best
    if best is None:
        return 0.0
    cfg, cl = best.config, result.cluster
    model = compute.active_equivalent(result.model)
    free = dataclasses.replace(cl, eager_kernel_overhead_us=1e-6)
    args = (cfg.tp, cfg.micro_batch, result.seq_len, cfg.sp, result.options, cfg.cp, cfg.dtype)
    share = fp8_amax.mlp_amax_share(result.model)  # the real model's, as estimate_pieces
    real = compute.layer_cost(model, cl, *args, amax_mlp_share=share)
    dev = compute.layer_cost(model, free, *args, amax_mlp_share=share)
    total = real.fwd + real.bwd
    return 1.0 - (dev.fwd + dev.bwd) / total if total > 0 else 0.0


def launch_note(result) -> str | None:
    """One line for `meshtron plan` (a SearchResult) when the best plan is launch-bound by at
    least NOTE_SHARE of its layers' time; None otherwise."""
    share = launch_share(result)
    if share < NOTE_SHARE:
        return None
    cfg = result.best.config
    n = compute.kernels_per_layer(result.model, result.options)
    us = compute.dispatch_s(result.cluster) * 1e6
    return (f"the GPU waits on kernel launches for {share:.0%} of the layers' time: at "
            f"micro-batch {cfg.micro_batch} x {result.seq_len} tokens (tp={cfg.tp}) the "
            f"{n} kernels of a layer's forward run shorter than the ~{us:.0f} us the host "
            "takes to launch each; a larger micro-batch, fewer kernels (--compile, a fused "
            "stack) or CUDA graphs recover it")
