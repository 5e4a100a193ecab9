"""GPU check kit: what one GPU says about meshtron's runtime, in one JSON file, in < 8 minutes.

    python bench/gpu_check.py --out gpu_check.json     # one CUDA GPU
    python bench/gpu_check.py --dry-run --out x.json   # the same code path on CPU, toy size

On one rank (a 1-rank process group: NCCL + gloo on CUDA, gloo on CPU), through the product's
own path (`meshtron.train.parallel.ParallelEngine`: build_mesh + parallelize + build_optimizer,
bf16 FSDP2 mixed precision, eager):

1. model: a Llama-3-shaped model (llama3-8b's widths, 128k vocabulary) with as many layers as
   the planner says fit the GPU at the chosen batch (planner search with tp = pp = dp = 1:
   micro-batch and recomputation are its choice), so the GPU is full;
2. throughput: median step time over the timed steps (CUDA-synchronised per step: a bench),
   tokens/s, MFU = model FLOPs per token (`ModelSpec.flops_per_token`) x tokens/s / the
   catalogue's dense bf16 peak, and the planner's predicted step time and tokens/s for the same
   plan beside them (ratio measured / predicted);
3. memory: `torch.cuda.max_memory_allocated` against the planner's `allocated`, and per
   component the planner's breakdown (params, grads, optimizer exact per rank from
   meshtron/planner/memory_ranks.py; gathered copies, activations, logits, workspace) with the
   runtime's measured params/grads/optimizer bytes (memory_bytes) and the rest of the peak;
4. checkpoint: `torch.distributed.checkpoint.save` (synchronous) vs `async_save` (time the
   training thread is blocked, and time to completion) of the model's state (capped at
   --ckpt-gib), on a gloo side group as async_save needs (shared notes);
5. recorder: step time with meshtron's collective recorder installed vs not, alternating
   steps (one rank: the hot-path cost of the installed kernels, not the per-collective cost);
6. compile: the same plan with `--compile` (`compile_report`): compile seconds apart, compiled
   vs eager step time and tokens/s, beside the planner's 'fused' / 'eager' ratio.

`--dry-run` runs all of it on CPU with the tiny preset in seconds (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init(device, tmp: str):
    """A 1-rank default group; returns it (NCCL for CUDA tensors, gloo for CPU ones)."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    if device.type == "cuda":
        dist.init_process_group("cuda:nccl,cpu:gloo", store=store, rank=0, world_size=1,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def choose_model(cluster, dry_run: bool, seq_len: int, global_batch: int):
    """(ModelSpec, planner Estimate): the largest layer count of the Llama-3 shape that the
    planner fits on one device of `cluster` (dry run: the tiny preset)."""
    import dataclasses

    from meshtron.model import preset
    from meshtron.planner.search import search_plans

    fixed = {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "dtype": "bf16"}
    if dry_run:
        spec = preset("tiny")
        est = search_plans(spec, cluster, global_batch, seq_len, fixed, top_k=1,
                           explain=False)
        return spec, est.best or est.near_miss
    base = preset("llama3-8b")
    for layers in range(base.layers, 0, -2):
        spec = dataclasses.replace(base, name=f"llama3-shape-{layers}l", layers=layers)
        best = search_plans(spec, cluster, global_batch, seq_len, fixed, top_k=1,
                            explain=False).best
        if best is not None:
            return spec, best
    raise SystemExit("gpu_check: no Llama-3-shaped model fits this GPU")


def _engine(spec, est, cluster, seq_len, global_batch, device):
    from meshtron.config import config_from_dict
    from meshtron.train.parallel import ParallelEngine

    plan = est.to_plan(spec.name, cluster.name, 1, global_batch, seq_len, attention="flash")
    model = {"preset": "llama3-8b", "layers": spec.layers} if spec.name.startswith(
        "llama3-shape") else spec.name
    cfg = config_from_dict({"model": model,
                            "data": {"seq_len": seq_len, "global_batch": global_batch},
                            "optim": {"warmup_steps": 0},
                            "train": {"dtype": "bf16", "steps": 1000}})
    return ParallelEngine(cfg, plan, device), plan, cfg


def _steps(engine, batch, device, n: int) -> list[float]:
    times = []
    x, y = batch
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        out = engine.train_step(x, y)
        float(out.loss)  # the step's result on the host: the step is done
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def throughput(engine, spec, est, cluster, batch, device, warmup: int, steps: int):
    _steps(engine, batch, device, warmup)
    times = _steps(engine, batch, device, steps)
    step = statistics.median(times)
    tokens = batch[0].numel()
    tps = tokens / step
    flops = spec.flops_per_token(batch[0].shape[1])
    return {"step_time_s": step, "step_times_s": times, "tokens_per_step": tokens,
            "tokens_per_s": tps, "mfu": flops * tps / (cluster.peak_tflops * 1e12),
            "model_tflops": flops * tps / 1e12,
            "predicted_step_time_s": est.step_time_s,
            "predicted_tokens_per_s": est.tokens_per_s, "predicted_mfu": est.mfu,
            "measured_over_predicted_step_time": step / est.step_time_s}


def memory_report(engine, spec, plan, cluster, device):
    from meshtron.planner.memory_ranks import predict_ranks

    state, bd = predict_ranks(spec, plan, "bf16", cluster.memory_gib)[0]
    measured = engine.memory_bytes()
    planned = {k: getattr(bd, k) * GIB for k in ("params", "grads", "optimizer", "gathered",
                                                   "activations", "in_flight", "recompute",
                                                   "logits", "workspace")}
    out = {"planned_bytes": planned, "planned_allocated_bytes": bd.allocated * GIB,
           "planned_total_bytes": bd.total * GIB,
           "measured_bytes": {k: measured[k] for k in ("params", "grads", "optimizer")}}
    peak = measured.get("cuda_peak_allocated")
    out["measured_peak_allocated_bytes"] = peak
    # what the allocator holds beyond the states: gathered copies, activations, logits, ...
    out["planned_rest_of_allocated_bytes"] = bd.allocated * GIB - sum(
        planned[k] for k in ("params", "grads", "optimizer"))
    if peak is not None:
        out["measured_rest_of_peak_bytes"] = peak - measured["total"]
        out["measured_over_planned_allocated"] = peak / (bd.allocated * GIB)
    return out


def checkpoint_report(engine, tmp: str, cap_gib: float):
    """Synchronous DCP save vs async_save of the model state (first tensors up to cap_gib)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state, size = {}, 0
    for k, v in engine.pm.state_dict().items():
        n = v.numel() * v.element_size()
        if state and size + n > cap_gib * GIB:
            break
        state[k], size = v, size + n
    side = dist.new_group(backend="gloo")  # async_save on the training group crashes (notes)
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(tmp, "sync"))
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=os.path.join(tmp, "async"), process_group=side)
    blocked_s = time.perf_counter() - t0
    fut.result()
    done_s = time.perf_counter() - t0
    dist.destroy_process_group(side)
    return {"bytes": size, "sync_save_s": sync_s, "async_blocking_s": blocked_s,
            "async_total_s": done_s, "async_blocking_over_sync": blocked_s / sync_s}


def recorder_report(engine, batch, device, pairs: int):
    import torch.distributed as dist

    from meshtron.doctor.recorder import CollectiveRecorder

    off, on = [], []
    for _ in range(pairs):
        off += _steps(engine, batch, device, 1)
        rec = CollectiveRecorder(dist.get_rank())
        rec.install()
        try:
            on += _steps(engine, batch, device, 1)
        finally:
            rec.uninstall()
    return {"step_time_off_s": statistics.median(off), "step_time_on_s": statistics.median(on),
            "on_over_off": statistics.median(on) / statistics.median(off)}


def _case_engine(spec, plan, seq_len, global_batch, device, dtype="bf16", fp8_recipe=None):
    """An engine for one case of the fp8 / offload checks: `spec` and `plan` as given, the run's
    precision `dtype` (fp8: `fp8_recipe`)."""
    from meshtron.config import config_from_dict
    from meshtron.train.parallel import ParallelEngine

    model = {"preset": "llama3-8b", "layers": spec.layers} if spec.name.startswith(
        "llama3-shape") else spec.name
    train = {"dtype": dtype, "steps": 1000}
    if fp8_recipe is not None:
        train["fp8_recipe"] = fp8_recipe
    cfg = config_from_dict({"model": model,
                            "data": {"seq_len": seq_len, "global_batch": global_batch},
                            "optim": {"warmup_steps": 0}, "train": train})
    return ParallelEngine(cfg, plan, device)


def _case_spec(spec, dry_run: bool):
    """The model of the fp8 / offload cases: half the layers of the one that fills the GPU in
    bf16 (FP8's casts and an offloaded run's staging buffers need headroom), the whole toy
    model on a dry run."""
    import dataclasses

    if dry_run or spec.layers <= 2:
        return spec
    layers = max(2, spec.layers // 2)
    return dataclasses.replace(spec, name=f"llama3-shape-{layers}l", layers=layers)


def _timed_case(engine, batch, device, warmup: int, steps: int) -> dict:
    """Median step time, the losses of the timed steps and the CUDA allocator's peak."""
    import torch

    _steps(engine, batch, device, warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    x, y = batch
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = engine.train_step(x, y)
        losses.append(float(out.loss))
        _sync(device)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"step_time_s": step, "tokens_per_s": x.numel() / step, "losses": losses,
            "peak_allocated_bytes": (torch.cuda.max_memory_allocated(device)
                                     if device.type == "cuda" else None)}


def _predicted(spec, cluster, plan, global_batch, seq_len):
    """The planner's estimate of `plan` exactly as given, or None where it cannot price it
    (a CPU cluster has no FP8 peak)."""
    from meshtron.errors import UserError
    from meshtron.planner.estimate import Evaluator

    try:
        return Evaluator(spec, cluster, global_batch, seq_len).evaluate(plan,
                                                                       keep_infeasible=True)
    except UserError:
        return None


def fp8_report(spec, plan, cluster, batch, device, seq_len, global_batch, dry_run: bool,
               warmup: int, steps: int) -> dict:
    """bf16 vs FP8 (rowwise) on the same model, plan, seed and batch: step time, tokens/s,
    the loss delta over the timed steps, and the planner's predicted speed-up. On CPU FP8 is
    torchao's emulation (numerics only: its step time says nothing about a GPU)."""
    import dataclasses

    spec = _case_spec(spec, dry_run)
    out = {"model": spec.name, "layers": spec.layers, "emulated": device.type != "cuda"}
    for dtype in ("bf16", "fp8"):
        p = dataclasses.replace(plan, dtype=dtype, fp8_recipe="rowwise")
        eng = _case_engine(spec, p, seq_len, global_batch, device, dtype,
                           "rowwise" if dtype == "fp8" else None)
        if dtype == "fp8":  # what the shared rule converted (planner/fp8.py fp8_linear)
            out["fp8_linears"] = sum(1 for part in eng.pm.model_parts for m in part.modules()
                                     if type(m).__name__ == "Float8Linear")
        out[dtype] = _timed_case(eng, batch, device, warmup, steps)
        est = _predicted(spec, cluster, p, global_batch, seq_len)
        out[dtype]["predicted_step_time_s"] = est.step_time_s if est is not None else None
        eng.release()
    b, f = out["bf16"], out["fp8"]
    out["fp8_over_bf16_tokens_per_s"] = f["tokens_per_s"] / b["tokens_per_s"]
    out["loss_delta_mean"] = statistics.mean(x - y for x, y in zip(f["losses"], b["losses"]))
    out["loss_delta_max_abs"] = max(abs(x - y) for x, y in zip(f["losses"], b["losses"]))
    if b["predicted_step_time_s"] and f["predicted_step_time_s"]:
        out["predicted_fp8_over_bf16_tokens_per_s"] = (b["predicted_step_time_s"]
                                                       / f["predicted_step_time_s"])
    return out


def offload_report(spec, plan, cluster, batch, device, seq_len, global_batch, dry_run: bool,
                   warmup: int, steps: int) -> dict:
    """FSDP2 CPU offload (offload='full', ZeRO-3) vs the same plan on the device: step time,
    the allocator's peak against the planner's `allocated` for each, the planner's host-link
    and host-optimizer time, and whether the losses agree (offload moves tensors only)."""
    import dataclasses

    spec = _case_spec(spec, dry_run)
    out = {"model": spec.name, "layers": spec.layers}
    for name, off in (("device", "none"), ("offloaded", "full")):
        p = dataclasses.replace(plan, zero=3, offload=off)
        eng = _case_engine(spec, p, seq_len, global_batch, device)
        out[name] = _timed_case(eng, batch, device, warmup, steps)
        eng.release()
        est = _predicted(spec, cluster, p, global_batch, seq_len)
        out[name]["predicted_step_time_s"] = est.step_time_s
        out[name]["predicted_allocated_bytes"] = est.memory.allocated * GIB
        out[name]["predicted_host_bytes_per_node"] = est.memory.host * GIB
        out[name]["predicted_offload_s"] = est.time.offload
        peak = out[name]["peak_allocated_bytes"]
        out[name]["measured_over_predicted_peak"] = (
            peak / (est.memory.allocated * GIB) if peak is not None else None)
    d, o = out["device"], out["offloaded"]
    out["offloaded_over_device_step_time"] = o["step_time_s"] / d["step_time_s"]
    out["predicted_offloaded_over_device_step_time"] = (o["predicted_step_time_s"]
                                                        / d["predicted_step_time_s"])
    out["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(o["losses"], d["losses"]))
    return out
def compile_report(spec, plan, cfg, cluster, device, batch, eager: dict, dry_run: bool,
                   steps: int):
    """`--compile` (per-block torch.compile, meshtron/parallel/compile.py) on the same plan:
    compile seconds (torch's counters) apart from the timed steps, compiled vs eager step
    time and tokens/s, and the planner's predicted ratio ('fused' vs 'eager' stack). Dry run:
    the aot_eager backend (the same tracing without inductor's CPU code generation)."""
    import contextlib
    import dataclasses

    from meshtron.parallel.compile import compile_backend, compile_seconds
    from meshtron.planner.search import evaluate_plan
    from meshtron.train.parallel import ParallelEngine

    plan = dataclasses.replace(plan, compile=True)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True))
    c0 = compile_seconds()
    with compile_backend("aot_eager") if dry_run else contextlib.nullcontext():
        engine = ParallelEngine(cfg, plan, device)
        first = _steps(engine, batch, device, 2)  # forward and backward graphs compile here
    compile_s = compile_seconds() - c0
    times = _steps(engine, batch, device, steps)
    engine.release()
    step = statistics.median(times)
    predicted = evaluate_plan(spec, cluster, plan.global_batch, plan.seq_len, plan).step_time_s
    return {"compile_time_s": compile_s, "first_steps_s": first, "step_time_s": step,
            "step_times_s": times, "tokens_per_s": batch[0].numel() / step,
            "eager_step_time_s": eager["step_time_s"],
            "compiled_over_eager_step_time": step / eager["step_time_s"],
            "predicted_step_time_s": predicted,
            "predicted_compiled_over_eager": predicted / eager["predicted_step_time_s"],
            "backend": "aot_eager" if dry_run else "inductor"}


