"""The cost model's cached pieces (estimate.Evaluator's per-instance and process-wide memos):
one micro-batch's compute and communication per layer (`_micro`, with its MoE part `_moe`),
its memory (`_memory_pieces`), the parameters per tensor rank, where the groups sit, the
stack's layer split and the pipeline schedules' in-flight micro-batches. Evaluator.evaluate
combines them (estimate.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from meshtron.model.spec import ModelSpec
from meshtron.planner import (comm, compute, fp8_amax, host, memory, memory_pipeline,
                              moe_capacity, moe_cost, moe_host, moe_memory, mtp, pipeline,
                              pipeline_split, placement)
from meshtron.planner.fp8 import fp8_fractions
from meshtron.planner.plan import Plan


class MicroCosts(NamedTuple):
    """Per micro-batch costs of one (tp, micro-batch, sp, recompute, cp, dtype) choice."""

    layer: float
    """Compute of one layer (recomputation included), seconds."""
    layer_tp: float
    """Tensor-, context- and expert-parallel communication of one layer, seconds (the
    expert all-to-alls averaged over the blocks: `Evaluator._moe`)."""
    layer_fwd: float
    """Forward part of one layer (compute + communication), seconds."""
    layer_wgrad: float
    """Weight-gradient part of one layer, seconds."""
    emb: compute.EdgeCost
    """The embedding's costs."""
    head: compute.EdgeCost
    """Final norm + head + loss costs."""
    p2p_bytes: float
    """Bytes of one pipeline send per tensor rank."""
    gather: float
    """Seconds to re-gather a scattered pipeline activation over the tensor group."""


class MemoryPieces(NamedTuple):
    """Bytes of one micro-batch's tensors at the plan's dtype (memory.py)."""

    mem: memory.MemoryOptions
    """The memory options with the plan's dtype."""
    activations: float
    """Activations one layer keeps."""
    work: float
    """Working set of a recomputed layer."""
    logits: float
    """Logits and their gradients (last stage)."""


class StageParams(NamedTuple):
    """Parameters on one tensor rank."""

    layer: float
    """Of one transformer block."""
    embedding: float
    """Of the embedding."""
    head: float
    """Of the final norm and head."""
    largest: float
    """Of the largest single weight matrix."""


