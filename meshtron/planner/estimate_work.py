"""`Work`: what the steps of one `estimate.Evaluator.evaluate` call hand each other, declared
and typed, so that a misspelt name fails where it is written (slots) instead of when a later
step reads it. Fields are grouped by the step that first sets them, in that order: `_inputs`
(the constructor's arguments), `_states`, `_memory_model`, `_split`, `_times`, `_stage_sync`.
Per-layer times are seconds per micro-batch, sizes bytes (parameters where named p_*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshtron.planner import compute, memory
from meshtron.planner.plan import Plan

Block = tuple[float, float, float, float]
"""A pipeline rank's mean block: (parameters, routed-expert parameters, activations,
recompute working set)."""


@dataclass(slots=True)
class Work:
    """One plan's evaluation state (estimate.py), under the names the steps use."""

    # ---- _inputs: the plan and its per micro-batch costs (estimate_pieces.py) ----
    cfg: Plan
    tp: int
    pp: int
    dp: int
    zero: int
    mb: int  # micro-batch size
    rec: str  # recomputation: none, selective, half or full
    v: int  # virtual stages per pipeline rank
    m: int  # micro-batches per step
    cp: int
    ep: int
    c_l: float  # compute of one layer (recomputation included)
    tpc_l: float  # tensor/context/expert-parallel communication of one layer
    f_l: float  # forward part of one layer (compute + communication)
    w_l: float  # weight-gradient part of one layer
    emb: compute.EdgeCost
    head: compute.EdgeCost  # final norm + head + loss (with a chunked loss: `head_for`)
    p2p_bytes: float  # one pipeline send per tensor rank
    gather: float  # seconds to re-gather a scattered pipeline activation
    ep_l: float  # expert all-to-alls of one layer (the part of tpc_l that is ep_comm)
    mem_opts: memory.MemoryOptions  # the memory options at the plan's dtype
    act: float  # activations one layer keeps
    work: float  # working set of a recomputed layer
    logits: float  # logits and their gradients (last stage)
    flags: dict[str, Any]  # DataParallelCost.dp_flags
    shard_dp: int  # ranks ZeRO shards over (dp / dp_replicate x cp: HSDP replicates the shard)
    keep: bool  # FSDP2 keeps the parameters gathered over the step
    fsdp_zero1: bool  # meshtron's ZeRO-1 on FSDP2 (no compression or DiLoCo)
    accum: float  # bytes per parameter of unsharded gradients accumulated over micro-batches
    t_layer: float  # c_l + tpc_l
    e_first: float  # first stage's extra time (embedding; with pp = 1 the head too)
    e_last: float  # last stage's extra time (head; 0 with pp = 1 and on torch's V)
    head_rank: int  # pipeline rank of the last virtual stage (pipeline.head_rank)
    # one replayed block's seconds in (c_l, tpc_l, w_l, ep_l) under meshtron's `half`, for a
    # part's own count (HalfRecompute.half_replay); zeros elsewhere
    replay: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    runs: int = 1  # pipeline schedule calls per step (Plan.pipeline_runs), m / runs each
    # ---- _states: parameters per tensor rank and the bytes of their states ----
    p_layer: float = 0.0  # of one block (without routed experts under ep > 1)
    p_emb: float = 0.0
    p_head: float = 0.0
    largest: float = 0.0  # the largest single weight matrix (StageParams)
    p_exp: float = 0.0  # routed-expert parameters of one block under ep > 1
    states: tuple[float, float, float] = (0.0, 0.0, 0.0)  # bytes per parameter on the device
    moved: float = 0.0  # bytes per parameter moved to the host (offload)
    e_states: tuple[float, float, float] | None = None  # the experts' `states` (ep > 1)
    e_moved: float = 0.0  # the experts' `moved`
    loose: bool = False  # the experts sit outside FSDP2 (MemoryOptions.experts_outside_fsdp)
    # ---- _memory_model: what every pipeline rank holds beside its blocks ----
    grad_extra: float = 0.0  # embedding gradient elements beyond the shard (first stage)
    extra_accum: float = 0.0  # bytes each of those holds over the step (memory_peak.py)
    reduce_bytes: float = 0.0  # previous block's reduce-scatter input beside a backward
    inflight: list[float] = field(default_factory=list)  # micro-batches in flight per rank
    extra_warm: int = 0  # warm-up forwards beyond the schedule's (A2A overlap)
    roots: list[float] = field(default_factory=list)  # root parameters per rank (emb, head)
    root_units: list[float] = field(default_factory=list)  # FSDP2 units outside the blocks
    out_bytes: float = 0.0  # one chunk output held by torch's pipelining
    outputs: list[float] = field(default_factory=list)  # held chunk outputs' bytes per rank
    recv: list[float] = field(default_factory=list)  # torch's receive buffers' bytes per rank
    blocks: list[Block] = field(default_factory=list)  # per rank: its mean block
    cache_b: float = 0.0  # Transformer Engine's cached FP8 bytes per GEMM weight element
    buffers: float = 0.0  # RoPE tables every stage keeps (memory_states.rope_table_bytes)
    not_gemm: float = 0.0  # parameters of a block outside its GEMMs (norms, router)
    per_layer: list[float] = field(default_factory=list)  # per rank: bytes per layer
    fixed: list[float] = field(default_factory=list)  # per rank: fixed bytes
    # per rank: the moment its memory is priced at (memory.MOMENTS; empty: every rank's peak)
    moments: list[str | None] = field(default_factory=list)
    # ---- _split: the layer split ----
    budget: float = 0.0  # tensor bytes a GPU may hold (Evaluator.tensor_budget)
    given: list[int] | None = None  # the plan's own split per rank (given_partition)
    n: list[int] = field(default_factory=list)  # layers per pipeline rank
    fits: bool = False
    # how n was chosen (estimate_results.SplitChoice.by) and, chosen for memory, the rule's
    # split that did not fit, the per-rank caps and the ranks it put over memory
    split_by: str = "rule"
    split_free: tuple[int, ...] = ()
    split_caps: tuple[int, ...] = ()
    split_over: tuple[int, ...] = ()
    # ---- _times, _stage_sync ----
    groups: dict[str, Any] = field(default_factory=dict)  # Evaluator._groups
    stage_t: list[float] = field(default_factory=list)  # per rank: one micro-batch's time
    stage_f: list[float] = field(default_factory=list)  # per rank: its forward part
    host_gpu: float = 0.0  # bytes one GPU keeps in host memory (its fullest stage)
    cutoff: float = float("inf")  # a step above it is dropped: the search's (evaluate)

    @property
    def accumulating(self) -> float:
        """Parameters of one block whose unsharded gradients FSDP2 accumulates over the
        micro-batches (`accum` bytes each): the routed experts too unless they sit outside
        FSDP2 (`loose`: their gradients are their states')."""
        return self.p_layer + (0.0 if self.loose else self.p_exp)

    @property
    def m_run(self) -> int:
        """Micro-batches per schedule call: what a pipeline's fill, drain and in-flight
        activations see (torchtitan and NeMo AutoModel call the schedule `runs` times per step)."""
        return self.m // self.runs
