"""Verdicts about how a run ended rather than where its ranks diverged (meshtron/diagnose/
analyze.py asks these first or last):

- `preempted`: every rank's last dump was written at SIGTERM (a preemption notice, or the
  launcher stopping the run) at about the same time, or the run wrote a `preempted` record: the
  ranks stopped together; which operation each had just issued is not a divergence. Says the
  step, and whether the preemption checkpoint was committed (else the newest complete one).
- `dead_rank` after a stale dump: a rank that dumped and went on (at SIGTERM, e.g. SIGKILLed
  during the preemption save; or at SIGUSR1, a dump on demand) and then died: a later dump of
  another rank shows it completed more collectives after its own dump, or lost its connection
  to it, and finds its process gone.
- `exception`: a rank raised (its dump's reason); the earliest error that is not a consequence
  of a peer's end (a broken connection) is named with its rank, type and message. When every
  error is such a consequence, the cause is the rank that ended without a Python error: one
  torchrun's agent saw killed by a signal (`dead_rank`); with no such rank, the verdict says
  that no rank names a cause rather than presenting a lost connection as one.

- `never_joined`: a rank with no hello file (written at its start, before it joins the process
  group) while a rank that dumped was still joining: its process never reached meshtron's
  start, and the others waited for it in the rendezvous.

The signal that ended a rank comes from what torchrun's agent saw (checkpoint/restart.py
`agent_exits`), the last complete checkpoint from the checkpoint store.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from meshtron.diagnose.trace import Trace


class Ending(NamedTuple):
    """A verdict's fields (analyze.py makes its Diagnosis of them)."""

    kind: str
    verdict: str
    culprit_ranks: list[int]

_BROKEN = ("connection closed", "connection reset", "broken pipe", "connection refused",
           "remote process exited", "peer rank is gone")
_TOGETHER_S = 5.0
"""Dumps at SIGTERM this close in time are one signal reaching every rank (the launcher
forwards it to all; a rank that got it alone tells the others at the next step's agreement)."""


def went_on_dump(dump: dict[str, Any]) -> bool:
    """A dump after which the rank was meant to go on: at SIGTERM (it checkpoints, then ends)
    or at SIGUSR1 (a dump on demand)."""
    return sigterm_dump(dump) or dump.get("reason") == "SIGUSR1"


def sigterm_dump(dump: dict[str, Any]) -> bool:
    """Written when SIGTERM arrived (not torchrun's teardown after a peer had ended)."""
    reason = dump.get("reason", "")
    return reason == "SIGTERM" or (reason.startswith("SIGTERM") and "after rank" not in reason)


def _latest_checkpoint(trace: Trace) -> int | None:
    from meshtron.checkpoint import store
    from meshtron.train import earlier

    kept = earlier.resumed_step(trace.run_dir)  # a kept launch: the store has moved on since
    if kept is not None:
        return kept
    try:
        return store.find_latest(store.checkpoint_root(trace.run_dir), deep=False).step
    except OSError:  # the checkpoint folder unreadable (replaced by a file, no permission)
        return None


def _checkpoint_text(trace: Trace) -> str:
    """The last complete checkpoint when this attempt ended: the next attempt's `restart`
    record resumed from it; for the latest attempt, the store's newest."""
    resumed = [m for m in trace.metrics if m.get("event") == "restart"
               and m.get("attempt") == trace.attempt + 1]
    if resumed:
        step = resumed[-1]["resumed_from_step"]
        if resumed[-1].get("restored_from") == "memory":  # --snapshot-every: not from disk
            return (f"attempt {trace.attempt + 1} resumed from the in-memory snapshot of step "
                    f"{step}")
        return ("no complete checkpoint when it ended" if step in (None, 0) else
                f"the last complete checkpoint was step {step} (attempt {trace.attempt + 1} "
                "resumed from it)")
    step = _latest_checkpoint(trace)
    return (f"the last complete checkpoint is step {step}" if step is not None
            else "no complete checkpoint")


