"""Activations per block and micro-batch, the recomputation working set and the loss's
logits, bytes, for the saved-tensor list and the loss a framework runs.

Activations per layer and micro-batch: the tensors autograd saves, listed op by op
(`activation_bytes`). Three lists:

* `korthikanti` (Megatron-LM / Transformer Engine fused kernels; Korthikanti et al. 2022,
  section 4, eqs. 1-5, generalised to grouped-query attention and SwiGLU): norm inputs 4h, QKV
  and MLP inputs 4h (both /t with sequence parallelism), Q 2h, K and V 4kv, attention output 2h,
  MLP 6f (SwiGLU, fused: gate and up inputs + product) or 4f (GeLU), dropout masks 2h; the
  attention core 2as (unfused; 5as with dropout), or a fp32 log-sum-exp per head with
  FlashAttention. Selective recomputation drops the attention core. Q and the attention
  output are heads x head_dim wide (h for most models; 2h for Qwen3). Under Transformer
  Engine's FP8 (`te_fp8_inputs`) every GEMM input is saved as its 1-byte quantised copy (QKV's
  and fc1's inputs, fc2's; the out-projection's beside FlashAttention's bf16 output), and the
  FP8 weights are cached over the step (`te_weight_cache_bytes`).
* `eager` (meshtron's model in eager PyTorch, read off its autograd graph; checked against
  `torch.autograd.graph.saved_tensors_hooks` in tests/test_memory.py): norm inputs (x, x1), the
  normed inputs of QKV and of the MLP (gathered, so full width even with sequence parallelism:
  DTensor saves the all-gathered input), Q and K after RoPE and V as SDPA sees them (K and V
  at kv width with native GQA; repeated to all query heads where `gqa_copies`), SDPA's output and its reshaped copy
  (the out-projection's input), the log-sum-exp, and SwiGLU's gate, up, SiLU output and product
  (GeLU: pre-activation and output). Selective recomputation (meshtron's policy,
  meshtron/parallel/recompute.py) keeps the block input, every matmul output (the row-parallel
  ones at full width, before their reduction) and every collective's output.
* `alternate-matmul` (torchtitan's selective "op" policy): the block input, every other matmul
  output (wq, wv, w1, w2) and the SDPA output with its log-sum-exp.

A block compiled per block (`KernelOptions.stack == 'compiled'`: meshtron's --compile, the
compiled torchtitan and OLMo-core stacks) saves what AOTAutograd's partitioner keeps instead
of what eager autograd saves (memory_saved.py `compiled_none`, measured): without
recomputation the norms' inputs in the compute dtype on every device (no composite fp32
copies), a gated MLP's gate, up and product but not the activation's output, and one RoPE
cast pair; under a selective policy traced into the graph (tp = 1) not w2's output, which
the backward does not read. Full recomputation keeps the block input either way; the block's
replay (`recompute_working_bytes`) is the compiled list. Korthikanti's list (fused Megatron
kernels) has no compiled variant.

Full recomputation keeps each block's input (/t with sequence parallelism) and, while one block
is recomputed, that block's activations (`recompute_working_bytes`). That working set and the
loss's (below) are alive at different times of the backward: the peak holds the larger
(`loss_or_recompute`). The block's backward also holds its own temporaries (the gradients
flowing between its ops) while its saved tensors are freed one node at a time: memory_bwd.py,
added to the block moment's working set by `backward_working_bytes`.

Logits (last stage, one micro-batch; [tokens, vocab/t] elements): meshtron's runtime at tp = 1
never builds them (meshtron/model/loss.py chunks the head and the loss over tokens; a
pipeline's last stage returns that loss itself since branch ppfix: parallel/parallel_model.py
`_stage_computes_loss`): what it holds is the fused loss's fp32 weight-gradient accumulator,
the input gradient and one chunk's logits (`chunked_loss_bytes`). Elsewhere the eager loss casts the
logits to fp32 and takes log_softmax, whose fp32 output is saved; at the start of backward the
saved output, the incoming gradient and log_softmax's input gradient are alive together: 12
bytes per element (the compute-dtype logits are freed after the loss, nothing saves them;
pipeline schedules keep the stage output, + the compute dtype's bytes); torch's loss_parallel
(tensor-parallel heads) 16 (`LOSS_PARALLEL_BYTES`). Every figure of meshtron's own runtime here
is checked against `meshtron rehearse` (one rank run under fake tensors; tests/test_rehearse.py). Megatron's fused
vocabulary-parallel cross-entropy keeps bf16 logits + an fp32 softmax that its backward
overwrites in place: 6 bytes; flash-attn's fused loss with in-place backward only the 16-bit
logits: 2 bytes; without it (flash-attn's default, which llm-foundry runs) the logits and a new
16-bit gradient: 4 bytes (`MemoryOptions.loss`).
"""

