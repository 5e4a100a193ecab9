"""Stored activations of an interleaved pipeline rank whose chunks hold different layer counts.

`pipeline.in_flight` counts the chunk-micro-batches an interleaved 1F1B rank holds at its peak
(warm-up + 1: (p - s - 1) 2 + (v - 1) p + 1) and spreads them evenly over the rank's v
chunks. They are not spread evenly: in the steady phase the rank runs the next round's
forwards on its first chunks while its backwards drain the last ones, so the first chunks
hold up to every micro-batch of the step (rehearsed, Llama 3 405B tp=8 pp=16 v=6 with 32
micro-batches, pipeline rank 5: 32, 31, 16 and 16 micro-batches on its first four chunks at
the peak; this walk: 32, 32, 16, 16, 5, 0). When the runtime's split gives the first chunks
more layers (126 layers over 96 chunks: 2, 2, 1, 1, 1, 1 on that rank), the even spread
undercounts (165 layer-micro-batches held against 135: the planner read 17.5% under the
rehearsal; with the weighting +0.4% on the fullest rank of that plan).

`weighted_in_flight` walks the schedule's order (torch's ScheduleInterleaved1F1B, which is
Megatron-LM's: forwards visit the chunks in rounds of m / max(1, m // p) micro-batches,
backwards the same with the chunks reversed, warm-up (v - 1) round + 2 (p - 1 - s)
forwards) and takes the largest sum over chunks of micro-batches held x layers.
"""

from __future__ import annotations


def _chunk_of(k: int, per_round: int, v: int, backward: bool) -> int:
    chunk = (k // per_round) % v
    return v - 1 - chunk if backward else chunk


def held_layer_microbatches(p: int, v: int, m: int, s: int, layers: list[int]) -> int:
    """Most (micro-batch x layer) activations pipeline rank `s` holds at once under
    interleaved 1F1B; `layers[c]`: the layers of its c-th chunk (virtual stage c p + s)."""
    per_round = m // max(1, m // p)
    total = m * v
    warm = min((v - 1) * per_round + 2 * (p - 1 - s), total)
    held = [0] * v
    now = best = 0
    for k in range(total):  # forward k, then (after warm-up) backward k - warm
        c = _chunk_of(k, per_round, v, False)
        held[c] += 1
        now += layers[c]
        if k >= warm:  # steady phase: backward k - warm follows this forward
            best = max(best, now)
            b = k - warm
            cb = _chunk_of(b, per_round, v, True)
            held[cb] -= 1
            now -= layers[cb]
    return max(best, now)


def weighted_in_flight(p: int, v: int, m: int, chunk_layers: list[int],
                       even: list[float]) -> list[float]:
    """Per pipeline rank, micro-batches' worth of its layers held at its peak (the multiplier
    `pipeline.in_flight` gives, `even`), from the chunks' own layer counts (`chunk_layers`,
    p v entries in virtual-stage order): never below the even spread."""
    out = []
    for s in range(p):
        layers = [chunk_layers[c * p + s] for c in range(v)]
        n = sum(layers)
        held = held_layer_microbatches(p, v, m, s, layers) / n if n else 0.0
        out.append(max(even[s], held))
    return out
