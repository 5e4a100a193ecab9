"""Rehearse a plan and report it (torch-free at import; `meshtron rehearse` and
`meshtron plan --rehearse` both call `rehearse`)."""

from __future__ import annotations

import sys
from typing import Any

from meshtron.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


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


def rehearse(model, plan, cluster, device: str, rank: int | None = None,
             imbalance: float | None = None, real: bool | None = None) -> dict[str, Any]:
    """Rehearse `rank` (default: the planner's fullest stage) of `plan`; the report dict.
    `imbalance`: a mixture of experts' load on the rehearsed rank's experts over the mean,
    given to both sides (default the planner's `expert_imbalance`). `real`: real tensors
    (default: on CUDA only; see rank.rehearse_rank). A plan saved for another stack
    (Plan.framework) is run on meshtron's runtime and priced, in the planner's column, as
    that stack with its options: what `meshtron plan` priced."""
    from meshtron.rehearse import compare

    plan, fw, imbalance = compare.pricing(plan, model, imbalance)
    est = compare.planner_estimate(model, cluster, plan, device, imbalance, framework=fw)
    if rank is None:
        rank = compare.first_rank_of_stage(plan, est.memory.stage)
    if not 0 <= rank < plan.gpus:
        raise UserError(f"rank={rank}: the plan has ranks 0..{plan.gpus - 1}")
    pp_rank = compare.pp_rank_of(plan, rank)
    bd = compare.with_stage_breakdown(est, plan, model, cluster, device, pp_rank, imbalance,
                                      fw)
    from meshtron.rehearse.rank import rehearse_rank

    got = rehearse_rank(model, compare.runnable(plan), rank, device, imbalance, real)
    compiled = bd
    ran = compare.as_ran(plan, "compile" in got)
    if ran is not plan:  # the blocks ran eagerly: set beside the planner's eager pricing
        bd = compare.planner_estimate(model, cluster, ran, device, imbalance,
                                      stage=pp_rank, framework=fw).memory
    # the outer loop's and the codec's state (DiLoCo's outer copy and momentum, error-feedback
    # residuals): built by the engine's features, not by the rehearsal's rank; the planner's
    # count of it is exact per rank (planner/memory_compress.py, measured byte for byte in
    # tests/test_compress_priced.py), constant through the step, so it adds to the peak
    unbuilt = compare.unbuilt_state_gib(model, plan, rank)
    rows = compare.rows_table(compare.rehearsal_rows(got["peak_bytes"], unbuilt),
                              compare.planner_rows(bd))
    report = {"model": model.name, "plan": plan.to_dict(), "device": device, "rank": rank,
              "pp_rank": pp_rank, "stages": got["stages"], "layers": got["layers"],
              "measured": got["measured"], "wall_s": round(got["wall_s"], 2),
              "memory": rows, "planner_workspace_gib": bd.workspace,
              "planner_fits": est.fits, "capacity_gib": bd.capacity}
    if unbuilt:
        report["unbuilt_state_gib"] = unbuilt
    planned, cpu_kernels, workspace = est, 0.0, bd.workspace
    if device == "cpu":  # what `meshtron plan` printed for this rank: the GPU's kernels
        gpu = compare.planner_estimate(model, cluster, plan, "cuda", imbalance, stage=pp_rank,
                                       framework=fw)
        report["planner_gpu_total_gib"] = gpu.memory.total
        planned = gpu
        workspace = compare.planner_estimate(model, cluster, ran, "cuda", imbalance,
                                             stage=pp_rank, framework=fw).memory.workspace
        cpu_kernels = compare.cpu_kernels_extra(model, cluster, ran, pp_rank, imbalance,
                                                bd if fw is None else None)
    if fw is not None:
        report["framework"] = fw.label
    total = {r["row"]: r for r in rows}["total"]
    report["fit"] = compare.fit_verdict(total["rehearsal_gib"], workspace, bd.capacity,
                                        planned.memory.total, planned.fits, cpu_kernels)
    if "peak_at" in got:
        report["peak_at"] = got["peak_at"]
    if "compile" in got:
        report["compile"] = got["compile"]
        report["planner_compiled_total_gib"] = compiled.allocated
    if model.is_moe:
        report["expert_imbalance"] = imbalance
    report["microbatches"] = plan.global_batch // (plan.dp * plan.micro_batch)
    if "microbatches_run" in got:  # fewer when they reach the same peak (microbatches.py)
        report["microbatches_run"] = got["microbatches_run"]
    if "step_s" in got:
        report["step_s"] = got["step_s"]
        t = est.time
        # a rank alone waits for no one: no bubble, and its collectives take no time
        report["planner_compute_s"] = t.compute + t.optimizer
    return report


