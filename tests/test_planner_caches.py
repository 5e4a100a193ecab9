"""The planner's process-wide memo caches never hand one question's answer to another.

estimate.py, compute.py, compute_edges.py and moe_cost.py memoise pure pieces of the cost model with
functools.lru_cache across Evaluators (the searches of one command build several: offload,
knob alternatives, a pinned layout's fits). A key that misses an input the piece reads (the
dtype, an attention or stack option, the cluster, the model) would return the answer of an
earlier evaluation in the same process. So: evaluate a set of questions that differ one input
at a time, in order, with the caches warm from each other; then each again alone, every cache
cleared first; the answers must be identical, field by field."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil

import pytest

import meshtron.planner as planner_pkg
from meshtron.model.spec import preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner import memory
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan


def _process_caches() -> list:
    """Every lru_cache'd function defined in a torch-free meshtron.planner module."""
    out = []
    for info in pkgutil.iter_modules(planner_pkg.__path__):
        mod = importlib.import_module(f"meshtron.planner.{info.name}")
        for obj in vars(mod).values():
            if (hasattr(obj, "cache_clear") and isinstance(obj, functools._lru_cache_wrapper)
                    and getattr(obj, "__module__", None) == mod.__name__):
                out.append(obj)
    return out


def _questions() -> list[tuple[str, tuple]]:
    """(label, (model, cluster, seq, opts, plan, global batch, memory options)): a base
    question and its one-input variants, each variant changing what at least one memoised
    piece reads (every KernelOptions field layer_cost or the data-parallel and pipeline costs
    read, and MemoryOptions.gqa_copies, which layer_cost takes as its own argument)."""
    dense = preset("llama3-8b")
    moe = preset("tiny-moe")
    h100, a100 = preset_cluster("dgx-h100", 2), preset_cluster("dgx-a100", 2)
    # interleaved under FSDP2 (the memory walks), selective recomputation (the recompute
    # FLOPs), tensor parallelism (layer and head costs)
    plan = Plan(tp=2, pp=2, dp=4, zero=1, micro_batch=1, recompute="selective", sp=True,
                schedule="interleaved", virtual_stages=2, dtype="bf16")
    base = (dense, h100, 4096, KernelOptions(), plan, 256, None)
    # four micro-batches on four stages: the walk's peak moment moves with the activations
    deep = plan.replace(pp=4, dp=2)

    def vary(**kw):
        q = dict(zip(("model", "cluster", "seq", "opts", "plan", "batch", "mem"), base))
        q.update(kw)
        return (q["model"], q["cluster"], q["seq"], q["opts"], q["plan"], q["batch"], q["mem"])

    # without sequence parallelism: the pipeline hop re-gathers the split activation
    # (p2p_grads_whole prices it) and a parallel-residual block all-reduces its branches
    nosp = plan.replace(sp=False)
    parallel = dataclasses.replace(dense, parallel_residual=True)
    cp2 = plan.replace(cp=2, dp=2)
    ds_plan = plan.replace(zero=3, pp=1, dp=8, schedule=None, virtual_stages=1)
    ds_opts = KernelOptions(sharding="zero", shard_units_per_layer=4, prefetch_params=5e7)

    return [
        ("base", base),
        ("fp8", vary(plan=plan.replace(dtype="fp8"))),
        ("fp8, fast accumulation everywhere",
         vary(plan=plan.replace(dtype="fp8"), opts=KernelOptions(fp8_split_accum_bwd=False))),
        ("fp32", vary(plan=plan.replace(dtype="fp32", reduce_dtype="fp32"))),
        ("unfused attention", vary(opts=KernelOptions(attention="unfused"))),
        ("compiled stack", vary(opts=KernelOptions(stack="compiled"))),
        ("A100", vary(cluster=a100)),
        ("older NCCL", vary(cluster=dataclasses.replace(h100, inter_node_latency_us=9.6,
                                                        intra_node_latency_us=5.0))),
        ("seq 2048", vary(seq=2048)),
        ("tied embeddings", vary(model=dataclasses.replace(dense, tied_embeddings=True))),
        ("wider vocabulary", vary(model=dataclasses.replace(dense, vocab=dense.vocab * 2))),
        ("full recompute", vary(plan=plan.replace(recompute="full", sp=False))),
        ("full recompute, sp", vary(plan=plan.replace(recompute="full"))),
        ("no recompute", vary(plan=plan.replace(recompute="none"))),
        ("deep", vary(plan=deep, batch=8)),
        ("deep, full recompute", vary(plan=deep.replace(recompute="full"), batch=8)),
        ("deep, no recompute", vary(plan=deep.replace(recompute="none"), batch=8)),
        ("micro-batch 2", vary(plan=plan.replace(micro_batch=2))),
        ("zero 3", vary(plan=plan.replace(zero=3))),
        # DeepSpeed's per-submodule ZeRO-3: a live-parameter limit below the unit (2.7e7
        # elements per tensor rank) blocks the prefetch that the same stack has without it
        ("zero 3, deepspeed prefetch", vary(plan=ds_plan, opts=ds_opts)),
        ("zero 3, live-parameter limit",
         vary(plan=ds_plan, opts=dataclasses.replace(ds_opts, max_live_params=1e7))),
        ("moe", vary(model=moe, plan=Plan(tp=1, pp=2, dp=8, zero=1, micro_batch=1,
                                          recompute="selective", sp=False,
                                          schedule="interleaved", virtual_stages=2, ep=2,
                                          dtype="bf16"))),
        ("moe unfused", vary(model=moe, opts=KernelOptions(attention="unfused"),
                             plan=Plan(tp=1, pp=2, dp=8, zero=1, micro_batch=1,
                                       recompute="selective", sp=False,
                                       schedule="interleaved", virtual_stages=2, ep=2,
                                       dtype="bf16"))),
        # the stack facts of the Megatron-DeepSpeed rows and torchtitan's attention code
        ("zero-1 all-reduce", vary(opts=KernelOptions(zero1_all_reduce=True))),
        ("no sp", vary(plan=nosp)),
        ("no sp, gradients sent whole", vary(plan=nosp,
                                             opts=KernelOptions(p2p_grads_whole=True))),
        ("launch blocking", vary(opts=KernelOptions(launch_blocking=True))),
        # the optimizer step's clipping passes (estimate_stage.py optimizer_bytes)
        ("no clipping", vary(opts=KernelOptions(grad_clip=False))),
        ("flash kernel on mma.sync", vary(opts=KernelOptions(flash_isa="sm80"))),
        ("unfused, bias copy", vary(opts=KernelOptions(attention="unfused",
                                                       score_bias_copy=True))),
        ("parallel residual", vary(model=parallel, plan=nosp)),
        ("parallel residual reduced once", vary(model=parallel, plan=nosp,
                                                opts=KernelOptions(residual_reduce_once=True))),
        ("compiled, complex RoPE", vary(opts=KernelOptions(stack="compiled",
                                                           complex_rope=True))),
        ("cp 2", vary(plan=cp2)),
        ("cp 2, torch ring", vary(plan=cp2, opts=KernelOptions(torch_ring=True))),
        ("K/V repeated", vary(mem=dataclasses.replace(memory.options_for(KernelOptions()),
                                                      gqa_copies=True))),
        ("cp 2, torch ring, K/V repeated",
         vary(plan=cp2, opts=KernelOptions(torch_ring=True),
              mem=dataclasses.replace(memory.options_for(KernelOptions(torch_ring=True)),
                                      gqa_copies=True))),
    ]


