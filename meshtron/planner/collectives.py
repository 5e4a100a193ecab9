"""The data-parallel / ZeRO and pipeline collectives one training step issues, per rank.

`step_collectives(plan, model, global_batch, seq_len)` lists what meshtron's runtime runs for a
plan (issue 17: one gradient reduction per step for ZeRO-0/1, ZeRO-1 as a distributed
optimizer, ZeRO-2/3 per micro-batch unless `accumulate_unsharded`, the embedding and
[final norm, output head] as FSDP units of their own, the last unit not resharded after
forward, no resharding between micro-batches with pipelining). It is the count the cost model
prices (planner/dp_cost.py `dp_flags`) and the one a runtime test checks against the
collectives it records on real gloo process groups. Torch-free.

What is counted, per rank, per optimizer step:

* FSDP units, in forward order on the rank's (virtual) stages: the token embedding (stage 0),
  every transformer block, and [final norm + output head] (last stage). A unit's parameters are
  those one tensor-parallel rank holds (planner/memory.py `*_params_local`), unpadded (FSDP2
  pads each parameter's dim 0 to a multiple of the group: less than one row per rank more).
* ZeRO-0: one `all_reduce` per unit (axis "dp_replicate"), input = the unit's gradient in
  `plan.reduce_dtype`.
* ZeRO-1: one `reduce_scatter` per unit (axis "dp_replicate"; input = the whole unit gradient
  in reduce_dtype) and one `all_gather` per unit of the updated parameters before the next
  forward (input = this rank's 1/dp shard in the compute dtype: FSDP2 casts the fp32 shard to
  MixedPrecisionPolicy.param_dtype before gathering, so bf16 runs gather bf16).
* ZeRO-2/3 (axis "dp_shard"): `all_gather` of each unit before its forward (input = the shard,
  1/dp_shard of the unit, in the compute dtype: bf16, fp8 runs gather bf16, fp32 runs fp32),
  and with ZeRO-3 before its backward again except for the last unit ([norm, head]: not
  resharded after forward); `reduce_scatter` of each unit's gradient after its backward (input
  = the whole unit gradient in reduce_dtype; a sigmoid router's balancing bias, E values per
  MoE block with no gradient, is gathered with its block but not reduced, as under ZeRO-1).
  ZeRO-3 without pipelining gathers every micro-batch; ZeRO-2 keeps the parameters gathered
  from the step's first forward to its last backward (one gather per unit per step). Without
  pipelining the reduce-scatter runs every micro-batch (once per step with
  `accumulate_unsharded`); with pipelining each unit is gathered once and reduced once per
  step. HSDP (dp_replicate > 1) adds an `all_reduce` over "dp_replicate" after every
  reduce-scatter, input = the reduced shard, in reduce_dtype.
* Pipelining (pp > 1), per micro-batch, for every stage boundary that crosses ranks: the
  forward `send` of the stage output / `recv` of the input, the backward `send` / `recv` of
  their gradients, each a [micro_batch, seq_len/cp, hidden] tensor in the compute dtype (1/tp
  of it with sequence parallelism). Boundaries between two stages on the same rank (the ZBV
  turn) are not counted.
* Expert parallelism (ep > 1; the runtime's contract, meshtron/parallel/expert.py): per MoE
  block on the rank and per micro-batch, on axis "ep" (group of ep ranks): one
  `all_to_all` of the per-expert counts (E int64, E*8 bytes) and four token `all_to_all`s
  (dispatch and combine forward, their gradients backward), each of mean input
  T*k*h*b bytes (T = micro_batch*seq_len/cp tokens, k = top_k, b = compute dtype bytes: the
  uneven ones average it over the group); blocks recomputed in the backward (full, selective,
  every second one of a stage's blocks with 'half') issue the forward's three again. The
  routed experts of each MoE block are an FSDP unit of their own over "dp_shard_mod_ep"
  (dp/dp_replicate*cp/ep ranks): the dense unit of the block no longer holds them; they are
  gathered, reduce-scattered and HSDP all-reduced like a block (never the last unit). ZeRO-0/1
  (dp all replicas): the experts' unit is reduced over "dp_mod_ep" (the dp/ep ranks holding
  the same experts, Megatron-Core's expert data parallel group) like a dense unit over
  "dp_replicate": once a step, ZeRO-0 one `all_reduce`, ZeRO-1 one `reduce_scatter` and one
  `all_gather` of the 1/(dp/ep) shard (tests/test_ep_train.py). Pipeline shape inference (first step
  only) is not counted. Under tp the MoE feed-forward (router, shared and routed experts) is
  replicated over the tp ranks, as the runtime runs it; only attention is split. Checked with
  pipelines (each pipeline rank's list, tp=2 and HSDP included) by tests/test_ep_pp.py.
* With context parallelism the data-parallel groups span dp x cp ranks (FSDP over dp_shard x
  cp); the axis is still named "dp_shard" / "dp_replicate", the group size in `group_size`.

Not counted: tensor-parallel and context-parallel activation collectives (per layer, inside
the blocks), the loss / metric reductions, gradient-norm clipping's all-reduce, evaluation,
checkpointing, and anything on a group of one rank. Plans with gradient compression or DiLoCo
are refused (meshtron.compress issues its own collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.errors import UserError
from meshtron.planner import memory

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "all_to_all")
"""Collective kinds a CollectiveCount can name."""
AXES = ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep", "dp_shard_mod_ep", "dp_mod_ep")
"""Mesh axis names."""


@dataclass(frozen=True)
class CollectiveCount:
    """Calls of one collective with one message size, per rank per optimizer step."""

    kind: str
    """'all_reduce' | 'reduce_scatter' | 'all_gather' | 'broadcast' | 'send' | 'recv' |
    'all_to_all'."""
    axis: str
    """Mesh axis the group spans: 'dp_shard', 'dp_replicate', 'tp', 'pp', 'cp', 'ep' (expert
    all-to-alls), 'dp_shard_mod_ep' (FSDP of the routed experts under expert parallelism,
    ZeRO-2/3) or 'dp_mod_ep' (their replicas under ZeRO-0/1)."""
    count: int
    """Calls per step on this rank."""
    bytes: int
    """Bytes of the collective's input tensor on this rank, per call (all_gather: the local
    shard; reduce_scatter: the whole unsharded buffer; all_reduce, send, recv: the tensor)."""
    group_size: int = 1
    """Ranks in the group (dp x cp for the data-parallel axes with context parallelism)."""
    dtype: str = ""
    """Element type on the wire: 'fp32', 'bf16' or 'int64' (the expert all-to-all's per-expert
    counts)."""


def even_stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per (virtual) stage when the plan gives none: an even split whose remainder goes
    to the middle stages first (the first and last carry the embedding and head); the rule of
    meshtron/parallel/mesh.py `stage_layer_counts`."""
    base, extra = divmod(num_layers, num_stages)
    order = sorted(range(num_stages),
                   key=lambda i: (i in (0, num_stages - 1), abs(i - (num_stages - 1) / 2)))
    counts = [base] * num_stages
    for i in order[:extra]:
        counts[i] += 1
    return counts


