"""Tensor and sequence parallelism for `meshtron.model.Transformer`, applied from outside.

Megatron-LM layout (Shoeybi et al. 2019) with sequence parallelism (Korthikanti et al. 2022),
expressed with DTensor's `parallelize_module`:

- attention: wq, wk, wv column-parallel (each rank holds heads/tp query heads and
  kv_heads/tp key/value heads: contiguous head blocks, so grouped-query pairs stay on one rank),
  wo row-parallel;
- multi-head latent attention (model/mla.py; torchtitan's deepseek_v3 plan): wq or wq_b and
  wkv_b column-parallel by heads, wo row-parallel; the down-projections wq_a, wkv_a and their
  norms replicated (fed the gathered sequence under sp), and the rotary key all heads share
  gets its gradient summed over the tp ranks (`_sum_grad_over_tp`);
- MLP: w1 (and w3) column-parallel, w2 row-parallel;
- token embedding: row-parallel over the vocabulary (uneven shards allowed: vocab 259 on tp=2
  is 130 + 129 rows); learned position table likewise over its rows;
- output head: column-parallel over the vocabulary, logits stay a vocabulary-sharded DTensor
  and the cross-entropy runs under `loss_parallel()` (no all-gather of logits);
- with sp=True the norms run on sequence shards (SequenceParallel) and the block inputs are
  all-gathered at `attention`/`feed_forward` entry (PrepareModuleInput), the row-parallel outputs
  are reduce-scattered back to sequence shards; with sp=False activations between blocks are
  replicated and the norms replicated.

The model code needs no change: attention infers its local head count from the tensor shape.
Tied input/output embeddings are re-tied after sharding (both are Shard(0) over the vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.model.mla import MLAttention
from meshtron.model.moe import MoE


def apply_tensor_parallel(model: nn.Module, tp_mesh, sp: bool = False) -> nn.Module:
    """Shard `model` (a Transformer or a pipeline-stage chunk of one) over `tp_mesh` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if tp_mesh.size() == 1:
        return model
    if sp:  # a later pipeline stage receives 1/tp of the sequence (Transformer.forward)
        model.sequence_shards = tp_mesh.size()
    seq = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {}
    tied = (getattr(model, "tok_embeddings", None) is not None
            and getattr(model, "output", None) is not None
            and model.output.weight is model.tok_embeddings.weight)
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "pos_embeddings", None) is not None:
        # Output [seq, hidden]: sequence is dim 0 here.
        top["pos_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate())
    if getattr(model, "norm", None) is not None and sp:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                        use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    if "output" in top:  # the model's loss then takes whole vocabulary-sharded logits
        model.output.vocab_parallel = True
    if tied:
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(input_layouts=(seq, None),
                                            desired_input_layouts=(Replicate(), None)),
            **_attention_plan(block.attention),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if isinstance(block.feed_forward, MoE):
            plan.update(_moe_plan(seq))
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                                   desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            })
            if getattr(block.feed_forward, "w3", None) is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
        if sp:  # the norms present (model/transformer.py Block: pre, post or both)
            for name in ("attention_norm", "ffn_norm"):
                if getattr(block, name, None) is not None:
                    plan[name] = SequenceParallel()
            for name in ("attention_post_norm", "ffn_post_norm"):  # their output meets the
                if getattr(block, name, None) is not None:     # plain residual stream
                    plan[name] = SequenceParallel(use_local_output=True)
        if not isinstance(block.attention, MLAttention) and block.attention.q_norm is not None:
            # per-head q/k norms see this rank's heads (dim 2): their weights' gradients are
            # partial sums over the heads, reduced as sequence parallelism reduces a norm's
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        if isinstance(block.attention, MLAttention):
            block.attention.k_rope_shared.register_forward_hook(_sum_grad_over_tp(tp_mesh))
    _replicate_leftover_params(model, tp_mesh)
    return model


def _attention_plan(attn: nn.Module) -> dict[str, Any]:
    """The head-sharded projections: q, k, v (GQA: contiguous head blocks) or MLA's up-
    projections (wq or wq_b, wkv_b); what is not named stays replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    if not isinstance(attn, MLAttention):
        names = ("wq", "wk", "wv")
    else:
        names = ("wq" if attn.wq is not None else "wq_b", "wkv_b")
    return {f"attention.{n}": ColwiseParallel() for n in names}


def _sum_grad_over_tp(tp_mesh):
    """A forward hook that leaves MLA's shared rotary key as it is and declares its gradient a
    partial sum: each rank's heads/tp heads contribute their part of it, and the replicated
    wkv_a needs the sum (Megatron's "copy to tensor-parallel region": identity forward,
    all-reduce backward). DTensor does the all-reduce: from_local(Replicate) then
    to_local(grad_placements=Partial) redistributes the gradient Partial -> Replicate."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def hook(module, inputs, output):
        return DTensor.from_local(output, tp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])

    return hook


def _moe_plan(seq) -> dict[str, Any]:
    """A mixture-of-experts feed-forward under TP: replicated over the tp ranks and fed the
    full tokens (the dense FFN's all-gather under sp), as plain tensors in and out; its output
    goes back to the block's layout (a local slice under sp, whose backward all-gathers the
    gradient, so every tp rank back-propagates the same full gradient and the MoE parameters'
    gradients are equal on all tp ranks without a reduction). Routing, experts and the
    all-to-alls of expert parallelism see the same tokens on every tp rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return {"feed_forward": PrepareModuleInputOutput(
        input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)}


def _replicate_leftover_params(model: nn.Module, tp_mesh) -> None:
    """Run every module that still holds plain parameters (the norms when sp=False) as a
    replicated DTensor module: parameters become Replicate DTensors on the tp mesh, inputs are
    wrapped as Replicate and outputs unwrapped. All parameters of a tp-sharded model then live
    on one mesh (one kind of tensor for FSDP2, gradient clipping and DCP). Every tp rank
    computes the same replicated value, so this is exact."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs_to_dtensor(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if (isinstance(x, torch.Tensor) and not isinstance(x, DTensor)) else x
                     for x in inputs)

    def outputs_to_local(mod, outputs, mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    from meshtron.model.moe import MoE

    skip = {id(m) for moe in model.modules() if isinstance(moe, MoE) for m in moe.modules()}
    for module in list(model.modules()):
        if id(module) in skip:  # replicated plain modules fed plain tensors (`_moe_plan`)
            continue
        own = list(module.named_parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for _, p in own):
            distribute_module(module, tp_mesh, input_fn=inputs_to_dtensor,
                              output_fn=outputs_to_local)
