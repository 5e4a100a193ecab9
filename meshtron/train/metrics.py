"""Per-step metrics to RUN_DIR/metrics.jsonl and a live progress bar (rich)."""

from __future__ import annotations

import json
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


class TrainProgress:
    """A progress bar showing loss and tokens/s; silent when disabled (non-zero ranks)."""

    def __init__(self, total: int, enabled: bool = True, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeRemainingColumn(), console=self.console, disable=not enabled)
        self._task = self._progress.add_task("train", total=total, loss=float("nan"), tps=0.0)
        self._last_print = 0.0

    def __enter__(self) -> "TrainProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        self._progress.update(self._task, completed=step, loss=loss, tps=tokens_per_s)
        # Without a terminal (CI, logs) rich draws nothing: print a line now and then instead.
        if self.enabled and not self.console.is_terminal and time.monotonic() - self._last_print > 10:
            self._last_print = time.monotonic()
            self.console.print(f"step {step}: loss {loss:.4f}, {tokens_per_s:,.0f} tok/s")

    def log(self, message: str) -> None:
        if self.enabled:
            self._progress.console.print(message)
