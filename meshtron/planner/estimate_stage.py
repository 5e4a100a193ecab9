"""Per-stage costs beside the step's critical path (estimate.Evaluator's helpers): the last
stage's head with a chunked loss, gradient accumulation passes, a stage's parameters, the
data-parallel time of a stage holding experts, host memory under offload, the search's
lower bound, and the layer split a plan fixes itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from meshtron.planner import compression, compute, memory, moe_cost, moe_memory, pipeline
from meshtron.planner.cluster import HOST_USABLE_FRACTION
from meshtron.planner.plan import Plan


class StageDp(NamedTuple):
    """One pipeline rank's exposed data-parallel time (`StageCosts.stage_dp`) and how it was
    priced, so the simulator places the same time the planner adds up."""

    total: float
    path: str
    """'none' (no data parallelism), 'compressed' (compression.dp_time), 'experts'
    (`_dp_with_experts`) or 'dense' (`_dp_time`)."""
    drain: tuple[int, int, float, int] | None
    """pipeline.reduce_after_drain's (v, rank, backward, idle slots) when FSDP2 under
    torch.distributed.pipelining reduces after the rank's last backward, else None."""


FSDP_GRAD_BYTES = 4.0
"""Bytes per element of the sharded gradient FSDP2 leaves for the optimizer: foreach_reduce
casts the reduced gradient to the sharded parameter's own dtype (torch/distributed/fsdp/
_fully_shard/_fsdp_collectives.py, `_to_dtype_if_needed(reduce_output, orig_dtype)`) before it
assigns or adds it to `.grad`, and the sharded parameters are the fp32 masters
(parallel/data_parallel.py MixedPrecisionPolicy): fp32 whether the reduce ran in fp32 or
bf16. FSDP1 does the same (torch/distributed/fsdp/_runtime_utils.py `_cast_grad_to_param_dtype`:
"so that the optimizer step runs with that dtype"), for Composer's and llm-foundry's runs."""


