"""The metrics.jsonl of a replica-FT run (`meshtron train --replica-ft G`), written by its
launcher with the writer and the step clock every run uses.

Each replica-group process appends one line per committed step to its own
RUN_DIR/replica_ft/group<i>_<attempt>.jsonl (meshtron/train/replica.py). The launcher reads those
lines as they arrive (`CommittedSteps.poll`, every few milliseconds), takes each step once, in
order, from whichever group logged it first (every member of a quorum commits the same step
with the same all-reduced loss), and writes the run's metrics.jsonl through `MetricsLog` at the
loop's logging points (`logs_at`), with the loop's fields and its step clock (`StepClock`), plus
`participants` (the replica groups that committed the step); a non-finite loss at a logging point fails the run as the loop does. One writer, the launcher: a group
that dies mid-line leaves nothing half-read, and when the launcher is gone nothing writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from meshtron.errors import RunFailed
from meshtron.train.metrics import MetricsLog, StepClock, evaluates_at, logs_at

GROUP_LOG_GLOB = "group*_*.jsonl"
"""The per-process step logs of RUN_DIR/replica_ft (replica.run_group writes them)."""


class CommittedSteps:
    """The committed steps of a replica-FT run, as the groups log them, into metrics.jsonl."""

    def __init__(self, cfg, run_dir: Path, group_dir: Path):
        self.cfg = cfg
        self.group_dir = group_dir
        self.log = MetricsLog(run_dir)
        self.clock = StepClock(cfg.data.global_batch * cfg.data.seq_len)
        self.offsets: dict[Path, int] = {}
        """Bytes of each group log already read (complete lines only)."""
        self.arrived: dict[int, dict[str, Any]] = {}
        """Committed steps read but not yet taken (a later step read before an earlier one)."""
        self.next_step = 1
        self.previous: dict[str, Any] | None = None
        """The last step taken (its commit time starts the next step's interval)."""
        self.pending, self.pending_s = 0, 0.0
        """Steps and seconds since the last logging point."""
        self.records: list[dict[str, Any]] = []
        """The records written to metrics.jsonl."""
        self.participants: list[int] = []
        """Replica groups that committed each step, steps 1, 2, ... taken so far."""
        self.eval_loss: float | None = None

    @property
    def degraded_steps(self) -> int:
        """Steps committed by fewer replica groups than the run has."""
        return sum(n < self.cfg.train.replica_ft for n in self.participants)

    def poll(self) -> None:
        """Read what the groups logged since the last call; write the steps now in order."""
        for path in sorted(self.group_dir.glob(GROUP_LOG_GLOB)):
            for record in self._new_lines(path):
                if record["step"] >= self.next_step:
                    self.arrived.setdefault(record["step"], record)
        while self.next_step in self.arrived:
            self._take(self.arrived.pop(self.next_step))
            self.next_step += 1

    def _new_lines(self, path: Path) -> list[dict[str, Any]]:
        start = self.offsets.get(path, 0)
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits
        self.offsets[path] = start + len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def _take(self, r: dict[str, Any]) -> None:
        """One committed step: its seconds into the clock; a record at a logging point."""
        step, prev = r["step"], self.previous
        # The step's interval: from the previous step's commit (after its evaluation) to this
        # commit, the same wall-clock instants in every group of the quorum; step 1 (warm-up,
        # never steady) takes the group's own measure.
        seconds = (r["t"] - prev["t"] - prev.get("eval_time_s", 0.0) if prev is not None
                   else r["seconds"])
        self.previous = r
        self.participants.append(r["participants"])
        self.pending += 1
        self.pending_s += seconds
        if not logs_at(self.cfg.train, step):
            return
        if not math.isfinite(r["loss"]):  # the loop's check, at the same logging points
            raise RunFailed(f"loss became {r['loss']} at step {step}; lower optim.lr or raise "
                            "optim.warmup_steps")
        record = {"step": step, "loss": r["loss"], "lr": r["lr"],
                  "step_time_s": self.clock.add(step, self.pending, self.pending_s)}
        self.pending, self.pending_s = 0, 0.0
        record["tokens_per_s"] = self.clock.tokens_per_s()
        if r.get("grad_norm") is not None:
            record["grad_norm"] = r["grad_norm"]
        if evaluates_at(self.cfg.train, step):
            self.eval_loss = r["eval_loss"]
            record["eval_loss"] = r["eval_loss"]
            record["eval_time_s"] = r["eval_time_s"]
        record["participants"] = r["participants"]
        self.records.append(record)
        self.log.write(record)

    def close(self) -> None:
        self.log.close()
