"""Knobs fixed by the user for the search (`Knobs`), validated by the plan's own rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from meshtron.errors import UserError
from meshtron.planner.plan import Plan
from meshtron.planner.plan_parse import parse_on_off, parse_schedule
from meshtron.planner.plan_rules import check

@dataclass(frozen=True)
class Knobs:
    """Knobs fixed by the user for the search; None leaves a knob to the search. Validated by
    the same rules as Plan (`plan_problems`), applied to the values given."""

    tp: int | None = None
    """Tensor-parallel degree."""
    pp: int | None = None
    """Pipeline-parallel degree."""
    dp: int | None = None
    """Data-parallel degree."""
    zero: int | None = None
    """ZeRO stage."""
    micro_batch: int | None = None
    """Micro-batch size in sequences."""
    recompute: str | None = None
    """'none', 'selective', 'half' or 'full'."""
    sp: bool | None = None
    """Sequence parallelism."""
    schedule: str | None = None
    """'1f1b', 'interleaved', 'zb' or 'gpipe'."""
    virtual_stages: int | None = None
    """Virtual stages per GPU stage."""
    dtype: str | None = None
    """The run's precision ('bf16' or 'fp32'); not searched, the planner's default when None."""
    dp_replicate: int | None = None
    """HSDP replica groups (with zero 2/3); not searched, 1 when None."""
    cp: int | None = None
    """Context-parallel degree (None: searched)."""
    reduce_dtype: str | None = None
    """Gradient reduction dtype; not searched (the framework's default when None)."""
    accumulate_unsharded: bool | None = None
    """ZeRO-2/3 unsharded accumulation; not searched (False when None)."""
    ep: int | None = None
    """Expert-parallel degree (MoE; None: searched where the planner searches it, else 1)."""
    etp: int | None = None
    """Expert tensor-parallel degree (Megatron-Core's folding, Plan.etp); not searched (the
    stack's own when None)."""
    compile: bool | None = None
    """Per-block torch.compile; not searched (the framework's default when None). True prices
    the 'fused' stack (compute.py: what `--compile` runs)."""
    async_tp: bool | None = None
    """Asynchronous TP (needs compile, tp > 1 and sp); not searched (False when None). True
    prices the TP collectives overlapped with the matmuls (kernel_options.py `KernelOptions.async_tp`)."""
    fp8_recipe: str | None = None
    """torchao float8 scaling with dtype fp8 ('rowwise' when None)."""
    pipeline_runs: int | None = None
    """Pipeline schedule runs per optimizer step (Plan.pipeline_runs); not searched (1 when
    None: one schedule of all micro-batches)."""
    offload: str | None = None
    """Host offload ('none', 'optimizer', 'full'; None: chosen only when nothing else fits)."""

    def __post_init__(self) -> None:
        check(self.to_dict(), runtime=False)  # runtime limits: the search applies them

    @classmethod
    def of(cls, fixed: "Knobs | Any | Mapping[str, Any] | None") -> "Knobs":
        if fixed is None:
            return cls()
        if isinstance(fixed, Knobs):
            return fixed
        if isinstance(fixed, Plan):
            return cls(**{f.name: getattr(fixed, f.name) for f in dataclasses.fields(cls)})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fixed) - names)
        if unknown:
            raise UserError(f"{unknown[0]}: unknown knob; allowed: {', '.join(sorted(names))}")
        values = dict(fixed)
        if isinstance(values.get("schedule"), str):
            sched, v = parse_schedule(values["schedule"])
            values["schedule"] = sched
            if v is not None and values.get("virtual_stages") is None:
                values["virtual_stages"] = v
        if isinstance(values.get("sp"), str):
            values["sp"] = parse_on_off("sp", values["sp"])
        if values.get("pp") == 1 and values.get("schedule") == "1f1b" \
                and values.get("virtual_stages") in (None, 1):
            values["schedule"] = None  # the old spelling of "no pipeline"
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
