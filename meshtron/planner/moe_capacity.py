"""Token drop at an expert capacity (KernelOptions.expert_capacity, expert_capacity_pad): how
many rows a MoE layer's experts multiply, its all-to-alls carry and its activations hold,
against the dropless routing the rest of the MoE cost model starts from. Torch-free.

The capacity of an expert is C = ceil(f T k / E) rows per source rank (f the capacity factor,
T the tokens the rank routes, k top-k, E experts): Megatron-Core's `get_capacity`
(megatron/core/transformer/moe/moe_utils.py, core_v0.12.2 64cb6bd7 .. core_v0.15.0 103851dc),
computed by the router's `apply_router_token_dropping` over the rank's own tokens
(routing_map.size(0): its sequence shard under sequence parallelism) and by the alltoall
dispatcher's `preprocess` likewise; DeepSpeed-MoE's GShard gating takes the same ceil
(deepspeed/moe/sharded_moe.py `_capacity`).

* Padded to capacity (Megatron-Core's moe_pad_expert_input_to_capacity, `drop_and_pad`): the
  router keeps exactly C rows per expert, real tokens with zero weight filling the short
  experts (`apply_router_token_dropping`: final_map = capacity_mask); the alltoall
  dispatcher permutes num_out_tokens = C E rows, sends C to every expert and each local
  expert receives C x tp x ep rows (`preprocess`: torch.full of capacity * tp_size *
  ep_size, tp_size the expert-tensor group it gathers over): every rank alike, whatever the
  router chose, so the routing imbalance does not apply. The allgather dispatcher gathers
  the T tokens whole (its volume does not depend on the capacity) and its experts take the
  same C-per-expert routing map. The flex dispatcher refuses padding at core_v0.15.0
  (transformer_config.py `__post_init__`); at d7288711 only its DeepEP backend does, and
  HybridEP's `setup_metadata` permutes the same C x ep rows per local expert (priced as its
  deduplicated rows scaled by C E / (T k), moe_deepep.py).
* Dropped without padding: each expert keeps at most C rows of each source rank (final_map
  = routing_map AND capacity_mask): the fullest rank's rows are the imbalance capped at f,
  min(imbalance, f) times the mean, and a rank sends min(1, f) of its T k slots (balanced
  sources). The splits stay dynamic: the dispatcher syncs with the host like dropless
  (`preprocess`: num_out_tokens from the routing map, sync point "before_permutation_1";
  moe_host.dispatcher_syncs).

Model FLOPs (MFU) count the routed tokens only; the hardware FLOPs (HFU) count the rows the
experts multiply (`executed_expert_flops_per_token`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertRows:
    """Rows of one MoE layer on one rank, each over the dropless mean of its kind."""

    per_expert: float
    """Rows one local expert of the fullest rank multiplies, over the mean T k ep / E
    (the grouped GEMMs' M): the imbalance dropless; capped at f; C E / (T k) padded."""
    received: float
    """Rows the fullest rank's experts receive in all, over the mean T k: the imbalance with
    expert parallelism (1 without: all experts local), capped at f; padded C E / (T k)."""
    sent: float
    """Rows a rank permutes and sends, over its T k routed slots (also what all experts
    multiply in all, for HFU): 1 dropless, min(1, f) dropped, C E / (T k) padded."""


def capacity_rows(factor: float, tokens: float, top_k: int, experts: int) -> int:
    """C: the rows an expert takes from one source rank routing `tokens` tokens
    (Megatron-Core moe_utils.py `get_capacity`: ceil(T k / E x factor))."""
    return math.ceil(tokens * top_k / experts * factor)


def padded_factor(factor: float, tokens: float, top_k: int, experts: int) -> float:
    """C E / (T k): the rows a padded layer moves per routed slot (1.0 at f = 1 when E
    divides T k; the ceil adds the rest)."""
    slots = tokens * top_k
    if slots <= 0:
        return 1.0
    return capacity_rows(factor, tokens, top_k, experts) * experts / slots


def expert_rows(tokens: float, top_k: int, experts: int, ep: int, imbalance: float,
                capacity: float = 0.0, pad: bool = True) -> ExpertRows:
    """The rows of one MoE layer (module docstring) for a rank routing `tokens` tokens:
    dropless (`capacity` 0) the routing imbalance of the fullest rank; `capacity` f > 0 with
    `pad` every expert's C rows; without `pad` the imbalance capped at f."""
    received = imbalance if ep > 1 else 1.0
    if capacity <= 0:
        return ExpertRows(imbalance, received, 1.0)
    if pad:
        c = padded_factor(capacity, tokens, top_k, experts)
        return ExpertRows(c, c, c)
    return ExpertRows(min(imbalance, capacity), min(received, capacity), min(1.0, capacity))


def executed_expert_flops_per_token(model, rows: ExpertRows, replay: float) -> float:
    """Hardware FLOPs per token the routed experts run beyond the model FLOPs: (sent - 1) of
    their 2 x 3 (forward, two backward GEMMs) x k x expert parameters per MoE layer, and
    `replay` (recomputation's share of forwards run again) of the forward's 2; negative
    where dropped tokens skip their experts (f < 1)."""
    if not model.is_moe or rows.sent == 1.0:
        return 0.0
    routed = model.moe_top_k * model.mlp_params(model.moe_ffn_hidden)
    return (rows.sent - 1.0) * model.moe_layers * routed * (6.0 + 2.0 * replay)


__all__ = ["ExpertRows", "capacity_rows", "executed_expert_flops_per_token", "expert_rows",
           "padded_factor"]