def _preempted_record(trace: Trace) -> dict[str, Any] | None:
    """The `preempted` record of this attempt (written after every dump of its ranks' SIGTERM)."""
    start = min(d["time"] for d in trace.dumps.values())
    signalled = [e["time"] for d in trace.dumps.values() for e in d.get("earlier_dumps", [])
                 if sigterm_dump(e)] + [d["time"] for d in trace.dumps.values()
                                        if sigterm_dump(d)]
    since = min(signalled, default=start) - 1.0
    # and signalled no later than this launch's last dump: a launch a --resume kept reads the
    # run's metrics.jsonl (trace._metrics), which holds later launches' records too; one whose
    # ranks all dumped for another reason took a later preemption as its own (review s55)
    last = max([d["time"] for d in trace.dumps.values()] + signalled) + 1.0
    found = [m for m in trace.metrics if m.get("event") == "preempted"
             and m.get("time", 0) >= since
             and m.get("time", 0) - m.get("seconds_after_signal", 0.0) <= last]
    return found[0] if found else None  # the first since: a later launch's come after it


def preempted(trace: Trace):
    """Every rank stopped by SIGTERM together, or a committed preemption checkpoint."""
    if len(trace.dumps) < trace.world_size:
        return None
    record = _preempted_record(trace)
    if record is not None:
        return Ending("preempted", f"preempted: SIGTERM reached the ranks and every rank "
                      f"wrote the checkpoint of step {record['checkpoint_step']} "
                      f"({record.get('seconds_after_signal', 0):.1f} s after the signal); "
                      "continue with --resume.", [])
    dumps = trace.dumps.values()
    times = [d["time"] for d in dumps]
    # a rank whose SIGTERM came after a peer had already ended by its own SIGTERM (no
    # checkpointing: the default action) dumps as torchrun's teardown: stopped together too
    together = all(d.get("reason", "").startswith("SIGTERM") for d in dumps) \
        and any(sigterm_dump(d) for d in dumps)
    if not together or max(times) - min(times) > _TOGETHER_S:
        return None
    steps = sorted({d.get("step") for d in dumps}, key=lambda s: s or 0)
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    return Ending("preempted", f"preempted: every rank was stopped by SIGTERM at {at} (within "
                  f"{max(times) - min(times):.1f} s; a preemption notice or the launcher "
                  "stopped the run) and no preemption checkpoint was committed; "
                  f"{_checkpoint_text(trace)}. The operations the ranks had just issued are "
                  "where the signal found them, not a divergence.", [])


def _last_seq(dump: dict[str, Any], group: str) -> int:
    return max((r["seq"] for r in dump.get("records", []) if r["group"] == group
                and not r.get("p2p")), default=-1)


def _outlived_dump(trace: Trace, rank: int) -> tuple[int, str] | None:
    """(another rank, what its dump shows) when that rank's later dump shows `rank` completing
    collectives after `rank`'s own dump, or losing its connection to `rank` (a gloo/NCCL error
    about a gone peer), and finds its process gone; on another host, where no process can be
    seen, both (a rank that went on after its dump and then raised would have dumped again, a
    stopped one keeps its connections open); None if no dump says so."""
    mine = trace.dumps[rank]
    for other, d in sorted(trace.dumps.items()):
        if other == rank or d["time"] <= mine["time"]:
            continue
        state = d.get("peers", {}).get(str(rank), {}).get("state")
        later = any(r["state"] == "completed" and not r.get("p2p")
                    and rank in trace.group_ranks(r["group"])
                    and r["seq"] > _last_seq(mine, r["group"]) for r in d.get("records", []))
        reason = d.get("reason", "")
        broke = reason.startswith("exception") and _is_consequence(reason)
        # a SIGKILLed process closes its sockets while it exits, before /proc shows it a
        # zombie: the peer that lost the connection can still read it as running; torchrun's
        # agent saw it end by a signal (`killed_by`)
        dying = state == "running" and broke and (killed_by(trace, rank) or "").startswith(
            "killed by")
        if (state in ("gone", "never_started") or dying) and (later or broke):
            shows = ("shows it completing more collectives after that dump" if later
                     else "shows the connection to it breaking after that dump")
            return other, shows + (", its process still exiting" if dying
                                   else ", then finds its process gone")
        if state in (None, "unknown") and later and broke:
            return other, ("shows it completing more collectives after that dump, then the "
                           "connection to it breaking (another host: its process is not seen)")
    return None


