"""Single-process training: the reference every parallel layout must reproduce.

One optimizer step = the global batch, split into micro-batches whose losses are weighted by
their share of the batch, so gradient accumulation gives exactly the full-batch gradient.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from meshtron.config import RunConfig
from meshtron.data import build_data
from meshtron.errors import RunFailed, UserError
from meshtron.model import Transformer, cross_entropy_loss
from meshtron.train.metrics import MetricsLog, TrainProgress
from meshtron.train.optim import build_adamw, build_scheduler


@dataclass
class TrainResult:
    """What a finished run reports (also written to RUN_DIR/summary.json)."""

    steps: int
    first_loss: float
    final_loss: float
    eval_loss: float | None
    tokens: int
    wall_s: float
    tokens_per_s: float
    params: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def autocast_context(dtype: str, device_type: str) -> contextlib.AbstractContextManager:
    """bf16 autocast keeps fp32 master weights and optimizer states (Micikevicius et al. 2018)."""
    if dtype == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_backward(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     micro_batch: int, dtype: str) -> float:
    """Accumulate gradients of the batch mean loss over micro-batches; returns the mean loss."""
    rows = inputs.shape[0]
    total = 0.0
    device_type = inputs.device.type
    for start in range(0, rows, micro_batch):
        x, y = inputs[start:start + micro_batch], targets[start:start + micro_batch]
        with autocast_context(dtype, device_type):
            logits = model(x)
        loss = cross_entropy_loss(logits, y) * (x.shape[0] / rows)
        loss.backward()
        total += loss.item()
    return total


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             micro_batch: int, dtype: str) -> float:
    model.eval()
    losses = []
    for inputs, targets in batches:
        for start in range(0, inputs.shape[0], micro_batch):
            x, y = inputs[start:start + micro_batch], targets[start:start + micro_batch]
            with autocast_context(dtype, x.device.type):
                losses.append(cross_entropy_loss(model(x), y).item())
    model.train()
    return sum(losses) / len(losses)


class LocalEngine:
    """One process, the plain model: the reference every parallel engine must reproduce."""

    is_main = True

    def __init__(self, cfg: RunConfig):
        torch.manual_seed(cfg.train.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = Transformer(cfg.model).to(self.device)
        self.optimizer = build_adamw([self.model], cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.micro = cfg.data.micro_batch or cfg.data.global_batch
        self.dtype = cfg.train.dtype
        self.grad_clip = cfg.optim.grad_clip

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float | None, float]:
        """Forward, backward, clip, optimizer and schedule step; returns (loss, grad norm, lr)."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        loss = forward_backward(self.model, inputs, targets, self.micro, self.dtype)
        norm = (float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
                if self.grad_clip > 0 else None)
        return loss, norm, self._step_optimizer()

    def _step_optimizer(self) -> float:
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        return evaluate(self.model, batches, self.micro, self.dtype)

    def slowest(self, seconds: float) -> float:
        """The slowest rank's value (one rank here)."""
        return seconds


def run_loop(engine, data, cfg: RunConfig, run_dir: Path, show_progress: bool = True,
             mfu_fn: Callable[[float], float] | None = None) -> TrainResult:
    """The training loop shared by every engine; only the main rank writes and prints."""
    main = engine.is_main
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    eval_set = data.eval_batches()
    log = MetricsLog(run_dir) if main else None
    first_loss = final_loss = math.nan
    eval_loss: float | None = None
    start = time.perf_counter()
    with TrainProgress(cfg.train.steps, enabled=show_progress and main) as progress:
        for step in range(cfg.train.steps):
            t0 = time.perf_counter()
            inputs, targets = data.next_batch()
            loss, grad_norm, lr = engine.train_step(inputs, targets)
            dt = engine.slowest(time.perf_counter() - t0)
            if not math.isfinite(loss):
                raise RunFailed(f"loss became {loss} at step {step}; lower optim.lr or raise "
                                "optim.warmup_steps")
            first_loss = loss if step == 0 else first_loss
            final_loss = loss
            record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                      "step_time_s": dt}
            if mfu_fn is not None:
                record["mfu"] = mfu_fn(dt)
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            last = step == cfg.train.steps - 1
            if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or last):
                eval_loss = engine.evaluate(eval_set)
                record["eval_loss"] = eval_loss
                progress.log(f"step {step + 1}: loss {loss:.4f}  eval {eval_loss:.4f}")
            if log is not None and (step % cfg.train.log_every == 0 or last or "eval_loss" in record):
                log.write(record)
            progress.update(step + 1, loss, tokens_per_step / dt)
    if log is not None:
        log.close()
    wall = time.perf_counter() - start
    result = TrainResult(steps=cfg.train.steps, first_loss=first_loss, final_loss=final_loss,
                         eval_loss=eval_loss, tokens=tokens_per_step * cfg.train.steps,
                         wall_s=wall, tokens_per_s=tokens_per_step * cfg.train.steps / wall,
                         params=cfg.model.num_params())
    if main:
        (run_dir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def build_run_data(cfg: RunConfig, dp_rank: int = 0, dp_size: int = 1):
    """The data pipeline for this data-parallel rank, checked against the model's vocabulary."""
    data = build_data(source=cfg.data.source, tokenizer=cfg.data.tokenizer,
                      seq_len=cfg.data.seq_len, global_batch=cfg.data.global_batch,
                      seed=cfg.train.seed, dp_rank=dp_rank, dp_size=dp_size,
                      eval_batches=cfg.data.eval_batches, bpe_vocab=cfg.data.bpe_vocab)
    if data.vocab_size > cfg.model.vocab:
        raise UserError(f"model.vocab={cfg.model.vocab}: smaller than the tokenizer's "
                         f"{data.vocab_size} ids")
    return data


def prepare_run_dir(cfg: RunConfig, main: bool = True, extra: dict[str, Any] | None = None) -> Path:
    run_dir = Path(cfg.train.run_dir)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        doc = {**cfg.to_dict(), **(extra or {})}
        (run_dir / "config.json").write_text(json.dumps(doc, indent=2, default=str))
    return run_dir


def train(cfg: RunConfig, show_progress: bool = True) -> TrainResult:
    """Single-process training."""
    data = build_run_data(cfg)
    # Bad input fails above, before anything is written to the run folder.
    run_dir = prepare_run_dir(cfg)
    return run_loop(LocalEngine(cfg), data, cfg, run_dir, show_progress)
