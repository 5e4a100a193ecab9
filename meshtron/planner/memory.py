"""Memory per GPU: model states per ZeRO stage, activations, logits, workspace.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3 and 5): mixed-precision AdamW keeps
bf16 weights (2 bytes/param), bf16 gradients (2) and fp32 master weights + two moments (K = 12),
16 bytes per parameter in all (18 when gradients accumulate in an fp32 buffer, as in
Megatron-LM's main_grad; KernelOptions.fp32_grad_reduce). ZeRO-1 shards the optimizer states
over the data-parallel group, ZeRO-2 also the gradients, ZeRO-3 also the weights. ZeRO-3
re-gathers the weights of a layer before using them; we keep two layers' gathered bf16 weights
(current + prefetch).

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4, eqs. 1-5), generalised to grouped-query
attention and SwiGLU by listing the stored tensors (bytes per token; h hidden, kv key/value width,
f MLP width, a heads, s sequence, t tensor-parallel degree):

* replicated over the tensor group unless sequence parallelism shards them by t: the inputs of
  the two norms (4h), the QKV and MLP inputs (2h + 2h), dropout masks (2 x 1h, with dropout);
  Korthikanti's "10 sbh" term;
* sharded by t: Q (2h), K and V (4kv), the attention-output input (2h), the MLP's inner
  activations (GeLU: input + output 4f; SwiGLU: gate, up and product 6f); Korthikanti's 24/t
  term for GPT (f = 4h);
* the attention core, sharded by t: unfused kernels keep the softmax output (2as), with dropout
  also its mask and output (5as, Korthikanti's 5as^2b); FlashAttention keeps only a fp32
  log-sum-exp per head (4a bytes).

Selective recomputation drops the attention core (Korthikanti, section 5); with FlashAttention it
stores what no recomputation stores. Full recomputation keeps only each layer's input (2h, /t with
sequence parallelism) and, while one layer is being recomputed, that layer's full activations.

Pipeline schedules keep several micro-batches in flight (pipeline.py). The last stage also holds
one micro-batch of logits: bf16 logits plus the fp32 copy the loss works on, 6 bytes per
[token, vocab/t] element (Megatron's vocab-parallel cross-entropy).

Workspace and fragmentation allowance: 1 GiB for the CUDA context, cuBLAS and NCCL workspaces
(NCCL's default buffers are 4 MiB per channel and peer; a CUDA context takes 0.3-0.5 GiB), capped
at 5% of the device for small devices, plus 8% of all tensors for the caching allocator's
fragmentation (PyTorch typically reserves 5-15% more than it allocates in LLM training).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.model.spec import ModelSpec
from meshtron.planner.compute import KernelOptions

GIB = float(2**30)
WEIGHT_BYTES = 2.0
"""bf16 weights."""
GRAD_BYTES = 2.0
"""bf16 gradients (4.0 with an fp32 accumulation buffer, see `state_bytes`)."""
OPTIMIZER_BYTES = 12.0
"""fp32 master weights + AdamW first and second moments (ZeRO's K = 12)."""
WORKSPACE_FIXED_GIB = 1.0
"""CUDA context, cuBLAS and NCCL workspaces."""
WORKSPACE_FIXED_MAX_FRACTION = 0.05
"""Cap of the fixed allowance on small devices, as a fraction of device memory."""
FRAGMENTATION = 0.08
"""Allocator fragmentation allowance, fraction of all tensors."""


def state_bytes(zero: int, dp: int, grad_bytes: float = GRAD_BYTES) -> tuple[float, float, float]:
    """Bytes per parameter held by one GPU for (weights, gradients, optimizer) at a ZeRO stage.

    `grad_bytes` is 4 when gradients are accumulated in an fp32 buffer (Megatron-LM's main_grad,
    `KernelOptions.fp32_grad_reduce`): bf16 weights + fp32 gradients + 12 bytes of optimizer
    states = 18 bytes per parameter, 6 + 12/d with a distributed optimizer (the table of
    Megatron-LM's docs/distrib_optimizer.md)."""
    w = WEIGHT_BYTES / dp if zero >= 3 else WEIGHT_BYTES
    g = grad_bytes / dp if zero >= 2 else grad_bytes
    o = OPTIMIZER_BYTES / dp if zero >= 1 else OPTIMIZER_BYTES
    return w, g, o


def layer_params_local(model: ModelSpec, tp: int) -> float:
    """Parameters of one layer held by one tensor-parallel rank (norm weights replicated)."""
    return (model.attention_params() + model.mlp_params()) / tp + 2 * model.norm_params


def embedding_params_local(model: ModelSpec, tp: int) -> float:
    """Vocabulary-parallel token embedding (+ replicated learned position table)."""
    return model.embedding_params() - model.vocab * model.hidden + model.vocab * model.hidden / tp


def head_params_local(model: ModelSpec, tp: int, pp: int) -> float:
    """Final norm + LM head on the last stage; a tied head needs its own copy when pp > 1."""
    out = model.vocab * model.hidden / tp
    if model.tied_embeddings and pp == 1:
        out = 0.0
    return model.norm_params + out


def activation_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                     recompute: str, opts: KernelOptions) -> float:
    """Bytes one layer keeps for one micro-batch until its backward pass (see module docstring)."""
    h, kv, f, a = model.hidden, model.kv_dim, model.ffn_hidden, model.heads
    tokens = micro_batch * seq
    if recompute == "full":
        return tokens * 2.0 * h / (tp if sp else 1)
    replicated = 8.0 * h + (2.0 * h if opts.dropout else 0.0)
    sharded = 4.0 * h + 4.0 * kv + (6.0 * f if model.mlp == "swiglu" else 4.0 * f)
    if opts.attention == "unfused":
        core = 0.0 if recompute == "selective" else (5.0 if opts.dropout else 2.0) * a * seq
    else:
        core = 4.0 * a
    return tokens * ((replicated / tp if sp else replicated) + (sharded + core) / tp)


