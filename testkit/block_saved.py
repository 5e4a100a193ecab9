"""What one meshtron block saves for its backward, eager or compiled as the runtime compiles it.

The block is built, wrapped for recomputation (parallel/recompute.py `apply_recompute`) and
compiled per block (parallel/compile.py `apply_compile`, inductor) exactly as `parallelize`
does at tp = 1, then run forward once under `torch.autograd.graph.saved_tensors_hooks`: the
tensors a compiled block's autograd Function saves (AOTAutograd's `CompiledFunction`,
`ctx.save_for_backward` of the partitioner's saved values) go through the hooks like eager
ones (checked on a tiny compiled function: `hooks_see_compiled_saves`). Each saved tensor is
counted once per storage, parameters (and views of them: the compiled graph saves the
transposed weights) and the model's RoPE table excluded, 0-dim tensors excluded (as tests/test_rehearse_models.py
`block_saved_bytes`). Used by bench/compiled_saved.py and tests/test_compiled_saved.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Saved:
    """One saved storage: the first tensor seen on it (shape, dtype) and the storage's bytes."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


# torchtitan's selective AC "op" policy (torchtitan/models/llama3/infra/parallelize.py
# `_save_list`, `_custom_policy`): these ops' outputs saved, except every second mm; the CPU's
# flash kernel added (torchtitan lists the CUDA kernels only) so that SDPA is saved as on a GPU
TITAN_SAVE = ("mm", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "max")


def titan_policy_context():
    """torchtitan's op policy as a checkpoint `context_fn` (see TITAN_SAVE)."""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = {getattr(torch.ops.aten, n).default for n in TITAN_SAVE}
    mm = torch.ops.aten.mm.default

    def policy(ctx, op, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        meta = policy.meta
        if op == mm:
            meta[key] += 1
        keep = op in save and not (op == mm and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    policy.meta = defaultdict(int)
    return create_selective_checkpoint_contexts(policy)


def one_block_model(spec, dtype):
    """A one-layer Transformer of `spec` on the CPU, its parameters in `dtype` (the compute
    copies FSDP2 gathers), any values (a byte count does not read them)."""
    import torch

    from meshtron.model.transformer import Transformer

    model = Transformer(spec.replace(layers=1), device="meta").to_empty(device="cpu")
    if model.rope is not None:
        from meshtron.model.rope import rope_cache

        model.rope = rope_cache(spec, torch.device("cpu"))
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def block_saves(spec, dtype: str = "bf16", recompute: str = "none", compiled: bool = True,
                seq: int = 512, batch: int = 1, policy: str = "meshtron") -> list[Saved]:
    """What block 0 of `spec` saves for its backward (module docstring). `recompute`: 'none',
    'selective' (meshtron's policy, or torchtitan's with policy='torchtitan') or 'full'."""
    import torch

    from meshtron.parallel.recompute import apply_recompute

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = one_block_model(spec, torch_dtype)
    if policy == "torchtitan" and recompute == "selective":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper)

        model.layers["0"] = checkpoint_wrapper(model.layers["0"], preserve_rng_state=True,
                                               context_fn=titan_policy_context)
    else:
        apply_recompute(model, recompute)
    if compiled:
        import torch._dynamo

        from meshtron.parallel.compile import apply_compile

        torch._dynamo.reset()
        apply_compile(model)  # tp = 1: the checkpoint wrapper is compiled with the block
    # the parameters, and the model's RoPE table (held by the model, shared by every block;
    # a checkpointed block saves it as an input)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if model.rope is not None:
        weights.add(model.rope.untyped_storage().data_ptr())
    saved: dict[int, Saved] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and t.dim() and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = Saved(tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                              storage.nbytes())
        return t

    x = torch.randn(batch, seq, spec.hidden, dtype=torch_dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.layers["0"](x, model.rope_for(seq))
    del out
    return list(saved.values())


def hooks_see_compiled_saves() -> bool:
    """A compiled `sin(x @ w)` saves through saved_tensors_hooks: the mm output (the sin is
    recomputed in backward from it) is seen by the pack hook."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    f = torch.compile(lambda x, w: torch.sin(x @ w), backend="inductor", fullgraph=True)
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t,
                                                   lambda t: t):
        f(x, w)
    return torch.Size([64, 16]) in seen


SDPA_KERNELS = ("flash", "efficient", "cudnn", "cpu")
"""SDPA's kernels: the three CUDA ones (aten._scaled_dot_product_{flash,efficient,cudnn}_
attention) and the CPU's (`_scaled_dot_product_flash_attention_for_cpu`)."""


def _sdpa(kernel: str, q, k, v):
    import torch

    aten = torch.ops.aten
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    if kernel == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0]
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]


