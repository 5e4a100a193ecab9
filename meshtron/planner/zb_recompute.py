"""What torch's split backward recomputes: zero bubble's W under activation checkpointing.

torch 2.13's zero-bubble stages (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) run a
non-first stage's backward in two passes (pipelining/_backward.py): B, `stage_backward_input`,
one `autograd.grad` to the stage input that keeps the graph (retain_graph=True); then W,
`stage_backward_weight`, one `autograd.grad` per parameter group (`get_param_groups`: the
parameters reached from one intermediate node, i.e. one per parameterized op of a block:
a Linear's weight and bias share theirs). A non-reentrant checkpoint (`checkpoint_wrapper`,
what `recompute = "full"` / `"half"` wraps a block in) recomputes the block's forward once per
graph task that unpacks its saved tensors (torch/utils/checkpoint.py: the recomputed tensors
are kept per graph task id, and each `autograd.grad` is a new task): once in B, and once more
in every W group's task. Measured on CPU (meshtron's 'tiny' blocks, fp32, FlopCounterMode
around B and W of a middle stage, torch 2.13.0): 9 groups per block (two norms, q, k, v, o, w1,
w3, w2); without recomputation F : B : W = 1 : 1 : 1; with "full" 1 : 1.76 : 7.81 (B runs one
recompute, W nine; each stops early at the block's last saved tensor, so one costs 0.76 of
the forward there); with "half" 1 : 1.38 : 4.41. The first stage's W is a whole backward
(stage.py `backward_weight_one_chunk`, stage 0), one recomputation, as without zero bubble.

Selective recomputation (a checkpoint with an op policy) does not run at all under the split
backward: torch refuses the second backward through the cached region ("Trying to backward an
extra time. You are only allowed to backward once on any region computed under selective
activation checkpoint", measured on the same blocks); plan_rules_runtime.py refuses the plan.

What W holds meanwhile (`WeightPass`): each group keeps its recomputed copy of what the nodes
W never runs saved until W ends, and W peaks while a group of the stage's last checkpointed
block recomputes it (traced group by group on the 'mid' model, docs/measurements.md
#zbv-full-recompute).

The planner prices each W group's recomputation as B's (the whole block's forward: the same
approximation as `compute.LayerCost.per_microbatch` makes for B; the early stop saves the
work after the block's last saved tensor, w2's GEMM and the residual add here).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

SPLIT_BACKWARD_SCHEDULES = ("zb",)
"""meshtron's schedules that run torch's split backward (parallel/pipeline.py build_schedule:
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)."""


def weight_groups(model) -> int:
    """Parameter groups of one dense block under torch's `get_param_groups`: one per
    parameterized op (a norm, a Linear; weight and bias of one op are one group): the two
    norms, q/k/v/o, the MLP's two or three matrices, and q/k norms where the model has them.
    (A mixture-of-experts block's router and expert matrices are counted as a dense MLP's.)"""
    norms = 2 + (2 if model.qk_norm else 0)
    mlp = 3 if model.gated_mlp else 2
    if getattr(model, "is_mla", False):  # model/mla.py: wq_a, q_norm, wq_b (or wq), wkv_a,
        # kv_norm, wkv_b, wo
        return 2 + (7 if model.q_lora_rank else 5) + mlp
    return norms + 4 + mlp


def weight_recompute_share(recompute: str) -> float:
    """Blocks recomputed per block, on the mean: 1 with 'full', 0.5 with 'half' (every second
    block), 0 otherwise (a part's own count: estimate_half.HalfRecompute.half_replay)."""
    return {"full": 1.0, "half": 0.5}.get(recompute, 0.0)


def weight_pass_recompute(model, recompute: str, schedule: str, pp: int, framework: str,
                          fwd: float) -> float:
    """Seconds W adds per layer and micro-batch on a non-first stage under torch's zero
    bubble with checkpointed blocks: one recomputed forward (`fwd`, the layer's forward
    seconds, or its tensor-parallel part) per parameter group (module docstring); 0 for
    other schedules, frameworks (FSDP2 under torch.distributed.pipelining only) and
    recompute modes."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES or pp <= 1 or framework != "fsdp2":
        return 0.0
    return weight_groups(model) * weight_recompute_share(recompute) * fwd


class WeightGroup(NamedTuple):
    """One W parameter group of a block: the gradient B captured for it (bytes per token;
    W frees it once the group has run, _backward.py `del param_group["grads"]`), its
    parameter elements (its weight gradient's share of the block's), and `last_holder`
    (bytes per token): the saved tensors beyond `memory_zb.weight_recompute_kept_bytes`'s
    set whose last holding node is this group's op (every earlier group's recomputed copy
    keeps them until this group runs)."""

    captured: float
    params: float
    last_holder: float


def block_groups(model, tp: int, sp: bool, cb: float, composite: bool) -> tuple:
    """A dense block's W parameter groups in torch's order (`get_param_groups` walks the
    stage's `parameters()`: the block's registration order, model/transformer.py Block:
    attention norm, wq, wk, wv, wo, q/k norms, MLP norm, w1, w2, w3), per token.

    What only W's own nodes save: the composite RMSNorm's weight product saves its fp32
    normalized input (4 bytes; a fused norm or LayerNorm is one node saving the norm's input,
    counted with the residual); wq, wk and wv save the attention norm's output, w1 and w3 the
    MLP norm's (column-parallel: the whole hidden width), w2 the SwiGLU product or GELU
    output (its column-parallel share). `composite`: memory_zb._composite_norm."""
    h, hd = model.hidden, model.head_dim
    h_in = h / (tp if sp and tp > 1 else 1)
    q, kv, ffn = model.heads * hd / tp, model.kv_dim / tp, model.ffn_hidden / tp
    nb = 4.0 if composite else cb  # the composite norm's weight product runs in fp32
    normed = 4.0 * h_in if composite else 0.0
    gated = model.gated_mlp
    groups = [WeightGroup(h_in * nb, h, normed)]
    if getattr(model, "is_mla", False):
        groups += mla_groups(model, tp, cb, nb, composite)
    else:
        groups += [WeightGroup(q * cb, h * q, 0.0), WeightGroup(kv * cb, h * kv, 0.0),
                   WeightGroup(kv * cb, h * kv, h * cb), WeightGroup(h * cb, q * h, 0.0)]
    if model.qk_norm:  # Qwen3's per-head norms (memory_zb.captured_grad_bytes' count)
        groups += [WeightGroup(q * cb, hd, 4.0 * q if composite else 0.0),
                   WeightGroup(kv * cb, hd, 4.0 * kv if composite else 0.0)]
    groups += [WeightGroup(h_in * nb, h, normed),
               WeightGroup(ffn * cb, h * ffn, 0.0 if gated else h * cb),
               WeightGroup(h * cb, ffn * h, ffn * cb)]
    if gated:
        groups.append(WeightGroup(ffn * cb, h * ffn, h * cb))
    return tuple(groups)


def mla_groups(model, tp: int, cb: float, nb: float, composite: bool) -> list:
    """MLA's W groups in model/mla.py's registration order (wq_a, q_norm, wq_b or one wq;
    wkv_a, kv_norm, wkv_b; wo), per token: the down-projections and latent norms replicated
    (their whole outputs captured), the up-projections and wo by heads. Only W's nodes save
    the latent norms' outputs (wq_b's, wkv_b's input), the attention norm's output past
    wkv_a (its last reader), and the output cut back to v_head_dim (wo's input: a copy of
    the padded SDPA output, which SDPA itself keeps); the composite norms' fp32 products."""
    h, heads, qr, kvr = model.hidden, model.heads, model.q_lora_rank, model.kv_lora_rank
    qk, rope = model.head_dim, model.qk_rope_head_dim
    q_up, kv_up = heads * qk / tp, heads * (model.qk_nope_head_dim + model.v_dim) / tp
    out = model.out_width / tp
    if qr:
        groups = [WeightGroup(qr * cb, h * qr, 0.0),
                  WeightGroup(qr * nb, qr, 4.0 * qr if composite else 0.0),
                  WeightGroup(q_up * cb, qr * q_up, qr * cb)]
    else:
        groups = [WeightGroup(q_up * cb, h * q_up, 0.0)]
    return groups + [WeightGroup((kvr + rope) * cb, h * (kvr + rope), h * cb),
                     WeightGroup(kvr * nb, kvr, 4.0 * kvr if composite else 0.0),
                     WeightGroup(kv_up * cb, kvr * kv_up, kvr * cb),
                     WeightGroup(h * cb, out * h, out * cb)]


