"""Host memory that in-memory snapshots (`meshtron train --snapshot-every`,
meshtron/checkpoint/snapshot.py) take per rank: its own shard of the model and optimizer state
and a copy of a peer's (Gemini, Wang et al. 2023), in 2 generations (the previous one stays
whole while the next is written). Gradients are not snapshotted (they are rebuilt by the next
step). Torch-free.

The snapshot of a rank holds what its checkpoint shard holds: fp32 parameters and AdamW's two
fp32 moments (`memory_ranks`, exact per rank) and, with --grad-compression or DiLoCo, their
state (error-feedback residuals, the group's mean residual, DiLoCo's outer copy and momentum:
memory_compress.snapshot_extra_bytes, exact per rank); the runtime's files add the optimizer's
step counters and 64-byte alignment per tensor (meshtron/checkpoint/snapshot_files.py), a few
hundred bytes per parameter tensor.
"""

from __future__ import annotations

from typing import Any

SLOTS = 2
"""Generations kept (meshtron/checkpoint/snapshot_files.py SLOTS)."""


def snapshot_host_bytes(spec: Any, plan: Any, ranks_per_node: int | None = None
                        ) -> list[dict[str, int]]:
    """Per global rank: own shard bytes, the peer copy it keeps (rank - ranks_per_node's) and
    the host total over both generations, exact from the plan (small plans: every rank)."""
    from meshtron.planner.memory_compress import snapshot_extra_bytes
    from meshtron.planner.memory_ranks import rank_states

    states = rank_states(spec, plan)
    world = len(states)
    rpn = ranks_per_node or getattr(plan, "ranks_per_node", None) or world
    extra = snapshot_extra_bytes(spec, plan)
    own = [st.params + st.optimizer + x for st, x in zip(states, extra)]
    out = []
    for r in range(world):
        peer = own[(r - rpn) % world] if world > rpn else 0
        out.append({"own": own[r], "peer_copy": peer, "host_total": SLOTS * (own[r] + peer)})
    return out


def snapshot_host_gib(memory: Any, plan: Any = None) -> float:
    """Host GiB per rank for a plan's fullest GPU (`MemoryBreakdown`): own parameter and
    optimizer shards (the optimizer's GiB holds compression's own residual and DiLoCo's outer
    copy and momentum: compression.with_state_bytes) and the group's mean residual
    (`mean_residual_gib`), plus an equal peer copy (the ring pairs ranks of the same position
    on the next node, which hold the same shard sizes), twice (generations). The RoPE tables
    counted with the parameters (`MemoryBreakdown.derived`) are rebuilt, not snapshotted."""
    own = memory.params - memory.derived
    return SLOTS * 2 * (own + memory.optimizer + mean_residual_gib(memory, plan))


def mean_residual_gib(memory: Any, plan: Any) -> float:
    """GiB of the group's mean residual a compressed or DiLoCo rank's snapshot holds beside its
    own (memory_compress.snapshot_extra_bytes): fp32 per local parameter (DiLoCo, compressed
    ZeRO-0/1: the fp32 parameters' own bytes, `memory.params`), or per element of every FSDP2
    unit's unsharded reduce-scatter input (compressed ZeRO-2/3: dp_shard times the fp32
    shards). meshtron's runtime keeps fp32 parameters at rest (planner/memory_states.py
    state_bytes, framework fsdp2), the only one that compresses."""
    if plan is None or (plan.grad_compression == "none" and not plan.diloco):
        return 0.0
    own = memory.params - memory.derived
    if plan.diloco or plan.zero <= 1:
        return own
    return own * plan.dp_shard


def snapshot_line(memory: Any, plan: Any = None) -> str:
    """The line `meshtron plan` prints under the best plan."""
    return (f"in-memory snapshots (train --snapshot-every): "
            f"{snapshot_host_gib(memory, plan):.3g} "
            f"GiB of host memory per {memory.device} (own parameter + optimizer shard and a "
            "peer's copy, "
            f"{SLOTS} generations)")
