"""The straggler rule of `meshtron doctor`: the rank the others wait for, beyond what the host's
CPU load explains (analyze.py asks `find` when the ranks' records agree).

Lateness. For every collective all members recorded (after the start-up step, up to the last
step every rank finished; none while a rank has finished no step: `_compared_window`), each
member's lateness is its entry time after the earliest member's; a collective cannot finish
before its last member enters, so a rank's summed lateness is the time the others spent
waiting for it. A sum, not a per-collective median: a rank late by a lot in one step of
three has a median lateness of 0 but costs its peers as much as one late every time.

Host load. With more runnable threads than cores every rank waits for a CPU now and then, and
which rank shares a core for a while is chance: healthy 2-rank runs on a loaded 2-core host
had one rank late 53% of the span and 11x its peer (measured, session 44), later than ranks
SIGSTOPped 20% of the time were (29% of the span, 1.6x its peer, in one run). Each rank
records per step (doctor/session.py `beat`) its training thread's CPU time and run-queue wait
(one /proc/self/task/TID/schedstat read, doctor/dump.py `schedstat_s`), its process's other
threads' CPU time and, of it, gloo's transport threads', and the seconds its training thread
spent blocked in waits on collectives (the recorder's `blocked_s`).

Two rules, by what the dumps carry:

* Own time (every rank has all four readings for the steps compared): in each step a rank's
  lateness counts only up to the evidence that the rank itself held the step up (`_own_s`):
  the time its training thread was neither on a CPU, nor waiting for one, nor blocked in a
  collective (stopped by SIGSTOP, sleeping in a data loader, waiting for a lock or a disk:
  Linux counts none of these in schedstat, Documentation/scheduler/sched-stats.rst), plus
  the run-queue wait its own other threads can explain (their CPU time beyond the least any
  rank's other threads had in that step: a checkpoint writer or a CPU-bound loader thread
  beside the training thread), and only past its run-queue wait beyond the least rank's (the
  host's load on it more than on the others). Evidence, not the lateness less the host's
  share: that difference is the small remainder of two large noisy terms (run-queue wait up
  to 53% of the span), whose positive part summed to 16% of the span on a healthy rank.
  The other threads are counted without gloo's transport threads (`transport_cpu_s`,
  doctor/dump.py `TransportThreads`): their CPU time is the collectives' work, on every rank
  alike, and grows on the rank whose peer is late (the healthy peer of a rank SIGSTOPped 20%
  of the time: its other threads 4.0% of the span outside its waits, the stopped rank's
  0.6%). Instrumented (session 46): a healthy rank's training thread slept only in its
  collective waits (one voluntary switch per wait: no GIL or lock hand-off), its own time
  was the wait its other threads explained, and gloo's threads had 91-99% of the other threads' CPU time; counted with
  them, the step-to-step jitter of their work took a healthy rank beside two busy loops to
  2.3% of the span (named), and a stopped rank's peer to 1.9% (the stopped rank, at 3.1%,
  missed). Not the run's work between steps (`_run_work`: logging, evaluation, checkpoints,
  read at the step's start): rank 0 alone writes the records and commits a checkpoint's
  metadata, off a CPU, and its peers wait for it in the next collective, as the run asked
  (docs/measurements.md#straggler-run-work). Nor the checkpoint writers' work during a step
  (an async save's commit): their CPU time, and the training thread's time off a CPU that
  it explains (waits for the GIL they hold: `_Step.stalled`, measurements.md
  #straggler-ended-threads). Not every thread's run-queue wait: a SIGCONT wakes all of a
  stopped rank's threads into the run queue (113% vs 39% of the span): subtracting it hides
  the straggler. A stop while the rank is blocked in a collective delays both ranks alike
  and is not seen; lateness outside the steps with readings (the loss logged after the last
  beat) counts nothing. Not named by this rule: a rank slower only in its own computation
  (more CPU time for the same step: uneven batches, a slower core; on a loaded host equal
  steps' CPU time differed by up to 1.7% of the span by chance), and one slowed by its own
  transport threads.
* Timing (dumps without those readings: NCCL ranks, another OS, an older meshtron): the
  lateness less, step by step, the run-queue wait beyond the least rank's (less its own
  other threads' CPU time: `_host_wait`); lateness outside the steps with readings counts
  whole.

Then, as Megatron-LM's StragglerDetector does (NVIDIA/Megatron-LM megatron/core/utils.py,
commit 22e030e, `_min_max`: each rank's timed section against the other ranks', slowest and
fastest named) and nvidia-resiliency-ext's relative performance score (docs
straggler_det/usage_guide: a rank's section time against the best rank's), the rank is
compared with the others: a straggler's counted lateness is at least `STRAGGLER_MIN_S`, 3x any
other rank's, and a share of the time the compared collectives span: `OWN_FRACTION` with own
time (healthy ranks at most 0.7% over 19 runs beside 2 and 4 busy loops on a 2-core host
at load 8-19, ranks SIGSTOPped 20% of the time at least 4.8% over 6: docs/measurements.md
#straggler-load; 2% lies between), `STRAGGLER_FRACTION` on timing alone (its noise is
larger).
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

STRAGGLER_MIN_S = 0.02
STRAGGLER_FRACTION = 0.1
OWN_FRACTION = 0.02
_READINGS = ("run_queue_s", "cpu_s", "other_threads_cpu_s", "blocked_s")
_BACKGROUND = ("transport_cpu_s", "checkpoint_threads_cpu_s")
"""Other threads whose CPU time is not the rank's own: gloo's transport threads (the
collectives' work) and the checkpoint's background writers (doctor/dump.py
CHECKPOINT_THREADS: the run's work, rank 0's the larger; an async save's commit ran on rank 0
during the next step and made its training thread wait for a CPU, 0.016 s more than its
peer in one step of a healthy run named a straggler, session 52)."""


@dataclass
class Finding:
    rank: int
    verdict: str
    evidence: list[str]


@dataclass
class _Step:
    """One rank's step between two beats: its window and what it did in it (seconds)."""

    start: float
    end: float
    wait: float
    """Run-queue wait of the training thread."""
    host: float
    """`wait` less the CPU time of the rank's other threads (`_host_wait`)."""
    cpu: float | None = None
    others: float | None = None
    """CPU time of the rank's other threads, less gloo's transport threads' when recorded."""
    blocked: float | None = None
    work: float = 0.0
    """Seconds of the run's work (logging, evaluation, checkpoints) in the window, before the
    step started (`_run_work`); the readings above leave it out."""
    writers: float = 0.0
    """CPU time of the rank's checkpoint writer threads in the step (`_BACKGROUND`)."""

    @property
    def off(self) -> float:
        """Neither on a CPU, nor waiting for one, nor blocked in a collective, in the step."""
        return (self.end - self.start - self.work) - self.cpu - self.wait - self.blocked

    @property
    def stalled(self) -> float:
        """`off`, less what the checkpoint writers' CPU time can explain: their Python work
        (an async save's commit, its staging) holds the GIL, and the training thread waits
        for it asleep, off a CPU (Python's eval loop: a thread asks for the GIL after a
        5 ms switch interval, sys.getswitchinterval). Measured (session 53): a healthy
        2-rank run's rank 0 was 0.016 s off a CPU in the step its commit thread ran, its
        peer 0.002 s (docs/measurements.md#straggler-ended-threads). A SIGSTOP stops the
        writers too: a stopped rank's `off` is not explained away."""
        return max(0.0, self.off - self.writers)


def find(trace) -> Finding | None:
    """The straggler of a run whose ranks' records agree, or None."""
    lates, last, total, span = _lateness(trace)
    if not total or len(lates) < 2:
        return None
    steps = _steps(trace)
    own = bool(steps) and all(s.blocked is not None for w in steps.values() for s in w.values())
    counted = _counted(lates, steps, own)
    worst = max(counted, key=counted.get)
    others = [v for r, v in counted.items() if r != worst]
    floor = max(STRAGGLER_MIN_S, (OWN_FRACTION if own else STRAGGLER_FRACTION) * span)
    if counted[worst] < floor or counted[worst] < 3 * max(others, default=0.0):
        return None
    waited = {r: sum(x for _, x in v) for r, v in lates.items()}
    mean_ms = 1e3 * waited[worst] / len(lates[worst])
    why = ("while it was stopped or blocked outside the collectives, or behind its own "
           "threads" if own else "its own stalls, not time it waited for a CPU more than "
           "the other ranks")
    text = (f"{trace.label(worst)} is a straggler: the other ranks waited for it "
            f"{waited[worst]:.3f} s in total, {100 * waited[worst] / span:.0f}% of the "
            f"{span:.3f} s the compared collectives span (a mean {mean_ms:.1f} ms per "
            f"collective; the last rank to arrive at {last[worst]} of {total} collectives); {counted[worst]:.3f} s of it "
            f"({100 * counted[worst] / span:.0f}%) {why}")
    step = _median_step(trace)
    if step:
        text += f"; median step time {step:.3f} s"
    rule = "own time" if own else "timing"
    return Finding(worst, text + ".",
                   [f"rank {r}: others waited {waited[r]:.3f} s for it (mean "
                    f"{1e3 * waited[r] / len(lates[r]):.1f} ms over {len(lates[r])} "
                    f"collectives; {counted[r]:.3f} s of it counted, {rule} rule)"
                    for r in sorted(lates)])


def _counted(lates, steps: dict[int, dict[int, _Step]], own: bool) -> dict[int, float]:
    """rank -> its lateness that counts (module docstring): step by step, past its host wait
    beyond the least rank's, and with `own` up to its own time in the step (`_own_s`)."""
    least = {k: {f: min(getattr(w[k], f) for w in steps.values())
                 for f in (("host", "wait", "others") if own else ("host",))}
             for k in (set.intersection(*(set(w) for w in steps.values())) if steps else ())}
    out = {}
    for rank, entries in lates.items():
        mine = {k: steps[rank][k] for k in least}
        late_in, whole = _late_by_step(entries, mine)
        # Outside the steps with readings: no evidence of its own time, none counts (the
        # collectives after the last beat, e.g. the loss logged after the last step).
        total = 0.0 if own else whole
        for k, late in late_in.items():
            step = mine[k]
            past_host = max(0.0, late - (step.host - least[k]["host"]))
            total += min(past_host, _own_s(step, least[k])) if own else past_host
        out[rank] = total
    return out


def _own_s(step: _Step, least: dict[str, float]) -> float:
    """Seconds of the step the rank itself held up: off a CPU outside collectives, and the
    run-queue wait beyond the least rank's that its other threads' CPU time (gloo's transport
    threads apart) beyond the least rank's can explain (they held its CPU only while they ran)."""
    behind_own = min(step.wait - least["wait"], step.others - least["others"])
    return step.stalled + max(0.0, behind_own)


def _late_by_step(entries: list[tuple[float, float]], steps: dict[int, _Step]):
    """(step -> lateness entered in it, lateness outside every step window)."""
    order = sorted(steps.items(), key=lambda kv: kv[1].end)
    ends = [s.end for _, s in order]
    late_in: dict[int, float] = defaultdict(float)
    whole = 0.0
    for t, late in entries:
        i = bisect.bisect_left(ends, t)  # the first step ending at or after t
        if i < len(order) and order[i][1].start < t:
            late_in[order[i][0]] += late
        else:
            whole += late
    return late_in, whole


def _steps(trace) -> dict[int, dict[int, _Step]]:
    """rank -> step -> _Step, for consecutive beats with a run-queue reading; empty when a
    rank has none (its lateness then counts whole)."""
    beats = {rank: [b for b in d.get("step_times", []) if b.get("run_queue_s") is not None]
             for rank, d in trace.dumps.items()}
    # The transport threads' share comes off every rank's other threads or off none: ranks
    # compared with and without it would differ by gloo's work alone; the checkpoint writers'
    # alike (`_BACKGROUND`).
    background = tuple(f for f in _BACKGROUND
                       if all(b.get(f) is not None for bs in beats.values() for b in bs))
    out = {rank: {b["step"]: _step(a, b, background) for a, b in zip(bs, bs[1:])
                  if b["step"] == a["step"] + 1} for rank, bs in beats.items()}
    return out if out and all(out.values()) else {}


def _step(before: dict[str, Any], after: dict[str, Any], background: tuple[str, ...]) -> _Step:
    """The step between two beats, the run's work between them (`_run_work`) taken out of
    what the rank did: its window still holds that work's collectives (their lateness is
    compared), but no evidence that the rank held the step up comes from it."""
    grew = {f: after[f] - before[f] for f in ("run_queue_s", *_READINGS, *_BACKGROUND)
            if before.get(f) is not None and after.get(f) is not None}
    work = _run_work(before, after)
    if not set(grew) <= set(work):  # only what was read in the work too comes out of it
        work = {}
    grew = {f: v - work.get(f, 0.0) for f, v in grew.items()}
    step = _Step(before["end_t"], after["end_t"], grew["run_queue_s"], _host_wait(grew),
                 work=work.get("seconds", 0.0))
    if all(f in grew for f in _READINGS):
        step.cpu, step.blocked = grew["cpu_s"], grew["blocked_s"]
        step.others = grew["other_threads_cpu_s"]
        for f in background:  # the collectives' and the checkpoint's threads (module docstring)
            step.others -= grew[f]
        if "checkpoint_threads_cpu_s" in background:
            step.writers = max(0.0, grew["checkpoint_threads_cpu_s"])
    return step


def _run_work(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What the rank did between its last beat and the step's start, by reading (doctor/
    session.py `run_work`: the seconds, CPU time, run-queue wait, blocked time...): logging,
    evaluation, checkpoints, the work the run gives the rank. Rank 0 alone writes
    metrics.jsonl and commits a checkpoint's metadata (disk writes: off a CPU, so `off`
    counted them as a stall); its peers wait for it in the next collective, as the run asked.
    Measured (session 52, docs/measurements.md#straggler-run-work): healthy `meshtron train
    --model debug --nproc 2 --plan dp=2 --steps 6 --checkpoint-every 3` runs were named a
    straggler in 1 of 8, rank 0 0.022 s off a CPU in the step-3 checkpoint's window. The
    async save's commit thread that overlaps the next step is the writers' (`_Step.stalled`).
    Empty (nothing taken out) for dumps without it, or when a reading is missing from it. A
    rank stopped during this work is not seen; a stop in the steps themselves still is."""
    a, b = before.get("run_work"), after.get("run_work")
    if not a or not b or set(a) != set(b) or "seconds" not in a:
        return {}
    return {f: b[f] - a[f] for f in a}


def _host_wait(grew: dict[str, float]) -> float:
    """The run-queue wait in a step that other processes caused, at least: less the CPU time
    the rank's own other threads had meanwhile (a thread can only have waited for its own
    process's threads while they ran). Beats without that reading count their whole wait."""
    if "other_threads_cpu_s" not in grew:
        return grew["run_queue_s"]
    return max(0.0, grew["run_queue_s"] - grew["other_threads_cpu_s"])


def _lateness(trace):
    """(rank -> (its entry time, its lateness) in each collective compared, rank -> times
    last, number of collectives, seconds they span), over the collectives every member of their
    group recorded between the end of the start-up and the end of the last step every rank
    finished (`_compared_window`); none before every rank has finished a step."""
    lates: dict[int, list[tuple[float, float]]] = defaultdict(list)
    last: Counter = Counter()
    window = _compared_window(trace)
    if window is None:
        return lates, last, 0, 0.0
    warm, done = window
    total, lo, hi = 0, float("inf"), float("-inf")
    for group, by_rank in trace.collectives().items():
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


def _compared_window(trace) -> tuple[float, float] | None:
    """(start, end) of the time compared: from when every rank had finished the first step its
    dump keeps (step 1; a later one after a resume or once the dump's window of beats moved on)
    to the end of the last step every rank finished (the run's end: a final evaluation, a
    checkpoint, plots on rank 0, is not a step either). None while a rank has finished no step:
    its dump, and so its peers' comparison, is all start-up. The start-up is not a straggler's:
    ranks reach its collectives (a vocabulary broadcast, the first all-gathers) after imports,
    tokenization and first compilations that differ by chance, and no beat gives the readings
    that tell the host's load from a rank's own. Measured (session 50): healthy 2-rank runs
    dumped on demand (SIGUSR1) before their first step, beside three busy loops, were named a
    straggler under the timing rule in 6 of 12 runs: one rank 22 ms to 2.5 s later at the
    start-up broadcasts and the first step's all-gathers, 14-97% of the span they covered
    (docs/measurements.md#straggler-on-demand)."""
    firsts, lasts = [], []
    for d in trace.dumps.values():
        ends = [st["end_t"] for st in d.get("step_times") or []]
        if not ends:
            return None
        firsts.append(min(ends))
        lasts.append(max(ends))
    return (max(firsts), min(lasts)) if firsts else None


def _median_step(trace) -> float | None:
    times = [st["seconds"] for d in trace.dumps.values() for st in d.get("step_times", [])
             if st["step"] > 1]
    if times:
        return statistics.median(times)
    steady = [m["step_time_s"] for m in trace.metrics if m.get("step", 0) > 1
              and m.get("step_time_s")]
    return statistics.median(steady) if steady else None
