"""Per-rank entries of a checkpoint: state that only the rank holding it can continue from.

Error feedback (meshtron/compress) keeps, on every rank, what quantization dropped from that
rank's own input. A checkpoint stores it twice: as the data-parallel group's mean, laid out like
the parameters (it reshards: what the group owes is kept, not which rank owes it), and as each
rank's own tensor under `own_key(rank, bucket)`, a key only that rank writes (DCP keeps every
rank's distinct keys, as it keeps each pipeline stage's parameters). A resume on the same
layout loads each rank's own entry, so it continues bit for bit with the uninterrupted run;
after a layout change the own entries mean nothing (another rank, group or shard) and `select`
leaves them out of the load template: each rank then restarts from the group's mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OWN_PREFIX = "rank_own."
MEAN_PREFIX = "grad_residual."
"""The keys of the group's mean residual (meshtron/compress/runtime.py RESIDUAL_PREFIX)."""

SAME_LAYOUT_FIELDS = ("tp", "cp", "pp", "dp", "dp_replicate", "ep", "etp", "zero", "schedule",
                      "virtual_stages", "stage_layers", "grad_compression",
                      "grad_compression_block", "compress_scope", "ranks_per_node", "diloco")
"""Plan fields that decide which residual each rank holds and its shape: the mesh position and
data-parallel group of every rank (meshtron/parallel/mesh.py), the parameters and FSDP units
of its stage, and the reduction's buckets and node split (meshtron/compress/collectives.py)."""


def own_key(rank: int, bucket: str) -> str:
    """The key of rank `rank`'s own entry of `bucket` inside its Stateful's state dict."""
    return f"{OWN_PREFIX}{rank}.{bucket}"


def layout_change(meta: dict[str, Any], world_size: int, plan: Any) -> str:
    """'' when this run has the layout the checkpoint was saved on; else what differs
    ('world size 2 -> 4', 'dp 2 -> 1')."""
    changed = [] if meta.get("world_size") == world_size else \
        [f"world size {meta.get('world_size')} -> {world_size}"]
    saved = meta.get("plan") or {}
    now = plan.to_dict() if plan is not None else {}
    changed += [f"{k} {saved.get(k)} -> {now.get(k)}" for k in SAME_LAYOUT_FIELDS
                if _norm(saved.get(k)) != _norm(now.get(k))]
    return ", ".join(changed)


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def select(template: dict[str, Any], folder: Path, meta: dict[str, Any], world_size: int,
           plan: Any) -> str:
    """Keep this rank's own entries in the load `template` only when the layout is unchanged
    and the checkpoint holds them with the same shape; else drop them (the Stateful then
    loads the group's mean). Returns the line the resume prints when it drops any ('' when
    none was dropped)."""
    _drop_absent_means(template, folder)
    if not any(isinstance(entries, dict) and any(k.startswith(OWN_PREFIX) for k in entries)
               for entries in template.values()):
        return _not_continued(folder, meta, plan)  # this layout keeps no residual
    change = layout_change(meta, world_size, plan)
    saved = {} if change else _saved_shapes(folder)
    if not drop_own(template, keep=saved):
        return ""
    why = f"the layout changed ({change})" if change else \
        "the checkpoint holds no per-rank residuals (saved with --checkpoint-residuals mean, " \
        "or before they were kept)"
    return (f"error-feedback residuals: {why}; every rank restarts from its data-parallel "
            "group's mean residual (what the group owes is kept, not which rank owes it), so "
            "the run continues close to, not bit for bit with, an uninterrupted one")


def _not_continued(folder: Path, meta: dict[str, Any], plan: Any) -> str:
    """The line for a compressed checkpoint whose residuals this run cannot continue: its
    ranks keep none (compress_scope='inter_node' with every data-parallel group inside one
    node, or groups of one rank: nothing is compressed, so error feedback is off and the
    Statefuls drop both the own and the mean residual). '' when the checkpoint holds none."""
    saved = (meta.get("plan") or {}).get("grad_compression") or "none"
    if plan is None or saved == "none" or not _saved_shapes(folder):
        return ""
    why = ("compress_scope='inter_node' and no data-parallel group of this run spans two "
           "nodes, so nothing is compressed" if getattr(plan, "compress_scope", None) ==
           "inter_node" else "no data-parallel group of this run has two ranks, so nothing "
           "is reduced")
    return (f"error-feedback residuals: dropped ({why}): the {saved} residuals the checkpoint "
            "holds (gradient the compressed reduction had not delivered yet) are not applied, "
            "so the run continues close to, not bit for bit with, an uninterrupted one")


def drop_own(template: dict[str, Any], keep: dict[str, tuple[int, ...]] | None = None) -> bool:
    """Remove the per-rank entries from a load template of Statefuls ({name: state dict}),
    but those `keep` holds with their shape ({flattened key: shape}); True when any was
    removed. A loop of your own that loads a checkpoint of another layout calls it on its
    template before `dcp.load` (the Statefuls then restore the group's mean)."""
    keep = keep or {}
    dropped = False
    for name, entries in template.items():
        if not isinstance(entries, dict):
            continue
        for key in [k for k in entries if k.startswith(OWN_PREFIX)]:
            if keep.get(f"{name}.{key}") != tuple(entries[key].shape):
                del entries[key]
                dropped = True
    return dropped


def _drop_absent_means(template: dict[str, Any], folder: Path) -> None:
    """Leave out of the load template the mean residual entries the checkpoint lacks: a
    ZeRO-2/3 unit's mean under tensor parallelism is keyed by tp rank since that key was
    needed (compress/runtime.py `_mean_key`); a checkpoint saved before holds one key per
    unit, which a tp rank other than 0 cannot use. The Stateful then keeps no mean for it (on
    the same layout each rank's own residual is what loads)."""
    means = [(name, k) for name, entries in template.items() if isinstance(entries, dict)
             for k in entries if k.startswith(MEAN_PREFIX)]
    if not means:
        return
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    for name, key in means:
        if f"{name}.{key}" not in saved:
            del template[name][key]


def _saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{flattened key: shape} of the per-rank entries in DCP's metadata of `folder`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, md in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items():
        if f".{OWN_PREFIX}" in key and isinstance(md, TensorStorageMetadata):
            out[key] = tuple(md.size)
    return out
