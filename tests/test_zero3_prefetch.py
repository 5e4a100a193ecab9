"""DeepSpeed ZeRO-3's parameter prefetch as its code runs it (planner/dp_cost.py
`_prefetch_share`, KernelOptions.prefetch_params / max_live_params / list_collectives): the
coordinator prefetches the next weight beside the current submodule's compute unless it already
holds `stage3_max_live_parameters` gathered elements; the host's per-rank list handling and the
fetch's norm read stay on the critical path whatever the prefetch hides."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.dp_cost import LIST_HOST_S_PER_RANK
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import PRESETS
from meshtron.planner.plan import Plan
from bench.published.table import gpt_model

GPT175 = ("gpt-175B", 96, 12288, 96)
GPT530 = ("gpt-530B", 105, 20480, 128)
# DeepSpeed 0.3's GPT layer as the deepspeed@2021 preset describes it, without the list
# collectives unless a test adds them
DS = KernelOptions(attention="unfused", dropout=True, stack="fused", sharding="zero",
                   shard_units_per_layer=4, overlap_grad_reduce=False)


def _evaluator(shape: tuple, gpus: int, opts: KernelOptions, mb: int) -> Evaluator:
    cl = dataclasses.replace(resolve_cluster(f"dgx-a100:{gpus // 8}"), memory_gib=1e6)
    return Evaluator(gpt_model(*shape), cl, gpus * mb, 2048, opts)


def _dp(shape: tuple, gpus: int, opts: KernelOptions, mb: int = 1,
        recompute: str = "full", reduce_dtype: str = "bf16") -> float:
    ev = _evaluator(shape, gpus, opts, mb)
    plan = Plan(1, 1, gpus, 3, mb, recompute, False, None, 1, dtype="bf16",
                reduce_dtype=reduce_dtype, attention=opts.attention)
    return ev.evaluate(plan).time.dp_comm


def test_a_unit_at_the_live_parameter_limit_blocks_the_prefetch():
    # 175B: four weights of 1.5-6.0e8 elements per layer, 4.5e8 on average
    prefetch = dataclasses.replace(DS, prefetch_params=5e7)
    free = _dp(GPT175, 768, prefetch)
    none = _dp(GPT175, 768, dataclasses.replace(DS, prefetch_params=0.0))
    assert free < 0.9 * none  # the prefetch hides the rings behind the weights' GEMMs
    # DeepSpeed's 1e9 default is above every 175B unit: nothing changes
    assert _dp(GPT175, 768, dataclasses.replace(prefetch, max_live_params=1e9)) == free
    # a limit below the unit: once a unit is gathered the coordinator prefetches nothing
    blocked = _dp(GPT175, 768, dataclasses.replace(prefetch, max_live_params=4e8))
    assert blocked == pytest.approx(none)


def test_deepspeed_2021_prefetches_neither_N21_gpt():
    """N21 Table 2's two models under the preset: 530B's QKV and MLP weights (1.3-1.7e9) reach
    the 1e9 live-parameter default by themselves; 175B's average weight (4.5e8) reaches it
    beside the tied word embedding (6.3e8), which Megatron's GPT2Model keeps gathered over the
    step (KernelOptions.live_embedding)."""
    ds = PRESETS["deepspeed@2021"].kernel
    assert ds.prefetch_params == 5e7 and ds.max_live_params == 1e9 and ds.live_embedding
    sync = dataclasses.replace(ds, prefetch_params=0.0)
    assert _dp(GPT175, 1536, ds) == pytest.approx(_dp(GPT175, 1536, sync))
    assert _dp(GPT530, 2240, ds) == pytest.approx(_dp(GPT530, 2240, sync))


def test_a_live_tied_embedding_counts_toward_the_limit():
    """Without the embedding held, 175B's weights are below the limit and prefetch; an untied
    model holds nothing over the step whatever the option says."""
    ds = PRESETS["deepspeed@2021"].kernel
    free = dataclasses.replace(ds, live_embedding=False)
    sync = dataclasses.replace(ds, prefetch_params=0.0)
    assert _dp(GPT175, 1536, free) < 0.95 * _dp(GPT175, 1536, sync)
    untied = GPT175 + (51200, 2048, False)
    assert _dp(untied, 1536, ds) == pytest.approx(_dp(untied, 1536, free))
    assert _dp(untied, 1536, ds) < 0.95 * _dp(untied, 1536, sync)


def test_list_handling_on_the_host_is_not_hidden_by_the_prefetch():
    """With four micro-batches' compute beside each weight, the prefetch hides every ring; what
    list collectives add is still at least the host's walk over the ranks of every call (96
    layers x 4 forward gathers, 4 backward gathers and 4 reduce-scatters)."""
    prefetch = dataclasses.replace(DS, prefetch_params=5e7)
    listed = dataclasses.replace(prefetch, list_collectives=True)
    gpus = 384
    extra = _dp(GPT175, gpus, listed, mb=4) - _dp(GPT175, gpus, prefetch, mb=4)
    calls = 96 * 12
    assert extra >= calls * gpus * LIST_HOST_S_PER_RANK


def test_list_fetches_read_every_gathered_weight_once_more():
    """Without prefetch everything is exposed: beside the host's walk over the ranks of every
    call, list collectives add per reduce-scattered byte the division and the flattening copy
    (4 passes, test_list_reductions_divide_and_flatten_every_gradient) and per
    gathered byte the zero-fill, the chunk copy-out (read + write) and the fetch's norm read:
    4 passes, 3 without the norm."""
    sync = dataclasses.replace(DS, prefetch_params=0.0, reduce_units_per_layer=12,
                               recompute_regathers=True)
    listed = dataclasses.replace(sync, list_collectives=True)
    gpus = 384
    hbm = _evaluator(GPT175, gpus, sync, 1).hbm
    extra = _dp(GPT175, gpus, listed) - _dp(GPT175, gpus, sync)
    layer = 12 * 12288 ** 2  # weights; biases and norms are reduced, not gathered
    gathered = 3 * 96 * layer  # forward, recomputed forward, backward
    reduced = 96 * layer
    host = (3 * 96 * 4 + 96 * 12) * gpus * LIST_HOST_S_PER_RANK
    passes = (extra - host - 2 * 4.0 * reduced / hbm) / (2.0 * gathered / hbm)
    # the embedding's bytes and the fill / drain collectives add a little
    assert 3.9 < passes < 4.2


@pytest.mark.parametrize("value", [0, -1.0, True, "1e9"])
def test_a_bad_live_parameter_limit_is_refused_by_name(value):
    from meshtron.errors import UserError
    with pytest.raises(UserError, match=r"^max_live_params=.*must be None or a number > 0$"):
        KernelOptions(max_live_params=value)


def test_list_reductions_divide_and_flatten_every_gradient():
    """Per reduce-scattered byte, stage3.py average_tensor's in-place div_ (read + write) and
    ProcessGroupNCCL's flatten of the input list (read + write): 4 passes. The gathers move
    bf16 weights whatever the reduction's dtype, so the list's extra time grows from bf16 to
    fp32 gradients by those passes over the 2 more bytes of every reduced element."""
    sync = dataclasses.replace(DS, prefetch_params=0.0, reduce_units_per_layer=12,
                               recompute_regathers=True)
    listed = dataclasses.replace(sync, list_collectives=True)
    gpus = 384
    hbm = _evaluator(GPT175, gpus, sync, 1).hbm
    extra = {d: _dp(GPT175, gpus, listed, reduce_dtype=d) - _dp(GPT175, gpus, sync, reduce_dtype=d)
             for d in ("bf16", "fp32")}
    reduced = 96 * 12 * 12288 ** 2  # the layers' weights; embedding, biases and norms add 0.4%
    passes = (extra["fp32"] - extra["bf16"]) / (2.0 * reduced / hbm)
    assert 3.95 < passes < 4.1
