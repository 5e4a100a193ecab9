"""`meshtron cost`: days, GPU-hours, energy and money of a training run, failures included.

    meshtron cost --model llama3-405b --cluster dgx-h100:2048 --global-batch 2048 \\
        --seq-len 8192 --tokens 15T
    meshtron cost --plan plan.toml --model llama3-70b --cluster dgx-h100:16 --tokens 2T --json

Pure Python (no torch import). Exit status 0, or 2 with one line for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshtron.argtypes import (negative_values_are_values, nonnegative_float, nonnegative_int,
                               positive_float, positive_int, take_from_plan)
from meshtron.errors import UserError


MAX_RUNS = 100_000
"""--runs above this is refused: the P50/P90 it reports settle within 0.1% by ~10,000 runs, and
10^8 runs would take hours."""


def register(subparsers: Any) -> None:
    from meshtron.planner.cli import add_framework_args

    p = subparsers.add_parser(
        "cost", help="days, GPU-hours, energy and money of a run, with failures and spot",
        description="Cost a training run on the planner's best plan (or --plan), with the "
                    "expected overhead of failures and spot preemptions (Young/Daly checkpoint "
                    "interval) and a Monte Carlo of the whole run (P50/P90).")
    p.add_argument("--model", default=None,
                   help="preset, config.json or model TOML (default with --plan: the plan's)")
    p.add_argument("--cluster", default=None,
                   help="dgx-h100:N etc. or a cluster TOML (default with --plan: the plan's)")
    p.add_argument("--global-batch", type=positive_int, help="sequences per step")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence")
    p.add_argument("--tokens", default="1T", type=token_budget,
                   help="training budget in tokens (15T, 300B, 2e12)")
    p.add_argument("--plan", metavar="PLAN.toml", help="cost this plan instead of the best one")
    add_framework_args(p)
    p.add_argument("--dtype", default=None, help="bf16 (default) | fp32 | fp8")
    p.add_argument("--price-on-demand", type=nonnegative_float, help="USD per GPU-hour")
    p.add_argument("--price-spot", type=nonnegative_float, help="USD per GPU-hour")
    p.add_argument("--prices", metavar="PRICES.toml", help="per-GPU price/power tables")
    p.add_argument("--gpu-watts", type=positive_float, help="GPU board power, W")
    p.add_argument("--system-watts", type=positive_float, help="server power per GPU, W")
    p.add_argument("--pue", type=positive_float, default=None, help="facility PUE (default 1.2)")
    p.add_argument("--storage-gb-per-s", type=positive_float, default=None,
                   help="aggregate checkpoint write bandwidth, GB/s (default 100)")
    p.add_argument("--restart-min", type=nonnegative_float, default=None,
                   help="fixed restart time after a failure, minutes (default 10)")
    p.add_argument("--failures-per-gpu-hour", type=positive_float, default=None,
                   help="hardware failure rate (default: Llama 3's 1.97e-5)")
    p.add_argument("--mtbf-hours", type=positive_float, default=None,
                   help="the whole job's MTBF in hours, instead of a per-GPU rate")
    p.add_argument("--spot-preemptions-per-node-hour", type=nonnegative_float, default=None,
                   help="spot preemption rate (default 0.2 per node-month)")
    p.add_argument("--spot-notice-s", type=nonnegative_float, default=None,
                   help="preemption notice, seconds (default 120)")
    p.add_argument("--spot-reacquire-min", type=nonnegative_float, default=None,
                   help="minutes to get spot capacity back (default 30)")
    p.add_argument("--checkpoint-interval-min", type=positive_float, default=None,
                   help="work between checkpoints, minutes (default: Daly's optimum)")
    p.add_argument("--replica-groups", type=positive_int, default=None,
                   help="replica groups for the replica-FT goodput (default: the plan's "
                        "replicated data-parallel groups)")
    p.add_argument("--peer-gb-per-s", type=positive_float, default=None,
                   help="network GB/s per GPU for peer state copies (default 25)")
    p.add_argument("--deadline-days", type=positive_float, default=None,
                   help="recommend only a pricing whose P90 meets this")
    p.add_argument("--runs", type=positive_int, default=2000,
                   help=f"Monte Carlo runs (at most {MAX_RUNS:,})")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="Monte Carlo seed")
    p.add_argument("--json", action="store_true", help="print JSON (schema meshtron-cost/1)")
    negative_values_are_values(p)  # `--tokens -1T`: refused by token_budget, naming the flag
    p.set_defaults(func=run)


def token_budget(text: str) -> str:
    """--tokens as typed, once planner/cli.py `parse_tokens` accepts it: a refusal names the
    flag (the parser's error) and the value."""
    from meshtron.planner.cli import MAX_TOKENS, parse_tokens

    try:
        parse_tokens(text)
    except UserError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a positive number of tokens up to {MAX_TOKENS:.0e}, like 2e12, "
            "300B or 15T") from None
    return text


