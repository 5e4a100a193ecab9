"""From a run's dumps to one verdict: align every group's operations by sequence number, find
the first divergence in time, and classify it.

Kinds, in the order they are looked for:
- `frozen_rank` / `dead_rank`: a rank left no dump. Its peers' dumps say whether its process
  was stopped (SIGSTOP, a debugger) or gone (/proc, same host), or, across hosts, whether they
  failed with a broken connection (dead) or timed out waiting (frozen).
- `mismatched_op`, `mismatched_shape` (dtype too), `never_entered`: the first (group, sequence
  number) where the members' records disagree: a different operation, different shapes or
  dtypes, or members that never issued it. Point-to-point operations align the k-th send from A
  to B with the k-th receive on B from A. Culprits are the minority (ties: the higher ranks).
- `straggler`: no divergence, but one rank reaches the collectives late: for every collective
  all members recorded, each member's lateness after the earliest member (the time the others
  waited for it; `_straggler`), less, step by step, the time it waited for a CPU more than the
  other ranks (the host's load, from each rank's run-queue wait less its own other threads'
  CPU time); a rank whose remaining
  lateness is at least `STRAGGLER_FRACTION` of the time span compared (and `STRAGGLER_MIN_S`)
  and 3x any other's.
- `preempted` (every rank stopped by SIGTERM together, or a committed preemption checkpoint),
  `dead_rank` after a stale SIGTERM dump, and `exception` (the earliest error a rank raised,
  when the ranks agree on every collective): how the run ended (meshtron/diagnose/endings.py).
- `no_dump`: no rank has dumped (killed from outside, or the run is still going).
- `none`: nothing of the above.
"""

from __future__ import annotations

import bisect
import socket
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from meshtron.diagnose import endings
from meshtron.diagnose.trace import Trace, frame_text
from meshtron.doctor.dump import process_state

KINDS = ("never_entered", "mismatched_op", "mismatched_shape", "dead_rank", "frozen_rank",
         "preempted", "exception", "straggler", "no_dump", "none")
