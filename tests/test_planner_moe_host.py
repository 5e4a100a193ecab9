"""The host issue of a MoE layer between two dispatcher syncs (planner/moe_host.py): after a
sync the queue is empty, so host-heavy work right after it starves the GPU whatever the totals
say. Planner-only, no torch."""

from __future__ import annotations

import pytest

from meshtron.model.spec import preset
from meshtron.planner import compute, moe_cost, moe_host, placement
from meshtron.planner.cluster import resolve_cluster


def test_makespan_is_the_gpu_time_when_the_host_stays_ahead():
    # every segment issues faster than it runs: the GPU never waits
    segs = [(1.0, 2.0), (0.5, 3.0), (1.0, 1.5)]
    assert moe_host.queue_makespan(segs) == pytest.approx(6.5)


def test_host_heavy_work_after_the_sync_is_never_recovered():
    # same totals (host 3, GPU 4) in two orders: GPU-heavy first hides the host entirely;
    # host-heavy first leaves the GPU idle until the host is done with it
    gpu_first = [(0.5, 3.0), (2.5, 1.0)]
    host_first = [(2.5, 1.0), (0.5, 3.0)]
    assert moe_host.queue_makespan(gpu_first) == pytest.approx(4.0)
    # the second segment's 3.0 of GPU work is first issued at 2.5, when the host is done
    # with the first: it ends at 5.5 whatever the totals
    assert moe_host.queue_makespan(host_first) == pytest.approx(5.5)
    # the old rule (max of the totals) sees no difference between the two
    assert moe_host.host_exposed(4.0, 0.0, 3.0, 0.0) == (0.0, 0.0)


def test_makespan_is_never_below_either_total():
    cases = [[(3.0, 1.0)], [(1.0, 1.0), (1.0, 1.0)], [(0.0, 2.0), (4.0, 0.5), (0.1, 0.1)]]
    for segs in cases:
        h, g = sum(x for x, _ in segs), sum(y for _, y in segs)
        assert moe_host.queue_makespan(segs) >= max(h, g) - 1e-12


def _work(experts_f, expert_ops_f):
    return moe_host.MoeWork(pre_f=1.0e-3, dispatch_f=0.3e-3, experts_f=experts_f,
                            combine_f=0.5e-3, combine_b=0.5e-3, dispatch_b=0.5e-3,
                            experts_b=2 * experts_f, wgrad_b=experts_f, attn_b=2.0e-3,
                            dense_ops=10,
                            expert_ops_f=expert_ops_f, expert_ops_b=expert_ops_f)


def test_forward_wait_is_what_the_forward_alone_costs():
    d = 10e-6
    # experts issuing 160 ops (1.6 ms) beside 0.5 ms of GPU work, right after the sync
    wait_f, wait_b = moe_host.ordered_wait(_work(0.5e-3, 160), d)
    fwd = moe_host.forward_segments(_work(0.5e-3, 160), d)
    own = moe_host.queue_makespan(fwd) - sum(g for _, g in fwd)
    assert wait_f == pytest.approx(min(own, wait_f + wait_b)) and wait_f > 0
    # a handful of host ops per layer: nothing to wait for
    assert moe_host.ordered_wait(_work(0.5e-3, 4), d) == (0.0, 0.0)


def _cost(tokens, per_expert, ep=8):
    model = preset("qwen3-30b-a3b")
    cl = resolve_cluster("dgx-h100:2")
    lc = compute.layer_cost(compute.active_equivalent(model), cl, 1, 1, int(tokens), False,
                            compute.KernelOptions(), 1, "fp8")
    args = (model, cl, float(tokens), ep, placement.ep_group(1, ep, 8), "fp8", 1.0, False, 0,
            "fused", 1, 1)
    return (moe_cost.moe_layer_cost(*args, lc.fwd, lc.bwd, per_expert),
            moe_cost.moe_layer_cost(*args, 0.0, 0.0, per_expert), lc)


def test_megatrons_per_expert_issue_starves_the_gpu_at_small_micro_batches_only():
    """Qwen3-30B-A3B on H100 with ep 8 (16 local experts, FP8 GroupedLinear): at 4096 tokens
    the experts' host issue after the sync outlasts their GPU work and the GPU waits, though
    the layer's host total is below its GPU total (the old rule priced nothing); at 16384
    tokens the GPU work covers it."""
    small, small_bare, lc = _cost(4096, True)
    d = compute.dispatch_s(resolve_cluster("dgx-h100:2"))
    hf, hb = moe_cost.host_seconds("fp8", 16, True, d)
    gpu = lc.fwd + lc.bwd + (small_bare.compute_fwd + small_bare.compute_bwd
                             + small.a2a_fwd + small.a2a_bwd)
    assert hf + hb < gpu  # the totals alone would hide the host
    wait = (small.compute_fwd - small_bare.compute_fwd) + (small.compute_bwd
                                                           - small_bare.compute_bwd)
    assert wait > 0
    big, big_bare, _ = _cost(16384, True)
    assert big.compute_fwd == pytest.approx(big_bare.compute_fwd)
    assert big.compute_bwd == pytest.approx(big_bare.compute_bwd)
    # one grouped launch (torch._grouped_mm) issues too little to matter
    grouped, grouped_bare, _ = _cost(4096, False)
    assert grouped.compute_fwd == pytest.approx(grouped_bare.compute_fwd)