def _model_and_cluster(args: argparse.Namespace):
    """--model and --cluster, or with --plan the plan's own (a contradicting flag, or a
    --global-batch / --seq-len / --dtype the file does not hold: refused)."""
    plan = None
    if args.plan:
        from meshtron.planner.plan import load_priced_plan

        plan = load_priced_plan(args.plan)
        take_from_plan(args, plan, args.plan, require=True)
        # a batch or length the file does not hold would re-price another run under its name;
        # the plan's dtype is what is priced (a --dtype beside it was silently ignored)
        take_from_plan(args, plan, args.plan, flags=("global_batch", "seq_len", "dtype"))
    for flag in ("model", "cluster"):
        if getattr(args, flag) is None:
            raise UserError(f"{flag}: required (or give --plan PLAN.toml, which names it)")
    return plan


def _estimate(args: argparse.Namespace, model, cluster, plan=None):
    """(Estimate, global batch, sequence length, warnings, Framework priced)."""
    from meshtron.planner.cli import framework_of, plan_framework
    from meshtron.planner.search import evaluate_plan, search_plans

    if plan is not None:
        # the stack and options the plan was saved with (what `meshtron plan` priced), as the
        # stack runs the model (its MoE path)
        fw, note = plan_framework(args, plan, model)
        batch = args.global_batch or plan.global_batch
        seq = args.seq_len or plan.seq_len
        if batch is None or seq is None:
            raise UserError(f"plan={args.plan!r}: has no global_batch/seq_len; give "
                            "--global-batch and --seq-len")
        # a plan file pins every mesh axis: priced even when predicted not to fit (`run` warns),
        # as `meshtron plan` answers a pinned layout (planner/pinned.py layout_pinned), and on
        # its own layer split when the stack's rule cannot build it (report.split_warning)
        result = search_plans(model, cluster, batch, seq, plan, top_k=1, explain=False,
                              framework=fw)
        # as evaluate_plan: not fitting, the split a fitting plan gets (it refuses no plan)
        est = (result.best or result.near_miss_priced
               or evaluate_plan(model, cluster, batch, seq, plan, framework=fw))
        warnings = [f"plan={args.plan!r}: {note}"] if note else []
        if not getattr(args, "framework", None) and note is None:
            from meshtron.planner.plan_priced import unrecorded_stack_warning

            old = unrecorded_stack_warning(plan, est.step_time_s, est.memory.total)
            warnings += [f"plan={args.plan!r}: {old}"] if old else []
        if result.split_fallback is not None:
            from meshtron.planner.report import split_warning

            warnings.append(f"plan={args.plan!r}: {split_warning(result, est)}")
        return est, batch, seq, warnings, fw
    fw = framework_of(args, model)  # as the stack runs the model (its MoE path)
    if args.global_batch is None or args.seq_len is None:
        raise UserError("global-batch/seq-len: both are required without --plan")
    fixed = {"dtype": args.dtype} if args.dtype else None
    result = search_plans(model, cluster, args.global_batch, args.seq_len, fixed, top_k=1,
                          framework=fw, explain=False)
    if not result.fits:
        raise UserError(f"cluster={args.cluster!r}: no plan of {args.model} fits "
                        f"({cluster.num_gpus} GPUs, global batch {args.global_batch})")
    return result.best, args.global_batch, args.seq_len, [], fw


