"""Memory of a mixture-of-experts block on one rank: where its parameters live and what its
routed part saves for the backward. Torch-free; memory.py's terms stay those of the dense
equivalent (`compute.active_equivalent`), this module says what a MoE block holds beyond it.

Parameters (`block_params`). The routed experts of a block are E/ep per expert-parallel rank
(GShard; meshtron/parallel/expert.py); their ZeRO states are spread over the ranks holding
the same experts, the expert-data-parallel group of dp*cp/ep ranks (Megatron-Core's
"expert data parallel" = world / (pp * ep * etp); torchtitan's "dp_shard_mod_ep";
meshtron/parallel/mesh.py `ExpertMeshes`). Under tensor parallelism the stacks differ:

* meshtron's runtime (framework 'fsdp2') runs the whole MoE feed-forward (router, shared and
  routed experts) replicated over the tp ranks, fed the gathered tokens
  (meshtron/parallel/tensor.py `_moe_plan`): nothing of it is divided by tp;
* Megatron-Core shards the routed experts over expert-tensor-parallel ranks, whose size
  defaults to tp (`--expert-tensor-parallel-size`, Megatron-Core MoE README), and the shared
  experts over tp like a dense MLP; the router is replicated.

Activations (`routed_saved_bytes`, per MoE layer and micro-batch of T tokens entering the
layer, k = top_k, E experts, R = T*k*f rows reaching the rank's experts with expert
parallelism (f the routing imbalance of the fullest rank; T*k without), h hidden, fe the
expert width, b the compute dtype's bytes; under token drop R and the combine's slots are the
rows moe_capacity.expert_rows leaves: padded, every expert's capacity), read off
meshtron/model/moe.py's autograd graph (what each op saves for its backward) and checked
against `meshtron rehearse`:

* router: the fp32 affinities [T, E] (softmax's / sigmoid's output), the top-k indices
  (int64 [T, k]), and with renormalised weights the fp32 weights and their sum;
* permutation: the expert order of the T*k slots and twice the token index of each (int64,
  saved by the `index_select`s and the combine's `index_add`; `order // k` is computed twice);
* experts (one `torch._grouped_mm` per matrix, meshtron/model/moe.py `_grouped_mm_swiglu`):
  the padded input [R + 16 E/ep, h] (each group padded to 16 rows), the gate and up outputs,
  SiLU's output and the product, [R + 16 E/ep, fe] each, the destination rows (int64 R), and
  the unpadded input [R, h]: `index_copy` saves its source whole for the shape of its
  gradient (`expand_as(source)`, tools/autograd/derivatives.yaml); under expert parallelism
  also the regrouping order of the received rows (int64 R) and, by the same `index_copy`
  rule, the experts' output [R, h];
* combine: the expert outputs [T*k, h] and their weights [T*k] (the product's two inputs),
  and the weighted outputs [T*k, h] (`index_add_`'s source, saved like index_copy's).

Megatron-Core (the 'korthikanti' list, framework 'megatron'/'deepspeed'): the router's fp32
probabilities, the grouped MLP's input [R, h] (FP8 when the experts' GEMMs run in FP8:
Transformer Engine's GroupedLinear saves the quantised input; DeepSeek-V3 technical report
section 3.3.2 caches the dispatched activations in FP8), the fc1 output [R, 2 fe] (SwiGLU's
input, bf16) and SwiGLU's output [R, fe] (fc2's input: FP8 too under FP8 GEMMs, the copy
GroupedLinear saves; DeepSeek-V3 section 3.3.2 caches the SwiGLU output's FP8 copy), and the
unpermute's expert outputs [T*k, h] with the probabilities (megatron/core/transformer/moe/
moe_utils.py `unpermute`; from Megatron-Core 0.13 the probabilities are applied in the
experts' weighted SwiGLU instead, which saves them [R] beside its input and leaves the
unpermute nothing to save: MemoryOptions.moe_weighted_act).
Expert GEMMs under expert tensor parallelism hold fe/etp columns.

The dense equivalent already charges a SwiGLU of width k*fe + E/3 for the routed part
(linear in the width, `dense_routed_bytes`); `activation_extra` is the difference.
"""

from __future__ import annotations

from typing import Any

from meshtron.model.mla_shapes import mla_replicated_params
from meshtron.model.spec import ModelSpec
from meshtron.planner.memory_options import FP8_TILE_BYTES
from meshtron.planner.moe_capacity import ExpertRows

GROUPED_MM_ALIGN = 16
"""Rows per expert group are padded to this multiple (meshtron/model/moe.py, the same
constant: torch._grouped_mm's 16-byte alignment of group offsets)."""
INDEX_BYTES = 8.0
"""int64 indices (argsort, index_select, repeat_interleave)."""
FP32 = 4.0


