"""Deterministic, shard-local parameter initialization: meta-device models at any size.

Every parameter's initial value is a pure function of (init seed, parameter name, element
index) on a given kind of device, not of the order in which a global random generator is
consumed. So one process that builds the whole model and a rank that holds a 1/64 shard of one
matrix compute the same numbers for the elements they share, and a model built on the meta
device, sharded by `meshtron.parallel.parallelize` and then materialized holds exactly the
single-process initialization (tests/test_meta_init.py compares them for dp, tp, pp and 3-D
layouts).

How: a parameter is cut into tiles, and tile t is drawn from its own generator seeded with
sha256(seed, name, t), on the device the values are for. A rank that owns the box
[r0:r1, c0:c1] draws only the tiles overlapping it and writes them into its own storage (the
memory beyond the shard is one tile per drawing thread). The tiles' geometry depends on the
device kind that draws:

- "tiles" (CUDA and other accelerators): at most `TILE_ROWS` x `TILE_COLS` over the last two
  dimensions (one index of each leading dimension, e.g. one expert), so a shard costs about its
  own size whichever dimension is sharded (row- or column-parallel, FSDP chunks, experts). Each
  tile is one randn kernel with a Philox generator: the host launches ~30,000 small kernels for
  an 8B model instead of drawing every element on one thread (~45 s);
  `bench/init_speed.py --device cuda` measures it (not yet run on a GPU).
- "rows" (the CPU): blocks of whole rows of at most `BLOCK_ELEMS` elements, the values every
  CPU run, checkpoint and test of meshtron has had (the tests' fp32/bf16 tolerances were
  measured with them). A column-parallel shard draws whole rows (tp times its size); blocks
  are drawn by `torch.get_num_threads()` threads (each block has its own generator, so the
  values do not depend on which thread draws it).

A CUDA generator gives other numbers than the CPU one (and its Philox assignment depends on the
GPU model), so the values are the same for every layout of a run, not across device kinds:
`materialize` draws on the compute device, also when the parameters live on the host
(offload), so offloading does not change them. `init_into(..., geometry=)` draws either
geometry on any device (the CUDA one is tested on the CPU that way).

Values (GPT-2 style, Radford et al. 2019): weights N(0, 0.02), the residual output projections
(`wo`, `w2`) N(0, 0.02/sqrt(2L)) so the residual stream's variance stays flat with depth; norm
weights 1, biases 0.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch
from torch import nn

TILE_ROWS = 512
TILE_COLS = 512
"""Tile extent of the "tiles" geometry over a parameter's last two dimensions (rows, columns):
256 Ki elements, so a tp=8 shard of a 4096-wide matrix is exactly one tile wide."""

BLOCK_ELEMS = 1 << 22
"""Elements per row block of the "rows" geometry (whole rows; at least one row); also the piece
size when a tensor is filled piecewise from a file (hf/load.py)."""

INIT_STD = 0.02
"""Standard deviation of the weight matrices (embeddings, projections)."""

_RESIDUAL_OUT = ("wo.weight", "w2.weight")


def geometry_for(device: torch.device | str) -> str:
    """The tile geometry drawn on `device`: "rows" on the CPU, "tiles" elsewhere."""
    return "rows" if torch.device(device).type == "cpu" else "tiles"


def tile_seed(seed: int, name: str, tile: tuple[int, ...], geometry: str = "tiles") -> int:
    """The generator seed of tile `tile` (its index along every dimension) of parameter
    `name` (63 bits); a row block is keyed by its row index alone (as it always was)."""
    key = str(tile[0]) if geometry == "rows" else ",".join(map(str, tile))
    digest = hashlib.sha256(f"{seed}:{name}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tile_shape(global_shape: tuple[int, ...], geometry: str = "tiles") -> tuple[int, ...]:
    """The tile extent along every dimension of a parameter of `global_shape` (ndim >= 2)."""
    if geometry == "rows":
        rows = max(1, BLOCK_ELEMS // math.prod(global_shape[1:]))
        return (min(rows, global_shape[0]), *global_shape[1:])
    if geometry != "tiles":
        raise ValueError(f"geometry={geometry!r}: expected 'rows' or 'tiles'")
    lead = (1,) * (len(global_shape) - 2)
    return lead + (min(TILE_ROWS, global_shape[-2]), min(TILE_COLS, global_shape[-1]))


def param_std(name: str, layers: int) -> float:
    """Standard deviation of a weight matrix by its (plain-model) name."""
    if name.endswith(_RESIDUAL_OUT):
        return INIT_STD / math.sqrt(2 * layers)
    return INIT_STD


def init_box(name: str, global_shape: tuple[int, ...], offset: tuple[int, ...],
             local_shape: tuple[int, ...], seed: int, layers: int,
             dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             geometry: str | None = None) -> torch.Tensor:
    """The initial values of the box `offset : offset + local_shape` of parameter `name`
    (a new tensor of `local_shape` on `device`, drawn there; `geometry`: see `init_into`)."""
    out = torch.empty(local_shape, dtype=dtype, device=device)
    init_into(out, name, global_shape, offset, seed, layers, geometry)
    return out


def _tiles(global_shape, offset, local_shape, geometry):
    """(tile index, tile shape, destination slices in the local box, source slices in the
    tile) of every tile overlapping the local box."""
    ext = tile_shape(global_shape, geometry)
    ranges = [range(o // t, (o + n - 1) // t + 1)
              for o, n, t in zip(offset, local_shape, ext)]
    for tile in itertools.product(*ranges):
        starts = [i * t for i, t in zip(tile, ext)]
        shape = tuple(min(t, g - s) for t, g, s in zip(ext, global_shape, starts))
        lo = [max(o, s) for o, s in zip(offset, starts)]
        hi = [min(o + n, s + n_t) for o, n, s, n_t in zip(offset, local_shape, starts, shape)]
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))
        src = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts))
        yield tile, shape, dst, src


@torch.no_grad()  # grad mode is thread-local: init_into's no_grad does not reach its pool
def _draw_tiles(out: torch.Tensor, name: str, seed: int, std: float, geometry: str,
                tiles) -> None:
    """Draw `tiles` (from `_tiles`) into `out`, on `out`'s device with a generator there
    (dtype and device explicit: the default dtype and device are thread-local too)."""
    gen = torch.Generator(device=out.device)
    for tile, shape, dst, src in tiles:
        gen.manual_seed(tile_seed(seed, name, tile, geometry))
        values = torch.randn(shape, generator=gen, device=out.device, dtype=torch.float32)
        out[dst].copy_(values[src].mul_(std))


def _threads(device: torch.device, work: int) -> int:
    """Host threads for drawing `work` elements: the intra-op thread count on the CPU (one
    draw is one thread's loop), one for a device (its kernels are queued in order anyway)."""
    if device.type != "cpu" or work < 4 * TILE_ROWS * TILE_COLS:
        return 1
    return max(1, torch.get_num_threads())


@torch.no_grad()
def init_into(out: torch.Tensor, name: str, global_shape: tuple[int, ...],
              offset: tuple[int, ...], seed: int, layers: int,
              geometry: str | None = None) -> None:
    """Write the initial values of the box at `offset` (of `out`'s shape) of parameter `name`
    into `out` (any device and dtype; drawn on `out`'s device), one tile at a time: the only
    memory beyond `out` is one tile per drawing thread. `geometry`: "rows" | "tiles" (default:
    `geometry_for(out.device)`)."""
    if out.numel() == 0:
        return
    if len(global_shape) <= 1:  # norm weights and biases: constants
        out.fill_(0.0 if name.endswith("bias") else 1.0)
        return
    std = param_std(name, layers)
    geometry = geometry or geometry_for(out.device)
    tiles = list(_tiles(global_shape, offset, tuple(out.shape), geometry))
    threads = min(_threads(out.device, out.numel()), len(tiles))
    if threads == 1:
        _draw_tiles(out, name, seed, std, geometry, tiles)
        return
    # Disjoint destination boxes: the threads never write the same element.
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda part: _draw_tiles(out, name, seed, std, geometry, part),
                      [tiles[i::threads] for i in range(threads)]))


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
def init_parameters(modules: Iterable[nn.Module], seed: int, layers: int,
                    device: torch.device | None = None) -> None:
    """Initialize this rank's part of every parameter of `modules` in place. `device`: where
    the values are drawn (default: each parameter's own device); parameters elsewhere (on the
    host with offloading) receive a copy, so they hold what the device would. Norms whose
    weight is applied as 1 + weight (`zero_centred`: Gemma, Nemotron) start at 0, the same
    norm as weight 1 elsewhere."""
    modules = list(modules)
    centred = {id(m.weight) for module in modules for m in module.modules()
               if getattr(m, "zero_centred", False)}
    for name, p in named_unique_parameters(modules):
        shape, offset, _ = local_box(p)
        local = local_tensor(p)
        if id(p) in centred:
            local.zero_()
            continue
        if device is None or local.device.type == device.type or local.numel() == 0:
            init_into(local, name, shape, offset, seed, layers)
            continue
        drawn = torch.empty(local.shape, dtype=local.dtype, device=device)
        init_into(drawn, name, shape, offset, seed, layers)
        local.copy_(drawn)


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
    init_parameters(parts, parts[0].init_seed if seed is None else seed, spec.layers,
                    device=device)
