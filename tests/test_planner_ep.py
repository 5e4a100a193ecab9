"""Expert parallelism in the planner (issue 21, part 4): the ep axis in the search and on the
command line, expert memory, the all-to-all cost terms, the runtime's collective contract in
step_collectives, refusals by framework, router-statistics calibration. Torch-free."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import preset
from meshtron.planner import comm, memory, moe_cost, placement
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.collectives import step_collectives
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset as framework
from meshtron.planner.frameworks import with_options
from meshtron.planner.plan import Plan, plan_problems
from meshtron.planner.search import evaluate_plan, search_plans


def _ev(model="mixtral-8x7b", cluster="dgx-h100:4", batch=256, seq=4096, opts=None, mem=None):
    return Evaluator(preset(model), resolve_cluster(cluster), batch, seq, opts, mem=mem)


def _plan(tp=1, pp=1, dp=32, zero=2, mb=1, rec="full", ep=1, sched=None, v=1):
    return Plan.trusted(tp, pp, dp, zero, mb, rec, False, sched, v, "bf16", 1, 1, "fp32",
                        False, ep)


# ---- search and layouts -----------------------------------------------------------------------
def test_search_picks_ep_for_a_moe_and_every_plan_validates():
    model, cl = preset("mixtral-8x7b"), resolve_cluster("dgx-h100:4")
    r = search_plans(model, cl, 256, 4096)
    # Mixtral's 8 experts do not fit replicated with full activations: ep=1 plans recompute,
    # ep > 1 ones are among the best (since ep with selective recomputation needs ZeRO-3
    # without a pipeline, plan_rules.ep_runtime_problems, ep=1 ZeRO-3 selective and ep=8
    # pp=4 ZeRO-1 are within 1% of each other)
    assert all(e.config.recompute != "none" for e in r.plans if e.config.ep == 1)
    assert any(e.config.ep > 1 for e in r.plans)
    for est in r.plans:
        c = est.config
        assert model.moe_experts % c.ep == 0 and (c.dp // c.dp_replicate * c.cp) % c.ep == 0
        # the plan rules, meshtron's runtime limits included
        full = c.replace(global_batch=256, seq_len=4096)
        assert plan_problems(full.knobs_and_context(), cl.num_gpus, model) == []
    # the other ep degrees are explained against the best
    ep = r.best.config.ep
    assert any(f"ep={e}" in a.label for a in r.alternatives for e in (1, 2, 4, 8) if e != ep)


def test_cli_layout_fixes_ep_and_prints_it(capsys):
    import meshtron.cli as top

    rc = top.main(["plan", "--model", "deepseek-v3", "--cluster", "dgx-h100:256",
                   "--global-batch", "4096", "--seq-len", "4096",
                   "--layout", "tp=1,pp=16,dp=128,ep=64", "--json", "--top", "1",
                   "--framework", "torchtitan@2025"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    p = doc["plans"][0]
    assert (p["tp"], p["pp"], p["dp"], p["ep"]) == (1, 16, 128, 64)
    # 64 ranks of 8 nodes: the all-to-alls cross the network and are exposed in meshtron
    assert p["time_s"]["ep_comm"] > 0.1 * p["step_time_s"]
    # meshtron's own runtime runs ep inside a pipeline too (tests/test_ep_pp.py)
    rc = top.main(["plan", "--model", "deepseek-v3", "--cluster", "dgx-h100:256",
                   "--global-batch", "4096", "--seq-len", "4096",
                   "--layout", "tp=1,pp=16,dp=128,ep=64", "--json", "--top", "1"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    p = doc["plans"][0]
    # any ZeRO stage (issue 21: ZeRO-0/1 with ep run too; with dp = 128 the distributed
    # optimizer's one reduction per step is the cheapest here)
    assert (p["tp"], p["pp"], p["dp"], p["ep"]) == (1, 16, 128, 64)
    assert p["zero"] in (0, 1, 2, 3)


def test_dense_model_never_gets_ep_and_ep_must_divide_experts():
    r = search_plans(preset("llama3-8b"), resolve_cluster("dgx-h100:1"), 64, 4096)
    assert all(e.config.ep == 1 for e in r.plans)
    with pytest.raises(UserError, match=r"plan.ep=2: expert parallelism needs a mixture-of-experts model"):
        search_plans(preset("llama3-8b"), resolve_cluster("dgx-h100:1"), 64, 4096, {"ep": 2})
    with pytest.raises(UserError, match=r"plan.ep=3: must divide the model's 8 "):
        search_plans(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:1"), 48, 4096,
                     {"ep": 3})


@pytest.mark.parametrize("name", ["megatron@2021", "deepspeed@2021"])
def test_frameworks_without_expert_parallelism_refuse_ep_by_name(name):
    # their code had no MoE at all (plan_rules_stack): refused before ep is looked at
    with pytest.raises(UserError, match=r"--model mixtral-8x7b \(a mixture of experts\)"):
        search_plans(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:4"), 256, 4096,
                     {"ep": 8, "tp": 1}, framework=framework(name))
    # `layouts = "any"` prices the model anyway: with every expert on each rank
    fw = with_options(framework(name), {"layouts": "any"})
    with pytest.raises(UserError, match=rf"plan.ep=8: framework {name} \+1 option\(s\) has "
                                        "no expert"):
        search_plans(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:4"), 256, 4096,
                     {"ep": 8, "tp": 1}, framework=fw)
    r = search_plans(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:8"), 256, 4096,
                     {"tp": 1, "pp": 4}, framework=fw, explain=False)
    assert all(e.config.ep == 1 for e in r.plans)
    assert any("expert parallelism left out" in n for n in r.notes)


@pytest.mark.parametrize("name", ["torchtitan@2025", "megatron@2024", "deepspeed@2024",
                                  "meshtron"])
def test_frameworks_with_expert_parallelism_say_how(name):
    assert framework(name).expert_parallel


def test_meshtron_runs_ep_with_every_zero_stage():
    """Issue 21: ep composes with ZeRO 0-3 in the runtime (tests/test_ep_pp.py), so the search
    offers ZeRO-0/1 with ep too, and every plan it returns validates."""
    for zero in (0, 1):
        r = search_plans(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:4"), 256, 4096,
                         {"ep": 8, "tp": 1, "zero": zero}, explain=False)
        assert r.plans and all(e.config.zero == zero and e.config.ep == 8 for e in r.plans)
        for e in r.plans:
            e.config.validate(32, preset("mixtral-8x7b"))  # UserError if not
    m = search_plans(preset("mixtral-8x7b"), resolve_cluster("dgx-h100:4"), 256, 4096,
                     {"ep": 8, "pp": 2, "tp": 1}, framework=framework("megatron@2024"),
                     explain=False, top_k=50)
    assert any(e.config.zero == 1 for e in m.plans)


# ---- memory -----------------------------------------------------------------------------------
def test_expert_states_divide_by_ep_and_shard_over_the_rest():
    model = preset("mixtral-8x7b")
    experts = moe_cost.expert_params_per_layer(model) * model.moe_layers
    fw = framework("megatron@2024")
    ev = _ev(opts=fw.kernel, mem=fw.memory)
    gib = memory.GIB
    base = ev.evaluate(_plan(zero=1, ep=1)).memory
    ep8 = ev.evaluate(_plan(zero=1, ep=8)).memory
    # 16-bit weights and fp32 main grads of 7/8 of the experts leave the rank
    assert base.params - ep8.params == pytest.approx(experts * 7 / 8 * 2 / gib, rel=1e-9)
    assert base.grads - ep8.grads == pytest.approx(experts * 7 / 8 * 4 / gib, rel=1e-9)
    # ZeRO-1 optimizer states: over dp = 32 ranks dense, over dp/ep = 4 for the experts: the
    # same per rank (E/ep experts over S/ep ranks = E over S)
    assert base.optimizer == pytest.approx(ep8.optimizer, rel=1e-9)
    # meshtron (FSDP2) ZeRO-0 vs ZeRO-1 with ep=8 on dp=32: ZeRO-1 shards the dense parts'
    # moments (8 bytes) over 32 ranks, the E/ep local experts' over the dp/ep = 4 holding them
    fs = _ev()
    z0, z1 = fs.evaluate(_plan(zero=0, ep=8)).memory, fs.evaluate(_plan(zero=1, ep=8)).memory
    dense = model.num_params() - experts
    assert z0.optimizer - z1.optimizer == pytest.approx(
        8 * (dense * (1 - 1 / 32) + experts / 8 * (1 - 1 / 4)) / gib, rel=1e-9)
    # ZeRO-1 is FSDP2 over dp (the experts over the dp/ep = 4 holding them): parameters
    # sharded at rest too (rehearsed, issue 30); ZeRO-0 keeps them whole. Both keep the fp32
    # RoPE table, counted with the parameters (memory.rope_table_bytes)
    tables = memory.rope_table_bytes(model, 4096)
    assert z0.params == pytest.approx((4 * (dense + experts / 8) + tables) / gib, rel=1e-9)
    assert z1.params == pytest.approx((4 * (dense / 32 + experts / 8 / 4) + tables) / gib,
                                      rel=1e-9)
    # FSDP2 ZeRO-3: shards equal, but only E/ep experts are gathered at a time
    z3 = _ev()
    a, b = z3.evaluate(_plan(zero=3, ep=1)).memory, z3.evaluate(_plan(zero=3, ep=8)).memory
    assert a.params == pytest.approx(b.params, rel=1e-9)
    assert b.gathered < a.gathered / 4


def test_routed_activations_count_unless_recomputed_and_grow_with_the_imbalance():
    """moe_memory.py: what the routed part saves beyond the dense equivalent. Without
    recomputation it is positive and grows with the rows an ep rank receives (imbalance);
    full recomputation keeps only the block input (no extra), its replay working set holds
    the extra instead."""
    ev = _ev()
    none = ev._memory_pieces(1, 1, False, "none", "bf16", 1, 8)
    dense_ep = ev._memory_pieces(1, 1, False, "none", "bf16", 1, 1)
    assert none.activations > dense_ep.activations  # ep: received rows regrouped, kept
    extra, _ = ev._moe_memory(1, 1, False, "none", 4096, ev.mem, 8, "bf16")
    assert extra > 0
    skewed = _ev(opts=KernelOptions(expert_imbalance=2.0))
    assert skewed._moe_memory(1, 1, False, "none", 4096, ev.mem, 8, "bf16")[0] > extra
    full, work = ev._moe_memory(1, 1, False, "full", 4096, ev.mem, 8, "bf16")
    assert full == pytest.approx(0.0, abs=1.0) and work == pytest.approx(extra)


# ---- all-to-all and grouped GEMM terms --------------------------------------------------------
def test_a2a_bytes_and_placement_of_the_ep_group():
    assert moe_cost.a2a_bytes(4096, 8, 7168, 2, 64) == 4096 * 8 * 7168 * 2 * 63 / 64
    assert moe_cost.a2a_bytes(4096, 8, 7168, 2, 1) == 0.0
    assert placement.ep_group(1, 8, 8) == comm.Group(8, 8)
    assert placement.ep_group(1, 64, 8) == comm.Group(64, 8)
    assert placement.ep_group(2, 8, 8) == comm.Group(8, 4)  # tp*ep = 16 spans two nodes


def test_a2a_time_intra_node_is_nvlink_and_inter_node_is_the_nic():
    fab = comm.Fabric.of(resolve_cluster("dgx-h100:8"))
    nbytes = 64e6
    intra = moe_cost.a2a_time(nbytes, comm.Group(8, 8), fab)
    assert intra == pytest.approx(fab.base_latency + nbytes / fab.intra_bw + fab.intra_alpha)
    inter = moe_cost.a2a_time(nbytes, comm.Group(64, 8), fab)
    off_node = nbytes * 56 / 63
    assert inter == pytest.approx(fab.base_latency + off_node / fab.inter_bw + fab.inter_alpha)
    # DeepSeek's node-limited routing: a token crosses to at most M nodes, once each
    limited = moe_cost.a2a_time(nbytes, comm.Group(64, 8), fab, top_k=8, node_limit=4)
    assert limited == pytest.approx(fab.base_latency + off_node / 2 / fab.inter_bw
                                    + fab.inter_alpha)


def test_all_to_all_counted_per_layer_fwd_bwd_and_recompute():
    ev = _ev()
    model = preset("mixtral-8x7b")
    group = placement.ep_group(1, 8, 8)
    mc = moe_cost.moe_layer_cost(model, ev.cluster, 4096.0, 8, group, "bf16",
                                 KernelOptions().expert_imbalance, False, 0, "eager")
    fab = comm.Fabric.of(ev.cluster)
    one = moe_cost.a2a_time(mc.a2a_bytes * KernelOptions().expert_imbalance, group, fab)
    assert mc.a2a_fwd == pytest.approx(2 * one) and mc.a2a_bwd == pytest.approx(2 * one)
    share = model.moe_layers / model.layers
    assert ev._moe(1, "none", 1, "bf16", 8)[2] == pytest.approx(share * 4 * one)
    assert ev._moe(1, "full", 1, "bf16", 8)[2] == pytest.approx(share * 6 * one)
    est = ev.evaluate(_plan(pp=1, rec="full", ep=8))
    assert est.time.ep_comm == pytest.approx(est.num_microbatches * model.layers * share * 6
                                             * one, rel=1e-9)
    assert est.step_time_s == pytest.approx(est.time.total)


def test_overlap_and_imbalance_change_the_cost_in_the_right_direction():
    plan = _plan(pp=1, rec="full", ep=8)
    base = _ev().evaluate(plan)
    hidden = _ev(opts=KernelOptions(ep_overlap=True)).evaluate(plan)
    skewed = _ev(opts=KernelOptions(expert_imbalance=2.0)).evaluate(plan)
    assert hidden.time.ep_comm < 0.5 * base.time.ep_comm
    assert skewed.time.ep_comm > base.time.ep_comm and skewed.time.compute > base.time.compute
    with pytest.raises(UserError, match=r"expert_imbalance=0.5"):
        KernelOptions(expert_imbalance=0.5)


def test_grouped_gemm_rows_grow_with_ep_and_small_ones_cost_more():
    model = preset("qwen3-30b-a3b")  # 128 experts of 768: small per-expert GEMMs
    assert moe_cost.routed_tokens_per_expert(4096, model, 1) == 4096 * 8 / 128
    assert moe_cost.routed_tokens_per_expert(4096, model, 8) == 4096 * 8 * 8 / 128
    cl = resolve_cluster("dgx-h100:1")
    g = comm.Group(1, 1)
    no_ep = moe_cost.moe_layer_cost(model, cl, 4096.0, 1, g, "bf16", 1.0, False, 0, "fused")
    ep8 = moe_cost.moe_layer_cost(model, cl, 4096.0, 8, placement.ep_group(1, 8, 8), "bf16",
                                  1.0, False, 0, "fused")
    # 256 rows per expert lose to tile quantisation against the dense equivalent's 4096
    assert no_ep.compute_fwd > 0 and ep8.compute_fwd < no_ep.compute_fwd


# ---- step_collectives: the runtime's contract (meshtron/parallel/expert.py) --------------------
def _counts(plan, model, batch, seq, pp_rank=0):
    return {(c.kind, c.axis, c.bytes, c.dtype): (c.count, c.group_size)
            for c in step_collectives(plan, model, batch, seq, pp_rank)}


def test_step_collectives_ep_matches_the_runtime_contract():
    model = preset("tiny-moe")  # 4 MoE blocks, E = 8, k = 2, h = 128, expert width 96
    plan = Plan(tp=1, pp=1, dp=4, zero=3, micro_batch=2, ep=2, global_batch=16, seq_len=64)
    got = _counts(plan, model, 16, 64)
    m = 16 // (4 * 2)
    row = 2 * 64 * 2 * 128 * 4  # T * k * h * fp32
    assert got[("all_to_all", "ep", row, "fp32")] == (4 * m * 4, 2)
    assert got[("all_to_all", "ep", 8 * 8, "int64")] == (4 * m, 2)
    local = 8 // 2 * 3 * 96 * 128  # E/ep experts of one block
    shard = 4 // 2
    assert got[("all_gather", "dp_shard_mod_ep", local // shard * 4, "fp32")] == (4 * 2 * m,
                                                                                  shard)
    assert got[("reduce_scatter", "dp_shard_mod_ep", local * 4, "fp32")] == (4 * m, shard)
    # the block's own FSDP unit no longer holds the experts
    block = model.layer_params(0) - 8 * 3 * 96 * 128
    assert ("reduce_scatter", "dp_shard", block * 4, "fp32") in got


def test_step_collectives_ep_recompute_dense_layers_and_pipeline():
    model = preset("tiny-moe-ds")  # block 0 dense
    row = 1 * 64 * 2 * 128 * 2  # bf16
    full = Plan(tp=1, pp=1, dp=2, zero=2, micro_batch=1, ep=2, recompute="full",
                dtype="bf16", global_batch=4, seq_len=64)
    got = _counts(full, model, 4, 64)
    m = 2
    assert got[("all_to_all", "ep", row, "bf16")] == (3 * m * 6, 2)  # 3 MoE blocks
    assert got[("all_to_all", "ep", 64, "int64")] == (3 * m * 2, 2)
    half = dataclasses.replace(full, recompute="half")
    # local positions 1 and 3 recomputed: blocks 1 and 3, both MoE
    assert _counts(half, model, 4, 64)[("all_to_all", "ep", row, "bf16")] == (
        m * (6 + 4 + 6), 2)
    piped = Plan(tp=1, pp=2, dp=2, zero=2, micro_batch=1, ep=2, dtype="bf16",
                 global_batch=8, seq_len=64)
    first, last = _counts(piped, model, 8, 64, 0), _counts(piped, model, 8, 64, 1)
    assert first[("all_to_all", "ep", row, "bf16")] == (4 * 4 * 1, 2)  # block 1 only
    assert last[("all_to_all", "ep", row, "bf16")] == (4 * 4 * 2, 2)


@pytest.mark.parametrize("zero", [0, 1])
def test_zero01_experts_priced_as_step_collectives_counts_them(zero):
    """ZeRO-0/1 with ep: the routed experts of each MoE block are reduced once a step over the
    dp/ep ranks holding them ("dp_mod_ep", as the runtime runs it: tests/test_ep_pp.py counts
    it on gloo); the evaluator's expert reduction and gather time (estimate._dp_with_experts ->
    once_per_step on placement.expert_groups) is exactly those calls priced by comm.py."""
    model = preset("mixtral-8x7b")
    ev = _ev()
    plan = _plan(zero=zero, dp=32, ep=8)
    groups = ev._groups(plan)["experts"]
    assert groups["dp"].size == 32 // 8
    counts = [c for c in step_collectives(plan, model, 256, 4096) if c.axis == "dp_mod_ep"]
    assert {c.kind for c in counts} == ({"all_reduce"} if zero == 0
                                        else {"reduce_scatter", "all_gather"})
    assert all(c.count == model.moe_layers and c.group_size == 4 for c in counts)
    # nothing of the experts is left on the dense axes: only the MoE blocks' dense units
    dense = {c.bytes for c in step_collectives(plan, model, 256, 4096)
             if c.axis == "dp_replicate"}
    block = model.layer_params(0) - moe_cost.expert_params_per_layer(model)
    assert block * 4 in dense
    flags = ev.dp_flags(plan)
    experts = moe_cost.expert_params_local(model, 1, 8) * model.layers
    red, gather = ev.once_per_step(experts, zero, groups, flags["gsize"], flags["wsize"],
                                   model.moe_layers)
    fns = {"all_reduce": comm.all_reduce, "reduce_scatter": comm.reduce_scatter}
    want_red = sum(c.count * fns[c.kind](c.bytes, groups["dp"], ev.fab) for c in counts
                   if c.kind in fns)
    want_gather = sum(c.count * comm.all_gather(c.bytes * c.group_size, groups["dp"], ev.fab)
                      for c in counts if c.kind == "all_gather")
    assert red > 0 and red == pytest.approx(want_red, rel=1e-12)
    assert gather == pytest.approx(want_gather, rel=1e-12)
    assert (gather > 0) == (zero == 1)
    est = ev.evaluate(plan)
    assert est.time.dp_comm > 0 and est.config.zero == zero


# ---- calibration from router statistics -------------------------------------------------------
def test_calibrate_router_stats_writes_the_imbalance_option(tmp_path, capsys):
    import meshtron.cli as top
    from meshtron.planner.frameworks import resolve

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "loss": 1.0, "moe_imbalance_mean": 3.0 if i == 0 else 1.5}
            for i in range(10)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "router.toml"
    assert top.main(["calibrate", "--router-stats", str(metrics), "--out", str(out)]) == 0
    assert "expert imbalance 1.500" in capsys.readouterr().out
    assert resolve(None, out).kernel.expert_imbalance == 1.5
    assert top.main(["calibrate", "--router-stats", str(tmp_path / "none.jsonl")]) == 2


def test_overlapped_all_to_alls_hide_behind_the_paired_layers_whole_computation():
    """DualPipe / Megatron-Core's 1F1B A2A overlap pair a forward chunk with another
    micro-batch's backward chunk: the four all-to-alls of a layer run beside the pair's
    attention and MLP, not beside the expert GEMMs alone (moe_cost.overlapped_a2a)."""
    from meshtron.planner.overlap import OVERLAP_INTERFERENCE

    # fits: only the interference of the hidden part remains, split by direction
    f, b = moe_cost.overlapped_a2a(2.0, 2.0, 3.0, 6.0)
    assert (f, b) == pytest.approx((OVERLAP_INTERFERENCE * 2.0, OVERLAP_INTERFERENCE * 2.0))
    # too long: what exceeds the pair's computation stays exposed
    f, b = moe_cost.overlapped_a2a(6.0, 6.0, 3.0, 6.0)
    assert f + b == pytest.approx(12.0 - 9.0 + OVERLAP_INTERFERENCE * 9.0)
    assert f == pytest.approx(b)
    # a window of the whole dense-equivalent layer hides more than the routed GEMMs alone
    model, cl = preset("deepseek-v3"), resolve_cluster("dgx-h100:64")
    group = placement.ep_group(1, 64, 8)
    args = (model, cl, 4096.0, 64, group, "bf16", 1.0, True, 4, "fused")
    bare = moe_cost.moe_layer_cost(*args)
    wide = moe_cost.moe_layer_cost(*args, 1, 1, 0.05, 0.10)
    assert wide.a2a_fwd + wide.a2a_bwd < bare.a2a_fwd + bare.a2a_bwd
    closed = moe_cost.moe_layer_cost(*args[:7], False, *args[8:])
    assert bare.a2a_fwd < closed.a2a_fwd


def test_evaluator_passes_the_dense_layer_as_the_overlap_window():
    # Qwen3-30B-A3B's 128 small experts over 4 nodes: the all-to-alls cross the NICs and
    # outlast the expert GEMMs, not the whole layer
    ev = _ev(model="qwen3-30b-a3b", opts=KernelOptions(ep_overlap=True))
    plan = _plan(pp=1, rec="full", ep=32)
    est = ev.evaluate(plan)
    window = ev._cache[("window", 1, 1, False, "full", 1, "bf16", 32, plan.fp8_recipe)]
    assert window[0] > 0 and window[1] > window[0]
    hidden = ev._moe(1, "full", 1, "bf16", 32, 1, window)[2]
    assert hidden < 0.9 * ev._moe(1, "full", 1, "bf16", 32)[2]
    assert est.time.ep_comm == pytest.approx(
        est.num_microbatches * preset("qwen3-30b-a3b").layers * hidden, rel=1e-9)


def test_host_issue_of_a_moe_layer_counts_per_expert_launches_of_te_grouped_linear():
    """Transformer Engine's GroupedLinear (Megatron-Core) issues split, allocations,
    quantisation and one cuBLAS GEMM per local expert; torch._grouped_mm one launch: the host
    time of a layer grows with E/ep only for the former."""
    d = 10e-6
    f16, b16 = moe_cost.host_seconds("fp8", 16, True, d)
    f4, b4 = moe_cost.host_seconds("fp8", 4, True, d)
    pf, pb = moe_cost.PER_EXPERT_HOST_OPS["fp8"]
    assert f16 - f4 == pytest.approx(12 * pf * d) and b16 - b4 == pytest.approx(12 * pb * d)
    g16, g4 = moe_cost.host_seconds("fp8", 16, False, d), moe_cost.host_seconds("fp8", 4, False, d)
    assert g16 == g4 and g16[0] < f4
    # bf16 GroupedLinear skips the quantisation and its allocations
    assert moe_cost.host_seconds("bf16", 16, True, d)[0] < f16
    assert moe_cost.per_expert_gemms("megatron") and not moe_cost.per_expert_gemms("fsdp2")


def test_host_bound_moe_layer_waits_for_its_host_between_syncs():
    # GPU-bound pair: nothing exposed; host-bound: the excess, split by host share
    assert moe_cost.host_exposed(3.0, 6.0, 2.0, 4.0) == (0.0, 0.0)
    f, b = moe_cost.host_exposed(1.0, 2.0, 2.0, 2.0)
    assert f + b == pytest.approx(1.0) and f == pytest.approx(b)
    # through moe_layer_cost: a host 100x slower per operation makes a small-expert layer
    # host-bound, and more local experts (ep 2 vs 8: 64 vs 16 of Qwen3's 128) cost more host
    model = preset("qwen3-30b-a3b")
    slow = dataclasses.replace(resolve_cluster("dgx-h100:1"), eager_kernel_overhead_us=1000.0)
    fast = resolve_cluster("dgx-h100:1")

    def cost(cl, ep, per_expert=True):
        return moe_layer_cost_with_window(model, cl, ep, per_expert)

    assert cost(slow, 8).compute_fwd > cost(fast, 8).compute_fwd
    assert cost(slow, 2).compute_fwd - cost(fast, 2).compute_fwd \
        > cost(slow, 8).compute_fwd - cost(fast, 8).compute_fwd
    assert cost(slow, 8, False).compute_fwd < cost(slow, 8).compute_fwd
    # without a window (caller does not know the layer), the host is not priced
    bare = moe_cost.moe_layer_cost(model, slow, 4096.0, 8, placement.ep_group(1, 8, 8), "fp8",
                                   1.0, False, 0, "fused", 1, 1, 0.0, 0.0, True)
    ref = moe_cost.moe_layer_cost(model, fast, 4096.0, 8, placement.ep_group(1, 8, 8), "fp8",
                                  1.0, False, 0, "fused", 1, 1, 0.0, 0.0, True)
    assert bare.compute_fwd == pytest.approx(ref.compute_fwd)


def moe_layer_cost_with_window(model, cl, ep, per_expert):
    return moe_cost.moe_layer_cost(model, cl, 4096.0, ep, placement.ep_group(1, ep, 8), "fp8",
                                   1.0, False, 0, "fused", 1, 1, 1e-3, 2e-3, per_expert)


def test_slow_host_makes_megatrons_small_experts_host_bound_through_the_evaluator():
    """Through `evaluate`: at a host cost per operation high enough to bind, Megatron-Core's
    per-expert GroupedLinear pays for every local expert (ep 2 holds 64 of Qwen3's 128, ep 8
    holds 16), and the same layout on the same slow host is faster with ep 8."""
    from meshtron.planner.frameworks import PRESETS

    mcore = PRESETS["megatron@2024"]
    slow = dataclasses.replace(resolve_cluster("dgx-h100:2"), eager_kernel_overhead_us=200.0)
    fast = resolve_cluster("dgx-h100:2")

    def step(cl, ep):
        ev = Evaluator(preset("qwen3-30b-a3b"), cl, 256, 4096, mcore.kernel, mem=mcore.memory)
        return ev.evaluate(_plan(dp=16, zero=1, ep=ep, rec="full")).time.compute

    slow2, slow8, fast2, fast8 = step(slow, 2), step(slow, 8), step(fast, 2), step(fast, 8)
    assert slow2 > fast2 and slow8 > fast8
    assert slow2 - fast2 > slow8 - fast8


@pytest.mark.parametrize("dispatch", ["fp8", "deepep", "hybridep"])
def test_meshtrons_runtime_refuses_dispatches_it_does_not_run(dispatch, tmp_path, capsys):
    # parallel/expert.py dispatches with torch's all_to_all_single only: one line, exit 2
    import meshtron.cli as top

    options = tmp_path / "options.toml"
    options.write_text(f'framework = "meshtron"\n[options]\nep_dispatch = "{dispatch}"\n')
    args = ["plan", "--model", "qwen3-30b-a3b", "--cluster", "dgx-h100:16",
            "--global-batch", "512", "--seq-len", "4096", "--options", str(options)]
    assert top.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"options.ep_dispatch='{dispatch}': meshtron's runtime dispatches with" in err
    # the stacks whose code runs it are priced with it
    fw = with_options(framework("megatron-bridge"), {"ep_dispatch": dispatch})
    r = search_plans(preset("qwen3-30b-a3b"), resolve_cluster("dgx-h100:16"), 512, 4096,
                     {"ep": 8}, framework=fw, explain=False, top_k=1)
    assert r.best is not None