def expert_tp(framework: str, tp: int, etp: int | None = None) -> int:
    """Tensor-parallel degree of the routed experts (module docstring): Plan.etp where set
    (Megatron-Core's folding), else the stack's own (1 for meshtron, tp for the others)."""
    if etp is not None:
        return etp
    return 1 if framework == "fsdp2" else tp


def expert_dp(plan: Any, shard: int) -> int:
    """Ranks sharing one rank's experts' ZeRO states, `shard` being the dense units' ZeRO group
    (dp/dp_replicate*cp): shard/ep where ep is folded over the data ranks; under Megatron-Core's
    folding (plan.etp set) its expert data-parallel group, tp*cp*dp / (ep*etp)
    (parallel_state.py: world // (etp * ep * pp) per stage), the experts' states being split
    over ep*etp ranks (`_block`)."""
    ep, etp = max(1, plan.ep), getattr(plan, "etp", None)
    if etp is None:
        return max(1, shard // ep)
    return max(1, shard * plan.tp // (ep * etp))


def expert_shard_group(dp: int, cp: int, ep: int) -> int:
    """Ranks that hold the same experts and share their ZeRO states: dp*cp/ep."""
    return max(1, (dp * cp) // max(1, ep))


def _block(model: ModelSpec, i: int, tp: int, ep: int, framework: str,
           etp: int | None = None) -> tuple[float, float]:
    """(parameters outside the routed experts, routed experts) of block i on one rank."""
    norms = 2 * model.norm_params
    # MLA's down-projections and latent norms are replicated over tp in every stack
    # (meshtron/parallel/tensor.py and torchtitan: NoParallel; Megatron-Core's MLA: its
    # linear_q_down_proj / linear_kv_down_proj are duplicated TE Linears): never divided
    rep = mla_replicated_params(model)
    attn = (model.attention_params() - rep) / tp + rep
    if not model.is_moe_layer(i):
        return attn + model.mlp_params() / tp + norms, 0.0
    fe, fs = model.moe_ffn_hidden, model.moe_shared_experts * model.moe_ffn_hidden
    shared = model.mlp_params(fs) if fs else 0.0
    router = model.moe_router_params()  # with the shared experts' gate (Qwen2-MoE)
    if framework != "fsdp2":
        shared /= tp
    experts = model.moe_experts * model.mlp_params(fe) / (ep * expert_tp(framework, tp, etp))
    return attn + router + shared + norms, experts


def block_params(model: ModelSpec, tp: int, pp: int, ep: int,
                 framework: str, etp: int | None = None) -> tuple[float, float]:
    """(parameters outside the routed experts, routed experts) of one block on one rank, as
    memory.layer_params_local averages blocks: the mean over the model's blocks without
    pipelining (the stage's total is exact), a MoE block's with it (the convention that the
    fullest stage holds MoE blocks only: DeepSeek-V3's 3 dense blocks of 61 sit on the first
    stage beside the embedding; a dense block can have more parameters than a MoE block's
    share of its experts under ep, but fewer states than a stage of MoE blocks)."""
    if pp > 1 and model.is_moe:
        return _block(model, model.moe_block_index(), tp, ep, framework, etp)
    kinds = [(n, _block(model, i, tp, ep, framework, etp)) for n, i in model.block_kinds()]
    return tuple(sum(n * size[part] for n, size in kinds) / model.layers for part in (0, 1))


def routed_saved_bytes(model: ModelSpec, tokens: float, tp: int, ep: int, imbalance: float,
                       cb: float, saved: str, expert_bytes: float | None = None,
                       recompute: str = "none", dense_fp8: bool = False,
                       weighted_act: bool = False, mem: Any = None,
                       etp: int | None = None, counts: ExpertRows | None = None) -> float:
    """Bytes one MoE layer's router, permutation, routed experts and combine save for the
    backward, one micro-batch of `tokens` tokens (module docstring). `saved`: memory.py's list
    ('eager' meshtron's model; else Megatron-Core's); `expert_bytes`: bytes of a saved expert
    GEMM input (FP8: 1), default `cb`. Recomputation: 'full' keeps none of it (the block's
    input only), 'half' every second layer's; meshtron's 'selective' keeps the outputs of the
    matmuls and collectives only (meshtron/parallel/recompute.py SAVED_OPS): the router's
    logits, the grouped GEMMs' outputs and the all-to-alls' outputs; Megatron's selective
    recomputes the attention core only, not the MoE. `dense_fp8`: the dense equivalent
    charged its fc1 input (the pre-MLP norm's output) as an FP8 GEMM input
    (memory_acts.te_fp8_inputs); in a MoE layer that tensor is the router's input, which the
    router's bf16 GEMM saves in the compute dtype (Megatron-Core's TopKRouter: a plain
    linear, not a Transformer Engine FP8 module): the difference is added here.
    `weighted_act`: Megatron-Core's probabilities applied in the experts' SwiGLU
    (MemoryOptions.moe_weighted_act): the combine saves no expert outputs, the SwiGLU the
    permuted probabilities (fp32 [R]). `mem`'s DeepSeek-V3 savings (MemoryOptions): the
    SwiGLU's input kept in FP8 and fc2's input recomputed (`swiglu_recompute`), the router's
    input recomputed with its norm (`recompute_norms`); Megatron-Core's list only. `etp`: the
    experts' tensor-parallel degree (`expert_tp`; None: tp): Megatron-Core's all-to-all
    dispatcher sends each tp rank's sequence shard (T/tp tokens, sequence parallelism) and
    all-gathers the received rows over the etp group (token_dispatcher.py
    `dispatch_postprocess`), so a rank's experts hold T*k*f*etp/tp rows of fe/etp columns.
    `counts`: the rows after token drop (moe_capacity.expert_rows; None: dropless at
    `imbalance`): the experts' rows at `received` (padded: every expert's capacity, the
    Megatron-Core alltoall dispatcher's C x etp x ep per local expert), the combine's at
    `sent` (the unpermute takes the rank's C E padded rows, token_dispatcher.py
    `combine_postprocess`, core_v0.15.0)."""
    if recompute == "full":
        return 0.0
    if recompute == "half":
        return 0.5 * routed_saved_bytes(model, tokens, tp, ep, imbalance, cb, saved,
                                        expert_bytes, dense_fp8=dense_fp8,
                                        weighted_act=weighted_act, mem=mem, etp=etp,
                                        counts=counts)
    k, e, h, fe = model.moe_top_k, model.moe_experts, model.hidden, model.moe_ffn_hidden
    if counts is None:
        counts = ExpertRows(imbalance, imbalance if ep > 1 else 1.0, 1.0)
    slots = tokens * k
    rows = slots * counts.received
    combined = slots * counts.sent  # the rows the combine takes back (padded or dropped)
    xb = cb if expert_bytes is None else expert_bytes
    if saved == "eager":
        padded = rows + GROUPED_MM_ALIGN * e / ep
        if recompute == "selective":
            a2a = (rows + slots) * h * cb if ep > 1 else 0.0
            return tokens * e * cb + padded * (2 * fe + h) * cb + a2a
        router = tokens * e * FP32 + slots * INDEX_BYTES
        if model.moe_norm_topk and k > 1:
            router += (slots + tokens) * FP32
        copies = 2 if ep > 1 else 1  # index_copy sources: the experts' input (+ their output)
        perm = 3 * slots * INDEX_BYTES + rows * INDEX_BYTES * copies
        experts = padded * (h * xb + 4 * fe * cb) + copies * rows * h * cb
        return router + perm + experts + combined * (2 * h + 1) * cb
    etp = expert_tp("megatron", tp, etp)
    rows *= etp / tp  # the rank's sequence shard, all-gathered over the etp group
    # the grouped MLP's input [R, h], fc1's output [R, 2 fe] (SwiGLU's input, bf16) and
    # fc2's input [R, fe]: both GEMM inputs FP8 where the GEMMs are (GroupedLinear saves
    # the quantised input; the bf16 SwiGLU output is freed once fc2 has quantised it)
    experts = rows * (h * xb + fe / etp * (2 * cb + xb))
    if mem is not None and mem.swiglu_recompute:  # FP8 SwiGLU input, fc2's input recomputed
        experts = rows * (h * xb + fe / etp * 2 * FP8_TILE_BYTES)
    # Megatron-Core runs MoE under tp > 1 with sequence parallelism: the router's input is
    # the local sequence shard; recomputed with its norm, it is not kept
    router_in = tokens * h * (cb - 1.0) / tp if dense_fp8 else 0.0
    if mem is not None and mem.recompute_norms:
        router_in = 0.0
    # the combine: the unpermute's expert outputs and probabilities (their gradient's
    # operands), or, with the probabilities in the SwiGLU, the permuted probabilities there
    combine = rows * FP32 if weighted_act else combined * (h * cb + FP32)
    return tokens * e * FP32 + slots * INDEX_BYTES + experts + combine + router_in


def dense_routed_bytes(act, model: ModelSpec, width: float, recompute: str) -> float:
    """What the dense equivalent's activations (`act(spec, recompute)`: bytes per layer)
    charge for `width` more SwiGLU columns: activation_bytes is linear in the width."""
    base = max(1, model.ffn_hidden)
    return (act(model.replace(ffn_hidden=2 * base), recompute)
            - act(model, recompute)) * width / base


def activation_extra(act, active: ModelSpec, model: ModelSpec, tokens: float, tp: int,
                     ep: int, imbalance: float, cb: float, saved: str, recompute: str,
                     expert_bytes: float | None = None,
                     shared_replicated: bool = False,
                     dense_fp8: bool = False,
                     weighted_act: bool = False, mem: Any = None,
                     etp: int | None = None,
                     counts: ExpertRows | None = None) -> tuple[float, float]:
    """(saved, recompute working set) bytes per average block and micro-batch a MoE model's
    layers hold beyond their dense equivalent `active` (`act(spec, recompute)`:
    memory.activation_bytes of a spec at the plan's other arguments): the routed part's exact
    bytes less the SwiGLU columns the equivalent charges for it, over the MoE share of the
    blocks. The working set of a recomputed layer (memory.recompute_working_bytes: what it
    saves without recomputation less what it keeps) grows by the same difference.
    `shared_replicated`: the shared experts run unsharded on every tp rank (meshtron's
    runtime) where the equivalent charged them /tp. `dense_fp8`, `weighted_act`: as
    `routed_saved_bytes` (and `etp`, `counts`)."""
    if not model.is_moe:
        return 0.0, 0.0
    share = model.moe_layers / model.layers
    routed_width = model.moe_top_k * model.moe_ffn_hidden + model.moe_experts / 3.0
    fs = model.moe_shared_experts * model.moe_ffn_hidden

    def extra(rec: str) -> float:
        exact = routed_saved_bytes(model, tokens, tp, ep, imbalance, cb, saved, expert_bytes,
                                   rec, dense_fp8, weighted_act, mem, etp, counts)
        charged = dense_routed_bytes(act, active, routed_width, rec)
        if shared_replicated and tp > 1 and fs:
            exact += dense_routed_bytes(act, active, fs, rec) * (tp - 1)
        return share * (exact - charged)

    kept = extra(recompute)
    work = 0.0 if recompute == "none" else max(0.0, extra("none") - (
        0.0 if recompute in ("full", "half") else kept))
    return kept, work


def stage_blocks(model: ModelSpec, spans: list[range], tp: int, ep: int,
                 framework: str, etp: int | None = None) -> tuple[float, float, float]:
    """(parameters outside the routed experts, routed experts, MoE share) of the mean block of
    the global blocks `spans` (ranges of indices) one pipeline rank holds: a stage with
    DeepSeek-V3's dense first blocks holds their dense MLPs, not a MoE block's experts
    (`block_params` prices every pipelined block as a MoE block, which is the fullest stage
    only when the dense blocks sit beside others). The MoE share scales the routed part's
    saved activations (`activation_extra`, averaged over the model's blocks). Counted per
    kind of block (`ModelSpec.moe_blocks_in`), never block by block."""
    n = sum(len(span) for span in spans)
    if not n:
        return 0.0, 0.0, 0.0
    moe = sum(model.moe_blocks_in(span) for span in spans)
    dense_block = _block(model, model.dense_block_index(), tp, ep, framework, etp) if n > moe \
        else (0.0, 0.0)
    moe_block = _block(model, model.moe_block_index(), tp, ep, framework, etp) if moe \
        else (0.0, 0.0)
    return (((n - moe) * dense_block[0] + moe * moe_block[0]) / n,
            ((n - moe) * dense_block[1] + moe * moe_block[1]) / n, moe / n)


def stage_pieces(model: ModelSpec, cfg: Any, chunks: list[int],
                 mean: tuple[float, float, float, float], moe_act: float, moe_work: float,
                 framework: str) -> list[tuple[float, float, float, float]]:
    """Per pipeline rank of a MoE plan whose (virtual) stages hold `chunks` layers: (block
    parameters, routed experts, activations, recompute working set) of the rank's mean block
    (`stage_blocks`), in place of `mean`: the MoE block's parameters and the model's mean
    activations, whose routed part (`moe_act`, `moe_work`: `activation_extra`) is spread over
    the model's MoE share. With ep = 1 the experts are in the block's unit, as `evaluate`
    merges them."""
    from meshtron.planner.pipeline import stages_of_rank

    pp, v = cfg.pp, cfg.virtual_stages
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    share = model.moe_layers / model.layers
    out = []
    for r in range(pp):
        spans = [range(starts[s], starts[s] + chunks[s])
                 for s in stages_of_rank(pp, v, cfg.schedule or "1f1b", r)]
        if not any(spans):
            out.append(mean)
            continue
        other, experts, mine = stage_blocks(model, spans, cfg.tp, cfg.ep, framework,
                                            getattr(cfg, "etp", None))
        if cfg.ep == 1:
            other, experts = other + experts, 0.0
        scale = mine / share - 1.0
        out.append((other, experts, mean[2] + moe_act * scale, mean[3] + moe_work * scale))
    return out
