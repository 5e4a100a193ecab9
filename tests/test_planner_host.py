"""Host launch overhead and NCCL SM contention in the planner's step time (planner/host.py,
issue 30 item 3), each pinned qualitatively from its mechanism: the GPU waits on the host only
where its work per kernel is shorter than a launch, fused/compiled stacks launch fewer kernels,
collectives are launches too, and a collective hidden beside compute costs it the share of
SMs its CTAs hold. No figure of a published row."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import compute as C
from meshtron.planner import host
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.overlap import OVERLAP_INTERFERENCE, overlapped

H100 = resolve_cluster("dgx-h100:1")
H100_4 = resolve_cluster("dgx-h100:4")
A100 = resolve_cluster("dgx-a100:1")
TINY, L8 = PRESETS["tiny"], PRESETS["llama3-8b"]
EAGER = C.KernelOptions()
NO_LAUNCH = dataclasses.replace(H100, eager_kernel_overhead_us=1e-6)
"""The same GPU with (almost) free launches: its layer times are the device's alone."""


def _idle_share(model, mb: int, seq: int, opts: C.KernelOptions = EAGER, tp: int = 1,
                sp: bool = False) -> float:
    """Share of a layer's forward + backward the GPU spends waiting on the host."""
    real = C.layer_cost(model, H100, tp, mb, seq, sp, opts)
    dev = C.layer_cost(model, NO_LAUNCH, tp, mb, seq, sp, opts)
    return 1.0 - (dev.fwd + dev.bwd) / (real.fwd + real.bwd)


def test_host_overhead_grows_as_gpu_work_per_kernel_shrinks():
    """Same kernels, less work in each: the launch-bound share rises; at a Llama-3-8B layer's
    work (4,096 tokens per micro-batch on one H100) it vanishes."""
    shares = [_idle_share(TINY, mb, seq) for mb, seq in ((8, 2048), (2, 512), (1, 64))]
    assert shares[0] < shares[1] < shares[2]
    assert shares[2] > 0.5  # a tiny layer at 64 tokens is launch-bound
    assert _idle_share(L8, 1, 4096) == 0.0


def test_tensor_parallelism_shrinks_work_per_kernel_so_the_host_shows():
    """tp splits each GEMM (less GPU work per kernel) but launches the same kernels plus its
    collectives: the host's share grows with tp."""
    model = PRESETS["llama3-8b"]
    one = _idle_share(model, 1, 256, tp=1)
    eight = _idle_share(model, 1, 256, tp=8, sp=True)
    assert eight > one


def test_compiled_and_fused_stacks_launch_fewer_kernels_and_wait_less():
    eager, comp = EAGER, C.compiled(EAGER)
    fused = dataclasses.replace(EAGER, stack="fused")
    assert C.kernels_per_layer(TINY, comp) < C.kernels_per_layer(TINY, eager)
    assert C.kernels_per_layer(TINY, fused) <= C.kernels_per_layer(TINY, comp)
    e, c = _idle_share(TINY, 1, 128, eager), _idle_share(TINY, 1, 128, comp)
    assert 0.0 < c < e


def test_collectives_are_launches_and_the_host_overlaps_exposed_communication():
    k, d = 20, 10e-6
    f0, b0 = host.layer_issue(k, 0, d)
    f4, b4 = host.layer_issue(k, host.tp_collectives(2, True), d)
    assert f4 - f0 == pytest.approx(4 * d)
    assert b4 - b0 == pytest.approx(4 * d * host.BACKWARD_HOST_FRACTION)
    assert host.tp_collectives(1, True) == 0 and host.tp_collectives(4, False) == 2
    # the backward launches BACKWARD_LAUNCHES per forward kernel at the measured per-node cost
    assert b0 == pytest.approx(host.BACKWARD_LAUNCHES * k * d * host.BACKWARD_HOST_FRACTION)
    # the GPU waits on the host only by what its compute and exposed communication leave
    assert host.launch_bound(1.0, 1.5) == pytest.approx(0.5)
    assert host.launch_bound(1.5, 1.0) == 0.0


