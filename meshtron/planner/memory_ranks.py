"""Exact model-state bytes of every rank of a meshtron run, from the plan alone.

`memory.py` costs a plan per parameter (bytes/param x parameters/GPU); this module counts what
meshtron's runtime really holds on each global rank, tensor by tensor, so the planner's numbers
can be checked byte for byte against a run's `memory.json` (tests/test_memory.py,
bench/memory_vs_measured.py):

* the model is built on the meta device (no memory) and cut into the rank's pipeline stages by
  the runtime's own functions (`meshtron.parallel.pipeline`);
* tensor parallelism shards each weight like `meshtron.parallel.tensor` does (column-parallel
  weights and biases on dim 0, row-parallel weights on dim 1, vocabulary-parallel embeddings and
  head on dim 0, norms and row-parallel biases replicated), FSDP2 then shards dim 0 of the
  tensor-parallel shard over "dp_shard"; both with torch.chunk's sizes (ceil(d/n), the last
  ranks smaller or empty), which is what DTensor's Shard and FSDP2 use;
* parameters and gradients are fp32 in both dtypes (FSDP2 keeps fp32 master parameters and
  reduces in fp32); AdamW keeps two fp32 moments per element of the parameters it updates: all
  local ones, or with ZeRO-1 those this data-parallel rank owns under the runtime's own greedy
  partition (`meshtron.parallel.data_parallel._partition`).

Needs torch (imported lazily): not for the search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtron.model.spec import ModelSpec

FP32 = 4
ADAM_MOMENTS = 2

_COLWISE = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.",
            "feed_forward.w3.")
_ROWWISE = ("attention.wo.", "feed_forward.w2.")
_VOCAB = ("tok_embeddings.weight", "pos_embeddings.weight", "output.weight")


def _chunk(size: int, parts: int, index: int) -> int:
    """Length of torch.chunk(size, parts)[index] (0 when that chunk does not exist)."""
    step = math.ceil(size / parts) if size else 0
    return max(0, min(step, size - index * step))


def tp_shard_dim(name: str) -> int | None:
    """Tensor dim a parameter is sharded on under tensor parallelism (None: replicated)."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    if name in _VOCAB:
        return 0
    if any(k in name for k in _COLWISE):
        return 0
    if any(k in name for k in _ROWWISE):
        return 1 if name.endswith("weight") else None
    return None


def local_shape(name: str, shape: tuple[int, ...], tp: int, r_tp: int, dp_shard: int,
                r_dp: int, fsdp: bool) -> tuple[int, ...]:
    """Shape of the rank's local piece of a parameter."""
    out = list(shape)
    dim = tp_shard_dim(name)
    if tp > 1 and dim is not None:
        out[dim] = _chunk(out[dim], tp, r_tp)
    if fsdp and dp_shard > 1:
        out[0] = _chunk(out[0], dp_shard, r_dp)
    return tuple(out)


@dataclass(frozen=True)
class RankState:
    """Bytes one rank holds at the end of a step (what memory.json measures)."""

    rank: int
    """Global rank."""
    params: int
    """Local parameter bytes."""
    grads: int
    """Local gradient bytes (after backward)."""
    optimizer: int
    """AdamW state bytes (exp_avg + exp_avg_sq)."""
    layers: int
    """Transformer blocks on this rank."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "total": self.total}


def _stage_parts(spec: ModelSpec, lay, pp_rank: int) -> list[Any]:
    import torch

    from meshtron.model import Transformer
    from meshtron.parallel.pipeline import split_model

    with torch.device("meta"):
        model = Transformer(spec)
    if lay.pp == 1 and lay.virtual_stages == 1:
        return [model]
    return [part for _, part in split_model(model, lay, pp_rank)]


def rank_states(spec: ModelSpec, plan: Any, dtype: str = "fp32") -> list[RankState]:
    """Exact parameter, gradient and AdamW bytes of every global rank of `plan` (any object the
    runtime's `resolve_plan` reads). The same in fp32 and bf16 runs (module docstring); `dtype`
    only decides whether FSDP2 is applied on a single data-parallel rank."""
    import torch

    from meshtron.parallel.data_parallel import _partition
    from meshtron.parallel.mesh import resolve_plan

    lay = resolve_plan(plan, None, spec)
    fsdp = lay.dp > 1 or dtype == "bf16"
    out: list[RankState] = []
    for rank in range(lay.tp * lay.pp * lay.dp):
        r_tp = rank % lay.tp
        r_pp = (rank // lay.tp) % lay.pp
        r_dp = rank // (lay.tp * lay.pp)  # rank in the flattened "dp" group
        r_shard = r_dp % lay.dp_shard
        params = grads = opt = layers = 0
        for part in _stage_parts(spec, lay, r_pp):
            layers += len(part.layers)
            named = [(n, p) for n, p in part.named_parameters() if p.requires_grad]
            shapes = [local_shape(n, tuple(p.shape), lay.tp, r_tp, lay.dp_shard, r_shard, fsdp)
                      for n, p in named]
            numels = [math.prod(s) for s in shapes]
            params += FP32 * sum(numels)
            grads += FP32 * sum(numels)
            if lay.zero == 1 and lay.dp > 1:
                owner = _partition([torch.empty(s, device="meta") for s in shapes], lay.dp)
                opt += FP32 * ADAM_MOMENTS * sum(k for k, o in zip(numels, owner) if o == r_dp)
            else:
                opt += FP32 * ADAM_MOMENTS * sum(numels)
        state = RankState(rank, params, grads, opt, layers)
        out.append(state)
    return out