def sdpa_saves(kernel: str, seq: int = 256, heads: int = 4, head_dim: int = 64) -> list[Saved]:
    """The forward outputs AOTAutograd's min-cut partitioner saves for the backward of
    projections + one SDPA kernel (`SDPA_KERNELS`), traced on the meta device: the CUDA
    kernels' meta functions stand in for a GPU (a CPU-only torch cannot run them), so which
    tensors each kernel's backward needs is read without one. Parameters (and their
    transposes) are left out."""
    import re

    import torch
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    width = heads * head_dim
    device = "cpu" if kernel == "cpu" else "meta"
    found: list[Saved] = []

    def forward_compiler(gm, args):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in outputs:
            val = getattr(node, "meta", {}).get("val")
            weight = re.fullmatch(r"t(_\d+)?", node.name)  # a weight's transpose
            if isinstance(val, torch.Tensor) and val.dim() and not weight:
                found.append(Saved(tuple(val.shape), str(val.dtype).replace("torch.", ""),
                                   val.numel() * val.element_size()))
        return gm

    def f(x, wq, wk, wv):
        b, s, _ = x.shape
        q, k, v = ((x @ w).view(b, s, heads, head_dim).transpose(1, 2) for w in (wq, wk, wv))
        return _sdpa(kernel, q, k, v).transpose(1, 2).reshape(b, s, width)

    x = torch.randn(1, seq, width, dtype=torch.bfloat16, device=device, requires_grad=True)
    ws = [torch.randn(width, width, dtype=torch.bfloat16, device=device, requires_grad=True)
          for _ in range(3)]
    compiled = aot_function(f, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                            partition_fn=min_cut_rematerialization_partition)
    compiled(x, *ws)
    return found


def tp_block_saves(spec_fields: dict, dtype: str = "bf16", sp: bool = False, seq: int = 512,
                   compiled: bool = True) -> int:
    """On each rank of a gloo tensor-parallel group (testkit/multiproc.py `run_on_ranks`):
    the bytes block 0 of ModelSpec(**spec_fields) saves for backward on this rank, sharded by
    parallel/tensor.py `apply_tensor_parallel` over all the ranks and compiled as the runtime
    compiles it (tp > 1, no recomputation), counted as `block_saves` does (parameters'
    local shards and the RoPE table excluded). With `sp` the block's input is this rank's
    1/tp of the sequence, as the embedding hands it on."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshtron.model.spec import ModelSpec
    from meshtron.parallel.tensor import apply_tensor_parallel

    spec = ModelSpec(**spec_fields)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = one_block_model(spec, torch_dtype)
    apply_tensor_parallel(model, mesh, sp=sp)
    if compiled:
        from meshtron.parallel.compile import apply_compile

        apply_compile(model)

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    skip = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.rope.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t):
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in skip and t.dim():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    rows = seq // dist.get_world_size() if sp else seq
    torch.manual_seed(0)  # the same input on every rank (replicated without sp)
    x = torch.randn(1, rows, spec.hidden, dtype=torch_dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.layers["0"](x, model.rope_for(seq))
    del out
    return sum(saved.values())
