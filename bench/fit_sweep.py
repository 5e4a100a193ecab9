"""Does the planner ever reject a plan whose rehearsal fits? Sweep its near misses.

For each setting (model, cluster, batch, sequence, optional fixed knobs) the sweep enumerates
the candidates the search itself considers (SearchSpace and search_bound's enumeration),
prices each as the search decides fit (`Evaluator.evaluate(..., exact_memory=False)`: the
time-balanced layer split, meshtron's runtime, the GPU's kernels), and keeps

- rejected near misses: `MemoryBreakdown.total` over the capacity by at most `--margin`;
- accepted plans just under it: `total` within `--margin` below the capacity;

nearest the capacity first, `--per-side` of each. Each is rehearsed on CPU (`meshtron.rehearse`:
one rank of the planner's fullest stage, fake process group and fake tensors, real shapes).

Like with like. The planner decides fit on `total = allocated + workspace <= capacity`, where
`allocated` is its peak of the tensors (what torch.cuda.max_memory_allocated reports) and
`workspace` the allowance no tensor tracker sees (CUDA context, cuBLAS, NCCL: 1 GiB; the caching
allocator's fragmentation: 8% of the tensors; planner/memory.py `workspace_bytes`). The
rehearsal measures tensors only, on the CPU's kernels (PyTorch's composite RMSNorm saves fp32
copies a CUDA kernel does not), so the figures compared are:

- planner: `total` on the kernels the rehearsal ran (`meshtron rehearse`'s planner column plus
  its workspace); `meshtron plan`'s GPU-kernel `total` (what the search decided on) beside it;
- rehearsal: its peak tensors plus the same allowance (`workspace_bytes` of them).

A row is flagged REJECTED-FITS when the planner's `total` exceeds the capacity but the
rehearsal's tensors plus the allowance do not, ACCEPTED-EXCEEDS in the opposite case (both on
the rehearsal's kernels). The search decided on the GPU's kernels: the rehearsal is carried
there by taking off what the planner itself prices for the CPU's fp32 norm copies (planner CPU
minus GPU tensors; an estimate, no GPU rehearses here) and flagged the same way. `planner vs
rehearsal tensors` beyond 5% (issue 30's bound) is marked. Exit status 1 when a row is flagged
(either basis) and `--strict` is given.

    python bench/fit_sweep.py [--setting NAME ...] [--per-side N] [--margin F] [--strict]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = float(2**30)

SETTINGS: dict[str, dict] = {
    # name: model, cluster, global batch, sequence, knobs fixed for the search
    "8b-1node-s4096": dict(model="llama3-8b", cluster="dgx-h100:1", global_batch=32,
                           seq_len=4096, knobs={}),
    "8b-1node-s8192-tp8": dict(model="llama3-8b", cluster="dgx-h100:1", global_batch=8,
                               seq_len=8192, knobs={"tp": 8}),
    "70b-4node-s4096-tp8": dict(model="llama3-70b", cluster="dgx-h100:4", global_batch=32,
                                seq_len=4096, knobs={"tp": 8}),
    "mixtral-2node-s4096": dict(model="mixtral-8x7b", cluster="dgx-h100:2", global_batch=32,
                                seq_len=4096, knobs={}),
    "qwen3moe-1node-s4096": dict(model="qwen3-30b-a3b", cluster="dgx-h100:1", global_batch=32,
                                 seq_len=4096, knobs={}),
}
AGREE = 0.05
"""Issue 30's bound on planner vs rehearsal tensors (the first half of item 2)."""
QUICK = "8b-1node-s8192-tp8"
"""The setting tests/test_fit_sweep.py runs: tp=8 ranks of an 8B model rehearse in seconds."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", action="append", choices=sorted(SETTINGS), metavar="NAME",
                   help=f"settings to sweep (repeatable); allowed: {', '.join(SETTINGS)}; "
                        "default: all")
    p.add_argument("--per-side", type=int, default=2, metavar="N",
                   help="rejected and accepted plans rehearsed per setting, nearest the "
                        "capacity first (default 2)")
    p.add_argument("--margin", type=float, default=0.10, metavar="F",
                   help="how far from the capacity a plan may be, as a fraction (default 0.10)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a row is flagged")
    args = p.parse_args(argv)
    if args.per_side < 1:
        p.error(f"--per-side={args.per_side}: must be a positive integer")
    if not 0.0 < args.margin < 1.0:
        p.error(f"--margin={args.margin}: must lie between 0 and 1")
    return args


def candidates(setting: dict, margin: float, per_side: int):
    """(model, cluster, evaluator, [(side, Estimate)], [Estimate]): the search's candidates
    of `setting` within `margin` of the capacity, `per_side` rejected and accepted, nearest
    first; then every candidate whose fit decision disagrees with its own `total <= capacity`
    (the decision is the stages' linear model after the pipeline walks, the reported total
    the fullest stage's breakdown)."""
    from meshtron.planner.cli import load_model
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.frameworks import preset
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan_knobs import Knobs
    from meshtron.planner.search_bound import _enumerate, _Tally
    from meshtron.planner.search_space import SearchSpace

    model = load_model(setting["model"])
    cluster = resolve_cluster(setting["cluster"])
    gb, seq = setting["global_batch"], setting["seq_len"]
    opts = preset("meshtron").kernel  # as search_plans prices meshtron's runtime
    ev = Evaluator(model, cluster, gb, seq, opts)
    space = SearchSpace(model, cluster, gb, seq, Knobs.of(setting["knobs"]), opts, ev.mem,
                        True, None)
    queue, _, _ = _enumerate(ev, space, _Tally(1))
    rejected, accepted, seen = [], [], set()
    disagree = []  # the fit decision against the breakdown it reports: should never differ
    for _, _, cfg in queue:
        est = ev.evaluate(cfg, keep_infeasible=True, exact_memory=False)
        if est is None or not est.memory.host_fits:
            continue
        ratio = est.memory.total / est.memory.capacity
        if est.fits != (ratio <= 1.0):
            disagree.append(est)
        key = _memory_key(est)  # ZeRO 2 and 3 of one layout often price alike: rehearse one
        if key in seen:
            continue
        if not est.fits and ratio <= 1.0 + margin:  # the planner's own fit decision
            rejected.append((ratio - 1.0, est))
        elif est.fits and ratio >= 1.0 - margin:
            accepted.append((1.0 - ratio, est))
        else:
            continue
        seen.add(key)
    pick = ([("rejected", e) for _, e in sorted(rejected, key=lambda x: x[0])[:per_side]]
            + [("accepted", e) for _, e in sorted(accepted, key=lambda x: x[0])[:per_side]])
    return model, cluster, ev, pick, disagree


def _memory_key(est) -> tuple:
    c = est.config
    return (c.tp, c.cp, c.pp, c.dp, c.ep, c.micro_batch, c.recompute, c.sp, c.schedule,
            round(est.memory.total, 2))


def rehearse_row(model, cluster, ev, side: str, est, setting_name: str) -> dict:
    """Rehearse one candidate; the row of the table (GiB)."""
    from meshtron.planner.memory import workspace_bytes, workspace_fixed
    from meshtron.rehearse.run import rehearse

    plan = est.to_plan(model.name, cluster.name, cluster.num_gpus, ev.global_batch, ev.seq,
                       ev.opts.attention).validate(cluster.num_gpus, model)
    r = rehearse(model, plan, cluster, "cpu")
    total = next(x for x in r["memory"] if x["row"] == "total")
    cap = r["capacity_gib"]
    tensors = total["rehearsal_gib"]
    allowance = workspace_bytes(tensors * GIB, cap * GIB, ev.mem) / GIB
    planner_total = total["planner_gib"] + r["planner_workspace_gib"]
    planner_fits = r["planner_fits"]  # MemoryBreakdown.fits on the rehearsal's kernels
    rehearsal_fits = tensors + allowance <= cap
    flag = ("REJECTED-FITS" if rehearsal_fits and not planner_fits else
            "ACCEPTED-EXCEEDS" if planner_fits and not rehearsal_fits else "")
    # the GPU's kernels (what the search decided on): the rehearsal less the fp32 norm copies
    # the planner prices for CPU kernels only (an estimate: no GPU rehearsal here)
    gpu_alloc = ((r["planner_gpu_total_gib"] - workspace_fixed(cap * GIB) / GIB)
                 / (1.0 + ev.mem.fragmentation))
    gpu_tensors = tensors - (total["planner_gib"] - gpu_alloc)
    gpu_need = gpu_tensors + workspace_bytes(gpu_tensors * GIB, cap * GIB, ev.mem) / GIB
    gpu_flag = ("REJECTED-FITS" if gpu_need <= cap and not est.fits else
                "ACCEPTED-EXCEEDS" if gpu_need > cap and est.fits else "")
    rel = total["planner_gib"] / tensors - 1.0
    return {"setting": setting_name, "side": side, "plan": est.config.describe(),
            "stage_layers": plan.stage_layers, "rank": r["rank"], "pp_rank": r["pp_rank"],
            "capacity_gib": cap, "planner_gpu_total_gib": est.memory.total,
            "planner_allocated_gib": total["planner_gib"], "planner_total_gib": planner_total,
            "rehearsal_gib": tensors, "rehearsal_total_gib": tensors + allowance,
            "planner_fits": planner_fits, "rehearsal_fits": rehearsal_fits, "flag": flag,
            "planner_vs_rehearsal": rel, "agrees": abs(rel) <= AGREE,
            "rehearsal_gpu_est_total_gib": gpu_need, "gpu_flag": gpu_flag,
            "wall_s": r["wall_s"]}


def sweep(names: list[str], margin: float, per_side: int, out=None):
    """Every row of the settings `names`; printed as they come when `out` is given."""
    rows = []
    for name in names:
        model, cluster, ev, pick, disagree = candidates(SETTINGS[name], margin, per_side)
        if out is not None and disagree:  # e.g. "needs 78.8 GiB per GPU > 80 GiB"
            e = min(disagree, key=lambda x: x.memory.total)
            print(f"| {name} | fit decision != breakdown | {len(disagree)} candidates, e.g. "
                  f"{e.config.describe()}: fits={e.fits} at {e.memory.total:.2f} GiB | "
                  f"{e.memory.capacity:.0f} | | | | | | | |", file=out, flush=True)
        if out is not None and not pick:
            print(f"| {name} | - | no plan within {margin:.0%} of the capacity | | | | | | |",
                  file=out, flush=True)
        for side, est in pick:
            row = rehearse_row(model, cluster, ev, side, est, name)
            rows.append(row)
            if out is not None:
                print(format_row(row), file=out, flush=True)
    return rows


HEADER = ("| setting | search | plan (rank, stage layers) | capacity | planner GPU total "
          "(decided) | planner total, CPU kernels | rehearsal tensors + allowance | "
          "planner vs rehearsal tensors | flag, CPU kernels | rehearsal GPU est. | "
          "flag, GPU est. |\n|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    rel = r["planner_vs_rehearsal"]
    return (f"| {r['setting']} | {r['side']} | {r['plan']} (rank {r['rank']}, "
            f"{'/'.join(map(str, r['stage_layers'] or ()))}) | {r['capacity_gib']:.0f} | "
            f"{r['planner_gpu_total_gib']:.2f} | {r['planner_total_gib']:.2f} | "
            f"{r['rehearsal_gib']:.2f} + {r['rehearsal_total_gib'] - r['rehearsal_gib']:.2f} "
            f"= {r['rehearsal_total_gib']:.2f} | {rel:+.1%}{'' if r['agrees'] else ' (> 5%)'} | "
            f"{r['flag'] or 'ok'} ({r['wall_s']:.0f} s) | "
            f"{r['rehearsal_gpu_est_total_gib']:.2f} | {r['gpu_flag'] or 'ok'} |")


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # first: --help answers without importing torch
    import warnings

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print(HEADER, flush=True)
    rows = sweep(args.setting or list(SETTINGS), args.margin, args.per_side, sys.stdout)
    flagged = [r for r in rows if r["flag"] or r["gpu_flag"]]
    print(f"\n{len(rows)} plans rehearsed in {time.perf_counter() - t0:.0f} s; "
          f"rejected but rehearsal fits: {sum(r['flag'] == 'REJECTED-FITS' for r in rows)}; "
          f"accepted but rehearsal exceeds: "
          f"{sum(r['flag'] == 'ACCEPTED-EXCEEDS' for r in rows)} (CPU kernels), "
          f"{sum(r['gpu_flag'] == 'REJECTED-FITS' for r in rows)} and "
          f"{sum(r['gpu_flag'] == 'ACCEPTED-EXCEEDS' for r in rows)} (GPU estimate); "
          f"planner beyond {AGREE:.0%} of the rehearsal: "
          f"{sum(not r['agrees'] for r in rows)}")
    return 1 if flagged and args.strict else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
