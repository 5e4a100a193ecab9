"""`meshtron doctor RUN_DIR --timeline`: merge the ranks' timeline_rank_N.json (timeline.py)
into one Chrome trace / Perfetto JSON (RUN_DIR/trace/timeline.json), a summary table of
compute / communication / idle fractions per rank, the measured pipeline bubble beside the
planner's prediction, and a PNG plot (RUN_DIR/trace/timeline.png)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.diagnose.trace import Trace, load_trace
from meshtron.doctor import timeline as tl
from meshtron.errors import UserError

COLORS = {"compute": "#4c9a2a", "comm": "#3d6fb6", "idle": "#d9822b"}


@dataclass
class TimelineReport:
    """Everything `meshtron doctor --timeline` prints and writes."""

    ranks: dict[int, dict[str, Any]]
    """rank -> rank_phases() result plus label, pp stage and steps."""
    labels: dict[int, str]
    bubble: dict[str, Any] = field(default_factory=dict)
    """Pipelined runs: measured idle fraction of the stages' p2p waits and the planner's."""
    trace_path: Path | None = None
    png_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    """Lines printed under the table (a launch of one step: why it shows no steady step)."""

    def fractions(self, rank: int) -> dict[str, float]:
        r = self.ranks[rank]
        span = r["span"] or 1.0
        return {k: r[k] / span for k in ("compute", "comm", "idle")}

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": {str(k): {"label": self.labels[k], "span_s": v["span"],
                                   "steps": v["steps"], **self.fractions(k)}
                          for k, v in self.ranks.items()},
                "bubble": self.bubble, "notes": self.notes, "trace": str(self.trace_path),
                "png": str(self.png_path) if self.png_path else None}

    def text(self) -> str:
        lines = [f"{'rank':<26} {'steps':>7} {'step s':>8} {'compute':>8} {'comm':>7} "
                 f"{'idle':>7}"]
        for rank, r in sorted(self.ranks.items()):
            f = self.fractions(rank)
            steps = r["steps"]
            per_step = r["span"] / max(1, len(steps))
            lines.append(f"{self.labels[rank]:<26} {steps[0]:>3}..{steps[-1]:<3} "
                         f"{per_step:>8.3f} {f['compute']:>7.1%} {f['comm']:>7.1%} "
                         f"{f['idle']:>7.1%}")
        b = self.bubble
        if b:
            stages = ", ".join(f"stage {s}: {v:.1%}" for s, v in sorted(b["per_stage"].items()))
            lines.append("")
            lines.append(f"pipeline bubble ({b['schedule']}, pp={b['pp']}, m={b['m']}): "
                         f"measured {b['measured']:.1%} of step time ({stages})")
            pred = b.get("predicted")
            lines.append("  planner predicted " + (f"{pred:.1%}" if pred is not None
                                                   else f"n/a ({b.get('predicted_error')})")
                         + f"; planner's formula on the measured stage compute "
                           f"{b['formula_on_measured']:.1%}")
        lines.extend(self.notes)
        lines.append(f"trace: {self.trace_path}" + (f"; plot: {self.png_path}"
                                                     if self.png_path else ""))
        return "\n".join(lines)


def load_timelines(tdir: Path) -> dict[int, dict[str, Any]]:
    docs = {}
    for path in sorted(tdir.glob("timeline_rank_*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("format") == tl.FORMAT:
            docs[int(doc["rank"])] = doc
    return docs


def build_report(run_dir: Path | str, png: bool = True) -> TimelineReport:
    trace = load_trace(run_dir)
    tdir = trace.trace_dir
    docs = load_timelines(tdir)
    if not docs:
        raise UserError(f"RUN_DIR={str(run_dir)!r}: no timeline (expected "
                        "trace/timeline_rank_N.json, written at the end of `meshtron train`)")
    if trace.mesh is None:
        trace.mesh = next((d["mesh"] for d in docs.values() if d.get("mesh")), None)
    entries = tl.entry_times(docs)
    sizes = {name: len(g["ranks"]) for d in docs.values() for name, g in d["groups"].items()}
    ranks = {}
    for rank, doc in docs.items():
        phases = tl.rank_phases(rank, doc, entries, sizes)
        phases["steps"] = [s["step"] for s in doc["steps"]]
        phases["step_starts"] = [s["start_t"] for s in doc["steps"]]
        ranks[rank] = phases
    labels = {r: trace.label(r) for r in ranks}
    report = TimelineReport(ranks, labels, notes=start_up_notes(docs))
    report.bubble = pipeline_bubble(trace, ranks)
    report.trace_path = tdir / "timeline.json"
    tl_json = chrome_trace(trace, docs, ranks)
    report.trace_path.write_text(json.dumps(tl_json))
    if png:
        report.png_path = plot(report, tdir / "timeline.png")
    return report


def start_up_notes(docs: dict[int, dict[str, Any]]) -> list[str]:
    """Why the table shows no steady step, when every rank's window is its launch's first step
    alone (timeline.py keeps it only then): that step's time holds the start-up. Documents
    written before `launch_first_step` was recorded: step 1 is a launch's first."""
    firsts = {doc.get("launch_first_step") or 1 for doc in docs.values()}
    only = {tuple(s["step"] for s in doc["steps"]) for doc in docs.values()}
    if len(firsts) != 1 or only != {(next(iter(firsts)),)}:
        return []
    step = next(iter(firsts))
    load = "" if step == 1 else ", loading the checkpoint it resumed from"
    launch = "this launch" if step == 1 else "this resumed launch"
    return [f"only step {step} ran in {launch}: its time includes the start-up (building "
            f"the model, the first allocations{load}), so the table shows no steady step "
            "(a launch of two or more steps is timed from its second step)"]


