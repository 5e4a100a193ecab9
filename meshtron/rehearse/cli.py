"""`meshtron rehearse`: run one rank of a plan alone and put its peak memory (and on a GPU its
compute-only step time) next to the planner's.

    meshtron rehearse --model llama3-8b --cluster dgx-h100:2 --global-batch 16 --seq-len 4096 \\
        --layout tp=2,dp=8 --zero 3 --micro-batch 1
    meshtron rehearse --plan plan.toml --rank 5 --json
    meshtron plan ... --rehearse            # the chosen plan, same table

Knobs left open are chosen by the planner (as `meshtron plan` would), so what is rehearsed is
a plan the runtime runs. Parsing imports no torch (startup rule); the run does.
Exit status: 0; 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from meshtron.argtypes import positive_int, take_from_plan
from meshtron.errors import UserError
from meshtron.rehearse.run import device_for, print_report, rehearse

def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "rehearse", help="run one rank of a plan alone (fake process group) and compare its "
                         "peak memory with the planner's",
        description="Build one rank of a plan with meshtron's runtime in a single process whose "
                    "collectives return at once, run one training step at the plan's shapes "
                    "(fake tensors on CPU: nothing allocated), and print its peak memory by "
                    "category next to the planner's breakdown.")
    p.add_argument("--plan", help="a saved plan (meshtron plan --save); else give the model, "
                                  "cluster and batch as for `meshtron plan`")
    p.add_argument("--model", help="preset name, Hugging Face config.json path or TOML file")
    p.add_argument("--cluster", help="dgx-h100:N, ... or a cluster TOML (the world is its GPUs)")
    p.add_argument("--global-batch", type=positive_int, help="sequences per step")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence")
    p.add_argument("--layout", help="fix any of tp, cp, pp, dp, ep (e.g. tp=8,pp=16)")
    p.add_argument("--zero", type=int, help="fix the ZeRO stage (0-3)")
    p.add_argument("--recompute", help="fix recomputation: none | selective | half | full")
    p.add_argument("--sp", help="fix sequence parallelism: on | off")
    p.add_argument("--micro-batch", type=positive_int, help="fix the micro-batch size")
    p.add_argument("--schedule", help="fix the pipeline schedule: 1f1b | interleaved[:V] | "
                                      "zb | zbv | gpipe")
    p.add_argument("--dp-replicate", type=positive_int, default=None,
                   help="HSDP: replicate ZeRO-2/3 shards over this many groups (divides dp)")
    p.add_argument("--offload", default=None,
                   help="host offload: none | full (FSDP2 CPUOffloadPolicy; 'optimizer' is "
                        "planned only, not run)")
    p.add_argument("--dtype", default=None, help="bf16 (default) | fp32 | fp8")
    p.add_argument("--fp8-recipe", default=None, choices=("rowwise", "tensorwise"),
                   help="with --dtype fp8: torchao's scaling (default rowwise)")
    p.add_argument("--compile", action="store_true",
                   help="a compiled plan (per-block torch.compile); on CPU the blocks are "
                        "rehearsed eagerly and the report says so")
    p.add_argument("--rank", type=int, default=None,
                   help="global rank to rehearse (default: the first rank of the stage the "
                        "planner finds fullest)")
    p.add_argument("--device", default="auto",
                   help="cpu (fake tensors, nothing allocated) | cuda (real tensors: measured "
                        "peak and step time) | auto (cuda when present)")
    p.add_argument("--expert-imbalance", type=imbalance_factor, default=None,
                   help="mixture of experts: tokens on the rehearsed rank's experts over the "
                        "mean (1 = balanced; default the planner's expert_imbalance)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def imbalance_factor(text: str) -> float:
    """--expert-imbalance: a number from 1 to 64 (the planner's expert_imbalance range)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value <= 64.0:
        raise argparse.ArgumentTypeError(f"--expert-imbalance={text!r}: must be a number "
                                         "from 1 (balanced) to 64")
    return value


def _resolve(args: argparse.Namespace):
    """(model spec, Plan with global_batch and seq_len, cluster)."""
    from meshtron.planner.cli import collect_knobs, load_model
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.search import search_plans

    if args.plan:
        from meshtron.planner.plan import load_priced_plan

        plan = load_priced_plan(args.plan)
        _refuse_flags_the_plan_fixes(args, plan)
        model = load_model(args.model)
        cluster = resolve_cluster(args.cluster)
        if cluster.num_gpus != plan.gpus:
            from meshtron.train.planning import sized_cluster

            cluster = sized_cluster(cluster, plan.gpus)
        return model, _validated(_with_run_flags(plan, args), model), cluster
    for flag in ("model", "cluster", "global_batch", "seq_len"):
        if getattr(args, flag) is None:
            raise UserError(f"--{flag.replace('_', '-')}: required without --plan")
    model = load_model(args.model)
    cluster = resolve_cluster(args.cluster)
    knobs = collect_knobs(argparse.Namespace(**{**vars(args), "reduce_dtype": None,
                                               "accumulate_unsharded": None}))
    result = search_plans(model, cluster, args.global_batch, args.seq_len, knobs, top_k=1,
                          explain=False)
    # nothing fits: the plan `meshtron plan` prices for this layout (the time-balanced split of
    # the leanest candidate, SearchResult.near_miss_priced), so both commands rehearse the same
    est = result.best or result.near_miss_priced or result.near_miss
    if est is None:
        raise UserError(f"layout {args.layout!r}: no valid plan on {cluster.num_gpus} GPUs")
    plan = est.to_plan(args.model, cluster.name, cluster.num_gpus, args.global_batch,
                       args.seq_len, result.options.attention)
    return model, _validated(_with_run_flags(plan, args), model), cluster


def _validated(plan, model):
    """`plan` once meshtron's runtime can run its layout (the one validity function); a plan
    saved for another stack is rehearsed on meshtron's runtime, priced as that stack."""
    from meshtron.rehearse.compare import runnable

    model.check_seq_len(plan.seq_len, "--seq-len")  # as `train` refuses it
    runnable(plan).validate(plan.gpus, model)
    return plan


PLAN_FIXES = ("layout", "zero", "recompute", "sp", "micro_batch", "schedule", "dp_replicate",
              "offload", "dtype")
"""The search's knobs: a saved plan has chosen each (they used to be ignored beside --plan)."""


def _refuse_flags_the_plan_fixes(args: argparse.Namespace, plan) -> None:
    """--model and --cluster the plan's unless given, and refused when they contradict it (as
    `cost --plan`); --global-batch and --seq-len may restate the plan's; a search knob is
    refused: it would be silently ignored."""
    take_from_plan(args, plan, args.plan, require=True)
    take_from_plan(args, plan, args.plan, flags=("global_batch", "seq_len"))
    if plan.global_batch is None or plan.seq_len is None:
        raise UserError(f"plan={args.plan!r}: has no global_batch/seq_len to rehearse")
    for flag in PLAN_FIXES:
        value = getattr(args, flag)
        if value is not None:
            raise UserError(f"--{flag.replace('_', '-')}={value!r}: the saved plan {args.plan} "
                            "fixes the layout and its knobs; drop the flag or re-plan")


def _with_run_flags(plan, args: argparse.Namespace):
    """The plan as the run's flags set it (meshtron train's --compile, --fp8-recipe): knobs
    the search does not choose."""
    import dataclasses

    change = {}
    if getattr(args, "compile", False):
        change["compile"] = True
    if getattr(args, "fp8_recipe", None):
        change["fp8_recipe"] = args.fp8_recipe
    return dataclasses.replace(plan, **change) if change else plan


def run(args: argparse.Namespace) -> int:
    device = device_for(args.device)
    model, plan, cluster = _resolve(args)
    report = rehearse(model, plan, cluster, device, args.rank, args.expert_imbalance)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
