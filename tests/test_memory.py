"""The planner's memory model against measurement.

- model states: the planner's exact per-rank bytes (meshtron/planner/memory_ranks.py) equal what
  the runtime measures and writes to memory.json (ParallelEngine.memory_bytes), byte for byte,
  for several layouts, every ZeRO stage and both dtypes, on real gloo ranks;
- activations: the eager saved-tensor list (memory.activation_bytes) equals what autograd
  keeps for one block on CPU (measured with the profiler's allocation records);
- published runs that ran are not rejected for memory, and torchtitan's published peak for an
  eager FSDP2 Llama 3.1 8B is predicted within a stated tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from meshtron.model.spec import ModelSpec, preset
from meshtron.planner import memory
from bench.memory_vs_measured import TORCHTITAN_8B_PEAK_GIB, torchtitan_8b_row
from bench.published.table import gpt_model
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.memory import MemoryOptions, state_bytes
from meshtron.planner.memory_ranks import greedy_owners, param_shapes, predict_ranks, rank_states
from meshtron.planner.plan import Plan


# ---- model states per framework and dtype ------------------------------------------------------
def test_fsdp2_states_are_fp32_master_in_both_dtypes_and_shard_per_zero_stage():
    for dtype in ("fp32", "bf16"):
        mem = MemoryOptions(dtype=dtype, framework="fsdp2")
        assert state_bytes(0, 8, mem=mem) == (4.0, 4.0, 8.0)
        # meshtron's ZeRO-1 is FSDP2 over dp (rehearsed: sharded parameters at rest)
        assert state_bytes(1, 8, mem=mem) == (0.5, 0.5, 1.0)
        # compressed ZeRO-1 / DiLoCo: whole parameters and gradients, states by owner
        assert state_bytes(1, 8, mem=mem, fsdp_zero1=False) == (4.0, 4.0, 1.0)
        assert state_bytes(2, 8, mem=mem) == (0.5, 0.5, 1.0)  # FSDP2 shards params at rest
        assert state_bytes(3, 8, mem=mem) == (0.5, 0.5, 1.0)
    # the compute copy is what differs: bf16 gathers 2 bytes per parameter, fp32 4
    kw = dict(zero=3, dp=8, layers=4, p_layer=100.0, p_root=10.0, largest=50.0)
    # ZeRO-3: at the loss the head's unit and its gradient; in a block's backward the block,
    # the prefetched next one and the block's gradient (memory_peak.py)
    assert memory.gathered_bytes(MemoryOptions(dtype="bf16"), **kw) == 2 * (10 + 10)
    assert memory.gathered_bytes(MemoryOptions(dtype="fp32"), **kw) == 4 * (10 + 10)
    assert memory.backward_gathered_bytes(MemoryOptions(dtype="bf16"), **kw) == 2 * (200 + 100)
    assert memory.backward_gathered_bytes(MemoryOptions(dtype="fp32"), **kw) == 4 * (200 + 100)
    # ZeRO-2 (no reshard after forward) keeps every block gathered
    assert memory.gathered_bytes(MemoryOptions(), **dict(kw, zero=2)) == 2 * (410 + 100)
    # mixed-precision frameworks: 2 + 2 + 12, fp32 runs 4 + 4 + 8
    assert sum(state_bytes(0, 1, mem=MemoryOptions(framework="deepspeed"))) == 16.0
    assert sum(state_bytes(0, 1, mem=MemoryOptions(dtype="fp32", framework="megatron"))) == 16.0


def test_deepspeed_zero3_gathers_at_most_its_live_parameter_cap():
    mem = MemoryOptions(framework="deepspeed")
    big = memory.gathered_bytes(mem, 3, 640, 105, 5.0e9, 1.0e9, 1.68e9)
    # the largest single matrix (1.68e9) must be whole, plus the 5e8 prefetch bucket; the
    # gradient side is the same matrix's gradient
    assert big == 2 * (1.68e9 + 5e8) + 2 * 1.68e9


def _zero3_full_recompute(layers: int, reduce_bytes: float, keep: bool = False):
    """A ZeRO-3 stage with small recomputed blocks (large units, little activation): the peak
    is a block's backward (memory.peak_moment), in bytes."""
    mem = MemoryOptions()
    bd = memory.breakdown(mem, 3, 8, (0.5, 0.5, 1.0), layers, 1e8, 2e7, 5e7, act=1e6,
                          in_flight=1, work=3e8, logits=1e8, capacity=80 * memory.GIB, stage=0,
                          keep_gathered=keep, root_unit=2e7, reduce_bytes=reduce_bytes)
    return bd.allocated * memory.GIB