from __future__ import annotations

import math

from meshtron.model.cp_halo_plan import halo_traffic
from meshtron.model.mla_shapes import mla_projections
from meshtron.model.spec import ModelSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.compute_core import cp_halo_rows, sliding_share
from meshtron.planner.memory_bwd import block_backward_bytes
from meshtron.planner.memory_kinds import window_mask_bytes
from meshtron.planner.memory_options import (DEFAULT, E5M6_TILE_BYTES, FP8_TILE_BYTES,
                                          MemoryOptions)
from meshtron.planner.memory_saved import none_bytes, rope_copies

RNG_STATE_BYTES = 5056.0
"""A checkpointed block keeps the CPU generator's state to replay dropout identically
(torch.utils.checkpoint, preserve_rng_state=True; torch.get_rng_state() is 5056 bytes)."""


def rope_copy_bytes(model: ModelSpec, seq: int, mem: MemoryOptions,
                    stack: str = "eager") -> float:
    """Per layer and micro-batch: RoPE's cos/sin cast to a 16-bit compute dtype (eager: 2 calls
    x 2; compiled: one of each, memory_saved.py `rope_copies`)."""
    if model.position != "rope" or mem.dtype == "fp32":
        return 0.0
    return rope_copies(stack) * seq * model.rope_dim * mem.compute_bytes


def _eager_selective(model: ModelSpec, tp: int, sp: bool, cb: float,
                     compiled: bool = False) -> float:
    """meshtron's selective policy: block input, matmul outputs, collective outputs. Compiled
    (the checkpoint traced into the block's graph, tp = 1: plan_rules_runtime refuses it under
    TP) the policy's MUST_SAVE only forbids recomputing a node; the partitioner saves what the
    backward reads, which w2's output is not (the residual add needs no saved tensor): one
    [tokens, hidden] fewer (measured, memory_saved.py)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    q = model.heads * model.head_dim
    block_in = h / (tp if sp else 1)
    col = q + 2.0 * kv + (2.0 * f if model.gated_mlp else f)  # wq wk wv w1 (w3), sharded
    if model.is_mla:  # MLA's projections: head-sharded up-projections, replicated down ones
        col = (2.0 * f if model.gated_mlp else f) + sum(
            n * (tp if split else 1) for _, n, _, split in mla_projections(model, tp))
    # wo and w2 outputs: full width on every tensor rank before the reduction; compiled, wo's
    row = (1.0 if compiled else 2.0) * h
    coll = 0.0
    if tp > 1:
        coll = 2.0 * h + (2.0 * h / tp if sp else 0.0)  # all-gathers (SP) or all-reduces; + RS
    return cb * (block_in + col / tp + row + coll)


def _alternate_matmul(model: ModelSpec, tp: int, sp: bool, cb: float,
                      compiled: bool = False) -> float:
    """torchtitan's selective op policy: block input, wq, wv, w1, w2 and SDPA outputs;
    compiled, not w2's (the backward does not read it: `_eager_selective`; measured with
    torchtitan's policy on meshtron's block, bench/compiled_saved.py)."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    block_in = h / (tp if sp else 1)
    w2 = 0.0 if compiled else h
    return cb * (block_in + (h + kv + f + w2) / tp + h) + 4.0 * a / tp


