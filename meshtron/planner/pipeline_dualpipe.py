"""DeepSeek's DualPipe and DualPipeV (deepseek-ai/DualPipe, DeepSeek-V3 report section 3.2.1),
priced for DeepSeek's stack only: meshtron's runtime does not run them (plan_rules_pipeline
`schedule_problem` refuses schedule 'dualpipe' outside `memory.pipeline_split='dualpipe'`).

What the code does (deepseek-ai/DualPipe at 3da1bbe):

* DualPipe (`virtual_stages=1`): the model is cut into PP stages; rank r holds two modules,
  stage r and stage PP-1-r (dualpipe.py: `self.module[phase ^ is_in_second_half]`). The step's
  micro-batches are split in half (`half_num_chunks`), one half fed from rank 0, the other from
  rank PP-1, so rank r runs stage r on one half and stage PP-1-r on the other. Ranks r and
  PP-1-r thus hold the same two stages and each runs m/2 micro-batches through both: they are
  data-parallel replicas of one rank of a V over PP/2 ranks (stages r and PP-1-r on rank r), the
  "cut-in-half" DualPipeV (dualpipev.py) with twice the data-parallel degree and half the
  micro-batches each. `fold` prices DualPipe as exactly that V; its parameters are 2x a 1F1B
  rank's (README table: "Parameter Per Device 2x").
* DualPipeV (`virtual_stages=2`): PP ranks, 2 PP stages, rank r holding stages r and 2PP-1-r,
  every micro-batch fed from rank 0 (torch's V placement, `pipeline.stages_of_rank`).
* Bubble (README table, PP the number of stages): (PP/2 - 1)(F&B + B - 3W), F a forward chunk,
  B a full backward chunk (input and weight gradients), W the weight-gradient part, F&B a
  forward and a backward chunk run overlapped (their computations add; the all-to-alls and
  pipeline transfers they overlap are hidden: `overlapped_forward_backward`, report 3.2.1).
* Activations (README table): PP+1 chunks' worth per rank, a chunk being one stage of one
  micro-batch. Read off dualpipe.py's steps: rank r (first half) runs 2(PP/2-r-1) forwards of
  stage r, then r+1 pairs of both, then the steady F0 B1 F1 B0: at its peak PP-r micro-batches
  of stage r and r+1 of stage PP-1-r, PP+1 in all (`in_flight` before the split is known,
  `rank_in_flight` on the split's own stages).
* Pipeline transfers: hidden in the overlapped chunks (report 3.2.1: "both all-to-all and PP
  communication can be fully hidden during execution"); the bubble formula has no hop term.
* Micro-batches: the engine's asserts are rules of the plan (plan_rules_pipeline
  `dualpipe_problem`).

Imports nothing of meshtron (it rewrites any dataclass with a Plan's fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCHEDULE = "dualpipe"


def is_dualpipe(cfg: Any) -> bool:
    """Whether plan `cfg` runs DualPipe proper (not the V): the one `fold` rewrites."""
    return cfg.schedule == SCHEDULE and cfg.virtual_stages == 1 and cfg.pp > 1


def fold(cfg: Any) -> Any:
    """DualPipe on pp ranks and dp replicas as the V it is per rank (module docstring): pp/2
    ranks holding stages r and pp-1-r, 2 dp replicas of each, the same stage split (a V's
    p*v = pp chunks in stage order are DualPipe's pp stages)."""
    return dataclasses.replace(cfg, pp=cfg.pp // 2, dp=cfg.dp * 2, virtual_stages=2)


def unfold(est: Any, cfg: Any, m: int) -> Any:
    """The folded plan's Estimate told as the plan `cfg` asked: its layout and its m
    micro-batches per step (each rank runs m/2 through each of its two stages)."""
    return dataclasses.replace(est, config=cfg, num_microbatches=m)


def in_flight(p: int, v: int, m: int) -> float:
    """Micro-batches' worth of a V rank's layers (both chunks) kept at the peak: PP+1 chunks,
    PP = p v stages, a chunk half the rank's layers (module docstring)."""
    return min(float(m), (p * v + 1) / 2.0)


def bubble(p: int, v: int, fwd: float, whole: float, wgrad: float) -> float:
    """The README's (PP/2 - 1)(F&B + B - 3W) for a V rank of p ranks and v = 2 chunks whose
    per-micro-batch forward, whole (forward + full backward) and weight-gradient times over both
    chunks are given: per chunk their halves, F&B = F + B (overlapped, comm hidden)."""
    stages = p * v
    f, b, w = fwd / 2.0, (whole - fwd) / 2.0, wgrad / 2.0
    return max(0.0, (stages / 2.0 - 1.0) * ((f + b) + b - 3.0 * w))


def rank_in_flight(chunks: list[int], p: int) -> list[float]:
    """Per V rank r of p (stages r and 2p-1-r, layers `chunks` in stage order), micro-batches'
    worth of its layers at the peak on the split's own stages: PP - r micro-batches of stage
    r and r + 1 of stage PP-1-r (PP = 2p; module docstring, dualpipe.py's and dualpipev.py's
    steps 1-4). Equal stages give `in_flight`'s (PP+1)/2."""
    stages = 2 * p
    out = []
    for r in range(p):
        a, b = chunks[r], chunks[stages - 1 - r]
        out.append((a * (stages - r) + b * (r + 1)) / (a + b) if a + b else in_flight(p, 2, stages))
    return out