class WeightPass(NamedTuple):
    """What a non-first stage's W adds at its peak under checkpointed blocks (`peak`).

    Per checkpointed block each W group keeps a recomputed copy of what the nodes W never
    runs saved (`copy`, memory_zb.weight_recompute_kept_bytes / groups) until W ends, and,
    until the group that runs their last holder, what W's own nodes saved (`groups`'
    `last_holder`). W's peak is in a group of the stage's last checkpointed block, while it
    recomputes the block (the recomputation's working set is the memory model's `recompute`
    term, a constant of the stage, not counted here): the earlier blocks' copies, this
    block's earlier groups' copies, less the captured gradients W has freed, plus the weight
    gradients it has made (`pending` per layer, 0 where the accumulator is the gradient).
    Under `half` the stored blocks W runs before it free what only W's nodes saved. Traced
    on the 'mid' model (docs/measurements.md #zbv-full-recompute), GiB above W's start: the
    V's rank 1 under full recomputation (2 blocks per stage) peaks at its last block's w2
    group, 4.262, priced 4.258 with the recomputation's 0.383; zb's last stage under `half`
    (3 blocks, the middle one checkpointed) at that block's w2 group, 2.049, priced 2.046."""

    copy: float
    groups: tuple
    pending: float
    every: int

    def peak(self, layers: float) -> float:
        """Bytes above W's start (its micro-batch's captured gradients in it) at W's peak on a
        stage of `layers` blocks, every `every`-th checkpointed (meshtron's `half`: blocks 1,
        3, ... of a part, parallel/recompute.py); a mean count (the planner's before the
        layer split) between its neighbours'."""
        low = int(layers)
        if layers == low:
            return self._peak(low)
        return self._peak(low) + (layers - low) * (self._peak(low + 1) - self._peak(low))

    def _peak(self, layers: int) -> float:
        return _weight_pass_peak(self, layers)


