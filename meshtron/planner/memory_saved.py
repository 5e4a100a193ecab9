"""What one block saves for its backward without recomputation, per token, for the stack that
runs it: meshtron's eager model (`eager_none`) or that model compiled per block by
torch.compile (`compiled_none`; parallel/compile.py). Shared by memory_acts.py (the saved
activations) and memory_bwd.py (the backward's moments, which free them), apart from both so
that neither imports the other.

A compiled block keeps what AOTAutograd's partitioner chooses, not what eager autograd saves
(torch/_functorch/partitioners.py `min_cut_rematerialization_partition`, the partitioner
inductor runs): a min cut of the joint forward/backward graph in which a node whose output a
non-fusible op (a GEMM, SDPA) reads in the backward must be saved ("materialized in
backward": `ban_if_materialized_backward`), while element-wise ops fused into the backward's
kernels are recomputed from smaller or already-saved inputs. Measured on one meshtron block,
torch 2.13.0, inductor on the CPU, compiled as the runtime compiles it (bench/compiled_saved.py;
tests/test_compiled_saved.py holds it; docs/measurements.md#compiled-activations), the compiled
block saves, against the eager one:

* each norm: its input in the compute dtype and the fp32 rstd (mean and rstd for LayerNorm),
  on every device: inductor decomposes the norm (torch/_decomp/decompositions.py
  `_fused_rms_norm` is in the core decomposition table), so the CPU's composite fp32 copies
  (`MemoryOptions.fused_norm` False) are not kept: the fused kernel's figure. The second
  norm's input is rebuilt from the block input and the out-projection's output, which is
  saved instead (the same bytes);
* the normed inputs of QKV and the MLP, Q and K after RoPE, V, SDPA's output and log-sum-exp:
  as eager (GEMM and SDPA inputs and outputs, materialized in the backward);
* a gated MLP (SwiGLU, GeGLU): the gate and up projections' outputs and their product (w2's
  input), not the activation's output, which the backward's fused kernel recomputes from the
  gate: 3 [tokens, ffn] tensors, not 4. An ungated GeLU keeps its pre-activation and its
  output (w2's input, materialized): 2, as eager (measured); squared ReLU likewise (its output
  is w2's input; not measured);
* RoPE's cos/sin cast to the compute dtype once, shared by Q and K (common subexpressions),
  not once per call: `rope_copies` 2, not 4;
* per-head q/k norms (Qwen3): their inputs (wq's and wk's outputs) and rstd, the fused form.

Tensor parallelism (tp = 2 on two gloo ranks, sp off and on, `--tp` of the bench): each rank
keeps this list at its shard widths, less RoPE's two casts, which the tensor-parallel graph
does not keep (its partitioner saves the model's fp32 RoPE table instead, a graph input the
model holds anyway): priced with them, 512 bytes per token conservative at head_dim 128.

Not measured compiled (priced as eager with the fused norms' figure): MLA's latents, the
CPU's sliding-window chunks, LayerNorm's statistics (the compiled block keeps them in the
compute dtype: 4 bytes per token fewer, left out).
"""

from __future__ import annotations

import dataclasses

from meshtron.model.spec import ModelSpec
from meshtron.planner.memory_kinds import qk_norm_bytes, window_chunk_bytes
from meshtron.planner.memory_options import MemoryOptions


def rope_copies(stack: str) -> float:
    """[seq, rope_dim] tables of RoPE's cos/sin cast to a 16-bit compute dtype one block
    keeps: eager 2 calls (q, k) x (cos, sin); compiled one cast of each, shared (module
    docstring)."""
    return 2.0 if stack == "compiled" else 4.0


def none_bytes(model: ModelSpec, tp: int, sp: bool, mem: MemoryOptions, attention: str,
               seq: int, stack: str = "eager") -> float:
    """Bytes per token one block saves without recomputation on `stack` (KernelOptions.stack:
    'compiled' is `compiled_none`, every other stack meshtron's eager list)."""
    if stack == "compiled":
        return compiled_none(model, tp, sp, mem, attention, seq)
    return eager_none(model, tp, sp, mem, attention, seq)


