"""The Plan (what `meshtron plan --save` writes and `meshtron train` reads) and fixed knobs.

Plan TOML, format "meshtron-plan/1" (every key at top level except the optional [predicted]
table; all sizes in sequences or layers, not tokens)::

    format = "meshtron-plan/1"
    model = "llama3-70b"          # preset name or path the plan was made for
    cluster = "dgx-h100:16"       # preset or cluster file it was made for
    gpus = 128                    # = tp * pp * dp
    global_batch = 1024           # sequences per optimizer step
    seq_len = 8192                # tokens per sequence
    tp = 8                        # tensor-parallel degree (inside a node)
    pp = 4                        # pipeline stages
    dp = 4                        # data-parallel replicas
    zero = 1                      # ZeRO stage 0..3 over the data-parallel group
    micro_batch = 1               # sequences per micro-batch per replica
    num_microbatches = 256        # = global_batch / (dp * micro_batch), for convenience
    recompute = "selective"       # "none" | "selective" | "full"
    sp = true                     # sequence parallelism (with tp > 1)
    schedule = "interleaved"      # "1f1b" | "interleaved" | "zb" | "gpipe"
    virtual_stages = 2            # model chunks per GPU (interleaved only, else 1)
    stage_layers = [10, 10, ...]  # layers per (virtual) stage in pipeline order; length
                                  # pp * virtual_stages; virtual stage j lives on GPU stage j % pp;
                                  # the embedding is on the first, the LM head on the last
    attention = "flash"           # kernel the prediction assumed: "flash" | "unfused"

    [predicted]                   # the planner's estimate, for predicted-vs-measured reports
    step_time_s = 10.2
    tokens_per_s = 822000.0
    memory_gib = 61.3
    mfu = 0.41

Unknown keys are rejected; `load_plan(path)` validates everything `Plan` validates.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from meshtron.errors import UserError
from meshtron.planner.pipeline import SCHEDULES

FORMAT = "meshtron-plan/1"
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


def _pos_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{name}={value!r}: must be a positive integer")


@dataclass(frozen=True)
class Plan:
    """One parallel layout with all its knobs; the contract between planner and trainer."""

    model: str
    """Model preset name or path the plan was made for."""
    cluster: str
    """Cluster preset or file the plan was made for."""
    gpus: int
    """Total GPUs; equals tp * pp * dp."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    tp: int
    """Tensor-parallel degree (inside one node)."""
    pp: int
    """Pipeline-parallel degree (number of GPU stages)."""
    dp: int
    """Data-parallel degree."""
    zero: int
    """ZeRO stage 0-3 over the data-parallel group."""
    micro_batch: int
    """Sequences per micro-batch per data-parallel replica."""
    recompute: str
    """Activation recomputation: 'none', 'selective' (attention core) or 'full'."""
    sp: bool
    """Sequence parallelism for the norm/dropout regions (meaningful with tp > 1)."""
    schedule: str
    """Pipeline schedule: '1f1b', 'interleaved', 'zb' (ZB-H1) or 'gpipe'."""
    virtual_stages: int
    """Model chunks per GPU stage (> 1 only with the interleaved schedule)."""
    stage_layers: list[int]
    """Layers per virtual stage in pipeline order, length pp * virtual_stages."""
    attention: str = "flash"
    """Attention kernel the prediction assumed ('flash' or 'unfused')."""
    predicted: dict[str, float] = field(default_factory=dict)
    """The planner's estimate (step_time_s, tokens_per_s, memory_gib, mfu, ...)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "seq_len", "tp", "pp", "dp", "micro_batch",
                     "virtual_stages"):
            _pos_int(f"plan.{name}", getattr(self, name))
        if self.tp * self.pp * self.dp != self.gpus:
            raise UserError(f"plan.gpus={self.gpus}: must equal tp*pp*dp = "
                             f"{self.tp}*{self.pp}*{self.dp} = {self.tp * self.pp * self.dp}")
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise UserError(f"plan.zero={self.zero!r}: allowed values are 0, 1, 2, 3")
        if self.recompute not in RECOMPUTE:
            raise UserError(f"plan.recompute={self.recompute!r}: allowed values are "
                             f"{', '.join(RECOMPUTE)}")
        if not isinstance(self.sp, bool):
            raise UserError(f"plan.sp={self.sp!r}: must be true or false")
        if self.schedule not in SCHEDULES:
            raise UserError(f"plan.schedule={self.schedule!r}: allowed values are "
                             f"{', '.join(SCHEDULES)}")
        if self.virtual_stages != 1 and self.schedule != "interleaved":
            raise UserError(f"plan.virtual_stages={self.virtual_stages}: must be 1 unless "
                             "schedule is 'interleaved'")
        if self.global_batch % (self.dp * self.micro_batch):
            raise UserError(f"plan.global_batch={self.global_batch}: must be divisible by "
                             f"dp*micro_batch = {self.dp * self.micro_batch}")
        if (not isinstance(self.stage_layers, list)
                or len(self.stage_layers) != self.pp * self.virtual_stages
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                       for n in self.stage_layers)):
            raise UserError(f"plan.stage_layers={self.stage_layers!r}: must list "
                             f"pp*virtual_stages = {self.pp * self.virtual_stages} positive layer counts")
        if self.attention not in ("flash", "unfused"):
            raise UserError(f"plan.attention={self.attention!r}: allowed values are flash, unfused")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)

    def layout(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT}
        for f in dataclasses.fields(self):
            if f.name == "predicted":
                continue
            d[f.name] = getattr(self, f.name)
        d["num_microbatches"] = self.num_microbatches
        if self.predicted:
            d["predicted"] = dict(self.predicted)
        return d

    def to_toml(self) -> str:
        header = ("# meshtron plan: parallel layout for `meshtron train` "
                  "(schema: meshtron/planner/plan.py)\n")
        return header + tomli_w.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        data = dict(data)
        fmt = data.pop("format", FORMAT)
        if fmt != FORMAT:
            raise UserError(f"plan.format={fmt!r}: allowed value is {FORMAT!r}")
        derived = data.pop("num_microbatches", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"plan.{unknown[0]}: unknown key; allowed: {', '.join(sorted(names))}")
        missing = sorted(n for n in names - set(data) if n not in ("attention", "predicted"))
        if missing:
            raise UserError(f"plan.{missing[0]}: missing")
        plan = cls(**data)
        if derived is not None and derived != plan.num_microbatches:
            raise UserError(f"plan.num_microbatches={derived!r}: must equal "
                             f"global_batch/(dp*micro_batch) = {plan.num_microbatches}")
        return plan

    @classmethod
    def from_toml(cls, text: str) -> "Plan":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"plan: not valid TOML ({exc})") from None
        return cls.from_dict(data)


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan written by `meshtron plan --save`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan={str(path)!r}: file does not exist")
    return Plan.from_toml(path.read_text())


# ---- fixed knobs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """Knobs fixed by the user; None leaves a knob to the search."""

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
    """'none', 'selective' or 'full'."""
    sp: bool | None = None
    """Sequence parallelism."""
    schedule: str | None = None
    """'1f1b', 'interleaved', 'zb' or 'gpipe'."""
    virtual_stages: int | None = None
    """Virtual stages of the interleaved schedule."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "virtual_stages"):
            value = getattr(self, name)
            if value is not None:
                _pos_int(name, value)
        if self.zero is not None and (self.zero not in ZERO_STAGES or isinstance(self.zero, bool)):
            raise UserError(f"zero={self.zero!r}: allowed values are 0, 1, 2, 3")
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise UserError(f"recompute={self.recompute!r}: allowed values are {', '.join(RECOMPUTE)}")
        if self.sp is not None and not isinstance(self.sp, bool):
            raise UserError(f"sp={self.sp!r}: allowed values are on, off")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise UserError(f"schedule={self.schedule!r}: allowed values are 1f1b, "
                             "interleaved[:V], zb, gpipe")
        if (self.virtual_stages is not None and self.virtual_stages > 1
                and self.schedule not in (None, "interleaved")):
            raise UserError(f"schedule={self.schedule!r}: virtual stages "
                             f"({self.virtual_stages}) need the interleaved schedule")

    @classmethod
    def of(cls, fixed: "Knobs | dict[str, Any] | None") -> "Knobs":
        if fixed is None:
            return cls()
        if isinstance(fixed, Knobs):
            return fixed
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fixed) - names)
        if unknown:
            raise UserError(f"{unknown[0]}: unknown knob; allowed: {', '.join(sorted(names))}")
        values = dict(fixed)
        if isinstance(values.get("schedule"), str) and ":" in values["schedule"]:
            sched, v = parse_schedule(values["schedule"])
            values["schedule"], values["virtual_stages"] = sched, v
        if isinstance(values.get("sp"), str):
            values["sp"] = parse_on_off("sp", values["sp"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def complete(self) -> bool:
        return all(getattr(self, f) is not None for f in
                   ("tp", "pp", "dp", "zero", "micro_batch", "recompute", "sp", "schedule"))


def parse_layout(text: str) -> dict[str, int]:
    """'tp=8,pp=16,dp=64' (any subset) -> {'tp': 8, 'pp': 16, 'dp': 64}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(tp|pp|dp)\s*=\s*(\d+)", part)
        if not m:
            raise UserError(f"layout={text!r}: expected comma-separated tp=N, pp=N, dp=N")
        key, value = m.group(1), int(m.group(2))
        if value <= 0:
            raise UserError(f"layout {key}={value}: must be a positive integer")
        if key in out:
            raise UserError(f"layout={text!r}: {key} given twice")
        out[key] = value
    if not out:
        raise UserError(f"layout={text!r}: expected comma-separated tp=N, pp=N, dp=N")
    return out


def parse_schedule(text: str) -> tuple[str, int | None]:
    """'1f1b' | 'interleaved' | 'interleaved:3' | 'zb' | 'gpipe' -> (schedule, virtual stages)."""
    m = re.fullmatch(r"(1f1b|interleaved|zb|gpipe)(?::(\d+))?", text.strip().lower())
    if not m:
        raise UserError(f"schedule={text!r}: allowed values are 1f1b, interleaved, "
                         "interleaved:V, zb, gpipe")
    sched, v = m.group(1), m.group(2)
    if v is not None:
        if sched != "interleaved":
            raise UserError(f"schedule={text!r}: only 'interleaved' takes a virtual-stage count")
        if int(v) < 2:
            raise UserError(f"schedule={text!r}: interleaving needs at least 2 virtual stages")
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
                schedule: str | None = None) -> dict[str, Any]:
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
    return fixed