def te_fp8_inputs(opts: KernelOptions, mem: MemoryOptions) -> bool:
    """Transformer Engine's FP8 Linears (Megatron-Core's; `fp8_scaling` 'te-*') keep their
    input for the weight gradient as the quantised FP8 tensor, 1 byte per element, not the
    bf16 one (module/linear.py and layernorm_linear.py: the saved `inputmat` / `ln_out` is the
    quantizer's output, its rowwise data dropped after the forward, `update_usage(rowwise_usage=
    False)`, the columnwise copy kept): the QKV and fc1 inputs (the norms' outputs), the
    out-projection's and fc2's. What is not a GEMM input stays in the compute dtype: the norms'
    inputs, Q, K and V and the attention output FlashAttention saves (FP8 attention is off by
    default), SwiGLU's input (fc1's bf16 output, Megatron's bias-SwiGLU kernel)."""
    return mem.dtype == "fp8" and opts.fp8_scaling.startswith("te-")


TE_FP8_WEIGHT_CACHE_BYTES = 2.0
"""Bytes per FP8 GEMM weight element Transformer Engine keeps from a step's first micro-batch
to its last: the quantised weight rowwise and columnwise (the transpose the dgrad GEMM reads on
Hopper), cached in the module's `_fp8_workspaces` when Megatron-Core passes
is_first_microbatch (module/linear.py: cache_name "weight", quantize_weight(cache=True); the
weight quantizer's columnwise usage is on while grad is enabled). With fp8_param_gather the
parameter itself is FP8 (1 byte, in place of the bf16 weight the states count) and only its
columnwise copy is added: 2 bytes, as the states count, nothing here."""


def te_weight_cache_bytes(opts: KernelOptions, mem: MemoryOptions) -> float:
    """`TE_FP8_WEIGHT_CACHE_BYTES` for a Megatron-Core FP8 run without fp8_param_gather, else 0:
    bytes per element of the blocks' GEMM weights (not the norms, the router, the embedding or
    Megatron's output layer, which run in bf16)."""
    if mem.framework != "megatron" or not te_fp8_inputs(opts, mem) or opts.fp8_param_gather:
        return 0.0
    return TE_FP8_WEIGHT_CACHE_BYTES


