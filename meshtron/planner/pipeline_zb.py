"""Zero-bubble pipeline schedules as torch.distributed.pipelining builds them, and their bubble.

meshtron's runtime (parallel/pipeline.py `build_schedule`) runs 'zb' with one stage per rank
and with v >= 3 as `ScheduleInterleavedZeroBubble` (the paper's ZB1P; Qi et al. 2024, "Zero
Bubble Pipeline Parallelism", arXiv 2401.10241) and with v = 2 as `ScheduleZBVZeroBubble`
(the paper's ZB-V, section 6, V placement); torchtitan builds the same classes. `orders`
re-derives the compute order each rank executes (torch 2.13 schedules.py,
`_get_1f1b_rank_ops(..., enable_zero_bubble=True)` with `_get_warmup_ops(multiply_factor=1)`
and `num_1f1b_microbatches = rank`, and `ScheduleZBVZeroBubble._calculate_single_rank_operations`;
the same in the pre-2.13 source read for comparison). The runtime drops the schedule's None
slots and runs each rank's list in order, every operation waiting only for its input
(`_PipelineScheduleRuntime._step_microbatches`: receives posted early, sends not waited on
until the step's end), so the step is the event walk of these lists (`walk`).
tests/test_pipeline_zb.py checks `orders` against the lists torch builds and `bubble` against
the walk.

Operations are (kind, stage, micro-batch): 'F' forward, 'B' input gradient, 'W' weight
gradient (the simulator's names, simulate/schedule.py).

The bubble of that walk for equal stages (per chunk and micro-batch: forward f, input
gradient b, weight gradient w), measured on torch's orders and checked by the tests:

* ZB1P, m >= p (and v = 1 for any m): (p-1) max(f+b-w, f, b), plus, with v = 1 and m < p,
  (p-m) min(f, b, w). The paper's (p-1)(f+b-w) holds only while w <= min(f, b): the
  schedule puts exactly one W after each steady-state B, so a W longer than f or b cannot
  fill the slot it was given.
* ZB-V: W sits at fixed places of the V and the critical path changes with the ratios. From
  m = 2p - 1 micro-batches on (torch pads its order to 2p - 1 and drops the missing ones)
  the bubble no longer changes with m and grows linearly with p from p = 2, so two small
  walks (p = 2 and 3) give it at any depth. Below that, and for ZB1P with v >= 3 and m < p,
  the walk itself (at most 3 v p^2 operations).
"""

from __future__ import annotations

from functools import lru_cache

Op = tuple[str, int, int]


def stage_rank(p: int, v: int, stage: int) -> int:
    """Pipeline rank holding virtual stage `stage` under 'zb': a V for v = 2 (torch's
    generate_stage_to_rank_mapping(style='v')), looped (stage % p) otherwise."""
    if v == 2:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def orders(p: int, v: int, m: int) -> list[list[Op]]:
    """Per pipeline rank, the compute operations torch runs for 'zb' with v stages per rank."""
    if v == 2:
        return [_zbv_order(p, m, r) for r in range(p)]
    return [_zb1p_order(p, v, m, r) for r in range(p)]


@lru_cache(maxsize=1024)
def cached_orders(p: int, v: int, m: int, schedule: str = "zb") -> tuple[tuple[Op, ...], ...]:
    """`orders` ('zb') or `interleaved_orders` ('interleaved'), built once (the planner's
    walks and memory_zb.py read them for every plan of a search)."""
    ords = interleaved_orders(p, v, m) if schedule == "interleaved" else orders(p, v, m)
    return tuple(tuple(o) for o in ords)


def interleaved_orders(p: int, v: int, m: int) -> list[list[Op]]:
    """Per pipeline rank, the compute operations of torch's ScheduleInterleaved1F1B (the
    same `_get_1f1b_rank_ops` without zero bubble, `_get_warmup_ops(multiply_factor=2)`:
    warm-up (v - 1) rounds + 2 (p - 1 - r) forwards; B a whole backward, no W). Megatron's
    interleaved schedule runs the same order (memory_pipeline.py)."""
    return [_zb1p_order(p, v, m, r, whole=True) for r in range(p)]


