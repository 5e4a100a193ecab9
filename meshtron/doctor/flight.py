"""PyTorch's Flight Recorder as the source of the records on NCCL.

ProcessGroupNCCL records every collective and point-to-point operation in C++ (a ring buffer
sized by TORCH_FR_BUFFER_SIZE, `prepare_env`), with its per-group sequence number, sizes,
dtypes, creation / start / completion times (the last two from CUDA events, i.e. GPU time) and
state. Nothing runs in Python per collective, so the recorder costs nothing on the hot path and
torch.compile'd code is covered too. At dump time `FlightRecorderSource.snapshot()` reads the
trace (`_dump_fr_trace_json`) and turns its entries into the records
`meshtron/diagnose/analyze.py` reads, the format of `recorder.CollectiveRecorder.snapshot()`:

- collectives keep the Flight Recorder's `collective_seq_id` (the per-group number that aligns
  ranks); point-to-point operations are renumbered per (group, direction, peer), in trace order,
  as the analysis matches the k-th send from A to B with the k-th receive on B from A (the trace
  numbers them per group across all peers). Exact while the ring buffer still holds every p2p
  operation of the run; after it wrapped, p2p numbers count from its oldest entry.
- op names from `profiling_name` ("nccl:all_reduce", "nccl:send 0->1", "nccl:recv 1<-0"; the
  ranks there are group ranks), group ranks from `pg_config`.
"""

from __future__ import annotations

import collections
import json
from typing import Any

# Flight Recorder dtype names (c10::ScalarType) -> torch's.
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2"}
_STATES = {"scheduled": "issued", "started": "started", "completed": "completed"}
_RENAMES = {"allreduce": "all_reduce", "allgather": "all_gather",
            "_allgather_base": "all_gather_into_tensor",
            "_reduce_scatter_base": "reduce_scatter_tensor", "reducescatter": "reduce_scatter",
            "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
            "ALLGATHER_coalesced": "all_gather_coalesced",
            "REDUCE_SCATTER_coalesced": "reduce_scatter_coalesced",
            "allreduce_coalesced": "all_reduce_coalesced"}


def _ns(value: Any) -> float | None:
    value = int(value or 0)
    return value / 1e9 if value > 0 else None


def _ranks(text: Any) -> list[int]:
    return [int(r) for r in (json.loads(text) if isinstance(text, str) else text or [])]


def groups_from_trace(fr: dict[str, Any], axes: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The trace's process groups as the dumps' group table: name -> {ranks, axis, desc}."""
    return {name: {"ranks": _ranks(cfg.get("ranks")), "axis": axes.get(name),
                   "desc": cfg.get("desc", "")}
            for name, cfg in (fr.get("pg_config") or {}).items()}


def records_from_trace(fr: dict[str, Any], rank: int,
                       groups: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's entries, oldest first, as recorder records (see the module docstring)."""
    out = []
    p2p_seq: dict[tuple, int] = collections.defaultdict(int)
    for e in sorted(fr.get("entries") or [], key=lambda e: int(e.get("record_id", 0))):
        group = str((e.get("process_group") or ["?"])[0])
        kind, _, rest = str(e.get("profiling_name", "")).partition(":")[2].partition(" ")
        ranks = groups.get(group, {}).get("ranks") or []
        rec = {"group": group, "shapes": e.get("input_sizes") or [],
               "dtypes": [_DTYPES.get(d, d.lower()) for d in e.get("input_dtypes") or []],
               "enqueue_t": _ns(e.get("time_created_ns")),
               "start_t": _ns(e.get("time_discovered_started_ns")),
               "end_t": _ns(e.get("time_discovered_completed_ns")),
               "state": _STATES.get(e.get("state"), e.get("state")), "axis": None,
               "stack": [f"{f.get('filename')}:{f.get('line')} in {f.get('name')}"
                         for f in e.get("frames") or []]}
        if e.get("duration_ms") is not None:  # CUDA-event time of the kernel
            rec["gpu_s"] = float(e["duration_ms"]) / 1e3
        if e.get("is_p2p") or kind in ("send", "recv"):
            sep = "->" if kind == "send" else "<-"
            local = int(rest.partition(sep)[2] or -1) if sep in rest else -1
            peer = ranks[local] if 0 <= local < len(ranks) else local
            key = (group, kind, peer)
            p2p_seq[key] += 1
            rec.update(op=kind, seq=p2p_seq[key], peer=peer)
        else:
            rec.update(op=_RENAMES.get(kind, kind), seq=int(e.get("collective_seq_id", 0)))
        rec["axis"] = groups.get(group, {}).get("axis")
        out.append(rec)
    return out


class FlightRecorderSource:
    """Stands in for CollectiveRecorder on NCCL (the same reading interface: `name_axis`,
    `snapshot`, `group_table`, `last_issue_t`); nothing is installed."""

    stacks = False
    waits = None

    def __init__(self, rank: int):
        import os

        self.rank = rank
        # Only its size is read (timeline.py: has the ring buffer wrapped?).
        self.records: collections.deque = collections.deque(
            maxlen=int(os.environ.get("TORCH_FR_BUFFER_SIZE", "2000") or 2000))
        self._axes: dict[str, str] = {}
        self._cache: dict[str, Any] | None = None
        self._enqueued: Any = None
        self._changed_t = 0.0

    @property
    def last_issue_t(self) -> float:
        """Wall time at which a group's last enqueued collective was first seen to change (the
        watchdog's progress signal; it polls every 0.2 s from its own thread). Reads only the
        trace's per-group status, not its entries."""
        import time

        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json

            status = json.loads(_dump_fr_trace_json(includeCollectives=False)).get("pg_status")
        except Exception:  # noqa: BLE001 - no trace: progress comes from steps alone
            return self._changed_t
        now = {k: v.get("last_enqueued_collective") for k, v in (status or {}).items()}
        if now != self._enqueued:
            self._enqueued, self._changed_t = now, time.time()
        return self._changed_t

    def name_axis(self, group, axis: str) -> None:
        self._axes[group.group_name] = axis

    def install(self) -> None:
        """Nothing to install: ProcessGroupNCCL records by itself."""

    def uninstall(self) -> None:
        """Nothing to remove."""

    def wall(self, t: float | None) -> float | None:
        return t

    def _trace(self) -> dict[str, Any]:
        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json

            fr = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
        except Exception:  # noqa: BLE001 - a dump must never fail because of it
            fr = {}
        self._cache = fr
        return fr

    def _groups(self, fr: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The trace's groups, completed from this process's own process groups where the
        trace's pg_config lacks them (gloo leaves it unfilled)."""
        groups = groups_from_trace(fr, self._axes)
        names = {str((e.get("process_group") or ["?"])[0]) for e in fr.get("entries") or []}
        for name in names - {n for n, g in groups.items() if g["ranks"]}:
            try:
                import torch.distributed as dist
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(name)
                groups[name] = {"ranks": list(dist.get_process_group_ranks(pg)),
                                "axis": self._axes.get(name),
                                "desc": getattr(pg, "group_desc", "") or ""}
            except (RuntimeError, ValueError, KeyError):
                continue
        return groups

    def group_table(self) -> dict[str, dict[str, Any]]:
        return self._groups(self._cache if self._cache is not None else self._trace())

    def snapshot(self) -> list[dict[str, Any]]:
        fr = self._trace()
        return records_from_trace(fr, self.rank, self._groups(fr))