def died_after_dump(trace: Trace):
    """A rank that dumped at SIGTERM or SIGUSR1, kept going, then died without dumping again."""
    found = {r: o for r, d in sorted(trace.dumps.items())
             if went_on_dump(d) and (o := _outlived_dump(trace, r)) is not None}
    if not found:
        return None
    r, (other, shows) = next(iter(found.items()))
    how = killed_by(trace, r) or "its process is gone"
    signal_name = trace.dumps[r].get("reason", "").split(":")[0]
    text = (f"{trace.label(r)} died after its {signal_name} dump at step "
            f"{trace.dumps[r].get('step')} "
            f"({how}): {trace.label(other)}'s later dump {shows}; {_checkpoint_text(trace)}.")
    return Ending("dead_rank", text, sorted(found))


def killed_by(trace: Trace, rank: int) -> str | None:
    """'killed by SIGKILL' / 'exit code 1': what torchrun's agent saw of `rank` in this
    attempt (checkpoint/restart.py `agent_exits`); None when it left no word."""
    from meshtron.checkpoint.restart import agent_exits, exit_text

    code = agent_exits(trace.run_dir, trace.attempt).get(rank)
    return None if code is None else exit_text(code)


def killed_without_dumps(trace: Trace) -> Ending | None:
    """No rank dumped, and torchrun's agent saw ranks end by a signal (SIGKILL, SIGSEGV,
    SIGBUS ...: none of them lets a rank write a dump): `dead_rank` naming each rank and its
    signal. None when the agent saw none."""
    killed = {r: how for r in range(trace.world_size)
              if (how := killed_by(trace, r)) and how.startswith("killed by")}
    if not killed:
        return None
    names = ", ".join(f"{trace.label(r)} {how}" for r, how in sorted(killed.items()))
    return Ending("dead_rank", f"{names} (torchrun's agent saw them end; no rank dumped: such "
                  f"a signal ends a process before it can); {_checkpoint_text(trace)}.",
                  sorted(killed))


def dead_rank_details(trace: Trace, culprits: list[int]) -> str:
    """'; killed by SIGKILL (torchrun's agent); the last complete checkpoint is step N'."""
    how = [f"rank {r} {text}" for r in culprits if (text := killed_by(trace, r))]
    seen = f"; torchrun's agent saw {', '.join(how)}" if how else ""
    return f"{seen}; {_checkpoint_text(trace)}"


def _joining(dump: dict[str, Any]) -> bool:
    """The rank dumped before it had joined the process group (`joined_t` still None)."""
    return "joined_t" in dump and dump["joined_t"] is None


def never_joined(trace: Trace, missing: list[int]) -> Ending | None:
    """Ranks with no hello file (written at a rank's start, before it joins the process
    group) while a rank that dumped was still joining: they never reached meshtron's start."""
    waiting = {r: d for r, d in trace.dumps.items() if _joining(d)}
    culprits = [r for r in missing if r not in trace.hellos]
    if not waiting or not culprits:
        return None
    names = "; ".join(trace.label(r) for r in culprits)
    one = len(culprits) == 1
    text = (f"{names} never joined: {'it' if one else 'they'} wrote no hello file (the "
            f"{'process' if one else 'processes'} never reached meshtron's start: stopped, "
            "stuck before it, or never spawned)")
    r = max(waiting, key=lambda k: waiting[k]["time"] - _start_t(trace, k, waiting[k]))
    secs = waiting[r]["time"] - _start_t(trace, r, waiting[r])
    where = trace.where(r)
    text += (f"; rank {r} waited {secs:.1f} s for {'it' if one else 'them'} to join the "
             "process group" + (f" (at {where})" if where else ""))
    seen = [f"rank {c} {how}" for c in culprits if (how := killed_by(trace, c))]
    if seen:
        text += f"; torchrun's agent saw {', '.join(seen)}"
    return Ending("never_joined", text + ".", culprits)


