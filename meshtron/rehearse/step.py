"""The rehearsed rank's optimizer step: AdamW's states primed, one step run (the runtime's
`forward_backward`, or pipeline_step.py's stages in schedule order), its peak read from the
tracker (fake tensors) or the CUDA allocator, and with real tensors its time."""

from __future__ import annotations

import time
from typing import Any

import torch

from meshtron.rehearse.memory import OFFLOADED, categories, state_bytes
from meshtron.rehearse.pipeline_step import pipelined_step


def prime_optimizer(pm, optimizer) -> None:
    """Create AdamW's states (one step on zero gradients), then drop the gradients."""
    for p in pm.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


def _step(pm, plan, spec, dev, optimizer, tokens, targets, exact: bool = True,
          hooks=None, tracker=None) -> int:
    """One optimizer step; returns the micro-batches run. `hooks`: the tracker's module
    tracker (tracker_hooks.py), whose hooks on each micro-batch's graph are released after
    its backward. `tracker`: with host offload its peak is paused while the optimizer steps
    (on the host)."""
    held = None
    if pm.is_pipelined:
        if plan.cp > 1:
            from meshtron.parallel.context import shard_batch

            shard = shard_batch(tokens, targets, plan.cp, pm.mesh.get_local_rank("cp"))
            tokens, targets = shard.tokens, shard.targets
        # the stages' receive buffers live to the next step: through the optimizer's
        n_run, held = pipelined_step(pm, plan, spec, dev, tokens, targets, exact, hooks)
    else:
        rows = tokens.shape[0]
        if not exact:  # the first, a middle and the last micro-batch (microbatches.py)
            from meshtron.rehearse.microbatches import accumulation_microbatches

            rows = accumulation_microbatches(rows // plan.micro_batch) * plan.micro_batch
        pm.forward_backward(tokens[:rows], targets[:rows])
        n_run = rows // plan.micro_batch
    host = tracker is not None and tracker.host is not None
    if host:
        tracker.on_host = True
    optimizer.step()
    optimizer.zero_grad()
    if host:
        tracker.on_host = False
    del held
    return n_run


def measured_step(pm, plan, spec, dev, optimizer, tokens, targets, tracker, real,
                   exact: bool = False) -> dict:
    """The step's peak: the tracker's (entering it again starts its peak from what is held
    now), or on CUDA the allocator's; with real tensors also the step's time after one
    warm-up step."""
    out = _timed_step(pm, plan, spec, dev, optimizer, tokens, targets) if real else {}
    if tracker is not None:
        states = state_bytes(optimizer)
        offloaded = getattr(plan, "offload", "none") == "full"
        if offloaded:  # the device's peak leaves out what CPUOffloadPolicy keeps on the host
            tracker.host = (OFFLOADED, states)
        with tracker:
            n_run = _step(pm, plan, spec, dev, optimizer, tokens, targets, exact,
                          getattr(tracker, "_mod_tracker", None), tracker)
        peak = categories(tracker.get_tracker_snapshot("peak"), OFFLOADED if offloaded else ())
        # AdamW's states live through the whole step, so they are in the peak; the tracker
        # files the states of the runtime's per-part optimizers as temporaries (it hooks only
        # the optimizer it is given): moved to their category, by their exact bytes
        moved = max(0.0, states - peak["optimizer"])
        peak["optimizer"] += moved
        peak["temporaries"] = max(0.0, peak["temporaries"] - moved)
        if offloaded:  # ...or, offloaded, out of the device's peak (in host memory)
            peak["total"] -= peak["optimizer"]
            peak["optimizer"] = 0.0
        what = "real" if real else "fake"
        if hasattr(tracker, "peak_at"):
            out["peak_at"] = tracker.peak_at()
        out.update(peak_bytes=peak, measured=f"{what} tensors, torch memory tracker"
                   + (", step timed" if real else ""), microbatches_run=n_run)
    return out


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_step(pm, plan, spec, dev, optimizer, tokens, targets) -> dict:
    """One warm-up step (kernels, allocator), then one timed step of every micro-batch; on
    CUDA the allocator's peak of the timed one."""
    _sync(dev)
    _step(pm, plan, spec, dev, optimizer, tokens, targets)
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    _step(pm, plan, spec, dev, optimizer, tokens, targets)
    _sync(dev)
    out: dict[str, Any] = {"step_s": time.perf_counter() - t0}
    if dev.type == "cuda":
        out.update(peak_bytes={"total": float(torch.cuda.max_memory_allocated(dev))},
                   measured="CUDA allocator peak, compute-only step (collectives return at "
                            "once)")
    return out

