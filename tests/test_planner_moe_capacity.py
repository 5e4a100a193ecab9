"""Token drop at an expert capacity (KernelOptions.expert_capacity, expert_capacity_pad): the
rows a MoE layer's experts multiply, its all-to-alls carry and its activations hold
(planner/moe_capacity.py, from Megatron-Core's get_capacity and drop_and_pad dispatcher), and
what `meshtron plan` answers with them. Planner-only, no torch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import preset
from meshtron.planner import moe_cost, moe_memory, placement
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.moe_capacity import (ExpertRows, capacity_rows,
                                           executed_expert_flops_per_token, expert_rows)
from testkit.plan_cli import options_refusal, plan_cli  # noqa: F401 (fixture)


@pytest.mark.parametrize("top_k,experts", [(2, 8), (8, 64)])
def test_the_capacity_is_the_ceil_of_f_t_k_over_e(top_k, experts):
    tokens = 1001  # T k / E is not whole for either shape: the ceil adds up to one row
    for factor in (1.0, 2.0):
        exact = tokens * top_k / experts * factor
        assert capacity_rows(factor, tokens, top_k, experts) == int(exact) + 1
    # whole: 1024 tokens, top 2 of 8 -> 256 rows at f = 1, 512 at f = 2
    assert capacity_rows(1.0, 1024, 2, 8) == 256 and capacity_rows(2.0, 1024, 2, 8) == 512


@pytest.mark.parametrize("top_k,experts", [(2, 8), (8, 64)])
def test_padded_rows_are_the_capacity_whatever_the_imbalance(top_k, experts):
    for factor in (1.0, 2.0):
        for imbalance in (1.0, 1.5, 3.0):
            rows = expert_rows(4096, top_k, experts, 8, imbalance, factor, pad=True)
            assert rows == ExpertRows(factor, factor, factor)  # 4096 k / E is whole
    odd = expert_rows(1001, top_k, experts, 8, 1.5, 1.0, pad=True)
    ceil = capacity_rows(1.0, 1001, top_k, experts) * experts / (1001 * top_k)
    assert odd.per_expert == odd.received == odd.sent == pytest.approx(ceil) and ceil > 1.0


@pytest.mark.parametrize("top_k,experts", [(2, 8), (8, 64)])
def test_unpadded_rows_are_the_imbalance_capped_at_the_factor(top_k, experts):
    # f = 1 caps a 1.5 imbalance at the mean; f = 2 leaves it; f = 0.5 drops half the slots
    assert expert_rows(4096, top_k, experts, 8, 1.5, 1.0, pad=False) == ExpertRows(1, 1, 1)
    assert expert_rows(4096, top_k, experts, 8, 1.5, 2.0, pad=False) == \
        expert_rows(4096, top_k, experts, 8, 1.5) == ExpertRows(1.5, 1.5, 1.0)
    assert expert_rows(4096, top_k, experts, 8, 1.5, 0.5, pad=False) == \
        ExpertRows(0.5, 0.5, 0.5)
    # without expert parallelism the rank receives every slot: the imbalance is not in it
    assert expert_rows(4096, top_k, experts, 1, 1.5, 2.0, pad=False).received == 1.0


def _layer(model, capacity: float, pad: bool, imbalance: float = 1.25, tokens: float = 4096.0):
    cl = resolve_cluster("dgx-h100:2")
    group = placement.ep_group(1, 8, cl.gpus_per_node)
    return moe_cost.moe_layer_cost(model, cl, tokens, 8, group, "bf16", imbalance, False, 0,
                                   "fused", capacity=capacity, capacity_pad=pad)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])  # top 2 of 8, 8 of 128
def test_padding_to_twice_the_capacity_prices_twice_the_mean_rows(name):
    model = preset(name)
    padded = _layer(model, 2.0, True)
    hot = _layer(model, 0.0, True, imbalance=2.0)  # dropless, the fullest rank at 2x the mean
    # the grouped GEMMs and the all-to-alls see the same rows; the padded layer also permutes
    # twice the slots
    assert padded.a2a_fwd == pytest.approx(hot.a2a_fwd) and padded.a2a_fwd > 0
    assert padded.compute_fwd > hot.compute_fwd
    assert padded.a2a_bytes == pytest.approx(2 * hot.a2a_bytes)
    # at f = 1 on whole rows the padded layer is the balanced dropless one but for the sync
    assert _layer(model, 1.0, True).a2a_fwd == pytest.approx(_layer(model, 0.0, True, 1.0).a2a_fwd)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_dropping_without_padding_caps_the_hot_rank(name):
    model = preset(name)
    # f above the imbalance drops nothing: the dropless price exactly
    assert _layer(model, 2.0, False) == _layer(model, 0.0, False)
    # f = 1 caps the 1.25 imbalance: the balanced dropless price, cheaper than uncapped
    assert _layer(model, 1.0, False) == _layer(model, 0.0, False, imbalance=1.0)
    assert _layer(model, 1.0, False).a2a_fwd < _layer(model, 0.0, False).a2a_fwd


def test_the_expert_activations_hold_the_padded_rows():
    model = preset("qwen3-30b-a3b")
    tokens, tp, ep = 4096.0, 1, 8

    def saved(counts=None, imbalance=1.0):
        return moe_memory.routed_saved_bytes(model, tokens, tp, ep, imbalance, 2.0, "korthikanti",
                                             counts=counts)

    padded = saved(expert_rows(tokens, model.moe_top_k, model.moe_experts, ep, 1.0, 2.0, True))
    # the experts' rows are those of a dropless rank at twice the mean; the unpermute takes
    # twice the slots back too: [T k, h] bf16 expert outputs and fp32 probabilities more
    slots = tokens * model.moe_top_k
    assert padded - saved(imbalance=2.0) == pytest.approx(slots * (model.hidden * 2.0 + 4.0))
    assert saved(expert_rows(tokens, 8, 128, ep, 1.0, 0.0)) == saved()


def test_hardware_flops_count_the_padded_rows_and_not_the_dropped():
    model = preset("qwen3-30b-a3b")
    per_layer = model.moe_top_k * model.mlp_params(model.moe_ffn_hidden)
    twice = ExpertRows(2.0, 2.0, 2.0)
    assert executed_expert_flops_per_token(model, twice, 0.0) == \
        pytest.approx(6.0 * per_layer * model.moe_layers)
    assert executed_expert_flops_per_token(model, twice, 1.0) == \
        pytest.approx(8.0 * per_layer * model.moe_layers)  # the recomputed forward too
    assert executed_expert_flops_per_token(model, ExpertRows(0.5, 0.5, 0.5), 0.0) < 0
    assert executed_expert_flops_per_token(model, ExpertRows(1.5, 1.5, 1.0), 0.0) == 0.0


def test_a_bad_pad_flag_is_refused_naming_the_field():
    with pytest.raises(UserError, match=r"expert_capacity_pad=1: must be true or false"):
        dataclasses.replace(KernelOptions(), expert_capacity_pad=1)


PLAN = ["--model", "qwen3-30b-a3b", "--cluster", "dgx-h100:2", "--global-batch", "64",
        "--seq-len", "2048", "--framework", "megatron@2024", "--layout", "tp=1,pp=1,dp=16,ep=8",
        "--zero", "2", "--recompute", "none", "--micro-batch", "1", "--offload", "none",
        "--dtype", "bf16", "--json", "--top", "1"]


def _plan(plan_cli, tmp_path, name: str, options: str) -> dict:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"[options]\nexpert_imbalance = 1.25\n{options}\n")
    rc, out, err = plan_cli(*PLAN, "--options", str(path))
    assert rc == 0, err
    return json.loads(out)["plans"][0]


def test_meshtron_plan_prices_the_padded_rows_from_an_options_file(plan_cli, tmp_path):
    dropless = _plan(plan_cli, tmp_path, "dropless", "")
    padded = _plan(plan_cli, tmp_path, "padded",
                   "expert_capacity = 2.0\nexpert_capacity_pad = true")
    # megatron@2024's own value: Megatron-Core's moe_pad_expert_input_to_capacity False
    dropped = _plan(plan_cli, tmp_path, "dropped", "expert_capacity = 2.0")
    # f = 2 above the 1.25 imbalance drops nothing: the dropless answer
    assert dropped["step_time_s"] == dropless["step_time_s"]
    assert dropped["hfu"] == dropless["hfu"] and dropped["mfu"] == dropless["mfu"]
    # padded to twice the mean rows: slower, more expert traffic and activations, and the
    # hardware FLOPs above the model FLOPs
    assert padded["step_time_s"] > dropless["step_time_s"]
    assert padded["time_s"]["ep_comm"] > dropless["time_s"]["ep_comm"]
    assert padded["memory_gib"]["activations"] > dropless["memory_gib"]["activations"]
    assert padded["hfu"] > padded["mfu"] and padded["mfu"] < dropless["mfu"]
    assert padded["fits"] and dropless["fits"]


def test_a_bad_pad_flag_in_an_options_file_is_one_line_exit_2(plan_cli, tmp_path):
    err = options_refusal(plan_cli, tmp_path, 'expert_capacity_pad = "yes"', *PLAN[:10])
    assert "expert_capacity_pad='yes': must be true or false" in err


def test_deepep_refuses_padding_to_capacity():
    """Megatron-Core's DeepEP dispatch sends the routed rows only: padding to capacity with it
    is one line naming both fields; dropping without padding, or dropless, is priced."""
    with pytest.raises(UserError, match="expert_capacity_pad=true with ep_dispatch='deepep'"):
        KernelOptions(ep_dispatch="deepep", expert_capacity=1.0)
    KernelOptions(ep_dispatch="deepep", expert_capacity=1.0, expert_capacity_pad=False)
    KernelOptions(ep_dispatch="deepep")


def test_the_pad_flag_is_each_presets_own():
    """Megatron-Core pads to capacity only when asked (moe_pad_expert_input_to_capacity
    defaults False); DeepSpeed-MoE's GShard dispatch always fills [E, C, h]; meshtron's
    runtime is dropless and its rule takes only True. A Megatron-Core preset with DeepEP and a
    capacity is therefore priced, not refused."""
    from meshtron.planner.frameworks import PRESETS

    pads = {name: fw.kernel.expert_capacity_pad for name, fw in PRESETS.items()}
    assert not pads["megatron@2024"] and not pads["megatron-bridge@2025"]
    assert pads["deepspeed@2021"] and pads["deepspeed@2024"] and pads["meshtron@2026"]
    bridge = PRESETS["megatron-bridge@2025"].kernel
    dataclasses.replace(bridge, ep_dispatch="deepep", expert_capacity=1.0)
    with pytest.raises(UserError, match="expert_capacity_pad=true with ep_dispatch='deepep'"):
        dataclasses.replace(bridge, ep_dispatch="deepep", expert_capacity=1.0,
                            expert_capacity_pad=True)