def test_a_block_backward_runs_beside_the_previous_blocks_reduce_scatter_input():
    """FSDP2 keeps one unit's reduce-scatter input (its gradient in the reduce dtype) until the
    next unit's post-backward (rehearsed: 0.168 GiB of fp32 gradient of the previous block at
    a recomputed block's backward, tests/test_rehearse.py 'full'). The reduce dtype's bytes
    show up per parameter of a block; none with one block (the head's buffer is released
    before the first block's backward) nor under pipelining (reduced after the last
    backward); a block's activations freed before it are not in that moment."""
    p_layer = 1e8
    assert _zero3_full_recompute(4, 4.0) - _zero3_full_recompute(4, 2.0) == pytest.approx(
        2.0 * p_layer)
    assert _zero3_full_recompute(1, 4.0) == _zero3_full_recompute(1, 2.0)
    assert _zero3_full_recompute(4, 4.0, keep=True) == _zero3_full_recompute(4, 2.0, keep=True)
    # the moment of the loss stays the peak where the loss's working set is larger
    mem = MemoryOptions()
    big_loss = [memory.breakdown(mem, 3, 8, (0.5, 0.5, 1.0), 4, 1e8, 2e7, 5e7, 1e6, 1, 3e8,
                                 5e9, 80 * memory.GIB, 0, reduce_bytes=r).allocated
                for r in (2.0, 4.0)]
    assert big_loss[0] == big_loss[1]