class StageCosts:
    """Mixin of `estimate.Evaluator`: needs what CostPieces and dp_cost.DataParallelCost give
    (self._params, self._micro, self._dp_time) and self.model, self.cluster, self.seq,
    self.opts, self.mem, self.hbm, self.grad_bytes, self.global_batch, self.n_gpus."""

    def _with_host(self, mem: memory.MemoryBreakdown, cfg: Plan,
                   host_gpu: float) -> memory.MemoryBreakdown:
        """`mem` with the host memory of one node: every GPU of the node offloads what its
        fullest stage does (states moved by plan.offload; with offload_activations, the
        stage's saved activations, which torch.autograd.graph.save_on_cpu copies out whole),
        against the node's usable host memory (cluster.host_memory_gib)."""
        gib = host_gpu / memory.GIB
        if cfg.offload_activations:
            gib += mem.activations + mem.in_flight
        per_node = min(self.cluster.gpus_per_node, self.n_gpus)
        cap = self.cluster.host_memory_per_node_gib
        return dataclasses.replace(
            mem, host=gib * per_node,
            host_capacity=None if cap is None else cap * HOST_USABLE_FRACTION)

    def block_params(self, tp: int, pp: int, ep: int, framework: str,
                     etp: int | None = None) -> tuple[float, float, float, float, float]:
        """Parameters per tensor rank (block, embedding, head, largest matrix, a block's
        routed experts kept apart under expert parallelism): `_params`, with a MoE block's
        where the stack keeps them (moe_memory.block_params; ep = 1 folds the experts into
        the block)."""
        p_layer, p_emb, p_head, largest = self._params(tp, pp)
        p_exp = 0.0
        if self.model.is_moe:
            p_layer, p_exp = moe_memory.block_params(self.model, tp, pp, ep, framework, etp)
            if ep == 1:
                p_layer, p_exp = p_layer + p_exp, 0.0
        return p_layer, p_emb, p_head, largest, p_exp

    def tied_embedding_s(self, tp: int, crosses_nodes: bool) -> float:
        """Megatron's and DeepSpeed's all-reduce of the tied word embedding's gradient between
        the end stages of a pipeline (pipeline.tied_embedding_reduce); 0 when untied."""
        if not self.model.tied_embeddings:
            return 0.0
        word = self.model.vocab * self.model.hidden / tp  # the tied table, vocabulary-parallel
        return pipeline.tied_embedding_reduce(self.grad_bytes * word, crosses_nodes, self.fab)

    def stage_dp(self, cfg: Plan, i: int, k: int, held: tuple[float, float, float], m: int,
                 stage_f: float, stage_b: float, flags: dict[str, Any],
                 groups: dict[str, Any]) -> StageDp:
        """Exposed data-parallel time of pipeline rank `i` holding `k` blocks, `held` = its
        (parameters, routed-expert parameters, parameters of its last unit kept gathered),
        with `stage_f`, `stage_b` the forward and backward of one micro-batch on it: the one
        choice between gradient compression, the experts' own groups and `_dp_time` that
        the planner (estimate_time.py) and the simulator (step_pieces.py) both use.
        Under torch.distributed.pipelining each schedule call's last backward syncs and
        reshards FSDP (stage.py backward_maybe_with_nosync; NeMo AutoModel's
        patched_backward_maybe_with_nosync alike): with plan.pipeline_runs calls per step
        the reductions and the re-gathers repeat per call, each over m / runs micro-batches."""
        runs = cfg.pipeline_runs if cfg.pp > 1 and self.opts.sharding == "fsdp" else 1
        if runs > 1:
            one = self._stage_dp(cfg, i, k, held, m // runs, stage_f, stage_b, flags, groups)
            return StageDp(runs * one.total, one.path, one.drain)
        return self._stage_dp(cfg, i, k, held, m, stage_f, stage_b, flags, groups)

    def _stage_dp(self, cfg: Plan, i: int, k: int, held: tuple[float, float, float], m: int,
                  stage_f: float, stage_b: float, flags: dict[str, Any],
                  groups: dict[str, Any]) -> StageDp:
        """`stage_dp` for one schedule call of `m` micro-batches."""
        zero, pp, v = cfg.zero, cfg.pp, cfg.virtual_stages
        params, experts, kept = held
        if cfg.dp * cfg.cp <= 1:  # ZeRO shards and reductions span dp x cp ranks
            return StageDp(0.0, "none", None)
        first, last = i == 0, i == pipeline.head_rank(pp, v, cfg.schedule)
        # chunk-slots a looped schedule idles at each chunk change (pipeline.bubble_time)
        looped = v > 1 and (cfg.schedule == "interleaved" or cfg.schedule == "gpipe")
        idle = max(0, pp - m) if looped else 0
        # FSDP2 under torch.distributed.pipelining reduces after the stage's last backward
        # (pipeline.reduce_after_drain); DDP-style stacks during it
        drain = (v, i, stage_b, idle) if pp > 1 and self.opts.sharding == "fsdp" else None
        # stage i finishes its last backward about i stage-backwards before stage 0; under
        # Megatron-Core's DDP the later stages are one bucket (bucket_size None on pipeline
        # ranks > 0, distributed_data_parallel.py), reduced after their own last backward
        window = (1 + i) * stage_b
        if i > 0 and v == 1 and self.mcore_ddp():
            window = i * stage_b
        args = (params, groups, m, stage_f, stage_b if zero >= 2 else window, k,
                cfg.recompute == "full" and self.opts.recompute_regathers)
        units = self.fsdp_units(k, first, last)
        if compression.changes_dp(cfg):  # gradient compression or DiLoCo
            return StageDp(compression.dp_time(self, cfg, *args, units=units, kept=kept),
                           "compressed", None)
        if experts:
            return StageDp(self._dp_with_experts(params, experts, zero, args, units, kept,
                                                 {**flags, "drain": drain}, groups),
                           "experts", drain)
        # Megatron-Core buckets the first stage only (dp_cost.mcore_edge_bucket)
        edge = self.mcore_edge_bucket(groups, k, first, last) if first else 0.0
        return StageDp(self._dp_time(params, zero, *args[1:], units=units, kept=kept,
                                     drain=drain, edge=edge, **flags), "dense", drain)

    def _dp_with_experts(self, params: float, experts: float, zero: int, args: tuple,
                         units: int, kept: float, flags: dict[str, Any],
                         groups: dict[str, Any]) -> float:
        """Exposed data-parallel time of a stage whose blocks hold `experts` routed-expert
        parameters under expert parallelism beside `params` others: the experts are their own
        FSDP units (one per MoE block) reduced over the dp*cp/ep ranks holding the same experts
        (placement.expert_groups), the rest over the whole data group. Each part overlaps its
        share of the stage's forward and backward (by parameters), so the compute is not
        counted twice."""
        _, _, m, fwd, bwd, k, regather = args
        share = experts / (params + experts)
        # a pipelined reduction's window (pipeline.reduce_after_drain) is shared the same way
        drain = flags.get("drain")

        def part(f: float) -> dict[str, Any]:
            if not drain:
                return flags
            v, rank, bwd_s, idle = drain
            return {**flags, "drain": (v, rank, bwd_s * f, idle)}

        dense = self._dp_time(params, zero, groups, m, fwd * (1 - share), bwd * (1 - share), k,
                              regather, units=units, kept=kept, **part(1 - share))
        moe_units = max(1, round(k * self.model.moe_layers / self.model.layers))
        exp = self._dp_time(experts, zero, groups["experts"], m, fwd * share, bwd * share, k,
                            regather, units=moe_units, kept=0.0, **part(share))
        return dense + exp

    def head_for(self, cfg: Plan, head: compute.EdgeCost) -> compute.EdgeCost:
        """The last stage's head costs of `cfg`: with meshtron's chunked cross-entropy (the
        memory model's condition: MemoryOptions loss 'chunked', tp = 1; a pipeline's last
        stage runs it too, parallel/parallel_model.py `_stage_computes_loss`) plus what
        its fused chunks add: per-chunk GEMMs and the fp32 weight-gradient accumulator's
        traffic (compute.chunked_loss_parts). Its forward makes every gradient: the head's
        weight-gradient GEMM and the other backward work move to the forward
        (compute.chunked_loss_forward_s), which a pipeline's stage times split by pass."""
        if not (self.mem.loss_kind == "chunked" and cfg.tp == 1):
            return head
        args = (self.model, self.cluster, cfg.micro_batch, self.seq, cfg.cp, cfg.dtype,
                self.opts.head_stack)
        extra = compute.chunked_loss_parts(*args)
        return dataclasses.replace(head, compute=head.compute + sum(s for _, s in extra),
                                   fwd=head.fwd + compute.chunked_loss_forward_s(*args),
                                   wgrad=0.0, parts=head.parts + extra)

    def accumulation_s(self, cfg: Plan, layers: int, stage: int, m: int,
                       flags: dict[str, Any]) -> float:
        """Seconds a stage of `layers` blocks spends adding each micro-batch's gradients to
        the accumulated ones, a memory-bound pass of its own unless the weight-gradient GEMM
        accumulates in place (KernelOptions.grad_accum_fusion). Gradients kept unsharded over
        the step (ZeRO-0/1, ZeRO-2/3 reduced once per step, pipelining) add the micro-batch's
        bf16 gradient into the accumulation dtype: read both, write the sum (2 + 2a bytes per
        element; the first micro-batch casts: 2 + a, nothing when a is bf16's 2), where a is
        the reduce dtype under FSDP (FSDP2's unsharded_accumulated_grad; meshtron's
        BF16Compute.accumulate) and the gradient buffer's elsewhere (Megatron's main_grad,
        DeepSpeed's buffers). ZeRO-2/3 reduced every micro-batch accumulate the reduced shard
        only (3a bytes per shard element, m - 1 times; FSDP adds it in the fp32 parameter's
        dtype, FSDP_GRAD_BYTES; the shard is the shard group's, a rank's experts' their own
        group's). Into a wider dtype PyTorch's add is unvectorised: those adds run at
        compute.cast_add_bytes_per_s, the first micro-batch's cast streams."""
        if cfg.zero >= 2 and not flags["reduce_once"] and not (
                cfg.pp > 1 and self.opts.sharding == "fsdp"):
            # the shard of FSDP2's shard group (HSDP replicates it dp_replicate times); a
            # rank's E/ep experts shard over the shard / ep ranks holding the same experts
            shard = cfg.dp // cfg.dp_replicate * cfg.cp
            elements = self._stage_params(cfg, layers, stage) / shard
            if cfg.ep > 1:
                experts = layers * moe_cost.expert_params_local(self.model, cfg.pp, cfg.ep)
                elements += experts / moe_memory.expert_dp(cfg, shard) - experts / shard
            # FSDP2 adds the reduced shard into `.grad` in the parameter's dtype
            acc = FSDP_GRAD_BYTES if self.opts.sharding == "fsdp" else flags["gsize"]
            return (m - 1) * 3.0 * acc * elements / self.hbm
        if self.opts.grad_accum_fusion:
            return 0.0
        acc = flags["gsize"] if self.opts.sharding == "fsdp" else self.grad_bytes
        params = self._stage_params(cfg, layers, stage)
        if acc == compute.BF16:  # bf16 += bf16: a vectorised add
            return (m - 1) * 3.0 * acc * params / self.hbm
        # bf16 into a wider buffer: the first micro-batch casts (2 + a), every later one adds
        # across dtypes, which PyTorch runs unvectorised (compute.CAST_ADD_BYTES_PER_SM)
        return ((2.0 + acc) * params / self.hbm + (m - 1) * (2.0 + 2.0 * acc) * params
                / compute.cast_add_bytes_per_s(self.cluster))

    def optimizer_bytes(self) -> float:
        """HBM bytes per local parameter of the step's optimizer work: AdamW (`opt_bytes`)
        reading the gradients in the dtype the step finds them in (FSDP: FSDP_GRAD_BYTES,
        whatever the reduce dtype; elsewhere the gradient buffer's), and with
        KernelOptions.grad_clip the norm's read and the scaling's read + write of them (the
        foreach kernels meshtron's clip_grad_norm_ runs: profiled with the optimizer on one
        H200, bench/h200_categories.py)."""
        g = FSDP_GRAD_BYTES if self.opts.sharding == "fsdp" else self.grad_bytes
        if self.opts.sharding == "fsdp" and self.mem.param_dtype == "bf16":
            g = 2.0  # the sharded gradients take the bf16 parameters' dtype
        base = self.opt_bytes
        if self.opts.optimizer == "fused":  # its 28 bytes count one gradient read
            base += g - self.grad_bytes
        return base + (3.0 * g if self.opts.grad_clip else 0.0)

    def _stage_params(self, cfg: Plan, layers: int, stage: int) -> float:
        """Parameters one tensor rank of pipeline stage `stage` holds (experts: the ep share)."""
        p_layer, p_emb, p_head, _ = self._params(cfg.tp, cfg.pp)
        if cfg.ep > 1:  # a rank holds E/ep of each block's experts
            p_exp = moe_cost.expert_params_local(self.model, cfg.pp, cfg.ep)
            p_layer = p_layer - p_exp * cfg.ep + p_exp
        p = layers * p_layer + (p_emb if stage == 0 else 0.0)
        last = pipeline.head_rank(cfg.pp, cfg.virtual_stages, cfg.schedule)
        return p + (p_head if stage == last else 0.0)

    def replica_floor(self, twin: Any) -> float:
        """A lower bound of the step of the one-replica `twin` estimate's plan with replicas
        (HSDP; search_bound prunes on it), inf where that plan cannot fit. The step less the
        parts the replicas change (`_stage_sync`: the data-parallel traffic, the optimizer's
        shard, the host copies): compute, the tensor, context, expert and pipeline traffic and
        the bubble depend on the layout's tp/pp/dp/cp/ep, not on how dp is split into replicas
        (estimate_time.py `_times`), and every part is >= 0. Cannot fit: the twin exceeds the
        memory by more than its gathered buffers and workspace; the replicas hold at least the
        rest (larger shards: memory.state_bytes over dp/dp_replicate; activations and logits
        do not depend on the split). Not simply 'the twin does not fit': buffers and stage
        split can come out a little smaller (tests/test_planner_hsdp.py)."""
        m, t = twin.memory, twin.time
        if m.total - m.gathered - m.workspace > m.capacity:
            return float("inf")
        return twin.step_time_s - t.dp_comm - t.optimizer - t.offload

    def lower_bound_step(self, cfg: Plan) -> float:
        """A cheap lower bound of the step time: m micro-batches of the busiest rank of the
        split that makes it least busy (`busiest_rank_floor`), no bubble, no pipeline or
        data-parallel communication. The step prices m x its busiest rank's stage time
        (estimate_time.py `_times`) plus non-negative terms, and every rank's time is at
        least the floor of its block count; cached per layer pieces and (pp, v, head rank)."""
        m = self.global_batch // (cfg.dp * cfg.micro_batch)
        key = ("step_floor", cfg.tp, cfg.micro_batch, cfg.sp, cfg.recompute, cfg.cp, cfg.dtype,
               cfg.ep, cfg.fp8_recipe, cfg.etp, cfg.pp, cfg.virtual_stages, cfg.schedule)
        floor = self._cache.get(key)
        if floor is None:  # schedules that place the head alike share the floor
            head_rank = pipeline.head_rank(cfg.pp, cfg.virtual_stages, cfg.schedule)
            placed = ("rank_floor", *key[1:-1], head_rank)
            floor = self._cache.get(placed)
            if floor is None:
                c_l, tpc_l, _, _, emb, head = self._micro(*key[1:10])[:6]
                head = self.head_for(cfg, head)  # the last stage's chunked loss, as priced
                # `half`: one replayed block's seconds, an odd part's saving is half of it
                c_r, tp_r = self.half_replay(cfg, (c_l, tpc_l))
                floor = self._cache[placed] = busiest_rank_floor(
                    self.model.layers, cfg.pp, cfg.virtual_stages, c_l + tpc_l, c_r + tp_r,
                    emb.compute + emb.tp, head.compute + head.tp, head_rank)
            self._cache[key] = floor
        return m * floor


def busiest_rank_floor(layers: int, pp: int, v: int, t_layer: float, replay: float,
                       first: float, last: float, head_rank: int) -> float:
    """The least, over every split of `layers` blocks into pp ranks of v model parts each
    (parts of any size, none included: whatever rule a stack splits by, a pinned split too),
    of the busiest rank's seconds per micro-batch, a rank of n blocks counted at its floor
    `_RankFloor.at`: n x `t_layer` (the per-layer mean) less half a `replay` (one replayed
    block: meshtron's `half` replays k // 2 of a part of k, estimate_half.HalfRecompute.
    half_replay) for each odd part it can hold; the embedding's `first` on rank 0, the
    head's `last` on `head_rank`. Why not the mean over ranks: the odd parts' saving is then
    taken wherever parts could be odd, also off the rank that sets the step; here a rank
    gains it only where its own count allows it, and the rounding of blocks to ranks is
    priced. Exact: the least T at which the ranks' largest counts within T sum to `layers`
    (T is one rank's floor plus its edge, and whether the counts reach `layers` only rises
    with T), found by walking the candidates up from the mean over ranks."""
    half = 0.5 * replay
    most_odd = min(pp * v, layers)
    most_odd -= (most_odd - layers) % 2
    mean = (layers * t_layer - half * most_odd + first + last) / pp  # every odd part saved
    if pp == 1:  # one rank, v = 1: its one part, exactly
        return layers * t_layer - half * (layers % 2) + first + last
    if half > t_layer or t_layer <= 0.0:  # a floor that falls with more blocks: none seen
        return mean
    rank = _RankFloor(layers, v, t_layer, half)
    edges = [0.0] * pp
    edges[0] += first
    edges[head_rank] += last
    counts: dict[float, int] = {}
    for e in edges:
        counts[e] = counts.get(e, 0) + 1

    def holds(t: float) -> bool:  # can the ranks hold every block within t seconds each?
        total = 0
        for e, c in counts.items():
            n = rank.most(t - e)
            if n < 0:
                return False
            total += c * n
        return total >= layers

    # below the mean over ranks and the floor of the fullest rank nothing holds; from there
    # each edge's candidates, the least first (from one at or below it: rounding)
    low = max(mean, rank.at(-(-layers // pp)))
    nxt = {e: max(0, rank.most(low - e)) for e in counts}  # each edge's next count
    cand = {e: rank.at(n) + e for e, n in nxt.items()}  # and its T
    while True:
        e = min(cand, key=cand.__getitem__)
        if holds(cand[e]):
            return cand[e]
        nxt[e] += 1
        if nxt[e] > layers:  # the heaviest edge at every block always holds
            del cand[e]
        else:
            cand[e] = rank.at(nxt[e]) + e


class _RankFloor:
    """The floor of one rank's seconds per micro-batch by its block count n (`at`): n x
    t_layer less `half` per odd part, at most min(v, n) of them and of n's parity; and its
    inverse `most`. Non-decreasing while half <= t_layer: a block more adds t_layer - half
    or t_layer + half."""

    def __init__(self, layers: int, v: int, t_layer: float, half: float) -> None:
        self.layers, self.v, self.t, self.half = layers, v, t_layer, half
        self.past = self.at(v + 1)  # the first count with more blocks than parts

    def at(self, n: int) -> float:
        if n <= self.v:
            return n * (self.t - self.half)
        return n * self.t - self.half * (self.v - ((n - self.v) & 1))

    def most(self, x: float) -> int:
        """The most blocks whose floor is at most x (-1: not even none), within `layers`;
        generous by rounding (1e-9 of a block), which only lowers the bound."""
        if x < 0.0:
            return -1
        v, t, half, top = self.v, self.t, self.half, self.layers
        if top > v and self.past <= x * (1 + 1e-12):
            # past v blocks, v or v - 1 odd parts by parity: n t - half v <= x for an even
            # offset n - v; an odd one is half dearer, and then one block less holds
            n = min(top, int((x + half * v) / t + 1e-9))
            return n - 1 if self.at(n) > x * (1 + 1e-12) else n
        if t <= half:
            return min(v, top)
        return min(v, top, int(x / (t - half) + 1e-9))


def given_partition(cfg: Plan, layers: int) -> list[int] | None:
    """Layers per pipeline rank of a plan that fixes its split (`stage_layers`, what the
    runtime cuts: a saved plan, or one being rehearsed), else None (the planner splits)."""
    counts = list(cfg.stage_layers or ())
    if cfg.pp == 1 or len(counts) != cfg.num_stages or sum(counts) != layers:
        return None
    return [sum(counts[s] for s in pipeline.stages_of_rank(cfg.pp, cfg.virtual_stages,
                                                 cfg.schedule or "1f1b", r))
            for r in range(cfg.pp)]
