"""FP8 gathers priced as the stacks' code runs them (planner/fp8_gather.py, compute.py's
tensor-parallel collectives): torchao's FP8 all-gather under FSDP2 casts the weight on the
shard before each gather, so its Linears cast no weight but copy it column-major for the
input gradient; stacks that gather the sequence-parallel activations in FP8 gather the
row-parallel output gradients in FP8 too."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import comm
from meshtron.planner import compute as C
from meshtron.planner.cluster import preset_cluster, resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.fp8 import GEMM_GROUPS, cast_bytes, fp8_fractions
from meshtron.planner.fp8_amax import current_amax_tp_s
from meshtron.planner.fp8_gather import (FP8_WEIGHT_TRANSPOSE_BYTES, gathered_weight_casts,
                                         pre_gather_cast_bytes, torchao_gathers_fp8)
from meshtron.planner.frameworks import PRESETS as STACKS
from meshtron.planner.placement import tp_group

H100 = resolve_cluster("dgx-h100:1")
L8 = PRESETS["llama3-8b"]
ALL = dict.fromkeys(GEMM_GROUPS, 1.0)
TENSORWISE = C.KernelOptions(stack="compiled", fp8_filter="all", sharding="fsdp",
                             fp8_scaling="torchao-tensorwise")


def test_only_torchao_fsdp_float8_all_gather_moves_the_weight_cast():
    gather = dataclasses.replace(TENSORWISE, fp8_fsdp_gather=True)
    assert torchao_gathers_fp8(gather, "tensorwise")
    assert not torchao_gathers_fp8(TENSORWISE, "tensorwise")  # torchtitan's default: off
    te = dataclasses.replace(gather, fp8_scaling="te-delayed", fp8_param_gather=True)
    assert not torchao_gathers_fp8(te, "tensorwise")  # Transformer Engine: its own mechanism
    cb = gathered_weight_casts(cast_bytes("torchao-tensorwise", "tensorwise", True))
    assert (cb.weight_fwd, cb.weight_bwd) == (0.0, FP8_WEIGHT_TRANSPOSE_BYTES)


def test_layer_with_gathered_fp8_weights_differs_by_the_weight_bytes():
    """The same GEMMs and activation casts; per micro-batch the layer stops casting its
    weights (max-abs and a cast per pass: 5 + 3 bytes) and copies them column-major (2)."""
    gather = dataclasses.replace(TENSORWISE, fp8_fsdp_gather=True)
    cost = {o.fp8_fsdp_gather: C.layer_cost(L8, H100, 1, 1, 8192, False, o, 1, "fp8", None,
                                            "tensorwise") for o in (TENSORWISE, gather)}
    cb = cast_bytes("torchao-tensorwise", "tensorwise", True)
    saved = cb.weight_fwd + cb.weight_bwd - FP8_WEIGHT_TRANSPOSE_BYTES
    w = C.fp8_weight_elements(L8, 1, ALL)
    bw = C.membound_bytes_per_s(H100, "compiled")
    got = sum(cost[False].__dict__[k] - cost[True].__dict__[k] for k in ("fwd", "bwd"))
    assert saved == 6.0
    assert got == pytest.approx(saved * w / bw, rel=1e-9)


def test_each_fp8_gather_casts_its_shard_eagerly():
    """OLMo-core's FP8 (fp32 shards, torchao's FP8 all-gather): the FP8 share of every gather's
    shard pays torchao's scale, clamp and cast (8 + 8 + 5 bytes) where FSDP2's cast to bf16
    would read 4 and write 1; the bf16 share and a bf16 plan are priced as before."""
    fw = STACKS["olmo-core@2024"]
    model, cl = PRESETS["llama3-8b"], preset_cluster("dgx-h100", 1)
    ev = Evaluator(model, cl, 1024, 4096, fw.kernel, mem=fw.memory)
    p, ranks, share = 1e9, 8, 0.9
    bf16 = ev.gather_prep_s(p, 2.0, ranks)
    assert bf16 == pytest.approx((4 + 2 + 2 * 2) * p / ranks / ev.hbm)
    assert pre_gather_cast_bytes(4.0) == 21.0 and pre_gather_cast_bytes(2.0) == 27.0
    wsize = 2.0 - share
    fp8 = ev.gather_prep_s(p, wsize, ranks)
    assert fp8 == pytest.approx((4 + wsize + share * (21 - 5) + 2 * wsize) * p / ranks / ev.hbm)
    assert fp8 > bf16


@pytest.mark.parametrize("scaling,fp8_grad", [("te-delayed", True),
                                              ("torchao-tensorwise", True),
                                              ("torchao-rowwise", False)])
def test_row_parallel_output_gradient_is_gathered_in_fp8(scaling, fp8_grad):
    """Sequence parallel at tp 8, no overlap of any kind: the backward's exposed
    collectives are, per GEMM pair, the row-parallel output gradient's all-gather and the
    column-parallel input gradient's reduce-scatter. Transformer Engine and torchao
    tensorwise gather that gradient in FP8 (1 byte per element), rowwise in bf16."""
    opts = C.KernelOptions(stack="compiled", fp8_filter="all", fp8_scaling=scaling,
                           megatron_linear=False, async_tp=False, tp_comm_overlap=False)
    cl = resolve_cluster("dgx-h100:1")
    tokens, tp = 8192, 8
    lc = C.layer_cost(L8, cl, tp, 1, tokens, True, opts, 1, "fp8", None, "tensorwise")
    fab, group = comm.Fabric.of(cl), tp_group(tp, cl.gpus_per_node)
    act = 2.0 * tokens * L8.hidden
    ag = comm.all_gather(act / 2.0 if fp8_grad else act, group, fab)
    rs = comm.reduce_scatter(act, group, fab)
    # current scaling's amax all-reduces beside them (planner/fp8_amax.py)
    frac = fp8_fractions(L8, tp, "tensorwise", "all")
    _, amax_b = current_amax_tp_s(opts, True, frac, group, fab, 1.0)
    assert lc.tp_bwd == pytest.approx(2 * (ag + rs) + amax_b, rel=1e-9)
