"""One rank of a plan, run alone: a fake process group, the runtime's own build, one step.

`rehearse_rank(spec, plan, rank, device)` joins a fake process group of `plan.gpus` ranks as
`rank` (torch's `fake` backend: every collective and point-to-point returns at once, buffers
untouched), builds the mesh with `build_mesh`, the model on meta, shards it with the runtime's
`parallelize` and `build_optimizer` (the same `Plan`, placement and code `meshtron train`
runs), then runs one optimizer step at the plan's shapes:

* on CPU nothing is allocated: sharding runs outside FakeTensorMode (DeviceMesh and DTensor
  build real index tensors while they shard), the shards are materialized under it, and
  torch's memory tracker (`FSDPMemTracker`, or `MemTracker` when a rank holds several pipeline
  stages or no FSDP unit) records the peak by category;
* on CUDA the tensors are real: the allocator's peak and the step's compute time (the fake
  collectives take no time, so the step is compute-only).

Without a pipeline the step is the runtime's `ParallelModel.forward_backward`; a pipelined
rank's stages run directly in its schedule's order (pipeline_step.py).

A mixture of experts routes by value (bincount, uneven all-to-all splits), which fake
tensors cannot size: every MoE layer gets a `StaticCounts` policy (meshtron/model/moe.py), the
mean T*k/E tokens per expert, or `imbalance` times it on the rehearsed rank's experts (the
planner's `expert_imbalance`: the fullest ep rank), and runs the kernel a GPU run uses (one
`torch._grouped_mm` per matrix in bf16). The router itself runs.

AdamW's states are created before the measured step (one step on zero gradients), so the
peak is a steady-state step's: states, gradients and the step's working set together. On CPU
the step runs the fewest of its micro-batches that reach the same peak (microbatches.py: every
micro-batch has the same shapes; `exact=True` runs them all), a pipelined stage holds one
receive buffer per micro-batch of the step, as torch's PipelineStage does (pipeline_step.py),
and the tracker's own hooks on a micro-batch's graph are emptied after its backward, which
otherwise keep a split backward's saved tensors to the end of the step (tracker_hooks.py).

By responsibility: this module builds the rank (fake group, mesh, shards, routing); step.py
primes the optimizer, runs and measures the step; pipeline_step.py runs a pipelined rank's
stages; memory.py holds the tracker and its categories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from meshtron.rehearse.memory import CATEGORIES, make_tracker
from meshtron.rehearse.step import measured_step, prime_optimizer

__all__ = ["CATEGORIES", "GIB", "rehearse_rank"]

GIB = float(2**30)

EAGER_NOTE = ("not rehearsed: torch.compile does not trace under the memory tracker (a "
              "TorchDispatchMode; dynamo skips every frame with 'non-infra torch dispatch mode "
              "present, this is not supported today in torch.compile' and the blocks' "
              "fullgraph compile fails), so the blocks ran eagerly and the figures are what "
              "eager holds")
"""Why a compiled plan's fake-tensor rehearsal runs its blocks eagerly (torch 2.13)."""


