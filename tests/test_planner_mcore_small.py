"""What Megatron-Core runs around a small model's step that the planner used to leave out
(session 39, branch smallgemm; docs/measurements.md #small-models): DDP's edge bucket (the
last gradient bucket's reduction and the first parameter all-gather, neither overlapped), the
passes over the whole gradient buffer (zeroing every step; Megatron-LM's 1/dp scaling and NaN
check per bucket) and the unfused vocabulary-parallel cross-entropy. Each test fails without
its mechanism. Shapes: the MC24 1.7B row (GPT, h 2048, 24 layers, vocabulary 131,072, tp 1,
dp 48 on 6 DGX-H100 nodes, one micro-batch of 4 x 4096 tokens)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.planner import comm
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import head_cost
from meshtron.planner.dp_cost import mcore_tail_bucket
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import PRESETS
from meshtron.planner.gemm import membound_bytes_per_s
from meshtron.planner.placement import groups_for_cost
from meshtron.planner.plan import Plan
from bench.published.table import gpt_model

MODEL = gpt_model("gpt-1.7b", 24, 2048, 16, vocab=131072, seq=4096, tied=False)
CLUSTER = dataclasses.replace(preset_cluster("dgx-h100", 6), memory_gib=1e6)
PLAN = Plan(1, 1, 48, 1, 4, "none", False, None, 1, dtype="bf16", reduce_dtype="fp32")


def _evaluator(preset: str = "megatron@2024", **opts) -> Evaluator:
    fw = PRESETS[preset]
    return Evaluator(MODEL, CLUSTER, 192, 4096, dataclasses.replace(fw.kernel, **opts),
                     mem=fw.memory)


def test_tail_bucket_walks_parameters_in_reverse():
    """ParamAndGradBuffer closes a bucket once it reaches the size, walking backwards: the last
    bucket is what is left at the front (an exact fill closes it, leaving the previous one)."""
    assert mcore_tail_bucket([5.0, 3.0, 3.0, 3.0], 4.0) == 8.0  # [3+3], then [3+5]
    assert mcore_tail_bucket([1.0, 4.0, 4.0], 4.0) == 1.0  # [4], [4], then [1] left open
    assert mcore_tail_bucket([2.0, 2.0], 4.0) == 4.0  # one exactly full bucket


def test_edge_bucket_is_the_embedding_and_not_hidden():
    """The first stage's last bucket holds the word and position embeddings and what of the
    first layer the previous bucket left; its reduce-scatter (fp32) and all-gather (bf16) are
    exposed whole, so the step's data-parallel time is at least theirs (it was 3.5 ms, all
    of it the hidden part's interference, before the edge bucket was priced)."""
    ev = _evaluator()
    groups = groups_for_cost(PLAN, CLUSTER.gpus_per_node)
    edge = ev.mcore_edge_bucket(groups, MODEL.layers, True, True)
    word = MODEL.vocab * MODEL.hidden
    bucket = max(40e6, 1e6 * 48)
    assert word < edge < word + 4096 * MODEL.hidden + bucket
    fab = comm.Fabric.of(CLUSTER)
    assert groups["dp"].size == 48 and groups["dp"].nodes == 6
    floor = (comm.reduce_scatter(4.0 * edge, groups["dp"], fab)
             + comm.all_gather(2.0 * edge, groups["dp"], fab))
    passes = ev.bucket_passes_s(MODEL.num_params(), 4.0)  # zeroing (the next test)
    assert ev.evaluate(PLAN).time.dp_comm - passes > floor
    # FSDP-style stacks have no such bucket (their units chain instead: dp_cost.unit_chain)
    fsdp = _evaluator("torchtitan@2025")
    assert fsdp.mcore_edge_bucket(groups, MODEL.layers, True, True) == 0.0
    assert fsdp.bucket_passes_s(1e9, 4.0) == 0.0


