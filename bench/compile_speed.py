"""Compiled vs eager step time, side by side in one run, next to the planner's predicted ratio.

    python bench/compile_speed.py                      # tiny and debug, 1, 2 and 4 ranks (dp)
    python bench/compile_speed.py --models debug --ranks 1 2 --steps 6

For each rank count one launch (run_on_ranks; 1 rank: the single-process LocalEngine) builds
the eager and the compiled engine of each model (the product's paths: LocalEngine /
ParallelEngine with `train.compile`), runs each once to compile (compile seconds from torch's
counters, reported apart), then alternates timed steps eager, compiled, eager, ... so that a
change of machine load hits both alike; medians per engine. Plans: dp = ranks, ZeRO-0, one
micro-batch per rank. The planner's prediction is `evaluate_plan` for the same plan with
`compile=False` (the 'eager' stack) and `compile=True` (the 'fused' stack: what --compile runs)
on this machine's calibrated cluster (`meshtron calibrate`), else the nominal CPU figures
(flagged in the output). Multi-rank runs on a 2-core machine share the cores: they prove the
path, not scaling; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _config(model: str, seq_len: int, global_batch: int, compile: bool):
    from meshtron.config import config_from_dict

    return config_from_dict({"model": model,
                             "data": {"seq_len": seq_len, "global_batch": global_batch},
                             "optim": {"warmup_steps": 0},
                             "train": {"dtype": "fp32", "steps": 1000, "compile": compile}})


def _plan(model: str, ranks: int, seq_len: int, global_batch: int, compile: bool):
    from meshtron.planner.plan import Plan

    return Plan(dp=ranks, zero=0, micro_batch=global_batch // ranks, model=model,
                global_batch=global_batch, seq_len=seq_len, compile=compile)


def _engine(model, ranks, seq_len, global_batch, compile):
    import torch

    cfg = _config(model, seq_len, global_batch, compile)
    if ranks == 1:
        from meshtron.train.loop import LocalEngine

        return LocalEngine(cfg)
    from meshtron.train.parallel import ParallelEngine

    return ParallelEngine(cfg, _plan(model, ranks, seq_len, global_batch, compile),
                          torch.device("cpu"))


def _step(engine, x, y) -> float:
    t0 = time.perf_counter()
    out = engine.train_step(x, y)
    float(out.loss)  # the host has the result: the step is done (CPU: no streams)
    return time.perf_counter() - t0


def rank_fn(models: list[str], ranks: int, seq_len: int, global_batch: int, steps: int):
    """Per rank: for each model, eager and compiled engines, compile, then alternating steps."""
    import torch
    import torch.distributed as dist

    from meshtron.parallel.compile import compile_seconds

    torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = global_batch // ranks
    out = {}
    for model in models:
        from meshtron.model import preset

        vocab = preset(model).vocab
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
        x = tokens[rank * rows:(rank + 1) * rows, :-1]
        y = tokens[rank * rows:(rank + 1) * rows, 1:]
        eager = _engine(model, ranks, seq_len, global_batch, False)
        compiled = _engine(model, ranks, seq_len, global_batch, True)
        if ranks == 1:  # LocalEngine takes the whole batch
            x, y = tokens[:, :-1], tokens[:, 1:]
        first_eager = _step(eager, x, y)
        c0 = compile_seconds()
        first_compiled = _step(compiled, x, y)  # forward and backward graphs compile here
        compile_s = compile_seconds() - c0
        te, tc = [], []
        for _ in range(steps):
            te.append(_step(eager, x, y))
            tc.append(_step(compiled, x, y))
        for e in (eager, compiled):
            if hasattr(e, "release"):
                e.release()
        out[model] = {"eager_s": te, "compiled_s": tc, "compile_s": compile_s,
                      "first_eager_s": first_eager, "first_compiled_s": first_compiled}
    return out


def predicted(model: str, ranks: int, seq_len: int, global_batch: int):
    """(eager, fused) predicted step seconds and the cluster's name."""
    from meshtron.model import preset
    from meshtron.planner.search import evaluate_plan
    from meshtron.train.planning import local_cluster, sized_cluster

    cluster = sized_cluster(local_cluster(ranks, None), ranks)
    spec = preset(model)
    times = [evaluate_plan(spec, cluster, global_batch, seq_len,
                           _plan(model, ranks, seq_len, global_batch, c)).step_time_s
             for c in (False, True)]
    return times[0], times[1], cluster.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "debug"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    from testkit.multiproc import run_on_ranks

    rows = []
    for ranks in args.ranks:
        if ranks == 1:
            result = rank_fn(args.models, 1, args.seq_len, args.global_batch, args.steps)
        else:
            import compile_speed  # this file as a module (sys.path[0]): the ranks import it

            per_rank = run_on_ranks(compile_speed.rank_fn, ranks, args.models, ranks, args.seq_len,
                                    args.global_batch, args.steps, timeout=1800)
            # the slowest rank's step is the step
            result = {m: {"eager_s": [max(t) for t in zip(*(r[m]["eager_s"] for r in per_rank))],
                          "compiled_s": [max(t) for t in zip(*(r[m]["compiled_s"]
                                                               for r in per_rank))],
                          "compile_s": max(r[m]["compile_s"] for r in per_rank)}
                      for m in args.models}
        for model in args.models:
            r = result[model]
            e, c = statistics.median(r["eager_s"]), statistics.median(r["compiled_s"])
            pe, pc, cluster = predicted(model, ranks, args.seq_len, args.global_batch)
            rows.append({"model": model, "ranks": ranks, "eager_step_s": e,
                         "compiled_step_s": c, "measured_compiled_over_eager": c / e,
                         "compile_s": r["compile_s"], "predicted_eager_s": pe,
                         "predicted_fused_s": pc, "predicted_fused_over_eager": pc / pe,
                         "cluster": cluster})
    load = os.getloadavg()
    print(f"seq_len {args.seq_len}, global batch {args.global_batch}, fp32, dp = ranks, "
          f"{args.steps} alternating timed steps per engine; load average "
          f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} cores")
    print(f"{'model':8} {'ranks':>5} {'eager s':>9} {'compiled s':>10} {'measured c/e':>12} "
          f"{'planner c/e':>11} {'compile s':>9}  planner cluster")
    for r in rows:
        print(f"{r['model']:8} {r['ranks']:5d} {r['eager_step_s']:9.4f} "
              f"{r['compiled_step_s']:10.4f} {r['measured_compiled_over_eager']:12.2f} "
              f"{r['predicted_fused_over_eager']:11.2f} {r['compile_s']:9.1f}  {r['cluster']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "load": load}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
