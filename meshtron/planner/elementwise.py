"""HBM bytes and kernel counts of one layer's memory-bound (non-GEMM) operations, per software
stack: what planner/compute.py times at `gemm.membound_bytes_per_s`.

Non-GEMM work (norms, residual adds, activation functions, rotary embedding, softmax, dropout,
casts, cross-entropy) is memory-bound: time = bytes moved / (HBM bandwidth * 0.8), 0.8 being what
streaming kernels reach (STREAM-like copy rates on A100/H100 HBM). What moves depends on the
software stack (`KernelOptions.stack`), itemised per operation in `elementwise_bytes`:

A calibrated cluster's `elementwise_gb_per_s` (what eager RMSNorm, silu(a)*b and softmax reach on
it) replaces HBM bandwidth * 0.8 for the eager stack, and its `eager_kernel_overhead_us` replaces
the per-kernel dispatch constant (planner/gemm.py DISPATCH_S).

* 'eager' (meshtron's own runtime; plain PyTorch modules without torch.compile): every operation
  is its own kernel that reads its inputs from HBM and writes its output back. RMSNorm as written
  in Llama-style code upcasts to fp32 and runs five kernels; rotary embedding is half-split
  slicing, a negation, a concatenation, two products and a sum; SwiGLU is a SiLU kernel plus a
  product; cross-entropy upcasts the logits to fp32. Each kernel also costs the host-side
  dispatch of eager PyTorch (about 10 us per operation with autograd recording; e.g. H. He,
  "Making Deep Learning Go Brrrr From First Principles", 2022): a layer cannot run faster than
  its kernels can be issued.
* 'fused' (Megatron-LM / Transformer Engine): norms, rotary embedding, the activation and the
  bias-dropout-add are single kernels that read each input once and write each output once
  (Megatron's fused kernels, Shoeybi et al. 2019; Korthikanti et al. 2022), the loss too.
* 'compiled' (per-block torch.compile: meshtron's --compile, torchtitan's apply_compile): inside
  each block inductor fuses what 'fused' fuses, but not into its extern kernels (cuBLAS, SDPA);
  the final norm, head and loss, the optimizer
  step and the gradient accumulation run outside the compiled blocks, eager. Compile can
  therefore save no more than the blocks' eager element-wise work and kernel issue (measured on
  one H200: 5.2% of the step, bench/results/gpu_check_h200_2026-12-04.json).

An eager RMSNorm is one ATen kernel when the model uses torch.nn.RMSNorm on PyTorch >= 2.8
(`KernelOptions.eager_norm` 'aten'); the reference module's five kernels are 'python'.

Backward moves about twice the forward's bytes (it reads the saved input and the incoming
gradient and writes the outgoing one).
"""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner.kernel_options import KernelOptions

# Bytes per element read + written by one forward operation, bf16 activations (2 bytes) and fp32
# intermediates (4 bytes) where the code upcasts. Eager figures follow the operations as written
# in plain PyTorch (meshtron/model/transformer.py, torchtitan's and Hugging Face's Llama):
#   RMSNorm: cast to fp32 (2+4), square (4+4), mean (4), scale (4+4), cast back (4+2), weight (2+2)
#   LayerNorm: one ATen kernel (2+2) in both stacks
#   RoPE (q and k): negate half (1+1), concatenate (2+2), x*cos (2+2), rotated*sin (2+2), sum (4+2)
#   complex RoPE (torchtitan's apply_rotary_emb, KernelOptions.complex_rope): fp32 upcast (2+4),
#   complex multiply (4+4, the frequencies broadcast), type_as back (4+2): the same 20 bytes,
#   in 3 kernels, and under compile too (inductor falls back to ATen for complex tensors)
#   SwiGLU: SiLU (2+2) and product (4+2) per ffn element; fused: one kernel (4+2)
#   GeLU: one kernel (2+2) in both stacks (Megatron fuses it with the bias add)
#   residual add: (4+2) per add in both stacks (Megatron fuses bias-dropout-add: same traffic)
#   dropout: eager mask + scale kernel (2+2+1) before the add; fused: +1 byte of mask
#   head-major transposes around the attention kernel: unfused attention's AV product is
#   head-major, copied back token-major (2+2) in eager and compiled code; a flash kernel
#   (SDPA's FLASH / cuDNN backends) takes q, k, v as head-major views of token-major tensors
#   (only the last dim must be contiguous) and allocates its output with the query's strides
#   (torch/_meta_registrations.py `meta__scaled_dot_product_flash_attention`:
#   empty_like(query)), so `.transpose(1, 2).contiguous()` after it returns the tensor itself:
#   no copy in or out
#   compiled (per-block torch.compile): inductor fuses each chain of pointwise ops and the norm
#   reductions into single kernels, as 'fused'; it cannot fuse into the extern kernels (cuBLAS
#   GEMMs, the SDPA kernel), and everything outside the compiled blocks (final norm, head,
#   loss) is eager
NORM_BYTES = {("eager", "rmsnorm"): 36.0, ("fused", "rmsnorm"): 4.0,
               ("eager", "layernorm"): 4.0, ("fused", "layernorm"): 4.0,
               ("compiled", "rmsnorm"): 4.0, ("compiled", "layernorm"): 4.0}
