"""Pipeline schedules (bubble, micro-batches in flight) and the layer-to-stage partition.

Schedules, for p stages, m micro-batches, per-micro-batch stage times t_i = F_i + B_i + W_i:

* 'gpipe' (Huang et al. 2019): all forwards then all backwards; bubble (p-1) stage-times, keeps
  all m micro-batches' activations; with v > 1 chunks per device (looped BFS) the bubble is
  divided by v as interleaving's is (the first micro-batch fills p - 1 chunk-times).
* '1f1b' (PipeDream-Flush, Narayanan et al. 2021): same bubble, stage i keeps p - i micro-batches.
* 'interleaved' with v virtual stages per GPU (Narayanan et al. 2021, section 2.2.2): bubble
  divided by v; stage i keeps ((p-i-1)*2 + (v-1)*p + 1) / v micro-batches' worth of its layers,
  i.e. p(1 + (p-1)/(pv)) on the first stage (Korthikanti et al. 2022, section 4.2.3); Megatron
  requires m to be a multiple of p.
* 'zb' (Qi et al. 2024 "Zero Bubble Pipeline Parallelism"): weight-gradient work W is deferred
  into the bubble. Priced as torch.distributed.pipelining orders it (pipeline_zb.py: the ZB1P
  of ScheduleInterleavedZeroBubble, the V of ScheduleZBVZeroBubble for v = 2): with one stage
  per rank the bubble is (p-1) max(F+B-W, F, B) (the paper's (p-1)(F+B-W) while W <= F, B),
  plus (p-m) min(F, B, W) with m < p; per chunk and divided likewise with v >= 3 and m >= p;
  ZB-V and small m from the walk of torch's order.

With unequal stages the step takes (m - 1) * max_i t_i + sum_i t_i for 1F1B (the critical stage
runs m micro-batches, the fill and drain pass each other stage once): the bubble is
sum_i t_i - max_i t_i, scaled by 1/v for interleaving.

Partition (Alpa's inter-operator pass, Zheng et al. 2022, section 5.2, restricted to contiguous
layer ranges of a pipeline of fixed depth): choose layers per stage, the embedding on the first
stage and the final norm + LM head + loss on the last, minimising the slowest stage subject to
each stage's memory. Because `sum_i t_i` does not depend on the split, minimising the slowest
stage also minimises the step time above. `partition_dp` is the general dynamic programme
(any per-layer costs, O(p L^2)); `partition_layers` solves the same problem exactly for identical
layers, which is what a transformer has, in O(p log L): the slowest stage of the optimum is some
e_i + k * tau (extra work of stage i plus k layers), and "can every stage hold its share under a
bottleneck T" is a monotone test, so a binary search over k for each distinct extra finds it.
Tests check both agree.
"""

from __future__ import annotations

import bisect
import math
from functools import lru_cache

from meshtron.planner import comm, pipeline_dualpipe, pipeline_zb
from meshtron.planner.overlap import OVERLAP_INTERFERENCE
from meshtron.planner.plan import SCHEDULES  # noqa: F401  (the one list, re-exported)


