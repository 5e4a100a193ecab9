"""DeepSeek-V3's published step (calibration row "DSV3 671B 2048xH800") in the planner's pieces.

The row runs through the same files and flags as bench/planner_cli_table.py (the command line a
user would type); this prints what the planner's step is made of: the step's parts, one MoE
block's per-micro-batch costs (its dense active-width equivalent by kind, the MoE extra, the
expert all-to-alls unhidden and exposed beside their window), the layer split and the critical
stage. Then DualPipe's own accounting of the same split: each DualPipe rank r runs stage r for
the micro-batches fed from one end and stage p-1-r for those fed from the other, half of them
each (deepseek-ai/DualPipe README; DeepSeek-V3 report section 3.2.1), and its bubble is
(p/2-1)(F&B + B - 3W) per chunk. Since branch dualpipe the planner prices DualPipe itself
(planner/pipeline_dualpipe.py): that part recomputes it from the planner's stage times, a
cross-check printed beside the planner's own figures, and the memory of the fullest rank.

    python bench/dsv3_pieces.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROW = "DSV3 671B 2048xH800"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return p.parse_args(argv)


def _evaluate(d: Path):
    """(row, the evaluator, the plan's Estimate) as `meshtron plan` answers the row."""
    from bench.planner_cli_table import _args
    from bench.published.runs import published_runs
    from meshtron.cli import build_parser
    from meshtron.planner import cli as pcli
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.pinned import answer_pinned
    from meshtron.planner.search import search_plans

    run = next(r for r in published_runs() if r.name == ROW)
    args = build_parser("plan").parse_args(_args(run, d))
    model, cluster = pcli.load_model(args.model), resolve_cluster(args.cluster)
    fw, knobs = pcli.framework_of(args), pcli.collect_knobs(args)
    res = answer_pinned(search_plans(model, cluster, args.global_batch, args.seq_len, knobs,
                                     top_k=1, framework=fw), knobs, fw)
    ev = Evaluator(model, cluster, args.global_batch, args.seq_len, fw.kernel, mem=fw.memory)
    return run, ev, ev.evaluate(res.plans[0].config, keep_infeasible=True)


def _layer_lines(ev, cfg) -> tuple[list[str], float, float, float, float]:
    """One average block per micro-batch; returns (lines, t_layer, f_l, w_l, c_l)."""
    key = (cfg.tp, cfg.micro_batch, cfg.sp, cfg.recompute, cfg.cp, cfg.dtype, cfg.ep,
           cfg.fp8_recipe)
    c_l, tpc_l, f_l, w_l, *_ = ev._micro(*key)
    lc = ev._cache[("layer",) + key]
    moe_c, _, a2a, _ = ev._moe(cfg.micro_batch, cfg.recompute, cfg.cp, cfg.dtype, cfg.ep,
                               cfg.tp, (lc.fwd, lc.bwd))
    ms = 1e3
    out = [f"one block, one micro-batch ({cfg.micro_batch} x {ev.seq} tokens), ms:",
           f"  dense active-width equivalent: forward {lc.fwd * ms:.2f}, backward "
           f"{lc.bwd * ms:.2f}; by kind (fwd, bwd): "
           + ", ".join(f"{k} {f * ms:.2f}/{b * ms:.2f}" for k, f, b in lc.parts),
           f"  MoE beyond it (grouped GEMMs, permutation, casts, host), all passes: "
           f"{moe_c * ms:.2f}",
           f"  expert all-to-alls exposed (fwd+bwd, after the overlap): {a2a * ms:.2f}",
           f"  block total {(c_l + tpc_l) * ms:.2f} (forward {f_l * ms:.2f}, weight gradients "
           f"{w_l * ms:.2f})"]
    return out, c_l + tpc_l, f_l, w_l, c_l


def _dualpipe(stage_t, stage_f, stage_w, m) -> tuple[float, float, int]:
    """(compute of the busiest DualPipe rank, its bubble, that rank) for the same per-stage
    times: rank r runs stage r and p-1-r for m/2 micro-batches each; bubble (p/2-1)(F&B + B -
    3W) with the rank's two chunks (F&B: their forward and backward computed side by side,
    the communication they overlap taken out already)."""
    p = len(stage_t)
    pairs = [(r, p - 1 - r) for r in range(p // 2)]
    load = [m / 2 * (stage_t[a] + stage_t[b]) for a, b in pairs]
    r = max(range(len(pairs)), key=load.__getitem__)
    a, b = pairs[r]
    f, whole, w = ((x[a] + x[b]) / 2 for x in (stage_f, stage_t, stage_w))
    back = whole - f
    return load[r], (p / 2 - 1) * (whole + back - 3 * w), r


def main(argv: list[str]) -> int:
    parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run, ev, est = _evaluate(Path(tmp))
    cfg, t, n, m = est.config, est.time, list(est.stage_layers), est.num_microbatches
    tokens = run.global_batch * run.seq_len
    published_s = tokens / (run.published * run.gpus)
    print(f"{ROW}: published {run.published:.0f} tokens/s/GPU = {published_s:.2f} s per step "
          f"of {tokens / 1e6:.1f}M tokens")
    pred = tokens / t.total / run.gpus
    print(f"planner: {t.total:.2f} s ({pred:.0f} tokens/s/GPU, {pred / run.published - 1:+.1%})")
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in t.to_dict().items()))
    lines, t_layer, f_l, w_l, _ = _layer_lines(ev, cfg)
    print("\n".join(lines))
    head = ev.head_for(cfg, ev._micro(cfg.tp, cfg.micro_batch, cfg.sp, cfg.recompute, cfg.cp,
                                      cfg.dtype, cfg.ep, cfg.fp8_recipe)[5])
    stage_t = [k * t_layer for k in n]
    stage_f = [k * f_l for k in n]
    stage_w = [k * w_l for k in n]
    emb = ev._micro(cfg.tp, cfg.micro_batch, cfg.sp, cfg.recompute, cfg.cp, cfg.dtype, cfg.ep,
                    cfg.fp8_recipe)[4]
    stage_t[0] += emb.compute
    stage_f[0] += emb.fwd
    stage_t[-1] += head.compute
    stage_f[-1] += head.fwd
    stage_w[-1] += head.wgrad
    print(f"split {n} ({sum(n)} blocks, mean {sum(n) / len(n):.2f}), {m} micro-batches; head "
          f"{head.compute * 1e3:.1f} ms per micro-batch on the last stage (with the MTP "
          f"module: {ev.model.mtp_depth})")
    load, bubble, r = _dualpipe(stage_t, stage_f, stage_w, m)
    print(f"DualPipe (priced, planner/pipeline_dualpipe.py): busiest rank {r} (stages {r} and "
          f"{len(n) - 1 - r}), {m // 2} micro-batches through each: {load:.2f} s of work "
          f"(the planner's compute + ep_comm: {t.compute + t.ep_comm:.2f} s), README bubble "
          f"{bubble:.2f} s (the planner's: {t.bubble:.2f} s), pipeline transfers hidden "
          f"({t.pp_comm:.2f} s)")
    print(f"memory: {'fits' if est.fits else 'does not fit'}; fullest rank "
          f"{est.memory.stage}: " + ", ".join(
              f"{k} {v:.1f}" for k, v in est.memory.to_dict().items()
              if isinstance(v, float) and v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
