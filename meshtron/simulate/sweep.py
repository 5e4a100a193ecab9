"""Sweep the GPU count of a training run: re-plan at every size, and find where scaling stops.

At every GPU count the planner's search (planner/search.py) picks the fastest plan that fits,
so each point is the best the cost model knows at that size, not one layout stretched. For a
fixed global batch, and optionally for a batch that grows with the cluster (tokens per GPU kept
constant up to a cap: how large runs grow their batch, e.g. Llama 3 405B ramped 4M -> 16M
tokens), it reports throughput, scaling efficiency (per-GPU throughput relative to the first
size), MFU, and the marginal throughput of the GPUs added since the previous size, relative to
one GPU's throughput at the first size: 1.0 means the new GPUs pay as well as the first ones,
0.001 that they add 0.1% of a GPU each.

Why a point scales as it does: between consecutive sizes, the two best plans' priced pieces
(step categories, why.py) are turned into GPU-seconds per token (piece x GPUs / tokens per
step, constant under perfect scaling); the pieces that moved with the whole step are named, with
the plan's knobs that changed (why.py `explain`). Where no layout exists, the reason is that the
batch cannot be split over that many GPUs (or nothing fits).
"""

from __future__ import annotations

import csv
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.search import search_plans
from meshtron.simulate.why import PARTS, explain, plan_knobs, priced_pieces

MAX_GPUS = 1 << 20
"""GPU counts above this (a million) are taken for a typo."""


def gpu_counts(text: str) -> list[int]:
    """'512..131072' (powers of two from 512 to 131072) or '512,1024,3072'."""
    text = str(text).strip()
    m = re.fullmatch(r"(\d+)\.\.(\d+)", text)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo < 1 or hi < lo:
            raise UserError(f"gpus={text!r}: expected LO..HI with 1 <= LO <= HI")
        if lo & (lo - 1) or hi & (hi - 1):
            bad = [str(x) for x in (lo, hi) if x & (x - 1)]
            raise UserError(f"gpus={text!r}: LO..HI sweeps powers of two; "
                            + " and ".join(bad) + (" are not" if len(bad) > 1 else " is not")
                            + " (give powers of two, or a list like 100,200,300)")
        out, n = [], 1
        while n <= hi:
            if n >= lo:
                out.append(n)
            n *= 2
    elif re.fullmatch(r"\d+(,\d+)*", text):
        out = sorted(set(int(x) for x in text.split(",")))
    else:
        raise UserError(f"gpus={text!r}: expected LO..HI (powers of two) or a list like 512,1024")
    if not out or out[0] < 1:
        raise UserError(f"gpus={text!r}: no GPU count >= 1 in it")
    if out[-1] > MAX_GPUS:
        raise UserError(f"gpus={text!r}: more than {MAX_GPUS:,} GPUs")
    return out


@dataclass
class SweepPoint:
    """One GPU count of one batch series."""

    series: str
    """'fixed' or 'growing' batch."""
    gpus: int
    """GPUs of this point."""
    global_batch: int
    """Sequences per step."""
    tokens_per_gpu: float
    """Tokens per GPU per step."""
    plan: str
    """The best plan's layout, or '' when none fits."""
    step_time_s: float
    """Step time (nan without a plan)."""
    tokens_per_s: float
    """Throughput (0 without a plan)."""
    mfu: float
    """Model FLOPs utilisation (0 without a plan)."""
    microbatches: int
    """Micro-batches per replica per step."""
    parts_s: dict[str, float]
    """Step time by part (estimate.TimeBreakdown)."""
    pieces_s: dict[str, float] = field(default_factory=dict)
    """Step time by priced piece (why.py `priced_pieces`: step categories without a pipeline)."""
    knobs: dict[str, Any] = field(default_factory=dict)
    """The plan's knobs (why.py `plan_knobs`), to name what changed between sizes."""
    scaling_efficiency: float = float("nan")
    """Per-GPU throughput / the series' first point's."""
    marginal: float = float("nan")
    """Throughput added per added GPU / one GPU's at the first point."""
    cause: str = ""
    """Why this point scales as it does against the previous one (why.py `explain`), or why
    it has no plan."""
    search_s: float = 0.0
    """Planner search time."""

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        parts = d.pop("parts_s")
        del d["knobs"]
        d.update({f"{k}_s": parts.get(k) for k in PARTS})
        # no number where there is none (strict JSON has no NaN; the CSV cell stays empty)
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}