def _korthikanti(model: ModelSpec, tp: int, sp: bool, recompute: str, opts: KernelOptions,
                 seq: int, cb: float = 2.0, fp8_inputs: bool = False,
                 mem: MemoryOptions = DEFAULT) -> float:
    """Bytes per token (the module docstring's list in the compute dtype `cb`; `fp8_inputs`:
    the GEMM inputs in FP8, `te_fp8_inputs`). Q and the attention output are heads x head_dim
    wide, which is not the hidden size everywhere (Qwen3: 32 x 128 over 2048). `mem`'s
    DeepSeek-V3 savings drop what the backward recomputes (recompute_norms,
    recompute_up_proj, swiglu_recompute) or store smaller (attn_out_e5m6)."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    q = model.heads * model.head_dim
    x = 1.0 if fp8_inputs else cb                       # a saved GEMM input
    # two norm inputs, the QKV and fc1 inputs (the norms' outputs); dropout masks
    normed = 0.0 if mem.recompute_norms else 2.0 * x * h
    replicated = 2.0 * cb * h + normed + (cb * h if opts.dropout else 0.0)
    replicated += (model.block_norms - 2) * cb * h  # sandwich (Gemma): post-norms' inputs
    # the out-projection's input: FlashAttention keeps its bf16 output O for its own backward,
    # the same tensor the bf16 Linear saves; an FP8 Linear saves its own FP8 copy beside it
    # Selective recomputation checkpoints the attention core (Megatron-Core core_r0.8.0
    # transformer/attention.py `_checkpointed_attention_forward`: tensor_parallel.checkpoint
    # keeps the core's inputs Q, K, V and runs it again in backward): FlashAttention's own O
    # is not kept, only the out-projection's copy of O (the same tensor in bf16; its FP8
    # copy under TE's FP8, which alone then stays)
    checkpointed = recompute == "selective" and opts.attention != "unfused"
    out = x * q + (cb * q if fp8_inputs and not checkpointed
                   and opts.attention != "unfused" else 0.0)
    if mem.attn_out_e5m6 and fp8_inputs:  # DeepSeek: one E5M6 copy serves both backwards
        out = E5M6_TILE_BYTES * q
    # SwiGLU: fc1's output [2f] (the activation's input) and fc2's input [f]; GeLU: f and f
    mlp = (2.0 * cb * f if model.gated_mlp else cb * f) + x * f
    if mem.swiglu_recompute and model.gated_mlp:  # FP8 input kept, output recomputed
        mlp = 2.0 * FP8_TILE_BYTES * f
    if model.is_mla:
        # Q and K are heads x (nope + rope), V heads x v_head_dim, the output heads x v; the
        # latents (normed, each an up-projection's input, and the norms' inputs) replicated
        # like the block's norms: Megatron-Core runs the down-projections on the sequence-
        # parallel shard. DeepSeek's recomputed norms keep only the norms' inputs.
        o = model.out_width
        out = x * o + (cb * o if fp8_inputs and opts.attention != "unfused" else 0.0)
        if mem.attn_out_e5m6 and fp8_inputs:
            out = E5M6_TILE_BYTES * o
        qkv = cb * q + cb * (kv + model.v_width)
        latents = model.q_lora_rank + model.kv_lora_rank
        replicated += (cb + (0.0 if mem.recompute_norms else x)) * latents
    else:
        qkv = cb * q + 2.0 * cb * kv
    if mem.recompute_up_proj:  # DeepSeek: Q, K and V recomputed from the latents
        qkv = 0.0
    sharded = qkv + out + mlp
    if model.qk_norm and not model.is_mla:  # the q/k norms' inputs (Qwen3, Gemma 3, OLMo 2)
        sharded += cb * (q + kv)
    if opts.attention == "unfused":
        core = 0.0 if recompute == "selective" else (5.0 if opts.dropout else 2.0) * a * seq
    else:
        core = 4.0 * a  # its fp32 log-sum-exp, kept whether checkpointed or not: conservative
    core *= cb / 2.0
    return (replicated / tp if sp else replicated) + (sharded + core) / tp


def activation_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                     recompute: str, opts: KernelOptions,
                     mem: MemoryOptions | None = None) -> float:
    """Bytes one layer keeps for one micro-batch until its backward pass (module docstring)."""
    mem = mem or DEFAULT
    if recompute == "half":
        # every second block keeps only its input, the others everything: the mean per block
        return 0.5 * sum(activation_bytes(model, tp, sp, micro_batch, seq, r, opts, mem)
                         for r in ("none", "full"))
    tokens = micro_batch * seq
    sp = sp and tp > 1
    if recompute == "full":
        return tokens * mem.compute_bytes * model.hidden / (tp if sp else 1) + RNG_STATE_BYTES
    cb = mem.compute_bytes
    # w2's output dropped by a compiled selective policy: measured at tp = 1 only (a tensor-
    # parallel block's partitioner kept other tensors than at tp = 1: memory_saved.py), so a
    # tensor-parallel one keeps eager's list, on the safe side
    compiled_selective = opts.stack == "compiled" and tp == 1
    if mem.saved == "korthikanti":
        per_token = _korthikanti(model, tp, sp, recompute, opts, seq, cb,
                                 te_fp8_inputs(opts, mem), mem)
    elif recompute == "none":
        per_token = none_bytes(model, tp, sp, mem, opts.attention, seq, opts.stack)
        return (tokens * per_token + rope_copy_bytes(model, seq, mem, opts.stack)
                + window_mask_bytes(model, seq, mem))
    elif mem.saved == "alternate-matmul":
        per_token = _alternate_matmul(model, tp, sp, cb, compiled_selective)
    else:
        per_token = _eager_selective(model, tp, sp, cb, compiled_selective)
    return tokens * per_token + (RNG_STATE_BYTES if mem.saved != "korthikanti" else 0.0)


FP8_EAGER_CAST_BYTES = 9.0
"""Bytes per element of one eager torchao float8 cast at its peak: the operand scaled in fp32
(`tensor.to(torch.float32) * scale`, torchao/float8/float8_training_tensor.py
`_ToFloat8ConstrFunc.forward`), its clamped copy (float8_utils.py `to_fp8_saturated`:
`x.clamp(...)`, fp32, while the scaled one is still referenced) and the float8 result
(`.to(float8_dtype)`, 1 byte): 4 + 4 + 1. Compiled, the cast is one fused kernel (bf16 in,
fp8 out) and holds only its 1-byte output."""


UP_PROJECTIONS = ("feed_forward.w1", "feed_forward.w3")
"""The MLP's input projections: autograd reaches them after the down projection (w2) and the
activation's backward, which release w2's saved input ([tokens, ffn] in the compute dtype)."""


def fp8_cast_working_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int,
                           opts: KernelOptions, mem: MemoryOptions,
                           recipe: str = "rowwise") -> float:
    """Extra bytes alive while an eager torchao Float8Linear casts its largest operand in the
    backward (one layer, one micro-batch): its backward casts the output gradient [tokens,
    out] and the saved input [tokens, in] to float8 (torchao/float8/float8_linear.py
    `matmul_with_hp_or_float8_args.backward`), each at FP8_EAGER_CAST_BYTES per element, one
    at a time. In an up projection's backward (UP_PROJECTIONS) w2's saved input of the same
    width is already released: the cast holds that much less beyond the saved activations.
    Measured by the rehearsal (tests/test_rehearse_kinds.py "fp8 ..."): the peak moves into
    w2's backward at its input's cast (tensorwise: w2 converts), or into w1's at its output
    gradient's (rowwise: w2 is under torchao's thresholds). 0 unless torchao's FP8 runs
    eagerly (torch.compile and Transformer Engine fuse the cast). Which Linears convert: the
    planner's rule (planner/fp8.py `fp8_linear`; every aligned one for a stack whose
    `fp8_filter` is 'all')."""
    if (mem.dtype != "fp8" or not opts.fp8_scaling.startswith("torchao")
            or opts.stack != "eager"):
        return 0.0
    from meshtron.planner.fp8 import block_linears, fp8_linear

    every = opts.fp8_filter == "all"
    peak = 0.0
    for _, name, out_f, in_f in block_linears(model, tp):
        if not fp8_linear(f"layers.0.{name}", out_f, in_f, recipe, emulate=every):
            continue
        net = FP8_EAGER_CAST_BYTES - (mem.compute_bytes if name in UP_PROJECTIONS else 0.0)
        peak = max(peak, net * max(out_f, in_f))
    return peak * micro_batch * seq


def recompute_working_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                            recompute: str, opts: KernelOptions,
                            mem: MemoryOptions | None = None) -> float:
    """Extra bytes alive while a recomputed layer runs its backward (one layer, one micro-batch)."""
    if recompute == "none":
        return 0.0
    full = activation_bytes(model, tp, sp, micro_batch, seq, "none", opts, mem)
    if recompute in ("full", "half"):  # 'half': a checkpointed block replays all of itself
        # (beside every saved tensor only where the part ends in a checkpointed block; a part
        # of an odd count recomputes it where a stored block's were: estimate_half._half_blocks)
        return full
    return max(0.0, full - activation_bytes(model, tp, sp, micro_batch, seq, recompute, opts, mem))


def backward_working_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                           recompute: str, opts: KernelOptions, mem: MemoryOptions,
                           recipe: str = "rowwise") -> float:
    """The block moment's working set (memory_peak.py `peak_moment`'s `work`): the layer
    being recomputed (`recompute_working_bytes`) and the backward's own fullest moment
    beyond the saved activations and the unit gradient (memory_bwd.py
    `block_backward_bytes`, negative where the gradients not yet made outweigh the
    temporaries) or, where it holds more, an eager FP8 cast (`fp8_cast_working_bytes`: a
    moment of w2's or w1's backward, measured against the former block moment)."""
    own = block_backward_bytes(model, tp, sp, micro_batch, seq, recompute, opts, mem)
    cast = fp8_cast_working_bytes(model, tp, micro_batch, seq, opts, mem, recipe)
    return (recompute_working_bytes(model, tp, sp, micro_batch, seq, recompute, opts, mem)
            + (max(own, cast) if cast else own))


def gathered_kv_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int, cp: int,
                      recompute: str, opts: KernelOptions, mem: MemoryOptions) -> float:
    """Bytes one layer keeps for backward of the K/V gathered over the cp ranks (one micro-batch,
    `seq` the whole sequence): with the all-gather design (`opts.cp_overlap` False: meshtron's
    runtime, meshtron/parallel/context.py) attention saves the whole sequence's K and V on every
    cp rank, which do not shrink with cp (measured: bench/cp_memory.py), but a sliding block
    under the halo exchange only its chunks and the rows before them; full recomputation
    gathers them again in backward instead. Ring attention (p2p) keeps only the local chunk,
    and so does torch's ring (`opts.torch_ring`: its all-gathered K/V live through the forward
    call only, its backward gathers them again, _templated_ring_attention_backward)."""
    if cp == 1 or opts.cp_overlap or opts.torch_ring or recompute == "full":
        return 0.0
    rows = float(seq)
    if cp_halo_rows(model, seq, cp) is not None:
        # a sliding block keeps its key layout (parallel/cp_halo.py `attend_halo`: the union of
        # its chunks and the rows before them, each once; the fullest rank's,
        # model/cp_halo_plan.py `halo_traffic`) instead of the sequence: at 128k tokens, cp 8
        # and a 1024-token window 18430 rows, not 131072
        share = sliding_share(model)
        halo = halo_traffic(seq, cp, model.sliding_window)[1]
        if recompute == "selective":
            # selective recomputation keeps the outputs of collectives and matmuls only
            # (parallel/recompute.py): of the layout, the all_to_all's received rows (the
            # rank's own K/V are the projections' outputs, counted with the activations), and
            # lays it out again in backward; the gather keeps its output, the whole sequence.
            # At 128k, cp 8, a 1024 window: 2046 rows, not 18430 (measured with the policy,
            # tests/test_cp_halo_odd.py)
            halo -= seq // cp
        rows = (1.0 - share) * seq + share * halo
    return 2.0 * micro_batch * rows * model.kv_dim / tp * mem.compute_bytes


LOSS_PARALLEL_BYTES = 16.0
"""Bytes per local logit at the peak of torch's `loss_parallel` cross-entropy (tensor-parallel
heads; torch/distributed/tensor/parallel/loss.py): the saved fp32 log-softmax, and in its
fused nll + log-softmax backward `zeros_like(x)`, `exp(x)` and their sum, alive together
(measured by `meshtron rehearse` at tp=2 and 4: 4 + 12)."""
FUSED_LOSS_ACC_BYTES = 4.0
"""The fused loss (meshtron/model/loss.py) accumulates the head's weight gradient over its
chunks inside addmm into one fp32 [vocab, hidden] buffer, held from the loss's forward to its
backward."""


def _fused_loss_grads_bytes(model: ModelSpec, tokens: int, mem: MemoryOptions) -> float:
    """The gradients meshtron's fused cross-entropy makes in its forward and keeps to its
    backward: the fp32 [vocab, hidden] weight-gradient accumulator and the [tokens, hidden]
    input gradient in the compute dtype (meshtron/model/loss.py `_FusedLinearCrossEntropy`
    keeps both on ctx.grads)."""
    return (FUSED_LOSS_ACC_BYTES * model.vocab * model.hidden
            + mem.compute_bytes * tokens * model.hidden)


def chunked_loss_held_bytes(model: ModelSpec, tokens: int, mem: MemoryOptions) -> float:
    """What a pipeline's last stage keeps per micro-batch from the chunked loss's forward to
    its backward (under a zero-bubble schedule to its second, weight pass: model/loss.py
    `OutputHead.split_backward`, torch keeping the graph with retain_graph): the loss's
    gradients (`_fused_loss_grads_bytes`) and what the final norm saved for its backward
    (`final_norm_bytes` less its output, the loss's input, which nothing keeps: the fused
    loss saves no tensor). Rehearsed, 'mid' GPipe pp 2 full recompute, m 4, the last stage:
    the planner -6.3% without the norm's saved tensors, -3.2% with them."""
    norm_saved = final_norm_bytes(model, tokens, mem) - mem.compute_bytes * tokens * model.hidden
    return _fused_loss_grads_bytes(model, tokens, mem) + norm_saved


