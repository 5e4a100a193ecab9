"""DeepSeek-V3's multi-token prediction modules (report section 2.2, `ModelSpec.mtp_depth`),
priced on the stage holding the output head: each of the D modules normalises the previous
depth's hidden state and the next token's embedding (two RMSNorms), projects their
concatenation [T, 2h] to [T, h] (one GEMM), runs one transformer block and the output head and
cross-entropy again (the head and the embedding shared with the main model, section 3.2.3:
DualPipe keeps them on one rank). So per micro-batch and module: one block (the model's
average block, MoE share included: its exposed all-to-alls charged with it), one head and the
projection, forward and backward. Memory on the head's rank: the module's parameters (one
block and the projection, `params`; its routed experts at the dense parameters' states, which
under ZeRO-1 shard over dp, not the dp/ep ranks that share an expert: a little under) and one
micro-batch of its block's activations (the head's stage holds one micro-batch: 1F1B's and
zero bubble's last stage, DualPipe's stage PP-1 on rank 0; `activations`). Not counted: the two
norms (memory-bound passes over [T, h], under 0.1% of a block) and the module's own logits
(alive at its loss, as the main head's are at theirs).
"""

from __future__ import annotations

import dataclasses

from meshtron.planner.compute import EdgeCost


def with_mtp(head: EdgeCost, depth: int, block: tuple[float, float, float, float],
             proj_fwd: float) -> EdgeCost:
    """The head's costs with `depth` modules: `block` = (compute, communication, forward,
    weight gradient) of one block and micro-batch (its communication, exposed all-to-alls
    and tensor-parallel traffic, counted as the module's compute: the head's stage runs it
    beside its own blocks); `proj_fwd`: the projection GEMM's forward seconds (its backward
    two such GEMMs)."""
    if depth <= 0:
        return head
    c, comm, f, w = block
    one = c + comm + head.compute + 3.0 * proj_fwd
    return dataclasses.replace(
        head, compute=head.compute + depth * one,
        fwd=head.fwd + depth * (f + head.fwd + proj_fwd),
        wgrad=head.wgrad + depth * (w + head.wgrad + proj_fwd),
        # by kind (compute.PART_KINDS, step_categories.KINDS): the head's own again, the
        # projection a GEMM, the module's block whole under 'moe' (it is a MoE block)
        parts=head.parts + tuple((k, depth * t) for k, t in head.parts)
        + (("gemm", depth * 3.0 * proj_fwd), ("moe", depth * (c + comm))))


def params(depth: int, block: float, hidden: int, tp: int) -> float:
    """Parameters per tensor rank of `depth` modules: one block (`block`, the pipelined
    planner's largest) and the 2h x h projection each."""
    return depth * (block + 2.0 * hidden * hidden / tp)


def with_activations(outputs: list[float], head_rank: int, depth: int,
                     act: float) -> list[float]:
    """Per pipeline rank, bytes kept beside the stages' own activations: `depth` blocks'
    activations of one micro-batch (`act` per block) on the head's rank."""
    if not depth:
        return outputs
    out = list(outputs)
    out[head_rank] += depth * act
    return out