def test_fp8_experts_quantise_the_routed_rows_at_the_stacks_cast_bytes():
    """Transformer Engine's GroupedLinear quantises the T*k permuted rows (both layouts, 4
    bytes an element under delayed scaling; current scaling's amax pass reads them once more:
    6), where the dense equivalent's fc1 input came quantised out of its norm (fp8.CastBytes
    .normed_fwd: delayed scaling's fused norm writes FP8 and transposes it, 1 byte; current
    scaling's norm computes the amax itself in TE >= 2.7, 4 bytes)."""
    from meshtron.planner.fp8 import cast_bytes

    routed, dense = 8.0e6, 1.0e6
    d_f, d_b = moe_cost.expert_cast_bytes("te-delayed", routed, dense)
    c_f, c_b = moe_cost.expert_cast_bytes("te-current", routed, dense)
    delayed, current = cast_bytes("te-delayed"), cast_bytes("te-current")
    assert (delayed.input_fwd, delayed.normed_fwd, current.input_fwd, current.normed_fwd) == (
        4.0, 1.0, 6.0, 4.0)
    assert d_f == pytest.approx(4.0 * 8.0e6 - 1.0 * 1.0e6)
    assert c_f == pytest.approx(6.0 * 8.0e6 - 4.0 * 1.0e6)
    assert d_b == pytest.approx(delayed.grad_bwd * (routed - dense))
    assert c_b > d_b and c_f > d_f
    # through the layer: current scaling costs the FP8 experts more
    model = preset("qwen3-30b-a3b")
    cl = resolve_cluster("dgx-h100:2")
    args = (model, cl, 4096.0, 8, placement.ep_group(1, 8, 8), "fp8", 1.0, False, 0, "fused")
    cur = moe_cost.moe_layer_cost(*args, fp8_scaling="te-current")
    dly = moe_cost.moe_layer_cost(*args, fp8_scaling="te-delayed")
    assert cur.compute_fwd > dly.compute_fwd and cur.compute_bwd > dly.compute_bwd


def test_merged_schedule_starts_its_stretch_with_the_experts_input_gradients():
    """Megatron-Core's merged forward-backward (EP all-to-all overlap) issues the experts'
    input-gradient backward before the dispatch sync: the GPU has it to run while the host
    issues the delayed weight gradients and the forward experts, so the same work waits less
    than in separate passes; a host slower than the whole stretch still binds."""
    d = 10e-6
    w = _work(0.5e-3, 160)
    merged = moe_host.merged_segments(w, d)
    # the backlog first (no host), the next stretch's input-gradient issue last (no GPU)
    assert merged[0][0] == 0.0 and merged[0][1] == pytest.approx(w.experts_b - w.wgrad_b)
    assert merged[-1][1] == 0.0
    assert sum(g for _, g in merged) == pytest.approx(
        sum(g for _, g in moe_host.stretch_segments(w, d)))
    assert sum(moe_host.ordered_wait(w, d, merged=True)) <= sum(moe_host.ordered_wait(w, d))
    slow = 1e-3  # 1 ms per operation: the host is the stretch
    f, b = moe_host.ordered_wait(w, slow, merged=True)
    host = sum(h for h, _ in moe_host.merged_segments(w, slow))
    assert f + b == pytest.approx(host - sum(g for _, g in merged)) and f > 0 and b > 0


def test_token_drop_padded_to_capacity_has_no_sync_so_the_host_runs_ahead():
    """Megatron-Core's alltoall dispatcher with drop_and_pad builds its splits on the host from
    the capacity and never syncs (moe_host.dispatcher_syncs): the experts' host issue that
    starves the GPU after a sync at 4096 tokens (the test above) costs nothing there, the
    layer's host total being below its GPU total; and the step drops the per-layer sync."""
    model, cl = preset("qwen3-30b-a3b"), resolve_cluster("dgx-h100:2")
    lc = compute.layer_cost(compute.active_equivalent(model), cl, 1, 1, 4096, False,
                            compute.KernelOptions(), 1, "fp8")
    args = (model, cl, 4096.0, 8, placement.ep_group(1, 8, 8), "fp8", 1.0, False, 0, "fused",
            1, 1)

    def wait(capacity):
        kw = dict(per_expert=True, capacity=capacity)
        with_host = moe_cost.moe_layer_cost(*args, lc.fwd, lc.bwd, **kw)
        bare = moe_cost.moe_layer_cost(*args, 0.0, 0.0, **kw)
        return (with_host.compute_fwd - bare.compute_fwd) + (with_host.compute_bwd
                                                            - bare.compute_bwd)

    assert wait(0.0) > 0
    assert wait(1.0) == pytest.approx(0.0, abs=1e-12)
    assert moe_host.dispatcher_syncs(True, "bf16", 0.0)
    assert not moe_host.dispatcher_syncs(True, "bf16", 1.0)
    assert not moe_host.dispatcher_syncs(True, "hybridep", 1.0)
    assert moe_host.dispatcher_syncs(True, "deepep", 1.0)  # DeepEP waits for its counts
    assert moe_host.dispatcher_syncs(False, "bf16", 1.0)  # meshtron / torchtitan


def test_an_unsynced_layer_waits_only_for_a_host_slower_than_its_gpu():
    w = moe_host.MoeWork(pre_f=1.0, dispatch_f=0.5, experts_f=1.0, combine_f=0.5, combine_b=1.0,
                         dispatch_b=1.0, experts_b=2.0, wgrad_b=1.0, attn_b=1.0, dense_ops=10,
                         expert_ops_f=40, expert_ops_b=60)
    # host 80 + 100 ops: 1.8 s at 0.01 s an op, GPU 3 + 5 s: nothing waits
    assert moe_host.unsynced_wait(w, 0.01) == (0.0, 0.0)
    # at 0.1 s an op the host takes 8 + 10 s against the GPU's 8: 10 s of waiting, split by
    # each pass's host time
    f, b = moe_host.unsynced_wait(w, 0.1)
    assert f + b == pytest.approx(10.0) and f == pytest.approx(10.0 * 8 / 18)
