"""What every model case shares: the case context, the shapes the planner fits, plans built for
the shape actually run (never another shape's plan: the old kit's stage_layers mismatch), the
engine through the product's path, and timed steps.

A dry run is the same code on CPU at toy size: the `tiny` preset stands in for llama3-8b, the
nominal CPU cluster for the GPU's catalogue entry; halving and the offload shape apply to it
as they do to the 8B shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
FIXED = {"tp": 1, "pp": 1, "dp": 1, "zero": 0}
"""One rank, no sharding: the planner chooses micro-batch and recomputation."""


@dataclasses.dataclass
class Ctx:
    """One case's inputs (from the driver's command line) and its result file."""

    dry_run: bool
    seq_len: int
    global_batch: int
    steps: int
    work: Path
    out: Path
    ckpt_gib: float
    fits_layers: int | None = None
    """Layers the eager case ran after the planner's largest fit ran out of memory (the
    driver passes it on, so later cases do not run out of memory again); None: the
    planner's largest fit."""
    cli_steps: int | None = None
    """Training steps of the CLI smoke's train commands (None: each case's own few); the
    kit's test makes a run long enough to outlast its cap whatever the machine's speed."""
    result: dict[str, Any] = dataclasses.field(default_factory=dict)

    def emit(self, **fields: Any) -> None:
        """Merge `fields` into the result and rewrite the result file now: a case killed by
        its time cap still leaves what it measured so far."""
        self.result.update(fields)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=_plain))
        os.replace(tmp, self.out)

    @property
    def base_model(self) -> str:
        return "tiny" if self.dry_run else "llama3-8b"

    @property
    def warmup(self) -> int:
        return 0 if self.dry_run else 1


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every process the kit starts: unbuffered output (a case cut short
    still shows its last lines) and the checkout on PYTHONPATH (no `pip install` needed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def stop_group(proc: subprocess.Popen, grace_s: float, kill_wait_s: float) -> None:
    """SIGTERM `proc`'s process group (it was started in a session of its own), SIGKILL after
    `grace_s` seconds, then wait at most `kill_wait_s` for it."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _plain(x: Any) -> Any:
    """JSON for what json does not know (numpy / torch scalars, paths)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def device(ctx: Ctx):
    import torch

    if ctx.dry_run:
        torch.set_num_threads(1)  # a toy model: more threads only contend (shared notes)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run on CPU)")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    return dev


def init_group(dev, ctx: Ctx) -> None:
    """A 1-rank default group through the product's one init path (`init_rank`: NCCL for CUDA
    tensors and gloo for CPU ones, bound to the device, NCCL_ENV; gloo on CPU), rendezvous in
    a file of the case's work folder."""
    import torch

    from meshtron.launch import World
    from meshtron.runtime import init_rank

    url = f"file://{ctx.work / f'store-{os.getpid()}'}"
    got = init_rank(World(rank=0, local_rank=dev.index or 0, world_size=1, source="gpu-kit",
                          local_world_size=1, init_method=url))
    if got != dev:
        raise RuntimeError(f"init_rank chose {got}, the case runs on {dev}")
    if ctx.dry_run:
        torch.set_num_threads(1)  # init_rank gives a lone CPU rank every core


def close_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def cluster(ctx: Ctx):
    """The GPU's catalogue entry with its own memory (what `meshtron train` plans for on an
    uncalibrated GPU node); dry run: the nominal CPU figures."""
    if ctx.dry_run:
        from meshtron.planner.cluster import nominal_cpu_cluster

        return nominal_cpu_cluster(1)
    from meshtron.calibrate.device import device_cluster

    return device_cluster(1)


def calibrated(ctx: Ctx):
    """The cluster of this node's calibration that cli_calibrate wrote where `meshtron train
    --plan auto` finds it (the work folder's runs/calibration/local-1.toml), when it applies to
    this device (planning.choose_cluster's rule); None otherwise."""
    from meshtron.calibrate.device import this_node
    from meshtron.train.planning import choose_cluster

    path = ctx.work / "runs" / "calibration" / "local-1.toml"
    if not path.is_file():
        return None
    chosen = choose_cluster(1, None, this_node(), path)
    return chosen.cluster if chosen.source.startswith("calibrated") else None


def shape(ctx: Ctx, layers: int):
    """The base model (llama3-8b's widths, 128k vocabulary; dry run: tiny) with `layers`."""
    from meshtron.model import preset

    base = preset(ctx.base_model)
    return dataclasses.replace(base, name=f"{base.name}-shape-{layers}l", layers=layers)


def search(spec, clus, ctx: Ctx, **fixed: Any):
    """The planner's best plan for `spec` with tp = pp = dp = 1 and `fixed`, or None."""
    from meshtron.planner.search import search_plans

    knobs = {**FIXED, "dtype": "bf16", **fixed}
    return search_plans(spec, clus, ctx.global_batch, ctx.seq_len, knobs, top_k=1,
                        explain=False).best


def largest_fit(ctx: Ctx, clus) -> int:
    """The most layers of the base shape the planner fits on one device (bisection: fitting
    is monotone in the layer count), or what the eager case measured to fit."""
    from meshtron.model import preset

    if ctx.fits_layers:
        return ctx.fits_layers

    lo, hi = 0, preset(ctx.base_model).layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if search(shape(ctx, mid), clus, ctx) is not None:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise SystemExit("gpu_check: not even one layer of the base shape fits this device")
    return lo


def half(layers: int) -> int:
    """The FP8 / HF cases' layer count: FP8's casts and an fp32 HF model need headroom."""
    return max(1, layers // 2)


def plan_for(spec, clus, ctx: Ctx, **fixed: Any):
    """(Plan, Estimate) for exactly `spec` (its own stage_layers), with `fixed` knobs."""
    est = search(spec, clus, ctx, **fixed)
    if est is None:
        raise RuntimeError(f"the planner fits no plan for {spec.name} with {fixed}")
    plan = est.to_plan(spec.name, clus.name, 1, ctx.global_batch, ctx.seq_len,
                       attention="flash")
    return plan, est


def evaluate(spec, clus, ctx: Ctx, plan):
    """The planner's estimate of `plan` as given, or None where it cannot price it (FP8 on a
    CPU cluster has no peak)."""
    from meshtron.errors import UserError
    from meshtron.planner.search import evaluate_plan

    try:
        return evaluate_plan(spec, clus, ctx.global_batch, ctx.seq_len, plan)
    except UserError:
        return None


def predicted(est) -> dict[str, Any] | None:
    if est is None:
        return None
    return {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
            "allocated_bytes": est.memory.allocated * GIB, "total_bytes": est.memory.total * GIB,
            "fits": bool(est.fits)}


def config(spec, ctx: Ctx, dtype: str = "bf16", compile: bool = False,
           fp8_recipe: str | None = None, **train: Any):
    from meshtron.config import config_from_dict

    t = {"dtype": dtype, "steps": 1000, "compile": compile, **train}
    if fp8_recipe is not None:
        t["fp8_recipe"] = fp8_recipe
    return config_from_dict({"model": {"preset": ctx.base_model, "layers": spec.layers},
                             "data": {"seq_len": ctx.seq_len, "global_batch": ctx.global_batch},
                             "optim": {"warmup_steps": 0}, "train": t})


def engine(cfg, plan, dev):
    """`ParallelEngine` (the product's path: mesh, parallelize, optimizer) and its build
    seconds (meta init + materialisation + optimizer)."""
    from meshtron.train.parallel import ParallelEngine

    sync(dev)
    t0 = time.perf_counter()
    eng = ParallelEngine(cfg, plan, dev)
    sync(dev)
    return eng, time.perf_counter() - t0


def batch(spec, ctx: Ctx, dev):
    """One fixed global batch of random tokens (the same for every engine of a case)."""
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (ctx.global_batch, ctx.seq_len + 1), generator=g)
    return tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(step: Callable[[], Any], dev, n: int) -> tuple[list[float], list[float]]:
    """(seconds, losses) of `n` calls of `step` (synchronised per step: this is a bench)."""
    times, losses = [], []
    for _ in range(n):
        sync(dev)
        t0 = time.perf_counter()
        out = step()
        losses.append(float(out))
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times, losses


def peak_bytes(dev) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def figures(times: list[float], spec, ctx: Ctx, clus, dev) -> dict[str, Any]:
    """Step time (median), tokens/s, MFU (model FLOPs / the catalogue's dense bf16 peak) and
    the allocator's peak."""
    step = statistics.median(times)
    tps = ctx.global_batch * ctx.seq_len / step
    flops = spec.flops_per_token(ctx.seq_len)
    return {"step_time_s": step, "step_times_s": times, "tokens_per_s": tps,
            "mfu": flops * tps / (clus.peak_tflops * 1e12), "model_tflops": flops * tps / 1e12,
            "peak_allocated_bytes": peak_bytes(dev)}


def beside(measured: dict[str, Any], pred: dict[str, Any] | None) -> dict[str, Any]:
    """The planner's figures next to the measured ones, as measured / predicted ratios."""
    if not pred:
        return {"predicted": None}
    out = {"predicted": pred,
           "measured_over_predicted_step_time": measured["step_time_s"] / pred["step_time_s"]}
    if measured.get("peak_allocated_bytes"):
        out["measured_over_predicted_peak"] = (measured["peak_allocated_bytes"]
                                               / pred["allocated_bytes"])
    return out


def describe_model(spec) -> dict[str, Any]:
    return {"name": spec.name, "layers": spec.layers, "hidden": spec.hidden,
            "params": spec.num_params()}
