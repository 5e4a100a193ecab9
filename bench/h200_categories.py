"""The planner's step, kind by kind, beside a torch.profiler window of the same plan on one H200
(calibration data: these are measurements of meshtron's own runtime, issue 30/31).

Reads bench/results/gpu_check_h200_2026-12-04.json (torch 2.11, one H200, llama3-8b widths, seq
4096, global batch 8): for each throughput case (eager, compile, fp8 case's bf16 and fp8
engines) its plan, step times and profiler window (GPU microseconds by category:
bench/gpukit/profile.py). The planner's side is planner/step_categories.py for exactly that
plan: the parts Evaluator.evaluate adds up, grouped into the profile's categories.

How the profile maps to a step: the window is one `train_step` call, i.e. one optimizer step
(all its micro-batches, the optimizer and the gradient accumulation), so busy categories
compare per step as they are. Idle differs: the window runs under the profiler, whose host-side
recording slows the host (the window is longer than the unprofiled step in eager); the kernels'
own durations are not slowed. So idle is shown both ways: the window's (window - busy) and the
unprofiled step's (median step time - busy kernel time of the window).

Category map (planner -> profile): gemm -> gemm; attention -> attention; elementwise +
grad_accumulation + fp8_cast -> elementwise; optimizer -> optimizer; host_wait + bubble ->
idle; communication -> communication; nothing the planner prices -> copies (memcpy/memset).
The profile files a kernel by its name: inductor's fused FP8 cast kernels whose names
mention `_scaled_mm` land in its gemm (listed below the fp8 table where they are among the
top kernels). Side-by-side ratios only; no timing here.

    python bench/h200_categories.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.model import preset  # noqa: E402
from meshtron.planner.cluster import resolve_cluster  # noqa: E402
from meshtron.planner.estimate import Evaluator  # noqa: E402
from meshtron.planner.search import search_plans  # noqa: E402
from meshtron.planner.step_categories import step_categories  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu_check_h200_2026-12-04.json"
GROUPS = {"gemm": ("gemm",), "attention": ("attention",),
          "elementwise": ("elementwise", "grad_accumulation", "fp8_cast"),
          "optimizer": ("optimizer",), "copies": (), "communication": ("communication",),
          "idle": ("host_wait", "bubble")}
"""Profile category -> the planner kinds it holds (module docstring)."""


def knobs(plan: str, dtype: str, compiled: bool) -> dict:
    """'tp=1,pp=1,dp=1 zero=0 mb=1 recompute=full sp=off schedule=-' as planner knobs."""
    parts = dict(p.split("=") for p in plan.replace(",", " ").split())
    return {"tp": int(parts["tp"]), "pp": int(parts["pp"]), "dp": int(parts["dp"]),
            "zero": int(parts["zero"]), "micro_batch": int(parts["mb"]),
            "recompute": parts["recompute"], "dtype": dtype, "compile": compiled}


def planner_side(run: dict) -> tuple[dict[str, float], float, float]:
    """(seconds per step by planner kind, step time, GEMM FLOPs per step) of `run`'s plan."""
    cluster = dataclasses.replace(resolve_cluster("dgx-h200:1"), gpus_per_node=1)
    spec = dataclasses.replace(preset("llama3-8b"), layers=run["model"]["layers"])
    res = search_plans(spec, cluster, 8, 4096, knobs(run["plan"], run["dtype"],
                                                     run["compiled"]), top_k=1, explain=False)
    ev = Evaluator(spec, cluster, 8, 4096, res.options)
    est = ev.evaluate(res.best.config)
    cats = step_categories(ev, est)
    return cats, est.step_time_s, gemm_flops(spec, est)


def gemm_flops(spec, est) -> float:
    """Hardware FLOPs of the step's GEMMs: the block linears (forward, two backward, the
    forward again under full recomputation) and the head (forward, its chunked replay, input
    and weight gradients: meshtron's chunked loss)."""
    tokens = 8 * 4096
    block = sum(spec.attention_params() + spec.ffn_params(i, active=True)
                for i in range(spec.layers))
    passes = 3 + {"full": 1.0, "half": 0.5}.get(est.config.recompute, 0.0)
    return 2.0 * tokens * (block * passes + spec.vocab * spec.hidden * 4)