def run(out_path: str, dry_run: bool, seq_len: int | None, global_batch: int | None,
        steps: int | None, ckpt_gib: float) -> dict:
    import torch

    from meshtron.calibrate.device import device_cluster
    from meshtron.train.planning import local_cluster

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run on CPU)")
    device = torch.device("cuda", 0) if not dry_run else torch.device("cpu")
    if dry_run:
        torch.set_num_threads(1)  # a toy model: more threads only contend (shared notes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seq_len = seq_len or (32 if dry_run else 4096)
    global_batch = global_batch or (2 if dry_run else 8)
    steps = steps or (1 if dry_run else 8)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshtron-gpu-check-") as tmp:
        _init(device, tmp)
        cluster = local_cluster(1, None) if dry_run else device_cluster(1)
        spec, est = choose_model(cluster, dry_run, seq_len, global_batch)
        engine, plan, cfg = _engine(spec, est, cluster, seq_len, global_batch, device)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.vocab, (global_batch, seq_len + 1), generator=g)
        batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
        report = {
            "format": "meshtron-gpu-check/1", "dry_run": dry_run, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cluster": cluster.name, "peak_tflops": cluster.peak_tflops,
            "memory_gib": cluster.memory_gib,
            "model": {"name": spec.name, "layers": spec.layers, "hidden": spec.hidden,
                      "params": spec.num_params()},
            "plan": plan.describe(), "seq_len": seq_len, "global_batch": global_batch}
        report["throughput"] = throughput(engine, spec, est, cluster, batch, device,
                                          warmup=0 if dry_run else 2, steps=steps)
        report["memory"] = memory_report(engine, spec, plan, cluster, device)
        report["recorder"] = recorder_report(engine, batch, device, 1 if dry_run else 4)
        report["checkpoint"] = checkpoint_report(engine, tmp, ckpt_gib)
        engine.release()
        case = (spec, plan, cluster, batch, device, seq_len, global_batch, dry_run,
                0 if dry_run else 2, 2 if dry_run else steps)
        report["fp8"] = fp8_report(*case)
        report["offload"] = offload_report(*case)
        report["compile"] = compile_report(spec, plan, cfg, cluster, device, batch,
                                           report["throughput"], dry_run, steps)
        torch.distributed.destroy_process_group()
    report["wall_s"] = time.perf_counter() - t_start
    Path(out_path).write_text(json.dumps(report, indent=2, default=float) + "\n")
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: the same code path")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--steps", type=int, help="timed steps")
    ap.add_argument("--ckpt-gib", type=float, default=2.0,
                    help="model state saved by the checkpoint check, GiB at most")
    args = ap.parse_args()
    r = run(args.out, args.dry_run, args.seq_len, args.global_batch, args.steps, args.ckpt_gib)
    t = r["throughput"]
    print(f"{r['device']}: {r['model']['name']} ({r['model']['params'] / 1e9:.2f}B) "
          f"{r['plan']}: {t['tokens_per_s']:.0f} tokens/s, MFU {t['mfu']:.1%} "
          f"(predicted {t['predicted_mfu']:.1%}), step {t['step_time_s']:.3f} s "
          f"vs predicted {t['predicted_step_time_s']:.3f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
