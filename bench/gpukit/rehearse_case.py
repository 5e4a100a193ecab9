"""`meshtron rehearse` on the one GPU (issue 30 item 1): two ranks of a plan far larger than
the machine, Llama-3-70B on 64 H200s (tp=8, pp=4, dp=2), each alone in its own process with a
fake process group and real tensors: the allocator's peak and the compute-only step time of
the rank next to the planner's (its allocated memory and its compute + optimizer time).

Rank 0 is on the first pipeline stage (embeddings, the most in-flight micro-batches under
1F1B); the second rank is on the last stage (the output layer and the loss). The plan is the
planner's (`meshtron plan --save`), the rehearsals are the user's command (`meshtron rehearse
--plan ... --json`). The dry run does the same with the tiny model on CPU (fake tensors).
"""

from __future__ import annotations

import json

from gpukit import common as C
from gpukit.cli_cases import on_sigterm, run  # noqa: F401 - the driver's cap stops commands

GPU = {"model": "llama3-70b", "cluster": "dgx-h200:8", "global_batch": 32, "seq_len": 4096,
       "layout": "tp=8,pp=4"}
DRY = {"model": "tiny", "cluster": "dgx-h100:1", "global_batch": 8, "seq_len": 64,
       "layout": "tp=2,pp=2"}


def last_stage_rank(plan_path) -> int:
    """The lowest global rank on the last pipeline stage (placement.py's rank order)."""
    from meshtron.planner.placement import placement
    from meshtron.planner.plan import load_plan

    plan = load_plan(plan_path)
    place = placement(plan, plan.gpus)
    return place.rank({**{a: 0 for a in place.axes}, "pp": plan.pp - 1})


def summary(report: dict) -> dict:
    """The figures of one rehearsal worth a glance: peaks and step times side by side."""
    total = next(r for r in report["memory"] if r["row"] == "total")
    out = {"rank": report["rank"], "pp_rank": report["pp_rank"], "stages": report["stages"],
           "layers": report["layers"], "measured": report["measured"],
           "wall_s": report["wall_s"], "peak_gib": total["rehearsal_gib"],
           "planner_allocated_gib": total["planner_gib"],
           "planner_over_measured_peak": (None if total["planner_vs_rehearsal"] is None
                                          else 1.0 + total["planner_vs_rehearsal"])}
    if "step_s" in report:
        out.update(step_s=report["step_s"], planner_compute_s=report["planner_compute_s"],
                   measured_over_planner_step=report["step_s"] / report["planner_compute_s"])
    return out


def case_rehearse(ctx: C.Ctx) -> None:
    setup = DRY if ctx.dry_run else GPU
    device = "cpu" if ctx.dry_run else "cuda"
    plan_path = ctx.work / "rehearse-plan.toml"
    ctx.emit(setup=setup, device=device)
    run(ctx, "plan", ["plan", "--model", setup["model"], "--cluster", setup["cluster"],
                      "--global-batch", str(setup["global_batch"]), "--seq-len",
                      str(setup["seq_len"]), "--layout", setup["layout"], "--save",
                      str(plan_path)], 60)
    ranks: dict = {}
    for label, rank in (("first_stage", None), ("last_stage", last_stage_rank(plan_path))):
        argv = ["rehearse", "--plan", str(plan_path), "--device", device, "--json"]
        rec = run(ctx, f"rehearse_{label}", argv + ([] if rank is None else
                                                    ["--rank", str(rank)]), 240)
        out = (ctx.work / f"cli-rehearse_{label}.out").read_text()
        ranks[label] = summary(json.loads(out[out.index("{"):]))
        ranks[label]["seconds"] = rec["seconds"]
        ctx.emit(ranks=ranks)
