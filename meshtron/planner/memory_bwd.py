"""A block's own backward temporaries: what a block's backward holds beyond its saved
activations and its unit's whole gradient, at its fullest moment (one layer, one micro-batch).

The block moment of the peak (memory_peak.py `block_moment`) counts the block's saved
activations (all of them: memory_acts.py `activation_bytes`, or the recomputed block's,
`recompute_working_bytes`) and, under FSDP2, the block's whole unsharded gradient. Neither is
what a moment of the backward holds: autograd frees a node's saved tensors once it has run
(retain_graph=False) and makes the weight gradients one GEMM at a time, while the gradients
flowing between the ops are alive beside them. The backward is walked at the moments that
can hold the most (each read off `meshtron rehearse`'s live tensors at the peak, 'mid' model,
2 layers, vocabulary 512, and torch's autograd formulas, tools/autograd/derivatives.yaml):

* the MLP's gate product (SwiGLU, `silu(w1 x) * w3 x`): `mul.Tensor`'s backward makes
  grad * other and grad * self, [tokens, ffn / tp] each, while its input gradient (w2's
  input gradient, made by w2's MmBackward) is still alive; w2's saved input is freed, its
  weight gradient made. GeLU: `gelu_backward`'s one output beside w2's input gradient.
  Megatron's fused bias-SwiGLU backward returns one [tokens, 2 ffn] tensor: the same bytes.
* the ffn norm's backward: the MLP's saved tensors and weight gradients are done; the
  normed input's gradient (w1's and w3's input gradients summed) and the norm's own
  temporaries are alive: the composite RMSNorm (PyTorch on CPU) holds five fp32
  [tokens, hidden] tensors (memory_zb.py `input_backward_bytes`, traced op by op), the fused
  kernel (CUDA, aten._fused_rms_norm) writes the input gradient directly.
* attention's backward (below), and the block's last op, the attention norm's backward:
  every weight gradient made, every saved tensor but that norm's freed, the norm's
  temporaries as the ffn norm's.
* attention's backward: the MLP's and the ffn norm's saved tensors are freed; alive are the
  residual gradient, the out-projection's input gradient and dq, dk, dv. On a GPU
  FlashAttention-2's backward (aten/src/ATen/native/transformers/cuda/flash_attn/
  flash_api.cpp `mha_bwd`, from flash-attn's csrc/flash_attn/flash_api.cpp) also allocates
  an fp32 dq accumulator [batch, seq, heads, head_dim] and, for grouped-query attention,
  dk and dv expanded to every query head before they are summed per group (priced where
  SDPA picks that kernel; cuDNN's and the memory-efficient kernel's buffers are not priced
  apart: not measured on a GPU here); the CPU's flash
  kernel (`_scaled_dot_product_flash_attention_for_cpu`) keeps its buffers per thread, and a
  fake-tensor rehearsal sees outputs only: the workspace is priced with the GPU's kernels
  only (`MemoryOptions.fused_norm`, which compare.py sets False for the CPU's kernels).
  Unfused attention (`opts.attention == 'unfused'`): the probabilities' gradient and the
  scores' gradient ([heads, seq] per token each, `_softmax_backward_data`).

At every moment the block's output gradient (the residual stream's, [tokens, hidden], alive
from the block's first backward op: the residual add hands it to both branches) is held.
Measured at the gate product ('mid', bf16, ZeRO-3, vocabulary 512): w2's input gradient,
the two products' gradients and w2's weight gradient beside the SiLU output and w1's and
w3's outputs, the output gradient alive: 40 MiB over the planner's former block moment,
whose unit gradient also held the 64 MiB of weight gradients not yet made.

A block compiled per block (`opts.stack == 'compiled'`) runs its backward as one inductor
graph that frees each saved tensor after its last use; its moments are walked as eager's with
the compiled block's saved list (memory_saved.py `compiled_none`: the SiLU output not saved,
the norms as the fused kernel's) and the norms' backward as one fused kernel on every device
(inductor fuses the decomposed norm's backward). Not measured: the compiled backward's own
buffers were not traced (inductor's generated code allocates outside the dispatcher).
"""

from __future__ import annotations

from meshtron.model.mla_shapes import mla_replicated_params
from meshtron.model.spec import ModelSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.memory_options import MemoryOptions
from meshtron.planner.memory_saved import none_bytes

COMPOSITE_NORM_BWD_FP32 = 5.0
"""fp32 [tokens, hidden] tensors the composite RMSNorm's backward holds at once (torch 2.13 on
CPU: the upcast gradient, then div, pow, mul, mul of the mean-square path; memory_zb.py)."""


def unit_grad_bytes(mem: MemoryOptions) -> float:
    """Bytes per weight-gradient element the block moment counts for the block's unsharded
    gradient (memory_peak.py `backward_gathered_bytes`: FSDP2's, in the compute dtype);
    0 where gradients land in buffers the states count (Megatron-LM's main_grad, DeepSpeed's
    buckets) and for fp32 (conservative: a dp = 1 fp32 run has no FSDP2 unit gradient)."""
    if mem.framework != "fsdp2" or mem.dtype == "fp32":
        return 0.0
    return mem.compute_bytes


