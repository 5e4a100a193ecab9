"""From a run's dumps to one verdict: align every group's operations by sequence number, find
the first divergence in time, and classify it.

Kinds, in the order they are looked for:
- `never_joined`: a rank left no hello file while the others were still joining the process
  group (its process never reached meshtron's start: stopped, stuck, or never spawned).
- `frozen_rank` / `dead_rank`: a rank left no dump. Its peers' dumps say whether its process
  was stopped (SIGSTOP, a debugger) or gone (/proc, same host), or, across hosts, whether they
  failed with a broken connection (dead) or timed out waiting (frozen).
- `mismatched_op`, `mismatched_shape` (dtype too), `never_entered`: the first (group, sequence
  number) where the members' records disagree: a different operation, different shapes or
  dtypes, or members that never issued it. Point-to-point operations align the k-th send from A
  to B with the k-th receive on B from A. Culprits are the minority (ties: the higher ranks).
- `straggler`: no divergence, but one rank reaches the collectives late (the others wait for
  it) by more than the host's CPU load explains, and 3x any other rank (straggler.py).
- `preempted` (every rank stopped by SIGTERM together, or a committed preemption checkpoint),
  `dead_rank` after a stale SIGTERM dump, and `exception` (the earliest error a rank raised,
  when the ranks agree on every collective): how the run ended (meshtron/diagnose/endings.py).
- `no_dump`: no rank has dumped (killed from outside, or the run is still going).
- `none`: nothing of the above.
"""

from __future__ import annotations

import socket
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from meshtron.diagnose import endings, straggler
from meshtron.diagnose.trace import Trace, frame_text
from meshtron.doctor.dump import FIRST_STEP_FLOOR_S, process_state

KINDS = ("never_entered", "mismatched_op", "mismatched_shape", "never_joined", "dead_rank",
         "frozen_rank", "preempted", "exception", "straggler", "no_dump", "none")
_BROKEN = ("connection closed", "connection reset", "broken pipe", "connection refused",
           "remote process exited", "peer")


@dataclass
class Diagnosis:
    kind: str
    verdict: str
    culprit_ranks: list[int]
    evidence: list[str] = field(default_factory=list)
    divergence: dict[str, Any] | None = None
    hang_to_dump_s: float | None = None
    """Seconds from the last progress of any rank to the last dump (watchdog runs)."""

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "kind": self.kind, "culprit_ranks": self.culprit_ranks,
                "evidence": self.evidence, "divergence": self.divergence,
                "hang_to_dump_s": self.hang_to_dump_s}


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _op_text(rec: dict[str, Any]) -> str:
    return f"{rec['op']} #{rec['seq']}"


def _sig(rec: dict[str, Any]) -> str:
    return ", ".join(f"{s} {d}" for s, d in zip(rec["shapes"], rec["dtypes"])) or "no tensors"