def rehearse_best(model, plan, cluster_name: str) -> dict[str, Any]:
    """`meshtron plan --rehearse`: the planner's best plan rehearsed on this machine's device."""
    from meshtron.planner.cluster import resolve_cluster

    return rehearse(model, plan, resolve_cluster(cluster_name), device_for("auto"))


def print_report(report: dict[str, Any]) -> None:
    from meshtron.rehearse.compare import verdict_line as compare_verdict

    p = report["plan"]
    axes = ",".join(f"{k}={p[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if p.get(k, 1) != 1)
    if p.get("dp_replicate", 1) > 1:
        axes += f" dp_replicate={p['dp_replicate']}"
    for key, off in (("offload", "none"), ("dtype", "bf16")):
        if p.get(key, off) != off:
            recipe = p.get("fp8_recipe", "rowwise")
            axes += f" {key}={p[key]}" + (f" ({recipe})" if p[key] == "fp8" else "")
    if p.get("compile"):
        axes += " compile"
    print(f"Rehearsal of rank {report['rank']} (pipeline rank {report['pp_rank']}, stages "
          f"{report['stages']}, {report['layers']} layers) of {report['model']} "
          f"{axes or 'dp=1'} zero={p['zero']} micro_batch={p['micro_batch']} "
          f"recompute={p['recompute']} on {report['device']} ({report['measured']}), "
          f"{report['wall_s']:.1f} s")
    if "expert_imbalance" in report:
        hot = (f", the rehearsed rank's experts at {report['expert_imbalance']:g}x it on both "
               "sides" if p.get("ep", 1) > 1 else "")
        print(f"(experts: tokens per expert fixed at the mean T*k/E{hot})")
    if "compile" in report:
        print(f"(compile: {report['compile']}; the planner column prices the same plan eager, "
              f"compiled it holds {report['planner_compiled_total_gib']:.3f} GiB)")
    if "microbatches_run" in report:
        print(f"(ran {report['microbatches_run']} of the step's {report['microbatches']} "
              "micro-batches: the fewest that reach the step's peak)")
    if "peak_at" in report:
        print(f"(the peak: {report['peak_at']})")
    print(f"{'peak memory (GiB)':<20}{'rehearsal':>12}{'planner':>12}{'planner vs':>12}")
    for r in report["memory"]:
        rel = r["planner_vs_rehearsal"]  # None: a side too small to compare
        print(f"{r['row']:<20}{r['rehearsal_gib']:>12.3f}{r['planner_gib']:>12.3f}"
              f"{'-' if rel is None else f'{rel:+.1%}':>12}")
    print("(rows below the total are the tracker's categories, filed by when a tensor is "
          "made: FSDP's unsharded gradient accumulation lands in activations; compare totals)")
    print(f"(planner adds {report['planner_workspace_gib']:.2f} GiB of workspace and "
          f"fragmentation no tensor tracker sees; device {report['capacity_gib']:.0f} GiB)")
    if "planner_gpu_total_gib" in report:  # else the two outputs seem to disagree
        print("(both sides above use the CPU's kernels: PyTorch's composite RMSNorm saves fp32 "
              "copies a CUDA kernel does not; `meshtron plan` prices the GPU's: "
              f"{report['planner_gpu_total_gib']:.1f} GiB with workspace)")
    if "unbuilt_state_gib" in report:
        print(f"(the rehearsal's optimizer row and total include "
              f"{report['unbuilt_state_gib']:.3f} GiB of DiLoCo / compression state the rank "
              "holds in a run but the rehearsal does not build: the planner's exact count)")
    if "framework" in report:
        print(f"(the planner column prices {report['framework']}, the stack the plan was "
              "saved for; the rehearsal runs meshtron's runtime on its layout)")
    print(compare_verdict(report["fit"]))
    if "step_s" in report:
        print(f"step (compute only): rehearsal {report['step_s']:.3f} s, planner "
              f"{report['planner_compute_s']:.3f} s")
    sys.stdout.flush()
