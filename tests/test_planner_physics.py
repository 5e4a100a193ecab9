"""Physics of the planner's time model: NCCL collectives, ZeRO-3 per-unit communication, the
software stack, and the honest validation table (bench/planner_published.py) as a regression."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.comm import (Fabric, Group, all_gather, all_reduce, bus_bandwidth,
                                   reduce_scatter, ring_bus_bw, ring_latency)
from meshtron.planner.compute import KernelOptions, layer_cost
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan
from bench.published.table import gpt_model, predict_published, summary
from bench.published.runs import published_runs
from bench.published.stacks import DEEPSPEED_ZERO3_2021

FAB = Fabric.of(resolve_cluster("dgx-a100:256"))


# ---- collectives -------------------------------------------------------------------------------
def test_ring_latency_grows_with_ranks_and_nodes():
    # NCCL tuning model: baseLat + (nsteps - nInterSteps) hwLat_NVLink + nInterSteps hwLat_NET
    one_node = ring_latency(Group(8, 8), FAB)
    assert one_node == pytest.approx(FAB.base_latency + 7 * FAB.intra_alpha)
    lats = [ring_latency(Group(n, 8), FAB) for n in (64, 256, 1024)]
    assert lats == sorted(lats) and lats[-1] > 10 * lats[0]
    expected = FAB.base_latency + (1023 - 127) * FAB.intra_alpha + 127 * FAB.inter_alpha
    assert lats[-1] == pytest.approx(expected)
    # an all-reduce runs the ring twice
    assert ring_latency(Group(64, 8), FAB, all_reduce=True) == pytest.approx(
        2 * ring_latency(Group(64, 8), FAB) - FAB.base_latency)


def test_small_per_rank_chunks_never_reach_link_speed():
    group = Group(1024, 8)
    peak = ring_bus_bw(group, FAB)
    big, small = bus_bandwidth(64e9, group, FAB), bus_bandwidth(64e6, group, FAB)
    assert big > 0.9 * peak
    assert small < 0.2 * peak  # 64 kB per rank: the 1,023 step latencies dominate
    # the same buffer over more ranks is slower (latency grows, volume does not)
    assert all_gather(256e6, Group(1024, 8), FAB) > all_gather(256e6, Group(64, 8), FAB)


def test_flat_rings_use_one_nic_per_member_in_a_node():
    # rail-aligned: a group with one member per node runs at one NIC's rate, a group filling
    # nodes at min(NVLink, 8 NICs)
    assert ring_bus_bw(Group(32, 1), FAB) == pytest.approx(FAB.inter_bw)
    assert ring_bus_bw(Group(256, 8), FAB) == pytest.approx(min(FAB.intra_bw, 8 * FAB.inter_bw))
    assert ring_bus_bw(Group(8, 8), FAB) == pytest.approx(FAB.intra_bw)
    assert all_reduce(1e9, Group(32, 1), FAB) > all_reduce(1e9, Group(256, 8), FAB)


def test_tree_all_reduce_wins_for_small_messages_at_scale():
    group = Group(4096, 8)
    ring_only = ring_latency(group, FAB, all_reduce=True) + 2 * 1e4 / ring_bus_bw(group, FAB)
    assert all_reduce(1e4, group, FAB) < 0.2 * ring_only  # log2(nodes) latency, not 2n
    # large buffers: the ring's full bandwidth
    assert all_reduce(1e10, group, FAB) <= ring_latency(group, FAB, True) + 2e10 / ring_bus_bw(
        group, FAB)


def test_hierarchical_reduce_scatter_is_two_levels():
    group = Group(64, 8)
    two = reduce_scatter(1e9, group, FAB, hierarchical=True)
    expected = reduce_scatter(1e9, Group(8, 8), FAB) + reduce_scatter(1e9 / 8, Group(8, 1), FAB)
    assert two == pytest.approx(expected)


# ---- ZeRO-3 / FSDP -----------------------------------------------------------------------------
def _zero3(gpus: int, opts: KernelOptions, batch: int = 1536, mb: int | None = None):
    model = gpt_model("gpt-175B", 96, 12288, 96)
    cl = dataclasses.replace(resolve_cluster(f"dgx-a100:{gpus // 8}"), memory_gib=1e6)
    mb = mb or batch // gpus
    ev = Evaluator(model, cl, batch, 2048, opts)
    return ev.evaluate(Plan(1, 1, gpus, 3, mb, "full", False, None, 1, dtype="bf16",
                            attention=opts.attention))


def test_zero3_per_gpu_throughput_falls_as_gpus_grow_at_fixed_batch():
    # FSDP-style (one unit per layer, one-unit prefetch): falls, gently
    fsdp = KernelOptions(attention="unfused", dropout=True, stack="fused")
    tf = [_zero3(g, fsdp).hardware_tflops_per_gpu for g in (384, 768, 1536)]
    assert tf[0] > tf[1] > tf[2]
    # DeepSpeed 2021 (per-submodule fetches, 5e7-parameter prefetch, re-gather around
    # recomputation): the ring latencies of ~2,300 collectives per step grow with the ranks
    ds = [_zero3(g, DEEPSPEED_ZERO3_2021).hardware_tflops_per_gpu for g in (384, 768, 1536)]
    assert ds[0] > ds[1] > ds[2]
    assert ds[2] < 0.6 * ds[0]
    # Megatron's 3D layout at the same scale keeps per-GPU throughput nearly flat (N21, Table 2)
    runs = {r.name: r for r in published_runs()}
    ptd = [predict_published(runs[f"N21 PTD-P 175B {g}"]).predicted for g in (384, 1536)]
    assert ptd[1] > 0.9 * ptd[0]


def test_zero3_collectives_are_counted_per_unit():
    base = KernelOptions(attention="unfused", dropout=True, stack="fused")
    per_layer = _zero3(1536, base).time.dp_comm
    per_module = _zero3(1536, dataclasses.replace(base, shard_units_per_layer=6)).time.dp_comm
    bucket = _zero3(1536, dataclasses.replace(base, shard_units_per_layer=6,
                                              prefetch_params=5e7)).time.dp_comm
    none = _zero3(1536, dataclasses.replace(base, shard_units_per_layer=6,
                                            prefetch_params=0.0)).time.dp_comm
    assert per_module > per_layer  # six times the collectives, each with its ring latency
    # DeepSpeed's bucket admits whole parameters: any bucket prefetches the next unit whole
    assert bucket == pytest.approx(per_module)
    assert none > per_module  # no prefetch (DeepSpeed 0.3): every gather exposed
    staged = _zero3(1536, dataclasses.replace(base, shard_units_per_layer=6, prefetch_params=5e7,
                                              list_collectives=True)).time.dp_comm
    assert staged > bucket  # staging copies on the collectives' path


def test_list_collectives_pay_host_time_per_rank_and_per_reduced_parameter():
    """DeepSpeed 0.3.x: the host walks every rank of every list-based call, so the extra time per
    call doubles with the ranks; reducing each parameter separately (12 per GPT layer) costs
    more calls than reducing per gathered unit (4)."""
    from meshtron.planner.estimate import LIST_HOST_S_PER_RANK
    base = KernelOptions(attention="unfused", dropout=True, stack="fused",
                         shard_units_per_layer=4, prefetch_params=0.0,
                         overlap_grad_reduce=False)
    listed = dataclasses.replace(base, list_collectives=True)
    extra = {g: _zero3(g, listed).time.dp_comm - _zero3(g, base).time.dp_comm
             for g in (384, 768)}
    # one micro-batch: 96 layers x (4 forward gathers, 4 backward gathers, 4 reduce-scatters),
    # each paying n x host time on top of its staging copies
    calls = 96 * 12
    for g, e in extra.items():
        assert e > calls * g * LIST_HOST_S_PER_RANK
    assert extra[768] > 1.5 * extra[384]  # twice the ranks per call
    per_param = _zero3(768, dataclasses.replace(listed, reduce_units_per_layer=12)).time.dp_comm
    assert per_param > _zero3(768, listed).time.dp_comm


def test_zero3_hides_comm_behind_compute_when_units_are_big_enough():
    # 8B on one node: per-layer all-gathers over NVLink hide behind each layer's compute, only
    # the first unit's fill, the last reduce-scatter and the interference remain
    model = PRESETS["llama3-8b"]
    ev = Evaluator(model, dataclasses.replace(resolve_cluster("dgx-h100:1"), memory_gib=1e6), 16,
                   8192, KernelOptions())
    est = ev.evaluate(Plan(1, 1, 8, 3, 2, "none", False, None, 1, dtype="bf16"))
    assert est.time.dp_comm < 0.05 * est.time.compute


# ---- software stack ----------------------------------------------------------------------------
def test_eager_pytorch_is_slower_than_fused_kernels():
    cl = resolve_cluster("dgx-h100:1")
    llama = PRESETS["llama3-8b"]
    eager = layer_cost(llama, cl, 1, 2, 8192, False, KernelOptions(stack="eager"))
    fused = layer_cost(llama, cl, 1, 2, 8192, False, KernelOptions(stack="fused"))
    # eager's fp32 RMSNorm (36 bytes against 4), 14-kernel RoPE and two-kernel SwiGLU: 4-5% of
    # the layer at seq 8192 (1.05 until 2026-12-05, when eager still paid a layout copy after
    # the flash kernel that SDPA does not make: elementwise.py, ttcosts2)
    assert eager.fwd > 1.04 * fused.fwd and eager.bwd > 1.04 * fused.bwd
    # GPT-style layers (one-kernel LayerNorm and GeLU in both stacks) differ much less
    gpt = PRESETS["gpt3-175b"]
    g_e = layer_cost(gpt, cl, 8, 1, 2048, False, KernelOptions(stack="eager"))
    g_f = layer_cost(gpt, cl, 8, 1, 2048, False, KernelOptions(stack="fused"))
    assert g_e.fwd / g_f.fwd < eager.fwd / fused.fwd


def test_eager_dispatch_bounds_tiny_layers():
    cl = resolve_cluster("dgx-h100:1")
    tiny = PRESETS["tiny"]
    eager = layer_cost(tiny, cl, 1, 1, 128, False, KernelOptions(stack="eager"))
    assert eager.fwd >= 20 * 10e-6  # dozens of kernels at ~10 us of host dispatch each


def test_torchtitan_compile_speedup_matches_the_stack_model():
    runs = {r.name: r for r in published_runs()}
    eager = predict_published(runs["TT Llama3.1 8B 8 eager"])
    comp = predict_published(runs["TT Llama3.1 8B 8 compile"])
    published = comp.run.published / eager.run.published  # 6667 / 5762
    assert comp.predicted / eager.predicted == pytest.approx(published, rel=0.06)


# ---- the validation table (bench/planner_published.py) -----------------------------------------
@pytest.fixture(scope="module")
def table():
    # session 40's rows (runs.ADDED_S40) are bounded apart, through the command line
    # (test_session40_rows_hold_their_first_run); three of their layouts the planner refuses;
    # so are session 41's (runs.ADDED_S41, test_session41_rows_hold_their_first_run) and
    # session 42's (runs.ADDED_S42, test_session42_rows_hold_their_first_run)
    from bench.published.runs import ADDED_S40, ADDED_S41, ADDED_S42

    return [predict_published(r) for r in published_runs()
            if r.name not in ADDED_S40 | ADDED_S41 | ADDED_S42]


def test_validation_table_covers_stacks_and_gpu_generations(table):
    val = [p for p in table if p.run.part == "validation"]
    assert len(val) >= 25
    assert len({p.run.stack.split()[0] for p in val}) >= 4
    gens = {(p.run.cluster.gpu or "").split("-")[0] for p in val}
    assert {"V100", "A100", "H100"} <= gens


def test_validation_errors_do_not_regress(table, capsys):
    """Honest current numbers (bench/planner_published.py, internal presets, memory ignored):
    validation (rows nothing looked at) n=31 mean 7.9%, max 25.2% (Megatron-Bridge's 405B on
    1024 H100, added in round 2 of issue 18 and run once); the 26 bf16 rows of 2019-2024 alone
    mean 6.4%, max 25.0%; calibration (K22, every row that steered a mechanism: `steered`, and
    the torchtitan 2D/3D/4D and Llama 3 405B rows looked at in round 2: `LOOKED_AT`) n=46 mean
    13.1%, max 31.5% (DeepSpeed 0.3 ZeRO-3). Tighten these bounds as the physics improves, never
    by editing rows.

    Issue 30 (physics branch): the tensor-parallel collectives now hide only behind their own
    GEMM, as Transformer Engine's userbuffers run them (compute.tp_exposed), which costs the
    FP8 Megatron-Bridge 405B rows (tp 8, cp 2: small per-GPU GEMMs) more; with the other
    issue-30 terms (optimizer implementation, gradient accumulation, the compiled stack,
    FSDP2's copy-out, pipeline fill chains and overlap_p2p_comm): n=31 mean 6.8%, max 26.6%
    (MB26.02 405B, too slow); bf16 rows mean 5.0%, max 25.0%; calibration mean 11.3%, max
    31.5%. The bound on the maximum moved from 0.26 to 0.28 for that row; the means tightened.

    The mixture-of-experts rows with expert parallelism (issue 21 part 4, validation, added
    before they were first run) are summarised apart: DeepSeek-V3's report -12.1% (was -6.4%
    before issue 30 priced Megatron-Core's sort of the received chunks by local expert, two
    more memory-bound passes over the T*k slots: the row runs DeepSeek's stack priced as
    Megatron-Core's, whose DeepEP dispatch may not make them); the two Megatron-Bridge
    Qwen3-30B-A3B rows on 16 H100 +53% and +117% (the planner is optimistic: 128 small
    experts on 2 nodes, FP8; what it misses there is not known yet).

    Issue 30 (moetime): an overlapping stack's all-to-alls hide behind the paired micro-batch's
    whole layer (DualPipe's forward chunk beside another micro-batch's backward chunk,
    DeepSeek-V3 report section 3.2.1, which states both all-to-alls are fully hidden), not the
    expert GEMMs alone (moe_cost.overlapped_a2a). DeepSeek-V3 through the command line (memory
    counted, micro-batch 1): -37.8% -> -17.8%; here (memory ignored, where the planner's step
    is 30% shorter than the fitting plan's for reasons outside the MoE terms) -12.1% -> +18.7%.
    The bound moved from 0.13 to 0.20 for that row; the Qwen3 rows are unchanged (their stack
    does not overlap the all-to-alls; the per-layer host issue priced with them does not bind
    at compute.DISPATCH_S).

    Issue 30 (fp8): FP8 casts priced per recipe and stack (planner/fp8.py cast_bytes; the
    Megatron presets run Transformer Engine's delayed scaling, whose norms write FP8 and whose
    weights are cast once per step): DeepSeek-V3 through the command line -17.8% -> -14.9%,
    here +18.7% -> +22.9%. The bound moved from 0.20 to 0.25 for that row.

    Issue 30 (session 34): the Qwen3 rows measure a regression Megatron-Bridge's maintainers
    tracked and fixed (issue #1998: dropless 2x slower than token drop, 25.11 2x slower than
    25.09); their inputs now follow the rows' recipes (FP8 current scaling, A2A overlap, bf16
    gradient reduction, no recomputation), and they are held to "faster than the regressed
    figure" instead of a bound on their error.

    Issue 30 item 3 (ttcosts2, 2026-12-05; main's GEMM-model attention core kept): what the
    FA2 stacks run around the kernel, from their code: torchtitan's repeat_kv copies and
    complex RoPE (no inductor code for complex tensors), torch's ring attention (fp32 merges
    and dk/dv sums, K/V all-gathered at every query head, the last fp32 dk/dv send exposed),
    context parallelism's calls as made (the causal diagonal plus unmasked chunk pairs, each
    at its own GEMM shapes) and no layout copy after a flash kernel. Here: validation 5.1% ->
    5.4% (max 25.0%), calibration 11.0% -> 10.1% (max 31.5%); bounds unchanged.

    Issue 30 (dsv3, 2026-12-05): DeepSeek-V3's all-to-alls toward the experts carry FP8 rows
    with 1x128 scales, its combines BF16 (report section 3.3.3; DeepEP's "FP8 dispatching and
    BF16 combining"; KernelOptions.ep_dispatch, moe_cost.a2a_dtype_bytes). Through the command
    line -17.2% -> -15.4%; here (memory ignored: an even split, no ZB-H1 stage carrying 5-6
    blocks of the 3.8 mean) +22.9% -> +25.3%. What the two views differ by is DualPipe priced
    as ZB-H1 on a memory-driven split (bench/dsv3_pieces.py, docs/measurements.md
    #dsv3-pieces): not changed here. The bound moved from 0.25 to 0.26 for that row.

    Issue 30 (dualpipe, 2026-12-05): DualPipe priced as DeepSeek's code runs it (stages r and
    PP-1-r on one rank, half the micro-batches through each, the README's bubble, transfers
    hidden: planner/pipeline_dualpipe.py), its activation savings and BF16 moments
    (MemoryOptions, report 3.2.3 / 3.3.3) and its MTP module (ModelSpec.mtp_depth = 1:
    planner/mtp.py). Here +25.3% -> +22.2%, through the command line -15.4% -> +22.2%
    (the same split, [3, 4 x 14, 2]: no memory-driven ZB-H1 split any more; the planner still
    finds it 121 GiB per rank). The bound is back at 0.25.

    Session 41 (branch qwen3reg): the Qwen3 regression rows' recipes read again (FP8
    parameters, 26.02's DeepEP) after their errors were known: calibration now, still held by
    `regressed` and left out of the calibration bound as they were of the validation one; no
    bound moved (validation n=26 mean 4.7% max 24.4%, calibration n=77 mean 8.6% max 28.5%,
    as before)."""
    # the bounds below were written for the rows before session 39; the rows it added
    # (runs.ADDED_S39, validation, never looked at) are bounded apart, at their first run's
    # figures (mean 9.6%, max 46.3%: bench/results/planner_cli_table_2026-12-05_valrows.txt)
    # so that they cannot regress unseen; a physics change that moves them reports it.
    # Session 39 looked at 25 of them: the 12 NeMo rows (branch nemomem: their memory, which
    # set their gradient-buffer dtype), TTA_2506's four float8 rowwise rows (branch rowwise:
    # the cost of torchao rowwise) and the 9 MC24 rows (branch smallgemm: Megatron-Core DDP's
    # edge bucket, bucket passes, the unfused loss): calibration (runs.LOOKED_AT), summarised
    # with it and held apart at their figures after those branches (mean 5.8%, max 14.1%);
    # the bound is recomputed over the 10 rows still unseen (TT24 float8, TTA_2506 bf16 and
    # tensorwise), at their figures when the branches merged: mean 4.9%, max 10.3%.
    # Session 42 (branch cp8b) priced Transformer Engine's p2p ring ops from its code
    # (ring_attention.te_ring_bytes), which slows the two NeMo 24.07 Llama 3 cp 2 rows among
    # the looked-at ones: their mean 5.9% -> 6.04%, max 14.1% unchanged; the bound recomputed
    # from that run, 6% -> 6.5%
    # Session 42 (branch memfix): FSDP1's and FSDP2's passes around each all-gather and
    # reduce-scatter priced from torch's code (dp_cost.gather_prep_s, grad_prep_s: FSDP2's
    # reduce-scatter copy-in, 6 bytes per unsharded parameter per reduction, was not priced)
    # slowed the two TT24 float8 rows (-7.7 -> -9.2%, -3.4 -> -4.6%) and TTA_2506's by 0.1-0.2
    # points: mean 5.1%, max 10.4%, and the mean's bound recomputed from them (0.05 -> 0.052)
    # Session 44 (branch planner44): the row-parallel output gradient gathered in FP8 where the
    # stack's code gathers it so (Transformer Engine's grad_output_preprocess, torchao's
    # Float8RowwiseParallel; the planner's casts already assumed it, its wire was bf16) makes
    # the tensorwise TP rows faster (TTA_2506 8B tensorwise TP +9.0% -> +12.2%): mean 5.8%,
    # max 10.9%; both bounds recomputed from that run (0.052 -> 0.06, 0.105 -> 0.11), a
    # regression of the table that the code's physics causes, said so in the branch's report
    from bench.published.runs import ADDED_S39

    assert len([p for p in table if p.run.name in ADDED_S39]) == len(ADDED_S39) == 35
    added = [p for p in table if p.run.name in ADDED_S39 and p.run.part == "validation"]
    assert len(added) == 10
    new = summary(added)
    seen = [p for p in table if p.run.name in ADDED_S39 and p.run.part == "calibration"]
    looked = summary(seen)
    table = [p for p in table if p.run.name not in ADDED_S39] + seen
    dense = [p for p in table if p.run.ep == 1]
    val = summary([p for p in dense if p.run.part == "validation"])
    old = summary([p for p in dense if p.run.part == "validation" and p.run.dtype == "bf16"])
    moe = {p.run.name: p for p in table if p.run.ep > 1}
    # DeepSeek-V3 steered the FP8 GEMM kinds (session 34): calibration, still bounded
    assert len(moe) == 3 and moe["DSV3 671B 2048xH800"].run.part == "calibration"
    assert abs(moe["DSV3 671B 2048xH800"].error) < 0.25
    # the Qwen3 rows measure Megatron-Bridge's dropless regression (issue #1998, "25.11 is 2X
    # slower than 25.09", PublishedRun.regression): the planner prices the software without it,
    # so it must stay faster than those figures; the other MoE rows keep the DSV3 bound
    regressed = [p for p in moe.values() if p.run.regression]
    assert len(regressed) == 2 and all(p.error > 0 for p in regressed)
    assert max(abs(p.error) for p in moe.values() if not p.run.regression) < 0.25
    # the two regression rows became calibration in session 41 (branch qwen3reg: their recipes
    # read again); they are held by `regressed` above, not by the calibration bound
    cal = summary([p for p in table if p.run.part == "calibration" and p not in regressed])
    with capsys.disabled():
        print(f"\nvalidation: n={val['n']} mean {val['mean']:.1%} max {val['max']:.1%} "
              f"(bf16 rows: n={old['n']} mean {old['mean']:.1%} max {old['max']:.1%}); "
              f"calibration: n={cal['n']} mean {cal['mean']:.1%} max {cal['max']:.1%}; "
              f"session 39 rows unseen: n={new['n']} mean {new['mean']:.1%} "
              f"max {new['max']:.1%}, looked at: n={looked['n']} mean {looked['mean']:.1%} "
              f"max {looked['max']:.1%}")
    assert new["mean"] < 0.06 and new["max"] < 0.11
    assert looked["mean"] < 0.065 and looked["max"] < 0.145
    assert val["mean"] < 0.075 and val["max"] < 0.28
    assert old["mean"] < 0.06 and old["max"] < 0.26
    assert cal["mean"] < 0.12 and cal["max"] < 0.33
    k22 = summary([p for p in table if p.run.name.startswith("K22")])
    assert k22["max"] < 0.10


def test_session40_rows_hold_their_first_run(capsys):
    """Session 40's validation rows (runs.ADDED_S40, bench/published/rows_2025.py: Megatron-
    Bridge 25.09 / 25.11 / 26.04.01 on DGX-H100, NeMo AutoModel on H100, torchtitan on H200),
    priced as a user would, through `meshtron plan` (bench/planner_cli_table.py), bounded at
    their first run's figures rounded up to the next half point: a regression guard of that
    run, not a goal (issue 30's goal is mean <= 10%, max <= 25%, every layout answered).
    First run (2026-12-05, bench/results/planner_cli_table_2026-12-05_valrows2.txt): 18 rows,
    15 answered (4 predicted not to fit), 3 refused (Qwen3-235B at TP 2 x DP 16 with EP 32:
    Megatron-Core folds EP over TP x DP with expert TP 1, the planner's layout rule folds it
    over DP x CP only); mean 18.5%, max 46.0%; the 8 dense rows mean 8.9%, max 15.2%; the 7
    answered MoE rows mean 29.6%, max 46.0%, every one but one predicted too slow.
    Branch eptp (2026-12-05, bench/results/planner_cli_table_2026-12-05_eptp.txt): Megatron-
    Core's folding priced (Plan.etp, the recipes' etp 1): the three Qwen3-235B rows answered
    for the first time (+11.5%, +25.3%, +16.6%; validation, nothing tuned after), DeepSeek-V3
    1024xH100 -46.0% -> -4.5% (its recipe's etp 1); 18 answered (4 not fitting), mean 16.1%,
    max 42.1%; dense unchanged; MoE mean 21.9%, max 42.1%.
    Six of the MoE rows were then examined (branch automoe: the four AutoModel MoE rows,
    Megatron-Bridge's DeepSeek-V3 and its 26.04.01 Qwen3-30B-A3B) and are calibration
    (runs.LOOKED_AT); bounded here, from their first run, is what remains validation: 12 rows,
    9 answered (none predicted not to fit), the same 3 refused; mean 8.5% (8.48), max 15.2%;
    the 8 dense rows as above; the one answered MoE row (25.09 Qwen3-30B-A3B token drop)
    +5.3%.
    Branch mcoremoe (session 41) examined the two dropless Qwen3-235B rows (25.11, 26.04.01:
    runs.LOOKED_AT, calibration since). Recomputed from the remaining 10 rows then (all
    answered, none unfit): mean 8.1%, max 15.2%; dense as above; the two token-drop MoE rows
    (Qwen3-30B-A3B +1.4%, Qwen3-235B-A22B +8.4%) mean 4.9%, max 8.4%; then, with the same
    branch's token drop priced without the dispatcher's sync (moe_host.dispatcher_syncs: the
    code has none there), +1.5% and +8.6%: mean 5.0%, max 8.6%, the bounds at 5.5% / 9%.
    Session 42 (branch cp8b) read Megatron-Bridge 25.09's Llama 3 8B row (tp 1, cp 1, -15.2%)
    beside the cp 2 8B rows: calibration since (runs.LOOKED_AT). Recomputed from the remaining
    9 (all answered, none unfit): mean 7.1% (7.06), max 11.4%; the 7 dense rows mean 7.7%
    (7.67), max 11.4% (torchtitan's Llama 3.1 8B FP8 on 64 H200, too fast); MoE as above.
    Then branch memfix priced FSDP2's reduce-scatter copy-in from torch's code (dp_cost.
    grad_prep_s), which slows NeMo AutoModel's Llama 3 70B at cp 2 (-9.3% -> -12.1%): the max
    bound recomputed from that run, 11.5% -> 12.5% (mean 7.1%, dense 7.8%, within theirs).
    Session 49 put context parallelism's exchange into the step at tp = 1 (estimate_time.py:
    it was dropped there with the tensor collectives' rounding guard, while priced at tp > 1),
    which slows the same row again by torch's ring attention's exposed sends (-12.1% ->
    -13.6%): the bounds recomputed from that run, max 12.5% -> 14%, dense mean 8% -> 8.5%
    (mean 7.47%, dense 8.2%)."""
    from bench.planner_cli_table import run_row, summarise
    from bench.published.runs import ADDED_S40, LOOKED_AT

    every_s40 = [r for r in published_runs() if r.name in ADDED_S40]
    assert len(every_s40) == len(ADDED_S40) == 18
    # what steered a choice is calibration with its reason; the rest never did
    looked = [r for r in every_s40 if r.name in LOOKED_AT]
    assert len(looked) == 9 and all(r.part == "calibration" for r in looked)
    runs = [r for r in every_s40 if r.name not in LOOKED_AT]
    assert len(runs) == 9 and all(r.part == "validation" for r in runs)
    rows = [run_row(r) for r in runs]
    every = summarise(rows, "validation")
    dense = summarise([r for r in rows if not r["run"].model.is_moe], "validation")
    moe = summarise([r for r in rows if r["run"].model.is_moe], "validation")
    with capsys.disabled():
        print(f"\nsession 40 rows: n={every['n']} answered {every['answered']} (unfit "
              f"{every['unfit']}), rejected {every['rejected']}; mean {every['mean']:.1%} max "
              f"{every['max']:.1%}; dense n={dense['n']} mean {dense['mean']:.1%} max "
              f"{dense['max']:.1%}; MoE answered {moe['answered']} mean {moe['mean']:.1%} "
              f"max {moe['max']:.1%}")
    assert every["rejected"] == 0 and every["answered"] == 9 and every["unfit"] == 0
    assert every["mean"] < 0.075 and every["max"] < 0.14
    assert dense["answered"] == 7 and dense["mean"] < 0.085 and dense["max"] < 0.14
    assert moe["answered"] == 2 and moe["mean"] < 0.055 and moe["max"] < 0.09


def test_session41_rows_hold_their_first_run(capsys):
    """Session 41's validation rows (runs.ADDED_S41, bench/published/rows_2026.py: NVIDIA's DGX
    Cloud benchmarking recipes on H100, NVIDIA/dgxc-benchmarking v24.11.1 and v25.05: Llama 3.1
    8B / 70B / 405B, Nemotron-4 15B / 340B and GPT-3 175B on NeMo 24.05-24.09, BF16 and FP8 at
    their smallest and largest GPU counts, and DeepSeek-V3 BF16 on 1,024 H100 on NeMo 25.04.01),
    priced as a user would, through `meshtron plan` (bench/planner_cli_table.py), bounded at
    their first run's figures rounded up to the next half point: a regression guard of that
    run, not a goal. First run (2026-12-05, bench/results/planner_cli_table_2026-12-05_
    valrows3.txt): 25 rows, 25 answered (2 predicted not to fit: Nemotron-4 340B on 128 H100,
    86.8 and 81.9 GiB), none refused; mean 8.5% (8.47), max 26.6% (DeepSeek-V3, too fast);
    the 24 dense rows mean 7.7%, max 21.6% (GPT-3 175B FP8 on 2,048 H100, too fast).
    DeepSeek-V3 was then examined (branch mcoremoe, runs.LOOKED_AT): calibration, still held
    at its first run's bound; Nemotron-4 340B BF16 on 128 H100, whose not-to-fit verdict a
    reviewer saw before NeMo's master-weight rule reached the DGXC rows, is calibration too;
    the other 23 dense rows stayed validation, bounded as before (the dense bounds were already
    theirs), and since the session's memory fixes every one of them fits.
    Session 42 (branch fp8scale) read the 12 FP8 rows' errors growing with the GPU count to
    size and judge Transformer Engine's amax all-reduces (planner/fp8_amax.py): calibration
    since (runs.LOOKED_AT), held at that run's figures (bench/results/planner_cli_table_
    2026-12-05_fp8scale.txt: mean 9.0% (8.96), max 19.3%, GPT-3 175B on 2,048 H100; they were 9.4%
    and 21.6%); the 11 BF16 rows left as validation, which the change does not touch, are
    bounded at their own figures of that run (mean 5.3%, max 11.7%, GPT-3 175B on 2,048 H100).
    Session 42 (branch cp8b) read the two Llama 3.1 8B BF16 rows (tp 1, cp 2, too slow) to
    compare the cp price with Transformer Engine's p2p ring: calibration since
    (runs.LOOKED_AT); the 9 BF16 rows left, after that branch's ring ops: mean 4.5% (4.54),
    max 11.7% (GPT-3 175B on 2,048 H100). Its Transformer Engine ring ops, priced from the
    code, slow the FP8 rows at cp 2 (Llama 3.1 8B / 70B / 405B: 0.7-1.8 points each): their
    mean 8.96% -> 9.04%, max 19.3% unchanged (GPT-3 175B, cp 1); the mean's bound recomputed
    from that run, 9% -> 9.5%. The same branch read the four Llama 3.1 70B / 405B BF16 rows
    beside a faster attention core's estimate and kept the core's rate because they would
    overshoot: a choice they steered, so calibration too (the lead, at the merge). The 5 BF16
    rows left (Nemotron-4 15B / 340B, GPT-3 175B) are bounded at their own figures of that run:
    mean 7.4% (7.36), max 11.7% (a different set, not a wider bound: the rows that left were
    the closer ones).
    Session 44 (branch planner44): the row-parallel output gradients gathered in FP8, as
    Transformer Engine's code gathers them (module/base.py grad_output_preprocess), move the
    FP8 rows faster by up to 1.6 points (bench/results/planner_cli_table_2026-12-06_s44.txt):
    mean 9.8% (9.78), max 19.9% (GPT-3 175B on 2,048 H100); the FP8 bounds recomputed from
    that run, 9.5% -> 10%, 19.5% -> 20%."""
    from bench.planner_cli_table import run_row, summarise
    from bench.published.runs import ADDED_S41, LOOKED_AT

    every_s41 = [r for r in published_runs() if r.name in ADDED_S41]
    assert len(every_s41) == len(ADDED_S41) == 25
    # what steered a choice is calibration with its reason (DeepSeek-V3, session 41's
    # mcoremoe); the rest never did
    fp8 = {r.name for r in every_s41 if r.dtype == "fp8"}
    assert len(fp8) == 12
    cp8b = {f"DGXC Llama3.1 {size} {gpus}xH100 BF16" for size, gpus in
            (("8B", 8), ("8B", 128), ("70B", 64), ("70B", 2048), ("405B", 576), ("405B", 2304))}
    assert ADDED_S41 & LOOKED_AT.keys() == {"DGXC25 DSV3 671B 1024xH100 BF16 tokendrop",
                                            "DGXC Nemotron4 340B 128xH100 BF16"} | fp8 | cp8b
    assert all(r.part == "calibration" for r in every_s41 if r.name in LOOKED_AT)
    runs = [r for r in every_s41 if r.name not in LOOKED_AT]
    assert len(runs) == 5 and all(r.part == "validation" for r in runs)
    rows = [run_row(r) for r in runs]
    every = summarise(rows, "validation")
    # the FP8 rows, calibration since fp8scale, held at that run's figures
    fp8_rows = summarise([run_row(r) for r in every_s41 if r.name in fp8], "calibration")
    # DeepSeek-V3, calibration since mcoremoe, still held at its first run's bound
    dsv3 = run_row(next(r for r in every_s41 if r.model.is_moe))
    with capsys.disabled():
        print(f"\nsession 41 rows: n={every['n']} answered {every['answered']} (unfit "
              f"{every['unfit']}), rejected {every['rejected']}; mean {every['mean']:.1%} max "
              f"{every['max']:.1%}; DeepSeek-V3 (calibration) {dsv3['error']:+.1%}; FP8 "
              f"(calibration) mean {fp8_rows['mean']:.1%} max {fp8_rows['max']:.1%}")
    assert every["rejected"] == 0 and every["answered"] == 5 and every["unfit"] == 0
    assert all(not r["run"].model.is_moe for r in rows)
    assert every["mean"] < 0.075 and every["max"] < 0.12
    assert fp8_rows["answered"] == 12 and fp8_rows["mean"] < 0.10 and fp8_rows["max"] < 0.20
    assert abs(dsv3["error"]) < 0.27


def test_session42_rows_hold_their_first_run(capsys):
    """Session 42's validation rows (runs.ADDED_S42): NVIDIA's DGX Cloud benchmarking recipes,
    NVIDIA/dgxc-benchmarking v25.04 on H100 (bench/published/rows_dgxc2504.py: Llama 3.1 8B /
    70B / 405B and Nemotron-4 15B / 340B on NeMo 2.0, the 25.02.01 container; GPT-3 175B on
    NeMo 1.0's launcher, 24.12; BF16 and FP8 at their smallest and largest GPU counts) and
    allenai/OLMo-core's README throughput table (rows_olmo_core.py: OLMo 1B / 7B / 13B and
    Llama 8B on one node of 8 H100, FSDP2 with torch.compile, priced on torchtitan@2025),
    priced as a user would, through `meshtron plan` (bench/planner_cli_table.py), bounded at
    their first run's figures rounded up to the next half point: a regression guard of that
    run, not a goal. First runs (2026-12-05, bench/results/planner_cli_table_2026-12-05_
    valrows4.txt, then _valrows4_olmc.txt with the OLMo-core rows, committed before it; the
    DGXC rows' figures identical in both): 31 rows, 31 answered, none predicted not to fit,
    none refused; mean 7.2% (7.23), max 24.7% (OLMo 1B FP8, too fast). DGXC2504: 24 rows,
    mean 5.6% (5.61), max 16.6% (GPT-3 175B FP8 on 2,048 H100, too fast); its 20 NeMo 2.0
    rows mean 5.0% (4.95), max 14.7% (Llama 3.1 8B FP8 on 8 H100, too slow); its 4 GPT-3 rows
    mean 8.9%, max 16.6%. OLMC: 7 rows, every one too fast, mean 12.8% (12.76), max 24.7%.
    Branch cp8b (session 42) read the four Llama 3.1 8B rows (tp 1, cp 2, 12.6-14.7% too
    slow) to compare the cp price with Transformer Engine's p2p ring: calibration since
    (runs.LOOKED_AT). The 27 left, after that branch's ring ops (bench/results/
    planner_cli_table_2026-12-05_cp8b.txt): mean 6.2% (6.23), max 24.7%; the 16 NeMo 2.0 rows
    mean 2.8% (2.81), max 8.7% (Llama 3.1 70B FP8 on 64 H100, too slow); GPT-3 and OLMC as
    before. cp8b also read the eight 70B / 405B rows beside a faster attention core's estimate
    and kept the core's rate because they would overshoot: calibration too (the lead, at the
    merge). The 19 left: mean 7.3% (7.33), max 24.7% (OLMo 1B FP8); the 8 NeMo 2.0 rows
    (Nemotron-4 15B / 340B) mean 2.0% (1.98), max 7.0%: a different set, not a wider bound.
    Branch fix42a (session 42, the review's corrections of inputs from their sources, not
    fits): OLMo-1B.py runs the unfused fp32 loss (fused_loss unset), which the 1B rows priced
    as the fused one (OLMo 1B BF16 23.0% -> 16.8%, FP8 24.7% -> 17.4% too fast), and the
    selection rule's 13B FP8 row (README at 41400c46fc, 5,500 TPS), missed at first, was added
    (22.6% too fast); nothing else here moved (bench/results/planner_cli_table_2026-12-05_
    fix42a.txt). The bounds recomputed from that run, rounded up to the next half point: 20
    rows, mean 7.4% (7.42), max 22.6% (OLMo 13B FP8); NeMo 2.0 mean 1.98%, max 6.98%; GPT-3
    mean 8.5% (8.52), max 15.5% (15.48); OLMC 8 rows, mean 12.3% (12.31), max 22.6%.
    Merged with branch memfix (FSDP2's reduce-scatter copy-in and all-gather prep priced from
    torch's code, dp_cost.grad_prep_s / gather_prep_s), which slows the OLMo-core rows (FSDP2
    on one node, all too fast): 20 rows mean 5.8% (5.83), max 15.6% (15.64); OLMC mean 8.3%
    (8.32), max 15.6%; the two bounds tightened to that run (the lead, at the merge).
    Branch olmocore (session 43) priced the OLMC rows on the olmo-core@2024 preset written from
    OLMo-core's code, their torchtitan@2025 errors known: calibration since (runs.LOOKED_AT),
    bounded apart as a regression guard at that run (bench/results/planner_cli_table_2026-12-
    05_olmocore.txt): mean 6.5% (6.45), max 21.3% (OLMo 13B FP8, too fast: FSDP's float8
    all-gather, which OLMo-core's Float8Config turns on, moved it from 13.8%). The 12 validation
    rows left (the DGXC NeMo 2.0 and GPT-3 rows, unmoved): mean 4.2% (4.16), max 15.5%
    (15.48, GPT-3 175B FP8 on 2,048 H100): the whole-set bounds recomputed from them, the
    NeMo 2.0 and GPT-3 ones unchanged.
    Session 44 (branch planner44, bench/results/planner_cli_table_2026-12-06_s44.txt): two
    terms read from the stacks' code, both making rows faster: the row-parallel output
    gradients gathered in FP8 (Transformer Engine's grad_output_preprocess; the 12 validation
    rows mean 4.5% (4.49), max 16.1% (GPT-3 175B FP8 on 2,048 H100, 15.5% -> 16.1%); NeMo 2.0
    mean 2.3%, max 7.3% (Nemotron-4 15B FP8 on 2,048 H100); GPT-3 mean 8.8%, max 16.1%) and
    torchao's FP8 all-gather casting each weight on its shard before the gather instead of in
    the Linear (planner/fp8_gather.py; OLMC mean 6.8%, max 23.0%, OLMo 13B FP8). The bounds
    these moved recomputed from that run: a regression of the table the code's physics
    causes, not hidden: said so in the branch's report."""
    from bench.planner_cli_table import run_row, summarise
    from bench.published.runs import ADDED_S42, LOOKED_AT

    every_s42 = [r for r in published_runs() if r.name in ADDED_S42]
    assert len(every_s42) == len(ADDED_S42) == 32
    # what steered a choice is calibration (branch cp8b's 8B rows); the rest never did
    cp8b = {f"DGXC2504 Llama3.1 {size} {gpus}xH100 {dt}" for size, gpus in
            (("8B", 8), ("8B", 128), ("70B", 64), ("70B", 2048), ("405B", 512), ("405B", 2048))
            for dt in ("BF16", "FP8")}
    olmocore = {r.name for r in every_s42 if r.name.startswith("OLMC")}
    assert len(olmocore) == 8
    assert ADDED_S42 & LOOKED_AT.keys() == cp8b | olmocore
    assert all(r.part == "calibration" for r in every_s42 if r.name in cp8b | olmocore)
    runs = [r for r in every_s42 if r.name not in cp8b]
    assert len(runs) == 20
    assert all(r.part == "validation" for r in runs if r.name not in olmocore)
    rows = [run_row(r) for r in runs]

    def part(keep) -> dict:
        return summarise([dict(r, run=dataclasses.replace(r["run"], part="validation"))
                          for r in rows if keep(r["run"])], "validation")

    every = part(lambda run: run.name not in olmocore)
    nemo2 = part(lambda run: "NeMo 2.0" in run.stack)
    gpt3 = part(lambda run: run.name.startswith("DGXC2504 GPT3"))
    olmc = part(lambda run: run.name.startswith("OLMC"))
    with capsys.disabled():
        print(f"\nsession 42 rows: n={every['n']} answered {every['answered']} (unfit "
              f"{every['unfit']}), rejected {every['rejected']}; mean {every['mean']:.1%} max "
              f"{every['max']:.1%}; NeMo 2.0 n={nemo2['n']} mean {nemo2['mean']:.1%} max "
              f"{nemo2['max']:.1%}; GPT-3 n={gpt3['n']} mean {gpt3['mean']:.1%} max "
              f"{gpt3['max']:.1%}; OLMo-core n={olmc['n']} mean {olmc['mean']:.1%} max "
              f"{olmc['max']:.1%}")
    assert every["rejected"] == 0 and every["answered"] == 12 and every["unfit"] == 0
    assert (nemo2["n"], gpt3["n"], olmc["n"]) == (8, 4, 8)
    assert olmc["answered"] == 8 and olmc["unfit"] == 0
    assert all("--framework olmo-core@2024" in " ".join(r["args"]) for r in rows
               if r["run"].name in olmocore)
    assert every["mean"] < 0.045 and every["max"] < 0.165
    assert nemo2["mean"] < 0.025 and nemo2["max"] < 0.075
    assert gpt3["mean"] < 0.09 and gpt3["max"] < 0.165
    assert olmc["mean"] < 0.07 and olmc["max"] < 0.235


def test_automodel_moe_layouts_that_ran_fit():
    """Issue 30 item 2: a layout that ran must not be predicted not to fit. NeMo AutoModel's
    DeepSeek-V3 (256 H100), Kimi K2 and Qwen3-30B-A3B ran on 80 GB; through the command line
    with the bf16 model, the experts outside FSDP2 where their ep_shard group is one rank and
    DeepEP (branch automoe) they fit (first run: 107.0, 118.6, 97.0 GiB, predicted not to
    fit; now 67.0, 63.4, 51.5 GiB with DeepEP's buffers and the bf16 loss). Calibration rows
    (runs.LOOKED_AT): a guard, not a validation.
    AutoModel's DeepSeek-V3 on 1,024 H100 still needs 87.5 GiB: its 8 local micro-batches run
    4 times per step (LBS 8, GA 4 in the summary), which no plan input states, so torch's
    receive buffers are priced for 32 micro-batches (docs/measurements.md #automoe-s40)."""
    from bench.planner_cli_table import run_row

    names = ("AM DSV3 671B 256xH100", "AM Kimi K2 256xH100", "AM Qwen3 30B-A3B 8xH100")
    rows = [run_row(r) for r in published_runs() if r.name in names]
    assert len(rows) == 3
    for row in rows:
        assert row["status"] == "ok", (row["run"].name, row.get("need"))
        assert row["need"] < 68.0


def test_runtime_zero_stages_cost_what_fsdp2_runs():
    """meshtron's runtime (sharding='fsdp') reduces ZeRO-0/1 gradients once per step whatever
    the number of micro-batches, in the plan's reduce_dtype, and runs ZeRO-1 as a distributed
    optimizer (reduce-scatter + all-gather of its parameters in the compute dtype: FSDP2 casts
    the shard to param_dtype first); one collective per FSDP unit (34 here: embedding, 32
    blocks, [norm, head]; tests/test_dp_collectives.py counts them on gloo); ZeRO-2/3
    reduce-scatter per micro-batch unless accumulate_unsharded. With 8 micro-batches over 64
    GPUs on a slow network the differences show."""
    model = PRESETS["llama3-8b"]
    cl = dataclasses.replace(resolve_cluster("dgx-h100:8"), memory_gib=1e6,
                             inter_node_gb_per_s=5.0)

    def dp_time(zero: int, sharding: str, batch: int = 512, **kw) -> float:
        from meshtron.planner.memory import options_for

        opts = KernelOptions(sharding=sharding)
        # the same loss (and so the same backward to hide behind) for both shardings; the
        # 'zero' side as plain buckets (DeepSpeed's), without Megatron-Core DDP's edge bucket
        # and buffer passes (tests/test_planner_mcore_small.py)
        mem = dataclasses.replace(options_for(opts), loss="vocab-parallel")
        if sharding == "zero":
            mem = dataclasses.replace(mem, framework="deepspeed")
        ev = Evaluator(model, cl, batch, 4096, opts, mem=mem)
        return ev.evaluate(Plan(1, 1, 64, zero, 1, "none", False, None, 1,
                                dtype="bf16", **kw)).time.dp_comm

    # once per step: 8 micro-batches per step or 1 cost the same all-reduce
    assert dp_time(0, "fsdp") == pytest.approx(dp_time(0, "fsdp", batch=64), rel=1e-6)
    # the same bytes as one bucketed all-reduce, plus 33 more calls' latency (each a 64-rank
    # ring over 8 nodes: planner/comm.py ring_latency), and at most one unit's collective
    # more: the last unit's reduction has no backward left to hide behind (dp_cost.unit_chain)
    from meshtron.planner.comm import Fabric as _Fabric
    from meshtron.planner.memory import layer_params_local

    fab, group = _Fabric.of(cl), Group(64, 8)
    unit = layer_params_local(model, 1, 1)
    extra = dp_time(0, "fsdp") - dp_time(0, "zero")
    latencies = 33 * ring_latency(group, fab, all_reduce=True)
    assert latencies < extra < latencies + all_reduce(4.0 * unit, group, fab)
    # the wire dtype is the plan's: bf16 reduction moves half the bytes
    assert dp_time(0, "fsdp", reduce_dtype="bf16") < 0.6 * dp_time(0, "fsdp")
    # distributed optimizer: fp32 reduce-scatter + bf16 all-gather, less than the fp32
    # all-reduce; the bytes of Megatron's bf16 weights, plus per-unit latencies
    # ... and FSDP2's own passes once a step (dp_cost.fsdp2_step_passes_s: the shard cast and
    # copied in, the copy-out, the accumulated gradient copied into the reduce-scatter input)
    extra = dp_time(1, "fsdp") - dp_time(1, "zero")
    latencies = 33 * 2 * ring_latency(group, fab)
    ev = Evaluator(model, cl, 512, 4096, KernelOptions(sharding="fsdp"))
    passes = ev.fsdp2_step_passes_s(model.num_params(), 1, 64, 8, 1, 4.0, 2.0)
    assert passes > 0
    assert latencies + passes < extra < latencies + passes + reduce_scatter(
        4.0 * unit, group, fab) + all_gather(2.0 * unit, group, fab)
    assert dp_time(1, "fsdp") < 0.8 * dp_time(0, "fsdp")
    # FSDP's ZeRO-2 reduce-scatters after every micro-batch; accumulating unsharded reduces once
    assert dp_time(2, "fsdp") > 2 * dp_time(2, "fsdp", accumulate_unsharded=True)
    assert dp_time(3, "fsdp") > dp_time(2, "fsdp") > dp_time(2, "zero")
    with pytest.raises(ValueError, match="sharding="):
        KernelOptions(sharding="ddp")


# ---- memory: what is alive together -------------------------------------------------------------
def _memory(dtype: str, recompute: str, loss: str | None = None):
    from meshtron.planner.memory import MemoryOptions

    model = PRESETS["llama3-8b"]
    mem = MemoryOptions(loss=loss) if loss else None
    ev = Evaluator(model, resolve_cluster("dgx-h100:1"), 8, 32768, mem=mem)
    est = ev.evaluate(Plan(1, 1, 8, 3, 1, recompute, False, "1f1b", 1, dtype=dtype))
    return est.memory


def test_loss_and_recomputed_block_are_not_alive_together():
    """The loss's backward (12 bytes per fp32-upcast logit) completes before the last
    checkpointed block is replayed: the peak holds the larger working set, not both. Llama 3 8B
    at 32k tokens (torchtitan TT24 Table 2 shapes): logits 47 GiB, a recomputed block ~6."""
    from meshtron.planner import memory

    m = _memory("bf16", "full", loss="eager")  # torchtitan's whole-logits loss
    logits = 32768 * 128256 * 12 / memory.GIB
    assert m.logits == pytest.approx(logits, rel=1e-6)
    assert m.recompute == 0.0  # the block's working set fits inside the freed loss's bytes
    assert memory.loss_or_recompute(3.0, 5.0) == 5.0 and memory.loss_or_recompute(5.0, 3.0) == 5.0
    m_none = _memory("bf16", "none", loss="eager")
    assert m_none.logits == pytest.approx(m.logits)  # the loss is the same without recompute
    # meshtron's own fused loss (tp=1, no pipeline) never builds the 47 GiB: the fp32
    # weight-gradient accumulator, the input gradient and one chunk's logits (rehearsed,
    # tests/test_rehearse.py)
    chunked = _memory("bf16", "none")
    assert chunked.logits < 0.1 * m_none.logits
    assert chunked.logits == pytest.approx(memory.chunked_loss_bytes(
        PRESETS["llama3-8b"], 32768, memory.MemoryOptions()) / memory.GIB)


def test_fp8_runs_count_bf16_activations_and_compute_copies():
    """Float8 linears (torchao, Transformer Engine) keep bf16 activations and gather bf16
    compute copies (memory.DTYPES): an fp8 plan's activations and gathered copies equal the bf16
    plan's, and are half an fp32 plan's."""
    from meshtron.planner import memory

    fp8, bf16, fp32 = (_memory(d, "full") for d in ("fp8", "bf16", "fp32"))
    assert fp8.activations == pytest.approx(bf16.activations)
    assert fp8.gathered == pytest.approx(bf16.gathered)
    assert fp32.gathered > bf16.gathered
    # the compute copies at both moments of the peak double; the previous block's
    # reduce-scatter input beside a block's backward is fp32 in both (reduce_dtype)
    args = (3, 8, 32, 2.2e8, 5.3e8, 5.9e7)
    for moment in (memory.gathered_bytes, memory.backward_gathered_bytes):
        opts = {d: memory.MemoryOptions(dtype=d) for d in ("fp8", "bf16", "fp32")}
        assert moment(opts["fp8"], *args) == moment(opts["bf16"], *args)
        assert moment(opts["fp32"], *args) == 2 * moment(opts["bf16"], *args)
    assert memory.previous_gradient_bytes(memory.MemoryOptions(), 8, 32, 2.2e8, False,
                                          4.0) == 4.0 * 2.2e8


def test_step_pieces_price_the_plans_fp8_recipe():
    """Issue 30 item 5: `step_pieces` (the simulator's view) asks `_micro` with the plan's
    fp8_recipe, as `evaluate` does; it used the default (rowwise) for every plan. With a
    2048-wide model the recipes differ (torchao's rowwise filter skips N <= 2048 GEMMs that
    tensorwise runs in FP8), so the pieces of a tensorwise plan must be its own."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.step_pieces import step_pieces

    model = ModelSpec(name="w2048", layers=4, hidden=2048, heads=16, kv_heads=4,
                      ffn_hidden=5632, vocab=32000, max_seq=4096)
    ev = Evaluator(model, resolve_cluster("dgx-h100:1"), 64, 4096)
    fwd = {}
    for recipe in ("rowwise", "tensorwise"):
        cfg = dataclasses.replace(Plan(1, 1, 8, 3, 1, "none", False, None, 1, dtype="fp8"),
                                  fp8_recipe=recipe)
        pieces = step_pieces(ev, ev.evaluate(cfg))
        micro = ev._micro(1, 1, False, "none", 1, "fp8", 1, recipe)
        head = ev.head_for(cfg, micro.head)  # the chunked loss's forward (review44)
        assert pieces.fwd[0] == pytest.approx(
            model.layers * micro.layer_fwd + micro.emb.fwd + head.fwd, rel=1e-12)
        fwd[recipe] = pieces.fwd[0]
    # the recipes price different Linears in FP8 and different casts (planner/fp8.py
    # cast_bytes: in eager, tensorwise's extra FP8 GEMMs cost more in casts than they save)
    assert fwd["tensorwise"] != pytest.approx(fwd["rowwise"], rel=1e-3)


def test_per_parameter_optimizer_loop_is_launch_bound_on_small_shards():
    """Composer's DecoupledAdamW ('for-loop') launches 9 kernels per parameter tensor, FSDP's
    clip 2 more, and reads a step counter per tensor (planner/optimizer_loop.py). Under FSDP1
    with use_orig_params a rank steps only the tensors its chunk of each unit intersects: at
    512 ranks MPT-1b's busiest rank holds the end of out_proj, norm_2 and the start of up_proj
    in every block (3 x 24) plus the root's final norm. There the loop dominates the step the
    'foreach' bytes alone would take; at 8 ranks of a 70B model the bytes dominate (the loop
    adds its launches only where a tensor's device time is shorter, and its synchronisations)."""
    from bench.published.table import mpt_model
    from meshtron.planner import gemm, host, optimizer_loop

    def opt_time(model, gpus: int, kind: str) -> float:
        cl = dataclasses.replace(resolve_cluster(f"dgx-h100:{gpus // 8}"), memory_gib=1e6)
        ev = Evaluator(model, cl, gpus, 2048, KernelOptions(optimizer=kind, stack="eager"))
        return ev.evaluate(Plan(1, 1, gpus, 3, 1, "none", False, None, 1,
                                dtype="bf16")).time.optimizer

    # without biases (the benchmark yamls' MPT has them: bench/published/table.py mpt_model),
    # so that the block is the six tensors counted above
    mpt1b = dataclasses.replace(mpt_model("mpt-1b", 24, 2048, 16, 2048), bias=False)
    units = [(optimizer_loop.layer_tensors(mpt1b, 1), 24),
             (optimizer_loop.outer_tensors(mpt1b, 1, True, True), 1)]
    assert optimizer_loop.busiest_rank_tensors(units, 1) == 24 * 6 + 3  # unsharded: all
    assert optimizer_loop.busiest_rank_tensors(units, 512) == 3 * 24 + 1
    launch = gemm.DISPATCH_S / host.AUTOGRAD_RECORD
    loop = (3 * 24 + 1) * (11 * launch + host.SYNC_S)
    small = opt_time(mpt1b, 512, "for-loop")
    assert small == pytest.approx(loop, rel=1e-9)  # issue-bound: the bytes take far less
    assert small > 20 * opt_time(mpt1b, 512, "foreach")
    mpt70b = dataclasses.replace(mpt_model("mpt-70b", 80, 8192, 64, 2048), bias=False)
    big, bytes_only = opt_time(mpt70b, 8, "for-loop"), opt_time(mpt70b, 8, "foreach")
    # the 160 norm weights still cost a launch-bound pass each and every tensor its .item()
    assert bytes_only < big < 1.1 * bytes_only