def in_flight(schedule: str, p: int, v: int, m: int, stage: int) -> float:
    """Micro-batches' worth of this stage's layer activations kept at the peak of the schedule."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        chunks = (p - stage - 1) * 2 + (v - 1) * p + 1
        return min(float(m), chunks / v)
    if schedule == "dualpipe":  # DualPipe's PP+1 chunks on every rank (pipeline_dualpipe.py)
        return pipeline_dualpipe.in_flight(p, v, m)
    return float(min(m, p - stage))  # 1f1b, zb


def stages_of_rank(pp: int, v: int, schedule: str, pp_rank: int) -> list[int]:
    """Global (virtual) stage indices held by pipeline rank `pp_rank`."""
    n = pp * v
    if schedule in ("zb", "dualpipe") and v == 2:  # torch's V, DualPipeV (and folded DualPipe)
        return sorted({pp_rank, n - 1 - pp_rank})
    return list(range(pp_rank, n, pp))


@lru_cache(maxsize=1024)  # read per plan and per rank by the memory model and the times
def head_rank(pp: int, v: int, schedule: str | None) -> int:
    """Pipeline rank holding the last virtual stage (final norm, output head, loss): the last
    rank, except on torch's V (ScheduleZBVZeroBubble: stages r and 2p-1-r on rank r), where
    it is rank 0, beside the embedding (`stages_of_rank`)."""
    last = pp * v - 1
    return next(r for r in range(pp) if last in stages_of_rank(pp, v, schedule or "1f1b", r))


def p2p_time(hop: float, p: int, v: int, m: int, blocking: bool = False,
             overlap: bool = False) -> float:
    """Seconds of pipeline transfers on the critical stage's path, each `hop` seconds.

    The fill (and, mirrored, the drain) waits for the first micro-batch to cross p*v - 1
    virtual-stage boundaries one after another (p - 1 without interleaving: the chain of the
    interleaved schedule wraps around the devices v times); in the steady state every
    micro-batch crosses each of the device's v boundaries forward and backward. Blocking
    engines (DeepSpeed's) pay a receive and a send per boundary and direction. Megatron-Core's
    overlap_p2p_comm (on by default with the interleaved schedule, megatron/training/
    arguments.py; refused without it, schedules.py) posts the steady-state transfers before the
    chunk's compute and waits after it: they cost OVERLAP_INTERFERENCE of their time, the
    fill and drain chains stay exposed. Blocking without interleaving is DeepSpeed's
    TrainSchedule, whose walk gives `train_schedule_hops`."""
    if p <= 1:
        return 0.0
    if blocking and v == 1:
        return hop * train_schedule_hops(p, m)
    per_boundary = 4.0 if blocking else 2.0
    chain = p * v - 1
    if overlap:
        return per_boundary * hop * (chain + OVERLAP_INTERFERENCE * m * v)
    return per_boundary * hop * (m * v + chain)


def train_schedule_hops(p: int, m: int) -> int:
    """Transfers on the critical path of DeepSpeed's pipeline engine (runtime/pipe/schedule.py
    TrainSchedule, the same from v0.3.15 to v0.8.2; v0.8.3 on swaps each step's two transfers,
    which the walk finds costs the same count): 2(m + p - 1) steps alternate forward and
    backward slots, stage s running the forward of micro-batch b at step 2b + s and its
    backward at 2b + 2p - 1 - s; a forward step receives the activation then sends the
    previous backward's gradient, a backward step sends the previous forward's activation
    then receives the gradient (RecvActivation, SendGrad / SendActivation, RecvGrad), each
    a blocking p2p.send / p2p.recv that completes when its peer posts the matching one.
    Walking those instruction streams with every transfer a rendezvous of `hop` seconds
    (tests/test_pipeline_deepspeed.py) gives the 1F1B bubble and this many hops beyond it,
    for transfers short beside a stage's compute: the first activation's chain and the last
    gradient's, p - 1 each, and four per micro-batch on the critical stage in the steady
    state, less the six the ends of that chain share with the fill and the drain; a lone
    micro-batch pays the two chains only, and with two stages one exchange per direction
    and micro-batch hides under the other stage's compute."""
    if p <= 1:
        return 0
    if p == 2:
        return 2 * m
    if m == 1:
        return 2 * (p - 1)
    return 4 * m + 2 * p - 8


def tied_embedding_reduce(nbytes: float, crosses_nodes: bool, fab: comm.Fabric) -> float:
    """Seconds of the all-reduce of a tied word embedding's gradient (`nbytes` per rank, in the
    gradient dtype) between the first stage (input embedding) and the last (the head's copy of
    it), which Megatron and DeepSpeed run after the step's backward, before the optimizer:
    Megatron-Core finalize_model_grads.py `_allreduce_word_embedding_grads` over the embedding
    group (2021: megatron/training.py after allreduce_gradients), DeepSpeed's pipeline engine
    `ReduceTiedGrads` (runtime/pipe/engine.py `_exec_reduce_tied_grads`). Nothing is left to
    hide it: rank 0 finishes the step's backward last. (meshtron's runtime refuses tied
    embeddings across stages, plan_rules.model_problems.)"""
    return comm.all_reduce(nbytes, comm.Group(2, 1 if crosses_nodes else 2), fab)


def reduce_after_drain(reduce_s: float, v: int, stage: int, bwd: float, idle: int = 0,
                       interference: float = OVERLAP_INTERFERENCE) -> float:
    """Exposed seconds of a pipeline rank's gradient reduction (`reduce_s`, all its chunks) when
    torch.distributed.pipelining runs it after each stage's last backward: FSDP's gradient
    sync is off for the step's micro-batches (stage.py `backward_maybe_with_nosync`:
    set_requires_gradient_sync(False), set_reshard_after_backward(False)) and the stage's
    reduce-scatters are issued only after its last backward (torch 2.4-2.5 run_post_backward
    on last_backward; 2.6+ `perform_reduce_grad`, the REDUCE_GRAD action that
    schedules.py `_add_reduce_grad` puts right after the stage's last B/W, before the rank's
    next action). perform_reduce_grad then calls `_root_post_backward_final_callback` with
    is_last_backward set, whose FSDPParamGroup.finalize_backward makes the compute stream wait
    for the reductions (current_stream().wait_event on the post-reduce events): no compute of
    the rank runs beside them. With v chunks of reduce_s / v each, every chunk but the rank's
    last finishes its backwards while the rank still has backwards of other chunks to run on
    the drain's critical chain (the last micro-batch passes every rank once per chunk), so
    each of those v - 1 stalls delays the step whole; the last chunk's reduction comes after
    the rank's last backward, which rank `stage` ends `stage` chunk-backwards (bwd / v each,
    `bwd`: one micro-batch's backward of the whole rank) before rank 0 (1F1B's and the
    interleaved schedule's drain): that idle hides it. Rank 0 exposes all of it. A looped
    schedule with fewer micro-batches than stages waits `idle` (= p - m) chunk-slots at each
    chunk change (`bubble_time`), which hides that much of each earlier chunk's stall. An
    event walk of the schedules' device orders with these stalls gives exactly this
    (tests/test_pipeline_split.py)."""
    if reduce_s <= 0.0:
        return 0.0
    v = max(1, v)
    last, chunk_bwd = reduce_s / v, bwd / v
    exposed = (v - 1) * max(0.0, last - idle * chunk_bwd) + max(0.0, last - stage * chunk_bwd)
    return exposed + interference * (reduce_s - exposed)


