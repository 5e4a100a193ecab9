"""How many of a step's micro-batches a rehearsal runs: the fewest that reach the same peak.

Every micro-batch of a step has the same shapes, so what a rank holds at any moment of the
step is a function of where the step is, not of which micro-batch it is working on:

* without a pipeline, of whether gradients were accumulated yet (after the first
  micro-batch) and whether this is the last micro-batch (the one that reduces them:
  `data_parallel.set_microbatch_policy`). The first, one middle and the last micro-batch
  show every such moment: min(m, 3) micro-batches give the step's peak exactly;
* with a pipeline, of the action being run (forward or backward, of which stage, and
  whether it is the stage's last backward) and, per stage of the rank, the micro-batches in
  flight (their stored activations), whether the stage has run a forward (its units are
  gathered) and a backward (its gradients accumulated) and whether it has run all of them.
  `states` lists those moments of an action order; a schedule of m' < m micro-batches whose
  set of moments equals the full step's reaches the same peak (1F1B: warm-up + 1 steady
  micro-batch; a looped schedule: its warm-up and one steady round). Under zero bubble a
  stage's gradients are made by its W, not its B, and FSDP2 folds them into its accumulator
  only at the stage's next B (planner/memory_zb.py; the first stage's W is a whole backward
  and folds them itself): whether the stage's accumulator exists yet and whether a W's
  gradients wait for their fold are part of the state (without them the last stage of a
  2-stage zb pipeline ran 2 of 4 micro-batches and read 6.26 GiB for the whole step's
  7.32). meshtron's runtime now folds them at W's end (parallel/pipeline.py
  `fold_weight_grads`, run by pipeline_step.py's W too): the accumulator exists once
  `acc | fold`, a function of the state kept, so the pair stays exact (finer than needed:
  it may run a micro-batch more than the fold requires, never fewer).

The micro-batches run are the first m' chunks of the rank's whole batch, which stays alive
as in a real step (only its rows of token ids: the data loader's output).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

Action = tuple[str, int, int]
"""(kind 'F' / 'B' / 'W', stage index, micro-batch index); 'W' only under zero bubble."""

ACCUMULATION_MOMENTS = 3
"""First (nothing accumulated), a middle one (accumulated, no reduction) and the last (the
reduction): every moment of a step of gradient accumulation."""


def accumulation_microbatches(m: int) -> int:
    """Micro-batches a non-pipelined rehearsal runs for a step of `m`."""
    return min(m, ACCUMULATION_MOMENTS)


def states(order: Iterable[Action]) -> set[tuple]:
    """The moments of an action order (module docstring): one per action, the rank's state
    before it and the action itself (its micro-batch index left out)."""
    order = list(order)
    stages = sorted({s for _, s, _ in order})
    split = any(kind == "W" for kind, _, _ in order)  # zero bubble: B keeps all to its W
    last = "W" if split else "B"  # the action ending a micro-batch (and the stage's step)
    ends = Counter(s for kind, s, _ in order if kind == last)
    live, fwd, bwd, wait, done, fold, acc = (dict.fromkeys(stages, 0) for _ in range(7))
    out = set()
    for kind, s, _ in order:
        held = tuple((live[t], wait[t], fwd[t] > 0, bwd[t] > 0, done[t] == ends[t])
                     + ((acc[t], fold[t]) if split else ()) for t in stages)
        out.add((held, kind, s, kind == last and done[s] + 1 == ends[s]))
        if kind == "F":
            live[s] += 1
            fwd[s] += 1
        elif kind == "B":
            bwd[s] += 1
            acc[s] |= fold[s]  # the first fold makes the accumulator
            fold[s] = 0
            wait[s] += split
            live[s] -= not split
            done[s] += not split
        else:
            live[s] -= 1
            wait[s] -= 1
            done[s] += 1
            acc[s] |= s == 0  # the first stage's W: a whole backward, folding as it goes
            fold[s] = int(s != 0)
    return out


def pipeline_microbatches(m: int, order_of: Callable[[int], list[Action]],
                          allowed: Callable[[int], bool]) -> int:
    """The fewest micro-batches m' <= m the schedule accepts (`allowed`) whose action order
    (`order_of(m')`, this pipeline rank's) shows the same moments as the step's `m`."""
    full = states(order_of(m))
    for k in range(1, m):
        if allowed(k) and states(order_of(k)) == full:
            return k
    return m