# ---- Chrome trace ------------------------------------------------------------------------------

def chrome_trace(trace: Trace, docs: dict[int, dict[str, Any]],
                 ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Trace Event Format: one process per rank (named with its mesh coordinates), thread 0
    the steps, thread 1 compute/comm/idle, thread 2 the recorded operations (issue to the
    moment completion was seen)."""
    t0 = min(r["window"][0] for r in ranks.values())

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    events: list[dict[str, Any]] = []
    for rank, doc in sorted(docs.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": trace.label(rank)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for tid, name in ((0, "steps"), (1, "main thread"), (2, "collectives")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": name}})
        for s in doc["steps"]:
            events.append({"ph": "X", "name": f"step {s['step']}", "cat": "step", "pid": rank,
                           "tid": 0, "ts": us(s["start_t"]),
                           "dur": us(s["end_t"]) - us(s["start_t"])})
        for kind, a, b in ranks[rank]["segments"]:
            events.append({"ph": "X", "name": kind, "cat": kind, "pid": rank, "tid": 1,
                           "ts": us(a), "dur": max(0.0, us(b) - us(a))})
        w0, w1 = ranks[rank]["window"]
        for r in doc["records"]:
            end = r["end_t"] or r["start_t"] or r["enqueue_t"]
            if end < w0 or r["enqueue_t"] > w1:
                continue
            args = {"group": r["group"], "axis": r.get("axis"), "seq": r["seq"],
                    "shapes": r["shapes"], "state": r["state"]}
            if "peer" in r:
                args["peer"] = r["peer"]
            events.append({"ph": "X", "name": f"{r['op']} #{r['seq']} ({r.get('axis') or 'pg'})",
                           "cat": "collective", "pid": rank, "tid": 2,
                           "ts": us(max(r["enqueue_t"], w0)),
                           "dur": max(0.0, us(min(end, w1)) - us(max(r["enqueue_t"], w0))),
                           "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(trace.run_dir), "t0_unix_s": t0}}


# ---- pipeline bubble --------------------------------------------------------------------------

def pipeline_bubble(trace: Trace, ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Measured: per pipeline stage, the time its ranks sat blocked before a neighbour's p2p
    entry, as a fraction of their step time, averaged over the stages. Predicted: the planner's
    `pipeline.bubble_time` share of its estimated step for the run's plan.toml, and the same
    formula fed with the measured per-stage compute."""
    plan = _plan(trace.run_dir)
    if plan is None or plan.pp <= 1:
        return {}
    per_stage: dict[int, list[float]] = {}
    compute: dict[int, list[float]] = {}
    for rank, r in ranks.items():
        stage = trace.coords(rank).get("pp", 0)
        per_stage.setdefault(stage, []).append(r["p2p_idle"] / (r["span"] or 1.0))
        compute.setdefault(stage, []).append(r["compute"] / max(1, len(r["steps"])))
    stage_frac = {s: sum(v) / len(v) for s, v in per_stage.items()}
    out: dict[str, Any] = {"pp": plan.pp, "schedule": plan.schedule, "m": plan.num_microbatches,
                           "virtual_stages": plan.virtual_stages,
                           "per_stage": stage_frac,
                           "measured": sum(stage_frac.values()) / len(stage_frac)}
    from meshtron.planner import pipeline

    m = max(1, plan.num_microbatches)
    per_mb = [sum(compute[s]) / len(compute[s]) / m for s in sorted(compute)]
    bubble = pipeline.bubble_time(plan.schedule or "1f1b", plan.virtual_stages, per_mb,
                                  [0.0] * len(per_mb), m)
    out["formula_on_measured"] = bubble / (m * max(per_mb) + bubble) if per_mb else 0.0
    try:
        est = _estimate(trace.run_dir, plan)
        out["predicted"] = est.time.bubble / est.step_time_s
        out["predicted_bubble_s"] = est.time.bubble
        out["predicted_step_s"] = est.step_time_s
    except (UserError, OSError, KeyError, ValueError) as exc:
        out["predicted"], out["predicted_error"] = None, str(exc)
    return out


def _plan(run_dir: Path):
    path = Path(run_dir) / "plan.toml"
    if not path.is_file():
        return None
    from meshtron.planner.plan import load_plan

    return load_plan(path)


def _estimate(run_dir: Path, plan):
    """The planner's estimate of the run's plan on the cluster it was planned for."""
    from meshtron.config import config_from_dict, load_toml
    from meshtron.planner.cluster import resolve_cluster
    import dataclasses

    from meshtron.planner.frameworks import preset
    from meshtron.planner.search import evaluate_plan
    from meshtron.train.planning import local_cluster, sized_cluster

    cfg = config_from_dict(load_toml(Path(run_dir) / "run.toml"))
    world = plan.tp * plan.pp * plan.dp
    try:
        cluster = resolve_cluster(plan.cluster) if plan.cluster else local_cluster(world, None)
    except UserError:  # a nominal or calibrated cluster saved by name only
        cluster = local_cluster(world, None)
    return evaluate_plan(cfg.model, sized_cluster(cluster, world), cfg.data.global_batch,
                         cfg.data.seq_len, plan,
                         options=dataclasses.replace(preset("meshtron").kernel,
                                                     attention=plan.attention))


# ---- PNG --------------------------------------------------------------------------------------

def plot(report: TimelineReport, path: Path) -> Path:
    """One horizontal lane per rank, coloured compute / communication / idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(r["window"][0] for r in report.ranks.values())
    order = sorted(report.ranks)
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(order) + 1.5))
    for lane, rank in enumerate(order):
        for kind in COLORS:
            bars = [(a - t0, b - a) for k, a, b in report.ranks[rank]["segments"] if k == kind]
            ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=COLORS[kind])
        for start in report.ranks[rank]["step_starts"]:  # step boundaries
            ax.plot([start - t0] * 2, [lane - 0.45, lane + 0.45], color="black", lw=0.8)
    ax.set_yticks(range(len(order)), [report.labels[r] for r in order])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3, frameon=False)
    ax.set_title("meshtron timeline (black: step starts)", pad=28)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