def test_moe_split_reads_cost_a_sync_per_layer_only_with_expert_parallelism(monkeypatch):
    """meshtron's dispatch reads its split sizes on the host once per MoE layer forward when
    ep > 1: each MoE block's forward carries SYNC_S more than with the read free."""
    moe = PRESETS["tiny-moe"]

    def moe_parts(ep: int) -> tuple[float, ...]:
        return Evaluator(moe, H100, 8, 256, preset("meshtron").kernel)._moe(1, "full", 1,
                                                                             "bf16", ep)
    with_sync = {ep: moe_parts(ep) for ep in (1, 2)}
    monkeypatch.setattr(host, "SYNC_S", 0.0)
    free = {ep: moe_parts(ep) for ep in (1, 2)}
    share = moe.moe_layers / moe.layers
    assert with_sync[1] == free[1]  # no expert parallelism: no read
    assert with_sync[2][1] - free[2][1] == pytest.approx(share * 20e-6)
    # full recomputation replays the forward, and its read
    assert with_sync[2][0] - free[2][0] == pytest.approx(2 * share * 20e-6)


def test_nccl_ctas_follow_nvlinks_and_nics():
    # 2 CTAs per NVLink (nccl#1703): A100's 12 links -> 24 (nccl#1225), H100's 18 -> 32 (cap)
    assert host.nccl_ctas(A100, inter_node=False) == 24
    assert host.nccl_ctas(H100, inter_node=False) == host.NCCL_MAX_CTAS == 32
    # an H800-like node (8 NVLinks, 200 GB/s per direction): 16, as its NCCL log reads
    h800 = dataclasses.replace(H100, intra_node_gb_per_s=200.0)
    assert host.nccl_ctas(h800, inter_node=False) == 16
    # across nodes: 2 per NIC, one NIC per GPU (nccl#689: 16 on 8 NICs)
    assert host.nccl_ctas(H100, inter_node=True) == 16


def test_sm_contention_scales_with_ctas_over_sms():
    """The hidden part of a collective costs compute ctas / sms of its time: more CTAs (intra
    node, more NVLinks) cost more, more SMs less."""
    intra, inter = host.sm_interference(H100, False), host.sm_interference(H100, True)
    assert intra == pytest.approx(32 / 132) and inter == pytest.approx(16 / 132)
    assert intra > inter
    assert host.sm_interference(A100, False) == pytest.approx(24 / 108)
    h800 = dataclasses.replace(H100, intra_node_gb_per_s=200.0)
    assert host.sm_interference(h800, False) < intra
    # the overlap formula charges exactly that share of the hidden time
    assert overlapped(1.0, 2.0, intra) == pytest.approx(intra)
    assert overlapped(3.0, 2.0, intra) == pytest.approx(1.0 + 2.0 * intra)
    assert overlapped(1.0, 2.0) == pytest.approx(OVERLAP_INTERFERENCE)


def test_megatron_linear_overlap_pays_the_tensor_groups_sm_share(monkeypatch):
    """Megatron's linears hide the backward's re-gather and reduction beside the column GEMM;
    the hidden part is charged the tp group's NCCL share: fewer CTAs, a smaller charge, and
    the forward (nothing overlapped) unchanged."""
    from meshtron.planner.overlap import tp_exposed
    meg = dataclasses.replace(EAGER, megatron_linear=True)
    colls = dict.fromkeys(("ag", "ag_in", "rs", "ar"), 1.0)
    gemms = dict.fromkeys(("qkv", "out", "up", "down"), 2.0)
    for nccl in (0.1, 0.3):
        fwd, bwd = tp_exposed(colls, gemms, lambda g, r: 2.0, 4096, 8, True, meg, 132, nccl)
        # per pair: the row GEMM's gathered gradient exposed (1), re-gather and reduction
        # hidden beside the column GEMM (2 x nccl)
        assert bwd == pytest.approx(2 * (1.0 + 2 * nccl)) and fwd == pytest.approx(4.0)
    C.layer_cost.cache_clear()
    base = C.layer_cost(L8, H100, 8, 1, 4096, True, meg)
    monkeypatch.setattr(host, "NCCL_MAX_CTAS", 16)
    C.layer_cost.cache_clear()
    fewer = C.layer_cost(L8, H100, 8, 1, 4096, True, meg)
    C.layer_cost.cache_clear()
    assert fewer.tp_bwd < base.tp_bwd and fewer.tp_fwd == base.tp_fwd