class CostPieces:
    """Mixin of `estimate.Evaluator`: the cached pieces of its cost model. Needs self.model,
    self.active, self.cluster, self.seq, self.opts, self.mem, self.fab and the per-instance
    cache self._cache (Evaluator.__init__)."""

    def _moe(self, mb: int, rec: str, cp: int, dtype: str, ep: int,
             tp: int = 1, window: tuple[float, float] = (0.0, 0.0),
             etp: int | None = None) -> tuple[float, ...]:
        """Per average block and micro-batch: (extra compute fwd+bwd+recomputed, its forward
        part, exposed expert all-to-all fwd+bwd+recomputed, its forward part) of the MoE
        layers beyond their dense equivalent (moe_cost.py; their memory: `_moe_memory`),
        averaged over the blocks (moe_layers / layers of them are MoE); zeros for a dense
        model. `tp`: where the ep group sits (ep data ranks tp apart: across nodes when
        tp * ep exceeds one, placement.ep_group). `window`: the dense equivalent layer's
        (forward, backward) compute, beside which an overlapping stack hides the all-to-alls
        (moe_cost.overlapped_a2a); `_micro` passes it and keeps it for `evaluate`. `etp`:
        Plan.etp (Megatron-Core's folding: ep groups etp apart, each rank dispatching its own
        sequence shard; None: the stack's own expert tp)."""
        model = self.model
        if not model.is_moe:
            return (0.0, 0.0, 0.0, 0.0)
        key = ("moe", mb, rec, cp, dtype, ep, tp, window, etp)
        hit = self._cache.get(key)
        if hit is None:
            o = self.opts
            stride = tp if etp is None else etp  # placement.expert_stride
            group = placement.ep_group(stride, ep, self.cluster.gpus_per_node)
            # meshtron's routed experts stay bf16 in an FP8 run (torchao converts nn.Linear
            # only: planner/fp8.py); Transformer Engine's and DeepSeek's grouped GEMMs are FP8
            e_dtype = "bf16" if dtype == "fp8" and o.fp8_filter == "torchao" else dtype
            mc = moe_cost.moe_layer_cost(model, self.cluster, mb * self.seq / cp, ep, group,
                                         e_dtype, float(o.expert_imbalance), o.ep_overlap,
                                         o.ep_node_limit, o.stack, tp,
                                         moe_memory.expert_tp(self.mem.framework, tp, etp),
                                         *window,
                                         moe_cost.per_expert_gemms(self.mem.framework),
                                         o.fp8_scaling, o.fp8_gemm, o.fp8_split_accum_bwd,
                                         o.ep_dispatch,
                                         moe_cost.folded(self.mem.framework, ep, etp),
                                         o.expert_routing, float(o.expert_capacity),
                                         o.router_dtype, o.expert_capacity_pad)
            share = model.moe_layers / model.layers
            # forward replayed, on the mean (a part's own count: HalfRecompute.half_replay)
            again = {"full": 1.0, "half": 0.5}.get(rec, 0.0)
            # with ep > 1 the dispatch reads its split sizes on the host once per MoE layer
            # forward (meshtron, torchtitan, Megatron's all-to-all dispatcher): a sync each,
            # but for Megatron-Core's token drop padded to capacity (moe_host.dispatcher_syncs)
            padded = float(o.expert_capacity) if o.expert_capacity_pad else 0.0
            syncs = moe_host.dispatcher_syncs(moe_cost.per_expert_gemms(self.mem.framework),
                                              o.ep_dispatch, padded)
            sync = host.SYNC_S if ep > 1 and syncs else 0.0
            hit = (share * ((mc.compute_fwd + sync) * (1 + again) + mc.compute_bwd),
                   share * (mc.compute_fwd + sync),
                   share * (mc.a2a_fwd * (1 + again) + mc.a2a_bwd), share * mc.a2a_fwd)
            self._cache[key] = hit
        return hit

    def fine_recompute(self, lc: compute.LayerCost, rec: str) -> dict[str, float]:
        """Seconds by kind one layer's backward spends per micro-batch running again what the
        memory options' fine-grained recomputation dropped (LayerCost.fine_recompute; the
        activation only where the MLP is gated, as memory_acts prices its saving)."""
        mem = self.mem
        return lc.fine_recompute(mem.recompute_norms, mem.recompute_up_proj,
                                 mem.swiglu_recompute and self.active.gated_mlp, rec)

    def _fp8_step(self, tp: int, dtype: str, fp8_recipe: str) -> float:
        """Seconds per layer and step casting FP8 weights once per step (Transformer Engine's
        weight cache: compute.fp8_step_cast_s); 0 for other dtypes and for torchao."""
        if dtype != "fp8":
            return 0.0
        frac = tuple(fp8_fractions(self.model, tp, fp8_recipe, self.opts.fp8_filter).values())
        return compute.fp8_step_cast_s(self.active, self.cluster, tp, self.opts, frac,
                                       fp8_recipe)

    def _micro(self, tp: int, mb: int, sp: bool, rec: str, cp: int = 1, dtype: str = "bf16",
               ep: int = 1, fp8_recipe: str = "rowwise", etp: int | None = None):
        key = ("micro", tp, mb, sp, rec, cp, dtype, ep, fp8_recipe, etp)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        m, cl, opts, s = self.model, self.cluster, self.opts, self.seq
        frac = None
        if dtype == "fp8":  # the runtime's rule on the real model's Linears (planner/fp8.py)
            frac = tuple(fp8_fractions(m, tp, fp8_recipe, opts.fp8_filter).values())
        # K/V copied per query head before the kernel (torchtitan's and Hugging Face's
        # repeat_kv); Megatron-Core hands TE's fused attention the K/V groups as they are
        repeat = self.mem.gqa_copies and self.mem.framework != "megatron"
        lc = compute.layer_cost(self.active, cl, tp, mb, s, sp, opts, cp, dtype, frac,
                                fp8_recipe, repeat, fp8_amax.mlp_amax_share(m))
        c_l, tpc_l, f_l, w_l = lc.per_microbatch(rec, opts.attention)
        if rec == "selective" and opts.attention == "flash":
            # what the framework's selective policy runs again in the backward (memory.py):
            # meshtron's keeps matmul and collective outputs only (the attention kernel and the
            # memory-bound ops are recomputed); torchtitan's "op" policy keeps every other
            # matmul and the attention output; Korthikanti's (Megatron-Core core_r0.8.0
            # transformer/attention.py `_checkpointed_attention_forward`: the core under
            # tensor_parallel.checkpoint) runs the flash forward again in the backward
            saved = self.mem.saved
            if saved == "eager":
                c_l += lc.fwd - lc.linear_fwd
            elif saved == "alternate-matmul":
                c_l += lc.fwd - lc.linear_fwd - lc.core_fwd + 0.5 * lc.linear_fwd
            elif saved == "korthikanti":
                c_l += lc.core_fwd
        c_l += sum(self.fine_recompute(lc, rec).values())
        # the layer's parts by kind, for planner/step_categories.py
        self._cache[("layer", tp, mb, sp, rec, cp, dtype, ep, fp8_recipe)] = lc
        window = (lc.fwd, lc.bwd)
        self._cache[("window", tp, mb, sp, rec, cp, dtype, ep, fp8_recipe)] = window
        moe_c, moe_f, a2a, a2a_f = self._moe(mb, rec, cp, dtype, ep, tp, window, etp)
        c_l, tpc_l, f_l = c_l + moe_c, tpc_l + a2a, f_l + moe_f + a2a_f
        emb = compute.embedding_cost(m, cl, tp, mb, s, sp, cp)
        head = compute.head_cost(m, cl, tp, mb, s, sp, opts.head_stack, cp, dtype,
                                 opts.eager_norm, opts.vocab_parallel_ce, opts.flash_ce,
                                 opts.train_metrics, opts.z_loss, opts.logits_fp32)
        if m.mtp_depth:  # DeepSeek-V3's MTP modules beside the head (planner/mtp.py)
            proj = compute.cluster_gemm_time(mb * s / cp, m.hidden, 2 * m.hidden,
                                             cl.at_dtype(compute.compute_dtypes(dtype)[1]))
            head = mtp.with_mtp(head, m.mtp_depth, (c_l, tpc_l, f_l, w_l), proj)
        # pipeline p2p: [mb*s/cp, h] in the compute dtype split over the tensor group,
        # re-gathered on NVLink (already split with sequence parallelism); without
        # scatter/gather each tensor rank sends the whole activation over its own link
        p2p_bytes = (4.0 if dtype == "fp32" else compute.BF16) * mb * s / cp * m.hidden / tp
        gather = 0.0 if sp else comm.all_gather(p2p_bytes * tp, self._tp_group(tp), self.fab)
        if not opts.p2p_scatter_gather and not sp:
            p2p_bytes, gather = p2p_bytes * tp, 0.0
        hit = MicroCosts(c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather)
        self._cache[key] = hit
        return hit

    def _memory_pieces(self, tp: int, mb: int, sp: bool, rec: str, dtype: str, cp: int = 1,
                       ep: int = 1, pp: int = 1, fp8_recipe: str = "rowwise",
                       etp: int | None = None):
        """(memory options, activations per layer, recompute working set, logits) in bytes for
        one micro-batch at the plan's dtype (memory.py); a context rank holds seq/cp tokens of
        each sequence (the unfused score matrix is then counted for seq/cp keys: a combination
        no context-parallel stack runs)."""
        key = ("mem", tp, mb, sp, rec, dtype, cp, ep, pp > 1, fp8_recipe, etp)
        hit = self._cache.get(key)
        if hit is None:
            mem = self.mem
            if mem.dtype != dtype:
                mem = dataclasses.replace(mem, dtype=dtype)
            mem = memory.canonical(mem)  # one object per value: cheap memo keys downstream
            seq = self.seq // cp
            args = (self.active, tp, sp, mb, seq, rec, self.opts, mem)
            kv = memory.gathered_kv_bytes(self.model, tp, mb, self.seq, cp, rec, self.opts, mem)
            moe_act, moe_work = self._moe_memory(tp, mb, sp, rec, seq, mem, ep, dtype, etp)
            hit = MemoryPieces(mem, memory.activation_bytes(*args) + kv + moe_act,
                               # the (recomputed) block's backward: its own temporaries
                               # or an eager FP8 cast (memory_acts.backward_working_bytes)
                               memory.backward_working_bytes(*args, fp8_recipe) + moe_work,
                               memory.logits_bytes(self.model, tp, mb, seq, mem,
                                                   pipelined=pp > 1, sp=sp,
                                                   z_loss=self.opts.z_loss,
                                                   logits_fp32=self.opts.logits_fp32))
            self._cache[key] = hit
        return hit

    def _moe_memory(self, tp: int, mb: int, sp: bool, rec: str, seq: int, mem, ep: int,
                    dtype: str, etp: int | None = None) -> tuple[float, float]:
        """(saved, recompute working set) bytes per average block and micro-batch of the MoE
        layers beyond their dense equivalent (moe_memory.py)."""
        def act(spec, r):
            return memory.activation_bytes(spec, tp, sp, mb, seq, r, self.opts, mem)

        o = self.opts
        # FP8 expert GEMMs save their quantised input (not meshtron's: torchao keeps experts
        # in bf16, planner/fp8.py)
        fp8 = dtype == "fp8" and o.fp8_filter != "torchao"
        counts = self._expert_rows(mb * seq, tp, ep, etp, mem.framework)
        return moe_memory.activation_extra(
            act, self.active, self.model, mb * seq, tp, ep, float(o.expert_imbalance),
            mem.compute_bytes, mem.saved, rec, 1.0 if fp8 else None,
            shared_replicated=mem.framework == "fsdp2",
            dense_fp8=mem.saved == "korthikanti" and memory.te_fp8_inputs(o, mem),
            weighted_act=mem.moe_weighted_act, mem=mem,
            etp=moe_memory.expert_tp(mem.framework, tp, etp), counts=counts)

    def _expert_rows(self, tokens: float, tp: int, ep: int, etp: int | None = None,
                     framework: str | None = None) -> moe_capacity.ExpertRows:
        """The rows of one MoE layer after token drop (moe_capacity.expert_rows) for a
        micro-batch of `tokens` tokens per tensor group: each rank routes its own sequence
        shard where the stack folds the expert grid (moe_cost.folded_tokens). `framework`:
        the memory options' (default the evaluator's)."""
        o, model = self.opts, self.model
        framework = framework or self.mem.framework
        is_folded = moe_cost.folded(framework, ep, etp)
        routed, _ = moe_cost.folded_tokens(tokens, tp, moe_memory.expert_tp(framework, tp, etp),
                                           is_folded)
        return moe_capacity.expert_rows(routed, model.moe_top_k, model.moe_experts, ep,
                                        float(o.expert_imbalance), float(o.expert_capacity),
                                        o.expert_capacity_pad)

    def _groups(self, cfg: Plan) -> dict[str, Any]:
        """Where the plan's tp / pp / dp groups sit on this cluster (placement.py)."""
        key = ("groups", cfg.tp, cfg.pp, cfg.dp, cfg.zero >= 2, cfg.dp_replicate,
               cfg.virtual_stages > 1, cfg.cp, cfg.ep)
        hit = self._cache.get(key)
        if hit is None:
            hit = placement.groups_for_cost(cfg, self.cluster.gpus_per_node)
            hit["experts"] = placement.expert_groups(cfg, self.cluster.gpus_per_node, hit)
            self._cache[key] = hit
        return hit

    def _tp_group(self, tp: int) -> comm.Group:
        return placement.tp_group(tp, self.cluster.gpus_per_node)

    def _params(self, tp: int, pp: int) -> tuple[float, float, float, float]:
        key = ("params", tp, pp)
        hit = self._cache.get(key)
        if hit is None:
            hit = StageParams(memory.layer_params_local(self.model, tp, pp),
                   memory.embedding_params_local(self.model, tp),
                   memory.head_params_local(self.model, tp, pp),
                   memory.largest_param_local(self.model, tp))
            self._cache[key] = hit
        return hit

    def _time_partition(self, pp: int, v: int, t_layer: float, e_first: float, e_last: float,
                        caps: list[int] | None = None, weights: tuple = (1.0, 1.0, 1.0)):
        """Layers per device as the priced stack splits them (pipeline_split.py: meshtron's
        and torchtitan's any split, time-balanced; Megatron's equal chunks; DeepSpeed's
        balanced partition), within the memory `caps` where the stack can choose."""
        rule = self.mem.split_rule
        key = ("part", rule, pp, v, t_layer, e_first, e_last,
               tuple(caps) if caps else None, weights)
        hit = self._cache.get(key, False)
        if hit is False:
            hit = pipeline_split.split_for(rule, self.model.layers, pp, v, t_layer, e_first,
                                           e_last, caps, weights)
            if hit is not None and caps and any(k > c for k, c in zip(hit, caps)):
                hit = None  # a computed split (DeepSpeed's) that does not fit
            self._cache[key] = hit
        return hit

    def _weighted_in_flight(self, pp: int, v: int, m: int, chunks: list[int],
                            even: list[float], act: float, grad: float,
                            extra: int = 0, odd: float = 0.0) -> list[float]:
        return list(_weighted_in_flight(pp, v, m, tuple(chunks), tuple(even), act, grad, extra,
                                        odd))

    def _peak_outputs(self, pp: int, v: int, m: int, rank: int, layers: list[int], act: float,
                      grad: float, out: float, odd: float = 0.0) -> float:
        return _peak_outputs(pp, v, m, rank, tuple(layers), act, grad, out, odd)

    def _in_flight_lower_bound(self, pp: int, v: int, m: int, chunks: list[int],
                               act: float, grad: float, extra: int = 0) -> list[float]:
        """Per pipeline rank, a multiplier never above `_weighted_in_flight`'s (the same
        conversion of memory_pipeline.held_lower_bound, a lower bound of the walk's peak)."""
        return list(_in_flight_lower_bound(pp, v, m, tuple(chunks), act, grad, extra))

    def _capacity_flops(self, cfg: Plan) -> float:
        """Hardware FLOPs per token the routed experts run beyond the model FLOPs under token
        drop (moe_capacity.executed_expert_flops_per_token: padded rows added, dropped ones
        taken off, the recomputed forward's too); 0 dropless."""
        if not self.model.is_moe or self.opts.expert_capacity <= 0:
            return 0.0
        counts = self._expert_rows(cfg.micro_batch * self.seq / cfg.cp, cfg.tp, cfg.ep,
                                   cfg.etp)
        return moe_capacity.executed_expert_flops_per_token(
            self.model, counts, compute.recompute_share(cfg.recompute))

    def _recompute_flops(self, rec: str) -> float:
        """FLOPs per token recomputation runs again: the recompute mode's
        (compute.recompute_flops_per_token) and the memory options' recomputed up-projections
        (compute.fine_recompute_flops_per_token)."""
        return (_recompute_flops(self.model, self.seq, rec, self.opts.attention,
                                 self.opts.v_width == "native")
                + compute.fine_recompute_flops_per_token(self.model, rec,
                                                         self.mem.recompute_up_proj))

    def _in_flight(self, schedule: str, pp: int, v: int, m: int) -> list[float]:
        key = ("inflight", schedule, pp, v, m)
        hit = self._cache.get(key)
        if hit is None:
            hit = [pipeline.in_flight(schedule, pp, v, m, i) for i in range(pp)]
            self._cache[key] = hit
        return hit


