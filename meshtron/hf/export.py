"""Write a Hugging Face checkpoint: safetensors weights + config.json (+ tokenizer files).

Two entry points:
- `save_hf(state, spec, out_dir)`: from a full state dict in meshtron names (one process; also
  what a consolidated training checkpoint feeds);
- `export_parallel(pm, spec, out_dir)`: from a running `ParallelModel`, collective over all
  ranks. Parameters are gathered one at a time (`DTensor.full_tensor`) in the same order on
  every rank of a pipeline stage; the stage's first rank (dp and tp coordinate 0) buffers them
  on the CPU and writes a file whenever `max_shard_bytes` is reached, so no rank ever holds more
  than one file's worth plus one parameter. Each pipeline stage writes its own files; rank 0
  writes the config, the tokenizer files and the origin record (export.json), then
  `model.safetensors.index.json` (or renames a lone file to `model.safetensors`).

The index (written to a temporary name and renamed) or the rename of the lone file is the
commit point, done last: a killed export leaves either a complete folder or one without it,
which a rerun accepts (its shard files, matched by name, are removed first). A folder with
a committed export, or with other *.safetensors files, is refused.

Tensors are written in the parameters' dtype (fp32 master weights also for bf16 runs), so an
export of unchanged weights is bit-identical to what was loaded.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from meshtron.argtypes import writable_target
from meshtron.data.tokenizer import TOKENIZER_FILES
from meshtron.errors import UserError
from meshtron.hf.names import HFTensors, check_supported, hf_config, sources
from meshtron.model.spec import ModelSpec

DEFAULT_SHARD_BYTES = 5 * 2**30
"""Largest safetensors file written (Hugging Face's own default is 5 GB)."""

COMMITTED = ("model.safetensors", "model.safetensors.index.json")
"""The files that make a folder a finished export (written last: the commit point)."""
_UNFINISHED = re.compile(r"(model(-pp\d{3})?-\d{5}\.safetensors|\..*\.tmp)")
"""The names a killed export leaves before its commit: shard files and temporary files."""


def unfinished_files(out: Path) -> list[Path]:
    """What an export killed before its commit left in `out` (none when it committed)."""
    if not out.is_dir() or any((out / name).is_file() for name in COMMITTED):
        return []
    return sorted(p for p in out.iterdir() if p.is_file() and _UNFINISHED.fullmatch(p.name))


def clear_unfinished(out: Path) -> None:
    """Remove a killed export's shard and temporary files before writing new ones."""
    for path in unfinished_files(out):
        path.unlink(missing_ok=True)


def prepare_export_dir(out_dir: str | Path, field: str = "train.export",
                       run_dir: str | Path | None = None) -> Path:
    """Create `out_dir`; refuse a file, a folder that already holds weights, and a meshtron run
    folder (`run_dir`, the run being trained, or any folder with run.toml or checkpoints/):
    the export's config.json would replace the run's own record of its configuration."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{field}={str(out_dir)!r}: is a file; give a folder")
    is_run = out.is_dir() and ((out / "run.toml").is_file() or (out / "checkpoints").is_dir())
    if is_run or (run_dir is not None and out.resolve() == Path(run_dir).resolve()):
        raise UserError(f"{field}={str(out_dir)!r}: is a meshtron run folder (its config.json "
                        "is the run's record, which the export's would replace); give a "
                        f"folder of its own, e.g. {str(out / 'weights')!r}")
    leftover = set(unfinished_files(out))
    if out.is_dir() and any(p not in leftover for p in out.glob("*.safetensors")):
        raise UserError(f"{field}={str(out_dir)!r}: already holds *.safetensors weights; "
                         "choose an empty folder")
    writable_target(out, field)  # before the checkpoint is read: nothing half-written
    return out


def _write_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    tmp.replace(path)


def write_metadata(out: Path, spec: ModelSpec, weight_map: dict[str, str],
                   config: dict[str, Any] | None = None, tokenizer_dir: str | Path | None = None,
                   dtype: str = "float32", origin: dict[str, Any] | None = None) -> None:
    """config.json, the tokenizer and the origin record (export.json), then the commit: the
    index (or a lone file renamed to model.safetensors)."""
    doc = dict(config) if config else hf_config(spec, dtype, export_type(spec, config))
    doc["vocab_size"] = spec.vocab
    _write_text(out / "config.json", json.dumps(doc, indent=2))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    if origin is not None:
        from meshtron.hf.origin import write_origin

        write_origin(out, origin)
    files = sorted(set(weight_map.values()))
    if len(files) == 1:
        (out / files[0]).replace(out / "model.safetensors")
    else:
        total = sum((out / f).stat().st_size for f in files)
        _write_text(out / "model.safetensors.index.json", json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2))


def _write_text(path: Path, text: str) -> None:
    """Whole or not at all: a temporary file renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def export_type(spec: ModelSpec, config: dict[str, Any] | None,
                field: str = "export") -> str:
    """The model_type whose tensor names the export writes: the kept source config's (its
    config.json is written as it is, so the names must be its type's), else the type the
    spec's fields read as."""
    declared = config.get("model_type") if isinstance(config, dict) else None
    return check_supported(spec, field, declared if isinstance(declared, str) else None)


def copy_tokenizer(src: str | Path, out: Path) -> list[str]:
    """Copy the tokenizer files of folder `src` (or the file `src`) into `out`."""
    src = Path(src)
    paths = [src] if src.is_file() else [src / n for n in TOKENIZER_FILES]
    copied = []
    for path in paths:
        if path.is_file():
            shutil.copyfile(path, out / path.name)
            copied.append(path.name)
    return copied


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def save_hf(state: dict[str, torch.Tensor], spec: ModelSpec, out_dir: str | Path,
            config: dict[str, Any] | None = None, tokenizer_dir: str | Path | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, field: str = "export --to",
            origin: dict[str, Any] | None = None) -> Path:
    """Write `state` (every parameter, meshtron names, full tensors) as a Hugging Face folder;
    `origin`: the export.json record (meshtron/hf/origin.py), written before the commit."""
    out = prepare_export_dir(out_dir, field)
    out.mkdir(parents=True, exist_ok=True)
    clear_unfinished(out)
    from meshtron.hf.load import model_shapes

    mtype = export_type(spec, config, field)
    names = sources(spec, mtype)
    missing = sorted(set(names) - set(state))
    if missing:
        raise UserError(f"export: the state has no tensor {missing[0]}")
    convert = HFTensors(spec, model_shapes(spec), mtype)
    weight_map: dict[str, str] = {}
    buf: dict[str, torch.Tensor] = {}
    size, n = 0, 0
    for ours in names:
        for theirs, t in convert.add(ours, state[ours].detach().cpu()):
            buf[theirs] = t
            size += t.numel() * t.element_size()
        if size >= max_shard_bytes:
            n = _flush(buf, out, f"model-{n:05d}.safetensors", weight_map, n)
            size = 0
    if buf:
        _flush(buf, out, f"model-{n:05d}.safetensors", weight_map, n)
    write_metadata(out, spec, weight_map, config, tokenizer_dir,
                   _dtype_name(state[next(iter(names))]), origin)
    return out


def _flush(buf: dict[str, torch.Tensor], out: Path, name: str, weight_map: dict[str, str],
           n: int) -> int:
    _write_file(buf, out / name)
    weight_map.update({k: name for k in buf})
    buf.clear()
    return n + 1


@torch.no_grad()
def export_parallel(pm, spec: ModelSpec, out_dir: str | Path,
                    config: dict[str, Any] | None = None,
                    tokenizer_dir: str | Path | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    origin: dict[str, Any] | None = None) -> Path | None:
    """Write the model of a `ParallelModel` as a Hugging Face folder (collective: every rank
    calls it). Returns the folder on rank 0, None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshtron.model.init import named_unique_parameters

    out = Path(out_dir)
    mesh = pm.mesh
    writer = all(mesh.get_local_rank(a) == 0 for a in mesh.mesh_dim_names if a != "pp")
    stage = mesh.get_local_rank("pp")
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        clear_unfinished(out)
    dist.barrier()
    from meshtron.hf.load import model_shapes

    convert = HFTensors(spec, model_shapes(spec), export_type(spec, config, "train.export"))
    weight_map: dict[str, str] = {}
    buf: dict[str, torch.Tensor] = {}
    size, n, dtype = 0, 0, "float32"
    for name, p in named_unique_parameters(pm.model_parts):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if not writer:
            continue
        t = full.detach().to("cpu", copy=True)
        dtype = _dtype_name(t)
        for theirs, done in convert.add(name, t):
            buf[theirs] = done
            size += done.numel() * done.element_size()
        if size >= max_shard_bytes:
            n = _flush(buf, out, f"model-pp{stage:03d}-{n:05d}.safetensors", weight_map, n)
            size = 0
    if writer and buf:
        _flush(buf, out, f"model-pp{stage:03d}-{n:05d}.safetensors", weight_map, n)
    maps: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(maps, (weight_map, dtype))
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    merged: dict[str, str] = {}
    for m, _ in maps:
        merged.update(m)
    write_metadata(out, spec, merged, config, tokenizer_dir, maps[0][1], origin)
    dist.barrier()
    return out
