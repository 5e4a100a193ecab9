"""The pieces every output of a plan search shares (planner/report.py's JSON,
report_table.py's table, report_warnings.py's warnings): number formatting, the cost model's
options as one line, the best plan's time and memory lines, the layers per pipeline rank and
the stack a result was priced for."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.planner.estimate import Estimate
from meshtron.planner.search import SearchResult


def framework_of(result: SearchResult):
    """The stack a result was priced for: its framework, else the default preset's."""
    from meshtron.planner.frameworks import preset

    return result.framework if result.framework is not None else preset(None)


def layers_per_gpu(est: Estimate) -> list[int]:
    """Layers per pipeline rank (stage_layers lists the virtual stages in pipeline order; torch's
    V holds stages r and 2pp-1-r on rank r: Estimate.layers_per_rank)."""
    return est.layers_per_rank


def options_dict(options: Any) -> dict[str, Any]:
    """Every field of the cost model's options (a dataclass), whatever fields it grows."""
    if dataclasses.is_dataclass(options):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return dict(vars(options))


HEADLINE_OPTIONS = ("stack", "attention", "dropout", "sharding")
"""Cost-model options every text output states; the others appear only when they differ from
their defaults (a planning run for meshtron's own runtime leaves them all at default). The JSON
output carries all of them."""


def options_line(options: Any, dtype: str) -> str:
    """'stack=eager, attention=flash, ..., dtype=bf16': the assumptions behind every figure."""
    values = options_dict(options)
    defaults = options_dict(type(options)()) if dataclasses.is_dataclass(options) else {}
    shown = [n for n in HEADLINE_OPTIONS if n in values]
    shown += [n for n in values if n not in HEADLINE_OPTIONS and defaults.get(n, ...) != values[n]]
    parts = []
    for name in shown:
        value = values[name]
        if isinstance(value, bool):
            value = "on" if value else "off"
        parts.append(f"{name}={value}")
    return ", ".join(parts + [f"dtype={dtype}"])


def fmt_count(x: float) -> str:
    """1234 -> '1.23K', 6.7e9 -> '6.74B': three significant digits with a unit (rounded
    before the unit is picked: 999.9e6 -> '1B', not '1e+03M')."""
    x = float(f"{x:.3g}")
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def fmt_tokens(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"


def fmt_s(x: float) -> str:
    """Seconds, three significant digits; an exact zero stays '0'."""
    if x == 0:
        return "0"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def fmt_gib(x: float) -> str:
    """GiB: one decimal from 0.1 up (a GPU's tens), two significant digits below (a small
    model's parameters, 0.00023 GiB, read '0.0' and all its memory columns alike); an exact
    zero stays '0.0'."""
    if x == 0 or x >= 0.1:
        return f"{x:.1f}"
    return f"{x:.2g}"


def fmt_tflops(x: float) -> str:
    """TFLOP/s per GPU: whole numbers from 1 up (a GPU's hundreds), two significant digits
    below (a CPU device's 0.05 would print '0'); an exact zero stays '0'."""
    if x == 0 or x >= 1:
        return f"{x:.0f}"
    return f"{x:.2g}"


def fmt_days(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def breakdown_line(est: Estimate) -> str:
    t = est.time
    layers = "tensor/context-parallel" if est.config.cp > 1 else "tensor-parallel"
    return (f"step {fmt_s(est.step_time_s)} s = compute {fmt_s(t.compute)} + {layers} "
            f"{fmt_s(t.tp_comm)} + pipeline {fmt_s(t.pp_comm)} + data-parallel exposed "
            f"{fmt_s(t.dp_comm)} + bubble {fmt_s(t.bubble)} + optimizer {fmt_s(t.optimizer)}"
            + (f" (on the host) + host-link copies {fmt_s(t.offload)} (offload="
               f"{est.config.offload})" if est.config.offload != "none" else "")
            + (f" + expert all-to-all {fmt_s(t.ep_comm)}" if t.ep_comm else "")
            # TimeBreakdown.step_host is Composer's train-metric sync, no other stack's
            + (f" + train-metric sync on the host at the step's end {fmt_s(t.step_host)}"
               if t.step_host else "")
            # TimeBreakdown.fp8_sync: Transformer Engine's delayed-scaling amax all-reduces
            + (f" + FP8 amax all-reduces {fmt_s(t.fp8_sync)}" if t.fp8_sync else ""))


def memory_line(est: Estimate) -> str:
    m = est.memory
    return (f"memory of the fullest {m.device} (stage {m.stage}, {m.dtype}): {m.describe()} = "
            f"{m.total:.3g} of {m.capacity:g} GiB" + host_text(m))


def host_text(m) -> str:
    """'; host memory per node ...' for a plan with host offload, else ''."""
    if not m.host:
        return ""
    cap = "unknown capacity" if m.host_capacity is None else f"{m.host_capacity:.4g} GiB usable"
    return f"; host memory per node (offload): {m.host:.4g} GiB of {cap}"
