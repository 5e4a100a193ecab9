"""Data-parallel / ZeRO communication left exposed per step (the Evaluator's mixin): which
collectives a plan's framework runs and when (`dp_flags`), and how much of them the compute
beside them hides (module docstring of estimate.py). Torch-free."""

from __future__ import annotations

from typing import Any

from meshtron.planner import comm, compute, host, pipeline
from meshtron.planner.compression import reduce_scatter_s
from meshtron.planner.fp8 import fp8_fractions, fp8_gathers_fp8
from meshtron.planner.fp8_gather import pre_gather_cast_bytes
from meshtron.planner.plan import Plan

OVERLAP_INTERFERENCE = compute.OVERLAP_INTERFERENCE
"""The hidden part of overlapped communication costs this fraction of its duration
(compute.py: NCCL kernels share SMs and HBM bandwidth with the GEMMs they run beside)."""

LIST_HOST_S_PER_RANK = 8e-6
"""Host time per group member of one list-based collective (KernelOptions.list_collectives):
DeepSpeed 0.3.x builds the per-rank chunk list in a Python loop (`narrow` per rank in
partition_parameters.py `_allgather_param` / `_reduce_scatter_gradient`), and PyTorch's
ProcessGroupNCCL (<= 1.10) copies every chunk separately (`copy_` per rank after all_gather,
before reduce_scatter via flatten_for_scatter_gather). About 2 us for a Python tensor view plus
about 3 us to issue one small copy (cudaMemcpyAsync launch); the host does this for every rank
of every call, serially, because ZeRO-3 of that era synchronises the device around each fetch."""


MCORE_MIN_BUCKET = 40_000_000
"""Megatron-Core DDP's smallest default gradient bucket, in parameters; the default is
max(MCORE_MIN_BUCKET, MCORE_BUCKET_PER_DP_RANK * dp) (megatron/core/distributed/
distributed_data_parallel.py at f2e5db402c: "make buckets larger" over large dp so that the
ring's chunks stay bandwidth-bound)."""
MCORE_BUCKET_PER_DP_RANK = 1_000_000
"""Parameters the default bucket grows by per data-parallel rank (MCORE_MIN_BUCKET)."""


def mcore_tail_bucket(matrices: list[float], bucket: float) -> float:
    """Parameters of the last gradient bucket of a Megatron-Core DDP buffer holding `matrices`
    (a stage's parameter tensors in module order, forward first) with `bucket`-parameter
    buckets: ParamAndGradBuffer walks the parameters in reverse ("to roughly follow backprop
    order") and closes a bucket once it holds `bucket` or more (param_and_grad_buffer.py at
    f2e5db402c). The last bucket holds the first parameters of the forward (the word embedding
    of the first stage and what of the first layer the previous bucket left)."""
    cur = last = 0.0
    for n in reversed(matrices):
        cur += n
        if cur >= bucket:
            last, cur = cur, 0.0
    return cur if cur > 0 else last


_exposed = compute.overlapped
"""Communication time not hidden behind `window` seconds of compute, plus the interference the
hidden part causes (one formula for tensor-, context- and data-parallel overlap)."""


def unit_chain(total: float, window: float, units: int, interference: float) -> float:
    """Exposed time of `units` equal collectives (`total` seconds together) issued one per
    FSDP unit beside `window` seconds of the units' compute: each hides behind the compute of
    the units next to it, except one that has no compute beside it, the first unit's
    all-gather before any forward (FSDP2 FSDPParamGroup.wait_for_unshard, FSDP1
    _pre_forward's _unshard) or the last unit's reduce-scatter after the last backward (the
    root's post-backward final callback waits for it: FSDP2 _root_post_backward_final_callback,
    FSDP1 _post_backward_final_callback's wait_stream on the post-backward stream). The
    exposed one is a whole collective, ring latency included: over hundreds of ranks it is
    latency-bound (comm.ring_latency)."""
    if total <= 0:
        return 0.0
    units = max(1, units)
    one = total / units
    return one + _exposed(total - one, window * (units - 1) / units, interference)


