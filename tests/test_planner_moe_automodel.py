"""NeMo AutoModel's MoE layout priced per memory category (MemoryOptions.param_dtype,
experts_outside_fsdp; planner/memory_states.py, memory.py `p_loose`) and DeepEP's dispatch
(KernelOptions.ep_dispatch 'deepep', planner/moe_deepep.py): each term against the bytes or
seconds its source gives, on a small mixture of experts."""

from __future__ import annotations

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner import memory
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.plan import Plan

MIXTRAL = PRESETS["mixtral-8x7b"]  # 8 experts, top 2
CLUSTER = resolve_cluster("dgx-h100:1")  # 8 GPUs, one node
GIB = memory.GIB


def _mem(ep: int, dp: int = 8, **mem):
    ev = Evaluator(MIXTRAL, CLUSTER, 64, 4096, mem=MemoryOptions(**mem))
    est = ev.evaluate(Plan(1, 1, dp, 3, 1, "full", False, None, 1, dtype="bf16", ep=ep))
    return est.memory


def test_bf16_model_halves_every_state_category():
    """from_config builds the model in bf16 and torch's Adam keeps its moments in the
    parameter's dtype: 2 + 2 + 4 bytes per parameter where FSDP2 over fp32 masters holds
    4 + 4 + 8. Sharded over the same ranks, each category halves, nothing else moves."""
    fp32, bf16 = _mem(8), _mem(8, param_dtype="bf16")
    for name in ("params", "grads", "optimizer"):
        assert getattr(bf16, name) == pytest.approx(getattr(fp32, name) / 2, rel=1e-12)
    assert bf16.activations == fp32.activations and bf16.logits == fp32.logits
    assert bf16.gathered == pytest.approx(fp32.gathered, rel=1e-12)


def test_experts_outside_fsdp_lose_their_gathered_copy_and_accumulator():
    """ep 8 over dp 8: one rank holds each expert (AutoModel's ep_shard group of size 1), so
    the experts are FSDP2's ignored_params: no bf16 compute copy of them is gathered and
    their gradients accumulate in place, not in an fp32 unsharded accumulator. The states
    stay; the gathered category drops to what the blocks without their experts gather."""
    kw = dict(param_dtype="bf16")
    wrapped, loose = _mem(8, **kw), _mem(8, experts_outside_fsdp=True, **kw)
    for name in ("params", "grads", "optimizer", "activations", "logits"):
        assert getattr(loose, name) == pytest.approx(getattr(wrapped, name), rel=1e-12)
    assert loose.gathered < wrapped.gathered
    # the same accounting on one pipelined stage (FSDP2 keeps the units gathered over the
    # step and accumulates fp32 gradients: AutoModel's rows), term by term
    mem = MemoryOptions(param_dtype="bf16", experts_outside_fsdp=True)
    states, e_states = (2.0 / 8, 2.0 / 8, 4.0 / 8), (2.0, 2.0, 4.0)
    layers, p_layer, p_exp = 4, 2e8, 1e9

    def bd(**kw):
        return memory.breakdown(mem, 3, 8, states, layers, p_layer, 0.0, 5e7, 1e8, 2.0, 0.0,
                                0.0, 80 * GIB, 0, keep_gathered=True, accum=4.0,
                                expert_states=e_states, reduce_bytes=0.0, **kw)

    with_experts, outside, none = bd(p_expert=p_exp), bd(p_loose=p_exp), bd()
    # outside: only the block's new gradient before AccumulateGrad adds it (bf16, one block)
    assert (outside.gathered - none.gathered) * GIB == pytest.approx(2.0 * p_exp, rel=1e-9)
    # wrapped, each expert parameter costs its bf16 copy (2) and fp32 accumulator (4), and
    # the backward's block its unsharded bf16 gradient (2) beside them
    assert (with_experts.gathered - none.gathered) * GIB == pytest.approx(
        layers * p_exp * (2.0 + 4.0) + 2.0 * p_exp, rel=1e-9)
    for name, b in zip(("params", "grads", "optimizer"), e_states):
        assert (getattr(outside, name) - getattr(none, name)) * GIB == pytest.approx(
            layers * p_exp * b, rel=1e-9)
        assert getattr(outside, name) == pytest.approx(getattr(with_experts, name), rel=1e-12)


def test_experts_in_a_larger_group_stay_wrapped():
    """ep 4 over dp 8: two ranks hold each expert, AutoModel wraps them in FSDP2 over that
    pair (fully_shard on the ep_shard mesh), so the option changes nothing."""
    kw = dict(param_dtype="bf16")
    assert _mem(4, **kw) == _mem(4, experts_outside_fsdp=True, **kw)


def test_param_dtype_refused_outside_fsdp2():
    with pytest.raises(UserError, match="param_dtype"):
        MemoryOptions(framework="megatron", param_dtype="bf16")
    with pytest.raises(UserError, match="allowed values are fp32, bf16"):
        MemoryOptions(param_dtype="fp16")
