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
rehearsal; with the weighting -2.2% on the fullest rank of that plan).

FSDP2 accumulates a chunk's gradients unsharded from its first backward on, so the moment the
activations are largest need not be the one the gradients are: with 16 micro-batches on 16
stages (no steady phase) a rank holds every gradient only when one chunk's micro-batches are
left (Llama 3 405B pipeline rank 1: the planner read +10.4% counting both at most, -3.3% with
the walk below).

`weighted_in_flight` walks the schedule's order (torch's ScheduleInterleaved1F1B, which is
Megatron-LM's: forwards visit the chunks in rounds of m / max(1, m // p) micro-batches,
backwards the same with the chunks reversed, warm-up (v - 1) round + 2 (p - 1 - s)
forwards) and takes the largest sum over chunks of micro-batches held x layers. The round is
Megatron-Core's microbatch_group_size_per_vp_stage (default pp; schedules.py refuses a
remainder of m by it below pp, so m is a multiple of p there and the rounds are the same).
It is every engine's count that runs this order, Megatron's too: its chunks are uneven under
account_for_embedding/loss_in_pipeline_split (the first and last chunk a layer short: the
Llama 3 paper's layout, section 3.3.2, "the first model chunk on the first stage has only the
embedding") and under the planner's time-balanced split. The even spread over-charged the
first rank there (Llama 3 405B, pp 16, v 8, 32 micro-batches: 125 layer-micro-batches
against the 112 its seven one-layer chunks hold) and under-charged the last (99 against 113).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate, chain, compress
from operator import add

from meshtron.planner.pipeline import stages_of_rank


def _visits(p: int, v: int, m: int) -> list[int]:
    """The chunk of the rank's forwards 0 .. m v - 1 in the schedule's order: rounds of
    m / max(1, m // p) micro-batches, chunks 0 .. v - 1 in turn (backward b visits chunk
    v - 1 - this of b)."""
    per_round = m // max(1, m // p)
    cycle = [c for c in range(v) for _ in range(per_round)]
    return (cycle * (m * v // len(cycle) + 1))[:m * v]


def walked_microbatches(p: int, v: int, m: int, extra: int = 0) -> int:
    """The micro-batches whose walk gives the same peaks as the walk of m (`held_bytes`,
    `peak_outputs`, `last_rank_moments`, `backward_work`). With m a multiple of p the order
    is a warm-up of at most (v + 1) p + extra forwards, rounds of p micro-batches over the
    chunks in turn, and a drain, the warm-up and the drain the same for every such m. Once
    every chunk has run its first backward (backward (v - 1) p on), a round of v rounds
    (p v forwards and as many backwards over every chunk p times) adds and frees the same
    bytes: the running sums repeat from one such round to the next, and the walk of more
    micro-batches only repeats them. Its peaks (their first moments, and the outputs then)
    are those of a walk that holds one whole repeat after the warm-up and the chunks' first
    backwards: m v >= 3 p v + extra, m >= 3 p + extra / v; one round more is kept. Equal to
    the walk of every micro-batch but for rounding (the repeats' running sums differ in their
    last bits, under 1e-13 of the bytes): tests/test_memory_pipeline_walk.py
    (a search of 32,768 micro-batches walked each rank of each interleaved plan whole:
    Llama-3-8B, --global-batch 32768 on 32 GPUs, two minutes)."""
    if m % p:
        return m  # rounds of m // (m // p): their own order
    return min(m, p * (4 + -(-extra // (p * v))))


def held_bytes(p: int, v: int, m: int, s: int, layers: list[int], act: float = 1.0,
               grad: float = 0.0, extra: int = 0, odd: float = 0.0) -> float:
    """Most bytes of stored activations (`act` per layer and micro-batch) and accumulated
    gradients (`grad` per layer, alive from a chunk's first backward on: FSDP2 keeps the
    unsharded gradient it accumulates over the step's micro-batches from then) pipeline rank
    `s` holds at once under interleaved 1F1B; `layers[c]`: the layers of its c-th chunk
    (virtual stage c p + s). With `grad` 0: layer-micro-batches held. `extra`: warm-up
    forwards beyond the schedule's own (`a2a_overlap_in_flight`); `odd`: bytes per
    micro-batch a chunk of an odd layer count holds beyond `act` per layer (`half_odd_bytes`).
    The walk (forward k, then backward k - warm; then the drain), its steps' order cached per (p, v, m, s, extra)
    (`_held_steps`) and summed by itertools.accumulate: the same additions in the same order
    (x - y is x + (-y) in IEEE 754), so the same bits, without a Python step per operation
    (the search walks every rank of every interleaved plan: session 48)."""
    steps, checked = _held_steps(p, v, walked_microbatches(p, v, m, extra), s, extra)
    stored = [act * n + (odd if n % 2 else 0.0) for n in layers]
    # indexed as `_held_steps` numbers them: forward c, first backward's gradients, freed
    table = stored + [grad * n for n in layers[::-1]] + [-x for x in stored[::-1]]
    now = accumulate(map(table.__getitem__, steps), initial=0.0)
    return max(compress(now, checked))


def peak_outputs(p: int, v: int, m: int, s: int, layers: list[int], act: float, grad: float,
                 out: float, odd: float = 0.0) -> float:
    """Chunk outputs (`held_outputs`) pipeline rank `s` holds at the moment its stored
    activations (`act` per layer and micro-batch), accumulated gradients (`grad` per layer)
    and the outputs themselves (`out` bytes each) are largest together under interleaved 1F1B
    (the walk of `held_bytes`): with few micro-batches per stage the peak comes late, when
    few are in flight, not at the most chunk-micro-batches of the even spread. The walk's first
    strict maximum (tests/test_memory_pipeline_walk.py: equal to a step-by-step walk's), the steps cached (`_output_steps`) and
    summed by itertools.accumulate in the same order: the same bits."""
    steps, outs = _output_steps(p, v, walked_microbatches(p, v, m), s)
    sends = [c * p + s != p * v - 1 for c in range(v)]
    held = [act * n + (odd if n % 2 else 0.0) for n in layers]
    back = [v - 1 - c for c in range(v)]
    grads = [grad * layers[c] for c in back]
    # indexed as `_output_steps` numbers them (the loop's own expressions, formed once)
    table = ([held[c] + (out if sends[c] else 0.0) for c in range(v)]
             + [g + out for g in grads] + [0.0 + out] + grads + [0.0]
             + [-held[c] - 2.0 * out if sends[c] else -held[c] for c in back])
    now = list(accumulate(map(table.__getitem__, steps), initial=0.0))
    return float(outs[now.index(max(now))])


@lru_cache(maxsize=1024)
def _held_steps(p: int, v: int, m: int, s: int, extra: int) -> tuple[tuple[int, ...],
                                                                      tuple[bool, ...]]:
    """The walk's additions in order, as indices into `held_bytes`' table (forward
    of chunk c: c; the first backward of forward-order chunk c: v + c; its freeing: 2 v + c),
    and per running sum (the initial 0 first) whether the loop compares it with its best."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + 2 * (p - 1 - s) + extra, m * v)
    visits = _visits(p, v, m)
    steps, checked = list(visits[:warm]), [True] * (1 + len(visits[:warm]))
    accumulated = [False] * v
    for c, cb in zip(visits[warm:] + [-1] * warm, visits):
        if c >= 0:
            steps.append(c)
            checked.append(True)
        if not accumulated[cb]:
            accumulated[cb] = True
            steps.append(v + cb)
            checked.append(True)
        steps.append(2 * v + cb)
        checked.append(False)
    return tuple(steps), tuple(checked)


@lru_cache(maxsize=1024)
def _freeing(p: int, v: int, m: int, s: int, extra: int) -> tuple[tuple[bool, ...],
                                                                   tuple[int, ...]]:
    """Of `_held_steps(p, v, m, s, extra)`: per running sum (the initial 0 first), whether
    a freeing step follows it, and those steps' forward-order chunks."""
    steps, _ = _held_steps(p, v, m, s, extra)
    before = tuple(x >= 2 * v for x in steps) + (False,)
    return before, tuple(x - 2 * v for x in steps if x >= 2 * v)


@lru_cache(maxsize=1024)
def _output_steps(p: int, v: int, m: int, s: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The walk's additions in order, as indices into `peak_outputs`' table
    (forward of chunk c: c; backward of forward-order chunk c sending, its first: v + c, a
    later one: 2 v; not sending, its first: 2 v + 1 + c, a later one: 3 v + 1; its freeing:
    3 v + 2 + c), and per running sum (the initial 0 first) the outputs held then; every sum
    is compared with the best, as the loop does."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + 2 * (p - 1 - s), m * v)
    visits = _visits(p, v, m)
    sends = [c * p + s != p * v - 1 for c in range(v)]
    bsends = [sends[v - 1 - c] for c in range(v)]
    steps: list[int] = []
    outs, held = [0], 0
    for c in visits[:warm]:
        steps.append(c)
        held += sends[c]
        outs.append(held)
    accumulated = [False] * v
    for c, cb in zip(visits[warm:] + [-1] * warm, visits):
        if c >= 0:
            steps.append(c)
            held += sends[c]
            outs.append(held)
        first = not accumulated[cb]
        accumulated[cb] = True
        if bsends[cb]:
            steps.append(v + cb if first else 2 * v)
            outs.append(held + 1)
            held -= 1
        else:
            steps.append(2 * v + 1 + cb if first else 3 * v + 1)
            outs.append(held)
        steps.append(3 * v + 2 + cb)
        outs.append(held)
    return tuple(steps), tuple(outs)


def last_rank_moments(p: int, v: int, m: int, layers: list[int], act: float, grad: float,
                      out: float, extra: int = 0, odd: float = 0.0
                      ) -> tuple[tuple[float, int], tuple[float, int]]:
    """Of the last pipeline rank (s = p - 1: its chunk v - 1 is the last virtual stage, the
    loss's), ((held, outputs) at its fullest moment, (held, outputs) at its fullest loss
    moment), walked as `peak_outputs` (the same order and bytes: `held` the stored
    activations and accumulated gradients, `outputs` the chunk outputs kept, `out` bytes each,
    the moment chosen by held + outputs x out). The loss moments are the starts of chunk
    v - 1's backwards: the logits and their gradients alive, that chunk's gradients not yet
    made by its first backward. In this order a loss moment always follows chunk v - 1's
    own forward in the same step (the rank's warm-up is (v - 1) rounds: forward k + warm and
    backward k visit chunk v - 1 together), so one micro-batch's logits are alive at a time,
    as the memory model counts them; the loss of the last chunk comes late in a round, when
    the first chunks' micro-batches have begun to leave, so the rank is priced at the larger
    of its loss moment and its fullest one (estimate.Evaluator._last_rank_moment), not their
    sum. The received output gradients are not counted: the rank's receive buffers hold them
    (`receive_buffers`, none counted beside the outputs on the last rank)."""
    m = walked_microbatches(p, v, m, extra)
    per_round = m // max(1, m // p)
    total = m * v
    warm = min((v - 1) * per_round + extra, total)
    visits = _visits(p, v, m)
    held = [act * n + (odd if n % 2 else 0.0) for n in layers]  # `held_bytes`' `stored`
    sends = [1 if c != v - 1 else 0 for c in range(v)]
    accumulated = [False] * v
    now, outs = 0.0, 0
    # (held + outputs' bytes, held, outputs) at the first moment of the largest of each kind
    best = loss = (float("-inf"), 0.0, 0)
    for c in visits[:warm]:  # the warm-up: forwards only
        now += held[c]
        outs += sends[c]
        if now + outs * out > best[0]:
            best = (now + outs * out, now, outs)
    for c, f in zip(visits[warm:] + [-1] * warm, visits):
        if c >= 0:  # forward k, then backward k - warm (of chunk v - 1 - f)
            now += held[c]
            outs += sends[c]
            if now + outs * out > best[0]:
                best = (now + outs * out, now, outs)
        b = v - 1 - f
        if b == v - 1 and now + outs * out > loss[0]:
            loss = (now + outs * out, now, outs)
        if not accumulated[b]:  # its first backward makes the chunk's gradients
            accumulated[b] = True
            now += grad * layers[b]
            if now + outs * out > best[0]:
                best = (now + outs * out, now, outs)
        now -= held[b]
        outs -= sends[b]
    return (best[1], best[2]), (loss[1], loss[2])


def held_layer_microbatches(p: int, v: int, m: int, s: int, layers: list[int]) -> int:
    """Most (micro-batch x layer) activations pipeline rank `s` holds at once under
    interleaved 1F1B; `layers[c]`: the layers of its c-th chunk (virtual stage c p + s)."""
    return round(held_bytes(p, v, m, s, layers))


def weighted_in_flight(p: int, v: int, m: int, chunk_layers: list[int], even: list[float],
                       act: float = 1.0, grad: float = 0.0, extra: int = 0,
                       odd: float = 0.0) -> list[float]:
    """Per pipeline rank, micro-batches' worth of its layers held at its peak (the multiplier
    `pipeline.in_flight` gives, `even`, which the planner adds to every layer's accumulated
    gradient), from the chunks' own layer counts (`chunk_layers`, p v entries in
    virtual-stage order) and, with accumulated gradients (`grad` bytes per layer beside `act`
    per layer and micro-batch), from the moment both are largest together: a chunk's
    gradients appear at its first backward, when its micro-batches start to leave. The walk
    is the order's own count, below the even spread where a rank's first chunks are the
    light ones (Megatron-Core's account_for_embedding_in_pipeline_split leaves the very
    first chunk without its layer, and that chunk holds the most micro-batches). `extra`:
    warm-up forwards beyond the schedule's own (`a2a_overlap_in_flight`); `odd`: as
    `held_bytes`, folded into the multiplier."""
    out = []
    for s in range(p):
        layers = [chunk_layers[c * p + s] for c in range(v)]
        n = sum(layers)
        if not n:
            out.append(even[s])
            continue
        peak = held_bytes(p, v, m, s, layers, act, grad, extra, odd)
        held = (peak - grad * n) / (act * n)  # the multiplier beside every layer's gradients
        out.append(held)
    return out


def stage_output_bytes(hidden: int, tp: int, sp: bool, micro_batch: int, seq: int,
                       compute_bytes: float) -> float:
    """Bytes of one chunk's output for one micro-batch: the hidden states a stage sends to the
    next, [micro_batch, seq, hidden] in the compute dtype (`seq` the rank's tokens: seq/cp),
    sequence-sharded over the tensor group with sequence parallelism (as meshtron's tensor
    parallelism leaves a block's output), whole on every tensor rank without."""
    return micro_batch * seq * hidden * compute_bytes / (tp if sp and tp > 1 else 1)


def held_outputs(pp: int, v: int, in_flight: list[float]) -> list[float]:
    """Per pipeline rank, chunk outputs alive at the peak. torch's pipelining keeps each
    forwarded chunk's output until that micro-batch's backward (PipelineStage.fwd_cache holds
    (stage_output, input_values) from forward_one_chunk; backward_one_chunk pops it and runs
    autograd from that output with the gradient received from the next stage): nothing else
    saves a stage's last block output, so every chunk-micro-batch in flight holds one, plus the
    received output gradient of the chunk running its backward. `in_flight`: the
    micro-batches' worth of the rank's layers it holds (`pipeline.in_flight`: chunk
    micro-batches / v). The last virtual stage's output is the logits (`logits_bytes`, with
    the pipeline's kept copy): its share of the last rank's chunks has none here, nor the
    received gradient (that rank's peak is the loss's moment; an interleaved last rank's
    outputs are walked at its moments instead, `last_rank_moments`). Megatron-LM
    keeps only the outputs' autograd nodes (`deallocate_output_tensor` frees their data once
    sent; deallocate_pipeline_outputs, on in its training arguments): the caller counts
    these for torch's pipelining only."""
    if pp == 1:
        return [0.0] * len(in_flight)
    # the last rank's peak is its loss (the logits), where no output gradient is received
    return [in_flight[s] * (v - 1) if s == pp - 1 else in_flight[s] * v + 1.0
            for s in range(pp)]


def receive_buffers(pp: int, v: int, m: int, schedule: str, in_flight: list[float],
                    inputs_saved: bool, counted: list[float]) -> list[float]:
    """Per pipeline rank, stage-sized tensors ([micro_batch, seq, hidden], `stage_output_bytes`)
    that torch 2.13's PipelineStage keeps for receiving, beyond those counted elsewhere. It
    makes one buffer per micro-batch of the step, not per micro-batch in flight, when the
    schedule first runs, and keeps them across steps (stage.py `_setup_forward_recv_info`:
    `_make_tensor_from_meta` for every chunk into `args_recv_info[chunk]`;
    `_setup_backward_recv_info`: the same into `grad_recv_info[chunk]`): m inputs on every
    non-first stage of the rank, m output gradients on every non-last one (torch's V passes
    its turn's tensors instead of receiving them, `set_local_fwd_input` /
    `set_local_bwd_input`, and keeps those to the next step in the same places: the same
    count). A received input is its buffer (`_retrieve_recv_activations`, no copy), so those
    in flight are already a block's saved input where the first norm saves its input
    (`inputs_saved`: a fused norm; the composite one saves fp32 copies instead): they are
    left out here, `in_flight[s]` micro-batches' worth of the rank's v chunks (the
    non-first ones' share). `counted`: per rank, output gradients already counted beside
    the kept outputs (`held_outputs`' one received gradient). Measured with the rehearsal
    (rehearse/pipeline_step.py `ReceiveBuffers`), 'mid', pp=2, m=12, interleaved:2: the
    rank's total +0.52 GiB."""
    if pp == 1:
        return [0.0] * len(in_flight)
    last = pp * v - 1
    out = []
    for s in range(pp):
        stages = stages_of_rank(pp, v, schedule, s)
        non_first = sum(j != 0 for j in stages)
        held = m * (non_first + sum(j != last for j in stages)) - counted[s]
        if inputs_saved:
            held -= in_flight[s] * v * non_first / len(stages)
        out.append(max(0.0, held))
    return out


def deepspeed_pipe_buffers(pp: int, m: int) -> list[float]:
    """Per pipeline rank, whole stage activations DeepSpeed's pipeline engine keeps beside
    what autograd saves (deepspeed/runtime/pipe/engine.py): it runs `num_pipe_buffers` =
    max(2, min(pp - stage, m)) buffers (schedule.py TrainSchedule), each holding the received
    input (`_exec_recv_activations` stores a clone of the receive buffer; the forward runs on
    a further clone, which the first block saves as its input) and the stage's output
    (`_exec_forward_pass` keeps `pipe_buffers['outputs']` until the backward runs autograd
    from it; only with activation partitioning, `partition_activations`, off by default, is
    its data cleared). The first stage receives no activation, the last sends none (its
    output is the loss); each rank also holds the engine's one receive buffer and one
    gradient buffer for the output's gradient."""
    if pp == 1:
        return [0.0]
    out = []
    for s in range(pp):
        buffers = max(2, min(pp - s, m))
        held = buffers * ((s > 0) + (s < pp - 1))
        out.append(held + (s > 0) + (s < pp - 1))  # + the receive and the gradient buffer
    return out


def a2a_overlap_in_flight(in_flight: list[float], v: int, m: int) -> list[float]:
    """Per pipeline rank, `in_flight` (micro-batches' worth of the rank's layers,
    `pipeline.in_flight`) under Megatron-Core's interleaved schedule with
    overlap_moe_expert_parallel_comm: it runs one more warm-up forward on every rank "to
    ensure the forward and backward computations are independent in all 1f1b steps"
    (schedules.py get_pp_rank_microbatches: num_warmup_microbatches + 1), whose forward and
    another micro-batch's backward then run as one combined step: one more chunk-micro-batch
    (1/v of the rank's layers) alive at the peak, at most every micro-batch of the step."""
    return [min(float(m), f + 1.0 / v) for f in in_flight]


def held_lower_bound(p: int, v: int, m: int, s: int, layers: list[int], act: float = 1.0,
                     grad: float = 0.0, extra: int = 0) -> float:
    """A lower bound of `held_bytes` (same arguments) in O(v) instead of the walk's O(m v):
    the largest of three values the walk itself reaches, so never above its maximum. (a) Just
    before the first backward: the warm-up's `warm` + 1 forwards are held and no gradient
    exists yet; they visit the chunks in the forward order, rounds of `per_round`. (b) That
    moment is also when the walk holds the most chunk-micro-batches (each later step runs a
    forward and a backward, the drain only backwards: warm + 1, at most m v, the count
    `pipeline.in_flight` gives), each holding at least the lightest chunk's layers. (c) After
    the last backward: every chunk's gradients, no activation. The search prunes with it
    (Evaluator._walk_may_fit) and the walk decides the rest."""
    per_round = m // max(1, m // p)
    total = m * v
    warm = min((v - 1) * per_round + 2 * (p - 1 - s) + extra, total)
    held = min(warm + 1, total)  # forwards 0..warm: whole cycles of v rounds, then the rest
    cycles, rest = divmod(held, per_round * v)
    first = sum((cycles * per_round + min(max(rest - c * per_round, 0), per_round)) * n
                for c, n in enumerate(layers))
    return max(act * first, act * held * min(layers), grad * sum(layers))


def half_odd_bytes(none: float, full: float) -> float:
    """Bytes per micro-batch a model part of an odd layer count holds beyond the mean per
    layer under `half` recomputation: meshtron checkpoints blocks 1, 3, ... of each part
    (parallel/recompute.py, `i % 2 == 1` over the part's own `layers`), so a part of n blocks
    stores ceil(n/2) whole (`none` bytes each) and floor(n/2) by their input only (`full`),
    half a stored block less a checkpointed one more than n times their mean. Rehearsed, 'mid'
    pp=2 interleaved:2 ZeRO-1 half: 12 layers (chunks of 3) -10.4% against 16 (of 4) -2.5%."""
    return 0.5 * (none - full)


def half_recomputes_first(blocks: int) -> bool:
    """Under meshtron's `half` (blocks 1, 3, ... of each model part checkpointed,
    parallel/recompute.py), whether a chunk of `blocks` blocks recomputes a block beside all
    its saved tensors. A part of an even count ends in a checkpointed block, recomputed
    first, before anything is freed. A part of an odd count ends in a stored one (block
    n - 1, n - 1 even), so its checkpointed block n - 2 is recomputed only once block n - 1's
    backward has freed its saved tensors (autograd frees a node's saved tensors after it
    runs; torch.utils.checkpoint's non-reentrant recomputation runs inside the checkpointed
    block's own backward, when the first of its saved tensors is unpacked: `_checkpoint_hook`
    `unpack_hook`): the recomputed block takes the freed block's place, and the chunk's
    fullest backward moment holds what a chunk without recomputation holds beside its
    saved activations. Rehearsed, 'mid' pp=2 interleaved:2 half, 12 layers (chunks of 3),
    pipeline rank 0: the peak in block 1's recomputed MLP backward, 6.994 GiB, which the
    planner read 7.347 with a recomputed block beside the stored ones (+5.1%)."""
    return blocks > 0 and blocks % 2 == 0


def backward_work(p: int, v: int, m: int, s: int, layers: list[int], works: list[float],
                  act: float = 1.0, grad: float = 0.0, extra: int = 0,
                  odd: float = 0.0) -> float:
    """The block moment's working set of pipeline rank `s` whose chunks' backwards hold
    different ones (`works[c]` beside the saved activations for the c-th chunk's; under
    `half` a chunk that ends in a stored block holds no recomputed block,
    `half_recomputes_first`): the most the walk of `held_bytes` (same other
    arguments) holds at a backward with that backward's working set, less the walk's own
    peak, so that the walk's peak plus this is that moment. Between the smallest and the
    largest of `works`: every step after the warm-up runs a backward on what its forward
    left, so some backward holds the walk's peak. Rehearsed, 'mid' pp=2 interleaved:2 half,
    14 layers, pipeline rank 0 (chunks of 3 and 4): the peak comes once both chunks'
    gradients are accumulated, in the 3-layer chunk's backward (7.41 GiB, and 7.43 in the
    forward before it), where the planner had priced the 4-layer chunk's recomputed block
    (7.757, +4.4%)."""
    # `held_bytes`' running sums (the same steps and table), read before each freeing step:
    # the backward then holds its chunk's gradients, not yet its freed activations
    m = walked_microbatches(p, v, m, extra)
    steps, checked = _held_steps(p, v, m, s, extra)
    before, chunks = _freeing(p, v, m, s, extra)
    stored = [act * n + (odd if n % 2 else 0.0) for n in layers]
    table = stored + [grad * n for n in layers[::-1]] + [-x for x in stored[::-1]]
    now = list(accumulate(map(table.__getitem__, steps), initial=0.0))
    best = max(compress(now, checked))
    work = works[::-1]  # the backward of chunk v - 1 - cb, at its fullest
    top = max(chain((0.0,), map(add, compress(now, before), map(work.__getitem__, chunks))))
    return min(max(top - best, min(works)), max(works))