def _fsdp1_postdivide(world: int) -> float:
    """FSDP1's gradient post-divide factor: world / the pre-divide factor, which torch's
    DefaultState._get_gradient_predivide_factor doubles while it divides the world and stays
    below world / factor (torch/distributed/algorithms/_comm_hooks/default_hooks.py)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return world / factor


class DataParallelCost:
    """Mixin of `estimate.Evaluator`: needs self.opts, self.mem, self.fab, self.hbm,
    self.cluster and self._cache."""

    def dp_interference(self, groups: dict[str, Any]) -> float:
        """What a data-parallel collective hidden beside compute costs it per second: the SMs
        its NCCL CTAs hold, for a group inside one node or across nodes (planner/host.py)."""
        return host.sm_interference(self.cluster, groups["dp"].nodes > 1)

    def dp_flags(self, cfg: Plan) -> dict[str, Any]:
        """How a plan's data-parallel collectives run, as keyword arguments of `_dp_time`; the
        same list planner/collectives.py `step_collectives` counts and
        tests/test_dp_collectives.py checks on real gloo steps (meshtron's runtime: FSDP1's
        flat_param stacks, which it does not run, differ as said below). `gsize` bytes per
        gradient element on the wire (the plan's reduce_dtype), `wsize` per gathered parameter
        (`_param_wire`), `reduce_once` (ZeRO-2/3 reduce-scatter once per step:
        accumulate_unsharded, or pipelining, whose schedule turns FSDP's gradient sync and
        resharding off until the last backward in torch.distributed.pipelining),
        `gather_once` (parameters stay gathered over the step's micro-batches: pipelining,
        torchtitan's reshard_after_forward=False with pp, and FSDP ZeRO-2, which meshtron
        reshards only after the step's last backward; not FSDP1's SHARD_GRAD_OP
        (KernelOptions.flat_param), which frees the unsharded parameters in every backward
        that syncs gradients, torch 2.1 _runtime_utils.py `_should_free_in_backward`, and
        Composer syncs every micro-batch: it gathers again for each forward))."""
        fsdp = self.opts.sharding == "fsdp"
        pipelined = cfg.pp > 1 and fsdp
        return {"gsize": 4.0 if cfg.reduce_dtype == "fp32" else compute.BF16,
                "wsize": self._param_wire(cfg),
                "reduce_once": cfg.zero >= 2 and (cfg.accumulate_unsharded or pipelined),
                "gather_once": cfg.zero >= 2 and (pipelined or (
                    cfg.zero == 2 and fsdp and not self.opts.flat_param))}

    def _param_wire(self, cfg: Plan) -> float:
        """Bytes per parameter of parameter all-gathers: FSDP2 casts its fp32 shards to
        MixedPrecisionPolicy.param_dtype before gathering (bf16 for bf16 and fp8 plans, none
        for fp32 ones), 16-bit-weight frameworks gather their bf16 weights; fp32 with
        fp32_params_autocast (Composer's param_dtype fp32). FP8 plans whose stack gathers
        FP8 weights (fp8.py `fp8_gathers_fp8`: torchao's float8 all-gather, meshtron's runtime
        with the tensorwise recipe on CUDA, meshtron/parallel/fp8.py `fp8_all_gather`; or
        Transformer Engine's FP8 parameters, KernelOptions.fp8_param_gather) move 1 byte per
        parameter of the FP8 Linears."""
        o = self.opts
        if o.fp32_params_autocast or (o.sharding == "fsdp" and cfg.dtype == "fp32"):
            return 4.0
        if cfg.dtype == "fp8" and fp8_gathers_fp8(o.fp8_scaling, cfg.fp8_recipe,
                                                  o.fp8_param_gather, o.sharding,
                                                  o.fp8_fsdp_gather):
            return compute.BF16 - self._fp8_block_share(cfg.fp8_recipe)
        return compute.BF16

    def _fp8_block_share(self, recipe: str) -> float:
        """Share of a dense block's parameters that FSDP2 gathers in FP8 (1 byte instead of
        2) under torchao's FP8 all-gather: the weights of its FP8 Linears (planner/fp8.py);
        norms and bf16 Linears gather bf16, and so, in this average, do the embedding and
        head of the end stages (a few layers' worth at most). Mixtures of experts: none
        (torchao leaves meshtron's routed experts, most of their parameters, in bf16)."""
        m = self.model
        if m.is_moe:
            return 0.0
        frac = fp8_fractions(m, 1, recipe, self.opts.fp8_filter)
        block = m.attention_params() + m.ffn_params(0)
        return compute.fp8_weight_elements(m, 1, frac) / block if block else 0.0

    def stage_matrices(self, tp: int, layers: int, first: bool, last: bool) -> list[float]:
        """A dense stage's weight matrices per tensor rank in module order, as Megatron's GPT
        registers them (megatron/core/models/gpt/gpt_model.py, the TE layer spec): word
        (vocabulary-parallel) and learned position embedding on the first stage, then per
        layer linear_qkv, linear_proj, linear_fc1, linear_fc2, then the untied output layer on
        the last stage; norms and biases (a few h-wide vectors) are left out."""
        m = self.model
        h, f = m.hidden, m.ffn_hidden
        up = 2 * f if m.gated_mlp else f
        out: list[float] = []
        if first:
            out += [m.vocab * h / tp] + ([m.max_seq * h] if m.position == "learned" else [])
        out += [(h + 2 * m.kv_dim) * h / tp, h * h / tp, up * h / tp, f * h / tp] * layers
        if last and not m.tied_embeddings:
            out.append(m.vocab * h / tp)
        return out

    def mcore_ddp(self) -> bool:
        """The stack reduces through Megatron-Core's bucketed DDP (megatron/core/distributed/,
        overlap_grad_reduce): the megatron presets with ZeRO sharding and overlap."""
        return (self.mem.framework == "megatron" and self.opts.sharding == "zero"
                and self.opts.overlap_grad_reduce)

    def mcore_edge_bucket(self, groups: dict[str, Any], layers: int, first: bool,
                          last: bool) -> float:
        """Parameters of Megatron-Core DDP's bucket that neither overlap hides (0 for other
        stacks or without overlap): the last gradient bucket (`mcore_tail_bucket`), whose
        reduction is issued when its last gradient is ready, after the stage's backward
        (register_grad_ready, then finish_grad_sync waits in finalize_model_grads), and the
        first parameter all-gather, the same bucket (the distributed optimizer all-gathers
        the buckets in reverse, forward order), which zero_grad_buffer dispatches before the
        forward and the first forward pre-hook waits for, one bucket ahead after it
        (optimizer/distrib_optimizer.py `_dispatch_gather_model_params`,
        `_finish_param_sync_helper` at f2e5db402c). Only the first pipeline stage is
        bucketed (bucket_size None on the others: one bucket, whose window
        estimate_stage.stage_dp shortens)."""
        if not self.mcore_ddp() or self.model.is_moe:
            return 0.0
        # the rule's dp excludes the context ranks (get_data_parallel_world_size())
        dp = groups["dp"].size // max(1, groups["cp"].size if "cp" in groups else 1)
        bucket = max(MCORE_MIN_BUCKET, MCORE_BUCKET_PER_DP_RANK * dp)
        tp = groups["tp"].size if "tp" in groups else 1
        return mcore_tail_bucket(self.stage_matrices(tp, layers, first, last), bucket)

    def fsdp_units(self, layers: int, first: bool, last: bool) -> int:
        """Collective calls per stage and per gather/reduce round: FSDP runtimes wrap the
        embedding (first stage) and [final norm, head] (last stage) as units of their own
        beside every block (torchtitan's apply_fsdp, parallel/data_parallel.py);
        'zero'-sharding frameworks bucket by layer only."""
        extra = int(first) + int(last) if self.opts.sharding == "fsdp" else 0
        return max(1, layers * self.opts.shard_units_per_layer + extra)

    def per_unit_each_microbatch(self, zero: int, reduce_once: bool, gather_once: bool) -> bool:
        """Whether `_dp_time` prices a stage per FSDP unit and micro-batch
        (`_zero3_per_microbatch`): ZeRO-3, or ZeRO-2 on FSDP, neither reduced nor gathered
        once per step (`dp_flags`)."""
        fsdp = self.opts.sharding == "fsdp"
        return (zero == 3 or (zero == 2 and fsdp)) and not (reduce_once or gather_once)

    def _dp_time(self, params: float, zero: int, groups: dict[str, Any], m: int, fwd: float,
                 bwd: float, layers: int = 1, regather: bool = False,
                 wire: float | None = None, gsize: float = 4.0, reduce_once: bool = False,
                 gather_once: bool = False, wsize: float = compute.BF16,
                 units: int | None = None, kept: float = 0.0,
                 drain: tuple[int, int, float, int] | None = None,
                 edge: float = 0.0, split: int = 1) -> float:
        """Exposed data-parallel time of a stage holding `params` parameters in `layers` layers
        (module docstring); `wire`: bytes per gradient element when compressed
        (planner/compression.py); `split`: ranks per node of a compressed hierarchical
        reduce-scatter (`reduce_scatter_s`); `units`: its FSDP units (`fsdp_units`; default: the
        layers' own); `kept`: parameters of its last unit, not re-gathered for backward
        (FSDP's [norm, head]); `drain`: (v, pipeline rank, one micro-batch's backward of the
        rank, chunk-slots idle at each chunk change) when torch.distributed.pipelining reduces
        the gradients after the stage's last backward (pipeline.reduce_after_drain); `edge`:
        parameters of the bucket a bucketed reduction and gather cannot hide
        (`mcore_edge_bucket`); the rest: `dp_flags`."""
        group = groups["dp"]
        units = units or max(1, layers * self.opts.shard_units_per_layer)
        key = ("dp", params, zero, group, groups["dp_replicate"], m, fwd, bwd, layers, regather,
               wire, gsize, reduce_once, gather_once, wsize, units, kept, drain, edge, split)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        gsize = wire or gsize
        fsdp = self.opts.sharding == "fsdp"
        if self.per_unit_each_microbatch(zero, reduce_once, gather_once):
            # per unit and micro-batch, with its own overlap rules
            exp = m * self._zero3_per_microbatch(params, groups, layers, fwd, bwd, regather,
                                                 backward_gather=zero == 3, wire=gsize,
                                                 wsize=wsize, units=units, kept=kept,
                                                 split=split)
            self._cache[key] = exp
            return exp
        if zero >= 2 and fsdp:
            exp = self._fsdp_accumulated(params, groups, units, m, fwd, bwd, zero, gsize,
                                         reduce_once, gather_once, regather, wsize, kept, drain,
                                         split)
            self._cache[key] = exp
            return exp
        if not self.opts.overlap_grad_reduce:
            fwd = bwd = 0.0
        if zero == 3:  # DeepSpeed-style ZeRO-3 under sharding='zero': per unit per micro-batch
            exp = m * self._zero3_per_microbatch(params, groups, layers, fwd, bwd, regather,
                                                 backward_gather=True, wire=gsize,
                                                 wsize=wsize)
        else:
            red, gather = self.once_per_step(params, zero, groups, gsize, wsize,
                                             units if fsdp else 1)
            nccl = self.dp_interference(groups)
            # one collective per FSDP unit: the chain's fill and drain show; bucketed
            # reductions (Megatron, DeepSpeed): one overlapped stream, but for Megatron-Core's
            # edge bucket
            chain = unit_chain if fsdp else (lambda t, w, _u, i: _exposed(t, w, i))
            # Megatron-Core's edge bucket (`mcore_edge_bucket`): its reduction after the
            # backward and its gather before the forward, whole; the rest overlaps
            e_red, e_gather = (self.once_per_step(edge, zero, groups, gsize, wsize)
                               if edge and not drain else (0.0, 0.0))
            reduce = pipeline.reduce_after_drain(red, *drain, nccl) if drain else \
                e_red + chain(max(0.0, red - e_red), bwd, units, nccl)
            exp = (reduce + e_gather + chain(max(0.0, gather - e_gather), fwd, units, nccl)
                   + self.bucket_passes_s(params, gsize)
                   + self.fsdp2_step_passes_s(params, zero, group.size, m,
                                              groups["pp"].size, gsize, wsize))
            if fsdp and self.opts.flat_param:  # FSDP1 NO_SHARD: the gradient cat as above
                per_mb = (self.copy_out_s(params, wsize)
                          + self.grad_prep_s(params, gsize, wsize, group.size))
                # Composer enters no_sync for DDP only (composer/trainer/trainer.py v0.17.2
                # _train_microbatches), so FSDP1 syncs, and NO_SHARD all-reduces, after every
                # micro-batch's backward (torch 2.1 _runtime_utils.py _post_backward_hook)
                exp = m * (exp + per_mb) if zero == 0 else exp + m * per_mb
        self._cache[key] = exp
        return exp

    def once_per_step(self, params: float, zero: int, groups: dict[str, Any],
                      gsize: float, wsize: float = compute.BF16,
                      units: int = 1) -> tuple[float, float]:
        """(gradient reduction, parameter all-gather) seconds of a ZeRO-0/1/2 stage that
        reduces once per step, as raw collective times (the overlap is the caller's: the
        evaluator's `_exposed`, the simulator's event queue). ZeRO-0: one all-reduce (gradient
        sync off but on the last micro-batch: FSDP2's set_requires_gradient_sync, DDP's
        no_sync, Megatron's and DeepSpeed's buffers); ZeRO-1: a distributed optimizer, one
        reduce-scatter, the step on the shard, one all-gather of the updated parameters behind
        the next forward (Megatron-LM docs/distrib_optimizer.md; meshtron's ZeRO-1); ZeRO-2
        (DeepSpeed / Megatron): the same over the shard group, plus the replicas' all-reduce.
        KernelOptions.zero1_all_reduce: a pipelined ZeRO-1's reduction is a whole all-reduce.
        `units` calls of each (FSDP: one per unit, `fsdp_units`), `wsize` bytes per gathered
        parameter."""
        group = groups["dp"]
        nbytes = gsize * params / units
        wbytes = wsize * params / units
        if zero == 0:
            return units * comm.all_reduce(nbytes, group, self.fab), 0.0
        if zero == 1:
            # DeepSpeed's pipeline engine all-reduces whatever its ZeRO stage (zero1_all_reduce);
            # without a pipeline its engine's ZeRO-1 reduce-scatters
            pipe_all_reduce = self.opts.zero1_all_reduce and groups["pp"].size > 1
            reduce = comm.all_reduce if pipe_all_reduce else comm.reduce_scatter
            return (units * reduce(nbytes, group, self.fab),
                    units * comm.all_gather(wbytes, group, self.fab))
        shard, rep = groups["dp_shard"], groups["dp_replicate"]
        return (units * (comm.reduce_scatter(nbytes, shard, self.fab)
                         + comm.all_reduce(nbytes / shard.size, rep, self.fab)),
                units * comm.all_gather(wbytes, shard, self.fab))

    def _fsdp_accumulated(self, params: float, groups: dict[str, Any], units: int, m: int,
                          fwd: float, bwd: float, zero: int, gsize: float, reduce_once: bool,
                          gather_once: bool, regather: bool, wsize: float,
                          kept: float = 0.0,
                          drain: tuple[int, int, float, int] | None = None,
                          split: int = 1) -> float:
        """FSDP2 ZeRO-2/3 whose gradients accumulate unsharded over the step's micro-batches
        (`reduce_once`: one reduce-scatter per unit per step, after the last backward: exposed
        behind that backward only, or under pipelining (`drain`) issued after it,
        pipeline.reduce_after_drain; else one per micro-batch, behind its backward) and/or
        whose parameters stay gathered (`gather_once`, pipelining or ZeRO-2: one all-gather
        per unit per step, before the first forward); otherwise the gathers stay per
        micro-batch (`_zero3_per_microbatch` with the reduction taken out). Like the
        per-micro-batch chain, the step-level gathers and reductions run unit after unit and
        have a fill and a drain (`unit_chain`): the first unit's all-gather before any forward,
        the last unit's reduce-scatter after the last backward."""
        shard, rep = groups["dp_shard"], groups["dp_replicate"]
        rs = units * (reduce_scatter_s(params / units, gsize, shard, self.fab, split)
                      + comm.all_reduce(gsize * params / units / shard.size, rep, self.fab))
        nccl = self.dp_interference(groups)
        if drain and reduce_once:  # after the last backward (pipeline.reduce_after_drain)
            out = pipeline.reduce_after_drain(rs, *drain, nccl)
        else:  # fwd, bwd: one micro-batch's
            out = (1 if reduce_once else m) * unit_chain(rs, bwd, units, nccl)
        out += (1 if reduce_once else m) * self.grad_prep_s(params, gsize, wsize, shard.size,
                                                            accumulated=reduce_once)
        if gather_once:
            ag = units * comm.all_gather(wsize * params / units, shard, self.fab)
            # FSDP1 (flat_param): no copy-out, a gradient cat per micro-batch's backward
            copies = ((m if self.opts.flat_param else 1) * self.copy_out_s(params, wsize)
                      + self.gather_prep_s(params, wsize, shard.size))
            return out + unit_chain(ag, fwd, units, nccl) + copies
        per_mb = self._zero3_per_microbatch(params, groups, 1, fwd, bwd, regather,
                                            backward_gather=zero == 3, wire=gsize,
                                            reduce=False, wsize=wsize, units=units,
                                            kept=kept)
        return out + m * per_mb

    def _zero3_per_microbatch(self, params: float, groups: dict[str, Any], layers: int,
                              fwd: float, bwd: float, regather: bool = False,
                              backward_gather: bool = True, wire: float | None = None,
                              reduce: bool = True, wsize: float = compute.BF16,
                              units: int | None = None, kept: float = 0.0,
                              split: int = 1) -> float:
        """ZeRO-3 / FSDP: one all-gather per wrapped unit before its forward, another before its
        backward (parameters are resharded after the forward) and one reduce-scatter of its
        gradients after it (HSDP: over the shard group, then an all-reduce of the shard over the
        replica group); the next unit's collectives are prefetched while this unit computes
        (FSDP's forward/backward prefetch, Zhao et al. 2023, section 3.3; DeepSpeed's parameter
        prefetch). Exposed per unit: max(0, comm - compute) plus the interference of the hidden
        part; the first unit's all-gather (fill) and the last reduce-scatter (drain) are never
        hidden. Collectives are counted per unit, each paying its own NCCL latency. Without
        `backward_gather` (FSDP's ZeRO-2: no resharding after the forward) the backward only
        reduce-scatters. FSDP (`units` given: `fsdp_units`) keeps the last unit ([norm, head])
        gathered after its forward: the backward starts without a gather and re-gathers the
        other units - 1 (`kept`: the last unit's parameters; 0: an average unit)."""
        opts = self.opts
        keep_last = units is not None and opts.sharding == "fsdp"
        units = units or max(1, layers * opts.shard_units_per_layer)
        # gradient reductions per step may be finer than the gathers (DeepSpeed reduces every
        # parameter, biases and norms included); spread over the gather units for the overlap
        rpl = opts.reduce_units_per_layer or opts.shard_units_per_layer
        r_units = max(1, round(units * rpl / opts.shard_units_per_layer)) if keep_last else \
            max(1, layers * rpl)
        shard, rep = groups["dp_shard"], groups["dp_replicate"]
        gsize = wire or 4.0
        rs_one = reduce_scatter_s(params / r_units, gsize, shard, self.fab, split)
        host = shard.size * LIST_HOST_S_PER_RANK if opts.list_collectives else 0.0

        def gather(elems: float) -> tuple[float, float]:
            # (device time a prefetch can hide: the ring and the staging copies on its path,
            # exposed time: the host's per-rank list handling, one chunk view and one chunk
            # copy issued per member before the unit's compute is launched, and the fetch's
            # norm read after its synchronisation; KernelOptions.list_collectives)
            t = comm.all_gather(wsize * elems, shard, self.fab)
            if not opts.list_collectives:
                return t, 0.0
            return t + 3.0 * wsize * elems / self.hbm, host + wsize * elems / self.hbm

        ag_dev, ag_host = gather(params / units)
        ag = ag_dev + ag_host
        if opts.list_collectives:
            # ProcessGroupNCCL's flatten of the input list, and stage3.py average_tensor's
            # in-place div_ of each gradient by the group size before it is reduced (v0.3.13 to
            # v0.5.x, on the reduction stream; it divides the whole reduce bucket at every
            # flush, so this is the least): read + write each
            rs_one += 4.0 * gsize * params / r_units / self.hbm + host
        rs = rs_one * r_units / units
        rs += comm.all_reduce(gsize * params / units / shard.size, rep, self.fab)
        if not reduce:
            rs = 0.0
        f_u, b_u = fwd / units, bwd / units
        hide = self._prefetch_share(params / units + self._held_params(groups))
        nccl = self.dp_interference(groups)
        fwd_u = ag_host + (1 - hide) * ag_dev + _exposed(hide * ag_dev, f_u, nccl)
        # recomputation that re-gathers: a second all-gather per unit in the backward
        if keep_last and units > 1 and kept > 0:
            # the backward gathers everything but the kept unit, over the other units - 1
            rest_dev, rest_host = gather((params - kept) / (units - 1))
        else:
            rest_dev, rest_host = ag_dev, ag_host
        times = (2 if regather else 1) if backward_gather else 0
        # gradient reduce-scatters hide behind the next unit's backward only when reduction
        # overlaps (DeepSpeed's overlap_comm, on in FSDP)
        rs_hidden, rs_exposed = (rs, 0.0) if self.opts.overlap_grad_reduce else (0.0, rs)
        bwd_u = (times * rest_host + (1 - hide) * times * rest_dev + rs_exposed
                 + _exposed(hide * times * rest_dev + rs_hidden, b_u, nccl))
        # FSDP2 copies every gathered unit out of the all-gather buffer into its parameters on
        # the compute stream (foreach_all_gather_copy_out after waiting for the gather): a
        # memory-bound pass over the unsharded bytes that no prefetch hides
        out_b = (params - kept) if keep_last and kept > 0 else params
        regathered = (2 if regather else 1) * out_b if backward_gather else 0.0
        copies = self.copy_out_s(params + regathered, wsize)
        if opts.flat_param:  # FSDP1: the backward's gradient cat of every unit, no copy-outs
            copies = self.copy_out_s(params, wsize)
        # every gather's input prepared, every reduction's gradients (FSDP1 and FSDP2 alike)
        copies += self.gather_prep_s(params + regathered, wsize, shard.size) + (
            self.grad_prep_s(params, gsize, wsize, shard.size) if reduce else 0.0)
        if keep_last and backward_gather:
            # the kept unit's backward gathers nothing; the next unit's gather hides behind it
            kept = rs_exposed + _exposed(rs_hidden, b_u, nccl)
            return ag + units * fwd_u + (units - 1) * bwd_u + kept + rs + copies
        return (ag + units * fwd_u + (ag if backward_gather else 0.0) + units * bwd_u + rs
                + copies)

    def _held_params(self, groups: dict[str, Any]) -> float:
        """Gathered parameters held over the whole step beside the units, counted against the
        live-parameter limit: the tied word embedding of this tensor rank when the stack keeps
        it gathered (KernelOptions.live_embedding; the one stage of an unpipelined model)."""
        m = self.model
        if not (self.opts.live_embedding and m.tied_embeddings) or groups["pp"].size > 1:
            return 0.0
        return m.vocab * m.hidden / groups["tp"].size

    def _prefetch_share(self, unit_params: float) -> float:
        """Share of a unit's all-gather that prefetching starts beside the previous unit's
        compute. DeepSpeed's coordinator adds whole parameters of the coming submodules to the
        prefetch until `stage3_prefetch_bucket_size` is reached, so any bucket > 0 prefetches
        the next unit whole (0.3.13-0.5.x: stage3.py prefetch_next_sub_modules, issued on the
        fetch stream right after each synchronous fetch; 0.6+: partitioned_param_coordinator.py
        fetch_sub_module); a bucket of 0 hides nothing. Neither prefetches while the gathered
        parameters reach `stage3_max_live_parameters` (KernelOptions.max_live_params): a unit
        of that size (a 530B GPT's QKV and MLP weights, 1.3-1.7e9 elements, against the 1e9
        default) blocks its successor's prefetch; `unit_params` includes what stays gathered
        beside it (`_held_params`). Units are priced at their average size."""
        pre, live = self.opts.prefetch_params, self.opts.max_live_params
        if pre is not None and pre <= 0:
            return 0.0
        return 0.0 if live is not None and unit_params >= live else 1.0

    def bucket_passes_s(self, params: float, gsize: float) -> float:
        """Seconds of the memory-bound passes over a stage's whole (unsharded) gradient buffer
        of `gsize`-byte elements that a bucketed reduction adds on the compute stream (priced
        with the data-parallel time it belongs to): KernelOptions.grad_bucket_passes
        (Megatron-LM's NaN check and scaling by 1/dp before each bucket's reduction) and
        Megatron-Core DDP's zeroing of the buffer before every step's first forward
        (zero_grad_buffer: ParamAndGradBuffer.reset, grad_data.zero_(), a write of every
        element; torch and FSDP set gradients to None instead)."""
        passes = self.opts.grad_bucket_passes + (1 if self.mcore_ddp() else 0)
        return passes * gsize * params / self.hbm

    def grad_prep_s(self, params: float, gsize: float, wsize: float, ranks: int,
                    accumulated: bool = False, alone: bool = False) -> float:
        """Seconds of the passes over a stage's gradients around one reduce-scatter of its FSDP
        units (`params` unsharded elements, `ranks` the shard group), both FSDP runtimes
        from their code. FSDP1 (KernelOptions.flat_param; torch 2.1
        torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`, `_reduce_grad`): the
        cast of the unit's flat gradient from the parameter dtype to the reduce dtype where
        they differ (read `wsize`, write `gsize` bytes), `_div_if_needed` by the pre-divide
        factor in place (`_get_gradient_predivide_factor`: > 1 for any world of 2 or more
        ranks; read and write `gsize`), and after the reduce-scatter the shard's post-divide
        by world / pre-divide where that is above 1 (`_fsdp1_postdivide`). FSDP2 (torch 2.13
        torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`): the
        reduce-scatter copy-in (`foreach_reduce_scatter_copy_in`, chunk_cat of the unit's
        gradients into the reduce-dtype input: read each in its dtype, the parameter
        dtype's, or the reduce dtype where they accumulate unsharded over the micro-batches
        (`accumulated`: `to_accumulated_grad_if_needed` upcast them), write `gsize`); no
        division for an fp32 or bf16 reduce dtype (`_get_gradient_divide_factors`: NCCL's
        ReduceOp.AVG, no pre- or post-divide kernel); the reduced shard cast back to the
        sharded parameter's dtype (`_to_dtype_if_needed(reduce_output, orig_dtype)`) where
        that differs. They run beside the next unit's backward (FSDP1 on its post-backward
        stream, FSDP2's copy-in on the compute stream itself), but they are kernels, not
        transfers: their blocks take the SMs the backward's GEMMs would use (a Hopper or
        Ampere GEMM tile holds most of an SM's shared memory, so the two do not share an
        SM), so their time is priced whole. FSDP2 on a shard group of one rank (`alone`:
        meshtron's zero 0) still copies in, and copies the input to the output instead of
        reducing (`reduce_output.copy_`); otherwise one rank is priced at 0 (FSDP1 runs none
        of this; experts left out of FSDP2, MemoryOptions.experts_outside_fsdp, neither).
        0 for 'zero' sharding."""
        if self.opts.sharding != "fsdp" or (ranks <= 1 and (self.opts.flat_param
                                                             or not alone)):
            return 0.0
        grad = self._grad_bytes(wsize)
        if self.opts.flat_param:
            cast = grad + gsize if gsize != grad else 0.0
            post = 2.0 * gsize / ranks if _fsdp1_postdivide(ranks) > 1 else 0.0
            return ((cast + 2.0 * gsize) + post) * params / self.hbm
        shard = self._shard_bytes()
        copy_in = (gsize if accumulated else grad) + gsize
        # one rank: no reduce-scatter, the input copied into the output (`reduce_output.copy_`)
        to_output = 2.0 * gsize if ranks <= 1 else 0.0
        back = (gsize + shard) / max(1, ranks) if shard != gsize else 0.0
        return (copy_in + to_output + back) * params / self.hbm

    def fsdp2_step_passes_s(self, params: float, zero: int, ranks: int, m: int, pp: int,
                            gsize: float, wsize: float) -> float:
        """Seconds of FSDP2's own passes in a ZeRO-0/1 step of meshtron's runtime
        (parallel/data_parallel.py: FSDP2 over the whole data axis for zero 1, its replicate
        path with shards of one rank for zero 0; parameters resharded after the step's last
        backward): each unit gathered once a step (`gather_prep_s`, `copy_out_s`; at one rank
        the all-gather input is the whole parameter) and its gradients reduced once, from the
        unsharded accumulated gradient where the step has several micro-batches or a
        pipeline (`grad_prep_s`). 0 for other stacks' zero 0 (torchtitan's and NeMo
        AutoModel's DDP), FSDP1 (KernelOptions.flat_param, priced by its callers) and where
        no FSDP2 runs (fp32 at one rank)."""
        o = self.opts
        if o.sharding != "fsdp" or o.flat_param or zero > 1 or (ranks == 1 and wsize >= 4.0):
            return 0.0
        if zero == 0 and self.mem.zero_stages != "all":
            return 0.0
        shard_ranks = ranks if zero == 1 else 1
        alone = shard_ranks == 1  # FSDP2 still runs on the size-1 axis (bf16 at dp 1)
        return (self.copy_out_s(params, wsize)
                + self.gather_prep_s(params, wsize, shard_ranks, alone=alone)
                + self.grad_prep_s(params, gsize, wsize, shard_ranks,
                                   accumulated=m > 1 or pp > 1, alone=alone))

    def gather_prep_s(self, params: float, wsize: float, ranks: int,
                      alone: bool = False) -> float:
        """Seconds of the all-gather input's preparation for `params` gathered elements, over
        the rank's shard (`params / ranks` elements): FSDP1 (KernelOptions.flat_param; torch
        2.1 flat_param.py `_use_low_precision_shard`) casts the fp32 shard to the gather
        dtype (read 4, write `wsize` bytes) where they differ, and all-gathers straight from
        it; FSDP2 (torch 2.13 _fsdp_collectives.py `foreach_all_gather`) casts the shard to
        MixedPrecisionPolicy.param_dtype where it differs from the shard's dtype
        (`_get_param_all_gather_inputs`' foreach copy; FSDPParam.init_dtype_attrs clamps an
        equal one to None: no copy), then `all_gather_copy_in` copies it into the rank's
        slot of the output (read and write `wsize`). On the all-gather copy-in stream (FSDP1:
        the unshard stream) beside compute, kernels like `grad_prep_s`'s: priced whole.
        0 for 'zero' sharding (DeepSpeed and Megatron gather their 16-bit weights in place)
        and one rank (FSDP1's NO_SHARD gathers nothing) but FSDP2 on a shard group of one
        rank (`alone`: meshtron's zero 0), which still prepares the whole parameter."""
        if self.opts.sharding != "fsdp" or (ranks <= 1 and (self.opts.flat_param
                                                             or not alone)):
            return 0.0
        shard = 4.0 if self.opts.flat_param else self._shard_bytes()
        cast = shard + wsize if shard != wsize else 0.0
        copy_in = 0.0 if self.opts.flat_param else 2.0 * wsize
        if wsize < compute.BF16 and self.opts.fp8_scaling.startswith("torchao"):
            # torchao's FP8 all-gather (fp8_gather.py): its FP8 share (BF16 - wsize) is cast
            # by torchao's eager scale, clamp and cast, not FSDP2's one-pass cast (shard + 1)
            fp8_share = compute.BF16 - wsize
            cast += fp8_share * (pre_gather_cast_bytes(shard) - (shard + 1.0))
        return (cast + copy_in) * params / max(1, ranks) / self.hbm

    def _shard_bytes(self) -> float:
        """Bytes per element of an FSDP2 stack's sharded parameters (MemoryOptions.param_dtype:
        fp32 master shards, or NeMo AutoModel's bf16 model)."""
        return 4.0 if self.mem.param_dtype == "fp32" else compute.BF16

    @staticmethod
    def _grad_bytes(wsize: float) -> float:
        """Bytes per element of a unit's gradient as autograd makes it: the gathered
        parameters' dtype (fp32 gathers make fp32 gradients; bf16 and FP8 gathers, whose FP8
        Linears keep bf16 weight gradients, bf16)."""
        return 4.0 if wsize >= 4.0 else compute.BF16

    def copy_out_s(self, params: float, wsize: float) -> float:
        """Seconds of FSDP2's all-gather copy-out of `params` gathered parameters (read and
        write `wsize` bytes each; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
        foreach_all_gather_copy_out, on the compute stream); 0 for 'zero' sharding (DeepSpeed
        and Megatron gather into the parameters' own storage). FSDP1 (KernelOptions
        flat_param) moves the same bytes once per backward instead: the cat of a unit's
        gradient views into its flat gradient (the callers)."""
        if self.opts.sharding != "fsdp":
            return 0.0
        return 2.0 * wsize * params / self.hbm