def chunked_loss_bytes(model: ModelSpec, tokens: int, mem: MemoryOptions) -> float:
    """Peak bytes of meshtron's fused cross-entropy (tp = 1, a pipeline's last stage too)
    beyond the unit gradient the moment's compute copies count (`gathered_bytes`). Its
    forward makes every
    gradient: it holds the fp32 weight-gradient accumulator and the input gradient [tokens,
    hidden] (compute dtype) until the backward, and while walking the chunks (Liger's chunk:
    tokens / ceil(vocab / hidden) tokens) one chunk's logits in the compute dtype beside their
    fp32 copy, then that copy (turned in place into the logits' gradient) beside its
    compute-dtype cast: (4 + c) bytes per chunk logit, 4 in fp32 (no copies). That forward
    moment is the loss's peak: in its backward the accumulator is scaled in place and cast to
    a 16-bit parameter's dtype (the unit gradient) while the chunk's tensors are gone, and at
    the forward the unit gradient's place is held by FSDP2's last all-gather output (kept
    until the next all-gather: `AllGatherState`; rehearsed at ZeRO-3, tests/test_rehearse.py;
    the loss alone on fake tensors: 2 + 4 + 6 x chunk x vocab bytes, bench/loss_memory.py)."""
    chunk = max(1, math.ceil(tokens / math.ceil(model.vocab / model.hidden)))
    cb = mem.compute_bytes
    held = _fused_loss_grads_bytes(model, tokens, mem)
    per_logit = FUSED_LOSS_ACC_BYTES + (cb if cb < FUSED_LOSS_ACC_BYTES else 0.0)
    return held + per_logit * chunk * model.vocab + final_norm_bytes(model, tokens, mem)