def local_stages(plan: Any, pp_rank: int) -> list[int]:
    """(Virtual) stage indices pipeline rank `pp_rank` holds (parallel/pipeline.py's rule: the
    V placement for zb with two stages per rank, else looped)."""
    n, pp = plan.num_stages, plan.pp
    if plan.schedule == "zb" and plan.virtual_stages == 2:
        return sorted({pp_rank, n - 1 - pp_rank})
    return list(range(pp_rank, n, pp))


def _stage_blocks(plan: Any, model: Any, pp_rank: int) -> list[list[int]]:
    """Global block indices of each (virtual) stage this rank holds, in forward order."""
    counts = list(plan.stage_layers) or even_stage_layers(model.layers, plan.num_stages)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(range(starts[s], starts[s] + counts[s])) for s in local_stages(plan, pp_rank)]


def _block_params(model: Any, tp: int, i: int, ep: int) -> tuple[float, float]:
    """(parameters of block i's own FSDP unit, of its routed-expert unit) on one rank: with
    expert parallelism the E/ep local experts are a unit of their own."""
    norms = 2 * model.norm_params
    dense = (model.layer_params(i) - norms) / tp + norms
    if model.is_moe_layer(i):
        # the runtime replicates an MoE feed-forward over the tp ranks (parallel/tensor.py):
        # only attention is split (measured: tests/test_ep_pp.py, tp=2)
        dense = model.attention_params() / tp + model.moe_params() + norms
    if ep > 1 and model.is_moe_layer(i):
        experts = model.moe_experts * model.mlp_params(model.moe_ffn_hidden)
        return dense - experts, experts / ep
    return dense, 0.0