STRAGGLER_MIN_S = 0.02
STRAGGLER_FRACTION = 0.1
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
def _collectives(trace: Trace) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    """group -> rank -> seq -> record (collectives only)."""
    out: dict[str, dict[int, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for rank, d in trace.dumps.items():
        for rec in d.get("records", []):
            if "peer" not in rec:
                out[rec["group"]][rank][rec["seq"]] = rec
    return out


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
    found = [d for group, by_rank in _collectives(trace).items()
             if (d := _first_collective_divergence(trace, group, by_rank)) is not None]
    found += _p2p_divergences(trace)
    return min(found, key=lambda d: d["t"]) if found else None


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
    missing = [r for r in range(trace.world_size) if r not in trace.dumps]
    if not missing or not trace.dumps:
        return None
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
    """The rank the others wait for, beyond what the host's CPU load explains.

    For every collective all members recorded (after the start-up step), each member's
    lateness is its entry time after the earliest member's; a collective cannot finish before
    its last member enters, so a rank's summed lateness is the time the others spent waiting
    for it. A sum, not a per-collective median: a rank late by a lot in one step of three has a
    median lateness of 0 but costs its peers as much as one late every time.

    The sum alone also counts the host's noise: with more runnable processes than cores, each
    rank waits for a CPU now and then, and which rank shares a core for a while is chance;
    healthy 2-rank runs under CPU load had one rank up to 61% of the span late and up to 16x
    its peer (measured, session 43), later than a rank SIGSTOPped 30% of the time. Timing alone
    cannot tell them apart; the kernel can: each rank records, per step, how long its training
    thread was runnable but waiting for a CPU (doctor/dump.py `run_queue_wait_s`, Linux
    schedstat), and a stopped, sleeping or blocked rank (SIGSTOP, a data loader, a GPU it waits
    for) is not waiting for a CPU. A rank can make its training thread wait for a CPU itself
    (a thread of its own computing beside it: a checkpoint writer, a data loader): only the
    wait beyond the CPU time its process's other threads had meanwhile is the host's
    (`_host_wait`). So in each step a rank's lateness only counts past that wait beyond the
    least any rank's in that step (`_stalls`): what is left is a stall of the rank's own. Then, as Megatron-LM's StragglerDetector does (NVIDIA/Megatron-LM
    megatron/core/utils.py, commit 22e030e, `_min_max`: each rank's timed section against the
    other ranks', slowest and fastest named) and nvidia-resiliency-ext's relative performance
    score (docs straggler_det/usage_guide: a rank's section time against the best rank's), the
    rank is compared with the others: what the correction leaves on a healthy run is about the
    same on every rank (each waits for the other), a stall is not. A straggler: its stalls are
    at least `STRAGGLER_FRACTION` of the time the compared collectives span (and
    `STRAGGLER_MIN_S`) and 3x any other rank's."""
    lates, last, total, span = _lateness(trace)
    if not total or len(lates) < 2:
        return None
    stalls = _stalls(trace, lates)
    worst = max(stalls, key=stalls.get)
    others = [v for r, v in stalls.items() if r != worst]
    floor = max(STRAGGLER_MIN_S, STRAGGLER_FRACTION * span)
    if stalls[worst] < floor or stalls[worst] < 3 * max(others, default=0.0):
        return None
    waited = {r: sum(x for _, x in v) for r, v in lates.items()}
    mean_ms = 1e3 * waited[worst] / len(lates[worst])
    text = (f"{trace.label(worst)} is a straggler: the other ranks waited for it "
            f"{waited[worst]:.3f} s in total, {100 * waited[worst] / span:.0f}% of the "
            f"{span:.3f} s the compared collectives span (a mean {mean_ms:.1f} ms per "
            f"collective; last in {last[worst]} of {total}); {stalls[worst]:.3f} s of it "
            f"({100 * stalls[worst] / span:.0f}%) its own stalls, not time it waited for a "
            f"CPU more than the other ranks")
    step = _median_step(trace)
    if step:
        text += f"; median step time {step:.3f} s"
    return Diagnosis("straggler", text + ".", [worst],
                     [f"rank {r}: others waited {waited[r]:.3f} s for it (mean "
                      f"{1e3 * waited[r] / len(lates[r]):.1f} ms over {len(lates[r])} "
                      f"collectives; {stalls[r]:.3f} s of its own stalls)"
                      for r in sorted(lates)])


def _stalls(trace: Trace, lates: dict[int, list[tuple[float, float]]]) -> dict[int, float]:
    """rank -> its summed lateness less, step by step, its CPU run-queue wait in excess of the
    least any rank waited in that step (the host's load on this rank more than on the others).
    Lateness outside the steps with a run-queue reading (dumps without one: another OS, an
    older meshtron) counts whole."""
    windows = _queue_windows(trace)
    out = {}
    for rank, entries in lates.items():
        steps = sorted(windows.get(rank, {}).items(), key=lambda kv: kv[1][1])
        ends = [end for _, (_, end, _) in steps]
        late_in: dict[int, float] = defaultdict(float)
        whole = 0.0
        for t, late in entries:
            i = bisect.bisect_left(ends, t)  # the first step ending at or after t
            if i < len(steps) and steps[i][1][0] < t:
                late_in[steps[i][0]] += late
            else:
                whole += late
        out[rank] = whole + sum(max(0.0, late - windows[rank][k][2])
                                for k, late in late_in.items())
    return out


def _queue_windows(trace: Trace) -> dict[int, dict[int, tuple[float, float, float]]]:
    """rank -> step -> (start, end, its run-queue wait in that step beyond the least of any
    rank in the same step), over the steps every rank has a run-queue reading for."""
    waits: dict[int, dict[int, tuple[float, float, float]]] = {}
    for rank, d in trace.dumps.items():
        beats = [st for st in d.get("step_times", []) if st.get("run_queue_s") is not None]
        waits[rank] = {b["step"]: (a["end_t"], b["end_t"], _host_wait(a, b))
                       for a, b in zip(beats, beats[1:]) if b["step"] == a["step"] + 1}
    common = set.intersection(*(set(w) for w in waits.values())) if waits else set()
    least = {k: min(w[k][2] for w in waits.values()) for k in common}
    return {rank: {k: (w[k][0], w[k][1], w[k][2] - least[k]) for k in common}
            for rank, w in waits.items()}


def _host_wait(before: dict, after: dict) -> float:
    """The run-queue wait between two beats that other processes caused, at least: less the CPU
    time the rank's own other threads had meanwhile (a thread can only have waited for its own
    process's threads while they ran: a rank starving its training thread with its own work, a
    checkpoint writer, a data-loading thread, is its own stall, not the host's load). Beats
    without that reading (dumps of an older meshtron) count their whole wait."""
    wait = after["run_queue_s"] - before["run_queue_s"]
    if after.get("other_threads_cpu_s") is None or before.get("other_threads_cpu_s") is None:
        return wait
    return max(0.0, wait - (after["other_threads_cpu_s"] - before["other_threads_cpu_s"]))


def _lateness(trace: Trace):
    """(rank -> (its entry time, its lateness) in each collective compared, rank -> times
    last, number of collectives, seconds they span), over the collectives every member of their
    group recorded, after the start-up step (first compilations and all-gathers are not a
    straggler's) and up to the end of the last step every rank finished (the run's end: a
    final evaluation, a checkpoint, plots on rank 0, is not a step either)."""
    warm, done = _start_up_end(trace), _steps_end(trace)
    lates: dict[int, list[tuple[float, float]]] = defaultdict(list)
    last: Counter = Counter()
    total, lo, hi = 0, float("inf"), float("-inf")
    for group, by_rank in _collectives(trace).items():
        members = trace.group_ranks(group)
        if len(members) < 2 or any(r not in by_rank for r in members):
            continue
        common = set.intersection(*(set(by_rank[r]) for r in members))
        for seq in common:
            times = {r: by_rank[r][seq]["enqueue_t"] for r in members}
            first = min(times.values())
            if not warm <= first <= done:
                continue
            for r, t in times.items():
                lates[r].append((t, t - first))
            last[max(times, key=times.get)] += 1
            total += 1
            lo, hi = min(lo, first), max(hi, max(times.values()))
    return lates, last, total, max(hi - lo, 0.0)


def _start_up_end(trace: Trace) -> float:
    """When every rank had finished its first step (-inf when the dumps carry no step times)."""
    ends = [st["end_t"] for d in trace.dumps.values() for st in d.get("step_times", [])
            if st["step"] == 1]
    return max(ends) if len(ends) == len(trace.dumps) else float("-inf")


def _steps_end(trace: Trace) -> float:
    """When the last step every rank finished ended (inf when the dumps carry no step times)."""
    last = [max(st["end_t"] for st in d["step_times"]) if d.get("step_times") else None
            for d in trace.dumps.values()]
    return float("inf") if None in last else min(last)


def _median_step(trace: Trace) -> float | None:
    times = [st["seconds"] for d in trace.dumps.values() for st in d.get("step_times", [])
             if st["step"] > 1]
    if times:
        return statistics.median(times)
    steady = [m["step_time_s"] for m in trace.metrics if m.get("step", 0) > 1
              and m.get("step_time_s")]
    return statistics.median(steady) if steady else None


def diagnose(trace: Trace) -> Diagnosis:
    """The verdict for a run's trace, with its evidence."""
    if not trace.dumps:
        diagnosis = _no_dumps(trace)
        diagnosis.evidence = evidence(trace)
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
    if live:
        pids = " ".join(str(p) for p in live.values())
        text = (f"no rank has dumped: the run is still going ({_ranks_text(list(live))} "
                f"running); `kill -USR1 {pids}` makes them dump, then run doctor again.")
    elif any("interrupted_t" in h for h in trace.hellos.values()):
        stopped = sorted(r for r, h in trace.hellos.items() if "interrupted_t" in h)
        text = (f"no rank has dumped: the run was interrupted (SIGINT, e.g. Ctrl-C; "
                f"{_ranks_text(stopped)} left at once, as asked); there is nothing to compare "
                "(`kill -USR1 <pid>` dumps the ranks of a live run, a hang included).")
    else:
        text = ("no rank has dumped: the ranks ended without a dump (killed from outside, e.g. "
                "SIGKILL of the launcher or of every rank); there is nothing to compare "
                "(`kill -USR1 <pid>` dumps the ranks of a live run).")
    return Diagnosis("no_dump", text, [])


def _nothing(trace: Trace) -> Diagnosis:
    reasons = Counter(d["reason"].split(":")[0] for d in trace.dumps.values())
    if "watchdog" in reasons:
        return Diagnosis("none", "every rank stopped in the same operations: no rank is behind "
                         "or issued anything different (a hang inside the transport itself, "
                         "or a step longer than the watchdog timeout).", [])
    if any(r.startswith("exception") for r in reasons):
        return Diagnosis("none", "the ranks agree on every collective they issued; the run "
                         "failed with an exception (see the evidence).", [])
    return Diagnosis("none", "no divergence and no straggler: every rank issued the same "
                     "collectives in the same order.", [])


def evidence(trace: Trace) -> list[str]:
    """One line per rank: why it dumped, its step, its last operation, where it is."""
    lines = []
    if trace.abort:
        lines.append(f"watchdog: rank {trace.abort.get('rank')} saw no progress for "
                     f"{trace.abort.get('limit_s')} s at step {trace.abort.get('step')}")
    for r in range(trace.world_size):
        d = trace.dumps.get(r)
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
