"""The kit's idle summary (the JSON's `idle`, near its top, and one printed line per profiled
engine): for every throughput case's profiler window, the idle per micro-batch, how much of it
had the host late (hostbound.py), the caching allocator's retries and device frees
(allocator.py) and whether expandable segments were on; and eager beside eager_expandable
(the same step with expandable segments), so one call says whether the idle falls.

Reads the finished cases' records only (no torch): the driver rewrites it after every case.
"""

from __future__ import annotations

from typing import Any, Iterator

from gpukit import allocator, hostbound

PAIR = ("eager", "eager_expandable")


def _engines(result: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(engine key, engine record) of each profiled engine of a case's result: `run` (eager,
    compile), bf16 / fp8, offloaded, meshtron / hf."""
    for key, val in result.items():
        if isinstance(val, dict) and isinstance(val.get("profile"), dict):
            yield key, val


def _ms(x: float | None) -> float | None:
    return None if x is None else x / 1e3


def row(engine: dict[str, Any]) -> dict[str, Any]:
    """One profiled engine's idle figures (module docstring)."""
    prof = engine["profile"]
    host = prof.get("host") or {}
    alloc = prof.get("allocator") or {}
    timed = engine.get("allocator_timed_steps") or {}
    return {
        "source": host.get("source"),
        "micro_batches_in_window": host.get("micro_batches_in_window"),
        "idle_ms_per_micro_batch": _ms(host.get("idle_us_per_micro_batch")),
        "host_late_ms_per_micro_batch": _ms(host.get("host_late_us_per_micro_batch")),
        "device_wait_ms_per_micro_batch": _ms(host.get("device_wait_us_per_micro_batch")),
        "host_issue_over_gpu_busy": host.get("host_issue_over_gpu_busy"),
        "kernels_per_micro_batch": host.get("kernels_per_micro_batch"),
        "alloc_calls_per_micro_batch": (host.get("runtime") or {}).get(
            "alloc_calls_per_micro_batch"),
        "allocator_retries": alloc.get("retries"),
        "device_frees": alloc.get("device_frees"),
        "device_allocs": alloc.get("device_allocs"),
        "allocator_syncs": alloc.get("syncs"),
        "allocator_retries_timed_steps": timed.get("retries"),
        "reserved_minus_allocated_peak_bytes": alloc.get("reserved_minus_allocated_peak_bytes"),
        "expandable_segments": allocator.expandable_on(alloc),
        "step_time_s": engine.get("step_time_s"),
        "tokens_per_s": engine.get("tokens_per_s"),
        "verdict": hostbound.verdict(host),
        "allocator": allocator.verdict(alloc)}


def summary(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """case[.engine] -> row, for every finished case with a profiled engine; `expandable_vs
    _default` once both eager cases have one."""
    out: dict[str, Any] = {}
    for name, rec in cases.items():
        for key, engine in _engines(rec.get("result") or {}):
            try:
                out[name if key == "run" else f"{name}.{key}"] = row(engine)
            except Exception as exc:  # noqa: BLE001 - a summary never costs the JSON
                out[name if key == "run" else f"{name}.{key}"] = {
                    "error": f"{type(exc).__name__}: {exc}"[:300]}
    a, b = (out.get(k) or {} for k in PAIR)
    if a.get("idle_ms_per_micro_batch") is not None and b.get("idle_ms_per_micro_batch") \
            is not None:
        same = all(_run(cases, PAIR[0]).get(k) == _run(cases, PAIR[1]).get(k)
                   for k in ("model", "plan"))
        out["expandable_vs_default"] = {
            "same_model_and_plan": same,
            "expandable_segments": [a["expandable_segments"], b["expandable_segments"]],
            "idle_ms_per_micro_batch": [a["idle_ms_per_micro_batch"],
                                        b["idle_ms_per_micro_batch"]],
            "idle_ratio": _ratio(b["idle_ms_per_micro_batch"], a["idle_ms_per_micro_batch"]),
            "tokens_per_s_ratio": _ratio(b["tokens_per_s"], a["tokens_per_s"]),
            "allocator_retries": [a["allocator_retries"], b["allocator_retries"]],
            "device_frees": [a["device_frees"], b["device_frees"]]}
    return out


def _run(cases: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return ((cases.get(name) or {}).get("result") or {}).get("run") or {}


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _num(x: float | None, fmt: str) -> str:
    return "?" if x is None else format(x, fmt)


def lines(summ: dict[str, Any], case: str) -> Iterator[tuple[str, str]]:
    """The printed lines of `case`'s rows (and the comparison once eager_expandable ran)."""
    for key, r in summ.items():
        if key.split(".")[0] != case or key == "expandable_vs_default":
            continue
        if "error" in r:
            yield key, f"no summary: {r['error']}"
            continue
        yield key, (f"{_num(r['idle_ms_per_micro_batch'], '.2f')} ms idle per micro-batch, "
                    f"{_num(r['host_late_ms_per_micro_batch'], '.2f')} ms of it host-late; "
                    f"allocator retries {r['allocator_retries']}, device frees "
                    f"{r['device_frees']}; expandable segments {r['expandable_segments']}")
        yield key, r["verdict"]
    cmp = summ.get("expandable_vs_default")
    if case == PAIR[1] and cmp:
        yield "expandable_vs_default", (
            f"idle per micro-batch {_num(cmp['idle_ms_per_micro_batch'][0], '.2f')} -> "
            f"{_num(cmp['idle_ms_per_micro_batch'][1], '.2f')} ms "
            f"(x{_num(cmp['idle_ratio'], '.2f')})"
            f", tokens/s x{_num(cmp['tokens_per_s_ratio'], '.3f')}"
            + ("" if cmp["same_model_and_plan"] else " (NOT the same model and plan)"))