def _answer(model, cluster, seq, opts, plan, batch, mem=None):
    """The estimate, with every pipeline stage's memory (not only the fullest one's)."""
    ev = Evaluator(model, cluster, batch, seq, opts, mem=mem)
    est = ev.evaluate(plan)
    assert est is not None
    stages = tuple(ev.evaluate(plan, stage=s).memory for s in range(plan.pp))
    return (est.time, est.memory, stages, tuple(est.stage_layers), est.hfu, est.fits)


def test_the_planner_has_process_wide_caches_to_check():
    names = {f.__name__ for f in _process_caches()}
    # the memoised pieces of estimate.py, estimate_moments.py, compute.py and
    # compute_edges.py: if they move, this test must follow
    assert {"_weighted_in_flight", "_peak_outputs", "_recompute_flops",
            "layer_cost", "head_cost", "_last_rank_moments"} <= names


def test_warm_caches_answer_as_cold_ones():
    caches = _process_caches()
    questions = _questions()
    for f in caches:
        f.cache_clear()
    warm = [(label, _answer(*q)) for label, q in questions]
    # the variants must differ from the base, or they test no key; each new stack option
    # from the one question it adds to (the pairs below)
    assert all(ans != warm[0][1] for _, ans in warm[1:])
    by = dict(warm)
    for plain, varied in (("no sp", "no sp, gradients sent whole"),
                          ("unfused attention", "unfused, bias copy"),
                          ("parallel residual", "parallel residual reduced once"),
                          ("compiled stack", "compiled, complex RoPE"),
                          ("cp 2", "cp 2, torch ring"),
                          ("cp 2, torch ring", "cp 2, torch ring, K/V repeated")):
        assert by[plain] != by[varied], f"{varied}: answered as {plain}"
    for (label, q), (_, hot) in zip(questions, warm):
        for f in caches:
            f.cache_clear()
        assert _answer(*q) == hot, f"{label}: a warm process-wide cache changed the answer"


