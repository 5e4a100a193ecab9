"""Read a Hugging Face safetensors checkpoint into this rank's shards only.

A checkpoint folder holds `config.json` and either one `model.safetensors` (or several
`*.safetensors`) or shards listed by `model.safetensors.index.json`. `Checkpoint` reads only the
files' JSON headers (names, shapes, dtypes: a few KB each) to check the folder against the model
before any rank starts; `load_into(parts)` then copies, for every parameter a rank holds, only
the box of rows/columns that rank owns, through safetensors' lazy slicing (`get_slice`), which
reads those bytes from the memory-mapped file and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

from meshtron.argtypes import folder_problem
from meshtron.errors import UserError
from meshtron.hf.names import Source, check_supported, hf_shapes, is_ignorable, sources
from meshtron.model.spec import ModelSpec

INDEX = "model.safetensors.index.json"
FIELD = "train.init_from"


def _header(path: Path, field: str = FIELD) -> dict[str, Any]:
    """The JSON header of a safetensors file: {name: {"dtype", "shape", "data_offsets"}}; the
    data it describes must be in the file (a truncated file is refused here, not mid-read)."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > 100_000_000:
                raise ValueError("header larger than 100 MB")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{field}: {str(path)!r} is not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise UserError(f"{field}: {str(path)!r} is not a safetensors file")
    header.pop("__metadata__", None)
    _check_data_size(path, header, 8 + size, field)
    return header


def _check_data_size(path: Path, header: dict[str, Any], start: int, field: str) -> None:
    """The file is exactly its header and the tensors' bytes it describes (safetensors'
    data_offsets count from the end of the header; huggingface/safetensors' header check,
    safetensors/src/tensor.rs `MetadataIncompleteBuffer`, refuses a buffer not fully covered:
    `safe_open` said "incomplete metadata, file not fully covered" as a traceback mid-merge):
    a truncated or padded file is one line naming it."""
    ends = [meta["data_offsets"][1] for meta in header.values() if isinstance(meta, dict)
            and isinstance(meta.get("data_offsets"), list) and len(meta["data_offsets"]) == 2
            and isinstance(meta["data_offsets"][1], int)]
    need, have = start + max(ends, default=0), path.stat().st_size
    if have != need:
        what = "truncated" if have < need else "longer than its tensors"
        raise UserError(f"{field}: {str(path)!r} is {what}: {have:,} bytes, its header "
                        f"describes {need:,}")


