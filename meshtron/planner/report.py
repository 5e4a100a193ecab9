"""Human (rich) and machine (JSON) output of a plan search.

JSON schema "meshtron-plan-search/1" (`meshtron plan --json`)::

    {
      "schema": "meshtron-plan-search/1",
      "model": {"name": str, "params": int, "layers": int, "hidden": int, "heads": int},
      "cluster": {ClusterSpec fields..., "num_gpus": int},
      "global_batch": int, "seq_len": int, "tokens": float,      # tokens = training budget
      "options": {"attention": "flash"|"unfused", "dropout": bool, ...},
      "fits": bool,                                               # some plan fits in memory
      "evaluated": int, "feasible": int, "search_time_s": float,
      "plans": [                                                  # best first, at most --top
        {"rank": int, "tp": int, "pp": int, "dp": int, "zero": int, "micro_batch": int,
         "num_microbatches": int, "recompute": str, "sp": bool, "schedule": str,
         "virtual_stages": int, "stage_layers": [int], "fits": bool,
         "memory_gib": {"params", "grads", "optimizer", "activations", "logits",
                        "workspace", "total", "capacity": float, "stage": int},
         "time_s": {"compute", "tp_comm", "pp_comm", "dp_comm_exposed", "bubble",
                    "optimizer": float},
         "step_time_s": float, "tokens_per_s": float,
         "model_tflops_per_gpu": float, "hardware_tflops_per_gpu": float,
         "mfu": float, "hfu": float,                              # fractions of peak
         "days": float, "gpu_hours": float, "cost": float|null}   # for `tokens`
      ],
      "alternatives": [{"family": str, "reason": str, "fits": bool, "layout": str|null,
                        "step_time_s": float|null, "memory_gib": float|null}],
      "near_miss": plan object (as above, fits = false) | null    # only when nothing fits
    }
"""

from __future__ import annotations

from typing import Any

from meshtron.planner.estimate import Estimate
from meshtron.planner.search import SearchResult

SCHEMA = "meshtron-plan-search/1"


def _sched(est: Estimate) -> str:
    c = est.config
    if c.pp == 1:
        return "-"
    return f"interleaved:{c.virtual_stages}" if c.schedule == "interleaved" else c.schedule


def to_json(result: SearchResult, tokens: float) -> dict[str, Any]:
    n = result.cluster.num_gpus
    price = result.cluster.price_per_gpu_hour
    m = result.model
    plans = []
    for i, est in enumerate(result.plans, 1):
        plans.append({"rank": i, **est.to_dict(tokens, n, price)})
    return {
        "schema": SCHEMA,
        "model": {"name": m.name, "params": m.num_params(), "layers": m.layers,
                  "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "vocab": m.vocab},
        "cluster": {**result.cluster.to_dict(), "num_gpus": n},
        "global_batch": result.global_batch, "seq_len": result.seq_len, "tokens": tokens,
        "options": dict(result.options.__dict__),
        "fits": result.fits, "evaluated": result.evaluated, "feasible": result.feasible,
        "search_time_s": result.seconds,
        "plans": plans,
        "alternatives": [a.to_dict() for a in result.alternatives],
        "near_miss": (result.near_miss.to_dict(tokens, n, price)
                      if result.near_miss is not None else None),
    }


def _fmt_tokens(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if x >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"


def render(result: SearchResult, tokens: float, console) -> None:
    """Print the ranked table, the memory/time breakdown and why other families lose."""
    from rich.table import Table

    m, cl = result.model, result.cluster
    n = cl.num_gpus
    console.print(
        f"[bold]{m.name}[/] ({m.num_params() / 1e9:.2f}B params) on [bold]{cl.name}[/] "
        f"({n} x {cl.gpu or f'{cl.peak_tflops:g} TFLOP/s device'}, {cl.memory_gib:g} GiB), "
        f"global batch {result.global_batch} x {result.seq_len} tokens; "
        f"{result.evaluated} plans evaluated in {result.seconds * 1000:.0f} ms")
    if not result.fits:
        return
    table = Table(title=f"Top {len(result.plans)} plans (step-time breakdown in seconds; "
                        f"time for {_fmt_tokens(tokens)} tokens)", show_lines=False)
    for col in ("#", "tp", "pp", "dp", "zero", "mb", "recomp", "sp", "schedule",
                "mem GiB (p/g/o/act/total)", "step s", "comp/tp/pp/dp/bubble",
                "tok/s", "TFLOP/s mdl/hw", "MFU", "HFU", "days", "GPU-h"):
        table.add_column(col, justify="right" if col not in ("recomp", "schedule") else "left")
    for i, e in enumerate(result.plans, 1):
        c, mem, t = e.config, e.memory, e.time
        table.add_row(
            str(i), str(c.tp), str(c.pp), str(c.dp), str(c.zero), str(c.micro_batch),
            c.recompute, "on" if c.sp else "off", _sched(e),
            f"{mem.params:.1f}/{mem.grads:.1f}/{mem.optimizer:.1f}/{mem.activations:.1f}/"
            f"[bold]{mem.total:.1f}[/]/{mem.capacity:g}",
            f"{e.step_time_s:.3g}",
            f"{t.compute:.3g}/{t.tp_comm:.2g}/{t.pp_comm:.2g}/{t.dp_comm:.2g}/{t.bubble:.2g}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.model_tflops_per_gpu:.0f}/{e.hardware_tflops_per_gpu:.0f}",
            f"{e.mfu * 100:.1f}%", f"{e.hfu * 100:.1f}%",
            f"{e.days(tokens):.1f}", f"{e.gpu_hours(tokens, n):,.0f}")
    console.print(table)
    best = result.plans[0]
    if cl.price_per_gpu_hour is not None:
        cost = best.gpu_hours(tokens, n) * cl.price_per_gpu_hour
        console.print(f"Best plan costs about {cost:,.0f} for {_fmt_tokens(tokens)} tokens "
                      f"at {cl.price_per_gpu_hour:g} per GPU-hour.")
    c = best.config
    if c.pp > 1:
        per_gpu = [sum(best.stage_layers[i::c.pp]) for i in range(c.pp)]
        chunks = f" in {c.virtual_stages} chunks each" if c.virtual_stages > 1 else ""
        console.print(f"Layers per pipeline stage of the best plan: {per_gpu}{chunks} "
                      "(embedding on the first stage, LM head + loss on the last)")
    if result.alternatives:
        console.print("[bold]Why the others lose[/] (vs the best plan):")
        for alt in result.alternatives:
            console.print(f"  - {alt.label}: {alt.reason}")


def render_no_fit(result: SearchResult, console) -> str:
    """Explain a model that fits nowhere; returns the one-line error for stderr."""
    nm = result.near_miss
    if nm is None:
        return "no plan: no layout is valid for this model, cluster and batch"
    mem = nm.memory
    console.print(
        f"[bold red]Nothing fits.[/] The leanest plan, {nm.config.describe()}, needs "
        f"{mem.total:.1f} GiB per GPU ({mem.params:.1f} params, {mem.grads:.1f} grads, "
        f"{mem.optimizer:.1f} optimizer, {mem.activations:.1f} activations, "
        f"{mem.logits:.1f} logits, {mem.workspace:.1f} workspace) > {mem.capacity:g} GiB; "
        f"it would run at {nm.step_time_s:.3g} s per step if it fitted.")
    return (f"model={result.model.name}: fits on no layout of {result.cluster.name}; needs at "
            f"least {mem.total:.1f} GiB per GPU > {mem.capacity:g} GiB (near miss: "
            f"{nm.config.describe()})")