def sweep(model: ModelSpec, cluster: ClusterSpec, counts: list[int], global_batch: int,
          seq_len: int, growth_cap: int | None = None,
          opts: KernelOptions | None = None) -> list[SweepPoint]:
    """Plan at every GPU count for the fixed batch and (growth_cap) the growing one."""
    gpn = cluster.gpus_per_node
    bad = [n for n in counts if n % gpn and n > gpn or gpn % n and n < gpn]
    if bad:
        raise UserError(f"gpus={bad[0]}: must be a multiple of gpus_per_node={gpn}")
    series = [("fixed", {n: global_batch for n in counts})]
    if growth_cap is not None:
        if growth_cap < global_batch:
            raise UserError(f"batch-growth={growth_cap}: the cap must be >= global-batch="
                            f"{global_batch}")
        series.append(("growing", {n: min(growth_cap, global_batch * n // counts[0])
                                   for n in counts}))
    out = []
    for name, batches in series:
        points = [_point(model, cluster, name, n, batches[n], seq_len, opts) for n in counts]
        _annotate(points, seq_len)
        out += points
    return out


def _cluster_of(cluster: ClusterSpec, gpus: int) -> ClusterSpec:
    gpn = cluster.gpus_per_node
    if gpus < gpn:
        from dataclasses import replace

        return replace(cluster, gpus_per_node=gpus, nodes=1)
    return cluster.with_nodes(gpus // gpn)


def _point(model, cluster, series, gpus, batch, seq, opts) -> SweepPoint:
    t0 = time.perf_counter()
    cl = _cluster_of(cluster, gpus)
    try:
        stack = {"framework": opts} if hasattr(opts, "kernel") else {"options": opts}
        result = search_plans(model, cl, batch, seq, None, top_k=1, explain=False, **stack)
        best = result.best
        why = ""
        if best is None and result.near_miss is not None:
            why = (f"no plan fits in memory ({gpus:,} GPUs, batch {batch}; the leanest needs "
                   f"{result.near_miss.memory.total:.0f} GiB per GPU)")
        elif best is None:
            why = (f"batch too small to split: {batch} sequences over {gpus:,} GPUs (data "
                   f"parallelism must divide the batch, every pipeline needs at least pp "
                   f"micro-batches, tp <= {cl.gpus_per_node})")
    except UserError as exc:  # no layout divides the batch at this size
        best, why = None, f"no layout: {exc}"
    dt = time.perf_counter() - t0
    if best is None:
        return SweepPoint(series, gpus, batch, batch * seq / gpus, "", float("nan"), 0.0, 0.0, 0,
                          {}, cause=why, search_s=dt)
    t = best.time
    parts = {k: getattr(t, k) for k in PARTS}
    return SweepPoint(series, gpus, batch, batch * seq / gpus, best.config.describe(),
                      best.step_time_s, best.tokens_per_s, best.mfu, best.num_microbatches, parts,
                      pieces_s=priced_pieces(result, model, best),
                      knobs=plan_knobs(best.config), search_s=dt)


def _annotate(points: list[SweepPoint], seq: int) -> None:
    first = next((p for p in points if p.tokens_per_s > 0), None)
    if first is None:
        return
    per_gpu0 = first.tokens_per_s / first.gpus
    prev = None
    for p in points:
        if p.tokens_per_s > 0:
            p.scaling_efficiency = p.tokens_per_s / p.gpus / per_gpu0
        if p.tokens_per_s <= 0 and prev is not None:
            p.marginal = 0.0  # the extra GPUs cannot be used: the previous plan still runs
        elif prev is not None and p.gpus > prev.gpus:
            p.marginal = (p.tokens_per_s - prev.tokens_per_s) / (p.gpus - prev.gpus) / per_gpu0
            if p.tokens_per_s > 0 and not p.cause:
                p.cause = explain(prev, p, seq)
        if p.tokens_per_s > 0:
            prev = p


def stop_point(points: list[SweepPoint], threshold: float) -> SweepPoint | None:
    """The first point whose added GPUs deliver less than `threshold` of a first-size GPU."""
    for p in points:
        if p.marginal == p.marginal and p.marginal < threshold:
            return p
    return None


def write_csv(points: list[SweepPoint], path: Path) -> None:
    rows = [p.row() for p in points]
    for r in rows:  # one number a cell: the pieces are the JSON's (the parts add up the same)
        del r["pieces_s"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_plots(points: list[SweepPoint], out: Path, title: str) -> list[Path]:
    """throughput.png, scaling_efficiency.png, mfu.png, marginal.png (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = [("throughput", "tokens/s", lambda p: p.tokens_per_s, True),
            ("scaling_efficiency", "per-GPU throughput / first size", 
             lambda p: p.scaling_efficiency, False),
            ("mfu", "MFU", lambda p: p.mfu, False),
            ("marginal", "throughput per added GPU / first size's per GPU",
             lambda p: p.marginal, False)]
    paths = []
    for name, ylabel, get, logy in figs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for series in dict.fromkeys(p.series for p in points):
            # the marginal plot keeps the sizes no plan can use (their added GPUs bring 0)
            pts = [p for p in points if p.series == series and get(p) == get(p)
                   and (p.tokens_per_s > 0 or name == "marginal")]
            ax.plot([p.gpus for p in pts], [get(p) for p in pts], marker="o",
                    label=f"{series} batch")
            idle = [p for p in pts if p.tokens_per_s <= 0]
            if idle:
                ax.plot([p.gpus for p in idle], [get(p) for p in idle], "x", color="red",
                        ms=10, label=f"{series} batch: no plan (batch too small / no fit)")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        if name == "marginal":
            ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {name.replace('_', ' ')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        path = out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
