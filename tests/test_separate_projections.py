"""Separate q/k/v and gate/up Linears (torchtitan's and meshtron's Llama) are priced as the
separate GEMMs they run (KernelOptions.separate_projections, planner/compute.py layer_cost):
at tp = 8 a GQA model's wk and wv are only kv_dim / tp columns wide, where tile saturation
costs most. Issue 30 item 3 (torchtitan's 405B FSDP8 TP8 PP8 rows predicted too fast)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.compute import KernelOptions, cluster_gemm_time, layer_cost
from meshtron.planner.frameworks import PRESETS as FRAMEWORKS

CLUSTER = resolve_cluster("dgx-h100:8")
FUSED = KernelOptions(stack="compiled", separate_projections=False)
SEPARATE = dataclasses.replace(FUSED, separate_projections=True)


def _fwd(model, tp, opts, dtype="bf16"):
    return layer_cost(model, CLUSTER, tp, 1, 8192, True, opts, 1, dtype).fwd


def test_separate_projections_add_exactly_the_split_gemms():
    # bf16, dense Llama 3 405B at tp=8: wq [h/8], wk and wv [kv/8 = 128] instead of one
    # [(h + 2 kv)/8] GEMM; w1 and w3 [f/8] instead of one [2f/8]. Nothing else changes.
    m, tp, tok = PRESETS["llama3-405b"], 8, 8192
    h, kv, f = m.hidden, m.kv_dim, m.ffn_hidden
    cl = CLUSTER.at_dtype("bf16")

    def g(n):
        return cluster_gemm_time(tok, n, h, cl)
    expected = (g(h / tp) + 2 * g(kv / tp) - g((h + 2 * kv) / tp)
                + 2 * g(f / tp) - g(2 * f / tp))
    fused, separate = layer_cost(m, CLUSTER, tp, 1, tok, True, FUSED), \
        layer_cost(m, CLUSTER, tp, 1, tok, True, SEPARATE)
    assert expected > 0  # narrower GEMMs never run more efficiently in the shape model
    assert separate.wgrad - fused.wgrad == pytest.approx(expected, rel=1e-9)
    # the backward runs the input- and weight-gradient GEMMs of each Linear: twice the extra
    assert separate.bwd - fused.bwd == pytest.approx(2 * expected, rel=1e-6)


def test_narrow_kv_shards_cost_more_as_tp_grows():
    # the relative penalty of separate Linears comes from the kv_dim/tp-wide GEMMs: it grows
    # with tp for a GQA model (Llama 3 70B: 8 kv heads) and is larger than for an MHA model of
    # similar width at the same tp (GPT-3 175B: kv_dim = hidden)
    gqa, mha = PRESETS["llama3-70b"], PRESETS["gpt3-175b"]

    def penalty(model, tp, dtype="bf16"):
        return _fwd(model, tp, SEPARATE, dtype) / _fwd(model, tp, FUSED, dtype) - 1.0
    by_tp = [penalty(gqa, tp) for tp in (1, 2, 4, 8)]
    assert by_tp == sorted(by_tp) and by_tp[0] >= 0.0 and by_tp[-1] > 2 * by_tp[0]
    assert penalty(gqa, 8) > penalty(mha, 8)
    # FP8 (torchtitan's float8, every Linear converted) keeps the same ordering
    fp8 = dataclasses.replace(SEPARATE, fp8_filter="all", fp8_scaling="torchao-tensorwise")
    fp8_fused = dataclasses.replace(fp8, separate_projections=False)
    assert (layer_cost(gqa, CLUSTER, 8, 1, 8192, True, fp8, 1, "fp8").fwd
            > layer_cost(gqa, CLUSTER, 8, 1, 8192, True, fp8_fused, 1, "fp8").fwd)


def test_presets_say_what_the_runtimes_build():
    # meshtron's runtime builds wq/wk/wv and w1/w3 as separate nn.Linear modules
    # (meshtron/model/transformer.py), as torchtitan's Llama does; Megatron fuses linear_qkv
    # and linear_fc1 (TE LayerNormLinear)
    torch = pytest.importorskip("torch")
    from meshtron.model.transformer import Attention, FeedForward

    spec = PRESETS["tiny"]
    attn, ffn = Attention(spec), FeedForward(spec)
    linears = {n for n, mod in [*attn.named_children(), *ffn.named_children()]
               if isinstance(mod, torch.nn.Linear)}
    runtime_separate = {"wq", "wk", "wv", "w1", "w3"} <= linears
    assert runtime_separate
    assert FRAMEWORKS["meshtron@2026"].kernel.separate_projections is runtime_separate
    assert FRAMEWORKS["torchtitan@2025"].kernel.separate_projections
    assert not FRAMEWORKS["megatron@2024"].kernel.separate_projections