# The interleaved schedule walks (memory_pipeline.py) are the costliest piece of an interleaved
# plan's memory, O(micro-batches x virtual stages) per pipeline rank, and repeat: configs that
# differ only in knobs the walk does not read (the schedule's time, ZeRO stages at the same
# gradient bytes) and the further searches of one command (a pinned layout's fits, offload,
# knob alternatives), each with its own Evaluator. Pure functions of their (hashable)
# arguments: memoised process-wide (typed: an int and a float of equal value are two keys;
# the tuples hold what pipeline.in_flight and the layer splits give, floats and ints).
@functools.lru_cache(maxsize=8192, typed=True)
def _weighted_in_flight(pp: int, v: int, m: int, chunks: tuple[int, ...],
                        even: tuple[float, ...], act: float, grad: float,
                        extra: int, odd: float) -> tuple[float, ...]:
    return tuple(memory_pipeline.weighted_in_flight(pp, v, m, list(chunks), list(even), act,
                                                    grad, extra, odd))


@functools.lru_cache(maxsize=32768, typed=True)
def _peak_outputs(pp: int, v: int, m: int, rank: int, layers: tuple[int, ...], act: float,
                  grad: float, out: float, odd: float) -> float:
    return memory_pipeline.peak_outputs(pp, v, m, rank, list(layers), act, grad, out, odd)