@pytest.mark.parametrize("base,label", [("base", "unfused attention"),
                                        ("base", "full recompute"), ("base", "micro-batch 2"),
                                        ("deep", "deep, full recompute"),
                                        ("base", "K/V repeated"),
                                        ("base", "no clipping"),
                                        ("unfused attention", "unfused, bias copy"),
                                        ("cp 2", "cp 2, torch ring"),
                                        ("parallel residual",
                                         "parallel residual reduced once")])
def test_each_variant_is_answered_alone_as_after_the_others(base, label):
    """Reverse order too: the base after the variant (a key that drops the varied input would
    hand the variant's value back to the base)."""
    caches = _process_caches()
    q = dict(_questions())
    for f in caches:
        f.cache_clear()
    _answer(*q[label])
    after_variant = _answer(*q[base])
    for f in caches:
        f.cache_clear()
    assert after_variant == _answer(*q[base])


def test_one_evaluators_own_cache_answers_each_plan_as_a_fresh_one():
    """The Evaluator's per-instance cache (`_cache`: micro costs, memory pieces, groups,
    splits, data-parallel times) is keyed by plan fields; the search asks one Evaluator
    thousands of plans. Plans that differ one field at a time, asked in a row, must each get a
    fresh Evaluator's answer."""
    model, cluster = preset("llama3-8b"), preset_cluster("dgx-h100", 2)
    base = Plan(tp=2, pp=2, dp=4, zero=1, micro_batch=1, recompute="selective", sp=True,
                schedule="interleaved", virtual_stages=2, dtype="bf16")
    plans = [base, base.replace(dtype="fp8"), base.replace(dtype="fp8", fp8_recipe="tensorwise"),
             base.replace(reduce_dtype="bf16"), base.replace(zero=2),
             base.replace(zero=3, accumulate_unsharded=True), base.replace(zero=3),
             base.replace(zero=3, dp_replicate=2), base.replace(schedule="1f1b", virtual_stages=1),
             base.replace(schedule="gpipe"), base.replace(virtual_stages=4),
             # GPipe priced at its moments (estimate_gpipe.py), the embedding's apart at tp 2
             base.replace(schedule="gpipe", virtual_stages=1),
             base.replace(schedule="gpipe", virtual_stages=1, recompute="half"),
             # looped BFS at the walk of its order (estimate_gpipe._looped_rank)
             base.replace(schedule="gpipe", recompute="half"),
             base.replace(schedule="gpipe", zero=0), base.replace(schedule="gpipe", zero=3),
             base.replace(sp=False), base.replace(recompute="full"),
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8),
             base.replace(tp=1, dp=8, sp=False), base.replace(micro_batch=2),
             base.replace(zero=3, offload="full"), base.replace(compile=True),
             # one micro-batch per step without a pipeline: GPipe's moments (ZeRO-0), then two
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8, zero=0, micro_batch=32),
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8, zero=0, micro_batch=16),
             # ... under ZeRO-1 and ZeRO-3 (sharded gradients made per unit), full recomputation
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8, zero=1, micro_batch=32),
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8, zero=3, micro_batch=32),
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8, zero=1, micro_batch=32,
                          recompute="full"),
             base.replace(pp=1, schedule=None, virtual_stages=1, dp=8, zero=3, micro_batch=16)]
    shared = Evaluator(model, cluster, 256, 4096)
    for plan in plans:
        warm = shared.evaluate(plan)
        cold = Evaluator(model, cluster, 256, 4096).evaluate(plan)
        assert warm is not None and cold is not None
        assert (warm.time, warm.memory, warm.stage_layers, warm.fits) == \
            (cold.time, cold.memory, cold.stage_layers, cold.fits), plan.knobs()


