"""Exact model-state bytes of every rank of a meshtron run, from the plan alone (no torch).

`memory.py` costs a plan per parameter (bytes/param x parameters/GPU); this module counts what
meshtron's runtime really holds on each global rank, tensor by tensor, so the planner's numbers
match a run's `memory.json` byte for byte (tests/test_memory.py, bench/memory_vs_measured.py):

* `param_shapes` lists the model's parameters in `meshtron.model.Transformer`'s registration
  order (checked against the module in tests), cut into pipeline stages as
  `meshtron.parallel.pipeline` does (embeddings on the first stage, final norm and head on the
  last; stage s on pipeline rank s % pp, or the V placement of zero-bubble with v = 2);
* tensor parallelism shards each weight like `meshtron.parallel.tensor` does (column-parallel
  weights and biases on dim 0, row-parallel weights on dim 1, vocabulary-parallel embeddings and
  head on dim 0, norms and row-parallel biases replicated), FSDP2 then shards dim 0 of the
  tensor-parallel shard over "dp_shard"; both with torch.chunk's sizes (ceil(d/n), the last
  ranks smaller or empty), which is what DTensor's Shard and FSDP2 use;
* parameters and gradients are fp32 in both dtypes (FSDP2 keeps fp32 master parameters and
  reduces in fp32); AdamW keeps two fp32 moments per element of the parameters it updates: all
  local ones. ZeRO-1 is FSDP2 over the whole data axis (dim 0 sharded over "dp"); only with
  compressed ZeRO-1 (or DiLoCo) does AdamW keep the parameters this data-parallel rank owns
  under the runtime's greedy partition (largest first onto the least-loaded owner,
  `meshtron.parallel.data_parallel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtron.model.mla_shapes import mla_projections
from meshtron.model.spec import ModelSpec
from meshtron.planner.pipeline import stages_of_rank  # noqa: F401  (re-exported)

FP32 = 4
GIB = float(2**30)
FROZEN = "feed_forward.router.expert_bias"
"""DeepSeek-V3's balancing bias (meshtron/model/moe.py): held, never given a gradient."""
ADAM_MOMENTS = 2

_COLWISE = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.",
            "feed_forward.w3.", "attention.wq_b.", "attention.wkv_b.")
_ROWWISE = ("attention.wo.", "feed_forward.w2.")
_VOCAB = ("tok_embeddings.weight", "pos_embeddings.weight", "output.weight")


def _chunk(size: int, parts: int, index: int) -> int:
    """Length of torch.chunk(size, parts)[index] (0 when that chunk does not exist)."""
    step = math.ceil(size / parts) if size else 0
    return max(0, min(step, size - index * step))


def tp_shard_dim(name: str) -> int | None:
    """Tensor dim a parameter is sharded on under tensor parallelism (None: replicated)."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    if name in _VOCAB:
        return 0
    if any(k in name for k in _COLWISE):
        return 0
    if any(k in name for k in _ROWWISE):
        return 1 if name.endswith("weight") else None
    return None


def local_shape(name: str, shape: tuple[int, ...], tp: int, r_tp: int, dp_shard: int,
                r_dp: int, fsdp: bool) -> tuple[int, ...]:
    """Shape of the rank's local piece of a parameter."""
    out = list(shape)
    dim = tp_shard_dim(name)
    if tp > 1 and dim is not None:
        out[dim] = _chunk(out[dim], tp, r_tp)
    if fsdp and dp_shard > 1:
        out[0] = _chunk(out[0], dp_shard, r_dp)
    return tuple(out)


