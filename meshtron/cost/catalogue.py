"""Prices and power per GPU type (keys: the planner's GPU catalogue names, cluster.py).

Prices are USD per GPU-hour. On-demand defaults are AWS list prices of the 8-GPU instance divided
by 8 (us-east-1, Linux): p3.16xlarge $24.48/h (V100, list since 2017), p4d.24xlarge $32.77/h
(A100 40GB, launch 2020-11), p4de.24xlarge $40.97/h (A100 80GB, 2022), p5.48xlarge $98.32/h
(H100, launch 2023-07; The Next Platform, 2023-07-27), p6-b200.48xlarge $113.93/h (B200, 2025).
H200: no list price checked here; the H100 figure is used (same die, p5e list unverified).
Spot defaults are 40% of on-demand: hyperscaler H100 spot ran 50-65% below on-demand in Q1 2026
(Digiteria Labs, "Cloud GPU Pricing Shifts in Q1 2026"); we take the middle. Smaller clouds rent
H100s at $2-3 per GPU-hour on demand: give your own with --price-on-demand / --price-spot or a
price TOML (`load_price_overrides`), or `price_per_gpu_hour` in the cluster file.

Power: `tdp_w` is the GPU's maximum board power from NVIDIA's datasheets (V100 SXM2 300 W,
A100 SXM4 400 W, H100 SXM5 700 W, H200 SXM 700 W, B200 1000 W); `system_w_per_gpu` is the
reference DGX system's maximum power divided by its 8 GPUs (DGX-1 3.5 kW, DGX A100 6.5 kW,
DGX H100/H200 10.2 kW, DGX B200 14.3 kW), i.e. what the wall meter sees with CPUs, NICs,
switches and fans. Energy = system power x time x PUE (facility overhead, default 1.2, a modern
hyperscale hall; the Uptime Institute's 2023 industry average is 1.58).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtron.errors import UserError
from meshtron.planner.cluster import GPU_CATALOGUE, ClusterSpec, gpu_type

SPOT_FRACTION = 0.4
"""Default spot price as a fraction of on-demand (module docstring)."""
DEFAULT_PUE = 1.2
"""Facility power usage effectiveness assumed when --pue is not given."""


@dataclass(frozen=True)
class GpuEconomics:
    """Price and power of one GPU type."""

    on_demand: float
    """On-demand price, USD per GPU-hour."""
    spot: float
    """Spot / preemptible price, USD per GPU-hour."""
    tdp_w: float
    """Maximum board power of the GPU, watts (datasheet)."""
    system_w_per_gpu: float
    """Server power per GPU (reference system's maximum / GPUs), watts."""
    source: str
    """Where the defaults come from, for the output."""

    def __post_init__(self) -> None:
        for name in ("on_demand", "spot", "tdp_w", "system_w_per_gpu"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise UserError(f"{name}={value!r}: must be a finite number >= 0")
        if self.system_w_per_gpu < self.tdp_w:
            raise UserError(f"system_w_per_gpu={self.system_w_per_gpu!r}: must be at least the "
                            f"GPU's own power tdp_w={self.tdp_w!r}")


def _aws(instance_usd_h: float, tdp: float, system: float, src: str) -> GpuEconomics:
    od = instance_usd_h / 8.0
    return GpuEconomics(od, od * SPOT_FRACTION, tdp, system, src)


DEFAULTS: dict[str, GpuEconomics] = {
    "V100-SXM2-32GB": _aws(24.48, 300.0, 3500 / 8, "AWS p3.16xlarge list (2017)"),
    "A100-SXM4-40GB": _aws(32.77, 400.0, 6500 / 8, "AWS p4d.24xlarge list (2020-11)"),
    "A100-SXM4-80GB": _aws(40.97, 400.0, 6500 / 8, "AWS p4de.24xlarge list (2022)"),
    "H100-SXM5-80GB": _aws(98.32, 700.0, 10200 / 8, "AWS p5.48xlarge list (2023-07)"),
    "H200-SXM-141GB": _aws(98.32, 700.0, 10200 / 8,
                           "H100's AWS p5.48xlarge list (2023-07); H200 list unverified"),
    "B200": _aws(113.93, 1000.0, 14300 / 8, "AWS p6-b200.48xlarge list (2025)"),
}
assert set(DEFAULTS) == set(GPU_CATALOGUE), "every catalogue GPU needs a price and a power"


def economics_for(cluster: ClusterSpec, on_demand: float | None = None,
                  spot: float | None = None, tdp_w: float | None = None,
                  system_w: float | None = None,
                  overrides: dict[str, dict[str, float]] | None = None) -> GpuEconomics:
    """The cluster GPU's figures: defaults, then a price TOML's table for that GPU, then the
    cluster file's price_per_gpu_hour (on-demand), then explicit flags; a spot price nobody gave
    is SPOT_FRACTION of the on-demand one. A cluster described by numbers only (no `gpu`) must
    be given an on-demand price and a power."""
    base = DEFAULTS.get(cluster.gpu) if cluster.gpu else None
    fields: dict[str, Any] = dict(vars(base)) if base else {}
    sources = [base.source] if base else []
    spot_given = False
    if cluster.gpu and overrides and cluster.gpu in overrides:
        fields.update(overrides[cluster.gpu])
        spot_given = "spot" in overrides[cluster.gpu]
        sources.append("price file")
    if cluster.price_per_gpu_hour is not None:
        fields["on_demand"] = cluster.price_per_gpu_hour
        sources.append("cluster file")
    given = {"on_demand": on_demand, "spot": spot, "tdp_w": tdp_w, "system_w_per_gpu": system_w}
    if any(v is not None for v in given.values()):
        fields.update({k: v for k, v in given.items() if v is not None})
        spot_given = spot_given or spot is not None
        sources.append("flags")
    if not spot_given and "on_demand" in fields:
        fields["spot"] = fields["on_demand"] * SPOT_FRACTION  # spot follows a given on-demand
    if not sources:
        sources = ["flags"]
    fields["source"] = sources[0] + (f" (overridden by {', '.join(sources[1:])})"
                                     if len(sources) > 1 else "")
    if "tdp_w" in fields and "system_w_per_gpu" not in fields:
        fields["system_w_per_gpu"] = fields["tdp_w"]
    missing = [k for k in ("on_demand", "tdp_w") if k not in fields]
    if missing:
        flag = {"on_demand": "--price-on-demand USD/GPU-hour", "tdp_w": "--gpu-watts W"}
        raise UserError(f"cluster {cluster.name!r} names no catalogue GPU (cluster.gpu: one of "
                        f"{', '.join(DEFAULTS)}), so it has no catalogue price or power; give "
                        f"{' and '.join(flag[k] for k in missing)}")
    return GpuEconomics(**fields)


def load_price_overrides(path: str) -> dict[str, dict[str, float]]:
    """A price TOML: one table per GPU (catalogue name or alias) with any of on_demand, spot,
    tdp_w, system_w_per_gpu, e.g. ``[H100] on_demand = 2.5  spot = 1.2``."""
    from meshtron.config import load_toml

    doc = load_toml(path, field="prices")
    allowed = {"on_demand", "spot", "tdp_w", "system_w_per_gpu"}
    out: dict[str, dict[str, float]] = {}
    for gpu, table in doc.items():
        name = gpu_type(gpu, field=f"prices.{gpu}").name  # unknown GPU -> UserError
        if not isinstance(table, dict):
            raise UserError(f"prices.{gpu}={table!r}: must be a table of "
                            f"{', '.join(sorted(allowed))}")
        for key, value in table.items():
            if key not in allowed:
                raise UserError(f"prices.{gpu}.{key}: unknown key; allowed: "
                                f"{', '.join(sorted(allowed))}")
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise UserError(f"prices.{gpu}.{key}={value!r}: must be a number >= 0")
        out[name] = {k: float(v) for k, v in table.items()}
    return out