def run_spec(args: argparse.Namespace, est, model, cluster, batch: int, seq: int):
    from meshtron.cost.model import RunSpec
    from meshtron.planner.cli import parse_tokens

    kw: dict[str, Any] = {}
    if args.mtbf_hours is not None and args.failures_per_gpu_hour is not None:
        raise UserError("mtbf-hours: give it or --failures-per-gpu-hour, not both")
    if args.mtbf_hours is not None:
        kw["failures_per_gpu_hour"] = 1.0 / (args.mtbf_hours * cluster.num_gpus)
    elif args.failures_per_gpu_hour is not None:
        kw["failures_per_gpu_hour"] = args.failures_per_gpu_hour
    for flag, key, scale in (("storage_gb_per_s", "storage_gb_per_s", 1),
                             ("restart_min", "restart_s", 60),
                             ("spot_preemptions_per_node_hour", "spot_preemptions_per_node_hour",
                              1),
                             ("spot_notice_s", "spot_notice_s", 1),
                             ("spot_reacquire_min", "spot_reacquire_s", 60),
                             ("checkpoint_interval_min", "interval_s", 60), ("pue", "pue", 1)):
        value = getattr(args, flag)
        if value is not None:
            kw[key] = value * scale
    kw.update(_checkpoint_size(est.config, cluster.gpus_per_node))
    return RunSpec(gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node,
                   step_time_s=est.step_time_s, tokens_per_step=float(batch * seq),
                   tokens=parse_tokens(args.tokens), params=float(model.num_params()), **kw)


def _checkpoint_size(plan, gpus_per_node: int) -> dict[str, Any]:
    """RunSpec's checkpoint bytes per parameter: the model and AdamW's 12, and a compressed or
    DiLoCo plan's state (every rank's own residual grows it with the data-parallel size)."""
    from meshtron.cost.model import CHECKPOINT_BYTES_PER_PARAM
    from meshtron.planner.memory_compress import checkpoint_extra_per_param

    extra, parts = checkpoint_extra_per_param(plan, gpus_per_node)
    if not extra:
        return {}
    return {"checkpoint_bytes_per_param": CHECKPOINT_BYTES_PER_PARAM + extra,
            "checkpoint_parts": f"{CHECKPOINT_BYTES_PER_PARAM:g} model and AdamW, {parts}"
            + ("; `meshtron train --checkpoint-residuals mean` saves the mean alone"
               if "own error-feedback" in parts else "")}


def run(args: argparse.Namespace) -> int:
    from meshtron.cost.catalogue import economics_for, load_price_overrides
    from meshtron.cost.model import cost_run
    from meshtron.cost.summary import regime_warnings, summary
    from meshtron.planner.cli import load_model
    from meshtron.planner.cluster import resolve_cluster

    plan = _model_and_cluster(args)
    if args.runs > MAX_RUNS:
        raise UserError(f"runs={args.runs}: at most {MAX_RUNS:,} Monte Carlo runs (percentiles "
                        "settle by ~10,000)")
    model = load_model(args.model)
    cluster = resolve_cluster(args.cluster)
    econ = economics_for(cluster, args.price_on_demand, args.price_spot, args.gpu_watts,
                         args.system_watts,
                         load_price_overrides(args.prices) if args.prices else None)
    est, batch, seq, warnings, fw = _estimate(args, model, cluster, plan)
    spec = run_spec(args, est, model, cluster, batch, seq)
    pricings = cost_run(spec, econ, runs=args.runs, seed=args.seed)
    if all(p.never is not None for p in pricings.values()):
        raise UserError(_never_line(args, spec, pricings["on_demand"].never))
    doc = summary(spec, econ, pricings, args.deadline_days)
    doc["plan"] = est.config.describe() + est.config.comm_label()
    doc["framework"] = fw.label
    doc["goodput"], doc["_goodput_lines"] = goodput_section(args, spec, est.config)
    doc["fits"] = est.fits
    warnings += [w for w in (_fit_warning(args, est, fw),
                            _deadline_warning(doc, args.deadline_days)) if w]
    warnings += regime_warnings(spec, pricings)
    doc["warnings"] = warnings
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    lines = doc.pop("_goodput_lines")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        # stdout marks a plan that does not fit too, not only stderr's warning
        head = ("" if est.fits else "PREDICTED NOT TO FIT (priced anyway): "
                f"{_need(est)}\n")
        print(head + render(doc) + "\n\n" + "\n".join(lines))
    return 0