def test_dp_overlap_interference_depends_on_where_the_group_sits():
    ev1 = Evaluator(L8, H100, 64, 4096, preset("meshtron").kernel)
    ev4 = Evaluator(L8, H100_4, 64, 4096, preset("meshtron").kernel)
    from meshtron.planner.plan import Plan
    in_node = Plan(tp=1, pp=1, dp=8, micro_batch=1, zero=3)
    across = Plan(tp=1, pp=1, dp=32, micro_batch=1, zero=3)
    assert ev1.dp_interference(ev1._groups(in_node)) == pytest.approx(32 / 132)
    assert ev4.dp_interference(ev4._groups(across)) == pytest.approx(16 / 132)


def _plan_json(capsys, *argv: str) -> dict:
    import json

    import meshtron.cli as top
    assert top.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_says_when_the_gpu_waits_on_launches(capsys):
    """Through the command line: a tiny model at 64 tokens per micro-batch is launch-bound and
    the plan says so; Llama-3-8B at its default batch on H100s is not."""
    tiny = _plan_json(capsys, "--model", "tiny", "--cluster", "dgx-h100:1", "--global-batch",
                      "8", "--seq-len", "64", "--top", "1")
    assert any("waits on kernel launches" in n for n in tiny["notes"])
    big = _plan_json(capsys, "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--top", "1")
    assert not any("waits on kernel launches" in n for n in big["notes"])


def test_the_head_and_loss_wait_on_launches_only_when_small():
    """The final norm, head GEMM and eager loss are launches too: a tiny model's head at 64
    tokens is launch-bound, Llama-3-8B's at 4,096 tokens is not."""
    small = C.head_cost(TINY, H100, 1, 1, 64, False, "eager")
    small_dev = C.head_cost(TINY, NO_LAUNCH, 1, 1, 64, False, "eager")
    assert small.compute > 2 * small_dev.compute and small.fwd > small_dev.fwd
    big = C.head_cost(L8, H100, 1, 1, 4096, False, "eager")
    assert big == C.head_cost(L8, NO_LAUNCH, 1, 1, 4096, False, "eager")


def test_eager_kernel_count_is_what_meshtrons_block_launches():
    """Count the ATen calls that reach a kernel in one eager forward and backward of
    meshtron's Block on CPU (LayerNorm standing in for the one-kernel fused RMSNorm of CUDA,
    which decomposes on CPU): the forward is the planner's `kernels_per_layer`, the backward
    BACKWARD_LAUNCHES times it."""
    import torch

    from meshtron.model.rope import rope_cache
    from meshtron.model.transformer import Block
    from testkit.kernel_count import KernelCount as Count

    spec = dataclasses.replace(TINY, norm="layernorm")
    torch.manual_seed(0)
    block = Block(spec).to(torch.bfloat16)
    x = torch.randn(1, 32, spec.hidden, dtype=torch.bfloat16, requires_grad=True)
    rope = rope_cache(spec)
    with Count() as fwd:
        y = block(x, rope)
    grad = torch.ones_like(y)
    with Count() as bwd:
        y.backward(grad)
    n_fwd, n_bwd = sum(fwd.ops.values()), sum(bwd.ops.values())
    assert fwd.ops["mm"] == 7 and bwd.ops["mm"] == 14  # two GEMMs per forward GEMM
    assert n_fwd == C.kernels_per_layer(TINY, EAGER) == C.kernels_per_layer(spec, EAGER)
    assert n_bwd / n_fwd == pytest.approx(host.BACKWARD_LAUNCHES, abs=0.05)
