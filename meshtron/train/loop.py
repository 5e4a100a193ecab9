"""The training loop shared by every engine, and the single-process engine (the reference every
parallel layout must reproduce).

One optimizer step = the global batch, split into micro-batches whose losses are weighted by
their share of the batch, so gradient accumulation gives exactly the full-batch gradient.

The step keeps the loss and the gradient norm on the device: the host reads them only at
logging points (every `train.log_every` steps, at step 1, at evaluations and at the end), in one
synchronisation per point (`engine.read_log`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from meshtron import doctor
from meshtron.config import RunConfig
from meshtron.errors import RunFailed
from meshtron.model import Transformer
from meshtron.runtime import batch_to_device
from meshtron.train.metrics import MetricsLog, StepClock, TrainProgress, evaluates_at, logs_at
from meshtron.train.optim import build_adamw, build_scheduler
from meshtron.train.precision import BF16Compute, configure_matmul_precision
from meshtron.train import router
from meshtron.hf.hooks import export_at_end, hf_fill
from meshtron.data.documents import apply_document_mask
from meshtron.data.tokenizer import keep_tokenizer
from meshtron.train.run_data import build_run_data


class StepOutput(NamedTuple):
    """What one optimizer step leaves for the loop; tensors stay on the device."""

    loss: torch.Tensor
    """Global-batch mean loss (0-d)."""
    grad_norm: torch.Tensor | None
    """Total gradient norm before clipping (0-d); None when clipping is off."""
    lr: float
    """Learning rate the step used."""


@dataclass
class TrainResult:
    """What a finished run reports (also written to RUN_DIR/summary.json)."""

    steps: int
    """Optimizer steps run; the last metrics record has this step number."""
    first_loss: float
    """Training loss of step 1."""
    final_loss: float
    """Training loss of the last step."""
    eval_loss: float | None
    """Held-out loss at the last evaluation (None: evaluation off)."""
    tokens: int
    """Tokens trained on: every step 1..N once, also in a resumed run."""
    wall_s: float
    """Seconds of this attempt's loop (steps resumed_from_step+1..N), evaluation and the first
    step included."""
    tokens_per_s: float | None
    """Steady-state throughput of the run's steps 1..N: tokens of every step but the first of
    each attempt / their training seconds (evaluation, saving and restarts excluded; a step
    trained twice counts once, with the time of the attempt that was kept; metrics.jsonl
    supplies the earlier attempts' times). None when no step is steady."""
    step_time_s: float | None
    """Median seconds per step over the same steady steps (the slowest rank's)."""
    params: int
    """Model parameters."""
    resumed_from_step: int = 0
    """The checkpoint step this attempt started from (0: a fresh start)."""
    attempt_step_time_s: float | None = None
    """Median seconds per step over this attempt's own steady steps (after
    resumed_from_step + 1): what its plan's prediction is compared with, since an earlier
    attempt may have run another layout (--resume on another --plan). None: none steady."""
    compile_time_s: float | None = None
    """Seconds this attempt spent in torch.compile (main rank; forward and backward graphs,
    recompilations and evaluation's graphs included), taken out of the step times above;
    None when the run does not compile."""
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """The metrics records, as in metrics.jsonl (main rank only)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()
                if k != "records" and not (k == "compile_time_s" and v is None)}


def forward_backward(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     micro_batch: int, mp: BF16Compute | None = None,
                     loss_fn=None) -> torch.Tensor:
    """Accumulate gradients of the batch mean loss over micro-batches; returns the mean loss
    (a detached 0-d tensor: no host synchronisation). With `mp` (bf16 mixed precision) the
    bf16 copy computes and its gradients land in `model`'s fp32 `.grad`. `loss_fn(logits,
    targets)`: a whole-logits loss instead of the model's chunked one (what a pipeline's last
    stage computes; the equivalence tests' bf16 reference of pipelined layouts)."""
    rows = inputs.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=inputs.device)
    if mp is not None:
        mp.refresh()
    compute = mp.model if mp is not None else model
    spec = getattr(compute, "spec", None)
    moe = router.moe_layers([compute]) if spec is not None and spec.is_moe else []
    for start in range(0, rows, micro_batch):
        x, y = inputs[start:start + micro_batch], targets[start:start + micro_batch]
        router.set_accum_scale(moe, x.shape[0] / rows)  # the aux loss weighted like the loss
        # x.shape[0] / rows: a power of two in the usual batch geometries, which scales bf16
        # gradients exactly (so micro-batching matches data parallelism bit for bit there)
        loss = (compute(x, y) if loss_fn is None  # chunked head + loss (model/loss.py)
                else loss_fn(compute(x), y)) * (x.shape[0] / rows)
        loss.backward()
        if mp is not None:
            mp.accumulate()
        total += loss.detach().float()
    return total


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             micro_batch: int, mp: BF16Compute | None = None) -> float:
    if mp is not None:
        mp.refresh()
        model = mp.model
    model.eval()
    losses = []
    for inputs, targets in batches:
        for start in range(0, inputs.shape[0], micro_batch):
            x, y = inputs[start:start + micro_batch], targets[start:start + micro_batch]
            losses.append(model(x, y).float())
    model.train()
    return float(torch.stack(losses).mean())


class LocalEngine:
    """One process, the plain model: the reference every parallel engine must reproduce."""

    is_main = True

    def __init__(self, cfg: RunConfig, device: torch.device | None = None):
        from meshtron.model.init import materialize
        from meshtron.runtime import local_device

        torch.manual_seed(cfg.train.seed)
        self.device = device if device is not None else local_device()
        # Built on meta and materialized as a parallel engine's parts are (one code path; the
        # values are drawn on the device: meshtron/model/init.py).
        self.model = Transformer(cfg.model, device="meta")
        materialize([self.model], self.device, fill=hf_fill(cfg))
        self.optimizer = build_adamw([self.model], cfg.optim, self.device.type)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.micro = cfg.data.micro_batch or cfg.data.global_batch
        self.dtype = cfg.train.dtype
        self.fp8_recipe = cfg.train.fp8_recipe
        if self.dtype == "fp8":  # refuse a device without FP8 before anything runs
            from meshtron.parallel.fp8 import fp8_emulated

            fp8_emulated(self.device)
        configure_matmul_precision(self.device, self.dtype)
        self._mp: BF16Compute | None = None
        self.grad_clip = cfg.optim.grad_clip
        self.spec = cfg.model
        self.compiles = cfg.train.compile
        """Per-block torch.compile (meshtron/parallel/compile.py) of the model that computes."""
        if self.compiles and self.dtype == "fp32":
            from meshtron.parallel.compile import apply_compile

            apply_compile(self.model)

    @property
    def mp(self) -> BF16Compute | None:
        """The bf16 compute copy (bf16 runs), made at first use: after the run's set-up
        (document masks, loaded weights) has touched the fp32 model."""
        if self.dtype in ("bf16", "fp8") and self._mp is None:
            self._mp = BF16Compute(self.model)
            if self.dtype == "fp8":  # the bf16 copy's block Linears compute in FP8
                from meshtron.parallel.fp8 import convert_to_fp8

                convert_to_fp8(self._mp.model, self.fp8_recipe, self.device)
            if self.compiles:  # the bf16 copy computes (after FP8 conversion, as torchtitan)
                from meshtron.parallel.compile import apply_compile

                apply_compile(self._mp.model)
        return self._mp

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        """Forward, backward, clip, optimizer and schedule step, with no host synchronisation."""
        # Page-locked and non-blocking: the host never waits for the device here (runtime.py).
        inputs = batch_to_device(inputs, self.device)
        targets = batch_to_device(targets, self.device)
        loss = forward_backward(self.model, inputs, targets, self.micro, self.mp)
        norm = (torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip,
                                               foreach=True)
                if self.grad_clip > 0 else None)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        if self.spec.is_moe:
            router.update_bias([self.model], compute=[self.mp.model] if self.mp else None)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss, norm, lr)

    def router_record(self) -> dict[str, float]:
        """Router statistics for metrics.jsonl (meshtron/train/router.py)."""
        model = self.mp.model if self.mp is not None else self.model
        return router.router_record(router.moe_layers([model]), self.spec, self.device)

    def read_log(self, out: StepOutput, seconds: float) -> tuple[float, float | None, float]:
        """(loss, grad norm, seconds): the logging point's one host synchronisation."""
        return read_values(out, seconds, self.device)

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        return evaluate(self.model, batches, self.micro, self.mp)


def read_values(out: StepOutput, seconds: float, device: torch.device,
                reduce_max=None) -> tuple[float, float | None, float]:
    """Loss, grad norm and host seconds in one tensor, optionally max-reduced over ranks
    (`reduce_max(tensor)`: loss and norm are equal on every rank, seconds become the slowest
    rank's), then read in a single device-to-host copy."""
    f64 = torch.float64
    nan = torch.full((), math.nan, dtype=f64, device=device)
    norm = out.grad_norm.reshape(()).to(device, f64) if out.grad_norm is not None else nan
    values = torch.stack([out.loss.reshape(()).to(device, f64), norm,
                          # non-blocking from host memory: no device synchronisation
                          torch.tensor(seconds, dtype=f64).to(device, non_blocking=True)])
    if reduce_max is not None:
        reduce_max(values)
    loss, grad_norm, secs = values.tolist()
    return loss, (grad_norm if out.grad_norm is not None else None), secs


def run_loop(engine, data, cfg: RunConfig, run_dir: Path, show_progress: bool = True,
             peak_flops: float | None = None, writers: list[Any] | None = None,
             checkpointer=None, trace_samples: bool = False) -> TrainResult:
    """Train `cfg.train.steps` steps (numbered 1..N); only the main rank writes and prints.

    `peak_flops`: the job's peak FLOP/s (all ranks) for MFU, when known. `writers`: extra
    record sinks with `write(record)` (e.g. TensorBoard), main rank only. `checkpointer`: a
    `meshtron.checkpoint.Checkpointer` (resume, periodic saves, SIGTERM), or None.
    `trace_samples`: add the step's global sample position and hash to every record."""
    main = engine.is_main
    ckpt = checkpointer
    start_step = ckpt.start() if ckpt else 0
    try:
        return _run_steps(engine, data, cfg, run_dir, show_progress, peak_flops, writers, ckpt,
                          start_step, trace_samples)
    finally:
        if ckpt:
            ckpt.close()


def _run_steps(engine, data, cfg, run_dir, show_progress, peak_flops, writers, ckpt,
               start_step, trace_samples=False) -> TrainResult:
    main = engine.is_main
    steps = cfg.train.steps
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
    eval_set = data.eval_batches() if cfg.train.eval_every else []
    records: list[dict[str, Any]] = ckpt.history() if ckpt and main else []
    log = MetricsLog(run_dir, resume=bool(ckpt and ckpt.resumed)) if main else None
    sinks = ([log] if log else []) + (list(writers or []) if main else [])
    clock = StepClock(tokens_per_step, first_step=start_step + 1)
    for interval in ckpt.past_intervals() if ckpt and main else []:
        clock.add(*interval)  # steps kept from earlier attempts: tokens/s covers 1..N once
    first_loss = next((r["loss"] for r in records if r["step"] == 1), math.nan)
    final_loss = records[-1]["loss"] if records else math.nan
    eval_loss: float | None = None
    compiled = CompileClock() if getattr(engine, "compiles", False) else None
    start = time.perf_counter()
    with TrainProgress(steps, enabled=show_progress and main) as progress:
        mark, pending = time.perf_counter(), 0
        for step in range(start_step + 1, steps + 1):
            doctor.step_starts()  # the run's work since the last beat ends (straggler rule)
            inputs, targets = data.next_batch()
            out = engine.train_step(inputs, targets)
            doctor.beat(step)
            pending += 1
            evaluating = evaluates_at(cfg.train, step)
            if not logs_at(cfg.train, step):
                if ckpt:
                    ckpt.after_step(step, steps)
                continue
            seconds = time.perf_counter() - mark
            if compiled is not None:  # compiling is not training: out of the step time
                seconds -= compiled.take()
            loss, grad_norm, seconds = engine.read_log(out, seconds)
            record = {"step": step, "loss": loss, "lr": out.lr,
                      "step_time_s": clock.add(step, pending, seconds)}
            if compiled is not None:
                record["compile_time_s"] = compiled.total
            comm_record = getattr(engine, "comm_record", None)  # compression / DiLoCo traffic
            if comm_record is not None:
                record.update(comm_record(pending))
            pending = 0
            if trace_samples and main:
                record.update(data.train.sampler.last_step_fields())
            if cfg.model.is_moe:  # before evaluation, whose forwards replace the statistics
                record.update(engine.router_record())
            if not math.isfinite(loss):
                raise RunFailed(f"loss became {loss} at step {step}; lower optim.lr or raise "
                                "optim.warmup_steps")
            first_loss = loss if step == 1 else first_loss
            final_loss = loss
            tps = clock.tokens_per_s()
            record["tokens_per_s"] = tps
            if peak_flops and tps:
                record["mfu"] = flops_per_token * tps / peak_flops
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            if evaluating:
                t0 = time.perf_counter()
                eval_loss = engine.evaluate(eval_set)
                record["eval_loss"] = eval_loss
                record["eval_time_s"] = time.perf_counter() - t0
            if main:
                records.append(record)
                for sink in sinks:
                    sink.write(record)
            progress.update(record)
            if ckpt:
                ckpt.after_step(step, steps)
            if compiled is not None:
                compiled.take()  # evaluation's own graphs (no_grad) count as compile time
            mark = time.perf_counter()  # evaluation, logging and saving are not training time
    if log is not None:
        log.close()
    return TrainResult(steps=steps, first_loss=first_loss, final_loss=final_loss,
                       eval_loss=eval_loss, tokens=tokens_per_step * steps,
                       wall_s=time.perf_counter() - start, tokens_per_s=clock.tokens_per_s(),
                       step_time_s=clock.median_step_s(), params=cfg.model.num_params(),
                       resumed_from_step=start_step, records=records,
                       attempt_step_time_s=clock.median_step_s(this_attempt=True),
                       compile_time_s=compiled.total if compiled is not None else None)


class CompileClock:
    """Seconds spent compiling, read from torch's compile-time counters
    (meshtron/parallel/compile.py `compile_seconds`) at each logging point."""

    def __init__(self):
        from meshtron.parallel.compile import compile_seconds

        self._read = compile_seconds
        self._seen = compile_seconds()
        self.total = 0.0
        """Compile seconds of this attempt so far."""

    def take(self) -> float:
        """Compile seconds since the last call (added to `total`)."""
        now = self._read()
        delta, self._seen = now - self._seen, now
        self.total += delta
        return delta


def train(cfg: RunConfig, show_progress: bool = True, overwrite: bool = False,
          data=None, checkpoint=None) -> TrainResult:
    """Single-process training into `cfg.train.run_dir` (refused when it holds a run, unless
    `overwrite` or resuming): metrics.jsonl, summary.json, curves.png (and TensorBoard files if
    asked). `data`: the run's data when already built (`build_run_data(cfg)`). `checkpoint`: a
    `meshtron.checkpoint.CheckpointConfig` (checkpoints, --resume, SIGTERM), or None."""
    from meshtron.train import outputs

    from meshtron.checkpoint.checkpointer import make_checkpointer

    resume = bool(checkpoint and checkpoint.resume)
    outputs.check_run_dir(cfg, overwrite or resume)
    data = build_run_data(cfg) if data is None else data
    # Bad input fails above, before anything is written to the run folder.
    run_dir = outputs.prepare_run_dir(cfg, resume=resume)
    keep_tokenizer(data.tokenizer, run_dir)
    engine = LocalEngine(cfg)
    apply_document_mask([engine.model], cfg, data.tokenizer)
    ckpt = make_checkpointer(checkpoint, cfg, engine, data)
    with outputs.extra_writers(cfg, run_dir) as writers:
        result = run_loop(engine, data, cfg, run_dir, show_progress, writers=writers,
                          checkpointer=ckpt)
    export_at_end(cfg, run_dir, model=engine.model)
    outputs.finish_run(run_dir, result.to_dict(), result.records)
    return result