NORM_KERNELS = {("eager", "rmsnorm"): 6, ("fused", "rmsnorm"): 1,
                 ("eager", "layernorm"): 1, ("fused", "layernorm"): 1,
                 ("compiled", "rmsnorm"): 1, ("compiled", "layernorm"): 1}
_ROPE_BYTES = {"eager": 20.0, "fused": 4.0, "compiled": 4.0}
_SWIGLU_BYTES = {"eager": 10.0, "fused": 6.0, "compiled": 6.0}
# GeGLU moves what SwiGLU does (a GELU kernel instead of SiLU, then the product); squared ReLU
# is a ReLU (2+2) and a square (2+2) in eager code, one kernel (2+2) fused (Megatron's
# squared_relu is fused by its bias-activation fusion; inductor fuses the pointwise pair)
_ACT_BYTES = {"swiglu": _SWIGLU_BYTES, "geglu": _SWIGLU_BYTES,
              "relu2": {"eager": 8.0, "fused": 4.0, "compiled": 4.0},
              "gelu": {"eager": 4.0, "fused": 4.0, "compiled": 4.0}}
_ACT_KERNELS = {"swiglu": 2, "geglu": 2, "relu2": 2, "gelu": 1}  # eager: activation (+ product)


def norm_key(stack: str, eager_norm: str, norm: str) -> tuple[str, str]:
    """The `NORM_BYTES` / `NORM_KERNELS` entry of a norm: an eager RMSNorm through ATen's
    fused kernel (KernelOptions.eager_norm 'aten') moves what a fused one does."""
    if stack == "eager" and eager_norm == "aten":
        return ("fused", norm)
    return (stack, norm)


def elementwise_bytes(model: ModelSpec, tp: int, sp: bool, opts: KernelOptions) -> float:
    """HBM bytes moved per token by one layer's memory-bound kernels in the forward pass.

    Per operation as in the table above. Replicated across tensor-parallel ranks unless sequence
    parallelism shards them (Korthikanti et al. 2022, section 4.2.2): the two norms, the two
    residual adds and the hidden dropouts. Sharded by tp: rotary embedding of q and k, the MLP
    activation and the unfused attention's output copy. The unfused attention's softmax/dropout
    traffic is counted with the attention core in `layer_cost`; GEMM inputs and outputs are part of the GEMM
    roofline, not counted here.
    """
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    q = model.heads * model.head_dim  # hidden, except where head_dim is not hidden/heads
    st = opts.stack
    # the block's norms (Gemma's sandwich: four) and its two residual adds
    replicated = (model.block_norms * NORM_BYTES[norm_key(st, opts.eager_norm, model.norm)] * h
                  + 2 * 6.0 * h)
    if opts.dropout:
        replicated += 2 * (5.0 if st == "eager" else 1.0) * h
    if model.residual_scale != 1 and st == "eager":  # Granite's factor: a product per branch
        replicated += 2 * 4.0 * h
    rope = "eager" if opts.complex_rope and st == "compiled" else st
    sharded = 0.0
    if model.position == "rope":  # the rotating share of q and k (partial rotary: Nemotron)
        sharded = _ROPE_BYTES[rope] * (q + kv) * model.rope_dim / model.head_dim
        if model.rope_dim < model.head_dim and st != "fused" and not model.is_mla:  # the
            # pass-through's concatenation
            sharded += 4.0 * (q + kv)
    if model.q_factor is not None and st == "eager":  # the softmax scale's product on q
        sharded += 4.0 * q
    if model.qk_norm:  # RMSNorm of q and k (per head or over the projection), on local heads
        sharded += NORM_BYTES[norm_key(st, opts.eager_norm, "rmsnorm")] * (q + kv)
    if model.is_mla:
        sharded = _ROPE_BYTES[rope] * model.heads * model.rope_dim  # the queries' rotary part
        mla_rep, mla_sharded = mla_elementwise_bytes(model, opts)
        replicated += mla_rep * (tp if sp else 1)  # on the gathered sequence: never / tp
        sharded += mla_sharded
    sharded += _ACT_BYTES[model.mlp][st] * f
    if st in ("eager", "compiled") and opts.attention != "flash":  # output copy (table above)
        sharded += 4.0 * (h if model.is_mla else q)  # heads x head_dim wide
    return (replicated / tp if sp else replicated) + sharded / tp


