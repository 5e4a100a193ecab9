"""`meshtron simulate`: sweep the GPU count (re-planning at every size), or simulate one step.

    meshtron simulate --model llama3-405b --gpus 512..131072 --global-batch 2048 \\
        --seq-len 8192 --out runs/scaling --batch-growth 16384
    meshtron simulate --step --model llama3-405b --cluster dgx-h100:2048 --global-batch 2048 \\
        --seq-len 8192 --straggler 0:1.2 --jitter 0.05

Pure Python (no torch import). Exit status 0, or 2 with one line for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from meshtron.argtypes import (negative_values_are_values, positive_float, positive_int,
                               take_from_plan, writable_target)
from meshtron.errors import UserError


def _straggler(text: str) -> tuple[int, float]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\S+?)\s*", text)
    try:
        factor = float(m.group(2)) if m else math.nan
    except ValueError:
        factor = math.nan
    if math.isnan(factor):  # 1e9 and 2.5e-1 are numbers: the range check below judges them
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK:FACTOR, e.g. 0:1.2")
    return int(m.group(1)), factor


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number >= 0")
    return value


def register(subparsers: Any) -> None:
    from meshtron.planner.cli import add_framework_args

    p = subparsers.add_parser(
        "simulate", help="sweep GPU counts (re-planning), or simulate one step rank by rank",
        description="Without --step: plan at every GPU count of --gpus and write CSV + PNG "
                    "plots of throughput, scaling efficiency, MFU and marginal throughput to "
                    "--out. With --step: discrete-event simulation of one step of the best "
                    "plan (or --plan), optionally with slow GPUs or jitter.")
    p.add_argument("--model", help="preset, config.json or model TOML (required, except with "
                                    "--step --plan: the plan's)")
    p.add_argument("--cluster",
                   help="sweep: a preset kind (default dgx-h100) or cluster TOML, nodes set per "
                        "size; --step: dgx-h100:N or a TOML (with --plan: the plan's)")
    p.add_argument("--global-batch", type=positive_int,
                   help="sequences per step (required, except with --step --plan: the plan's)")
    p.add_argument("--seq-len", type=positive_int,
                   help="tokens per sequence (required, except with --step --plan: the plan's)")
    add_framework_args(p)
    p.add_argument("--gpus", default="64..131072",
                   help="sweep sizes: LO..HI (powers of two) or a list 512,1024,4096")
    p.add_argument("--out", help="sweep: folder for sweep.csv and the PNG plots")
    p.add_argument("--batch-growth", type=positive_int, metavar="MAX_BATCH",
                   help="also sweep a batch growing with the GPUs (tokens per GPU of the first "
                        "size) up to MAX_BATCH sequences")
    p.add_argument("--threshold", type=_fraction, default=0.001,
                   help="report where the added GPUs deliver less than this fraction of a "
                        "first-size GPU each (default 0.001)")
    p.add_argument("--step", action="store_true", help="simulate one step instead of sweeping")
    p.add_argument("--plan", metavar="PLAN.toml",
                   help="--step: this plan, not the best one (its model, cluster, batch and "
                        "sequence length unless given)")
    p.add_argument("--straggler", type=_straggler, action="append", default=[],
                   metavar="RANK:FACTOR", help="--step: this GPU is FACTOR x slower (repeatable)")
    p.add_argument("--jitter", type=_fraction, default=0.0,
                   help="--step: log-normal per-operation noise (sigma, e.g. 0.05)")
    p.add_argument("--seed", type=int, default=0, help="--step: seed of the jitter")
    p.add_argument("--mtbf-hours", type=positive_float, default=None,
                   help="--step: the job's MTBF in hours for the goodput of the three recovery "
                        "strategies (default: Llama 3's per-GPU failure rate)")
    p.add_argument("--failures-per-gpu-hour", type=positive_float, default=None,
                   help="--step: per-GPU failure rate instead of --mtbf-hours")
    p.add_argument("--replica-groups", type=positive_int, default=None,
                   help="--step: replica groups for replica-FT goodput (default: the plan's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    negative_values_are_values(p)  # `--gpus -8..16`: refused by gpu_counts, naming the flag
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshtron.planner.cli import framework_of, load_model, plan_framework

    plan = _fill_from_plan(args)
    model = load_model(args.model)
    if plan is not None:  # the stack and options it was saved with (what `meshtron plan` priced)
        opts, note = plan_framework(args, plan, model)
        return _run_step(args, model, opts, plan, [note] if note else [])
    opts = framework_of(args, model)  # a planner Framework (--framework, --options, --stack ...)
    if args.step:
        return _run_step(args, model, opts)
    for flag in ("mtbf_hours", "failures_per_gpu_hour", "replica_groups"):
        if getattr(args, flag) is not None:
            raise UserError(f"{flag.replace('_', '-')}={getattr(args, flag)!r}: applies to "
                            "--step only (goodput of one plan)")
    return _run_sweep(args, model, opts)


def _fill_from_plan(args: argparse.Namespace):
    """With --step --plan, what the flags leave out comes from the plan file (as `meshtron
    cost --plan`); a --model, --cluster, --global-batch or --seq-len that contradicts it is
    refused. Otherwise --model, --global-batch and --seq-len are required. The plan read, or None."""
    plan = None
    if args.plan and not args.step:
        raise UserError(f"plan={args.plan!r}: applies to --step only (a sweep re-plans at "
                        "every size)")
    if args.plan:
        from meshtron.planner.plan import load_priced_plan

        plan = load_priced_plan(args.plan)
        if plan.pipeline_runs > 1:  # step.py's graph is one schedule of all micro-batches
            raise UserError(f"plan.pipeline_runs={plan.pipeline_runs}: the step simulator "
                            "walks one pipeline schedule per step; price several schedule "
                            "calls with `meshtron plan` or `meshtron cost`")
        # batch and length too: one the file does not hold would simulate another run
        take_from_plan(args, plan, args.plan, flags=("model", "cluster", "global_batch",
                                                     "seq_len"))
    for flag in ("model", "global_batch", "seq_len"):
        if getattr(args, flag) is None:
            name = flag.replace("_", "-")
            raise UserError(f"--{name}: required (or --step --plan PLAN.toml, which names it)")
    if args.cluster is None and args.step:  # a sweep sets the nodes; one step needs them
        raise UserError("--cluster: required with --step (dgx-h100:N or a cluster TOML), or "
                        "--plan PLAN.toml, which names it")
    args.cluster = args.cluster or "dgx-h100"
    return plan


def _sweep_cluster(text: str):
    from meshtron.planner.cluster import CLUSTER_PRESETS, resolve_cluster

    kind = text.split(":", 1)[0]
    if kind in CLUSTER_PRESETS:
        return resolve_cluster(f"{kind}:1")
    return resolve_cluster(text)


def _run_sweep(args: argparse.Namespace, model, opts) -> int:
    from meshtron.simulate.sweep import gpu_counts, stop_point, sweep, write_csv, write_plots

    if not args.out:
        raise UserError("out: required for a sweep (a folder for sweep.csv and the plots)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"out={args.out!r}: exists and is not a folder")
    writable_target(out, "out")  # before the sweep: nothing computed for a folder never written
    counts = gpu_counts(args.gpus)
    cluster = _sweep_cluster(args.cluster)
    points = sweep(model, cluster, counts, args.global_batch, args.seq_len, args.batch_growth,
                   opts)
    if not any(p.tokens_per_s > 0 for p in points):  # nothing to plot: the input's fault
        first = points[0]
        raise UserError(f"global_batch={args.global_batch}: no GPU count of the sweep "
                        f"({counts[0]} to {counts[-1]}, --gpus) gets a plan; at "
                        f"{first.gpus}: {first.cause}; give a larger --global-batch or "
                        "smaller --gpus")
    out.mkdir(parents=True, exist_ok=True)
    write_csv(points, out / "sweep.csv")
    title = f"{model.name}, {args.seq_len} tokens/seq"
    plots = write_plots(points, out, title)
    doc = {"schema": "meshtron-sweep/1", "csv": str(out / "sweep.csv"),
           "plots": [str(p) for p in plots], "search_s": sum(p.search_s for p in points),
           "series": {}}
    for series in dict.fromkeys(p.series for p in points):
        pts = [p for p in points if p.series == series]
        stop = stop_point(pts, args.threshold)
        half = stop_point(pts, 0.5)
        doc["series"][series] = {
            "threshold": args.threshold,
            "stops_paying_at": half.gpus if half else None,
            "stops_paying_why": half.cause if half else None,
            "below_threshold_at": stop.gpus if stop else None,
            "below_threshold_why": stop.cause if stop else None,
            "points": [p.row() for p in pts]}
    if args.json:
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        print(_render_sweep(doc))
    return 0


def _cell(value: float | None, width: int, digits: int) -> str:
    """A ratio against the previous or first size, or '-' where there is none (the first
    size's marginal, a size with no plan)."""
    if value is None or value != value:
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


def _render_sweep(doc: dict[str, Any]) -> str:
    lines = []
    for series, s in doc["series"].items():
        lines.append(f"{series} batch:")
        # the plan column as wide as its longest plan: a plan string is never cut
        w = max([4] + [len(r["plan"]) for r in s["points"]])
        lines.append(f"  {'GPUs':>7} {'batch':>6} {'plan':{w}} {'tok/s':>11} {'eff':>6} "
                     f"{'MFU':>6} {'marginal':>9}  against the previous size")
        for r in s["points"]:
            eff = _cell(r["scaling_efficiency"], 6, 3)
            marg = _cell(r["marginal"], 9, 4)
            lines.append(f"  {r['gpus']:7d} {r['global_batch']:6d} {r['plan']:{w}} "
                         f"{r['tokens_per_s']:11.4g} {eff} {r['mfu']:6.3f} "
                         f"{marg}  {r['cause']}")
        if s["stops_paying_at"]:
            lines.append(f"  adding GPUs stops paying (each added GPU < 0.5 of a first-size GPU) "
                         f"at {s['stops_paying_at']:,} GPUs: {s['stops_paying_why']}")
        if s["below_threshold_at"]:
            lines.append(f"  marginal throughput < {s['threshold']:g} of a first-size GPU per "
                         f"added GPU at {s['below_threshold_at']:,} GPUs: "
                         f"{s['below_threshold_why']}")
    lines.append(f"Wrote {doc['csv']} and {len(doc['plots'])} plots; planner search "
                 f"{doc['search_s']:.1f} s in total")
    return "\n".join(lines)


def _run_step(args: argparse.Namespace, model, opts, plan=None,
              warnings: list[str] | None = None) -> int:
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan_priced import unrecorded_stack_warning
    from meshtron.planner.search import evaluate_plan, search_plans
    from meshtron.simulate.step import Perturbation, simulate_step

    cluster = resolve_cluster(args.cluster)
    batch, seq = args.global_batch, args.seq_len
    warnings = list(warnings or [])
    if plan is not None:
        result = search_plans(model, cluster, batch, seq, plan, top_k=1, framework=opts,
                              explain=False)
        # as evaluate_plan, which refuses in one line what nothing prices
        est = (result.best or result.near_miss_priced
               or evaluate_plan(model, cluster, batch, seq, plan, framework=opts))
        if result.split_fallback is not None:  # a split the stack cannot build (issue 30)
            from meshtron.planner.report import split_warning

            # the planner's text (`meshtron plan --json` "warnings"), of the plan simulated
            warnings.append(split_warning(result, est))
        old = (None if getattr(args, "framework", None)
               else unrecorded_stack_warning(plan, est.step_time_s, est.memory.total))
        if not est.fits:  # `meshtron cost --plan` prices it; simulating it is refused
            from meshtron.planner.report import need_text

            stack = "" if opts.name == "meshtron" else f" as {opts.label}"
            raise UserError(f"plan={args.plan!r}: predicted not to fit on {args.cluster}"
                            f"{stack} ({need_text(est, parts=False)}); simulate refuses a plan that "
                            "does not fit (`meshtron cost --plan` prices it anyway)"
                            + (f"; {old}" if old else ""))
        if old:
            warnings.append(old)
    else:
        result = search_plans(model, cluster, batch, seq, None, top_k=1, framework=opts,
                              explain=False)
        if not result.fits:
            raise UserError(f"cluster={args.cluster!r}: no plan of {args.model} fits")
        est = result.best
    if est.config.schedule == "dualpipe" and est.config.pp > 1:
        # the event walk replays torch.distributed.pipelining's orders (simulate/schedule.py)
        raise UserError("plan.schedule='dualpipe': `meshtron simulate --step` walks "
                        "torch.distributed.pipelining's schedules, not DeepSeek's DualPipe; "
                        "`meshtron plan` and `meshtron cost` price it")
    # the options the search priced the plan with: the stack's, compiled or with async TP
    # where the plan says so (search.search_plans: compute.compiled)
    ev = Evaluator(model, cluster, batch, seq, result.options, mem=opts.memory)
    pert = Perturbation(stragglers=tuple(args.straggler), jitter=args.jitter, seed=args.seed)
    base = simulate_step(ev, est)
    res = simulate_step(ev, est, pert) if (pert.stragglers or pert.jitter) else base
    doc = {"schema": "meshtron-step-sim/1", "plan": est.config.describe() + est.config.comm_label(),
           "ranks": est.config.gpus, "framework": opts.label,
           # the planner's figures of the plan simulated (`meshtron plan`'s step and memory)
           "analytical_step_s": est.step_time_s, "memory_gib": est.memory.total,
           "unperturbed": base.to_dict(), "perturbed": res.to_dict(),
           "slowdown": res.step_time_s / base.step_time_s, "warnings": warnings}
    doc["goodput"], lines = _goodput(args, model, est, res.step_time_s)
    if args.json:  # JSON carries them and repeats them on stderr, as `meshtron plan --json`
        for line in warnings:
            print(f"warning: plan={args.plan!r}: {line}", file=sys.stderr, flush=True)
        print(json.dumps(doc, indent=2))
        return 0
    stack = "" if opts.name == "meshtron" else f", priced for {opts.label}"
    print(f"Plan: {doc['plan']} ({doc['ranks']:,} ranks{stack})")
    for line in warnings:
        print(f"warning: {line}")
    print(f"analytical step {est.step_time_s:.3f} s; simulated {base.step_time_s:.3f} s "
          f"({base.step_time_s / est.step_time_s - 1:+.1%}); {base.events:,} events x "
          f"{base.classes} class in {base.seconds:.2f} s")
    if est.config.pp > 1:  # everything else is the planner's pieces, placed on the graph
        print("  (the pipeline's transfers and bubble are walked event by event; the planner "
              "prices them in closed form)")
    if res is not base:
        print(f"perturbed ({'; '.join(res.notes) or 'jitter'}"
              f"{f', jitter {args.jitter:g}' if args.jitter and res.notes else ''}): "
              f"{res.step_time_s:.3f} s = x{doc['slowdown']:.3f} of the unperturbed step; "
              f"{res.classes} classes in {res.seconds:.2f} s")
    print("\n".join(lines))
    return 0


def _goodput(args: argparse.Namespace, model, est, step_s: float):
    """Goodput of the three recovery strategies for the simulated step (the cost model's
    checkpoint size at its default storage bandwidth)."""
    from meshtron.cost.model import CHECKPOINT_BYTES_PER_PARAM, DEFAULT_STORAGE_GB_PER_S
    from meshtron.reliability import DEFAULT_GPU_FAILURES_PER_HOUR, cluster_mtbf_s
    from meshtron.cost.model import DEFAULT_RESTART_S
    from meshtron.reliability.goodput import (at_job_scale, goodput_doc, goodput_table,
                                              load_recovery_times, render_goodput,
                                              replica_groups)

    gpus = est.config.gpus
    if args.mtbf_hours is not None and args.failures_per_gpu_hour is not None:
        raise UserError("mtbf-hours: give it or --failures-per-gpu-hour, not both")
    if args.mtbf_hours is not None:  # finite and > 0: checked by its argparse type
        mtbf = args.mtbf_hours * 3600.0
    else:
        mtbf = cluster_mtbf_s(gpus, args.failures_per_gpu_hour
                              if args.failures_per_gpu_hour is not None
                              else DEFAULT_GPU_FAILURES_PER_HOUR)
    params = float(model.num_params())
    save_s = CHECKPOINT_BYTES_PER_PARAM * params / (DEFAULT_STORAGE_GB_PER_S * 1e9)
    # the job's restart at its scale, as `meshtron cost` (reliability/goodput.py at_job_scale)
    times = at_job_scale(load_recovery_times(), DEFAULT_RESTART_S, "cost model default")
    groups = replica_groups(args.replica_groups, est.config.dp, est.config.replicas)
    rows = goodput_table(step_s, mtbf, params, gpus, save_s, groups, times)
    counts = ("--mtbf-hours" if args.mtbf_hours is not None
              else "hardware failures only, per-GPU rate x GPUs")
    return goodput_doc(rows, times, mtbf), render_goodput(rows, times, mtbf, counts=counts)