def final_norm_bytes(model: ModelSpec, tokens: int, mem: MemoryOptions) -> float:
    """The final norm at the loss's moment: what it saves for its backward (a fused norm its
    input, the composite RMSNorm of PyTorch on CPU an fp32 copy of it and the fp32 normalised
    tensor, as a block's norms: memory_bwd.py) and its output, the loss's input. Small beside
    whole logits; beside the fused loss's working set it is a quarter of it (rehearsed 'mid'
    model: 80 MiB composite of the 0.34 GiB)."""
    cb = mem.compute_bytes
    composite = model.norm == "rmsnorm" and not mem.fused_norm
    return ((8.0 if composite else cb) + cb) * tokens * model.hidden


def head_input_bytes(model: ModelSpec, tp: int, sp: bool, tokens: int,
                     mem: MemoryOptions) -> float:
    """What the final norm and a DTensor ColwiseParallel head hold at torch's `loss_parallel`
    loss (tp > 1): the norm's saved tensors (`final_norm_bytes`' kinds) over the rank's tokens
    (tokens / tp under sequence parallelism, `SequenceParallel` norms run on the sequence
    shard) and the head's saved input, the whole [tokens, hidden] in the compute dtype (the
    norm's output without sequence parallelism; with it the input all-gathered over tp by the
    head's input redistribution, torch/distributed/tensor/parallel/style.py ColwiseParallel
    `_prepare_input_fn`, Shard(1) -> Replicate, which matmul saves for the weight gradient,
    the shard freed after the gather). Rehearsed (tests/test_rehearse_models.py, Llama kind,
    vocabulary 512, tp 2 + sp: 24.8 MB missing, these two tensors 25.2 MB)."""
    if not sp:  # the norm's output is the head's input: final_norm_bytes counts it
        return final_norm_bytes(model, tokens, mem)
    shard, cb = tokens / tp, mem.compute_bytes
    # the norm's saved tensors on the shard (its output shard is freed once gathered) and
    # the gathered input the head's matmul saves
    return (final_norm_bytes(model, shard, mem) - cb * shard * model.hidden
            + cb * tokens * model.hidden)


