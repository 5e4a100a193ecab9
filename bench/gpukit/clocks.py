"""The GPU's SM clock, power and temperature during a profiler window, sampled on a background
thread: whether a GEMM rate below the datasheet's comes from a power- or heat-limited clock
(the first H200 run measured GEMMs falling from 763 to 705 TFLOP/s as they filled more of the
step, and recorded no clock).

Readers, the first that works (feature-detected, never assumed):
- `pynvml` (nvidia-ml-py): clock, power, temperature, the clock-limit reasons bitmask, the
  maximum SM clock and the enforced power limit;
- torch.cuda.clock_rate / power_draw / temperature (they need pynvml too, but a torch build may
  bring its own);
- `nvidia-smi --query-gpu ... -lms` (one process for the window, its lines read as they come).
On CPU (dry run) nothing is sampled: every figure is null and `reason` says why.

A sampler never touches a CUDA stream: no host sync is added to the window.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any, Callable

FIELDS = ("sm_clock_mhz", "power_w", "temperature_c")
INTERVAL_S = 0.05
REASON_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap",
               0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal",
               0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}
"""NVML's clocks event (throttle) reasons: sw_power_cap is the power limit holding the clock."""


def reasons(mask: int | None) -> list[str] | None:
    if mask is None:
        return None
    return [name for bit, name in REASON_BITS.items() if mask & bit]