# -- loading records ---------------------------------------------------------------------------
def _p2p(trace: Trace) -> dict[tuple, dict[int, dict[str, Any]]]:
    """(group, op, this rank, peer) -> seq -> record."""
    out: dict[tuple, dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank, d in trace.dumps.items():
        for rec in d.get("records", []):
            if "peer" in rec:
                out[(rec["group"], rec["op"], rank, rec["peer"])][rec["seq"]] = rec
    return out


# -- divergences -------------------------------------------------------------------------------
def _first_collective_divergence(trace: Trace, group: str, by_rank) -> dict[str, Any] | None:
    members = [r for r in trace.group_ranks(group) if r in trace.dumps]
    if len(members) < 2:
        return None
    spans = {r: (min(by_rank[r]), max(by_rank[r])) if by_rank.get(r) else (None, 0)
             for r in members}
    lows = [lo for lo, _ in spans.values() if lo is not None]
    if not lows:
        return None
    start, end = max(lows), max(hi for _, hi in spans.values())
    for seq in range(start, end + 1):
        present = {r: by_rank[r][seq] for r in members if seq in by_rank.get(r, {})}
        if not present:
            continue
        ops = Counter(rec["op"] for rec in present.values())
        if len(ops) > 1:
            return _mismatch("mismatched_op", group, seq, present, lambda rec: rec["op"])
        sigs = Counter(_sig(rec) for rec in present.values())
        # all-to-all may split unevenly: its members' shapes legitimately differ.
        if len(sigs) > 1 and not next(iter(ops)).startswith("all_to_all"):
            return _mismatch("mismatched_shape", group, seq, present, _sig)
        absent = [r for r in members if r not in present and spans[r][1] < seq]
        if absent:
            waiting = {r: rec for r, rec in present.items() if rec["state"] != "completed"}
            return {"kind": "never_entered", "group": group, "seq": seq, "culprits": absent,
                    "records": present, "waiting": waiting or present,
                    "t": min(rec["enqueue_t"] for rec in present.values())}
    return None


def _mismatch(kind: str, group: str, seq: int, present, key) -> dict[str, Any]:
    counts = Counter(key(rec) for rec in present.values())
    top = max(counts.values())
    majority = [k for k, c in counts.items() if c == top]
    # Ties: the value of the lowest rank counts as the expected one.
    expected = majority[0] if len(majority) == 1 else key(present[min(present)])
    culprits = sorted(r for r, rec in present.items() if key(rec) != expected)
    return {"kind": kind, "group": group, "seq": seq, "culprits": culprits, "records": present,
            "expected": expected, "t": min(rec["enqueue_t"] for rec in present.values())}


def _p2p_divergences(trace: Trace) -> list[dict[str, Any]]:
    table = _p2p(trace)
    out = []
    for (group, op, rank, peer), recs in table.items():
        if peer not in trace.dumps:
            continue
        other = table.get((group, "recv" if op == "send" else "send", peer, rank), {})
        other_max = max(other) if other else 0
        for seq in sorted(recs):
            rec = recs[seq]
            if seq in other:
                if _sig(rec) != _sig(other[seq]) and op == "send":
                    out.append({"kind": "mismatched_shape", "group": group, "seq": seq,
                                "culprits": sorted({rank, peer}), "t": rec["enqueue_t"],
                                "records": {rank: rec, peer: other[seq]}, "p2p": True})
                    break
            elif seq > other_max and rec["state"] != "completed":
                out.append({"kind": "never_entered", "group": group, "seq": seq,
                            "culprits": [peer], "t": rec["enqueue_t"], "records": {rank: rec},
                            "waiting": {rank: rec}, "p2p": True})
                break
    return out


def find_divergence(trace: Trace) -> dict[str, Any] | None:
    """The earliest divergence over all groups, or None."""
    found = [d for group, by_rank in trace.collectives().items()
             if (d := _first_collective_divergence(trace, group, by_rank)) is not None]
    found += _p2p_divergences(trace)
    found = [d for d in found if d["kind"] != "never_entered" or not _caught_running(trace, d)]
    return min(found, key=lambda d: d["t"]) if found else None


def _caught_running(trace: Trace, d: dict[str, Any]) -> bool:
    """A `never_entered` whose culprits were dumped on demand (SIGUSR1) no later after the
    operation began than a step lasts: ranks signalled together dump while running, one has
    issued the next operation and the other not yet. In a run that makes progress, no rank is
    behind a peer by more than the step they are both in (every step ends with collectives of
    all of them), so a lag within the longest step recorded is where the signal found them;
    the `preempted` rule reads SIGTERM dumps the same way. A watchdog's or an exception's
    dump is no such snapshot: the run had stopped."""
    culprits = [trace.dumps[r] for r in d["culprits"] if r in trace.dumps]
    if not culprits or any(c.get("reason") != "SIGUSR1" for c in culprits):
        return False
    return min(c["time"] for c in culprits) - d["t"] <= step_bound_s(trace)


def step_bound_s(trace: Trace) -> float:
    """The longest step any dump recorded; before the first step, the watchdog's first-step
    limit (the time meshtron allows start-up, FIRST_STEP_FLOOR_S without a watchdog)."""
    steps = [s["seconds"] for d in trace.dumps.values() for s in d.get("step_times", [])
             if s.get("seconds") is not None]
    if steps:
        return max(steps)
    limits = [(d.get("watchdog") or {}).get("first_step_timeout_s")
              for d in trace.dumps.values()]
    return max([x for x in limits if x] or [FIRST_STEP_FLOOR_S])


# -- verdicts ----------------------------------------------------------------------------------
def _waited(trace: Trace, waiting: dict[int, dict[str, Any]]) -> tuple[int, float] | None:
    best = None
    for r, rec in waiting.items():
        if rec.get("state") == "completed":
            continue
        s = (rec.get("end_t") or trace.dumps[r]["time"]) - rec["enqueue_t"]
        if best is None or s > best[1]:
            best = (r, s)
    return best


def _never_entered(trace: Trace, d: dict[str, Any]) -> Diagnosis:
    culprits = d["culprits"]
    rec = next(iter(d["records"].values()))
    if d.get("p2p"):
        sender = next(iter(d["records"]))
        peer_op = "recv" if rec["op"] == "send" else "send"
        what = f"the {peer_op} matching rank {sender}'s {rec['op']} #{d['seq']}"
    else:
        what = _op_text(rec)
    text = (f"{'; '.join(trace.label(r) for r in culprits)} never entered {what} on "
            f"{trace.group_label(d['group'])}")
    for r in culprits:
        where = trace.where(r)
        if where:
            text += f"; {'it' if len(culprits) == 1 else f'rank {r}'} is at {where}"
    wait = _waited(trace, d["waiting"])
    if wait:
        text += f"; rank {wait[0]} has waited {wait[1]:.1f} s"
    return Diagnosis("never_entered", text + ".", culprits, divergence=_public(d))


def _issued_at(stack: list[str]) -> str | None:
    """'file.py:12 in fn' of a record's stack (innermost first), outside torch."""
    frames = []
    for entry in reversed(stack):
        place, _, function = entry.partition(" in ")
        file, _, line = place.rpartition(":")
        frames.append({"file": file, "line": int(line or 0), "function": function})
    return frame_text(frames) if frames else None


def _mismatch_verdict(trace: Trace, d: dict[str, Any]) -> Diagnosis:
    culprits = d["culprits"]
    recs = d["records"]
    others = sorted(r for r in recs if r not in culprits)
    bad = recs[culprits[0]]
    good = recs[others[0]] if others else bad
    names = "; ".join(trace.label(r) for r in culprits)
    group = trace.group_label(d["group"])
    if d["kind"] == "mismatched_op":
        text = (f"{names} issued {bad['op']} #{d['seq']} on {group} where "
                f"{_ranks_text(others)} issued {good['op']} #{d['seq']}")
    else:
        text = (f"{names} issued {bad['op']} #{d['seq']} on {group} with {_sig(bad)} where "
                f"{_ranks_text(others)} used {_sig(good)}")
    where = _issued_at(bad.get("stack") or [])
    if where:
        text += f"; it was issued at {where}"
    return Diagnosis(d["kind"], text + ".", culprits, divergence=_public(d))


def _public(d: dict[str, Any]) -> dict[str, Any]:
    return {"kind": d["kind"], "group": d["group"], "seq": d["seq"], "culprits": d["culprits"],
            "ops": {str(r): {"op": rec["op"], "shapes": rec["shapes"], "dtypes": rec["dtypes"],
                             "state": rec["state"]} for r, rec in d["records"].items()}}


def _missing_ranks(trace: Trace) -> Diagnosis | None:
    unreadable = trace.unreadable_ranks()  # they dumped: not missing
    missing = [r for r in range(trace.world_size)
               if r not in trace.dumps and r not in unreadable]
    if not missing or not trace.dumps:
        return None
    joining = endings.never_joined(trace, missing)
    if joining is not None:
        return Diagnosis(*joining)
    states: dict[int, str] = {}
    for r in missing:
        seen = [d.get("peers", {}).get(str(r), {}).get("state") for d in trace.dumps.values()]
        if "stopped" in seen:
            states[r] = "stopped"
        elif "gone" in seen or "never_started" in seen and r not in trace.hellos:
            states[r] = "gone"
        else:
            broken = any(_is_broken(d) for d in trace.dumps.values())
            states[r] = "gone" if broken else "unresponsive"
    dead = [r for r in missing if states[r] == "gone"]
    frozen = [r for r in missing if r not in dead]
    kind, culprits = ("dead_rank", dead) if dead else ("frozen_rank", frozen)
    names = "; ".join(trace.label(r) for r in culprits)
    if kind == "dead_rank":
        text = (f"{names} died (its process is gone and it left no dump"
                f"{endings.dead_rank_details(trace, culprits)})")
    elif all(states[r] == "stopped" for r in culprits):
        text = f"{names} is frozen (its process is stopped, e.g. by SIGSTOP, and could not dump)"
    else:
        text = f"{names} is frozen (it did not answer the watchdog and left no dump)"
    wait = _waiting_for(trace, culprits)
    if wait:
        r, rec, secs = wait
        text += (f"; rank {r} waited {secs:.1f} s for it in {_op_text(rec)} on "
                 f"{trace.group_label(rec['group'])}")
        if endings.sigterm_dump(trace.dumps[r]):  # measured to that dump, not to its end
            text += (" up to its SIGTERM dump and went on waiting after it: no preemption "
                     f"checkpoint could be written, {_ranks_text(culprits)} did not answer")
    if len(culprits) > 1:
        text = text.replace("its process is", "their processes are").replace(
            " is frozen", " are frozen").replace("it left", "they left").replace(
            "for it in", "for them in")
    # Each rank's reason (an exception's first line included) is in `evidence(trace)`.
    return Diagnosis(kind, text + ".", culprits, [])


def _is_broken(dump: dict[str, Any]) -> bool:
    text = (dump.get("reason", "") + " " + (dump.get("exception") or "")).lower()
    return dump.get("reason", "").startswith("exception") and any(b in text for b in _BROKEN)


def _waiting_for(trace: Trace, culprits: list[int]):
    """(rank, record, seconds): the longest any dumped rank waited in an unfinished operation
    of a group that contains a culprit."""
    best = None
    for r, d in trace.dumps.items():
        for rec in reversed(d.get("records", [])):
            ranks = trace.group_ranks(rec["group"])
            if rec["state"] == "completed" or not any(c in ranks for c in culprits):
                continue
            secs = d["time"] - rec["enqueue_t"]
            if best is None or secs > best[2]:
                best = (r, rec, secs)
            break
    return best


def _straggler(trace: Trace) -> Diagnosis | None:
    """The rank the others wait for, beyond what the host's CPU load explains (straggler.py)."""
    found = straggler.find(trace)
    if found is None:
        return None
    return Diagnosis("straggler", found.verdict, [found.rank], found.evidence)


def diagnose(trace: Trace) -> Diagnosis:
    """The verdict for a run's trace, with its evidence."""
    if not trace.dumps:  # a failure note may still name the error (no dump on a full disk)
        diagnosis = _ending(endings.raised(trace)) or _no_dumps(trace)
        diagnosis.evidence = diagnosis.evidence + evidence(trace)
        return diagnosis
    diagnosis = (_ending(endings.died_after_dump(trace)) or _missing_ranks(trace)
                 or _ending(endings.preempted(trace)))
    if diagnosis is None:
        d = find_divergence(trace)
        if d is not None:
            diagnosis = (_never_entered(trace, d) if d["kind"] == "never_entered"
                         else _mismatch_verdict(trace, d))
        else:
            diagnosis = (_ending(endings.raised(trace)) or _straggler(trace)
                         or _nothing(trace))
    diagnosis.evidence = diagnosis.evidence + evidence(trace)
    if trace.abort and trace.dumps:
        diagnosis.hang_to_dump_s = (max(d["time"] for d in trace.dumps.values())
                                    - max(d["last_progress_t"] for d in trace.dumps.values()))
    return diagnosis


def _ending(found: endings.Ending | None) -> Diagnosis | None:
    return None if found is None else Diagnosis(*found)


def _no_dumps(trace: Trace) -> Diagnosis:
    """Only hello files: nothing to compare. Either the ranks still run (a dump on demand:
    SIGUSR1) or they ended without dumping (SIGKILL of the launcher or of every rank)."""
    host = socket.gethostname()
    live = {r: h["pid"] for r, h in sorted(trace.hellos.items())
            if h.get("host") == host and process_state(h["pid"]) in ("running", "stopped")}
    if trace.unreadable_ranks():
        return _only_unreadable(trace)
    if live:
        pids = " ".join(str(p) for p in live.values())
        text = (f"no rank has dumped: the run is still going ({_ranks_text(list(live))} "
                f"running); `kill -USR1 {pids}` makes them dump, then run doctor again.")
        absent = [r for r in range(trace.world_size) if r not in trace.hellos]
        if absent:  # the others then wait for them in the rendezvous
            text += (f" {_ranks_text(absent).capitalize()} wrote no hello file: not started "
                     "yet, or stopped or stuck before meshtron's start.")
    elif any("interrupted_t" in h for h in trace.hellos.values()):
        stopped = sorted(r for r, h in trace.hellos.items() if "interrupted_t" in h)
        text = (f"no rank has dumped: the run was interrupted (SIGINT, e.g. Ctrl-C; "
                f"{_ranks_text(stopped)} left at once, as asked); there is nothing to compare "
                "(`kill -USR1 <pid>` dumps the ranks of a live run, a hang included).")
    elif not trace.hellos:
        seen = [f"rank {r} {how}" for r in range(trace.world_size)
                if (how := endings.killed_by(trace, r))]
        text = ("no rank has dumped: no rank reached meshtron's start (no hello file in "
                "trace/; stopped, stuck before it, or never spawned)"
                + (f"; torchrun's agent saw {', '.join(seen)}" if seen else "")
                + "; there is nothing to compare.")
    elif (killed := endings.killed_without_dumps(trace)) is not None:
        return Diagnosis(*killed)
    else:
        text = ("no rank has dumped: the ranks ended without a dump (killed from outside, e.g. "
                "SIGKILL of the launcher or of every rank); there is nothing to compare "
                "(`kill -USR1 <pid>` dumps the ranks of a live run).")
    return Diagnosis("no_dump", text, [])


def _only_unreadable(trace: Trace) -> Diagnosis:
    """Dumps were written but none can be read: say so, and what ABORT.json still says."""
    files = ", ".join(f"trace/{n} ({why})" for n, why in trace.unreadable.items())
    text = f"no readable dump: {files}"
    if trace.abort:
        text += (f"; the watchdog fired (rank {trace.abort.get('rank')} saw no progress for "
                 f"{trace.abort.get('limit_s')} s at step {trace.abort.get('step')})")
    silent = [r for r in range(trace.world_size) if r not in trace.unreadable_ranks()]
    if silent:
        text += f"; {_ranks_text(silent)} left no dump"
    return Diagnosis("no_dump", text + "; there is nothing to compare.", [])


def _nothing(trace: Trace) -> Diagnosis:
    reasons = Counter(d["reason"].split(":")[0] for d in trace.dumps.values())
    if "watchdog" in reasons:
        return Diagnosis("none", "every rank stopped in the same operations: no rank is behind "
                         "or issued anything different (a hang inside the transport itself, "
                         "or a step longer than the watchdog timeout).", [])
    if any(r.startswith("exception") for r in reasons):
        return Diagnosis("none", "the ranks agree on every collective they issued; the run "
                         "failed with an exception (see the evidence).", [])
    if set(reasons) == {"SIGUSR1"}:
        return Diagnosis("none", "dumped on demand (SIGUSR1) while running: no rank is behind "
                         f"a peer by more than the longest step ({step_bound_s(trace):.1f} s) "
                         "and none issued anything different; where each rank was is in the "
                         "evidence.", [])
    return Diagnosis("none", "no divergence and no straggler: every rank issued the same "
                     "collectives in the same order.", [])


def evidence(trace: Trace) -> list[str]:
    """One line per rank: why it dumped, its step, its last operation, where it is."""
    lines = []
    if trace.abort:
        lines.append(f"watchdog: rank {trace.abort.get('rank')} saw no progress for "
                     f"{trace.abort.get('limit_s')} s at step {trace.abort.get('step')}")
    for name, why in trace.unreadable.items():
        lines.append(f"trace/{name}: unreadable, {why}")
    for r in range(trace.world_size):
        d = trace.dumps.get(r)
        if d is None and r in trace.unreadable_ranks():
            lines.append(f"{trace.label(r)}: dump unreadable (see above)")
            continue
        if d is None:
            how = ("; interrupted (SIGINT)" if "interrupted_t" in trace.hellos.get(r, {})
                   else "")
            lines.append(f"{trace.label(r)}: no dump{how}")
            continue
        recs = d.get("records", [])
        last = recs[-1] if recs else None
        op = (f"; last {_op_text(last)} on {trace.group_label(last['group'])} ({last['state']})"
              if last else "")
        where = trace.where(r)
        reason = d["reason"].splitlines()[0]
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        lines.append(f"{trace.label(r)}: {reason} at step {d.get('step')}{op}"
                     + (f"; at {where}" if where else ""))
    return lines
