"""Command-line spellings of plan knobs (`plan` and `train` share these flags): layouts,
schedules, on/off values."""

from __future__ import annotations

import re
from typing import Any

from meshtron.errors import UserError

LAYOUT_AXES = ("tp", "cp", "pp", "dp", "dp_replicate", "ep", "etp")
_LAYOUT_WORDS = ", ".join(f"{axis}=N" for axis in LAYOUT_AXES)


def parse_layout(text: str) -> dict[str, int]:
    """'tp=8,cp=2,pp=16,dp=64,ep=8' (any subset) -> {'tp': 8, 'cp': 2, 'pp': 16, 'dp': 64,
    'ep': 8}; ep is folded over the dp x cp ranks, it does not multiply the world size.
    'etp=N' (expert tensor parallelism, Megatron-Core's folding: ep*etp divides tp*cp*dp).
    'dp_replicate=N' (the Plan's field: HSDP, dp split into N replicas of dp/N-rank sharded
    groups; ZeRO-2/3) names the replicate axis; the Plan's validity function judges it."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(rf"({'|'.join(LAYOUT_AXES)})\s*=\s*(\d+)", part)
        if not m:
            raise UserError(f"layout={text!r}: expected comma-separated {_LAYOUT_WORDS}")
        key, value = m.group(1), int(m.group(2))
        if value <= 0:
            raise UserError(f"layout {key}={value}: must be a positive integer")
        if key in out:
            raise UserError(f"layout={text!r}: {key} given twice")
        out[key] = value
    if not out:
        raise UserError(f"layout={text!r}: expected comma-separated {_LAYOUT_WORDS}")
    return out


def parse_schedule(text: str) -> tuple[str, int | None]:
    """'1f1b' | 'interleaved' | 'interleaved:3' | 'zb' | 'zbv' | 'gpipe' | 'gpipe:2' | 'dualpipe' |
    'dualpipev' -> (schedule, virtual stages or None when not given). 'gpipe:V' is torch's
    ScheduleLoopedBFS: V chunks per rank, every forward of a chunk before the next's
    (meshtron/parallel/pipeline.py)."""
    m = re.fullmatch(r"(1f1b|interleaved|zbv|zb|gpipe|dualpipev|dualpipe)(?::(\d+))?",
                     text.strip().lower())
    if not m:
        raise UserError(f"schedule={text!r}: allowed values are 1f1b, interleaved, "
                         "interleaved:V, zb, zbv, gpipe, gpipe:V, dualpipe, dualpipev")
    sched, v = m.group(1), m.group(2)
    if sched == "zbv":
        if v is not None:
            raise UserError(f"schedule={text!r}: zbv always has 2 virtual stages")
        return "zb", 2
    if sched == "dualpipev":  # DeepSeek's cut-in-half V (planner/pipeline_dualpipe.py)
        if v is not None:
            raise UserError(f"schedule={text!r}: dualpipev always has 2 virtual stages")
        return "dualpipe", 2
    if v is not None:
        if sched not in ("interleaved", "gpipe"):
            raise UserError(f"schedule={text!r}: only 'interleaved' and 'gpipe' (looped BFS) "
                            "take a virtual-stage count")
        if int(v) < 2:
            raise UserError(f"schedule={text!r}: a virtual-stage count must be at least 2")
        return sched, int(v)
    return sched, (1 if sched != "interleaved" else None)


def parse_on_off(name: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("on", "true", "yes", "1"):
        return True
    if t in ("off", "false", "no", "0"):
        return False
    raise UserError(f"{name}={text!r}: allowed values are on, off")


def fixed_knobs(layout: str | None = None, zero: int | None = None, recompute: str | None = None,
                sp: str | None = None, micro_batch: int | None = None,
                schedule: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Knobs fixed on a command line (`plan` and `train` share these flags); unset stay open."""
    fixed: dict[str, Any] = {}
    if layout:
        fixed.update(parse_layout(layout))
    if zero is not None:
        fixed["zero"] = zero
    if recompute is not None:
        fixed["recompute"] = recompute.strip().lower()
    if sp is not None:
        fixed["sp"] = parse_on_off("sp", sp)
    if micro_batch is not None:
        fixed["micro_batch"] = micro_batch
    if schedule is not None:
        sched, v = parse_schedule(schedule)
        fixed["schedule"] = sched
        if v is not None:
            fixed["virtual_stages"] = v
    if dtype is not None:
        fixed["dtype"] = dtype.strip().lower()
    return fixed