def _zb1p_order(p: int, v: int, m: int, r: int, whole: bool = False) -> list[Op]:
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warm = min((v - 1) * per_round + (2 if whole else 1) * (p - 1 - r), total)
    lag = total + warm if whole else r  # the interleaved 1F1B: whole backwards, no W

    f_stage = [((k // per_round) % v) * p + r for k in range(total)]
    b_stage = [(v - 1 - (j // per_round) % v) * p + r for j in range(total)]  # j = k - warm
    # micro-batch counters per kind and stage (the rank's chunks only are ever counted)
    cf, cb, cw = [0] * (p * v), [0] * (p * v), [0] * (p * v)

    out: list[Op] = []
    for k in range(warm):
        s = f_stage[k]
        out.append(("F", s, cf[s]))
        cf[s] += 1
    weights = 0  # W of the weights-th backward: one after each B once r of them wait
    for j in range(total):  # j = k - warm, the backward's index
        if j + warm < total:
            s = f_stage[j + warm]
            out.append(("F", s, cf[s]))
            cf[s] += 1
        s = b_stage[j]
        out.append(("B", s, cb[s]))
        cb[s] += 1
        if j >= lag:
            s = b_stage[weights]
            out.append(("W", s, cw[s]))
            cw[s] += 1
            weights += 1
    if not whole:
        for j in range(weights, total):
            s = b_stage[j]
            out.append(("W", s, cw[s]))
            cw[s] += 1
    return out


def _zbv_order(p: int, m: int, r: int) -> list[Op]:
    n = max(2 * p - 1, m)  # torch pads to 2p - 1 micro-batches, then drops the missing ones
    c0, c1 = r, 2 * p - 1 - r
    cnt = {("F", c0): 0, ("F", c1): 0, ("B", c0): 0, ("B", c1): 0}
    out: list[Op] = []

    def add(kind: str, stage: int, mb: int | None = None) -> None:
        if mb is None:
            mb = cnt[(kind, stage)]
            cnt[(kind, stage)] += 1
        out.append((kind, stage, mb))

    for _ in range(2 * (p - r) - 1):
        add("F", c0)
    for _ in range(r):
        add("F", c1)
        add("F", c0)
    for _ in range(p - r):
        add("F", c1)
        b = cnt[("B", c1)]
        out += [("B", c1, b), ("W", c1, b)]
        cnt[("B", c1)] += 1
    while cnt[("F", c1)] < cnt[("F", c0)] or cnt[("F", c0)] < n:
        if cnt[("F", c0)] < n:
            add("F", c0)
        for c in (c0, c1):
            if c == c1:
                add("F", c1)
            b = cnt[("B", c)]
            out += [("B", c, b), ("W", c, b)]
            cnt[("B", c)] += 1
    w0, w1 = cnt[("B", c0)], cnt[("B", c1)]
    for _ in range(r):
        add("B", c0)
        add("B", c1)
    for _ in range(p - r):
        add("B", c0)
        out.append(("W", c0, w0))
        w0 += 1
    out += [("W", c1, j) for j in range(w1, cnt[("B", c1)])]
    out += [("W", c0, j) for j in range(w0, cnt[("B", c0)])]
    return [o for o in out if o[2] < m]


def walk(p: int, v: int, m: int, f: list[float], b: list[float], w: list[float],
         hop: float = 0.0, schedule: str = "zb") -> float:
    """Makespan of torch's 'zb' orders (`schedule` 'interleaved': its interleaved 1F1B, b the
    whole backward, w unused), per virtual stage forward f, input gradient b and weight
    gradient w of one micro-batch; a transfer between ranks delays its receiver by `hop` (a
    rank's own sends never hold it: the runtime waits on them at the step's end)."""
    return max(_ends(p, v, m, f, b, w, hop, schedule))


def _ends(p: int, v: int, m: int, f: list[float], b: list[float], w: list[float],
         hop: float = 0.0, schedule: str = "zb") -> list[float]:
    """End time of every operation of torch's 'zb' orders (`_program`'s numbering: operation i
    ends at [i + 1], [0] is 0: "no operation") (`schedule` 'interleaved': its interleaved 1F1B, b the
    whole backward, w unused), per virtual stage forward f, input gradient b and weight
    gradient w of one micro-batch; a transfer between ranks delays its receiver by `hop` (a
    rank's own sends never hold it: the runtime waits on them at the step's end)."""
    dur = [*f, *b, *w]  # indexed by kind * p v + stage (`_program`)
    keys, prevs, deps = _program(p, v, m, schedule)
    end = [0.0]  # end[0]: "no operation" (index 0 in prevs/deps); operation i ends at end[i + 1]
    append = end.append
    if hop:
        for k, a, d, x in zip(keys, prevs, deps, _cross(p, v, m, schedule)):
            start, ready = end[a], end[d] + hop if x else end[d]
            append((start if start > ready else ready) + dur[k])
    else:  # the search's walks: one max and one add per operation
        for k, a, d in zip(keys, prevs, deps):
            start, ready = end[a], end[d]
            append((start if start > ready else ready) + dur[k])
    return end


@lru_cache(maxsize=2048)
def _program(p: int, v: int, m: int, schedule: str = "zb") -> tuple[tuple, ...]:
    """torch's orders as an event list in an order where every input comes first: per
    operation, its kind * p v + stage (kinds 0/1/2 for F/B/W), 1 + the index of the rank's
    previous operation and 1 + the index of the operation producing its input (its own B for
    a W; 0: none). Operations are numbered (kind * p v + stage) * m + micro-batch so that
    finding an input is arithmetic. Any order with inputs first gives every operation the
    same end time (one max and one add of the same two ends), so the placement's order is
    free."""
    nv = p * v
    if schedule == "interleaved":  # the search's walks: numbered directly, no tuples
        ranks = [_interleaved_coded(p, v, m, r) for r in range(p)]
    else:
        ranks = [_coded(o, nv, m) for o in cached_orders(p, v, m, schedule)]
    count = 3 * nv * m
    if max((max(ids, default=0) for ids, _ in ranks), default=0) >= count:
        raise RuntimeError(f"zero-bubble order deadlocks at p={p} v={v} m={m}")
    # 1 + the event index of each operation once placed, -1 before; a last slot, 0, read
    # for "no input" (index -1): one lookup and one test per operation
    done = [-1] * count + [0]
    keys: list[int] = []
    prevs: list[int] = []
    deps: list[int] = []
    add_key, add_prev, add_dep = keys.append, prevs.append, deps.append
    last, at = [0] * p, [0] * p
    placed = 0
    moved = True
    while moved:
        moved = False
        for r, (ids, inputs) in enumerate(ranks):
            i, n, prev = at[r], len(ids), last[r]
            start = i
            while i < n:
                d = done[inputs[i]]
                if d < 0:
                    break  # its input is not placed yet: another rank's turn
                op = ids[i]
                add_key(op // m)
                add_prev(prev)
                add_dep(d)
                placed += 1
                done[op] = prev = placed
                i += 1
            if i > start:
                at[r], last[r], moved = i, prev, True
    if any(a < len(ids) for a, (ids, _) in zip(at, ranks)):
        raise RuntimeError(f"zero-bubble order deadlocks at p={p} v={v} m={m}")
    return tuple(keys), tuple(prevs), tuple(deps)


@lru_cache(maxsize=256)
def _cross(p: int, v: int, m: int, schedule: str = "zb") -> tuple[bool, ...]:
    """Per operation of `_program`, whether its input ran on another rank (only a walk with
    a transfer time reads it: the search's walks do not)."""
    keys, _, deps = _program(p, v, m, schedule)
    nv = p * v
    looped = schedule != "zb"
    rank_of = [s % p if looped else stage_rank(p, v, s) for s in range(nv)] * 3
    return tuple(d > 0 and rank_of[keys[d - 1]] != rank_of[k] for k, d in zip(keys, deps))


def _interleaved_coded(p: int, v: int, m: int, r: int) -> tuple[list[int], list[int]]:
    """`_coded` of rank r's `interleaved_orders` list, built without the tuples (the same
    warm-up, rounds and micro-batch counts as `_zb1p_order(..., whole=True)`; equal:
    tests/test_pipeline_zb_walk.py). Forward k visits chunk (k // round) % v and backward j
    chunk v - 1 - (j // round) % v; either is the chunk's (k // (round v)) round + k % round-th
    visit (every earlier visit of it is in a whole round), its micro-batch."""
    nv = p * v
    total = m * v
    warm = min((v - 1) * (m // max(1, m // p)) + 2 * (p - 1 - r), total)
    chunk, f0, b0 = _interleaved_visits(p, v, m)
    at = r * m  # stage c p + r: rank 0's numbers + r m
    f_ids = [x + at for x in f0]
    # F of stage s needs F of s - 1 (none for stage 0: chunk 0 of rank 0)
    f_in = [x - m for x in f_ids] if r else [x - m if c else -1 for x, c in zip(f_ids, chunk)]
    # B of stage s needs B of s + 1; the last stage (rank p - 1's last chunk) its own F
    b_ids = [x + at for x in b0]
    b_in = ([x + m for x in b_ids] if r < p - 1 else
            [x + m if c else x - nv * m for x, c in zip(b_ids, chunk)])
    # warm-up forwards, then forward k beside backward k - warm, then the drain's backwards
    steady = total - warm
    ids = f_ids[:warm] + [0] * (2 * steady) + b_ids[steady:]
    inputs = f_in[:warm] + [0] * (2 * steady) + b_in[steady:]
    ids[warm:warm + 2 * steady:2] = f_ids[warm:]
    ids[warm + 1:warm + 2 * steady:2] = b_ids[:steady]
    inputs[warm:warm + 2 * steady:2] = f_in[warm:]
    inputs[warm + 1:warm + 2 * steady:2] = b_in[:steady]
    return ids, inputs


@lru_cache(maxsize=64)
def _interleaved_visits(p: int, v: int, m: int) -> tuple[list[int], list[int], list[int]]:
    """Per forward k (and backward k) of rank 0's interleaved order: the chunk forward k
    visits, the number of forward k and that of backward k (`_interleaved_coded`)."""
    nv = p * v
    per_round = m // max(1, m // p)
    block = per_round * v
    visit = [(k // block) * per_round + k % per_round for k in range(m * v)]
    chunk = [(k // per_round) % v for k in range(m * v)]
    f0 = [c * p * m + mb for c, mb in zip(chunk, visit)]
    b0 = [(nv + (v - 1 - c) * p) * m + mb for c, mb in zip(chunk, visit)]
    return chunk, f0, b0


def _coded(order: tuple[Op, ...], nv: int, m: int) -> tuple[list[int], list[int]]:
    """A rank's order as operation numbers ((kind * nv + stage) * m + micro-batch) and the
    number of each one's input (-1: none): F of stage s needs F of s - 1, B of s needs B of
    s + 1 (the last stage: its own F), W its own B."""
    ids, inputs = [], []
    for kind, s, mb in order:
        if kind == "F":
            ids.append(s * m + mb)
            inputs.append((s - 1) * m + mb if s > 0 else -1)
        elif kind == "B":
            ids.append((nv + s) * m + mb)
            inputs.append((nv + s + 1) * m + mb if s < nv - 1 else s * m + mb)
        else:
            ids.append((2 * nv + s) * m + mb)
            inputs.append((nv + s) * m + mb)
    return ids, inputs


def _walk_bubble(p: int, v: int, m: int, f: float, b: float, w: float) -> float:
    n = p * v
    return walk(p, v, m, [f] * n, [b] * n, [w] * n) - m * v * (f + b + w)


def bubble(p: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """Idle time of torch's 'zb' step beyond the rank's own m v (f + b + w), equal stages,
    per chunk and micro-batch forward f, input gradient b, weight gradient w (module
    docstring)."""
    if p <= 1:
        return 0.0
    if v == 1 or (v >= 3 and m >= p):
        idle = (p - 1) * max(f + b - w, f, b)
        if v == 1 and m < p:
            idle += (p - m) * min(f, b, w)
        return idle
    if v == 2 and m >= 2 * p - 1:
        # constant in m from 2p - 1 on and affine in p from p = 2: two walks of 3 and 5
        # micro-batches give it at any depth
        two = _walk_bubble(2, 2, 3, f, b, w)
        return two + (p - 2) * (_walk_bubble(3, 2, 5, f, b, w) - two)
    return _walk_bubble(p, v, m, f, b, w)  # fewer micro-batches than the steady state needs


@lru_cache(maxsize=1024)
def stage_bubble(v: int, m: int, f: tuple[float, ...], b: tuple[float, ...],
                 w: tuple[float, ...]) -> float:
    """`bubble` for pipeline ranks of unequal work (per rank, all its chunks: forward f, input
    gradient b, weight gradient w of one micro-batch; the end ranks carry the embedding and
    the head), beyond m times the slowest rank's work. Equal ranks take the closed forms;
    otherwise the walk of torch's order with each rank's work split evenly over its chunks
    (cached: the plans a search compares often differ only in what the pipeline does not
    see, the ZeRO stage or the data parallelism).
    Past a few rounds of p micro-batches every round shifts the step by the same time, so
    the walk of a few rounds prices any m (`_long_idle`; tests/test_pipeline_zb.py compares
    with the walk of all m); ZB1P with v >= 3 and m not a multiple of p repeats rounds of
    m // (m // p) and is walked whole."""
    p = len(f)
    t = [x + y + z for x, y, z in zip(f, b, w)]
    if p <= 1:
        return 0.0
    if all(max(x) - min(x) <= 1e-12 * max(t) for x in (f, b, w)):
        return bubble(p, v, m, f[0] / v, b[0] / v, w[0] / v)
    where = [stage_rank(p, v, s) for s in range(p * v)]
    per = ([f[r] / v for r in where], [b[r] / v for r in where], [w[r] / v for r in where])
    return _settled_idle(p, v, m, per, max(t))


@lru_cache(maxsize=1024)
def chunk_bubble(v: int, m: int, f: tuple[float, ...], b: tuple[float, ...],
                 w: tuple[float, ...]) -> float:
    """`stage_bubble` from each virtual stage's own forward f, input gradient b and weight
    gradient w (p v entries, stage order): a rank's chunks need not be equal (the split's
    remainder, the head on rank 0 of the V beside the embedding's chunk). Chunks equal on
    every rank take `stage_bubble` (its closed forms); otherwise the walk at chunk level."""
    p = len(f) // v
    rank = [[s for s in range(p * v) if stage_rank(p, v, s) == r] for r in range(p)]
    tot = [tuple(sum(x[s] for s in mine) for mine in rank) for x in (f, b, w)]
    scale = max(max(x, default=0.0) for x in (f, b, w)) or 1.0
    if all(max(x[s] for s in mine) - min(x[s] for s in mine) <= 1e-12 * scale
           for x in (f, b, w) for mine in rank):
        return stage_bubble(v, m, *tot)
    worst = max(x + y + z for x, y, z in zip(*tot))
    return _settled_idle(p, v, m, (list(f), list(b), list(w)), worst)


def _settled_idle(p: int, v: int, m: int, per: tuple, worst: float) -> float:
    """Idle of the walk of torch's order with per-stage times `per` beyond m times the
    slowest rank's work `worst` (`stage_bubble`'s docstring: how many micro-batches)."""
    if v >= 3 and m % p:  # rounds of m // (m // p) micro-batches: walked whole
        return max(0.0, walk(p, v, m, *per) - m * worst)
    return _long_idle(p, v, m, "zb", tuple(tuple(x) for x in per), worst)


@lru_cache(maxsize=1024)
def interleaved_bubble(m: int, f: tuple[float, ...], b: tuple[float, ...], p: int) -> float:
    """Idle of torch's interleaved 1F1B beyond m times the slowest rank's work, from each
    virtual stage's own forward f and whole backward b (p v entries, stage j on rank j % p):
    the walk of its order. `pipeline.bubble_time`'s (sum t - max t) / v is this walk's only
    when a rank's chunks are equal (tests/test_pipeline_zb.py); the split's remainder and
    the end stages' embedding and head make them unequal (cached: a search meets few
    distinct chunk-time sets)."""
    v = len(f) // p
    worst = max(sum(f[s] + b[s] for s in range(r, p * v, p)) for r in range(p))
    if m % p:  # rounds of m // (m // p): walked whole
        return max(0.0, walk(p, v, m, list(f), list(b), [0.0] * (p * v),
                             schedule="interleaved") - m * worst)
    return _long_idle(p, v, m, "interleaved", (f, b, (0.0,) * (p * v)), worst)


def _long_idle(p: int, v: int, m: int, schedule: str, per: tuple, worst: float) -> float:
    """The idle of m micro-batches, at least 0, from the walk of a few rounds of p.

    The order is a warm-up, rounds of p micro-batches repeated, and a drain; the warm-up and
    the drain do not change with m (`_zb1p_order` and `interleaved_orders` once m is a
    multiple of p; `_zbv_order` and one stage per rank repeat every micro-batch), so the
    order of m + p micro-batches is that of m with one round more before the drain. Once
    every operation of three successive rounds on every rank ends a fixed time after its
    namesake of the round before (`_round_shift`), every later one does: its inputs, its
    rank's previous operation and another rank's output of the same micro-batch, lie within
    that window or after it and are shifted alike (max and + commute with adding a
    constant: the round map is max-plus linear, Baccelli et al., "Synchronization and
    Linearity", 1992, ch. 3). The drain then ends the same shift later per round added, so
    the makespan of m is that of a short walk plus the whole rounds times the shift, exactly
    but for rounding. Checking only the makespan is not enough: it can fall by a round's
    worth for rounds and then stop (one stage per rank, p = 4, a slow first stage: the
    idle drops 0.40 per micro-batch to micro-batch 18, then holds), or grow with m (a
    chain across ranks slower than any rank's own work: Llama-3-8B at pp=8 x interleaved:3
    on 32 GPUs, +0.93 s every 16 micro-batches, which the search walked to 32,768
    micro-batches: minutes and gigabytes).

    Walks of 6p micro-batches first (7p for the V from p = 6: `_drain_rounds`), doubling
    until the shift is uniform (the walk of m when it never is below m); they stay
    independent of m (but that last), so plans of other data-parallel degrees (other m, same
    chunk times; the sweeps of `meshtron simulate` search many) reuse them
    (`_span_and_shift`)."""
    runs = (5 + _drain_rounds(p, v, schedule)) * p  # the fewest `_round_shift` reads
    while runs < m:
        span, shift = _span_and_shift(p, v, runs, schedule, per)
        if shift is not None:
            rounds, rest = divmod(m - runs, p)
            if rest:  # one stage per rank or the V: it repeats every micro-batch
                span = _span_and_shift(p, v, runs + rest, schedule, per)[0]
            return max(0.0, span + rounds * shift - m * worst)
        runs *= 2
    return max(0.0, walk(p, v, m, *(list(x) for x in per), schedule=schedule) - m * worst)


@lru_cache(maxsize=8192)
def _span_and_shift(p: int, v: int, runs: int, schedule: str,
                    per: tuple[tuple[float, ...], ...]) -> tuple[float, float | None]:
    """(The makespan of `runs` micro-batches, `_round_shift` of its walk), memoised apart from
    `_long_idle`'s m (session 48's walks of 2p, 3p, ... were too)."""
    end = _ends(p, v, runs, *(list(x) for x in per), schedule=schedule)
    return max(end), _round_shift(p, v, runs, schedule, end)


def _round_shift(p: int, v: int, runs: int, schedule: str, end: list[float]) -> float | None:
    """The time by which every operation of the three rounds before the drain's
    (`_drain_rounds`) of each rank's order (a round: p micro-batches, 2 v p operations per
    rank for interleaved 1F1B, 3 v p for 'zb') ends after its namesake a round earlier, when
    that is one time for every rank and operation (to rounding); None otherwise,
    or when the walk is too short to hold them after the warm-up."""
    per = (2 if schedule == "interleaved" else 3) * v * p
    tail = _drain_rounds(p, v, schedule) * per
    chains = _rank_chains(p, v, runs, schedule)
    if min(len(c) for c in chains) < 5 * per + tail:
        return None
    # rounding only: the path from an operation to its namesake a round later adds at most
    # the p rounds of operations of all ranks, each addition within half an ulp of the
    # largest end; 1e-12 of the step accepted ranks of nearly equal work whose gap was
    # real, and carried that gap over every round (tests/test_pipeline_zb.py)
    tol = p * per * 2.0 ** -52 * max(end)
    shift = end[chains[0][-tail - per]] - end[chains[0][-tail - 2 * per]]
    for chain in chains:
        n = len(chain)
        for j in range(n - tail - 4 * per, n - tail - per):
            if abs(end[chain[j + per]] - end[chain[j]] - shift) > tol:
                return None
    return shift


def _drain_rounds(p: int, v: int, schedule: str) -> int:
    """Whole rounds at the end of each rank's order that hold its drain (the operations where
    the order of p micro-batches more differs from it: `_round_shift` reads the rounds before
    them). One for interleaved 1F1B (at most (v - 1) p + 2 (p - 1) backwards of 2 v p) and
    ZB1P (as many input and weight gradients and r weight passes more, of 3 v p); the V's rank
    r drains 7p - 5 - 3r operations (its last second-chunk forwards without a first-chunk
    one, then its backwards and weight passes), over a round of 6p from p = 6 on
    (tests/test_pipeline_zb.py reads them from the orders)."""
    if schedule == "zb" and v == 2:
        return -(-(7 * p - 5) // (6 * p))
    return 1


@lru_cache(maxsize=256)
def _rank_chains(p: int, v: int, m: int, schedule: str = "zb") -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, the indices into `_ends` of its operations in the order it runs
    them (from `_program`'s previous-operation links)."""
    _, prevs, _ = _program(p, v, m, schedule)
    after = [0] * (len(prevs) + 1)
    firsts = []
    for i, prev in enumerate(prevs, start=1):
        if prev:
            after[prev] = i
        else:
            firsts.append(i)
    chains = []
    for i in firsts:
        chain = [i]
        while after[chain[-1]]:
            chain.append(after[chain[-1]])
        chains.append(tuple(chain))
    return tuple(chains)


def interleaved_idle_floor(m: int, f: tuple[float, ...], b: tuple[float, ...], p: int) -> float:
    """A lower bound of `interleaved_bubble` (same arguments) in O(p v), without the walk, for
    the search to drop a plan whose step is over its cutoff even with this idle. Each rank runs
    its operations one at a time: it cannot start before micro-batch 0's forwards of the
    stages before its first (stage r) have run, and after its last operation (the backward of
    stage `_last_backward`, the last micro-batch) the backwards of the stages below it still
    run. So the walk's makespan is at least, for every rank, that head + its m micro-batches'
    work + that tail (hop 0, as `interleaved_bubble` walks); the idle is that minus m times
    the slowest rank's work. Tight for equal chunks ((p - 1)(f + b) on the last rank); the
    margin keeps it below the walk's own rounding."""
    v = len(f) // p
    work = [sum(f[s] + b[s] for s in range(r, p * v, p)) for r in range(p)]
    worst = max(work)
    span = max(sum(f[:r]) + m * work[r] + sum(b[:_last_backward(p, v, m, r)])
               for r in range(p))
    return max(0.0, span - m * worst - 1e-9 * m * worst)


def _last_backward(p: int, v: int, m: int, r: int) -> int:
    """The stage of rank r's last operation in torch's interleaved 1F1B order (the last
    backward of `_zb1p_order(..., whole=True)`: b_stage of its index m v - 1)."""
    per_round = m // max(1, m // p)
    return (v - 1 - ((m * v - 1) // per_round) % v) * p + r
