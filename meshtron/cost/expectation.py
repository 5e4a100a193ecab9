"""The expected wall time of the process montecarlo.py samples, in closed form, and its exact
split by cause: one process for the "days" and the P50/P90 of `meshtron cost`.

Daly 2006 ("A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22(3)), eq. 13, is the expectation of this process with one kind of interruption: a run
is cut into segments of L = tau + delta seconds (work, then a checkpoint write); lossy
interruptions arrive at rate 1/M; one that strikes a segment loses the time since the segment
began, then a restart of R seconds, which an interruption may strike too (it then starts
again), then the segment is redone. Per segment:

    E = L + (e^(L/M) - 1) (E[X | X < L] + T_restart),   T_restart = M (e^(R/M) - 1)
      = M e^(R/M) (e^(L/M) - 1)                          (eq. 13 per segment)

With two kinds (hardware failures and spot preemptions that lose work, shares p_j of the
interruptions, restarts R_j; the kind of each interruption drawn by its rate), a restart
attempt ends without interruption with probability Q = sum_j p_j e^(-R_j/M), so
T_restart = M (1 - Q) / Q and E = M (e^(L/M) - 1) / Q (Q = e^(-R/M) for one kind). The parts
add up to E exactly: work and save L; the time lost in struck segments
M (e^(L/M) - 1) - L; the restarts of kind j, p_j M (1 - e^(-R_j/M)) / Q per interruption of a
segment (attempts struck included).

The run's last segment is its remainder of work, and the run ends with a save (its final
weights): the closed form and the Monte Carlo both count RunProcess.segments().

Spot preemptions whose notice covers a save lose no work: each costs save + reacquire +
restart, at their rate over the whole wall time, so the wall time is divided by 1 - rate x
cost (the time they add draws more of them); rate x cost >= 1 never finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshtron.cost.montecarlo import RunProcess

NEVER_FINISHES_S = 100 * 365.25 * 86400.0
"""An expected wall time beyond a century is reported as "never finishes", not as a number:
no cluster, budget or model outlives it, and past it the figures are e^(R/M) growing to
float overflow (a 74-digit day count for a 3.6 s MTBF and a 601 s restart)."""


@dataclass(frozen=True)
class Expectation:
    """The expected wall time of a RunProcess and its parts (seconds)."""

    wall_s: float
    """Expected wall time; inf when the run never finishes."""
    parts: dict[str, float] = field(default_factory=dict)
    """work, checkpoint_stalls, lost_work, restarts[, preemptions]: they add up to wall_s."""
    never: str | None = None
    """Why the run never finishes (None: it does)."""


def _log_expm1(x: float) -> float:
    """log(e^x - 1) without overflow."""
    return x + math.log1p(-math.exp(-x)) if x > 1.0 else math.log(math.expm1(x))


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def _seconds(x: float) -> str:
    return f"{x:.3g} s" if x < 100 else f"{x:,.0f} s"


def expect(proc: RunProcess) -> Expectation:
    """Expected wall time of `proc` (module docstring), or why it never finishes."""
    segments = [(n, length) for n, length in proc.segments() if n > 0]
    saves = sum(n for n, _ in segments)
    parts = {"work": proc.work_s, "checkpoint_stalls": saves * proc.save_s}
    lam = proc.lossy_rate
    if lam > 0:
        m, kinds = 1.0 / lam, proc.restart_kinds()
        log_q = _logsumexp([math.log(p) - r / m for p, r, _ in kinds])
        log_wall = _logsumexp([math.log(n) + math.log(m) + _log_expm1(length / m) - log_q
                               for n, length in segments])
        if log_wall > math.log(NEVER_FINISHES_S):
            who = "a failure" if len(kinds) == 1 else "a lossy interruption"
            restart = max(r for _, r, _ in kinds)
            return Expectation(math.inf, never=(
                f"{who} every {_seconds(m)} against a {_seconds(restart)} restart and "
                f"{_seconds(segments[0][1])} of work + save between checkpoints: expected wall "
                "time beyond 100 years (Daly 2006 eq. 13)"))
        q = math.exp(log_q)
        struck = sum(n * math.expm1(length / m) for n, length in segments)
        lost = sum(n * (m * math.expm1(length / m) - length) for n, length in segments)
        for share, restart, cause in kinds:
            own = lost * share + struck * share * m * -math.expm1(-restart / m) / q
            if cause == "failures":
                parts["lost_work"] = lost * share
                parts["restarts"] = own - lost * share
            else:  # a preemption's lost work and its restart (reacquiring capacity) together
                parts["preemptions"] = own
    wall = sum(parts.values())
    if proc.preempt_saves and proc.preempt_rate > 0:
        each = proc.save_s + proc.preempt_restart_s
        busy = proc.preempt_rate * each
        if busy >= 1.0 or wall / (1.0 - busy) > NEVER_FINISHES_S:
            return Expectation(math.inf, never=(
                f"a spot preemption every {_seconds(1 / proc.preempt_rate)} but each costs "
                f"{_seconds(each)} (a save in the notice, reacquiring capacity, restart)"))
        parts["preemptions"] = wall * busy / (1.0 - busy)
        wall += parts["preemptions"]
    return Expectation(wall, parts)
