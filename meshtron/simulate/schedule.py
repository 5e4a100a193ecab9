"""The order in which each pipeline device runs its operations, per schedule.

An operation is (kind, virtual stage, micro-batch) with kind 'F' (forward), 'B' (backward;
input and weight gradients, or input gradients only under zero bubble) or 'W' (weight
gradients, zero bubble only). Virtual stage j lives on device j % p (Megatron's numbering,
planner/pipeline.py `split_virtual`).

* gpipe: all forwards, then all backwards (v > 1: looped BFS, chunk by chunk).
* 1f1b (PipeDream-Flush, Narayanan et al. 2021): device s runs p - s - 1 warm-up forwards,
  then alternates one forward and one backward, then drains the backwards.
* interleaved (Narayanan et al. 2021, section 2.2.2; Megatron-LM's
  `forward_backward_pipelining_with_interleaving`): forwards visit chunks in rounds of p
  micro-batches, the k-th forward is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p;
  backwards the same with chunks reversed; warm-up (p - s - 1) 2 + (v - 1) p forwards. With
  fewer micro-batches than devices one round of all m (torch's ScheduleInterleaved1F1B): p
  becomes m in the round arithmetic above.
* zb (ZB-H1, Qi et al. 2024): the 1F1B order of forwards and input-gradient backwards, with
  each weight-gradient W run whenever the device would otherwise wait for its next input (the
  greedy rule that fills 1F1B's bubble), at the latest when p - s of them wait (ZB-H1 keeps
  1F1B's activation memory: device s holds at most p - s micro-batches), and the rest at the
  end. That order depends on the
  durations, so it is taken from an event-driven run at the nominal durations (`zb_orders`) and
  then kept fixed, as a runtime's static schedule is.
"""

from __future__ import annotations

import heapq
from collections import deque

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
    """Micro-batches per round of the interleaved schedule: p (Megatron-LM), or all m when
    there are fewer (torch's ScheduleInterleaved1F1B: max(1, m // p) rounds of m / rounds,
    schedules.py; planner/pipeline.py `bubble_time` prices the chunk changes' idle slots)."""
    return p if m >= p else m


def _gpipe_order(p: int, v: int, m: int, s: int) -> list[Op]:
    fw = [("F", c * p + s, j) for c in range(v) for j in range(m)]
    bw = [("B", c * p + s, j) for c in reversed(range(v)) for j in range(m)]
    return fw + bw


def device_orders(schedule: str | None, p: int, v: int, m: int) -> list[list[Op]]:
    """Per device, its F/B operations in execution order (zb: see `zb_orders`)."""
    if p == 1:  # no pipeline: each micro-batch's forward, then its backward
        return [[op for j in range(m) for op in (("F", 0, j), ("B", 0, j))]]
    if schedule == "gpipe":
        return [_gpipe_order(p, v, m, s) for s in range(p)]
    if schedule in ("1f1b", "interleaved", "zb", None):
        if schedule == "interleaved" and m > p and m % p:
            raise ValueError(f"interleaved schedule needs m % p == 0 or m < p (m={m}, p={p})")
        return [_megatron_order(p, v, m, s) for s in range(p)]
    raise ValueError(f"unknown schedule {schedule!r}")


def zb_orders(p: int, v: int, m: int, fwd: list[float], bwd: list[float], wgrad: list[float],
              hop: float) -> list[list[Op]]:
    """ZB-H1's per-device order at the given durations (event-driven, greedy W filling).
    `bwd` is the whole backward; B runs bwd - wgrad, W runs wgrad."""
    base = device_orders("zb", p, v, m)
    nv = p * v
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    pending: list[deque[Op]] = [deque() for _ in range(p)]
    free = [0.0] * p
    out: list[list[Op]] = [[] for _ in range(p)]
    events: list[tuple[float, int]] = [(0.0, s) for s in range(p)]
    heapq.heapify(events)

    def arrival(op: Op) -> float | None:
        kind, j, mb = op
        if kind == "F":
            if j == 0:
                return 0.0
            t = done.get(("F", j - 1, mb))
            return None if t is None else t + hop
        if j == nv - 1:
            return done.get(("F", j, mb))
        t = done.get(("B", j + 1, mb))
        return None if t is None else t + hop

    while events:
        now, s = heapq.heappop(events)
        if now < free[s] - 1e-15:
            continue
        if pos[s] == len(base[s]):
            if pending[s]:
                op = pending[s].popleft()
                free[s] = max(now, free[s]) + wgrad[op[1]]
                out[s].append(op)
                heapq.heappush(events, (free[s], s))
            continue
        op = base[s][pos[s]]
        ready = arrival(op)
        if len(pending[s]) >= p - s or (pending[s] and (ready is None or ready > now + 1e-15)):
            w = pending[s].popleft()  # memory cap reached, or the device would wait: a W
            free[s] = now + wgrad[w[1]]
            out[s].append(w)
            heapq.heappush(events, (free[s], s))
        elif ready is not None and ready <= now + 1e-15:
            kind, j, mb = op
            dur = fwd[j] if kind == "F" else bwd[j] - wgrad[j]
            free[s] = now + dur
            done[op] = free[s]
            out[s].append(op)
            pos[s] += 1
            if kind == "B":
                pending[s].append(("W", j, mb))
            _wake_neighbours(events, op, free[s], hop, p, nv)
            heapq.heappush(events, (free[s], s))
        elif ready is not None:
            heapq.heappush(events, (ready, s))
        # else: idle until a neighbour's completion wakes this device
    return out


def _wake_neighbours(events: list, op: Op, t: float, hop: float, p: int, nv: int) -> None:
    kind, j, _ = op
    if kind == "F":
        target = j + 1 if j + 1 < nv else j  # the last stage's own backward follows its forward
    else:
        target = j - 1
    if 0 <= target < nv:
        heapq.heappush(events, (t + (hop if target != j else 0.0), target % p))