def recomputed_bytes(model: ModelSpec, tp: int, sp: bool,
                     opts: KernelOptions) -> dict[str, float]:
    """Forward HBM bytes per token of the memory-bound pieces fine-grained recomputation runs
    again in the backward (MemoryOptions recompute_norms, recompute_up_proj, swiglu_recompute;
    compute_parts.LayerCost.recomputed), each as `elementwise_bytes` prices it in the forward:
    'norms': the block's input and pre-MLP norms (Megatron-Core core_v0.14.0
    transformer_layer.py, recompute_modules "layernorm": input_layernorm and pre_mlp_layernorm
    under CheckpointWithoutOutput; DeepSeek-V3 report 3.2.3 "we recompute all RMSNorm
    operations"), replicated unless sequence parallelism shards them; 'latent_norms': MLA's two
    latent RMSNorms (replicated: every tp rank runs them whole); 'up_proj': what the
    up-projections' checkpoint runs beside its GEMMs (multi_latent_attention.py
    `qkv_up_proj_and_rope_apply`, recompute_modules "mla_up_proj": the latent norms, counted
    under 'latent_norms', the queries' and the shared key's RoPE and the heads' concatenations;
    a model without MLA: the RoPE of q and k); 'act': the MLP activation (Megatron-Core
    moe/experts.py recompute_modules "moe_act", CheckpointWithoutOutput over activation_func;
    DeepSeek-V3 report 3.3.3 "recompute its output in the backward pass")."""
    h, st = model.hidden, opts.stack
    rope = "eager" if opts.complex_rope and st == "compiled" else st
    norm = NORM_BYTES[norm_key(st, opts.eager_norm, model.norm)]
    norms = 2 * norm * h  # the two norms whose outputs memory_acts drops
    latent_norms = up_proj = 0.0
    if model.is_mla:
        latent_norms = NORM_BYTES[norm_key(st, opts.eager_norm, "rmsnorm")] * (
            model.q_lora_rank + model.kv_lora_rank)
        qk = model.heads * model.head_dim
        sharded = 2 * 4.0 * qk  # q's and k's concatenations (mla_elementwise_bytes)
        if st in ("eager", "compiled") and opts.v_width == "padded":
            sharded += 2.0 * model.heads * model.v_dim + 2.0 * qk  # V's zero padding
        up_proj = (_ROPE_BYTES[rope] * model.rope_dim
                   + (_ROPE_BYTES[rope] * model.heads * model.rope_dim + sharded) / tp)
    elif model.position == "rope":
        q = model.heads * model.head_dim
        up_proj = _ROPE_BYTES[rope] * (q + model.kv_dim) * model.rope_dim / model.head_dim / tp
    act = _ACT_BYTES[model.mlp][st] * model.ffn_hidden / tp
    return {"norms": norms / tp if sp else norms, "latent_norms": latent_norms,
            "up_proj": up_proj, "act": act}