def compiled_none(model: ModelSpec, tp: int, sp: bool, mem: MemoryOptions, attention: str,
                  seq: int) -> float:
    """Bytes per token one block compiled per block saves without recomputation (module
    docstring): the eager list with the norms as the fused kernel saves them on every device,
    less a gated MLP's activation output; the device's sliding-window path as eager."""
    fused = dataclasses.replace(mem, fused_norm=True)
    window_path = window_chunk_bytes(model, tp, seq, mem) - window_chunk_bytes(
        model, tp, seq, fused)
    activation = mem.compute_bytes * model.ffn_hidden / tp if model.gated_mlp else 0.0
    return eager_none(model, tp, sp, fused, attention, seq) + window_path - activation


def eager_none(model: ModelSpec, tp: int, sp: bool, mem: MemoryOptions, attention: str,
                seq: int) -> float:
    """Bytes per token one eager block saves without recomputation (memory_acts.py's module
    docstring)."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    q = model.heads * model.head_dim                       # query width (Qwen3: 2h)
    cb = mem.compute_bytes
    kv_sdpa = q if mem.gqa_copies and model.heads != model.kv_heads else kv
    h_in = h / (tp if sp else 1)                           # norm inputs, sequence-sharded with SP
    norms = model.block_norms                              # Gemma's sandwich: four
    if model.norm == "rmsnorm" and not mem.fused_norm:
        # composite rms_norm: fp32 copy of the input and the fp32 normalised tensor
        norm = norms * (4.0 * h_in + 4.0 * h_in)
    else:
        norm = norms * cb * h_in                           # input (+ per-row statistics)
    stats = (8.0 if model.norm == "layernorm" else 4.0) / (tp if sp else 1)  # fp32 mean/rstd
    norm += norms * stats
    gathered = 2.0 * h                                     # normed inputs of QKV and MLP
    # q after RoPE, k and v as SDPA sees them, SDPA's output (= the out-projection's input:
    # attention kernels return it in [batch, seq, heads, dim] layout, so the reshape is a view)
    attn = 2.0 * q + 2.0 * kv_sdpa
    mlp = 4.0 * f if model.gated_mlp else 2.0 * f
    core = 4.0 * a                                          # fp32 log-sum-exp per head
    if attention == "unfused":
        core += cb * a * seq                                # softmax output
    return (norm + cb * (gathered + (attn + mlp) / tp) + core / tp
            + mla_eager_bytes(model, tp, mem) + qk_norm_bytes(model, tp, mem)
            + window_chunk_bytes(model, tp, seq, mem))


def mla_eager_bytes(model: ModelSpec, tp: int, mem: MemoryOptions) -> float:
    """Bytes per token meshtron's MLA block (model/mla.py) saves beyond what `eager_none`'s
    attention terms count (q, k and the zero-padded v at the q/k head width, SDPA's output,
    all as for GQA with kv_heads = heads): the out-projection's input, a copy of SDPA's output
    cut to v_head_dim (heads x v / tp), and the two latents: the normed latents the
    up-projections save (q_lora_rank + kv_lora_rank) and their RMSNorms' own tensors (the
    composite's fp32 input copy and normalised tensor; the fused kernel's input and per-row
    statistics), on the whole gathered sequence on every tp rank (replicated, also with
    sequence parallelism: wq_a and wkv_a run on the gathered input). 0 without MLA."""
    if not model.is_mla:
        return 0.0
    cb, latents = mem.compute_bytes, model.q_lora_rank + model.kv_lora_rank
    norms = 8.0 * latents if (model.norm == "rmsnorm" and not mem.fused_norm) \
        else cb * latents + 2 * 4.0
    return cb * model.out_width / tp + cb * latents + norms