def test_stage_memory_memo_is_keyed_by_every_argument():
    """memory.stage_memory memoises the terms of its arguments other than in_flight, outputs
    and weight_cache (`_stage_parts`, a search's ~90k calls for ~5k keys). Each argument varied
    alone, right after the base warmed the memo, must be answered as with the memo cleared;
    and each must change the answer in at least one of the regimes below (else this check
    could not fail for it)."""
    fsdp = memory.MemoryOptions(framework="fsdp2")
    base = dict(mem=fsdp, zero=1, dp=8, states=(2.0, 4.0, 8.0), p_layer=3e8, p_root=5e8,
                largest=2e8, act=7e8, in_flight=3.0, work=9e8, logits=11e8, grad_bytes=4.0,
                keep_gathered=False, accum=2.0, p_expert=1e8, expert_states=(1.0, 2.0, 4.0),
                root_unit=4e8, reduce_bytes=4.0, grad_extra=6e8, outputs=5e7,
                weight_cache=3e7, extra_accum=None, moment=None, p_loose=0.0)
    regimes = [base, dict(base, zero=3), dict(base, zero=3, keep_gathered=True),
               dict(base, mem=memory.MemoryOptions(framework="deepspeed"), zero=3),
               dict(base, work=0.0, logits=0.0)]
    varied = dict(mem=memory.MemoryOptions(framework="fsdp2", dtype="fp32"), zero=2, dp=1,
                  states=(2.0, 4.0, 9.0), p_layer=3.5e8, p_root=6e8, largest=9e9, act=8e8,
                  in_flight=4.0, work=1.3e9, logits=12e8, grad_bytes=2.0,
                  keep_gathered=True, accum=4.0, p_expert=2e8, expert_states=(1.0, 2.0, 5.0),
                  root_unit=2e9, reduce_bytes=2.0, grad_extra=7e8, outputs=6e7,
                  weight_cache=4e7, extra_accum=4.0, moment="loss", p_loose=3e8)
    assert set(varied) == set(inspect.signature(memory.stage_memory).parameters)
    moved = set()
    for regime in regimes:
        for name, value in varied.items():
            question = dict(regime, **{name: value})
            memory.stage_memory(**regime)  # warm the memo with the regime's own key
            warm = memory.stage_memory(**question)
            memory._stage_parts.cache_clear()
            assert warm == memory.stage_memory(**question), f"{name}: the memo missed it"
            if warm != memory.stage_memory(**regime):
                moved.add(name)
    assert moved == set(varied), f"never changed the answer: {set(varied) - moved}"
    # every moment of a warm key is answered as a cold one's (GPipe's embedding moment too)
    # (a small embedding gradient: its moment below the block's, which then differs)
    small = dict(base, grad_extra=1e7)
    answers = {}
    for moment in memory.MOMENTS:
        memory.stage_memory(**small)
        warm = memory.stage_memory(**dict(small, moment=moment))
        memory._stage_parts.cache_clear()
        assert warm == memory.stage_memory(**dict(small, moment=moment)), moment
        answers[moment] = warm
    assert len({answers[m] for m in ("loss", "block", "embedding")}) == 3, answers