# memoised: memory_zb.held weighs every zb stage of every plan the search meets, and plans
# that differ in knobs W does not read (dp, the ZeRO stage, offload) ask the same peak; the
# key is the whole WeightPass (every figure `_peak` reads) and the layer count (session 48)
@lru_cache(maxsize=4096)
def _weight_pass_peak(wp: WeightPass, layers: int) -> float:
    """`WeightPass.peak` at a whole layer count."""
    checked = [i for i in range(layers) if i % wp.every == wp.every - 1]
    if not checked:
        return 0.0
    n = len(wp.groups)
    captured = sum(g.captured for g in wp.groups)
    params = sum(g.params for g in wp.groups) or 1.0
    # the blocks W has finished: every group's copy of a checkpointed one, captured
    # gradients freed, weight gradients made; a stored block's tensors only W's nodes
    # saved freed as they run (retain_graph=False)
    stored = checked[-1] - (len(checked) - 1)
    done = ((len(checked) - 1) * n * wp.copy
            + checked[-1] * (wp.pending - captured)
            - stored * sum(g.last_holder for g in wp.groups))
    best = 0.0
    for j in range(n):  # the start of group j of the last checkpointed block
        held = sum(g.last_holder for g in wp.groups[j:])
        ran = wp.groups[:j]
        part = (j * (wp.copy + held) - sum(g.captured for g in ran)
                + wp.pending * sum(g.params for g in ran) / params)
        best = max(best, part)
    return max(0.0, done + best)
