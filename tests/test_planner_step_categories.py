"""The planner's step by kind of GPU work (planner/step_categories.py, issue 30/31) and the
optimizer-step bytes the H200 profile showed missing (gradient clipping, the accumulated
gradient's dtype). Planner only, no torch: each kind checked against the formula it comes from,
and the kinds against the step they must add up to."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import compute as C
from meshtron.planner import host
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan
from meshtron.planner.step_categories import KINDS, step_categories

L8 = PRESETS["llama3-8b"]
H200 = dataclasses.replace(resolve_cluster("dgx-h200:1"), gpus_per_node=1)


def _evaluated(model=L8, cluster=H200, batch=8, opts=None, **plan):
    ev = Evaluator(model, cluster, batch, 4096, opts or C.KernelOptions())
    est = ev.evaluate(Plan(**{"tp": 1, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 1,
                              "recompute": "none", "dtype": "bf16", **plan}))
    return ev, est


@pytest.mark.parametrize("plan, opts", [
    ({"recompute": "full"}, C.KernelOptions()),
    ({"recompute": "none", "micro_batch": 4}, C.compiled(C.KernelOptions())),
    ({"recompute": "selective", "micro_batch": 2}, C.KernelOptions()),
    # Megatron-Core's checkpointed attention core: its flash forward again
    ({"recompute": "selective", "micro_batch": 2}, C.KernelOptions(stack="fused",
                                                                  sharding="zero")),
    ({"recompute": "none", "micro_batch": 4, "dtype": "fp8"}, C.compiled(C.KernelOptions())),
])
def test_kinds_add_up_to_the_step(plan, opts):
    model = dataclasses.replace(L8, layers=13)
    ev, est = _evaluated(model, opts=opts, **plan)
    cats = step_categories(ev, est)
    assert set(cats) == set(KINDS)
    assert sum(cats.values()) == pytest.approx(est.time.total, rel=1e-12)
    assert all(v >= 0.0 for v in cats.values())
    assert (cats["fp8_cast"] > 0.0) == (plan.get("dtype") == "fp8")


@pytest.mark.parametrize("kw, cp, dtype, repeat", [
    ({}, 1, "bf16", False),
    ({"launch_blocking": True}, 1, "bf16", False),      # the launches wait: host_wait
    ({"flash_unpad": True}, 1, "bf16", False),          # unpad copies + the host's syncs
    ({"fp32_params_autocast": True}, 1, "bf16", False),
    ({}, 1, "bf16", True),                               # repeat_kv's copies
    ({"torch_ring": True}, 2, "bf16", False),            # the ring's merges and copies
    ({}, 1, "fp8", False),
])
def test_a_layers_parts_are_its_forward_and_backward(kw, cp, dtype, repeat):
    """Every term layer_cost adds is in exactly one kind: the parts sum to fwd and bwd."""
    small = dataclasses.replace(L8, hidden=1024, heads=8, kv_heads=2, ffn_hidden=3584)
    lc = C.layer_cost(small, H200, 1, 2, 4096, False, C.KernelOptions(**kw), cp, dtype,
                      None, "rowwise", repeat)
    assert {k for k, _, _ in lc.parts} == set(C.PART_KINDS)
    assert sum(f for _, f, _ in lc.parts) == pytest.approx(lc.fwd, rel=1e-12)
    assert sum(b for _, _, b in lc.parts) == pytest.approx(lc.bwd, rel=1e-12)
    parts = {k: (f, b) for k, f, b in lc.parts}
    if kw.get("launch_blocking") or kw.get("flash_unpad"):
        assert parts["host_wait"][0] > 0.0


def test_tensor_parallel_and_moe_plans_add_up_too():
    cl = resolve_cluster("dgx-h100:1")
    ev, est = _evaluated(L8, cl, batch=16, tp=8, sp=True, recompute="full")
    cats = step_categories(ev, est)
    assert cats["communication"] == pytest.approx(est.time.tp_comm + est.time.dp_comm)
    assert cats["communication"] > 0.0
    assert sum(cats.values()) == pytest.approx(est.time.total, rel=1e-12)
    moe = PRESETS["tiny-moe-ds"]
    ev, est = _evaluated(moe, cl, batch=16, tp=1, dp=8)
    cats = step_categories(ev, est)
    assert cats["moe"] > 0.0
    assert sum(cats.values()) == pytest.approx(est.time.total, rel=1e-12)


def test_gemm_kind_is_the_layers_linears_times_passes_plus_the_head():
    """Full recomputation runs every block GEMM four times (forward, two backward, forward
    again); the head's GEMMs (three, plus what meshtron's fused loss's chunked GEMMs and fp32
    weight-gradient accumulation add) come once per micro-batch."""
    model = dataclasses.replace(L8, layers=4)
    ev, est = _evaluated(model, recompute="full")
    lc = C.layer_cost(model, H200, 1, 1, 4096, False, C.KernelOptions())
    head = ev.head_for(est.config, C.head_cost(model, H200, 1, 1, 4096, False, "eager"))
    head_gemm = sum(s for kind, s in head.parts if kind == "gemm")
    m = est.num_microbatches
    assert m == 8
    cats = step_categories(ev, est)
    assert cats["gemm"] == pytest.approx(m * (4 * 4 * lc.wgrad + head_gemm))
    assert cats["attention"] == pytest.approx(m * 4 * (2 * lc.core_fwd + dict(
        (k, b) for k, _, b in lc.parts)["attention"]))


def test_host_wait_is_the_launch_bound_of_small_layers():
    """A small model's layers are shorter than their launches: the GPU waits on the host, and
    that wait is what the step's host_wait kind holds (host.launch_bound per layer)."""
    small = dataclasses.replace(L8, hidden=256, heads=4, kv_heads=4, ffn_hidden=768, layers=4)
    ev, est = _evaluated(small, batch=8)
    lc = ev._cache[("layer", 1, 1, False, "none", 1, "bf16", 1, "rowwise")]
    parts = {k: (f, b) for k, f, b in lc.parts}
    issue_f, _ = host.layer_issue(C.kernels_per_layer(small, C.KernelOptions()), 0,
                                  C.dispatch_s(H200))
    device_f = lc.fwd - parts["host_wait"][0]
    assert parts["host_wait"][0] == pytest.approx(host.launch_bound(device_f, issue_f))
    assert parts["host_wait"][0] > 0.0
    cats = step_categories(ev, est)
    assert cats["host_wait"] >= est.num_microbatches * small.layers * sum(parts["host_wait"])


