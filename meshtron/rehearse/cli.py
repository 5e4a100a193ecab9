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
import sys
from typing import Any

from meshtron.argtypes import positive_int
from meshtron.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


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
    p.add_argument("--dtype", default=None, help="bf16 (default) | fp32 | fp8")
    p.add_argument("--rank", type=int, default=None,
                   help="global rank to rehearse (default: the first rank of the stage the "
                        "planner finds fullest)")
    p.add_argument("--device", default="auto",
                   help="cpu (fake tensors, nothing allocated) | cuda (real tensors: measured "
                        "peak and step time) | auto (cuda when present)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def device_for(text: str) -> str:
    """The device to rehearse on: cpu, cuda, or auto (cuda when present)."""
    text = (text or "auto").strip().lower()
    if text not in DEVICES:
        raise UserError(f"device={text!r}: allowed values are {', '.join(DEVICES)}")
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cuda" and not torch.cuda.is_available():
        raise UserError("device='cuda': no CUDA device here; use --device cpu (fake tensors)")
    return text


def _resolve(args: argparse.Namespace):
    """(model spec, Plan with global_batch and seq_len, cluster)."""
    from meshtron.planner.cli import collect_knobs, load_model
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.search import search_plans

    if args.plan:
        from meshtron.planner.plan import load_plan

        plan = load_plan(args.plan)
        model = load_model(args.model or plan.model)
        name = args.cluster or plan.cluster
        if not name:
            raise UserError(f"plan={args.plan!r}: names no cluster; give --cluster")
        cluster = resolve_cluster(name)
        if cluster.num_gpus != plan.gpus:
            from meshtron.train.planning import sized_cluster

            cluster = sized_cluster(cluster, plan.gpus)
        if plan.global_batch is None or plan.seq_len is None:
            raise UserError(f"plan={args.plan!r}: has no global_batch/seq_len to rehearse")
        return model, plan.validate(plan.gpus, model), cluster
    for flag in ("model", "cluster", "global_batch", "seq_len"):
        if getattr(args, flag) is None:
            raise UserError(f"--{flag.replace('_', '-')}: required without --plan")
    model = load_model(args.model)
    cluster = resolve_cluster(args.cluster)
    knobs = collect_knobs(argparse.Namespace(**{**vars(args), "dp_replicate": None,
                                               "reduce_dtype": None,
                                               "accumulate_unsharded": None,
                                               "offload": None}))
    result = search_plans(model, cluster, args.global_batch, args.seq_len, knobs, top_k=1,
                          explain=False)
    est = result.best or result.near_miss
    if est is None:
        raise UserError(f"layout {args.layout!r}: no valid plan on {cluster.num_gpus} GPUs")
    plan = est.to_plan(args.model, cluster.name, cluster.num_gpus, args.global_batch,
                       args.seq_len, result.options.attention)
    return model, plan.validate(plan.gpus, model), cluster


def run(args: argparse.Namespace) -> int:
    device = device_for(args.device)
    model, plan, cluster = _resolve(args)
    report = rehearse(model, plan, cluster, device, args.rank)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def rehearse(model, plan, cluster, device: str, rank: int | None = None) -> dict[str, Any]:
    """Rehearse `rank` (default: the planner's fullest stage) of `plan`; the report dict."""
    from meshtron.rehearse import compare

    if model.is_moe and device == "cpu":
        raise UserError(f"model={model.name!r}: a mixture of experts routes tokens by value "
                        "(bincount, uneven all-to-all splits), which fake tensors cannot "
                        "size; rehearse it on a GPU (--device cuda)")
    plan = compare.with_layer_split(plan, model)
    est = compare.planner_estimate(model, cluster, plan, device)
    if rank is None:
        rank = compare.first_rank_of_stage(plan, est.memory.stage)
    if not 0 <= rank < plan.gpus:
        raise UserError(f"rank={rank}: the plan has ranks 0..{plan.gpus - 1}")
    pp_rank = compare.pp_rank_of(plan, rank)
    bd = compare.with_stage_breakdown(est, plan, model, cluster, device, pp_rank)
    from meshtron.rehearse.rank import rehearse_rank

    got = rehearse_rank(model, plan, rank, device)
    rows = compare.rows_table(compare.rehearsal_rows(got["peak_bytes"]),
                              compare.planner_rows(bd))
    report = {"model": model.name, "plan": plan.to_dict(), "device": device, "rank": rank,
              "pp_rank": pp_rank, "stages": got["stages"], "layers": got["layers"],
              "measured": got["measured"], "wall_s": round(got["wall_s"], 2),
              "memory": rows, "planner_workspace_gib": bd.workspace,
              "planner_fits": est.fits, "capacity_gib": bd.capacity}
    if "step_s" in got:
        report["step_s"] = got["step_s"]
        t = est.time
        # a rank alone waits for no one: no bubble, and its collectives take no time
        report["planner_compute_s"] = t.compute + t.optimizer
    return report


def print_report(report: dict[str, Any]) -> None:
    p = report["plan"]
    axes = ",".join(f"{k}={p[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if p.get(k, 1) != 1)
    print(f"Rehearsal of rank {report['rank']} (pipeline rank {report['pp_rank']}, stages "
          f"{report['stages']}, {report['layers']} layers) of {report['model']} "
          f"{axes or 'dp=1'} zero={p['zero']} micro_batch={p['micro_batch']} "
          f"recompute={p['recompute']} on {report['device']} ({report['measured']}), "
          f"{report['wall_s']:.1f} s")
    print(f"{'peak memory (GiB)':<20}{'rehearsal':>12}{'planner':>12}{'planner vs':>12}")
    for r in report["memory"]:
        rel = r["planner_vs_rehearsal"]
        print(f"{r['row']:<20}{r['rehearsal_gib']:>12.3f}{r['planner_gib']:>12.3f}"
              f"{'' if rel is None else f'{rel:+.1%}':>12}")
    print("(rows below the total are the tracker's categories, filed by when a tensor is "
          "made: FSDP's unsharded gradient accumulation lands in activations; compare totals)")
    print(f"(planner adds {report['planner_workspace_gib']:.2f} GiB of workspace and "
          f"fragmentation no tensor tracker sees; device {report['capacity_gib']:.0f} GiB)")
    if "step_s" in report:
        print(f"step (compute only): rehearsal {report['step_s']:.3f} s, planner "
              f"{report['planner_compute_s']:.3f} s")
    sys.stdout.flush()
