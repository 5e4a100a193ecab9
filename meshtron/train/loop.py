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
from typing import Any

import torch

from meshtron.config import RunConfig
from meshtron.data import build_data
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


def train(cfg: RunConfig, show_progress: bool = True) -> TrainResult:
    data = build_data(source=cfg.data.source, tokenizer=cfg.data.tokenizer,
                      seq_len=cfg.data.seq_len, global_batch=cfg.data.global_batch,
                      seed=cfg.train.seed, dp_rank=0, dp_size=1,
                      eval_batches=cfg.data.eval_batches, bpe_vocab=cfg.data.bpe_vocab)
    if data.vocab_size > cfg.model.vocab:
        raise ValueError(f"model.vocab={cfg.model.vocab}: smaller than the tokenizer's "
                         f"{data.vocab_size} ids")
    # Bad input fails above, before anything is written to the run folder.
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model)
    optimizer = build_adamw([model], cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    micro = cfg.data.micro_batch or cfg.data.global_batch
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    eval_set = data.eval_batches()

    log = MetricsLog(run_dir)
    first_loss = final_loss = math.nan
    eval_loss: float | None = None
    start = time.perf_counter()
    with TrainProgress(cfg.train.steps, enabled=show_progress) as progress:
        for step in range(cfg.train.steps):
            t0 = time.perf_counter()
            inputs, targets = data.next_batch()
            loss = forward_backward(model, inputs, targets, micro, cfg.train.dtype)
            grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                         if cfg.optim.grad_clip > 0 else None)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise RuntimeError(f"loss became {loss} at step {step}")
            first_loss = loss if step == 0 else first_loss
            final_loss = loss
            record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                      "step_time_s": dt}
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            last = step == cfg.train.steps - 1
            if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or last):
                eval_loss = evaluate(model, eval_set, micro, cfg.train.dtype)
                record["eval_loss"] = eval_loss
                progress.log(f"step {step + 1}: loss {loss:.4f}  eval {eval_loss:.4f}")
            if step % cfg.train.log_every == 0 or last or "eval_loss" in record:
                log.write(record)
            progress.update(step + 1, loss, tokens_per_step / dt)
    log.close()
    wall = time.perf_counter() - start
    result = TrainResult(steps=cfg.train.steps, first_loss=first_loss, final_loss=final_loss,
                         eval_loss=eval_loss, tokens=tokens_per_step * cfg.train.steps,
                         wall_s=wall, tokens_per_s=tokens_per_step * cfg.train.steps / wall,
                         params=cfg.model.num_params())
    (run_dir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result