@dataclass(frozen=True)
class RankState:
    """Bytes one rank holds at the end of a step (what memory.json measures)."""

    rank: int
    """Global rank."""
    params: int
    """Local parameter bytes."""
    grads: int
    """Local gradient bytes (after backward)."""
    optimizer: int
    """AdamW state bytes (exp_avg + exp_avg_sq)."""
    layers: int
    """Transformer blocks on this rank."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "total": self.total}


def _block_shapes(spec: ModelSpec, i: int) -> list[tuple[str, tuple[int, ...]]]:
    h, kv, f = spec.hidden, spec.kv_dim, spec.ffn_hidden
    q = spec.heads * spec.head_dim
    qkv_bias = spec.bias or spec.qkv_bias
    pre = f"layers.{i}."
    out: list[tuple[str, tuple[int, ...]]] = []

    def norm(name: str, width: int = h, layer: bool = spec.norm == "layernorm") -> None:
        out.append((pre + name + ".weight", (width,)))
        if layer:
            out.append((pre + name + ".bias", (width,)))

    # model/transformer.py Block: pre-norms, post-norms or both (ModelSpec.norm_layout)
    has_pre, has_post = spec.norm_layout != "post", spec.norm_layout != "pre"

    def linear(name: str, n_out: int, n_in: int, bias: bool) -> None:
        out.append((pre + name + ".weight", (n_out, n_in)))
        if bias:
            out.append((pre + name + ".bias", (n_out,)))

    if has_pre:
        norm("attention_norm")
    if spec.is_mla:  # meshtron/model/mla.py, in its registration order
        for name, n_out, n_in, _ in mla_projections(spec, 1):
            linear(f"attention.{name}", int(n_out), n_in, False)
            if name in ("wq_a", "wkv_a"):
                latent = spec.q_lora_rank if name == "wq_a" else spec.kv_lora_rank
                out.append((pre + ("attention.q_norm" if name == "wq_a"
                                   else "attention.kv_norm") + ".weight", (latent,)))
        linear("attention.wo", h, spec.out_width, False)
    else:
        linear("attention.wq", q, h, qkv_bias)
        linear("attention.wk", kv, h, qkv_bias)
        linear("attention.wv", kv, h, qkv_bias)
        linear("attention.wo", h, q, spec.bias)
        if spec.qk_norm:  # RMSNorms per head, or over the whole projection (OLMo 2)
            whole = spec.qk_norm_whole
            norm("attention.q_norm", q if whole else spec.head_dim, False)
            norm("attention.k_norm", kv if whole else spec.head_dim, False)
    if has_post:
        norm("attention_post_norm")
    if has_pre:
        norm("ffn_norm")
    if spec.is_moe_layer(i):  # meshtron/model/moe.py
        e, fe, fs = spec.moe_experts, spec.moe_ffn_hidden, spec.moe_shared_experts * spec.moe_ffn_hidden
        if spec.moe_router == "sigmoid":  # the balancing bias: a Parameter nothing trains
            out.append((pre + FROZEN, (e,)))  # (the router's own, before its gate's)
        out.append((pre + "feed_forward.router.gate.weight", (e, h)))
        for name, shape in (("w1", (e, fe, h)), ("w3", (e, fe, h)), ("w2", (e, h, fe))):
            out.append((pre + f"feed_forward.experts.{name}.weight", shape))
        if fs:
            for name, n_out, n_in in (("w1", fs, h), ("w3", fs, h), ("w2", h, fs)):
                linear(f"feed_forward.shared.{name}", n_out, n_in, False)
            if spec.moe_shared_gate:  # Qwen2-MoE's sigmoid gate on the shared experts
                linear("feed_forward.shared.gate", 1, h, False)
        return out
    linear("feed_forward.w1", f, h, spec.bias)
    linear("feed_forward.w2", h, f, spec.bias)
    if spec.gated_mlp:
        linear("feed_forward.w3", f, h, spec.bias)
    if has_post:
        norm("ffn_post_norm")
    return out


def param_shapes(spec: ModelSpec, layers: range, first: bool, last: bool
                 ) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of a model part's parameters in registration order."""
    out: list[tuple[str, tuple[int, ...]]] = []
    if first:
        out.append(("tok_embeddings.weight", (spec.vocab, spec.hidden)))
        if spec.position == "learned":
            out.append(("pos_embeddings.weight", (spec.max_seq, spec.hidden)))
    for i in layers:
        out += _block_shapes(spec, i)
    if last:
        out.append(("norm.weight", (spec.hidden,)))
        if spec.norm == "layernorm":
            out.append(("norm.bias", (spec.hidden,)))
        if not (spec.tied_embeddings and first):  # a tied head is the embedding itself
            out.append(("output.weight", (spec.vocab, spec.hidden)))
    return out


def greedy_owners(numels: list[int], n: int) -> list[int]:
    """ZeRO-1 owner of each parameter: largest first onto the least-loaded owner (ties: the
    earlier parameter, the lower owner), the runtime's rule."""
    load = [0] * n
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        j = min(range(n), key=lambda k: (load[k], k))
        owner[i] = j
        load[j] += numels[i]
    return owner


