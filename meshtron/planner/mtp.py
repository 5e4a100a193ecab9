"""DeepSeek-V3's multi-token prediction modules (report section 2.2, `ModelSpec.mtp_depth`),
priced on the stage holding the output head: each of the D modules normalises the previous
depth's hidden state and the next token's embedding (two RMSNorms), projects their
concatenation [T, 2h] to [T, h] (one GEMM), runs one transformer block and the output head and
cross-entropy again (the head and the embedding shared with the main model, section 3.2.3:
DualPipe keeps them on one rank). So per micro-batch and module: one block (the model's
average block, MoE share included: its exposed all-to-alls charged with it), one head and the
projection, forward and backward. Not counted: the two norms (memory-bound passes over
[T, h], under 0.1% of a block) and the module's memory (its block's parameters, activations
and a second set of logits on the head's stage).
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
