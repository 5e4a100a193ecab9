"""Zero bubble with checkpointed blocks (planner/zb_recompute.py): torch's W recomputes a
checkpointed block once per parameter group, measured here on meshtron's own blocks with
torch's _backward.py functions (the ones PipelineStage calls for B and W), and the planner
prices W with those recomputations."""

from __future__ import annotations

import pytest
import torch

from meshtron.model import Transformer
from meshtron.model.spec import preset
from meshtron.parallel.recompute import apply_recompute
from meshtron.planner.zb_recompute import weight_groups


def _split_backward_forwards(name: str, mode: str) -> tuple[int, int, int]:
    """Forward calls of the blocks of a middle stage ('name' preset's blocks) in F, in B
    (`stage_backward_input`) and in W (`stage_backward_weight`) under recompute `mode`."""
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)

    spec = preset(name)
    torch.manual_seed(0)
    model = apply_recompute(Transformer(spec), mode)
    blocks = list(model.layers.values())
    calls = [0]
    for b in blocks:  # the block itself, inside its checkpoint wrapper
        inner = getattr(b, "_checkpoint_wrapped_module", b)
        inner.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(2, 16, spec.hidden, requires_grad=True)  # the received input, a leaf
    rope = model.rope_for(16)
    h = x
    for b in blocks:
        h = b(h, rope)
    f = calls[0]
    _, groups = stage_backward_input([h], [torch.randn_like(h)], [x], iter(params))
    b_calls = calls[0] - f
    stage_backward_weight(iter(params), groups)
    return f, b_calls, calls[0] - f - b_calls


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt"])
def test_w_recomputes_a_checkpointed_block_once_per_parameter_group(name):
    """Full recomputation: B recomputes each block once, W once per parameter group (9 for a
    Llama block, 8 for a GPT block, whose Linear biases share their weight's group):
    the planner's count. Without checkpoints nothing is recomputed."""
    layers = preset(name).layers
    assert _split_backward_forwards(name, "none") == (layers, 0, 0)
    f, b, w = _split_backward_forwards(name, "full")
    assert (f, b) == (layers, layers)
    assert w == layers * weight_groups(preset(name))


def test_selective_recompute_does_not_run_under_the_split_backward():
    """torch 2.13's selective checkpoint refuses W's second pass (plan_rules_runtime.py
    refuses the plan: test below)."""
    with pytest.raises(RuntimeError) as err:
        _split_backward_forwards("tiny", "selective")
    assert "backward an extra time" in str(err.value.__cause__ or err.value)


def test_plan_refuses_zero_bubble_with_selective_recompute():
    from meshtron.planner.plan_rules import plan_problems

    base = dict(pp=2, schedule="zb")
    assert any("selective" in p for p in plan_problems({**base, "recompute": "selective"}))
    assert not any("selective" in p for p in plan_problems({**base, "recompute": "full"}))
    assert not any("selective" in p
                   for p in plan_problems({**base, "recompute": "selective", "pp": 1}))


@pytest.mark.parametrize("recompute,share", [("full", 1.0), ("half", 0.5), ("none", 0.0)])
def test_planner_prices_w_recomputation_under_zero_bubble(recompute, share):
    """Per layer and micro-batch, zb's W (and the layer's compute) carries `groups` x the
    recomputed forward (x 1/2 with 'half'); 1F1B's backward does not."""
    from meshtron.model.spec import resolve_model
    from meshtron.planner import resolve_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import as_plan

    model = resolve_model("llama3-8b")
    ev = Evaluator(model, resolve_cluster("dgx-h100:2"), 256, 4096)
    knobs = dict(tp=2, pp=4, dp=2, zero=1, micro_batch=1, recompute=recompute,
                 global_batch=256, seq_len=4096)
    zb = ev._inputs(as_plan({**knobs, "schedule": "zb"}).validate(16, model))
    one = ev._inputs(as_plan({**knobs, "schedule": "1f1b"}).validate(16, model))
    cfg = zb.cfg
    lc = ev._cache[("layer", 2, 1, cfg.sp, recompute, 1, cfg.dtype, 1, cfg.fp8_recipe)]
    groups = weight_groups(model)
    assert groups == 9
    assert zb.c_l - one.c_l == pytest.approx(groups * share * lc.fwd, rel=1e-12, abs=1e-15)
    assert zb.w_l - one.w_l == pytest.approx(groups * share * (lc.fwd + lc.tp_fwd),
                                             rel=1e-12, abs=1e-15)