def test_gradient_buffer_passes():
    """Megatron-Core zeroes its whole fp32 gradient buffer before every step (4 bytes per
    element); Megatron-LM's training loop also scales and NaN-checks each bucket
    (KernelOptions.grad_bucket_passes 3: a read for the norm, a read and a write to scale):
    memory-bound passes over every local fp32 gradient element, at the evaluator's
    memory-bound bandwidth."""
    params = 1e9
    ev = _evaluator()
    assert ev.bucket_passes_s(params, 4.0) == pytest.approx(4.0 * params / ev.hbm)
    scaled = _evaluator(grad_bucket_passes=3)
    assert scaled.bucket_passes_s(params, 4.0) == pytest.approx(16.0 * params / ev.hbm)
    # tp = pp = 1: every GPU's buffer holds every parameter
    step = scaled.evaluate(PLAN).time.dp_comm - ev.evaluate(PLAN).time.dp_comm
    assert step == pytest.approx(12.0 * MODEL.num_params() / ev.hbm, rel=0.02)


def test_unfused_vocab_parallel_loss_moves_52_bytes_per_logit():
    """Megatron-Core's VocabParallelCrossEntropy without --cross-entropy-loss-fusion: 38 bytes
    per logit forward (fp32 cast, max, subtraction, exp, sum, division) and 14 backward
    (multiplication, cast back), against a fused kernel's 6 + 6."""
    cl = CLUSTER.at_dtype("bf16")
    fused = head_cost(MODEL, cl, 1, 4, 4096, False, "fused")
    unfused = head_cost(MODEL, cl, 1, 4, 4096, False, "fused", vocab_parallel_ce=True)
    logits = 4 * 4096 * MODEL.vocab
    extra = (38 + 14 - 12) * logits / membound_bytes_per_s(cl, "fused")
    assert unfused.compute - fused.compute == pytest.approx(extra, rel=1e-6)
    # the step sees it (one micro-batch per step here)
    ev, ce = _evaluator(), _evaluator(vocab_parallel_ce=True)
    assert ce.evaluate(PLAN).step_time_s - ev.evaluate(PLAN).step_time_s == pytest.approx(
        extra, rel=0.02)


def test_later_pipeline_stages_reduce_one_bucket_after_their_backward():
    """Megatron-Core buckets only pipeline rank 0 (bucket_size None on the others): a later
    stage's one bucket is reduced after its own last backward, so it hides behind the i
    stage-backwards rank 0 still runs, not i + 1 (plain buckets start during that backward).
    On a slow network the reduction outlasts either window: the difference is one stage
    backward, less the interference it would have caused, plus the buffer's zeroing."""
    cl = dataclasses.replace(CLUSTER, inter_node_gb_per_s=1.0)
    plan = Plan(1, 2, 24, 1, 1, "none", False, "1f1b", 1, dtype="bf16", reduce_dtype="fp32")
    groups = groups_for_cost(plan, cl.gpus_per_node)
    fw = PRESETS["megatron@2024"]
    mcore = Evaluator(MODEL, cl, 192, 4096, fw.kernel, mem=fw.memory)
    plain = Evaluator(MODEL, cl, 192, 4096, fw.kernel,
                      mem=dataclasses.replace(fw.memory, framework="deepspeed"))
    params, stage_b = 0.8e9, 0.05
    args = (plan, 1, 12, (params, 0.0, 0.0), 8, 0.02, stage_b)

    def exposed(ev: Evaluator) -> float:
        return ev.stage_dp(*args, ev.dp_flags(plan), groups).total

    red = mcore.once_per_step(params, 1, groups, 4.0)[0]
    assert red > 2 * stage_b  # longer than either window
    nccl = mcore.dp_interference(groups)
    zeroing = mcore.bucket_passes_s(params, 4.0)
    assert exposed(mcore) - exposed(plain) == pytest.approx(
        stage_b * (1 - nccl) + zeroing, rel=1e-6)