def _start_t(trace: Trace, rank: int, dump: dict[str, Any]) -> float:
    """When the rank started (its hello file), else its dump's time (a wait of 0)."""
    return trace.hellos.get(rank, {}).get("start_t") or dump["time"]


def _is_consequence(text: str) -> bool:
    return any(b in text.lower() for b in _BROKEN)


def raised(trace: Trace):
    """The earliest exception a rank raised that is not a peer's end seen from here (from its
    dump, or from its failure note when its dump could not be written: `_noted_errors`)."""
    errors = {r: d for r, d in trace.dumps.items() if d.get("reason", "").startswith("exception")}
    errors = {**_noted_errors(trace), **errors}
    if not errors:
        return None
    own = {r: d for r, d in errors.items() if not _is_consequence(d["reason"])}
    if not own:
        return _lost_connections(trace, errors)
    first = min(own, key=lambda r: own[r]["time"])
    message = _message(own[first])
    same = sorted(r for r, d in own.items() if r != first and d["reason"] == own[first]["reason"])
    noted = own[first].get("noted")
    text = f"{trace.label(first)} raised {message}"
    text += (" (its dump could not be written: this is its failure note in RUN_DIR/attempts; "
             "the traceback is in the run's output)" if noted
             else f" at step {own[first].get('step')}")
    if same:
        text += f"; {', '.join(trace.label(r) for r in same)} raised the same"
    others = sorted(r for r in errors if r not in own)
    if others:
        text += (f"; {', '.join(trace.label(r) for r in others)} then failed because a peer "
                 "was gone")
    end = "." if noted else " (the traceback is in the evidence's dump)."
    return Ending("exception", text + end, [first, *same])


def _noted_errors(trace: Trace) -> dict[int, dict[str, Any]]:
    """rank -> a dump-like record ('reason', 'time', 'noted') of each rank with no readable
    dump whose failure note (checkpoint/restart.py `note_failure`, written with restarts) names
    a Python error: a rank whose dump failed (a full disk, an unwritable trace folder) did
    raise; without this it read as no exception at all."""
    from meshtron.checkpoint.restart import failure_notes

    return {note["rank"]: {"reason": f"exception: {note['cause']}", "time": note["time"],
                           "noted": True}
            for note in failure_notes(trace.run_dir, trace.world_size, trace.attempt)
            if note.get("kind") == "exception" and note.get("rank") not in trace.dumps}


def _message(dump: dict[str, Any]) -> str:
    """The first line of a dump's exception ('RuntimeError: ...'), at most 300 characters."""
    message = dump["reason"].removeprefix("exception:").strip().splitlines()[0]
    return message if len(message) <= 300 else message[:297] + "..."


def _lost_connections(trace: Trace, errors: dict[int, dict[str, Any]]) -> Ending:
    """Every rank that raised lost a connection to a peer: the cause is a rank that ended
    without a Python error, named when torchrun's agent saw it killed by a signal; else the
    verdict says that no rank names one (a lost connection is never presented as the cause)."""
    first = min(errors, key=lambda r: errors[r]["time"])
    lost = ", ".join(trace.label(r) for r in sorted(errors))
    seen = f"{lost} then failed because a peer was gone ({_message(errors[first])})"
    killed = {r: how for r in range(trace.world_size) if r not in errors
              and (how := killed_by(trace, r)) and how.startswith("killed by")}
    if killed:
        names = "; ".join(f"{trace.label(r)} ({how})" for r, how in sorted(killed.items()))
        last = {r: trace.dumps[r].get("reason", "").split(":")[0] for r in killed
                if r in trace.dumps}
        after = "".join(f"; rank {r}'s last dump was its {why} dump" for r, why in last.items())
        return Ending("dead_rank", f"{names} died without a Python error{after}; {seen}; "
                      f"{_checkpoint_text(trace)}.", sorted(killed))
    return Ending("exception", "every error is a lost connection; no rank names a cause: "
                  f"{seen}, and no rank left a Python error or was seen killed by a signal "
                  "(a peer on another host, or one killed without torchrun's agent seeing it; "
                  "its host's logs, e.g. the kernel's OOM killer, may say why).", [])