NEVER_FLAGS = (("mtbf_hours", "--mtbf-hours"), ("failures_per_gpu_hour", "--failures-per-gpu-hour"),
               ("restart_min", "--restart-min"), ("storage_gb_per_s", "--storage-gb-per-s"),
               ("checkpoint_interval_min", "--checkpoint-interval-min"))
"""The flags that set how often a run is struck and what each strike costs."""


def _never_line(args: argparse.Namespace, spec, reason: str) -> str:
    """The one line of a run that never finishes at any pricing, naming the flags the user
    gave that make it so (or the cluster, whose GPUs set the failure rate by default)."""
    given = [f"{flag}={getattr(args, name):g}" for name, flag in NEVER_FLAGS
             if getattr(args, name) is not None]
    what = (", ".join(given) if given else
            f"--cluster={args.cluster} (the default failure rate over {spec.gpus:,} GPUs)")
    return (f"{what}: the run never finishes at any pricing: {reason}; allowed: a job MTBF "
            "well above the restart and the save (longer --mtbf-hours, shorter --restart-min, "
            "faster --storage-gb-per-s)")


def _need(est) -> str:
    from meshtron.planner.report import need_text

    return need_text(est, parts=False)


def goodput_section(args: argparse.Namespace, spec, plan) -> tuple[dict[str, Any], list[str]]:
    """Goodput of restart-from-disk, in-memory recovery and replica FT at the run's failure
    rate, from the measured recovery seconds (meshtron/reliability/goodput.py)."""
    from meshtron.cost.model import FAILURES_ONLY
    from meshtron.reliability.goodput import (DEFAULT_PEER_GB_PER_S, at_job_scale, goodput_doc,
                                              goodput_table, load_recovery_times,
                                              render_goodput, replica_groups)

    # One restart time for the header and this table: the cost model's job restart (default
    # or --restart-min), not the seconds measured on a 2-rank CPU run (reliability/goodput.py
    # at_job_scale).
    label = (f"--restart-min {args.restart_min:g}" if args.restart_min is not None
             else "default 10 min, --restart-min")
    times = at_job_scale(load_recovery_times(), spec.restart_s, label)
    groups = replica_groups(args.replica_groups, plan.dp, plan.replicas)
    bw = args.peer_gb_per_s if args.peer_gb_per_s is not None else DEFAULT_PEER_GB_PER_S
    rows = goodput_table(spec.step_time_s, spec.mtbf_s, spec.params, spec.gpus, spec.save_s,
                         groups, times, peer_gb_per_s=bw)
    # the goodput table counts hardware failures only (as on demand): preemptions are priced
    # in the spot rows above
    return goodput_doc(rows, times, spec.mtbf_s), render_goodput(
        rows, times, spec.mtbf_s, counts=f"{FAILURES_ONLY}, as on demand")


def _fit_warning(args: argparse.Namespace, est, fw) -> str | None:
    """A line when the --plan priced is predicted not to fit (None when it fits); the
    rehearsal's word only for meshtron's own runtime short of GPU memory (report.trust_text)."""
    if est.fits:
        return None
    from meshtron.planner.report import need_text, trust_text

    trust = trust_text(est, fw, f"`meshtron rehearse --plan {args.plan}` "
                       "checks it")
    return (f"plan={args.plan!r}: predicted not to fit on {args.cluster}, "
            f"{need_text(est)}; priced anyway" + (f" ({trust.rstrip('; ')})" if trust else ""))


def _deadline_warning(doc: dict[str, Any], deadline: float | None) -> str | None:
    """A line when neither pricing meets --deadline-days at P90."""
    if deadline is None:
        return None
    p90 = {name: doc[name]["p90_days"] for name in ("on_demand", "spot")
           if doc[name]["finishes"]}
    if min(p90.values()) <= deadline:
        return None
    best = min(p90, key=p90.get)
    return (f"deadline-days={deadline:g}: no option meets it at P90 (fastest: "
            f"{best.replace('_', '-')} at {p90[best]:.1f} days); the recommendation below is "
            "the cheapest, not one that meets the deadline")


