"""Per-step metrics: RUN_DIR/metrics.jsonl, the step clock behind the run's one tokens/s
figure, and the console progress (rich)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)


class MetricsLog:
    """Appends one JSON object per line; flushed each write so a killed run keeps its history."""

    def __init__(self, run_dir: Path, resume: bool = False):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a" if resume else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def evaluates_at(train, step: int) -> bool:
    """Whether step `step` (from 1) of a run with these `train` settings evaluates: every
    `train.eval_every` steps and at the last step (never when eval_every is 0)."""
    return bool(train.eval_every) and (step % train.eval_every == 0 or step == train.steps)


def logs_at(train, step: int) -> bool:
    """Whether step `step` is a logging point (a metrics.jsonl record): step 1, the last step,
    every evaluation and every `train.log_every` steps. Every engine's loop and the replica-FT
    launcher log the same steps."""
    return (step == 1 or step == train.steps or evaluates_at(train, step)
            or step % train.log_every == 0)


class StepClock:
    """Training time between logging points, and the one throughput definition of a run.

    The loop reads the clock at each logging point, right after that point's host
    synchronisation, so an interval holds every step since the previous point; evaluation runs
    after a point and before the clock restarts, so it never counts as training. Steady state
    is every step but the first of each attempt (lazy initialisation, allocator and
    communicator warm-up): tokens/s = tokens of the steady steps / their seconds, the same
    figure in the console, metrics.jsonl (running, up to that step) and summary.json (the whole
    run). A resumed run (--resume, a torchrun restart) counts every step 1..N once, with the
    time of the attempt whose result was kept: the intervals logged before the resumed step
    are added back from metrics.jsonl (`add(..., steady=...)`), and the resumed attempt's
    first step is warm-up again (`first_step`)."""

    def __init__(self, tokens_per_step: int, first_step: int = 1):
        self.tokens_per_step = tokens_per_step
        self.first_step = first_step
        """This attempt's first step (1, or the step after the resumed checkpoint)."""
        self.intervals: list[tuple[int, int, float, bool]] = []
        """(last step, steps, seconds, steady) per logging interval."""

    def add(self, last_step: int, steps: int, seconds: float,
            steady: bool | None = None) -> float:
        """Record an interval; returns its seconds per step. `steady`: None = unless it holds
        this attempt's first step (the loop logs that step on its own)."""
        if steady is None:
            steady = not last_step - steps + 1 <= self.first_step <= last_step
        self.intervals.append((last_step, steps, seconds, steady))
        return seconds / steps

    def _steady(self) -> list[tuple[int, int, float, bool]]:
        return [iv for iv in self.intervals if iv[3]]

    @property
    def steady_steps(self) -> int:
        return sum(iv[1] for iv in self._steady())

    def tokens_per_s(self) -> float | None:
        """Steady-state tokens per second so far (None until a step after the first)."""
        steady = self._steady()
        seconds = sum(iv[2] for iv in steady)
        if not steady or seconds <= 0:
            return None
        return self.tokens_per_step * sum(iv[1] for iv in steady) / seconds

    def median_step_s(self, this_attempt: bool = False) -> float | None:
        """Median seconds per step over the steady intervals (None for a one-step run);
        `this_attempt`: only this attempt's (from `first_step` on), not the earlier attempts'
        added back from metrics.jsonl."""
        steady = [iv for iv in self._steady() if not this_attempt or iv[0] >= self.first_step]
        return statistics.median(s / n for _, n, s, _ in steady) if steady else None


def _rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"


class TrainProgress:
    """A progress bar with loss and steady tokens/s on a terminal; without one (CI, logs) a
    line at evaluation steps, at the last step and at most every 10 s in between, each step
    at most once. Silent when disabled (non-zero ranks)."""

    def __init__(self, total: int, enabled: bool = True, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.total = total
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(), console=self.console, disable=not enabled)
        self._task = self._progress.add_task("train", total=total, loss=float("nan"), tps="-")
        self._last_print = time.monotonic()

    def __enter__(self) -> "TrainProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def update(self, record: dict[str, Any]) -> None:
        """Show a metrics record (step numbered from 1)."""
        if not self.enabled:
            return
        step, tps = record["step"], record.get("tokens_per_s")
        self._progress.update(self._task, completed=step, loss=record["loss"], tps=_rate(tps))
        has_eval = "eval_loss" in record
        terminal = self.console.is_terminal
        due = time.monotonic() - self._last_print > 10 or step == self.total
        if has_eval or (not terminal and due):
            self._last_print = time.monotonic()
            ev = f", eval {record['eval_loss']:.4f}" if has_eval else ""
            self._progress.console.print(
                f"step {step}/{self.total}: loss {record['loss']:.4f}{ev}, {_rate(tps)} tok/s")