def bubble_time(schedule: str, v: int, stage_times: list[float], wgrad_times: list[float],
                m: int | None = None, fwd_times: list[float] | None = None) -> float:
    """Idle time of the critical stage beyond its own m micro-batches (see module docstring);
    stage_times, wgrad_times and fwd_times per device, all its chunks (m None: as many
    micro-batches as the steady state needs).

    Looped schedules (interleaved, and gpipe with v > 1: looped BFS) send micro-batch 0 of
    chunk c + 1 into device 0 only after it went round all p devices in chunk c. With m >= p
    micro-batches per round device 0 is busy meanwhile; with fewer (torch's Interleaved1F1B
    runs rounds of max(1, m // p): m < p is one round of m, schedules.py) it waits p - m
    chunk-times at each of the v - 1 chunk changes, forward and backward alike: the wave's
    makespan is v m + p - 1 + (v - 1)(p - m) chunk-slots instead of v m + p - 1."""
    p = len(stage_times)
    if p <= 1:
        return 0.0
    worst = max(stage_times)
    fill = sum(stage_times) - worst
    if schedule == "interleaved" or (schedule == "gpipe" and v > 1):
        idle = (v - 1) * max(0, p - m) * sum(stage_times) / p / v if m else 0.0
        return fill / v + idle
    if schedule == "zb":
        return _zb_bubble(v, stage_times, wgrad_times, fwd_times, m)
    if schedule == "dualpipe":  # the critical rank's two chunks (pipeline_dualpipe.bubble)
        crit = max(range(p), key=stage_times.__getitem__)
        fwd = fwd_times[crit] if fwd_times is not None else stage_times[crit] / 3.0
        return pipeline_dualpipe.bubble(p, v, fwd, stage_times[crit], wgrad_times[crit])
    return fill


def _zb_bubble(v: int, stage_times: list[float], wgrad_times: list[float],
               fwd_times: list[float] | None, m: int | None) -> float:
    """torch's zero-bubble step (pipeline_zb.stage_bubble: the walk of its order, closed
    forms for equal stages). A caller without forward times (diagnose's measured per-stage
    compute) gets a third of each stage as its forward, the backward twice the forward (its
    matrix products: twice the FLOPs)."""
    p = len(stage_times)
    if fwd_times is None:
        fwd_times = [t / 3.0 for t in stage_times]
    bwd_in = [max(0.0, t - f - w) for t, f, w in zip(stage_times, fwd_times, wgrad_times)]
    return pipeline_zb.stage_bubble(v, m if m else 2 * p, tuple(fwd_times), tuple(bwd_in),
                                    tuple(wgrad_times))


def _stage_extras(p: int, first_extra: float, last_extra: float) -> list[float]:
    extras = [0.0] * p
    extras[0] += first_extra
    extras[-1] += last_extra
    return extras