@functools.lru_cache(maxsize=8192, typed=True)
def _in_flight_lower_bound(pp: int, v: int, m: int, chunks: tuple[int, ...], act: float,
                           grad: float, extra: int) -> tuple[float, ...]:
    out = []
    for s in range(pp):
        layers = [chunks[c * pp + s] for c in range(v)]
        n = sum(layers)
        if not n:  # weighted_in_flight keeps the even spread there: no bound, no pruning
            out.append(0.0)
            continue
        low = _held_lower_bound(pp, v, m, s, tuple(layers), act, grad, extra)
        out.append(max(0.0, (low - grad * n) / (act * n)))
    return tuple(out)


@functools.lru_cache(maxsize=32768, typed=True)
def _held_lower_bound(pp: int, v: int, m: int, s: int, layers: tuple[int, ...], act: float,
                      grad: float, extra: int) -> float:
    return memory_pipeline.held_lower_bound(pp, v, m, s, list(layers), act, grad, extra)


@functools.lru_cache(maxsize=256)
def _recompute_flops(model: ModelSpec, seq: int, recompute: str, attention: str,
                     v_native: bool) -> float:
    """compute.recompute_flops_per_token, memoised across Evaluators: it sums over every block,
    and the searches of one command (offload, knob alternatives, a pinned layout's fits) each
    build their own Evaluator of the same model (a frozen, hashable ModelSpec)."""
    return compute.recompute_flops_per_token(model, seq, recompute, attention, v_native)