class Sampler:
    """`read()` -> {field: value, "reasons": mask} every `interval_s` while started."""

    def __init__(self, read: Callable[[], dict[str, Any]], source: str,
                 static: dict[str, Any] | None = None, interval_s: float = INTERVAL_S,
                 close: Callable[[], None] | None = None):
        self.read, self.source, self.static = read, source, static or {}
        self.interval_s, self._close = interval_s, close
        self.samples: list[dict[str, Any]] = []
        self.t0_unix_ns: int | None = None
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        # the profiler's timestamps are on the same Unix-epoch clock (time.time_ns): a sample
        # can be placed on the kernel timeline
        self.t0_unix_ns = time.time_ns()
        t0 = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.samples.append({"t_s": time.perf_counter() - t0, **self.read()})
            except Exception as exc:  # noqa: BLE001 - a failed read is recorded, never fatal
                if len(self.errors) < 3:
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._close is not None:
            self._close()

    def summary(self, keep: int = 200) -> dict[str, Any]:
        """min / median / max of each field, the clock-limit reasons seen (with how many
        samples had each), and the samples themselves (at most `keep`, evenly thinned)."""
        out: dict[str, Any] = {"source": self.source, "reason": None, **self.static,
                               "interval_s": self.interval_s, "n": len(self.samples),
                               "t0_unix_ns": self.t0_unix_ns}
        for f in FIELDS:
            vals = [s[f] for s in self.samples if s.get(f) is not None]
            out[f] = ({"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
                      if vals else None)
        seen: dict[str, int] = {}
        for s in self.samples:
            for name in reasons(s.get("reasons")) or []:
                seen[name] = seen.get(name, 0) + 1
        out["limit_reasons"] = seen if any(s.get("reasons") is not None for s in self.samples) \
            else None
        step = max(1, -(-len(self.samples) // keep))
        out["samples"] = [{k: v for k, v in s.items() if v is not None}
                          for s in self.samples[::step]]
        if self.errors:
            out["errors"] = self.errors
        if not self.samples:
            out["reason"] = f"{self.source}: no sample read" + (
                f" ({self.errors[0]})" if self.errors else "")
        return out


def unavailable(reason: str) -> dict[str, Any]:
    """The record of a window where no clock could be sampled."""
    return {"source": None, "reason": reason, "n": 0, "limit_reasons": None, "samples": [],
            **dict.fromkeys(FIELDS)}


def _nvml_handle(pynvml, dev):
    """NVML's handle of torch's `dev` (by UUID when torch knows it: CUDA_VISIBLE_DEVICES may
    renumber the devices torch sees)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        with contextlib.suppress(Exception):  # an NVML without this lookup: by index below
            return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-")
                                                    else f"GPU-{text}")
    return pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)


def working(candidates: dict[str, tuple[Callable[[], Any], ...]],
            required: str) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """Per field, the first candidate reader that answers now (NVML renames and deprecates
    calls across drivers: nvmlDeviceGetTemperature gave way to nvmlDeviceGetTemperatureV, the
    throttle reasons to the clocks event reasons), and why each field has none. A field
    without a reader reads as null; `required` without one fails the sampler (the next
    source is tried)."""
    chosen: dict[str, Callable[[], Any]] = {}
    why: dict[str, str] = {}
    for field, fns in candidates.items():
        for fn in fns:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - try the next candidate
                why[field] = f"{type(exc).__name__}: {exc}"[:160]
                continue
            chosen[field] = fn
            why.pop(field, None)
            break
        else:
            why.setdefault(field, "no reader in this version")
    if required not in chosen:
        raise RuntimeError(f"{required}: {why.get(required, 'no reader')}")
    return chosen, why


def _reader(chosen: dict[str, Callable[[], Any]], fields=(*FIELDS, "reasons")):
    def read() -> dict[str, Any]:
        return {f: (chosen[f]() if f in chosen else None) for f in fields}
    return read


def _nvml(dev) -> Sampler:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = _nvml_handle(pynvml, dev)
    except Exception:
        pynvml.nvmlShutdown()
        raise
    nv = {name: getattr(pynvml, name) for name in (
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature") if hasattr(pynvml, name)}
    temp = pynvml.NVML_TEMPERATURE_GPU
    chosen, why = working({
        "sm_clock_mhz": (lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),),
        "power_w": (lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,),  # milliwatts
        "temperature_c": tuple(lambda fn=nv[n]: fn(h, temp) for n in (
            "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature") if n in nv),
        "reasons": tuple(lambda fn=nv[n]: fn(h) for n in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons") if n in nv)}, "sm_clock_mhz")
    static: dict[str, Any] = {"unread": why or None}
    for key, fn in (("max_sm_clock_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(
            h, pynvml.NVML_CLOCK_SM)), ("power_limit_w", lambda: pynvml.
            nvmlDeviceGetEnforcedPowerLimit(h) / 1e3)):
        try:
            static[key] = fn()
        except Exception:  # noqa: BLE001 - optional figures
            static[key] = None
    return Sampler(_reader(chosen), "pynvml", static, close=pynvml.nvmlShutdown)


def _torch(dev) -> Sampler:
    """torch.cuda's readers (they call pynvml, or amdsmi on ROCm): each field on its own, so a
    torch or driver without one still samples the others."""
    import torch

    scale = {"power_w": 1e-3}  # power_draw: milliwatts
    chosen, why = working({f: ((lambda fn=fn, f=f: fn(dev) * scale.get(f, 1)),)
                           for f, name in (("sm_clock_mhz", "clock_rate"),
                                           ("power_w", "power_draw"),
                                           ("temperature_c", "temperature"))
                           if (fn := getattr(torch.cuda, name, None)) is not None},
                          "sm_clock_mhz")
    return Sampler(_reader(chosen, FIELDS), "torch.cuda", {"unread": why or None})


SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
SMI_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _smi(dev) -> Sampler:
    """`nvidia-smi -lms`: one process for the window, its CSV lines read as they come."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise RuntimeError("nvidia-smi is not on PATH")
    index = _smi_index(dev)
    # the reasons field was renamed in newer drivers; without it, clock and power still tell
    for extra in (*((r,) for r in SMI_REASONS), ()):
        query = ",".join(SMI_FIELDS + extra)
        probe = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                "-i", index], capture_output=True, text=True, timeout=10)
        if probe.returncode == 0:
            break
    else:
        raise RuntimeError(f"nvidia-smi --query-gpu failed: {probe.stderr.strip()[:160]}")
    proc = subprocess.Popen([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                             "-i", index, "-lms", str(int(INTERVAL_S * 1e3))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def read() -> dict[str, Any]:
        line = proc.stdout.readline()  # paced by nvidia-smi's own interval
        if not line:
            raise RuntimeError("nvidia-smi stopped")
        vals = [v.strip() for v in line.split(",")]
        out = {f: _num(v) for f, v in zip(FIELDS, vals)}
        out["reasons"] = int(vals[3], 16) if len(vals) > 3 and vals[3].startswith("0x") else None
        return out

    def close() -> None:
        proc.terminate()
        proc.wait(timeout=5)

    # the thread blocks in readline at most one nvidia-smi interval after the window ends
    return Sampler(read, "nvidia-smi", interval_s=0.0, close=close)


def _smi_index(dev) -> str:
    """nvidia-smi's index (or UUID) of torch's `dev`: CUDA_VISIBLE_DEVICES renumbers them."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    i = dev.index or 0
    return visible[i].strip() if i < len(visible) else str(i)


def _num(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


def sampler(dev) -> tuple[Sampler | None, str | None]:
    """The first reader that works for `dev`, or (None, why none does)."""
    if dev.type != "cuda":
        return None, f"{dev.type} device (dry run): no GPU clock to sample"
    why = []
    for name, make in (("pynvml", _nvml), ("torch.cuda", _torch), ("nvidia-smi", _smi)):
        try:
            return make(dev), None
        except Exception as exc:  # noqa: BLE001 - try the next reader
            why.append(f"{name}: {type(exc).__name__}: {exc}"[:160])
    return None, "; ".join(why)