def _fake_group(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # never replace a group someone else made
        raise RuntimeError("rehearse: torch.distributed is already initialised in this "
                           "process; rehearse in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _static_routing(parts, imbalance: float, dtype: str) -> None:
    """Fix every MoE layer's tokens per expert on the host (module docstring)."""
    from meshtron.model.moe import MoE, StaticCounts

    for part in parts:
        for module in part.modules():
            if not isinstance(module, MoE):
                continue
            d = module.dispatcher
            hot = None if d is None else (d.rank * d.local, (d.rank + 1) * d.local)
            module.counts_policy = StaticCounts(imbalance, hot)
            if dtype != "fp32" and hasattr(torch, "_grouped_mm"):  # a bf16 GPU run's kernel
                module.experts.kernel = "grouped"


def _gpu_embedding_kernel(parts) -> None:
    """A GPU run's embedding backward (PyTorch's kernel, which sums in fp32 itself) instead of
    the CPU's fp32-sum path and its [vocab, hidden] fp32 buffer (meshtron/model/embedding.py)."""
    from meshtron.model.embedding import Embedding

    for part in parts:
        for module in part.modules():
            if isinstance(module, Embedding):
                module.kernel = "pytorch"


def _gpu_fp8_kernels(parts, recipe: str) -> None:
    """Fake tensors run what an FP8 GPU run does. Every torchao Float8Linear's scaled matmuls
    switch from CPU emulation to `torch._scaled_mm` (whose meta kernel gives the bf16
    output's shape; nothing is computed): emulation (torchao float8_ops.py `float8_mm`:
    `torch.mm(a._data.float() / a._scale, ...)`) makes fp32 copies of both operands and an
    fp32 product no GPU run holds (at the test table's sizes the peak was the same either
    way: it sits in a cast, not a GEMM). And a Linear converted only because emulation
    converts every aligned one (parallel/fp8.py) runs in bf16 as on a GPU, where it is below
    torchao's size thresholds (planner/fp8.py `fp8_gemm`): its casts are disabled, so
    torchao multiplies the bf16 operands it saves anyway (float8_linear.py
    `matmul_with_hp_or_float8_args`)."""
    try:
        from torchao.float8.config import CastConfig, ScalingType
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:  # no fp8 plan without torchao (parallel/fp8.py refuses first)
        return
    from meshtron.planner.fp8 import fp8_gemm

    off = CastConfig(scaling_type=ScalingType.DISABLED)
    casts = ("input", "weight", "grad_output", "input_for_grad_weight",
             "weight_for_grad_input", "grad_output_for_grad_weight")
    for part in parts:
        for module in part.modules():
            if not isinstance(module, Float8Linear):
                continue
            module.linear_mm_config = type(module.linear_mm_config)(
                *(c._replace(emulate=False) for c in module.linear_mm_config))
            if not fp8_gemm(*module.weight.shape, recipe):  # global shape, as converted
                module.config = dataclasses.replace(
                    module.config, **{f"cast_config_{c}": off for c in casts})


def rehearse_rank(spec, plan, rank: int, device: str = "cpu", imbalance: float = 1.0,
                  real: bool | None = None, exact: bool = False) -> dict[str, Any]:
    """Run one step of global rank `rank` of `plan` (a validated Plan with global_batch and
    seq_len) for model `spec`; returns {"rank", "pp_rank", "stages", "peak_bytes": {category:
    bytes, "total": bytes}, "wall_s", and with real tensors "step_s"}. `imbalance`: a mixture
    of experts' load on this rank's experts over the mean (module docstring). `real`: real
    tensors (default: on CUDA only); real on the CPU runs the GPU path's code at a toy size
    (timed step, and the tracker's peak: the CPU has no allocator statistics). The tracked
    step runs the fewest micro-batches that reach its peak (microbatches.py), all of them with
    `exact`; a timed step always runs them all."""
    from meshtron.model import Transformer
    from meshtron.model.init import materialize
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.train.parallel import runtime_plan

    start = time.perf_counter()
    torch.set_num_threads(1)
    _fake_group(rank, plan.gpus)
    mesh = None
    try:
        rt = runtime_plan(plan, plan.dtype)
        eager = (rt.compile or rt.async_tp) and device == "cpu"  # where the tracker runs
        if eager:  # the tracker is a dispatch mode, which torch.compile refuses (EAGER_NOTE)
            rt = dataclasses.replace(rt, compile=False, async_tp=False)
        mesh = build_mesh(rt, device_type=device, spec=spec)
        with torch.device("meta"):
            model = Transformer(spec)
        real = device != "cpu" if real is None else real
        pm = parallelize(model, rt, mesh, allocate=False)
        if spec.is_moe:
            _static_routing(pm.model_parts, imbalance, plan.dtype)
        if device == "cpu":
            _gpu_embedding_kernel(pm.model_parts)
        if plan.dtype == "fp8" and not real:
            _gpu_fp8_kernels(pm.model_parts, rt.fp8_recipe)
        dev = torch.device("cpu") if device == "cpu" else pm.device
        mode = contextlib.nullcontext() if real else _fake_mode()
        with mode:
            # real tensors get the product's initialization (uninitialized memory may hold
            # NaNs, and a MoE router's choices follow the values); fake ones hold nothing
            materialize(pm.model_parts, dev, fill=None if real else _keep_empty)
            optimizer = build_optimizer(pm, lr=1e-4)
            tracker = make_tracker(pm, optimizer) if dev.type == "cpu" else None
            with tracker or contextlib.nullcontext():  # the tracker sees the states made
                prime_optimizer(pm, optimizer)
            local = plan.global_batch // plan.dp
            tokens = torch.randint(0, spec.vocab, (local, plan.seq_len), device=dev)
            targets = torch.randint(0, spec.vocab, (local, plan.seq_len), device=dev)
            result = measured_step(pm, rt, spec, dev, optimizer, tokens, targets, tracker,
                                    real, exact)
        if eager:
            result["compile"] = EAGER_NOTE
        result.update(rank=rank, pp_rank=mesh.get_local_rank("pp"), stages=pm.stage_ids,
                      layers=sum(len(p.layers) for p in pm.model_parts))
    finally:
        if mesh is not None:  # and DTensor's caches of it: a second rehearsal in this process
            from meshtron.parallel.mesh import release_mesh  # would get its dead groups

            release_mesh(mesh)
        dist.destroy_process_group()
    result["wall_s"] = time.perf_counter() - start
    return result


def _keep_empty(parts) -> None:
    """materialize's fill: leave the fake shards uninitialized (nothing to compute)."""


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)