def test_tensor_parallel_embedding_accumulates_a_whole_vocabulary_gradient():
    """DTensor's embedding backward returns the vocabulary-parallel weight's gradient whole
    (rehearsed at tp=4: [32000, 2048] fp32 where the shard is [8000, 2048]); accumulated
    unsharded over micro-batches (ZeRO-1) the planner holds tp times the shard, and only on
    the stage with the embedding, only with accumulation."""
    spec = ModelSpec(name="mid", layers=2, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
                     vocab=32000, max_seq=4096)
    assert memory.embedding_grad_extra(spec, 1) == 0.0
    assert memory.embedding_grad_extra(spec, 4) == 32000 * 2048 * 3 / 4
    cluster = preset_cluster("dgx-h100", 1)

    def gathered(tp: int, global_batch: int) -> float:
        ev = Evaluator(spec, cluster, global_batch, 2048, mem=MemoryOptions(fused_norm=False))
        plan = Plan(tp, 1, 8 // tp, 1, 2, "none", True, "1f1b", 1)
        return ev.evaluate(plan, keep_infeasible=True).memory.gathered * memory.GIB

    # one micro-batch (nothing accumulated) against two: the accumulated fp32 gradients are
    # the rank's local parameters plus the embedding's other 3/4
    local = (2 * memory.layer_params_local(spec, 4) + memory.embedding_params_local(spec, 4)
             + memory.head_params_local(spec, 4, 1))
    grown = gathered(4, 8) - gathered(4, 4)
    assert grown == pytest.approx(4.0 * (local + memory.embedding_grad_extra(spec, 4)),
                                  rel=1e-9)


def test_zero0_accumulates_the_embeddings_whole_gradient_over_the_step():
    """ZeRO-0 runs FSDP2 on a size-1 shard axis with gradient sync on the last micro-batch
    only (and torch's pipelining turns it off to the last backward), so FSDP2 accumulates
    the embedding's whole [vocab, hidden] gradient in the reduce dtype from the first
    backward to the step's end (rehearsed, Llama 3 70B tp=8 pp=4 interleaved:8, rank 0: a
    3.91 GiB fp32 gradient at the peak). The states' fp32 gradient is the local shard's
    accumulator: what a second micro-batch adds is the embedding's other (tp - 1)/tp, in
    fp32, on the stage holding it only; one micro-batch without a pipeline adds nothing."""
    spec = ModelSpec(name="mid", layers=4, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
                     vocab=32000, max_seq=4096)
    cluster = preset_cluster("dgx-h100", 1)

    def gathered(pp: int, global_batch: int, stage: int = 0) -> float:
        ev = Evaluator(spec, cluster, global_batch, 2048, mem=MemoryOptions(fused_norm=False))
        plan = Plan(4, pp, 2 // pp, 0, 2, "none", True, "1f1b", 1)
        est = ev.evaluate(plan, keep_infeasible=True, stage=stage)
        return est.memory.gathered * memory.GIB

    extra = 4.0 * memory.embedding_grad_extra(spec, 4)
    assert gathered(1, 8) - gathered(1, 4) == pytest.approx(extra, rel=1e-9)
    # pipelined: accumulated even at one micro-batch per pipeline rank's step
    assert memory.embedding_accum_bytes(MemoryOptions(), 0, 0.0, 4.0, 1, 2, 1) == 4.0
    assert memory.embedding_accum_bytes(MemoryOptions(), 0, 0.0, 4.0, 1, 1, 2) == 0.0
    # no FSDP2 (fp32 at one shard): the gradient is sharded after every backward
    assert memory.embedding_accum_bytes(MemoryOptions(dtype="fp32"), 0, 0.0, 4.0, 4, 2,
                                        1) == 0.0


def test_pipeline_chunk_outputs_held_at_the_peak():
    """torch's pipelining keeps every in-flight chunk's output until its backward
    (memory_pipeline.held_outputs): a 1F1B stage that sends holds its warm-up micro-batches'
    outputs and the received gradient, the last stage none (its output is the logits); under
    interleaving the walk counts those alive at the moment the rank's memory peaks, which with
    16 micro-batches on 16 stages and large accumulated gradients comes late: far fewer than
    every chunk-micro-batch of the even spread (Llama 3 405B rank 0: the planner read -2.8%
    of the rehearsal without the outputs, -1.0% with the walk's, +7.5% with the spread's)."""
    from meshtron.planner import pipeline
    from meshtron.planner.memory_pipeline import held_outputs, peak_outputs

    even = [pipeline.in_flight("1f1b", 4, 1, 8, s) for s in range(4)]
    assert held_outputs(4, 1, even) == [5.0, 4.0, 3.0, 0.0]
    assert held_outputs(1, 1, [1.0]) == [0.0]
    layers = [2, 2, 1, 1, 1, 1]
    alone = peak_outputs(16, 6, 16, 0, layers, act=1.0, grad=0.0, out=1e-9)
    late = peak_outputs(16, 6, 16, 0, layers, act=1.0, grad=100.0, out=1e-9)
    assert alone == 16 * 6 + 1  # no steady phase: every forward, then a received gradient
    assert 0 < late < alone
    # the last rank's last chunk (the last virtual stage) sends nothing
    assert peak_outputs(16, 6, 16, 15, [1] * 6, 1.0, 0.0, 1e-9) <= 16 * 5 + 1


def test_interleaved_chunks_hold_micro_batches_by_their_own_layers():
    """planner/memory_pipeline.py walks torch's interleaved 1F1B order: with equal chunks it
    holds exactly pipeline.in_flight's warm-up + 1 chunk-micro-batches; with the first chunks
    heavier (Llama 3 405B, pp=16, v=6, 32 micro-batches, pipeline rank 5: 2, 2, 1, 1, 1, 1
    layers) the steady phase's next-round forwards on those chunks make 165 layer-micro-
    batches, not the even spread's 135 (rehearsed: the planner read 17.5% under before)."""
    from meshtron.planner import pipeline
    from meshtron.planner.memory_pipeline import held_layer_microbatches, weighted_in_flight

    for p, v, m in ((16, 6, 32), (4, 2, 12), (2, 2, 12), (16, 6, 16)):
        for s in range(p):
            even = pipeline.in_flight("interleaved", p, v, m, s)
            assert held_layer_microbatches(p, v, m, s, [1] * v) == pytest.approx(even * v)
    assert held_layer_microbatches(16, 6, 32, 5, [2, 2, 1, 1, 1, 1]) == 165
    chunks = [1] * 96
    for c in (0, 1):
        chunks[c * 16 + 5] = 2
    even = [pipeline.in_flight("interleaved", 16, 6, 32, s) for s in range(16)]
    weighted = weighted_in_flight(16, 6, 32, chunks, even)
    assert weighted[5] == pytest.approx(165 / 8) and weighted[5] > even[5]
    assert weighted[4] == even[4]  # equal chunks: the even spread
    # with accumulated gradients far larger than a layer's activations, and 16 micro-batches
    # on 16 stages (no steady phase: every forward first), the peak is the last chunk's
    # first backward: every gradient accumulated, one chunk's 16 micro-batches left
    # (rehearsed, Llama 3 405B pipeline rank 1: the planner read +10.4% holding both at most)
    even16 = [pipeline.in_flight("interleaved", 16, 6, 16, s) for s in range(16)]
    low = weighted_in_flight(16, 6, 16, [1] * 96, even16, act=1.0, grad=100.0)
    assert even16[1] == 16 and low[1] == pytest.approx(16 / 6)


# ---- activations: the eager list against autograd ----------------------------------------------
def _measured_block_bytes(spec: ModelSpec, dtype: str, recompute: str, batch: int,
                          seq: int) -> int:
    """Bytes a block keeps after its forward (output excluded), from the profiler's records."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from meshtron.model.transformer import Block, rope_cache
    from meshtron.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": Block(spec)})
    holder.to(tdtype)
    apply_recompute(holder, recompute)
    rope = rope_cache(spec) if spec.position == "rope" else None
    base = torch.randn(batch, seq, spec.hidden, dtype=tdtype, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = base * 1.0  # the block's input, as the previous block's output
        y = holder.layers["0"](x, rope)
        del x
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    return kept - y.numel() * y.element_size()


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eager_activation_list_matches_autograd(name, dtype):
    spec = preset(name)
    # PyTorch's CPU rms_norm is composite; meshtron's attention is SDPA's native GQA
    mem = MemoryOptions(dtype=dtype, fused_norm=False)
    for rec in ("none", "selective", "full"):
        measured = _measured_block_bytes(spec, dtype, rec, 2, 64)
        predicted = memory.activation_bytes(spec, 1, False, 2, 64, rec, KernelOptions(), mem)
        # within 0.2% (CPU LayerNorm keeps bf16 statistics where CUDA keeps fp32)
        assert measured == pytest.approx(predicted, rel=2e-3), (name, dtype, rec)


# ---- exact per-rank states: the structure the planner counts is the runtime's ------------------
@pytest.mark.parametrize("fields", [{}, dict(position="learned", norm="layernorm", bias=True,
                                          mlp="gelu", tied_embeddings=True, kv_heads=8),
                                    dict(qkv_bias=True)])
def test_param_shapes_follow_the_module(fields):
    import torch

    from meshtron.model import Transformer

    spec = preset("tiny").replace(**fields)
    with torch.device("meta"):
        model = Transformer(spec)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert param_shapes(spec, range(spec.layers), True, True) == real


def test_greedy_owners_is_the_runtimes_partition():
    import random

    import torch

    from meshtron.parallel.data_parallel import _partition

    rng = random.Random(0)
    for n in (2, 3, 4):
        numels = [rng.choice([64, 64, 128, 259, 1000, 1000, 4096]) for _ in range(30)]
        tensors = [torch.empty(k, device="meta") for k in numels]
        assert greedy_owners(numels, n) == _partition(tensors, n)


LAYOUTS = [  # 4 ranks: every ZeRO stage, both dtypes, tp / pp / interleaving / uneven splits
    dict(tp=2, pp=1, dp=2, zero=1, sp=True, dtype="fp32"),
    dict(tp=1, pp=1, dp=4, zero=3, dtype="bf16"),
    dict(tp=1, pp=2, dp=2, zero=2, dtype="fp32", schedule="1f1b", stage_layers=[1, 3]),
    dict(tp=2, pp=2, dp=1, zero=0, dtype="bf16", schedule="gpipe"),
    dict(tp=1, pp=2, dp=2, zero=1, dtype="bf16", schedule="interleaved", virtual_stages=2,
         stage_layers=[1, 1, 1, 1]),
    dict(tp=1, pp=1, dp=4, zero=1, dtype="fp32", model="tiny-gpt"),
    dict(tp=1, pp=1, dp=4, zero=2, dtype="fp32"),  # forward-only eval must not keep gathers
]


def _plan(layout: dict) -> Plan:
    pp, v = layout["pp"], layout.get("virtual_stages", 1)
    stage_layers = layout.get("stage_layers") or [4 // (pp * v)] * (pp * v)
    return Plan(model=layout.get("model", "tiny"), cluster="test", global_batch=8,
                seq_len=32, tp=layout["tp"], pp=pp, dp=layout["dp"], zero=layout["zero"],
                micro_batch=2 if pp > 1 else 8 // layout["dp"], recompute="none",
                sp=layout.get("sp", False), schedule=layout.get("schedule"),
                virtual_stages=v, stage_layers=stage_layers, dtype=layout["dtype"])


def measure_states_rank_fn(layouts: list[dict]) -> list[dict]:
    """Per rank (under run_on_ranks): one training step and one evaluation of each layout with
    the runtime's own engine, then the bytes it reports for memory.json."""
    import torch
    import torch.distributed as dist

    from meshtron.config import config_from_dict
    from meshtron.train.parallel import ParallelEngine

    out = []
    for layout in layouts:
        plan = _plan(layout)
        cfg = config_from_dict({"model": plan.model, "data": {"seq_len": 32, "global_batch": 8},
                                "train": {"dtype": layout["dtype"], "steps": 1}})
        engine = ParallelEngine(cfg, plan, torch.device("cpu"))
        rows = 8 // plan.dp
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab, (8, 33), generator=g)
        r = engine.dp_rank
        x, y = tokens[r * rows:(r + 1) * rows, :-1], tokens[r * rows:(r + 1) * rows, 1:]
        engine.train_step(x, y)
        engine.evaluate([(x, y)])  # as a run ends: evaluation at the last step, then memory.json
        out.append(engine.memory_bytes())
        del engine
        dist.barrier()
    return out


def test_planner_states_equal_the_runtimes_bytes_on_every_rank():
    from testkit.multiproc import run_on_ranks

    measured = run_on_ranks(measure_states_rank_fn, 4, LAYOUTS, timeout=600)
    for i, layout in enumerate(LAYOUTS):
        plan = _plan(layout)
        predicted = rank_states(preset(plan.model), plan, layout["dtype"])
        for rank in range(4):
            got = {k: measured[rank][i][k] for k in ("params", "grads", "optimizer")}
            want = {k: getattr(predicted[rank], k) for k in ("params", "grads", "optimizer")}
            assert got == want, (layout, rank)


@pytest.mark.slow  # suite time (session 51): a path two default tests cover
def test_memory_json_of_a_real_run_matches_the_planner(tmp_path):
    """`meshtron train --nproc 4` end to end: its memory.json against the planner's breakdown.

    default coverage:
    tests/test_train_launch.py::test_two_ranks_through_the_cli_match_single_process
    (memory.json of a `meshtron train --nproc 2` run: the planner's per-rank states equal
    the measured bytes exactly) and
    tests/test_memory.py::test_planner_states_equal_the_runtimes_bytes_on_every_rank (this
    layout, tp=2 pp=2 dp=1 ZeRO-0 bf16, on every rank: the bytes memory.json writes)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "meshtron", "train", "--nproc", "4", "--plan",
           "tp=2,pp=2,dp=1", "--zero", "0", "--micro-batch", "2", "--schedule", "1f1b",
           "--model", "tiny", "--steps", "1", "--global-batch", "4", "--seq-len", "32",
           "--dtype", "bf16", "--run-dir", str(run_dir)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    measured = json.loads((run_dir / "memory.json").read_text())["measured_bytes_per_rank"]
    plan = Plan.from_toml((run_dir / "plan.toml").read_text())
    predicted = predict_ranks(preset("tiny"), plan, "bf16", 4.0)
    for rank, (state, bd) in enumerate(predicted):
        for k in ("params", "grads", "optimizer"):
            assert measured[rank][k] == getattr(state, k), (rank, k)
            assert getattr(bd, k) * memory.GIB == pytest.approx(measured[rank][k], abs=0.5)


def test_predict_ranks_is_the_planners_evaluation_of_each_pipeline_rank():
    """memory_ranks.predict_ranks reports, per rank, what Evaluator.evaluate(stage=...) gives for
    the rank's pipeline stage (one description of a rank's memory): every moment of the peak
    and the gradients accumulated over a step's micro-batches (meshtron's ZeRO-1 keeps them
    unsharded, in `gathered`, until the last micro-batch's reduction), with the exact bytes of
    the states the planner holds at the peak."""
    from meshtron.planner.cluster import preset_cluster as _cluster

    spec = preset("tiny")
    cluster = dataclasses.replace(_cluster("dgx-h100", 1), memory_gib=4.0)
    for knobs in (dict(tp=1, pp=1, dp=4, zero=1, global_batch=32),
                  dict(tp=2, pp=2, dp=1, zero=0, global_batch=8, schedule="1f1b",
                       stage_layers=(1, 1))):
        plan = Plan.from_dict(dict(knobs, model="tiny", micro_batch=2, seq_len=64,
                                   dtype="bf16", recompute="none", sp=False))
        ev = Evaluator(spec, cluster, plan.global_batch, plan.seq_len, KernelOptions(),
                       mem=MemoryOptions(dtype="bf16", framework="fsdp2"))
        for state, bd in predict_ranks(spec, plan, "bf16", 4.0):
            pp_rank = state.rank // (plan.tp * plan.dp) if plan.pp > 1 else 0
            want = ev.evaluate(plan, stage=pp_rank).memory
            for k in ("gathered", "activations", "in_flight", "recompute", "logits"):
                assert getattr(bd, k) == getattr(want, k), (knobs, state.rank, k)
            for k in ("params", "optimizer"):
                assert getattr(bd, k) * memory.GIB == getattr(state, k)
    # 4 micro-batches at ZeRO-1: the accumulated gradients (4 bytes per local parameter,
    # unsharded) replace the sharded gradients at the peak
    one = Plan.from_dict(dict(model="tiny", tp=1, pp=1, dp=4, zero=1, micro_batch=2,
                              global_batch=8, seq_len=64, dtype="bf16", recompute="none"))
    four = dataclasses.replace(one, global_batch=32)
    (s1, b1), (s4, b4) = predict_ranks(spec, one, "bf16", 4.0)[0], \
        predict_ranks(spec, four, "bf16", 4.0)[0]
    assert b1.grads * memory.GIB == s1.grads and b4.grads == 0.0
    # one micro-batch is priced at its own moment (estimate_gpipe.py: each unit resharded
    # after its backward), which holds fewer compute copies than m 4's: the difference is the
    # accumulator (4 bytes per local parameter) and at most every compute copy (2 bytes a
    # parameter, `params` holding 4 / dp bytes of each)
    more = (b4.gathered - b1.gathered) * memory.GIB - 4 * s1.params
    assert 0.0 <= more <= 2 * s1.params * one.dp / 4


# ---- published runs that ran must fit ----------------------------------------------------------
def _fits(ev: Evaluator, *knobs):
    est = ev.evaluate(Plan.trusted(*knobs, dtype="bf16"))
    return est.fits, est


def test_llama3_405b_published_layout_fits_on_80gb_h100():
    """Llama Team 2024, section 3.3: tp8 cp1 pp16 dp64 (8,192 H100 80GB), sequence 8192,
    micro-batch 1, FSDP sharding optimizer states and gradients but not the weights after
    forward (ZeRO-2), fp32 gradient accumulation and reduce-scatter, no recomputation."""
    ev = Evaluator(preset("llama3-405b"), preset_cluster("dgx-h100", 1024), 2048, 8192,
                   KernelOptions(fp32_grad_reduce=True), mem=MemoryOptions(framework="megatron"))
    fits, est = _fits(ev, 8, 16, 64, 2, 1, "none", True, "1f1b")
    assert fits, est.memory.to_dict()
    assert est.memory.total <= 80


def test_530b_zero3_on_640_a100_fits():
    """Narayanan et al. 2021, section 5.9 / Table 2: the 530B GPT with DeepSpeed ZeRO-3 and no
    model parallelism on 640 A100 80GB, global batch 2560, micro-batch 4, sequence 2048,
    activation recomputation (DeepSpeed's defaults for live and prefetched parameters)."""
    model = gpt_model("gpt-530B", 105, 20480, 128, tied=False)
    ev = Evaluator(model, preset_cluster("dgx-a100", 80), 2560, 2048,
                   KernelOptions(attention="unfused", dropout=True),
                   mem=MemoryOptions(framework="deepspeed"))
    fits, est = _fits(ev, 1, 1, 640, 3, 4, "full", False, None)
    assert fits, est.memory.to_dict()


def test_torchtitan_8b_fsdp_fits_and_its_peak_is_predicted_within_10_percent():
    """The row bench/memory_vs_measured.py prints (one definition, so the two cannot drift):
    FSDP2 with bf16 params / fp32 reduce, per-block units; the selective "op" policy saves
    every other matmul output and the SDPA output (parallelize_llama.py). Its loss was the
    eager one, so the published peak is 55.9 GiB when meshtron's chunked loss is priced in
    its place (the 2026-12-04 regression of this row)."""
    ev, plan = torchtitan_8b_row()
    est = ev.evaluate(plan)
    assert est.fits, est.memory.to_dict()
    assert est.memory.total == pytest.approx(TORCHTITAN_8B_PEAK_GIB, rel=0.10)


def test_torchtitan_8b_row_prices_torchtitan_s_loss_and_saved_list():
    """Exact inputs: the command line's torchtitan preset's memory layout (not meshtron's
    defaults), and the eager loss's whole fp32 logits: 12 bytes per element of the local
    batch's 2 x 8192 tokens x 128256 vocabulary (log_softmax's saved output, the incoming
    gradient and its input gradient, memory_acts.py)."""
    from meshtron.planner import frameworks

    ev, plan = torchtitan_8b_row()
    tt = frameworks.preset("torchtitan").memory
    for field in ("framework", "activations", "loss", "gqa_copies"):
        assert getattr(ev.mem, field) == getattr(tt, field), field
    m = ev.evaluate(plan).memory
    assert m.logits * 2**30 == pytest.approx(12 * 2 * 8192 * ev.model.vocab, rel=1e-9)


def _two_blocks(spec: ModelSpec, recompute: str):
    import torch
    from torch import nn

    from meshtron.model.transformer import Block
    from meshtron.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({str(i): Block(spec) for i in range(2)})
    return apply_recompute(holder, recompute)


def test_half_recompute_checkpoints_every_second_block_and_keeps_the_mean():
    """'half' (torchtitan's selective_ac_option = "2") wraps the 2nd, 4th, ... block only; two
    blocks keep what one unwrapped and one fully recomputed block keep (2 x the planner's 'half'
    figure, measured with the profiler), and the gradients equal those without recomputation."""
    import torch

    from meshtron.model.transformer import rope_cache

    spec = preset("tiny")
    half = _two_blocks(spec, "half")
    wrapped = ["_checkpoint_wrapped_module" in dict(b.named_children()) for b in
               half.layers.values()]
    assert wrapped == [False, True]
    mem = MemoryOptions(dtype="fp32", fused_norm=False)
    predicted = 2 * memory.activation_bytes(spec, 1, False, 2, 64, "half", KernelOptions(), mem)
    assert predicted == pytest.approx(sum(memory.activation_bytes(
        spec, 1, False, 2, 64, r, KernelOptions(), mem) for r in ("none", "full")))
    measured = sum(_measured_block_bytes(spec, "fp32", r, 2, 64) for r in ("none", "full"))
    assert measured == pytest.approx(predicted, rel=2e-3)
    rope = rope_cache(spec)
    grads = []
    for rec in ("none", "half"):
        model = _two_blocks(spec, rec)
        torch.manual_seed(1)
        x = torch.randn(2, 64, spec.hidden, requires_grad=True)
        y = x
        for block in model.layers.values():
            y = block(y, rope)
        y.square().mean().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