def _preemption_text(ck: dict[str, Any]) -> str:
    """How spot preemptions enter the run: their MTBF and whether their notice covers a save."""
    every = ck["spot_preemption_mtbf_s"]
    if every is None:
        return "no spot preemptions"
    notice, save = ck["spot_notice_s"], ck["save_s"]
    head = (f"spot preemptions every {every / 3600:.2f} h (+{ck['spot_reacquire_s'] / 60:.0f} "
            "min each to get capacity back)")
    if notice >= save:
        return f"{head}, a save fits in their {notice:g} s notice: no work lost"
    from meshtron.cost.summary import seconds_text

    return (f"{head}, their {notice:g} s notice < the {seconds_text(save)} save: they lose "
            "work")


def render(doc: dict[str, Any]) -> str:
    """The human-readable report."""
    from meshtron.cost.summary import LABELS, interval_text, seconds_text
    from meshtron.planner.report import fmt_count

    od, sp, ck, pr = doc["on_demand"], doc["spot"], doc["checkpoint"], doc["prices"]
    work_s = doc["failure_free_days"] * 86400
    gpus = f"{doc['gpus']:,} GPU" + ("s" if doc["gpus"] != 1 else "")
    lines = [
        f"Plan: {doc['plan']} on {gpus}, step {doc['step_time_s']:.2f} s, "
        f"{fmt_count(doc['tokens'])} tokens: {doc['failure_free_days']:.1f} days without "
        "failures",  # 1T, not 1e+12
        f"Checkpoint: {ck['bytes'] / 1e9:,.4g} GB ({ck['bytes_per_param']:g} B per parameter: "
        f"{ck['bytes_per_param_parts']}), save {seconds_text(ck['save_s'])}, restart "
        f"{seconds_text(ck['restart_s'])} (job restart + reading the checkpoint back)",
        f"Interruptions: job MTBF {ck['mtbf_s'] / 3600:.2f} h ({ck['mtbf_counts']}); "
        + _preemption_text(ck),
        "Checkpoint interval: " + "; ".join(
            f"{LABELS[name]} " + interval_text(p["checkpoint_interval_s"], p["daly_interval_s"],
                                               p["interval_mtbf_s"], p["interval_mtbf_counts"],
                                               work_s)
            for name, p in (("on_demand", od), ("spot", sp))),
    ] + ([] if doc.get("framework", "meshtron@").startswith("meshtron@") else [
        f"Priced for {doc['framework']} (frameworks.py)"]) + [
        f"Prices: on-demand ${pr['on_demand']:.6g}, spot ${pr['spot']:.6g} per GPU-hour "
        f"({pr['source']}); power {pr['system_w_per_gpu']:.0f} W per GPU x PUE {pr['pue']:g}",
        "",
        f"{'':12} {'days':>7} {'P50':>7} {'P90':>7} {'GPU-hours':>13} {'cost USD':>15} "
        f"{'P90 cost USD':>15}",
    ]
    for name, p in (("on_demand", od), ("spot", sp)):
        if not p["finishes"]:
            lines.append(f"{LABELS[name]:12} never finishes (the warning says why)")
            continue
        lines.append(f"{LABELS[name]:12} {p['days']:7.1f} {p['p50_days']:7.1f} "
                     f"{p['p90_days']:7.1f} {p['gpu_hours']:13,.0f} {p['cost_usd']:15,.0f} "
                     f"{p['p90_cost_usd']:15,.0f}")
    lines += ["", "Energy (expected wall time x power): " + "; ".join(
        f"{LABELS[name]} {p['energy_kwh']:,.0f} kWh at the facility ({p['gpu_energy_kwh']:,.0f} "
        "kWh in the GPUs)" for name, p in (("on_demand", od), ("spot", sp)) if p["finishes"]),
        "", f"Recommendation: {LABELS[doc['recommendation']['pricing']]}"]
    lines += [f"  - {r}" for r in doc["recommendation"]["reasons"]]
    return "\n".join(lines)