def accumulating_adds(run: dict) -> float:
    """The planner's seconds for the m - 1 fp32 += bf16 adds of `run`'s step (its
    accumulation less the first micro-batch's cast)."""
    cluster = dataclasses.replace(resolve_cluster("dgx-h200:1"), gpus_per_node=1)
    spec = dataclasses.replace(preset("llama3-8b"), layers=run["model"]["layers"])
    res = search_plans(spec, cluster, 8, 4096, knobs(run["plan"], run["dtype"],
                                                     run["compiled"]), top_k=1, explain=False)
    ev = Evaluator(spec, cluster, 8, 4096, res.options)
    cfg = res.best.config
    m = 8 // cfg.micro_batch
    flags = ev.dp_flags(cfg)
    return (ev.accumulation_s(cfg, spec.layers, 0, m, flags)
            - ev.accumulation_s(cfg, spec.layers, 0, 1, flags))


def table(name: str, run: dict) -> dict[str, float]:
    cats, step, flops = planner_side(run)
    prof = run["profile"]
    us = prof["us"]
    print(f"\n{name}: {run['model']['layers']} layers, {run['plan']}"
          f"{' compiled' if run['compiled'] else ''}, dtype {run['dtype']}")
    print(f"  {'category':14} {'planner s':>10} {'profile s':>10} {'prof/plan':>9}")
    out = {}
    for cat, kinds in GROUPS.items():
        p = sum(cats[k] for k in kinds)
        m = us[cat] / 1e6
        out[cat] = m / p if p else float("nan")
        ratio = f"{m / p:9.3f}" if p else f"{'-':>9}"
        parts = ", ".join(f"{k} {cats[k]:.4f}" for k in kinds if cats[k]) if len(kinds) > 1 \
            else ""
        print(f"  {cat:14} {p:10.4f} {m:10.4f} {ratio}   {parts}")
    busy = prof["busy_us"] / 1e6
    idle_step = run["step_time_s"] - busy
    p_idle = sum(cats[k] for k in GROUPS["idle"])
    print(f"  {'idle unprof.':14} {p_idle:10.4f} {idle_step:10.4f}"
          f" {'(step - busy)':>9}")
    print(f"  {'step':14} {step:10.4f} {run['step_time_s']:10.4f} "
          f"{run['step_time_s'] / step:9.3f}   (profile window {prof['window_us'] / 1e6:.4f} s,"
          f" busy {busy:.4f} s)")
    print(f"  GEMM rate: planner {flops / cats['gemm'] / 1e12:.0f} TFLOP/s, profile "
          f"{flops / (us['gemm'] / 1e6) / 1e12:.0f} TFLOP/s ({flops / 1e15:.3f} PFLOP per step)")
    acc = [t for t in prof.get("top", ()) if "CUDAFunctor_add<float>" in t["name"]
           and t["name"].startswith("void at::native::unrolled_elementwise_kernel")]
    if acc:  # one kernel the planner prices alone: the fp32 += bf16 accumulating adds
        print(f"  accumulating adds (unrolled fp32 += bf16 kernel): planner "
              f"{accumulating_adds(run):.4f} s, profile {acc[0]['us'] / 1e6:.4f} s")
    fused = [t for t in prof.get("top", ()) if t["category"] == "gemm"
             and t["name"].startswith("triton_")]
    if fused:
        s = sum(t["us"] for t in fused) / 1e6
        print(f"  of the profile's gemm, inductor-fused cast kernels among the top 12: {s:.4f} s"
              f" ({', '.join(t['name'][:40] for t in fused)})")
    return out


def main() -> int:
    from bench.help_only import help_only

    help_only(__doc__)
    cases = json.loads(RESULTS.read_text())["cases"]
    print("planner kinds -> profile categories:",
          "; ".join(f"{c} = {' + '.join(k) or 'not priced'}" for c, k in GROUPS.items()))
    table("eager", cases["eager"]["result"]["run"])
    table("compile", cases["compile"]["result"]["run"])
    fp8 = cases["fp8"]["result"]
    table("fp8 case bf16", fp8["bf16"])
    table("fp8 case fp8", fp8["fp8"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
