"""The model cases: each `case_*(ctx)` runs in its own process (bench/gpu_check.py), on one
rank through `ParallelEngine` (the product's path), and reports through `ctx.emit` as it goes.

env         torch / CUDA / GPU, and the bf16 matmul ceiling (8192^3; dry run 256^3)
eager       the largest llama3-8b-shaped model the planner fits, the planner's plan: step
            time, tokens/s, MFU, peak memory (planner's prediction beside each), states
            measured vs planned, a profiler window by category (with the idle's host-late
            share and the caching allocator's retries and frees); the driver runs it twice,
            the second time (eager_expandable) with expandable segments in its environment
compile     the same shape and plan with per-block torch.compile (dry run: aot_eager)
fp8         half the layers, a plan built for that shape: bf16 compiled vs FP8 (rowwise)
            compiled, same seed and batch
offload     an eighth of the layers, ZeRO-3: FSDP2 CPU offload vs the same plan on the device
checkpoint  the product's Checkpointer: synchronous save vs async save (pinned stager on CUDA)
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import statistics
import time

from gpukit import allocator
from gpukit import common as C
from gpukit.profile import window


def case_env(ctx: C.Ctx) -> None:
    import torch

    dev = C.device(ctx)
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": "cpu"}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}",
                    memory_bytes=p.total_memory, sms=p.multi_processor_count,
                    driver_visible_gpus=torch.cuda.device_count())
    from importlib import metadata

    for pkg in ("torchao", "transformers", "triton", "tomli_w"):
        try:  # installed, not imported (seconds each); the cases that need one import it
            info[f"{pkg}_version"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[f"{pkg}_version"] = None
    clus = C.cluster(ctx)
    info.update(cluster=clus.name, peak_tflops=clus.peak_tflops, memory_gib=clus.memory_gib)
    ctx.emit(**info)
    n = 256 if ctx.dry_run else 8192
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    for _ in range(3):
        a @ b
    reps = 3 if ctx.dry_run else 50
    C.sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    C.sync(dev)
    tflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    ctx.emit(matmul={"n": n, "dtype": "bf16", "tflops": tflops,
                     "over_peak": tflops / clus.peak_tflops})


def _compile_ctx(ctx: C.Ctx, compiled: bool):
    from meshtron.parallel.compile import compile_backend

    # inductor's CPU code generation costs tens of seconds on a shared 2-core box
    return compile_backend("aot_eager") if ctx.dry_run and compiled else contextlib.nullcontext()


def run_engine(ctx: C.Ctx, key: str, spec, plan, clus, dev, est, profile: bool = True,
               shapes: bool = True, **cfg_kw) -> dict:
    """Build the engine for exactly (spec, plan), time it, emit under `key`, release it.
    `profile`: a profiler window after the timed steps; `shapes`: with its GEMM-shapes step
    (profile.window)."""
    import torch

    compiled = bool(plan.compile or cfg_kw.get("compile"))
    cfg = C.config(spec, ctx, dtype=plan.dtype, compile=compiled, **cfg_kw)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    out = {"model": C.describe_model(spec), "plan": plan.describe(), "dtype": plan.dtype,
           "compiled": compiled}
    with _compile_ctx(ctx, compiled):
        eng, out["init_s"] = C.engine(cfg, plan, dev)
        try:
            _measure(ctx, key, out, eng, spec, plan, clus, dev, est, compiled, profile, shapes)
        finally:
            eng.release()
            del eng
            if compiled:  # the next engine of this case compiles its own blocks afresh
                torch._dynamo.reset()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def _measure(ctx, key, out, eng, spec, plan, clus, dev, est, compiled, profile,
             shapes) -> None:
    from meshtron.parallel.compile import compile_seconds

    ctx.emit(**{key: out})
    x, y = C.batch(spec, ctx, dev)

    def step():
        return eng.train_step(x, y).loss

    c0 = compile_seconds()
    out["first_steps_s"], _ = C.timed(step, dev, 2 if compiled else 1 + ctx.warmup)
    out["compile_time_s"] = compile_seconds() - c0
    ctx.emit(**{key: out})
    got: list = []  # the allocator over every timed step: a retry may miss the window
    out["allocator_timed_steps"] = allocator.measured(
        allocator.cuda_reader(dev), lambda: got.append(C.timed(step, dev, ctx.steps)),
        "dry run: CPU tensors have no caching allocator", reset_peak=False)
    (times, losses), = got
    fig = C.figures(times, spec, ctx, clus, dev)
    out.update(fig, losses=losses, **C.beside(fig, C.predicted(est)))
    cal = C.calibrated(ctx)
    if cal is not None:  # what `--plan auto` predicts on this node, once calibrated
        out["calibrated"] = C.beside(fig, C.predicted(C.evaluate(spec, cal, ctx, plan)))
    out["memory"] = _states(eng, spec, plan, clus)
    ctx.emit(**{key: out})
    if profile:
        out["profile"] = window(step, dev, 1, plan.num_microbatches or 1, shapes)
        ctx.emit(**{key: out})


def _states(eng, spec, plan, clus) -> dict:
    """Parameter, gradient and optimizer-state bytes the runtime holds against the planner's
    exact per-rank figures (meshtron/planner/memory_ranks.py)."""
    from meshtron.planner.memory_ranks import predict_ranks

    measured = eng.memory_bytes()
    # the exact end-of-step states (memory.json's moment); the breakdown is the peak's, where
    # gradients accumulated over micro-batches sit unsharded in `gathered` (grads 0 there)
    state, _ = predict_ranks(spec, plan, plan.dtype, clus.memory_gib)[0]
    keys = ("params", "grads", "optimizer")
    return {"measured_bytes": {k: measured[k] for k in keys},
            "planned_bytes": {k: getattr(state, k) for k in keys}}


def _setup(ctx: C.Ctx):
    dev = C.device(ctx)
    C.init_group(dev, ctx)
    clus = C.cluster(ctx)
    return dev, clus, C.largest_fit(ctx, clus)


def _throughput(ctx: C.Ctx, compiled: bool) -> None:
    """The largest shape the planner fits, its plan (compiled or not). When the planner was
    wrong and it does not fit, that is recorded (`oom`) and two layers fewer are measured."""
    import torch

    dev, clus, layers = _setup(ctx)
    ctx.emit(allocator_conf=allocator.conf(),  # eager_expandable: its own environment
             largest_fit_layers=layers, cluster=clus.name, peak_tflops=clus.peak_tflops,
             backend=("aot_eager" if ctx.dry_run else "inductor") if compiled else "eager")
    for n in (layers, layers - 2):
        spec = C.shape(ctx, n)
        eager_plan, eager_est = C.plan_for(spec, clus, ctx)
        plan = dataclasses.replace(eager_plan, compile=compiled)  # the eager case's plan
        est = C.evaluate(spec, clus, ctx, plan) if compiled else eager_est
        if compiled:
            ctx.emit(predicted_eager_step_time_s=eager_est.step_time_s,
                     predicted_compiled_over_eager_tokens_per_s=(
                         eager_est.step_time_s / est.step_time_s if est else None))
        try:
            run_engine(ctx, "run", spec, plan, clus, dev, est)
            break
        except torch.OutOfMemoryError as exc:
            oom = {"layers": n, "error": str(exc)[:400]}
        ctx.emit(oom=oom)  # outside the handler: its frames (and tensors) are gone
        if n - 2 < 1:
            raise RuntimeError(f"out of memory at {n} layers")
    C.close_group()


def case_eager(ctx: C.Ctx) -> None:
    _throughput(ctx, compiled=False)


def case_compile(ctx: C.Ctx) -> None:
    _throughput(ctx, compiled=True)


def case_fp8(ctx: C.Ctx) -> None:
    try:
        import torchao  # noqa: F401 - the float8 training path needs it
    except Exception as exc:  # noqa: BLE001
        ctx.emit(skipped=f"torchao import failed: {type(exc).__name__}: {exc}"[:300])
        return
    dev, clus, layers = _setup(ctx)
    spec = C.shape(ctx, C.half(layers))
    bf16, _ = C.plan_for(spec, clus, ctx, compile=True)  # built for the halved shape
    fp8 = dataclasses.replace(bf16, dtype="fp8", fp8_recipe="rowwise")
    ctx.emit(model=C.describe_model(spec), stage_layers=list(bf16.stage_layers),
             note="cpu dry-run: torchao's emulated float8, aot_eager" if ctx.dry_run else
             "rowwise float8 (torchao), inductor")
    # bf16 compiled is profiled by the compile case (the full shape): here the FP8 engine only
    b = run_engine(ctx, "bf16", spec, bf16, clus, dev, C.evaluate(spec, clus, ctx, bf16),
                   profile=False)
    f = run_engine(ctx, "fp8", spec, fp8, clus, dev, C.evaluate(spec, clus, ctx, fp8),
                   fp8_recipe="rowwise")
    deltas = [p - q for p, q in zip(f["losses"], b["losses"])]
    ctx.emit(fp8_over_bf16_tokens_per_s=f["tokens_per_s"] / b["tokens_per_s"],
             loss_delta_mean=statistics.mean(deltas),
             loss_delta_max_abs=max(abs(d) for d in deltas),
             loss_delta_max_rel=max(abs(d) / q for d, q in zip(deltas, b["losses"])))
    if b.get("predicted") and f.get("predicted"):
        ctx.emit(predicted_fp8_over_bf16_tokens_per_s=(b["predicted"]["step_time_s"]
                                                       / f["predicted"]["step_time_s"]))
    C.close_group()


def case_offload(ctx: C.Ctx) -> None:
    dev, clus, layers = _setup(ctx)
    spec = C.shape(ctx, max(1, layers // 8))  # host AdamW over every parameter: keep it small
    on_device, _ = C.plan_for(spec, clus, ctx, zero=3, offload="none")
    off = dataclasses.replace(on_device, offload="full")
    ctx.emit(model=C.describe_model(spec))
    d = run_engine(ctx, "device", spec, on_device, clus, dev,
                   C.evaluate(spec, clus, ctx, on_device), profile=False)
    est = C.evaluate(spec, clus, ctx, off)
    o = run_engine(ctx, "offloaded", spec, off, clus, dev, est, shapes=False)
    ctx.emit(offloaded_over_device_step_time=o["step_time_s"] / d["step_time_s"],
             loss_max_abs_diff=max(abs(p - q) for p, q in zip(o["losses"], d["losses"])),
             predicted_host_bytes=est.memory.host * C.GIB if est else None,
             predicted_offload_s=est.time.offload if est else None)
    if d.get("predicted") and o.get("predicted"):
        ctx.emit(predicted_offloaded_over_device_step_time=(
            o["predicted"]["step_time_s"] / d["predicted"]["step_time_s"]))
    C.close_group()


def case_checkpoint(ctx: C.Ctx) -> None:
    """Blocking seconds per save (in `save` plus the wait before the next optimizer step) and
    seconds to commit, synchronous vs asynchronous, with the model the product trains."""
    from meshtron.checkpoint import CheckpointConfig, store
    from meshtron.checkpoint.checkpointer import Checkpointer
    from meshtron.config import config_from_dict
    from meshtron.train.loop import build_run_data

    dev = C.device(ctx)
    C.init_group(dev, ctx)
    clus = C.cluster(ctx)
    hidden = 256 if ctx.dry_run else 2048
    # fp32 parameters + AdamW's two moments: 12 bytes per parameter, ~12 h^2 per block
    layers = 1 if ctx.dry_run else max(1, round(ctx.ckpt_gib * C.GIB / 12 / (12 * hidden**2)))
    run_dir = ctx.work / "checkpoint-case"
    cfg = config_from_dict({
        "model": {"preset": "tiny", "hidden": hidden, "layers": layers,
                  "ffn_hidden": int(hidden * 8 / 3) // 8 * 8},
        "data": {"seq_len": ctx.seq_len if ctx.dry_run else 512, "global_batch": 2},
        "train": {"dtype": "bf16", "steps": 1000, "eval_every": 0, "run_dir": str(run_dir)}})
    est = C.search(cfg.model, clus, dataclasses.replace(ctx, seq_len=cfg.data.seq_len,
                                                        global_batch=2))
    plan = est.to_plan(cfg.model.name, clus.name, 1, 2, cfg.data.seq_len, attention="flash")
    eng, init_s = C.engine(cfg, plan, dev)
    data = build_run_data(cfg)
    ck = Checkpointer(CheckpointConfig(every=1, keep=1), cfg, eng, data, run_dir, plan)
    ck.start()

    def step():
        return eng.train_step(*(t.to(dev) for t in data.next_batch())).loss

    base, _ = C.timed(step, dev, 3)  # optimizer states exist after the first
    ctx.emit(model=C.describe_model(cfg.model), init_s=init_s, step_time_s=base[-1],
             stager="pinned host buffers, side stream" if dev.type == "cuda" else
             "cpu dry-run: unpinned host copies on the stager thread")
    rounds = 1 if ctx.dry_run else 2
    blocked, commit, during = {"sync": [], "async": []}, {"sync": [], "async": []}, []
    n = 3
    for _ in range(rounds):
        for mode in ("sync", "async"):
            n += 1
            C.sync(dev)
            t0 = time.perf_counter()
            ck.save(n, blocking=mode == "sync")
            if mode == "async":
                while ck._inflight is not None and not ck._inflight.done():
                    during += C.timed(step, dev, 1)[0]
                ck.wait()
            commit[mode].append(time.perf_counter() - t0)
            blocked[mode].append(ck.stalls_s[-1])
            ctx.emit(blocking_s=blocked, commit_s=commit, steps_during_async_s=during)
    ck.close()
    folder = store.find_latest(ck.root).path
    nbytes = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    med = statistics.median
    ctx.emit(bytes=nbytes, async_blocking_over_sync=med(blocked["async"]) / med(blocked["sync"]),
             sync_write_gb_per_s=nbytes / med(commit["sync"]) / 1e9)
    eng.release()
    C.close_group()
