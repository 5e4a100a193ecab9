"""Planner-predicted vs measured step time for every layout of 8 CPU ranks on the demo model.

For every (tp, pp, dp) with tp*pp*dp = 8 that the runtime accepts for the demo model ('tiny':
4 layers, 8 heads, 4 kv heads; seq 256, global batch 16), the planner's best plan of that layout
(`resolve_run_plan`, exactly what `meshtron train --nproc 8 --plan tp=..,pp=..,dp=..` runs) is
built and trained for a few steps, and its steady-state step time (run_loop's `step_time_s`:
data fetch + step, slowest rank) is compared with the planner's prediction. Then the planner's
overall pick (`--plan auto`) is placed among the measured layouts.

Default mode (one run, side by side): ONE torchrun launch of 8 ranks builds every layout's
`ParallelEngine` and runs them in rotating round-robin rounds (R rounds x K steps each), so the
noise of a shared machine hits all layouts alike; measured = median of a layout's timed steps.
`--cli`: instead run `meshtron train --nproc 8 --plan ...` once per layout, one after another,
and read RUN_DIR/summary.json (`measured_step_time_s`: median of the steps after the first 2).

    .venv/bin/python bench/plan_vs_measured.py                       # all layouts, ~5 min
    .venv/bin/python bench/plan_vs_measured.py --rounds 2 --steps 2 --layouts "tp=2,dp=4;pp=2,dp=4"
    .venv/bin/python bench/plan_vs_measured.py --cli --steps 6

Calibrates this machine for 8 ranks first if runs/calibration/local-8.toml is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NPROC = 8
OUT_DIR = ROOT / "runs" / "bench" / "plan_vs_measured"


def _demo_doc(steps: int, run_dir: str) -> dict:
    from meshtron.config import apply_overrides
    from meshtron.train.demo import DEMO_CONFIG

    doc = json.loads(json.dumps(DEMO_CONFIG))
    return apply_overrides(doc, {"train.steps": steps, "train.eval_every": 0,
                                 "train.run_dir": run_dir})


def _layout_str(tp: int, pp: int, dp: int) -> str:
    return f"tp={tp},pp={pp},dp={dp}"


def candidate_plans(cfg, world: int, only: list[str] | None):
    """[(layout string, Plan | None, reason)] for every tp*pp*dp = world."""
    from meshtron.planner.plan import fixed_knobs
    from meshtron.train.job import ParallelRequest
    from meshtron.train.planning import resolve_run_plan

    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            text = _layout_str(tp, pp, dp)
            if only and not any(_norm(o) == (tp, pp, dp) for o in only):
                continue
            try:
                plan, _ = resolve_run_plan(cfg, ParallelRequest(plan=text,
                                                                knobs=fixed_knobs(text)), world)
                out.append((text, plan, ""))
            except ValueError as e:
                out.append((text, None, str(e)))
    return out


def _norm(text: str) -> tuple[int, int, int]:
    d = {"tp": 1, "pp": 1, "dp": 1}
    for part in text.split(","):
        k, v = part.split("=")
        d[k.strip()] = int(v)
    return d["tp"], d["pp"], d["dp"]


def knobs_text(plan) -> str:
    sched = plan.schedule_label()
    s = f"z{plan.zero} mb{plan.micro_batch} rc={plan.recompute}"
    if plan.tp > 1:
        s += f" sp={'on' if plan.sp else 'off'}"
    if plan.pp > 1:
        s += f" {sched}"
    return s


def _key(plan) -> str:
    d = plan.to_dict()
    d.pop("predicted", None)
    return json.dumps(d, sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", help="';'-separated subset, e.g. 'tp=2,dp=4;pp=2,dp=4' "
                                      "(default: every layout of 8 ranks the runtime accepts)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per layout per round (default 2); with --cli: steps "
                         "per run (default 6; the first 2 are dropped)")
    ap.add_argument("--rounds", type=int, default=4, help="round-robin rounds (default mode)")
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="untimed steps per layout before the rounds (default mode)")
    ap.add_argument("--cli", action="store_true",
                    help="one `meshtron train --nproc 8` launch per layout instead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    only = [t for t in (args.layouts or "").split(";") if t.strip()] or None
    if args.worker:
        return worker(args, only)

    from meshtron.calibrate.cli import default_cluster_path

    os.chdir(ROOT)
    cal = default_cluster_path(NPROC)
    if not cal.is_file():
        print(f"calibrating {NPROC} ranks -> {cal}", flush=True)
        code = subprocess.run([sys.executable, "-m", "meshtron", "calibrate", "--nproc",
                               str(NPROC)], cwd=ROOT).returncode
        if code != 0:
            raise SystemExit("calibration failed")
    print(f"cluster: {cal}: {cal.read_text().strip().replace(chr(10), '; ')}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run_cli(args, only) if args.cli else run_interleaved(args, only)
    if rows is None:
        return 1
    report(rows, time.perf_counter() - t0, args)
    return 0


def run_interleaved(args, only):
    out_json = OUT_DIR / "interleaved.json"
    out_json.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={NPROC}", str(Path(__file__).resolve()), "--worker",
           "--rounds", str(args.rounds), "--steps", str(args.steps or 2),
           "--warmup-steps", str(args.warmup_steps)]
    if args.layouts:
        cmd += ["--layouts", args.layouts]
    env = dict(os.environ, OMP_NUM_THREADS="1", PLAN_VS_MEASURED_OUT=str(out_json))
    code = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if code != 0 or not out_json.is_file():
        print(f"launch failed (exit code {code})")
        return None
    return json.loads(out_json.read_text())


def run_cli(args, only):
    """One `meshtron train --nproc 8 --plan LAYOUT` per layout; numbers from summary.json."""
    from meshtron.config import config_from_dict

    steps = args.steps or 6
    cfg = config_from_dict(_demo_doc(steps, "unused"))
    cands = candidate_plans(cfg, NPROC, only)
    auto = _auto_plan(cfg)
    rows = []
    for text, plan, reason in cands:
        row = {"layout": text, "knobs": knobs_text(plan) if plan else "", "skip": reason,
               "predicted_s": plan.predicted["step_time_s"] if plan else None,
               "is_auto": bool(plan) and _key(plan) == _key(auto)}
        if plan is not None:
            run_dir = OUT_DIR / "cli" / text.replace(",", "_").replace("=", "")
            cmd = [sys.executable, "-m", "meshtron", "train", "--nproc", str(NPROC), "--plan",
                   text, "--model", "tiny", "--seq-len", "256", "--global-batch", "16",
                   "--lr", "3e-3", "--warmup-steps", "10", "--steps", str(steps),
                   "--eval-every", "0", "--run-dir", str(run_dir)]
            print(f"--- {' '.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            code = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1")
                                  ).returncode
            row["launch_s"] = time.perf_counter() - t0
            summ = run_dir / "summary.json"
            if code == 0 and summ.is_file():
                s = json.loads(summ.read_text())
                row["measured_s"] = s["measured_step_time_s"]
                row["predicted_s"] = s.get("predicted_step_time_s", row["predicted_s"])
                metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
                lines = [json.loads(line) for line in metrics]
                steady = [l["step_time_s"] for l in lines[2:]]
                row["min_s"], row["max_s"] = min(steady), max(steady)
            else:
                row["skip"] = f"run failed (exit code {code})"
        rows.append(row)
    if not any(r.get("is_auto") for r in rows):
        rows.append({"layout": auto.layout() + " (auto)", "knobs": knobs_text(auto),
                     "predicted_s": auto.predicted["step_time_s"], "is_auto": True,
                     "skip": "auto pick not among the measured layouts "
                             "(use --layouts to include it)"})
    return rows


def _auto_plan(cfg):
    from meshtron.train.job import ParallelRequest
    from meshtron.train.planning import resolve_run_plan

    plan, _ = resolve_run_plan(cfg, ParallelRequest(), NPROC)
    return plan


def report(rows, seconds: float, args) -> None:
    measured = [r for r in rows if r.get("measured_s") is not None]
    by_meas = sorted(measured, key=lambda r: r["measured_s"])
    by_pred = sorted([r for r in rows if r.get("predicted_s") is not None and not r.get("skip")],
                     key=lambda r: r["predicted_s"])
    for i, r in enumerate(by_meas):
        r["rank_meas"] = i + 1
    for i, r in enumerate(by_pred):
        r["rank_pred"] = i + 1
    mode = "one 8-rank launch, round-robin" if not args.cli else "one `meshtron train` per layout"
    print(f"\n=== planner vs measured, tiny, seq 256, global batch 16, {NPROC} CPU ranks "
          f"({mode}; {seconds:.0f} s) ===")
    auto = next((r for r in rows if r.get("is_auto")), None)
    paired = auto is not None and "round_medians" in auto
    if paired:  # each layout against the planner's pick, round by round (noise cancels)
        for r in measured:
            r["vs_pick"] = statistics.median(a / b for a, b in zip(r["round_medians"],
                                                                  auto["round_medians"]))
    print("meas s: median of the timed steps (slowest rank, data fetch + step); spread: "
          "min..max step" + ("; vs pick: median over rounds of this layout's / the planner "
                             "pick's round time" if paired else ""))
    print(f"{'layout':<22} {'knobs':<36} {'pred s':>8} {'meas s':>8} {'spread':>13} "
          f"{'meas/pred':>9} {'pred#':>5} {'meas#':>5}" + (f" {'vs pick':>7}" if paired else ""))
    for r in sorted(rows, key=lambda r: r.get("rank_meas", 99)):
        if r.get("skip") and r.get("measured_s") is None:
            print(f"{r['layout']:<22} {r['knobs']:<36} "
                  f"{(r['predicted_s'] or float('nan')):>8.3f}  skipped: {r['skip']}")
            continue
        spread = f"{r['min_s']:.2f}..{r['max_s']:.2f}"
        mark = "  <- planner pick" if r.get("is_auto") else ""
        print(f"{r['layout']:<22} {r['knobs']:<36} {r['predicted_s']:>8.3f} "
              f"{r['measured_s']:>8.3f} {spread:>13} {r['measured_s'] / r['predicted_s']:>9.2f} "
              f"{r['rank_pred']:>5} {r['rank_meas']:>5}"
              + (f" {r['vs_pick']:>7.2f}" if paired else "") + mark)
    if not measured:
        return
    fastest = by_meas[0]
    if auto is None or auto.get("measured_s") is None:
        print("planner pick: not measured in this run")
        return
    slower = auto["measured_s"] / fastest["measured_s"] - 1
    print(f"planner pick (--plan auto): {auto['layout']} {auto['knobs']}: measured rank "
          f"{auto['rank_meas']} of {len(measured)}, {slower * 100:+.1f}% vs the fastest measured "
          f"({fastest['layout']} {fastest['measured_s']:.3f} s); goal: within 10% -> "
          f"{'MET' if slower <= 0.10 else 'NOT MET'}")
    if paired:
        best = min(measured, key=lambda r: r["vs_pick"])
        print(f"paired (round by round): fastest layout {best['layout']} at x{best['vs_pick']:.2f} "
              f"of the pick's time -> pick {(1 / best['vs_pick'] - 1) * 100:+.1f}% slower than it"
              if best is not auto else "paired (round by round): the pick is the fastest layout")
    ratios = [r["measured_s"] / r["predicted_s"] for r in measured]
    print(f"measured/predicted: median x{statistics.median(ratios):.2f}, "
          f"range x{min(ratios):.2f}..x{max(ratios):.2f}")
    # Rank agreement (Spearman) between predicted and measured orders.
    if len(measured) > 2:
        by_p = sorted(measured, key=lambda r: r["predicted_s"])
        pr = {r["layout"]: i for i, r in enumerate(by_p)}
        mr = {r["layout"]: i for i, r in enumerate(by_meas)}
        n = len(measured)
        d2 = sum((pr[k] - mr[k]) ** 2 for k in pr)
        rho = 1 - 6 * d2 / (n * (n * n - 1))
        print(f"Spearman rank correlation predicted vs measured: {rho:+.2f}")


# ----------------------------------------------------------------------------------------------
def worker(args, only) -> int:
    import torch.distributed as dist

    from meshtron.config import config_from_dict
    from meshtron.launch import current_world
    from meshtron.runtime import init_rank, shutdown_rank
    from meshtron.train.loop import build_run_data, run_loop
    from meshtron.train.parallel import ParallelEngine

    world = current_world()
    device = init_rank(world)
    rank0 = world.rank == 0
    k, rounds = args.steps, args.rounds
    total = args.warmup_steps + rounds * k
    cfg = config_from_dict(_demo_doc(total, "unused"))
    cands = candidate_plans(cfg, world.world_size, only)
    auto = _auto_plan(cfg)
    entries = []  # (name, plan, is_auto)
    for text, plan, _ in cands:
        if plan is not None:
            entries.append((text, plan, _key(plan) == _key(auto)))
    if not any(e[2] for e in entries):
        entries.append((auto.layout() + " (auto)", auto, True))

    engines = []
    for name, plan, _ in entries:
        run_dir = OUT_DIR / "interleaved" / name.replace(",", "_").replace("=", "").replace(" ", "")
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(run_dir)))
        t0 = time.perf_counter()
        eng = ParallelEngine(c, plan, device)
        data = build_run_data(c, dp_rank=eng.dp_rank, dp_size=plan.dp)
        engines.append((eng, data, c))
        if rank0:
            print(f"built {name:<16} {knobs_text(plan):<36} predicted "
                  f"{plan.predicted['step_time_s']:.3f} s ({time.perf_counter() - t0:.1f} s)",
                  flush=True)

    def run(i: int, steps: int) -> list[float]:
        eng, data, c = engines[i]
        c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=steps))
        dist.barrier()
        result = run_loop(eng, data, c, Path(c.train.run_dir), show_progress=False)
        # Every step's time (the slowest rank's), from the records rank 0 keeps.
        return [r["step_time_s"] for r in result.records]

    for i in range(len(engines)):
        t = run(i, args.warmup_steps)
        if rank0:
            print(f"warm-up {entries[i][0]}: {', '.join(f'{x:.2f}' for x in t)} s", flush=True)
    times: list[list[float]] = [[] for _ in engines]
    for r in range(rounds):
        order = list(range(len(engines)))
        order = order[r % len(order):] + order[:r % len(order)]  # rotate the start
        if r % 2:
            order.reverse()
        for i in order:
            times[i].extend(run(i, k))
        if rank0:
            print(f"round {r}: " + ", ".join(f"{entries[i][0]} "
                                            f"{statistics.median(times[i][-k:]):.2f}"
                                            for i in range(len(engines))), flush=True)
    if rank0:
        rows = []
        for (name, plan, is_auto), t in zip(entries, times):
            rows.append({"layout": name, "knobs": knobs_text(plan), "skip": "",
                         "predicted_s": plan.predicted["step_time_s"],
                         "measured_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                         "times": t, "is_auto": is_auto,
                         "round_medians": [statistics.median(t[j * k:(j + 1) * k])
                                           for j in range(rounds)]})
        for text, plan, reason in cands:
            if plan is None:
                rows.append({"layout": text, "knobs": "", "skip": reason, "predicted_s": None})
        Path(os.environ["PLAN_VS_MEASURED_OUT"]).write_text(json.dumps(rows, indent=2))
    shutdown_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