def test_pipelined_plans_are_refused():
    ev = Evaluator(L8, resolve_cluster("dgx-h100:1"), 16, 4096)
    est = ev.evaluate(Plan(tp=1, pp=2, dp=4, zero=1, micro_batch=1, recompute="full",
                           schedule="1f1b"))
    with pytest.raises(ValueError, match="pp=2"):
        step_categories(ev, est)


# ---- the optimizer step ------------------------------------------------------------------------
def test_gradient_clipping_adds_three_gradient_passes():
    """meshtron's clip_grad_norm_ reads every gradient for the norm and scales it in place
    (foreach norm + foreach mul): with fp32 gradients (FSDP reduce dtype fp32) 12 bytes per
    parameter beside AdamW's; the fused AdamW reads the fp32 gradient (4 bytes, not bf16's 2)."""
    model = dataclasses.replace(L8, layers=4)
    clip, est = _evaluated(model)
    noclip, est0 = _evaluated(model, opts=C.KernelOptions(grad_clip=False))
    flags = clip.dp_flags(est.config)
    assert flags["gsize"] == 4.0
    assert noclip.optimizer_bytes() == pytest.approx(28.0 - 2.0 + 4.0)
    assert clip.optimizer_bytes() - noclip.optimizer_bytes() == pytest.approx(12.0)
    delta = est.time.optimizer - est0.time.optimizer
    assert delta == pytest.approx(12.0 / 42.0 * est.time.optimizer)
    # one rank holds every parameter (tp = dp = 1, ZeRO-0): 42 bytes each at 0.8 x HBM
    assert est.time.optimizer == pytest.approx(42.0 * model.num_params() / clip.hbm, rel=1e-6)


def test_megatron_clips_its_fp32_main_gradients():
    """Sharding 'zero' (Megatron, DeepSpeed) reads the gradient buffer's dtype: fp32 main_grad
    with fp32_grad_reduce."""
    ev = Evaluator(L8, H200, 8, 4096, C.KernelOptions(sharding="zero", fp32_grad_reduce=True))
    assert ev.optimizer_bytes() == pytest.approx(30.0 + 12.0)
    foreach = Evaluator(L8, H200, 8, 4096, C.KernelOptions(optimizer="foreach",
                                                           grad_clip=False))
    assert foreach.optimizer_bytes() == pytest.approx(86.0)


