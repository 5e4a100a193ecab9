"""What torchrun's agent saw end each rank of a failed attempt, read from its own log records
(meshtron/launch.py installs `AgentExits` on torch's elastic multiprocessing logger; torch is
left as it is). The notes it writes (RUN_DIR/attempts/attempt_N/exits.json) name the signal of
every rank that ended by one in the restart record, the launcher's lines and `meshtron doctor`.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Mapping


class AgentExits(logging.Filter):
    """Notes how torchrun's agent saw every rank end each failed attempt (exit code, or minus
    the signal) into RUN_DIR/attempts/attempt_N/exits.json (checkpoint/restart.py
    `note_agent_exits`). A logging filter, torch left as it is (torch 2.13 elastic/
    multiprocessing/api.py SubprocessContext):

    - `_close` logs "Sending process %s closing signal %s" (and "Unable to shutdown process %s
      via %s, forcefully exiting via %s") for each rank the agent itself stops after a failure:
      those pids are noted as the agent's own teardown;
    - `_poll` then logs "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s" once per
      failed attempt, naming only its earliest failure (ties in its whole-second timestamps go
      to the lowest local rank: a rank SIGKILLed while rank 0 raised on the broken connection
      was not named). Every failure of the attempt is in that frame's `result.failures`; it is
      read from there (feature-detected: a torch without it leaves the logged one).

    A rank the agent stopped is left out unless it ended by another signal than the agent's
    (it died of its own before the agent's signal landed): the note names the ranks whose end
    was their own, so a SIGKILL, SIGSEGV or SIGBUS is named wherever torchrun logged it.

    The two records read here are then dropped, not printed: meshtron says the same per rank
    (launch.py `_report_failures`: "torchrun: rank 1 (pid ...) failed: killed by SIGKILL";
    the restart line: "restart 1 (torchrun): rank 1 killed by SIGKILL"), and torchrun's
    "W1207 ... Sending process 4185 closing signal SIGTERM" / "E1207 ... failed (exitcode: -9)
    local_rank: 1 ..." lines gave the user pids and a binary path to act on instead. "Unable
    to shutdown process" (a rank that ignored SIGTERM) stays."""

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.run_dir, self.attempt = run_dir, 0
        self.stopped: dict[int, set[int]] = {}
        """pid -> the signals the agent sent it during this attempt's teardown."""
        self.last_stopped: dict[int, set[int]] = {}
        """The same of the last failed attempt (`_report_failures`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        msg = str(record.msg)
        if msg.startswith("Sending process %s closing signal %s") and len(args) >= 2:
            self._stopped(args[0], args[1])
            return False
        if msg.startswith("Unable to shutdown process %s via %s") and len(args) >= 3:
            self._stopped(args[0], args[2])
        elif msg.startswith("failed (exitcode: %s) local_rank: %s") and len(args) >= 2:
            from meshtron.checkpoint.restart import note_agent_exits

            # one node (meshtron's own launcher): the local rank is the rank
            exits = self._own_ends(_attempt_failures()) or {int(args[1]): int(args[0])}
            if self.run_dir:
                note_agent_exits(self.run_dir, self.attempt, exits)
            self.attempt += 1
            self.last_stopped, self.stopped = self.stopped, {}
            return False
        return True

    def _stopped(self, pid, sig) -> None:
        try:
            number = int(signal.Signals[sig] if isinstance(sig, str) else sig)
            self.stopped.setdefault(int(pid), set()).add(number)
        except (KeyError, ValueError, TypeError):
            pass

    def _own_ends(self, failures: dict[int, tuple[int, int]]) -> dict[int, int]:
        """{rank: exit code} of the failures that were not the agent's teardown."""
        return {rank: code for rank, (pid, code) in failures.items()
                if not agent_stopped(self.stopped, pid, code)}


def agent_stopped(stopped: Mapping[int, set[int]], pid: int, code: int) -> bool:
    """The rank `pid` ended by torchrun's teardown: the agent signalled it, and it did not
    end by another signal of its own (e.g. a SIGSEGV that landed first)."""
    sent = stopped.get(pid)
    return sent is not None and not (code < 0 and -code not in sent)


def _attempt_failures() -> dict[int, tuple[int, int]]:
    """{local rank: (pid, exit code)} of every failure of the attempt torchrun's `_poll` is
    logging (the `result` of the frame that logs), {} when no caller frame holds one."""
    frame = sys._getframe(1)
    while frame is not None:
        result = frame.f_locals.get("result") if frame.f_code.co_name == "_poll" else None
        failures = getattr(result, "failures", None)
        if isinstance(failures, dict):
            try:
                return {int(r): (int(f.pid), int(f.exitcode)) for r, f in failures.items()}
            except (AttributeError, TypeError, ValueError):
                return {}
        frame = frame.f_back
    return {}