def recompute_working_bytes(model: ModelSpec, tp: int, sp: bool, micro_batch: int, seq: int,
                            recompute: str, opts: KernelOptions) -> float:
    """Extra bytes alive while a recomputed layer runs its backward (one layer, one micro-batch)."""
    if recompute == "none":
        return 0.0
    if recompute == "full":
        return activation_bytes(model, tp, sp, micro_batch, seq, "none", opts)
    return (activation_bytes(model, tp, sp, micro_batch, seq, "none", opts)
            - activation_bytes(model, tp, sp, micro_batch, seq, "selective", opts))


def logits_bytes(model: ModelSpec, tp: int, micro_batch: int, seq: int) -> float:
    """bf16 logits + fp32 loss copy of one micro-batch on the last stage."""
    return micro_batch * seq * model.vocab / tp * 6.0


def workspace_bytes(tensors: float, capacity: float) -> float:
    """Workspace and fragmentation allowance for a GPU holding `tensors` bytes."""
    fixed = min(WORKSPACE_FIXED_GIB * GIB, WORKSPACE_FIXED_MAX_FRACTION * capacity)
    return fixed + FRAGMENTATION * tensors


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of the fullest GPU of a plan, GiB."""

    params: float
    """bf16 weights (plus ZeRO-3's gathered-layer buffers)."""
    grads: float
    """bf16 gradients."""
    optimizer: float
    """fp32 master weights and AdamW moments."""
    activations: float
    """Stored activations of all in-flight micro-batches plus the recomputation working set."""
    logits: float
    """Logits of one micro-batch (last stage only)."""
    workspace: float
    """Workspace and fragmentation allowance."""
    capacity: float
    """Device memory."""
    stage: int
    """Pipeline stage this breakdown belongs to (the fullest one)."""

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.logits
                + self.workspace)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits,
                "workspace": self.workspace, "total": self.total, "capacity": self.capacity,
                "stage": self.stage}