def test_fsdp_steps_fp32_gradients_whatever_the_reduce_dtype():
    """FSDP2 casts each reduced gradient back to its fp32 master parameter's dtype before it
    lands in `.grad` (estimate_stage.FSDP_GRAD_BYTES): a bf16 reduce halves the wire, not what
    the optimizer, the clipping or a ZeRO-3 shard's accumulation read and write."""
    from meshtron.planner.estimate_stage import FSDP_GRAD_BYTES

    assert FSDP_GRAD_BYTES == 4.0
    ev = Evaluator(L8, resolve_cluster("dgx-h200:1"), 64, 4096, C.KernelOptions())
    z3 = Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, recompute="none", dtype="bf16")
    steps, accs = [], []
    for reduce in ("fp32", "bf16"):
        plan = z3.replace(reduce_dtype=reduce)
        flags = ev.dp_flags(plan)
        assert flags["gsize"] == (4.0 if reduce == "fp32" else 2.0)  # the wire does change
        accs.append(ev.accumulation_s(plan, L8.layers, 0, 8, flags))
        steps.append(ev.evaluate(plan).time.optimizer)
    assert accs[1] == pytest.approx(accs[0]) and accs[0] > 0.0
    assert steps[1] == pytest.approx(steps[0]) and steps[0] > 0.0


# ---- gradient accumulation across dtypes --------------------------------------------------------
def test_cast_add_is_bound_by_sms_on_hopper_and_streams_on_ampere():
    """The unvectorised fp32 += bf16 add reached 2.52 TB/s on the H200's 132 SMs (its profile);
    per SM the same elsewhere, capped by streaming: an A100 (108 SMs, 0.8 x 2.04 TB/s) streams,
    an H100 (3.35 TB/s) is held to the H200's rate."""
    assert C.cast_add_bytes_per_s(H200) == pytest.approx(2.52e12)
    a100 = resolve_cluster("dgx-a100:1")
    assert C.cast_add_bytes_per_s(a100) == pytest.approx(a100.hbm_bytes_per_s * C.HBM_EFFICIENCY)
    h100 = resolve_cluster("dgx-h100:1")
    assert C.cast_add_bytes_per_s(h100) == pytest.approx(2.52e12)
    assert C.cast_add_bytes_per_s(h100) < h100.hbm_bytes_per_s * C.HBM_EFFICIENCY


def test_accumulating_into_bf16_stays_vectorised():
    """With a bf16 reduce dtype the add has one dtype: 3 x 2 bytes per element per micro-batch
    after the first, at the streaming rate, and no cast on the first."""
    model = dataclasses.replace(L8, layers=4)
    ev, est = _evaluated(model, reduce_dtype="bf16")
    flags = ev.dp_flags(est.config)
    assert flags["gsize"] == 2.0
    params = ev._stage_params(est.config, 4, 0)
    got = ev.accumulation_s(est.config, 4, 0, 8, flags)
    assert got == pytest.approx(7 * 6.0 * params / ev.hbm)


def test_the_runs_clipping_reaches_the_planner():
    """`meshtron train --plan auto` plans with the run's own clipping: optim.grad_clip 0 drops
    the norm and scale passes from the predicted optimizer step."""
    from meshtron.config import config_from_dict
    from meshtron.train.job import ParallelRequest
    from meshtron.train.planning import _searched_plan

    def predicted_step(clip: float) -> float:
        cfg = config_from_dict({"model": "llama3-8b", "optim": {"grad_clip": clip},
                                "data": {"global_batch": 8, "seq_len": 4096},
                                "train": {"dtype": "bf16"}})
        plan = _searched_plan(cfg, ParallelRequest(knobs={"tp": 1, "pp": 1, "dp": 8, "zero": 1}), 8,
                              resolve_cluster("dgx-h100:1"))
        return plan.predicted["step_time_s"]

    # llama3-8b on 8 GPUs, ZeRO-1: an eighth of 8.03e9 parameters clipped per rank, 3 x 4
    # bytes each (fp32 gradients) at 0.8 x HBM
    clip_s = 12.0 * PRESETS["llama3-8b"].num_params() / 8 / (3350e9 * C.HBM_EFFICIENCY)
    assert predicted_step(1.0) - predicted_step(0.0) == pytest.approx(clip_s, abs=2e-6)
