"""Per-block `torch.compile` (plan.compile, `meshtron train --compile`).

Applied as torchtitan's `apply_compile` does (torchtitan/models/llama3/infra/parallelize.py):
each transformer block is compiled on its own, after tensor parallelism and activation
checkpointing (the block may be a `CheckpointWrapper`: the recomputation is traced with it)
and before FSDP2 (whose hooks on the block stay outside the graph: FSDP2 wraps them in
`torch._dynamo.disable`, torch/distributed/fsdp/_fully_shard/_fsdp_common.py `_dynamo_disable`). Blocks are compiled with `Module.compile()`, in place,
so module names, parameter names and checkpoint keys do not change (a `torch.compile(block)`
wrapper would add `_orig_mod.`). Every block has the same code and shapes, so dynamo compiles
one graph and reuses it for the others (with `inline_inbuilt_nn_modules`, parameters are graph
inputs, not guards on module identity).

Embeddings, the final norm, the output head and the loss stay eager (torchtitan does the same;
the chunked loss of meshtron/model/loss.py has its own memory-saving structure).

The first steps compile (the forward at the first call, the backward at the first backward);
`compile_seconds()` reports the time dynamo and inductor spent, so the run reports it apart
from the step time (meshtron/train/loop.py `compile_time_s`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from meshtron.errors import UserError


BACKEND = "inductor"
"""The torch.compile backend of `apply_compile`. Only bench/gpu_check.py --dry-run changes it
(`compile_backend("aot_eager")`: the same dynamo + AOT-autograd tracing without inductor's C++
code generation, which costs tens of seconds on a 2-core CPU)."""


@contextlib.contextmanager
def compile_backend(name: str):
    """Blocks compiled inside use backend `name` (see BACKEND)."""
    global BACKEND
    old, BACKEND = BACKEND, name
    try:
        yield
    finally:
        BACKEND = old


def apply_compile(model: nn.Module, inside_checkpoint: bool = False) -> nn.Module:
    """Compile each block of `model.layers` (a Transformer or a pipeline stage chunk) in
    place; returns `model`. `inside_checkpoint`: a recomputed block's wrapped module is
    compiled and the (full) checkpoint runs eagerly around it: the forward is then recomputed
    by the compiled code too (see `parallelize`'s call; never with selective recomputation,
    whose op-level policy cannot see inside a compiled graph)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UserError("plan.compile=true: the model has no `layers` of transformer blocks to "
                        "compile")
    from meshtron.model.moe import MoE

    emb = getattr(model, "tok_embeddings", None)
    if emb is not None:
        emb.register_forward_hook(_wait_async_output)
    for block in layers.values():
        if inside_checkpoint:
            block = getattr(block, "_checkpoint_wrapped_module", block)
        # fullgraph=True as torchtitan: a graph break would silently split the block into
        # eager pieces between graphs (and DTensors crossing them); better to fail loudly.
        # Except MoE blocks (torchtitan compiles them with fullgraph=False too): the routing
        # reads the per-expert token counts on the host (the all-to-all's split sizes,
        # grouped-GEMM offsets), a graph break by construction; the pieces are still compiled.
        moe = any(isinstance(m, MoE) for m in block.modules())
        block.compile(backend=BACKEND, fullgraph=not moe)
    return model


def async_tp_problem(device_type: str, backend: str | None = None) -> str | None:
    """Why asynchronous TP cannot run on this device / process-group backend (one line), or
    None. torch's async TP is an inductor pass (`_micro_pipeline_tp`) that rewrites
    all-gather + matmul and matmul + reduce-scatter into symmetric-memory kernels
    (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter): CUDA devices
    with peer access and NCCL only."""
    if device_type != "cuda":
        return (f"plan.async_tp=true: the device {device_type!r} does not support it "
                "(torch's async TP runs symmetric-memory CUDA kernels over NCCL); use "
                "async_tp=false")
    if backend is not None and backend != "nccl":
        return (f"plan.async_tp=true: the process-group backend {backend!r} does not support "
                "it (NCCL only); use async_tp=false")
    return None


def enable_async_tp(tp_mesh) -> None:
    """Turn on torch's micro-pipelined TP for the compiled blocks, as torchtitan does
    (torchtitan/distributed/tensor_parallel.py `maybe_enable_async_tp`): the inductor pass
    flag and symmetric memory on the tp group (`enable_symm_mem_for_group`, deprecated in
    torch 2.13 as no longer needed but harmless; kept for older versions). The flag is
    inductor's process-wide configuration: every process of a run compiles the same blocks with it, which is what
    asynchronous TP means for the run."""
    import torch.distributed as dist

    problem = async_tp_problem(tp_mesh.device_type, dist.get_backend(tp_mesh.get_group()))
    if problem:
        raise UserError(problem)
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo tracing, AOT autograd and
    inductor, forward and backward): torch's own compile-time counters, summed over the
    top-level phases only (the nested ones are inside them): dynamo's frame compiles, and the
    backward graphs AOT autograd compiles lazily at the first backward
    (`backward._backward_impl`). Not `bw_compiler`: a backward compiled eagerly inside a frame
    compile (seen with the graph breaks of MoE blocks) would count twice."""
    from torch._dynamo.utils import compilation_time_metrics

    total = 0.0
    for name in ("_compile.compile_inner", "backward._backward_impl"):
        total += sum(compilation_time_metrics.get(name, ()))
    return total


def _wait_async_output(module: nn.Module, args, out):
    """The first block's input, made a plain tensor. Under tensor parallelism the embedding's
    output is the result of an asynchronous all-reduce / reduce-scatter (RowwiseParallel with
    `use_local_output`): an `AsyncCollectiveTensor`, a tensor subclass. A compiled block fed
    that subclass traces it as such and its compiled backward hands autograd a gradient of
    the wrong kind: the eager DTensor redistribution behind the embedding then receives a
    plain tensor (AttributeError `_local_tensor` on torch 2.13, measured). Any non-view op
    on it waits for the collective and returns a plain tensor; `clone` is the cheapest
    (one [batch, seq, hidden] copy per forward, once per model, not per block). Later blocks
    get plain tensors already (the residual add waits)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return out.clone() if isinstance(out, AsyncCollectiveTensor) else out