FP32_LOGIT = 4.0
"""Bytes of one fp32 logit (KernelOptions.logits_fp32: the model's `.float()` logits)."""


def logits_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int,
                 mem: MemoryOptions | None = None, pipelined: bool = False,
                 sp: bool = False, z_loss: bool = False, logits_fp32: bool = False) -> float:
    """Logits of one micro-batch and their gradients at the loss (module docstring); under
    torch's `loss_parallel` (tp > 1) with the final norm's and the head's saved input
    (`head_input_bytes`). `logits_fp32` (KernelOptions.logits_fp32): the fused 'flash-ce' loss
    holds the fp32 logits and their new fp32 gradient; `z_loss` (KernelOptions.z_loss) apart
    from a fused kernel also holds what its logsumexp saves (`z_loss_saved_bytes`)."""
    mem = mem or DEFAULT
    elements = micro_batch * seq * model.vocab / tp
    kind = mem.loss_kind
    if kind == "vocab-parallel":
        return elements * 6.0
    if kind == "inplace":
        return elements * mem.compute_bytes
    if kind == "flash-ce":  # the logits and their new gradient (MemoryOptions.loss), both
        # in the logits' dtype: OLMo-core src/olmo_core/triton/cross_entropy_loss.py at
        # 41400c46fc (flash-attn's kernel) saves `logits` and allocates
        # `torch.empty_like(logits)` for their gradient; fp32 under logits_fp32
        return elements * 2.0 * (FP32_LOGIT if logits_fp32 else mem.compute_bytes)
    if kind == "chunked" and tp == 1:  # a pipeline's last stage keeps no logits either: it
        # returns the loss (parallel/parallel_model.py `_stage_computes_loss`)
        return chunked_loss_bytes(model, micro_batch * seq, mem)
    return (_whole_logits_bytes(model, tp, micro_batch, seq, mem, pipelined, sp)
            + (elements * z_loss_saved_bytes(mem, logits_fp32) if z_loss else 0.0))


