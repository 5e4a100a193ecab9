"""Deterministic, shard-local parameter initialization: meta-device models at any size.

Every parameter's initial value is a pure function of (init seed, parameter name, element
index), not of the order in which a global random generator is consumed. So one process that
builds the whole model and a rank that holds a 1/64 shard of one matrix compute the same
numbers for the elements they share, and a model built on the meta device, sharded by
`meshtron.parallel.parallelize` and then materialized holds exactly the single-process
initialization (tests/test_meta_init.py compares them for dp, tp, pp and 3-D layouts).

How: a parameter is cut along dim 0 into blocks of at most `BLOCK_ELEMS` elements (whole rows);
block b is drawn from its own CPU generator seeded with sha256(seed, name, b). A rank that owns
the box [r0:r1, c0:c1] draws only the blocks overlapping rows r0..r1 and keeps its columns. The
memory cost of initialization is therefore one block (16 MiB in fp32) on top of the shard (the
values are written into the shard's own storage block by block), never the full tensor; the compute cost is the rows a rank touches times the full row width
(a row-parallel shard, Shard(1), draws tp times its own size).

Values (GPT-2 style, Radford et al. 2019): weights N(0, 0.02), the residual output projections
(`wo`, `w2`) N(0, 0.02/sqrt(2L)) so the residual stream's variance stays flat with depth; norm
weights 1, biases 0.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch
from torch import nn

BLOCK_ELEMS = 1 << 22
"""Elements drawn per generator block (whole rows; at least one row)."""

INIT_STD = 0.02
"""Standard deviation of the weight matrices (embeddings, projections)."""

_RESIDUAL_OUT = ("wo.weight", "w2.weight")


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of row block `block` of parameter `name` (63 bits)."""
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def param_std(name: str, layers: int) -> float:
    """Standard deviation of a weight matrix by its (plain-model) name."""
    if name.endswith(_RESIDUAL_OUT):
        return INIT_STD / math.sqrt(2 * layers)
    return INIT_STD


def init_box(name: str, global_shape: tuple[int, ...], offset: tuple[int, ...],
             local_shape: tuple[int, ...], seed: int, layers: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial values of the box `offset : offset + local_shape` of parameter `name`
    (a new CPU tensor of `local_shape`)."""
    out = torch.empty(local_shape, dtype=dtype)
    init_into(out, name, global_shape, offset, seed, layers)
    return out


@torch.no_grad()
def init_into(out: torch.Tensor, name: str, global_shape: tuple[int, ...],
              offset: tuple[int, ...], seed: int, layers: int) -> None:
    """Write the initial values of the box at `offset` (of `out`'s shape) of parameter `name`
    into `out` (any device and dtype), one generator block at a time: the only memory beyond
    `out` is one block."""
    if out.numel() == 0:
        return
    if len(global_shape) <= 1:  # norm weights and biases: constants
        out.fill_(0.0 if name.endswith("bias") else 1.0)
        return
    std = param_std(name, layers)
    row_elems = math.prod(global_shape[1:])
    rows_per_block = max(1, BLOCK_ELEMS // row_elems)
    r0, r1 = offset[0], offset[0] + out.shape[0]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    g = torch.Generator(device="cpu")
    for block in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1):
        b0 = block * rows_per_block
        b1 = min(b0 + rows_per_block, global_shape[0])
        g.manual_seed(block_seed(seed, name, block))
        values = torch.randn((b1 - b0, *global_shape[1:]), generator=g, dtype=torch.float32)
        lo, hi = max(r0, b0), min(r1, b1)
        out[lo - r0:hi - r0].copy_(values[(slice(lo - b0, hi - b0), *cols)].mul_(std))


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset, local shape) of this rank's part of `param` (a DTensor or a plain
    tensor, which is its own whole)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        shape = tuple(param.shape)
        return shape, (0,) * len(shape), shape
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(param.shape)
    local, offset = compute_local_shape_and_global_offset(shape, param.device_mesh,
                                                          param.placements)
    return shape, tuple(offset), tuple(local)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def named_unique_parameters(modules: Iterable[nn.Module]):
    """(plain-model name, parameter) over `modules`, each parameter once (tied weights under
    their first name, as `named_parameters` gives them), wrapper prefixes removed."""
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield clean_name(name), p


def clean_name(name: str) -> str:
    """A parameter name without activation-checkpoint wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "")


@torch.no_grad()
def fill_local(param: torch.Tensor, values: torch.Tensor) -> None:
    """Copy `values` (this rank's box) into the parameter's local storage."""
    local = local_tensor(param)
    if local.numel():
        local.copy_(values.to(device=local.device, dtype=local.dtype))


@torch.no_grad()
def init_parameters(modules: Iterable[nn.Module], seed: int, layers: int) -> None:
    """Initialize this rank's part of every parameter of `modules` in place."""
    for name, p in named_unique_parameters(modules):
        shape, offset, _ = local_box(p)
        init_into(local_tensor(p), name, shape, offset, seed, layers)


def retie_embeddings(module: nn.Module) -> None:
    """Tie the output head to the token embedding again where the spec says they are tied
    (moving modules between devices may replace one of the two Parameter objects)."""
    spec = getattr(module, "spec", None)
    if (spec is not None and spec.tied_embeddings
            and getattr(module, "tok_embeddings", None) is not None
            and getattr(module, "output", None) is not None
            and module.output.weight is not module.tok_embeddings.weight):
        module.output.weight = module.tok_embeddings.weight


@torch.no_grad()
def materialize(parts: list[nn.Module], device: torch.device, seed: int | None = None,
                fill=None, param_device: torch.device | None = None) -> None:
    """Allocate this rank's shards of meta-device `parts` (model parts after `parallelize`) on
    `device` and fill them: `fill(parts)` when given (e.g. loading a checkpoint), else the
    deterministic initialization with `seed` (default: the model's own `init_seed`). Buffers
    derived from the spec (the RoPE table) are recomputed. `param_device`: where the
    parameters live when not on `device` (the host, with FSDP2's CPU offload; buffers stay on
    `device`, which FSDP2 does not offload)."""
    from meshtron.model.rope import rope_cache

    for part in parts:
        part.to_empty(device=param_device or device)
        if param_device is not None:
            for module in part.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(device)
        retie_embeddings(part)
        if getattr(part, "rope", None) is not None:
            part.rope = rope_cache(part.spec, device)
    if fill is not None:
        fill(parts)
        return
    spec = parts[0].spec
    init_parameters(parts, parts[0].init_seed if seed is None else seed, spec.layers)