def _stage_ranges(plan: Any, layers: int) -> list[range]:
    n = plan.pp * plan.virtual_stages
    counts = list(getattr(plan, "stage_layers", None) or [])
    if not counts:  # the runtime's even split: remainder layers to the middle stages first
        base, extra = divmod(layers, n)
        order = sorted(range(n), key=lambda i: (i in (0, n - 1), abs(i - (n - 1) / 2)))
        counts = [base + (1 if s in order[:extra] else 0) for s in range(n)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def rank_states(spec: ModelSpec, plan: Any, dtype: str = "fp32") -> list[RankState]:
    """Exact parameter, gradient and AdamW bytes of every global rank of `plan` (tp, pp, dp,
    zero, virtual_stages, schedule, stage_layers, dp_replicate), ranks placed by
    `meshtron.planner.placement` as the runtime's mesh is. The same in
    fp32 and bf16 runs (module docstring); `dtype` only decides whether FSDP2 is applied with a
    single data-parallel rank."""
    from meshtron.planner.placement import placement

    tp, pp, dp, zero = plan.tp, plan.pp, plan.dp, plan.zero
    v = getattr(plan, "virtual_stages", 1) or 1
    cp = getattr(plan, "cp", 1) or 1
    place = placement(plan, tp * cp * pp * dp)
    # with context parallelism FSDP2 shards over the flattened ("dp_shard", "cp") axis
    # (meshtron/parallel/data_parallel.py): cp ranks hold shards like data-parallel ones
    dp_shard = place.size("dp_shard") * cp
    fsdp = dp * cp > 1 or dtype == "bf16"
    # ZeRO-1 is FSDP2 over the whole data axis (meshtron/parallel/data_parallel.py), except
    # where meshtron.compress reduces the gradients (compressed ZeRO-0/1, DiLoCo): whole
    # parameters per owner there.
    own_reduction = getattr(plan, "diloco", 0) > 0 or (
        getattr(plan, "grad_compression", "none") != "none" and zero <= 1)
    zero1_fsdp = zero == 1 and dp > 1 and not own_reduction
    ranges = _stage_ranges(plan, spec.layers)
    n_stages = pp * v
    out: list[RankState] = []
    for rank in range(place.world_size):
        c = place.coords(rank)
        r_tp, r_pp = c["tp"], c["pp"]
        r_shard = c["dp_shard"] * cp + c.get("cp", 0)  # rank in "dp_shard" (x "cp")
        r_dp = c["dp_replicate"] * dp_shard + r_shard  # rank in the flattened "dp" group
        n_sh, r_sh = (dp, r_dp) if zero1_fsdp else (dp_shard, r_shard)
        params = opt = layers = frozen = 0
        for s in stages_of_rank(pp, v, getattr(plan, "schedule", "1f1b"), r_pp):
            numels = []
            for name, shape in param_shapes(spec, ranges[s], s == 0, s == n_stages - 1):
                n = math.prod(local_shape(name, shape, tp, r_tp, n_sh, r_sh, fsdp))
                if name.endswith(FROZEN):  # no gradient, no AdamW state: a parameter only
                    frozen += FP32 * n
                else:
                    numels.append(n)
            layers += len(ranges[s])
            params += FP32 * sum(numels)
            if zero == 1 and dp > 1 and not zero1_fsdp:
                owner = greedy_owners(numels, dp)
                opt += FP32 * ADAM_MOMENTS * sum(k for k, o in zip(numels, owner) if o == r_dp)
            else:
                opt += FP32 * ADAM_MOMENTS * sum(numels)
        out.append(RankState(rank, params + frozen, params, opt, layers))
    return out


def predict_ranks(spec: ModelSpec, plan: Any, dtype: str, capacity_gib: float,
                  opts: Any = None, mem: Any = None) -> list[tuple[RankState, Any]]:
    """Per rank: the exact model states (`rank_states`) and the planner's breakdown of the
    rank's pipeline stage, from the planner's own evaluation (`Evaluator.evaluate(stage=...)`
    of the plan with the runtime's layer split: gradient accumulation and every moment of the
    peak included; one description of a rank's memory, not two), for meshtron's runtime
    (FSDP2 framework, `dtype`) on a device of `capacity_gib`. The breakdown's parameters,
    gradients and optimizer states are the exact bytes where the planner holds them at the
    peak (a gradient the planner holds as accumulated, unsharded, `gathered`, is 0 there).
    `plan` also needs global_batch, seq_len, micro_batch, recompute and sp. `opts`: the kernel
    options (default meshtron's runtime); `mem`: other memory options (e.g. the CPU kernels a
    rehearsal runs)."""
    from meshtron.planner.placement import placement

    est_of = _stage_estimator(spec, plan, dtype, capacity_gib, opts, mem)
    place = placement(plan, plan.tp * (getattr(plan, "cp", 1) or 1) * plan.pp * plan.dp)
    out = []
    for st in rank_states(spec, plan, dtype):
        bd = est_of(place.coords(st.rank)["pp"])
        exact = {k: getattr(st, k) / GIB if getattr(bd, k) > 0 else 0.0
                 for k in ("params", "grads", "optimizer")}
        out.append((st, _replace(bd, **exact)))
    return out


def _stage_estimator(spec: ModelSpec, plan: Any, dtype: str, capacity_gib: float, opts: Any,
                     mem: Any):
    """pipeline rank -> the planner's MemoryBreakdown of it (evaluated once per rank)."""
    import dataclasses

    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.collectives import even_stage_layers
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.memory import MemoryOptions
    from meshtron.planner.plan import as_plan

    mem = mem or MemoryOptions(dtype=dtype, framework="fsdp2")
    cfg = as_plan(plan)
    if cfg.dtype != dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if cfg.pp > 1 and not cfg.stage_layers:  # the runtime's even split, as rank_states cuts
        cfg = dataclasses.replace(cfg, stage_layers=tuple(
            even_stage_layers(spec.layers, cfg.num_stages)))
    # only the device's memory matters here: it sizes the workspace allowance
    cluster = dataclasses.replace(preset_cluster("dgx-h100", 1), memory_gib=capacity_gib)
    ev = Evaluator(spec, cluster, cfg.global_batch, cfg.seq_len, opts, mem=mem)
    cache: dict[int, Any] = {}

    def of(pp_rank: int):
        if pp_rank not in cache:
            cache[pp_rank] = ev.evaluate(cfg, keep_infeasible=True, stage=pp_rank).memory
        return cache[pp_rank]

    return of


def _replace(bd: Any, **fields: float) -> Any:
    import dataclasses

    return dataclasses.replace(bd, **fields)