class Checkpoint:
    """The tensors of a Hugging Face checkpoint folder: name -> (file, shape), from headers."""

    def __init__(self, folder: str | Path, field: str = FIELD):
        self.field = field
        """The option or field that named the folder, for errors."""
        self.folder = Path(folder)
        if (problem := folder_problem(self.folder)) is not None:
            raise UserError(f"{self.field}={str(folder)!r}: {problem} (a Hugging Face "
                            "checkpoint folder holds config.json and *.safetensors)")
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        index = self.folder / INDEX
        if index.is_file():
            self._read_index(index)
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"{self.field}={str(folder)!r}: holds no *.safetensors file")
            for path in files:
                for name, meta in _header(path, self.field).items():
                    self.files[name] = path
                    self.shapes[name] = tuple(meta.get("shape", ()))

    def declared_type(self) -> str | None:
        """The model_type the folder's config.json names (None: no readable config.json):
        its tensor names are that type's."""
        path = self.folder / "config.json"
        try:
            doc = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError, UnicodeDecodeError):
            raise UserError(f"{self.field}: {str(path)!r} is not valid JSON") from None
        mtype = doc.get("model_type") if isinstance(doc, dict) else None
        return mtype if isinstance(mtype, str) else None

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise UserError(f"{self.field}: {str(index)!r} has no weight_map object") from None
        headers: dict[str, dict[str, Any]] = {}
        for name, file in weight_map.items():
            path = self.folder / str(file)
            if str(file) not in headers:
                if not path.is_file():
                    raise UserError(f"{self.field}: shard {file!r} (holding tensor {name}) is "
                                    f"missing from {str(self.folder)!r}")
                headers[str(file)] = _header(path, self.field)
            meta = headers[str(file)].get(name)
            if meta is None:
                raise UserError(f"{self.field}: tensor {name} is listed in {INDEX} under {file!r} "
                                 "but that shard does not hold it")
            self.files[name] = path
            self.shapes[name] = tuple(meta.get("shape", ()))

    def _resolve(self, name: str) -> str | None:
        """The stored name of Hugging Face tensor `name`: itself, or without GPT-2's
        "transformer." prefix (the original GPT-2 files store "h.0.attn.c_attn.weight")."""
        if name in self.shapes:
            return name
        bare = name.removeprefix("transformer.")
        return bare if bare in self.shapes else None

    def check(self, spec: ModelSpec, want_shapes: dict[str, tuple[int, ...]]
              ) -> dict[str, Source]:
        """Check names and shapes against the model; returns meshtron name -> Source (with the
        stored names)."""
        mtype = check_supported(spec, self.field, self.declared_type())
        srcs = sources(spec, mtype)
        expected = hf_shapes(spec, want_shapes, mtype)
        stored = {self._resolve(s.name): s.name for s in srcs.values()}
        stored.update({n: n for s in srcs.values() for n in s.stacked})
        for name in sorted(self.shapes):
            if name not in stored and not is_ignorable(name, spec):
                raise UserError(f"{self.field}: unknown tensor {name} in {self.files[name].name} "
                                f"(not a parameter of a {spec.layers}-layer {mtype} model)")
        out = {}
        for ours, src in srcs.items():
            if src.stacked:
                for name in src.stacked:
                    self._check_one(name, ours, expected)
                out[ours] = src
                continue
            real = self._resolve(src.name)
            if real is None:
                raise UserError(f"{self.field}: tensor {src.name} (meshtron {ours}) is missing "
                                f"from {str(self.folder)!r}")
            got, want = self.shapes[real], expected[src.name]
            if got != want:
                raise UserError(f"{self.field}: tensor {src.name} has shape {list(got)}; the model "
                                 f"needs {list(want)}")
            out[ours] = dataclasses.replace(src, name=real)
        return out

    def _check_one(self, name: str, ours: str, expected: dict[str, tuple[int, ...]]) -> None:
        if name not in self.shapes:
            raise UserError(f"{self.field}: tensor {name} (meshtron {ours}) is missing from "
                             f"{str(self.folder)!r}")
        if tuple(self.shapes[name]) != tuple(expected[name]):
            raise UserError(f"{self.field}: tensor {name} has shape {list(self.shapes[name])}; the "
                             f"model needs {list(expected[name])}")

    def read_into(self, src: Source, target: torch.Tensor, offset: tuple[int, ...],
                  block_elems: int) -> int:
        """Copy the box at `offset` (of `target`'s shape, in meshtron's orientation) of the
        tensor `src` points at into `target`, in row blocks of at most `block_elems` elements;
        returns the bytes read. The file is mapped only while this tensor is read, so its pages
        do not accumulate in the process. Stacked experts: only the experts in the box."""
        from safetensors import safe_open

        if src.stacked:
            return sum(self.read_into(Source(src.stacked[offset[0] + e]), target[e], offset[1:],
                                      block_elems) for e in range(target.shape[0]))

        shape = tuple(target.shape)
        row = max(1, math.prod(shape[1:]))
        step = max(1, block_elems // row)
        start = list(offset)  # the box's first index in the stored tensor, fused part included
        start[src.axis] += src.offset
        read = 0
        with safe_open(str(self.files[src.name]), framework="pt") as f:
            sl = f.get_slice(src.name)
            for r in range(0, shape[0], step):
                n = min(step, shape[0] - r)
                rows = slice(start[0] + r, start[0] + r + n)
                cols = tuple(slice(o, o + k) for o, k in zip(start[1:], shape[1:]))
                if src.transpose:
                    values = sl[(cols[0], rows)].t()
                else:
                    values = sl[(rows, *cols)]
                target[r:r + n].copy_(values)
                read += values.numel() * values.element_size()
            del sl
        return read


def model_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Global shapes of every parameter of the plain model (built on meta: no memory)."""
    from meshtron.model.init import named_unique_parameters
    from meshtron.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(spec, init_seed=0)
    return {n: tuple(p.shape) for n, p in named_unique_parameters([model])}


def model_aliases(spec: ModelSpec) -> dict[str, str]:
    """Second names of one parameter (a tied `output.weight`) -> the name `model_shapes`
    gives it: a checkpoint of the model's state_dict holds both."""
    from meshtron.model.init import clean_name
    from meshtron.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(spec, init_seed=0)
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean_name(name)
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def check_checkpoint(folder: str | Path, spec: ModelSpec) -> Checkpoint:
    """Validate a checkpoint folder against `spec` (headers only); UserError naming the tensor."""
    ckpt = Checkpoint(folder)
    ckpt.check(spec, model_shapes(spec))
    return ckpt


@torch.no_grad()
def load_into(parts: list[torch.nn.Module], folder: str | Path, spec: ModelSpec) -> int:
    """Fill this rank's shards of `parts` (materialized, e.g. by `parallelize`) from the
    checkpoint; returns the bytes read."""
    from meshtron.model.init import (
        BLOCK_ELEMS,
        local_box,
        local_tensor,
        named_unique_parameters,
    )

    ckpt = Checkpoint(folder)
    mapping = ckpt.check(spec, model_shapes(spec))
    read = 0
    for name, p in named_unique_parameters(parts):
        _, offset, local = local_box(p)
        if 0 in local:
            continue
        # Row blocks: the transient copy is one block, not the whole shard.
        read += ckpt.read_into(mapping[name], local_tensor(p), offset, BLOCK_ELEMS)
    return read