def partition_layers(layers: int, p: int, layer_time: float, first_extra: float = 0.0,
                     last_extra: float = 0.0, caps: list[int] | None = None,
                     min_layers: int = 1) -> list[int] | None:
    """Layers per stage minimising the slowest stage for identical layers; None if infeasible.

    caps[i] is the most layers stage i can hold in memory (None: unlimited). Surplus capacity at
    the optimum is taken away from the first stages, which hold the most micro-batches.
    The feasibility test for a bottleneck T sums u_i = min(cap_i, floor((T - e_i) / tau)); the
    middle stages (no extra work) are summed in O(log p) from their sorted caps.
    """
    if p * min_layers > layers:
        return None
    extras = _stage_extras(p, first_extra, last_extra)
    caps = list(caps) if caps is not None else [layers] * p
    if min(caps) < min_layers or sum(caps) < layers:
        return None
    tau = max(layer_time, 1e-30)
    ends = [0] if p == 1 else [0, p - 1]
    mid = sorted(caps[1:-1]) if p > 2 else []
    prefix = [0]
    for c in mid:
        prefix.append(prefix[-1] + c)

    def feasible(bound: float) -> bool:
        total = 0
        for i in ends:
            u = min(caps[i], int(math.floor((bound - extras[i]) / tau + 1e-9)))
            if u < min_layers:
                return False
            total += u
        if mid:
            k = int(math.floor(bound / tau + 1e-9))
            if k < min_layers:
                return False
            j = bisect.bisect_left(mid, k)
            total += prefix[j] + k * (len(mid) - j)
        return total >= layers

    best = math.inf
    for e in set(extras):
        lo, hi = min_layers, layers
        if not feasible(e + hi * tau):
            continue
        while lo < hi:
            md = (lo + hi) // 2
            if feasible(e + md * tau):
                hi = md
            else:
                lo = md + 1
        best = min(best, e + lo * tau)
    if best == math.inf:
        return None
    n = [min(c, int(math.floor((best - e) / tau + 1e-9))) for c, e in zip(caps, extras)]
    surplus = sum(n) - layers
    for i in range(p):
        if surplus <= 0:
            break
        take = min(surplus, n[i] - min_layers)
        n[i] -= take
        surplus -= take
    return n


def partition_dp(layer_times: list[float], p: int, first_extra: float = 0.0,
                 last_extra: float = 0.0, caps: list[int] | None = None,
                 min_layers: int = 1) -> tuple[float, list[int]] | None:
    """General dynamic programme: (slowest-stage time, layers per stage), or None if infeasible.

    best[s][j] = min over i of max(best[s-1][i], cost of layers i..j-1 on stage s-1), the
    recurrence of Alpa's inter-operator pass for a fixed pipeline depth.
    """
    L = len(layer_times)
    extras = _stage_extras(p, first_extra, last_extra)
    caps = caps or [L] * p
    prefix = [0.0]
    for t in layer_times:
        prefix.append(prefix[-1] + t)
    inf = math.inf
    best = [[inf] * (L + 1) for _ in range(p + 1)]
    choice = [[-1] * (L + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        for j in range(s * min_layers, L + 1):
            for i in range(max(0, j - caps[s - 1]), j - min_layers + 1):
                if best[s - 1][i] == inf:
                    continue
                cost = max(best[s - 1][i], prefix[j] - prefix[i] + extras[s - 1])
                if cost < best[s][j]:
                    best[s][j], choice[s][j] = cost, i
    if best[p][L] == inf:
        return None
    n, j = [], L
    for s in range(p, 0, -1):
        i = choice[s][j]
        n.append(j - i)
        j = i
    return best[p][L], n[::-1]


def min_memory_partition(layers: int, per_layer: list[float], fixed: list[float],
                         min_layers: int = 1) -> tuple[float, list[int]]:
    """Split minimising the fullest stage's memory n_i * per_layer[i] + fixed[i] (bisection)."""
    p = len(per_layer)

    def counts(bound: float) -> list[int]:
        return [int(math.floor((bound - f) / max(a, 1e-30) + 1e-9)) for a, f in zip(per_layer, fixed)]

    lo = max(f + a * min_layers for a, f in zip(per_layer, fixed))
    hi = max(f + a * layers for a, f in zip(per_layer, fixed))
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        u = counts(mid)
        if min(u) >= min_layers and sum(u) >= layers:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * hi:
            break
    n = [max(min_layers, c) for c in counts(hi)]
    surplus = sum(n) - layers
    for i in range(p):
        take = min(max(surplus, 0), n[i] - min_layers)
        n[i] -= take
        surplus -= take
    return max(a * k + f for a, k, f in zip(per_layer, n, fixed)), n


def split_virtual(stage_layers: list[int], v: int, schedule: str | None = None) -> list[int]:
    """Split each device's layers into v chunks; returns p*v counts in pipeline order
    (virtual stage j = chunk * p + device, as Megatron's interleaved schedule numbers them;
    torch's V for 'zb' with v = 2: `stages_of_rank`)."""
    return list(_split_virtual(tuple(stage_layers), v, schedule or "1f1b"))


@lru_cache(maxsize=4096)  # the time and memory models ask for every plan's split, few differ
def _split_virtual(stage_layers: tuple[int, ...], v: int, schedule: str) -> tuple[int, ...]:
    p = len(stage_layers)
    out = [0] * (p * v)
    for i, n in enumerate(stage_layers):
        base, extra = divmod(n, v)
        for c, s in enumerate(stages_of_rank(p, v, schedule, i)):
            out[s] = base + (1 if c < extra else 0)
    return tuple(out)
