"""SIGTERM as a preemption notice: remember it, let the step finish, and chain to whatever handler
was installed before (e.g. a collective-trace dump), so several handlers can share the signal."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable


_peers_gone: Callable[[], list[int]] | None = None


def set_peer_check(peers_gone: Callable[[], list[int]] | None) -> None:
    """`peers_gone()`: the ranks whose processes have ended (the doctor's session knows them).
    A SIGTERM while one is gone is torchrun stopping the ranks after a failure, not a
    preemption: no checkpoint is promised (its collectives would need the gone peer); the
    doctor's session dumps and ends the rank."""
    global _peers_gone
    _peers_gone = peers_gone


class PreemptionWatch:
    """Records the first SIGTERM (time and count); the training loop polls `requested`.

    Installing keeps the previous handler and calls it after recording (unless it is the default
    action, which would kill the process before the checkpoint, or SIG_IGN). `close` puts the
    previous handler back only when ours is still the installed one, so a handler installed on
    top of ours (which chains to ours) is never dropped."""

    def __init__(self, rank: int = 0, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.rank = rank
        self.requested_at: float | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        # torchrun's teardown after a failed peer: no checkpoint to promise (set_peer_check)
        teardown = _peers_gone is not None and bool(_peers_gone())
        if self.requested_at is None and not teardown:
            self.requested_at = time.monotonic()
            print(f"meshtron train (rank {self.rank}): {signal.Signals(signum).name} received: "
                  "finishing this step, then checkpointing", file=sys.stderr, flush=True)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