def _frozen(model: Any, i: int) -> int:
    """Elements of block i's DeepSeek-V3 balancing bias (sigmoid router: E fp32 values,
    meshtron/model/moe.py `Router.expert_bias`): a Parameter without gradient, so FSDP2
    gathers it with the block's unit but never reduce-scatters it (not a trained parameter:
    ModelSpec does not count it)."""
    moe = model.is_moe and model.is_moe_layer(i) and model.moe_router == "sigmoid"
    return model.moe_experts if moe else 0


def _units(plan: Any, model: Any, pp_rank: int) -> list[tuple[float, float]]:
    """(trained parameters, gathered-only elements: `_frozen`) per tensor rank of this rank's
    FSDP units, in forward order (the blocks of a model whose blocks are alike as
    memory.layer_params_local counts them; a mixture of experts block by block, without its
    routed experts under expert parallelism)."""
    p_layer = memory.layer_params_local(model, plan.tp, plan.pp)
    ep = getattr(plan, "ep", 1)
    units: list[tuple[float, float]] = []
    last = plan.num_stages - 1
    for s, blocks in zip(local_stages(plan, pp_rank), _stage_blocks(plan, model, pp_rank)):
        if s == 0:
            units.append((memory.embedding_params_local(model, plan.tp), 0))
        if model.is_moe:
            units += [(_block_params(model, plan.tp, i, ep)[0], _frozen(model, i))
                      for i in blocks]
        else:
            units += [(p_layer, 0)] * len(blocks)
        if s == last:
            units.append((memory.head_params_local(model, plan.tp, plan.pp), 0))
    return [u for u in units if u[0] > 0]


def _expert_collectives(out: dict, plan: Any, model: Any, pp_rank: int, m: int,
                        seq_len: int, compute_b: float, reduce_b: float) -> None:
    """The expert-parallel all-to-alls and the routed experts' FSDP units (module docstring)."""
    ep, cp = plan.ep, plan.cp
    tokens = plan.micro_batch * seq_len // cp
    row = tokens * model.moe_top_k * model.hidden
    rec = plan.recompute
    pipelined = plan.pp > 1
    if plan.zero <= 1:  # the expert data-parallel group "dp_mod_ep": dp/ep ranks, once a step
        shard = plan.dp // ep
    else:
        shard = plan.dp // plan.dp_replicate * cp // ep
    gathers = 1 if (pipelined or plan.zero == 2) else m
    if plan.zero == 3 and not pipelined:
        gathers += m  # experts are resharded after forward and gathered again for backward
    reduces = 1 if (pipelined or plan.accumulate_unsharded) else m
    for blocks in _stage_blocks(plan, model, pp_rank):
        for pos, i in enumerate(blocks):
            if not model.is_moe_layer(i):
                continue
            again = rec in ("full", "selective") or (rec == "half" and pos % 2 == 1)
            token_calls = 4 + (2 if again else 0)
            count_calls = 1 + (1 if again else 0)
            _add(out, "all_to_all", "ep", m * token_calls, row, ep, compute_b)
            key = ("all_to_all", "ep", model.moe_experts * 8, ep, "int64")
            out[key] = out.get(key, 0) + m * count_calls
            u = _block_params(model, plan.tp, i, ep)[1]
            if plan.zero == 0:
                _add(out, "all_reduce", "dp_mod_ep", 1, u, shard, reduce_b)
                continue
            if plan.zero == 1:
                _add(out, "reduce_scatter", "dp_mod_ep", 1, u, shard, reduce_b)
                _add(out, "all_gather", "dp_mod_ep", 1, u / shard, shard, compute_b)
                continue
            _add(out, "all_gather", "dp_shard_mod_ep", gathers, u / shard, shard, compute_b)
            _add(out, "reduce_scatter", "dp_shard_mod_ep", reduces, u, shard, reduce_b)
            _add(out, "all_reduce", "dp_replicate", reduces, u / shard, plan.dp_replicate,
                 reduce_b)


