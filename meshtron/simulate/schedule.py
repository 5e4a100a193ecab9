"""The order in which each pipeline device runs its operations, per schedule.

An operation is (kind, virtual stage, micro-batch) with kind 'F' (forward), 'B' (backward;
input and weight gradients, or input gradients only under zero bubble) or 'W' (weight
gradients, zero bubble only). Virtual stage j lives on device j % p (Megatron's numbering,
planner/pipeline.py `split_virtual`) but for zero bubble's V (`device_of`).

* gpipe: all forwards, then all backwards (v > 1: looped BFS, chunk by chunk).
* 1f1b (PipeDream-Flush, Narayanan et al. 2021): device s runs p - s - 1 warm-up forwards,
  then alternates one forward and one backward, then drains the backwards.
* interleaved (Narayanan et al. 2021, section 2.2.2; Megatron-LM's
  `forward_backward_pipelining_with_interleaving`): forwards visit chunks in rounds of p
  micro-batches, the k-th forward is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p;
  backwards the same with chunks reversed; warm-up (p - s - 1) 2 + (v - 1) p forwards.
  torch's ScheduleInterleaved1F1B runs rounds of m // max(1, m // p) micro-batches instead of
  p (all m when there are fewer than p): that replaces p in the round arithmetic above.
* zb (Qi et al. 2024): the order torch.distributed.pipelining runs, forwards, input-gradient
  backwards 'B' and weight-gradient backwards 'W' (planner/pipeline_zb.py `orders`: the ZB1P
  of ScheduleInterleavedZeroBubble, and for v = 2 the V of ScheduleZBVZeroBubble, whose
  virtual stage j lives on device j for j < p and 2p - 1 - j after: `stage_rank`).
"""

from __future__ import annotations

from meshtron.planner import pipeline_zb

Op = tuple[str, int, int]
"""(kind, virtual stage, micro-batch)."""


def _megatron_order(p: int, v: int, m: int, s: int) -> list[Op]:
    total = m * v
    r = _round(p, m)

    def fwd(k: int) -> Op:
        chunk = (k // r) % v
        return ("F", chunk * p + s, (k // (r * v)) * r + k % r)

    def bwd(k: int) -> Op:
        chunk = v - 1 - (k // r) % v
        return ("B", chunk * p + s, (k // (r * v)) * r + k % r)

    if v == 1:
        warm = min(p - s - 1, m)
    else:
        warm = min((p - s - 1) * 2 + (v - 1) * r, total)
    order = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        order += [fwd(warm + i), bwd(i)]
    order += [bwd(k) for k in range(total - warm, total)]
    return order


def _round(p: int, m: int) -> int:
    """Micro-batches per round of the interleaved schedule: torch's ScheduleInterleaved1F1B
    runs max(1, m // p) rounds of m / rounds (schedules.py; the plan's rules refuse m that
    does not divide): p when m is a multiple of p (Megatron-LM's only case), all m when there
    are fewer (planner/pipeline.py `bubble_time` prices the chunk changes' idle slots)."""
    return m // max(1, m // p)


def _gpipe_order(p: int, v: int, m: int, s: int) -> list[Op]:
    fw = [("F", c * p + s, j) for c in range(v) for j in range(m)]
    bw = [("B", c * p + s, j) for c in reversed(range(v)) for j in range(m)]
    return fw + bw


def device_orders(schedule: str | None, p: int, v: int, m: int) -> list[list[Op]]:
    """Per device, its operations in execution order."""
    if p == 1:  # no pipeline: each micro-batch's forward, then its backward
        return [[op for j in range(m) for op in (("F", 0, j), ("B", 0, j))]]
    if schedule == "gpipe":
        return [_gpipe_order(p, v, m, s) for s in range(p)]
    if schedule == "zb":
        return pipeline_zb.orders(p, v, m)
    if schedule in ("1f1b", "interleaved", None):
        return [_megatron_order(p, v, m, s) for s in range(p)]
    raise ValueError(f"unknown schedule {schedule!r}")


def device_of(schedule: str | None, p: int, v: int, stage: int) -> int:
    """The device holding virtual stage `stage`."""
    if schedule == "zb":
        return pipeline_zb.stage_rank(p, v, stage)
    return stage % p
