"""The CUDA caching allocator during a profiled window: did it retry, free, or map memory?

A cudaMalloc that fails makes the allocator free its cached blocks (cudaFree, which synchronises
the device) and retry; a plan at 126 of 141 GB (the first H200 run) is a suspect for idle that
no host sync in meshtron's code explains. Recorded per window, from `torch.cuda.memory_stats()`
read before and after (host counters: no device sync):
- counter deltas, each feature-detected on the installed torch (2.11-2.13 have them all, an
  older one may lack some: `missing` names them): num_alloc_retries, num_ooms,
  num_sync_all_streams, num_device_alloc / num_device_free (cudaMalloc + cuMemMap, cudaFree +
  cuMemUnmap), and segment.all.allocated / freed (segments obtained and released);
- peaks within the window (peak counters reset at its start): allocated, reserved, active,
  requested; the reserved - allocated slack at the peak and the inactive split bytes after
  (fragmentation);
- whether expandable segments are on: as configured (PYTORCH_ALLOC_CONF, else
  PYTORCH_CUDA_ALLOC_CONF, the order torch reads them) and as observed (the memory snapshot's
  segments carry `is_expandable`), and the allocator backend (native or cudaMallocAsync).

Readers are injected (`Reader`): a unit test hands in synthetic stats; on CPU (dry run) there
is no caching allocator, the record says so and still carries the configuration read from the
environment.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
            "num_device_free", "segment.all.allocated", "segment.all.freed")
PEAKS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
         "requested_bytes.all.peak")
CURRENT = ("allocated_bytes.all.current", "reserved_bytes.all.current",
           "inactive_split_bytes.all.current")
CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The allocator's configuration variables, in the order torch reads them (the first set wins;
the second is the older, CUDA-only name, "supported with lower priority": the comment in
c10/core/AllocatorConfig.h of torch 2.13)."""


