"""What a block of one of the dense model kinds read from Hugging Face configs saves for its
backward beyond a Llama block (memory_saved.py `eager_none`), for meshtron's eager model
(meshtron/model/transformer.py, attention.py): per-head or whole q/k RMSNorms (Qwen3, Gemma 3,
OLMo 2, OLMoE), Gemma's sandwich norms (four a block), and sliding-window attention on the
CPU's kernels. Each term was read off the block's saved tensors (`torch.autograd.graph.
saved_tensors_hooks` on one block, deduplicated by storage; tests/test_rehearse_models.py
checks it) and holds the planner within 5% of `meshtron rehearse` (the same table).
"""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner.memory_options import MemoryOptions

RSTD_BYTES = 4.0
"""Bytes of the fp32 per-row statistic an RMSNorm keeps (rstd; torch's rms_norm, composite
or `_fused_rms_norm`, saves it beside its input)."""


def norm_saved_bytes(mem: MemoryOptions) -> float:
    """Bytes per element one RMSNorm saves: PyTorch's composite rms_norm (the CPU's kernels,
    `fused_norm=False`) an fp32 copy of its input and the fp32 normalised tensor (8); the fused
    kernel its input in the compute dtype."""
    return 8.0 if not mem.fused_norm else mem.compute_bytes


def qk_norm_bytes(model: ModelSpec, tp: int, mem: MemoryOptions) -> float:
    """Bytes per token the q and k RMSNorms save (model/transformer.py `Attention`: per head
    over [.., head_dim], Qwen3 / Gemma 3; over the whole projection, OLMo 2 / OLMoE): their
    input (`norm_saved_bytes` per element, q heads x head_dim and kv_dim wide) and a
    per-row rstd (a row per head, or one per projection). Nothing else saves the raw q and k
    (RoPE's multiplications save only cos and sin; SDPA the rotated q and k). MLA's latent
    norms are mla_eager_bytes'."""
    if not model.qk_norm or model.is_mla:
        return 0.0
    q, kv = model.heads * model.head_dim, model.kv_dim
    rows = 2.0 if model.qk_norm_whole else float(model.heads + model.kv_heads)
    return (norm_saved_bytes(mem) * (q + kv) + RSTD_BYTES * rows) / tp


def chunked_window(model: ModelSpec, seq: int, mem: MemoryOptions) -> bool:
    """Whether the sliding blocks run model/attention.py `window_attention`'s CPU path
    (queries in chunks of the window, each one SDPA call with a band mask): the CPU's
    kernels (`fused_norm=False`, as compare.py asks the planner for a CPU rehearsal) and a
    sequence longer than the window (else one causal SDPA call, a Llama block's). On CUDA the
    window is one FlexAttention call (q, k, v, the output and the log-sum-exp saved, as SDPA)."""
    return bool(model.sliding_window) and seq > model.sliding_window and not mem.fused_norm


def window_chunk_bytes(model: ModelSpec, tp: int, seq: int, mem: MemoryOptions) -> float:
    """Bytes per token a sliding block on the CPU path saves beyond a causal one, averaged
    over the model's blocks (`sliding_blocks` of `layers` slide): each chunk's SDPA output
    (saved by its own backward) and, apart, their `torch.cat` (a [batch, heads, seq, dim]
    tensor, so the out-projection's reshaped input is a copy, not a view: heads x v wide,
    saved by the out-projection), where one causal SDPA call's output is that input."""
    if not chunked_window(model, seq, mem):
        return 0.0
    return mem.compute_bytes * model.out_width / tp * model.sliding_blocks / model.layers


def window_mask_bytes(model: ModelSpec, seq: int, mem: MemoryOptions) -> float:
    """Bytes per layer and micro-batch of the chunks' band masks (boolean, [rows, keys] of each
    chunk: the window's queries against the at most 2 x window - 1 keys they reach), which
    SDPA turns into additive masks in the compute dtype and saves for its backward; shared
    by the batch and the heads, so per micro-batch, not per token. Averaged over the blocks
    as `window_chunk_bytes`."""
    if not chunked_window(model, seq, mem):
        return 0.0
    w = model.sliding_window
    # closed form of the chunk loop: the first chunk w x w, each later full one w x (2w - 1),
    # a last partial one of r rows r x (r + w - 1)
    full, r = seq // w - 1, seq % w
    elements = w * w + full * w * (2 * w - 1) + r * (r + w - 1)
    return mem.compute_bytes * elements * model.sliding_blocks / model.layers