def _moments(model: ModelSpec, tp: int, sp: bool, recompute: str, opts: KernelOptions,
             mem: MemoryOptions, seq: int) -> list[tuple[float, float]]:
    """(bytes per token held beyond the saved activations, weight elements whose gradients
    are not made yet) at each moment of the module docstring, for one tensor rank."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    q = model.heads * model.head_dim
    cb = mem.compute_bytes
    h_in = h / (tp if sp else 1)                       # the residual stream's width
    swiglu = model.gated_mlp
    gpu = mem.fused_norm                               # the GPU's kernels (module docstring)
    compiled = opts.stack == "compiled"                # the backward one compiled graph
    kv_sdpa = q if mem.gqa_copies and a != model.kv_heads else kv
    attn_w = h * (q + 2 * kv) / tp                    # wq, wk, wv
    out_w = q * h / tp                                 # wo
    if model.is_mla:  # MLA's projections (head-sharded up-projections, replicated down)
        rep = mla_replicated_params(model)
        out_w = model.out_width * h / tp
        attn_w = (model.attention_params() - rep) / tp + rep - out_w
    mlp_w = (3 if swiglu else 2) * h * f / tp
    # gate, up, SiLU, product / pre, post; compiled, the SiLU output is recomputed
    # (memory_saved.py compiled_none)
    mlp_saved = cb * ((3 if compiled else 4) if swiglu else 2) * f / tp
    dy = cb * h_in
    # the gate product: w2's input gradient and mul's two outputs (GeLU: gelu_backward's),
    # w2's saved input freed; w2's weight gradient made
    gate = dy + cb * gate_product_tensors(model) * f / tp
    if recompute == "selective" and mem.saved == "eager" and not compiled:
        # meshtron's policy caches w2's output, which the replay never reaches (checkpoint's
        # early stop once every saved tensor is back): alive to the block's end
        gate += cb * h
    moments = [(gate, attn_w + out_w + mlp_w - mlp_w / (3 if swiglu else 2))]
    # the ffn norm's backward: the normed input's gradient and the norm's temporaries
    # (it replaces the normed input w1 and w3 saved, freed after their backward)
    # compiled, the norm's backward is one fused kernel on every device (as its forward saves)
    composite = model.norm == "rmsnorm" and not gpu and not compiled
    norm_tmp = 4.0 * COMPOSITE_NORM_BWD_FP32 * h_in if composite else cb * h_in
    moments.append((dy + norm_tmp - mlp_saved, attn_w + out_w))
    if model.norm_layout != "pre":
        # Gemma's sandwich and OLMo 2's post norms: the block's backward starts at the MLP's
        # post-norm, every saved tensor alive and no weight gradient made yet (the rehearsal's
        # peak of both, `ffn_post_norm`'s backward). The composite norm's backward holds four
        # fp32 [tokens, hidden] tensors there, one fewer than at the block's pre-norms
        # (measured: one Gemma 3 / OLMo 2 block alone under torch's MemTracker, 2048 tokens,
        # 16 bytes per element beyond the forward's end at ffn_post_norm's backward peak)
        post_tmp = 4.0 * (COMPOSITE_NORM_BWD_FP32 - 1) * h_in if composite else cb * h_in
        moments.append((dy + post_tmp, attn_w + out_w + mlp_w))
    # attention: wo's input gradient, dq, dk, dv (+ FlashAttention's workspace on a GPU)
    core = cb * (2 * q + 2 * kv_sdpa) / tp
    if opts.attention == "unfused":
        core += 2.0 * cb * a * seq / tp                 # the probabilities' and scores' grads
    elif gpu:
        core += 4.0 * q / tp + (2.0 * cb * q / tp if kv_sdpa != q else 0.0)
    ffn_norm_saved = (8.0 if composite else cb) * h_in  # memory_saved.py `none_bytes`
    moments.append((dy + core - mlp_saved - ffn_norm_saved - cb * h, attn_w))
    # the block's last op, the attention norm's backward: every weight gradient made, every
    # saved tensor but that norm's freed (where the unit gradient outweighs the temporaries)
    saved = none_bytes(model, tp, sp, mem, opts.attention, seq, opts.stack)
    moments.append((dy + norm_tmp - (saved - ffn_norm_saved), 0.0))
    return moments


def gate_product_tensors(model: ModelSpec) -> int:
    """[tokens, ffn] tensors the MLP's activation backward holds at its fullest beyond its
    input gradient less w2's freed saved input: SwiGLU / GeGLU mul's two products; GeLU
    gelu_backward's one output; squared ReLU (Nemotron, `torch.square`) three: torch's
    pow_backward (torch/csrc/autograd/FunctionsManual.cpp) computes
    `grad * (exponent * self.pow(exponent - 1))` in one expression, whose temporaries
    (self.pow(1), a copy, and 2 x it) live until the product is made (measured: the MLP's
    backward alone under torch's MemTracker, 4096 tokens: dy + 3 ffn-wide tensors over
    GeLU's dy + 1)."""
    if model.gated_mlp:
        return 2
    return 3 if model.mlp == "relu2" else 1


def block_backward_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                         recompute: str, opts: KernelOptions, mem: MemoryOptions) -> float:
    """Bytes a block's backward holds at its fullest moment beyond its saved activations and
    its whole unit gradient (module docstring); negative where the unit gradient not yet
    made outweighs the temporaries. One layer, one micro-batch of `seq` tokens per rank."""
    if mem.saved != "eager":
        # rehearsed on meshtron's eager block only; Megatron-LM's and DeepSpeed's fused
        # kernels (the korthikanti list) are not walked: their block moment is as before
        return 0.0
    sp = sp and tp > 1
    tokens = micro_batch * seq
    g = unit_grad_bytes(mem)
    return max(tokens * held - g * unmade
               for held, unmade in _moments(model, tp, sp, recompute, opts, mem, seq))