def conf(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The allocator configuration the environment sets: the variable, its value, and whether
    it turns expandable segments on (`expandable_segments:True`, the last entry winning)."""
    environ = os.environ if environ is None else environ
    # set wins, even empty: c10's AllocatorConfig parses the first variable that is present
    name = next((v for v in CONF_VARS if v in environ), None)
    value = environ.get(name, "") if name else ""
    on = False
    for item in value.split(","):
        key, _, val = item.partition(":")
        if key.strip() == "expandable_segments":
            on = val.strip() == "True"  # torch accepts exactly True / False (AllocatorConfig)
    return {"env": name, "value": value or None, "expandable_segments": on}


def with_expandable(environ: Mapping[str, str]) -> dict[str, str]:
    """The child environment of the expandable-segments variant: the configuration the parent
    has (whichever variable torch would read), expandable_segments:True added or replacing."""
    c = conf(environ)
    name = c["env"] or "PYTORCH_CUDA_ALLOC_CONF"
    kept = [x for x in (c["value"] or "").split(",")
            if x.strip() and x.partition(":")[0].strip() != "expandable_segments"]
    return {name: ",".join(kept + ["expandable_segments:True"])}


@dataclasses.dataclass
class Reader:
    """Where the numbers come from: `stats()` -> memory_stats dict, `reset_peak()`,
    `segments()` -> the snapshot's segment dicts (or None), `backend()` -> its name."""

    stats: Callable[[], Mapping[str, int]]
    reset_peak: Callable[[], None]
    segments: Callable[[], list | None]
    backend: Callable[[], str | None]


def cuda_reader(dev) -> Reader | None:
    """The CUDA caching allocator of `dev`, or None on a device without one."""
    if dev.type != "cuda":
        return None
    import torch

    def segments():
        snap = getattr(torch.cuda, "memory_snapshot", None)
        return snap() if snap is not None else None

    def backend():
        get = getattr(torch.cuda, "get_allocator_backend", None)
        return get() if get is not None else None

    return Reader(lambda: torch.cuda.memory_stats(dev),
                  lambda: torch.cuda.reset_peak_memory_stats(dev), segments, backend)


def expandable_observed(segments: list | None) -> dict[str, Any] | None:
    """How many of the allocator's segments are expandable (None: no snapshot, or a torch whose
    segments do not say)."""
    if segments is None:
        return None
    flags = [s.get("is_expandable") for s in segments if isinstance(s, dict)]
    if not flags or any(f is None for f in flags):
        return {"segments": len(flags), "expandable": None}
    return {"segments": len(flags), "expandable": sum(bool(f) for f in flags)}


def deltas(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, Any]:
    """Counter deltas over the window, its peaks and the state after (module docstring); keys
    this torch's stats lack are listed in `missing`, never guessed."""
    out: dict[str, Any] = {"counters": {}, "peak_bytes": {}, "after_bytes": {}, "missing": []}
    for key in COUNTERS:
        if key in before and key in after:
            out["counters"][key] = after[key] - before[key]
        else:
            out["missing"].append(key)
    for group, keys in (("peak_bytes", PEAKS), ("after_bytes", CURRENT)):
        for key in keys:
            if key in after:
                out[group][key.split(".")[0]] = after[key]
            else:
                out["missing"].append(key)
    peak = out["peak_bytes"]
    if "reserved_bytes" in peak and "allocated_bytes" in peak:
        slack = peak["reserved_bytes"] - peak["allocated_bytes"]
        out["reserved_minus_allocated_peak_bytes"] = slack
    c = out["counters"]
    # device frees: the dedicated counter, else the segments released (one cudaFree each)
    out["device_frees"] = c.get("num_device_free", c.get("segment.all.freed"))
    out["device_allocs"] = c.get("num_device_alloc", c.get("segment.all.allocated"))
    out["retries"] = c.get("num_alloc_retries")
    out["syncs"] = c.get("num_sync_all_streams")  # each waits for every stream's events
    return out


def measured(reader: Reader | None, run: Callable[[], Any], why: str = "",
             reset_peak: bool = True) -> dict[str, Any]:
    """Run `run()` (the profiled window) between two reads of the allocator; its record.
    `reset_peak`: the peaks are the window's own (else: since the last reset, the engine's
    start, which the case's own peak figure keeps)."""
    rec: dict[str, Any] = {"conf": conf(), "peaks_since": "window" if reset_peak else "engine"}
    if reader is None:
        run()
        return {"source": None, "reason": why or "no caching allocator on this device", **rec}
    try:
        before = dict(reader.stats())
        if reset_peak:
            reader.reset_peak()
    except Exception as exc:  # noqa: BLE001 - a reader this torch lacks: the window still runs
        before, rec = None, {"source": None, "error": f"{type(exc).__name__}: {exc}"[:300], **rec}
    run()  # outside any handler: an out-of-memory error here is the case's to catch, alone
    if before is None:
        return rec
    try:
        rec.update(source="torch.cuda.memory_stats", **deltas(before, dict(reader.stats())))
        rec["backend"] = reader.backend()
        rec["expandable_observed"] = expandable_observed(reader.segments())
    except Exception as exc:  # noqa: BLE001
        rec.update(source="torch.cuda.memory_stats", error=f"{type(exc).__name__}: {exc}"[:300])
    return rec


def expandable_on(rec: Mapping[str, Any]) -> bool | None:
    """Expandable segments as observed in the snapshot when it says, else as configured."""
    seen = rec.get("expandable_observed") or {}
    if seen.get("expandable") is not None and seen.get("segments"):
        return seen["expandable"] > 0
    return (rec.get("conf") or {}).get("expandable_segments")


def verdict(rec: Mapping[str, Any]) -> str:
    if rec.get("source") is None:
        return f"allocator: not recorded ({rec.get('reason') or rec.get('error')})"
    line = (f"allocator: {rec.get('retries')} retries, {rec.get('device_frees')} device frees, "
            f"{rec.get('device_allocs')} device allocs, {rec.get('syncs')} stream syncs in the "
            f"window")
    if rec.get("retries"):
        line += " (a retry frees cached blocks: cudaFree synchronises the device)"
    return line + f"; expandable segments {expandable_on(rec)}"