def gqa_repeat_bytes(model: ModelSpec, tp: int, stack: str) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of one layer's K/V repeated to every query head
    before SDPA, where the model code does so (MemoryOptions.gqa_copies: torchtitan's Llama
    `repeat_kv` until January 2026, torchtitan#2259; Hugging Face's sdpa attention): the
    expand + reshape copies K and V (read kv_dim, write hidden wide, bf16), and its backward
    sums the heads' gradients back (read hidden, write kv_dim wide). Under per-block
    torch.compile inductor fuses K's copy into the rotary kernel that produces it (its write
    widens from kv_dim to hidden) and V's stays a copy. Sharded by tp (local heads); zero
    without grouped-query attention."""
    h, kv = model.hidden, model.kv_dim
    if kv >= h:
        return 0.0, 0.0
    per = 2.0 * (h - kv) + 2.0 * (kv + h) if stack == "compiled" else 2.0 * 2.0 * (kv + h)
    return per / tp, per / tp


def mla_elementwise_bytes(model: ModelSpec, opts: KernelOptions) -> tuple[float, float]:
    """(replicated, head-sharded) forward bytes per token of MLA's own memory-bound kernels
    (model/mla.py), bf16: the two latent RMSNorms and the shared rotary key's RoPE, which every
    tp rank runs whole; the concatenations of each head's query and key from their non-rotary
    and rotary parts (read and write, 4 bytes per element; Megatron-Core's MLA concatenates
    too), and, where the stack's kernel needs V padded (KernelOptions.v_width: meshtron's own
    model, Hugging Face's; eager or compiled stacks), V's zero padding to the q/k head size
    and the copy of the output cut back to v_head_dim."""
    st = opts.stack
    rope = "eager" if opts.complex_rope and st == "compiled" else st
    latents = model.q_lora_rank + model.kv_lora_rank
    replicated = (NORM_BYTES[norm_key(st, opts.eager_norm, "rmsnorm")] * latents
                  + _ROPE_BYTES[rope] * model.rope_dim)
    qk, out = model.heads * model.head_dim, model.out_width
    sharded = 2 * 4.0 * qk
    if st in ("eager", "compiled") and opts.v_width == "padded":
        sharded += 2.0 * model.heads * model.v_dim + 2.0 * qk + 4.0 * out  # pad, cut copy
    return replicated, sharded


def kernels_per_layer(model: ModelSpec, opts: KernelOptions) -> int:
    """Kernels one layer's forward issues (GEMMs, attention, memory-bound operations). The
    eager count is what meshtron's Block launches, counted from its code path by
    bench/host_kernel_count.py (tests/test_planner_host.py checks it): eager RoPE is, per q
    and k, two casts of the cos/sin tables to the activation dtype, a negation, a
    concatenation, two products and a sum; the flash kernel's output is already token-major,
    so its transpose + reshape launches nothing in eager code."""
    st = opts.stack
    n = model.block_norms * NORM_KERNELS[norm_key(st, opts.eager_norm, model.norm)] + 2  # norms,
    # residual adds
    n += (3 if model.gated_mlp else 2) + 4  # MLP and attention linears (q, k, v, out)
    if model.qk_norm:
        n += 2 * NORM_KERNELS[norm_key(st, opts.eager_norm, "rmsnorm")]
    n += 1 if opts.attention == "flash" else 4  # flash kernel, or QK^T, softmax, (dropout), AV
    if model.position == "rope" and opts.complex_rope and st != "fused":
        n += 6  # per q and k: upcast, complex multiply, cast back
    elif model.position == "rope":
        n += 14 if st == "eager" else 1
    if st in ("eager", "compiled") and opts.attention != "flash":
        n += 1  # the unfused attention output's copy (no copy after a flash kernel)
    if model.is_mla:  # model/mla.py: wq_a + wq_b (or wq), wkv_a + wkv_b and wo; two latent
        # norms; q's and k's concatenations, V's padding and the cut output's copy (eager,
        # where the kernel needs V padded)
        n += (1 if model.q_lora_rank else 0) + 2 * NORM_KERNELS[
            norm_key(st, opts.eager_norm, "rmsnorm")] + (
                4 if st == "eager" and opts.v_width == "padded" else 2)
    if st == "eager":
        n += _ACT_KERNELS[model.mlp]  # activation (+ product, or square)
        n += 2 if model.residual_scale != 1 else 0  # Granite's residual factor
        n += 1 if model.q_factor is not None else 0  # the softmax scale on q
        if model.norm_plus_one:  # each norm's 1 + weight (a weight-sized kernel, launched)
            n += model.block_norms + (2 if model.qk_norm else 0)
        n += 2 if model.position == "rope" and not model.is_mla and \
            model.rope_dim < model.head_dim else 0  # partial rotary: the q and k concatenations
        n += 2 if opts.dropout else 0
    return n