def _add(out: dict, kind: str, axis: str, count: int, elems: float, size: int,
         width: float) -> None:
    """Count `count` calls of `elems` elements of `width` bytes (4: fp32, 2: bf16)."""
    if count <= 0 or size <= 1:
        return
    key = (kind, axis, int(round(width * elems)), size, "fp32" if width == 4.0 else "bf16")
    out[key] = out.get(key, 0) + count


def step_collectives(plan: Any, model: Any, global_batch: int, seq_len: int,
                     pp_rank: int = 0) -> list[CollectiveCount]:
    """The data-parallel / ZeRO and pipeline collectives of one training step on a rank of
    pipeline rank `pp_rank` (module docstring: what is and is not counted), one entry per
    (kind, axis, bytes), sorted."""
    if plan.grad_compression != "none" or plan.diloco:
        raise UserError("step_collectives: plans with grad_compression or diloco issue "
                        "meshtron.compress's own collectives, which are not counted here")
    if not 0 <= pp_rank < plan.pp:
        raise UserError(f"pp_rank={pp_rank}: must be in 0..{plan.pp - 1}")
    m = global_batch // (plan.dp * plan.micro_batch)
    compute_b = 4.0 if plan.dtype == "fp32" else 2.0
    reduce_b = 4.0 if plan.reduce_dtype == "fp32" else 2.0
    units = _units(plan, model, pp_rank)
    out: dict = {}
    cp, zero = plan.cp, plan.zero
    ep = getattr(plan, "ep", 1)
    if ep > 1:
        _expert_collectives(out, plan, model, pp_rank, m, seq_len, compute_b, reduce_b)
    if zero <= 1:
        size = plan.dp * cp
        for u, frozen in units:  # the balancing bias: gathered by ZeRO-1, never reduced
            if zero == 0:
                _add(out, "all_reduce", "dp_replicate", 1, u, size, reduce_b)
            else:
                _add(out, "reduce_scatter", "dp_replicate", 1, u, size, reduce_b)
                _add(out, "all_gather", "dp_replicate", 1, (u + frozen) / size, size,
                     compute_b)
    else:
        shard = plan.dp // plan.dp_replicate * cp
        rep = plan.dp_replicate
        pipelined = plan.pp > 1
        # parameters stay gathered over the micro-batches with pipelining and under ZeRO-2
        gathers = 1 if (pipelined or zero == 2) else m
        reduces = 1 if (pipelined or plan.accumulate_unsharded) else m
        for i, (u, frozen) in enumerate(units):
            is_last_unit = i == len(units) - 1 and pp_rank == _last_rank(plan)
            n_ag = gathers
            if zero == 3 and not pipelined and not is_last_unit:
                n_ag += m  # re-gathered before the backward (resharded after forward)
            # the balancing bias travels with its block (counted in the unit's dtype: measured
            # in fp32, tests/test_ep_pp.py)
            _add(out, "all_gather", "dp_shard", n_ag, (u + frozen) / shard, shard, compute_b)
            _add(out, "reduce_scatter", "dp_shard", reduces, u, shard, reduce_b)
            _add(out, "all_reduce", "dp_replicate", reduces, u / shard, rep, reduce_b)
    if plan.pp > 1:
        act = plan.micro_batch * seq_len / cp * model.hidden / (plan.tp if plan.sp else 1)
        mine = set(local_stages(plan, pp_rank))
        for s in mine:
            nxt, prv = s + 1, s - 1
            if nxt < plan.num_stages and nxt not in mine:
                _add(out, "send", "pp", m, act, plan.pp, compute_b)   # forward output
                _add(out, "recv", "pp", m, act, plan.pp, compute_b)   # its gradient
            if prv >= 0 and prv not in mine:
                _add(out, "recv", "pp", m, act, plan.pp, compute_b)   # forward input
                _add(out, "send", "pp", m, act, plan.pp, compute_b)   # its gradient
    return sorted((CollectiveCount(k, a, c, b, g, d) for (k, a, b, g, d), c in out.items()),
                  key=lambda x: (x.axis, x.kind, x.bytes))


def _last_rank(plan: Any) -> int:
    """Pipeline rank holding the last stage."""
    last = plan.num_stages - 1
    return next(r for r in range(plan.pp) if last in local_stages(plan, r))


__all__ = ["CollectiveCount", "step_collectives", "even_stage_layers", "local_stages"]