def z_loss_saved_bytes(mem: MemoryOptions, logits_fp32: bool) -> float:
    """Bytes per logit a z-loss computed apart from the cross-entropy keeps until the loss's
    backward (OLMo-core nn/functional/cross_entropy_loss.py at 41400c46fc:
    `logits.logsumexp(-1).pow(2)`): autograd saves logsumexp's input for its backward
    (PyTorch tools/autograd/derivatives.yaml, logsumexp: `logsumexp_backward(grad, self,
    result, dim, keepdim)`), the logits as the model returns them (fp32 under logits_fp32),
    which nothing else keeps (the eager loss saves only log_softmax's output)."""
    return FP32_LOGIT if logits_fp32 else mem.compute_bytes


def _whole_logits_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int,
                        mem: MemoryOptions, pipelined: bool, sp: bool) -> float:
    """The eager losses' whole logits (module docstring)."""
    elements = micro_batch * seq * model.vocab / tp
    kind = mem.loss_kind
    # whole logits: a pipeline's last stage also keeps its output (the compute dtype's bytes)
    kept = mem.compute_bytes if pipelined else 0.0
    if tp > 1:  # vocabulary-parallel logits under loss_parallel
        return (elements * (LOSS_PARALLEL_BYTES + kept)
                + head_input_bytes(model, tp, sp, micro_batch * seq, mem))
    if kind == "eager-bf16":  # the eager loss's three tensors in the compute dtype
        return elements * (3.0 * mem.compute_bytes + kept)
    return elements * (12.0 + kept)


def loss_or_recompute(logits: float, work: float) -> float:
    """Bytes of the loss's working set and of a recomputed block's, which are never alive
    together: autograd runs the loss's backward (logits, their fp32 copies and gradients) and
    the head's to completion, freeing them, before the last block's checkpointed forward is
    replayed (torch.utils.checkpoint recomputes inside the block's backward node), so the peak
    holds the larger of the two, not their sum. In a pipeline schedule one micro-batch's loss
    and another's recomputation do not overlap either: a stage runs one action at a time."""
    return max(logits, work)

