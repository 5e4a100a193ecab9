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
    tables = memory.rope_table_bytes(MIXTRAL, 4096) / GIB  # fp32 RoPE buffer: with params
    assert bf16.params - tables == pytest.approx((fp32.params - tables) / 2, rel=1e-12)
    for name in ("grads", "optimizer"):
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


# ---- DeepEP's dispatch (planner/moe_deepep.py) -------------------------------------------------
def test_fake_balanced_gate_reaches_neighbouring_ranks_of_one_node():
    """AutoModel's FakeBalancedGate sends token t to experts t k .. t k + k - 1 (mod E): with
    DeepSeek-V3's 256 experts over ep 64 (4 a rank, 32 a node) that is 2 ranks of 1 node;
    Qwen3-30B-A3B's 128 over ep 8: 1 rank; Kimi K2's 384 over ep 32 (12 a rank): 1, 2, 1
    ranks for the three starting points of a period, always 1 node."""
    from meshtron.planner.moe_deepep import spread

    assert spread(256, 8, 64, 8, "contiguous") == (2.0, 1.0)
    assert spread(128, 8, 8, 8, "contiguous") == (1.0, 1.0)
    assert spread(384, 8, 32, 8, "contiguous") == pytest.approx((4 / 3, 1.0))


def test_spread_routing_matches_the_enumerated_draws():
    """'spread': k distinct experts uniform over E; the closed form against every draw of a
    small case enumerated (8 experts, top 2, 4 ranks of 2 experts, 2 ranks a node)."""
    from itertools import combinations

    from meshtron.planner.moe_deepep import spread

    draws = list(combinations(range(8), 2))
    ranks = sum(len({x // 2 for x in d}) for d in draws) / len(draws)
    nodes = sum(len({x // 4 for x in d}) for d in draws) / len(draws)
    assert spread(8, 2, 4, 2, "spread") == pytest.approx((ranks, nodes), rel=1e-12)


def test_deepep_sends_a_token_once_per_node_and_rank():
    """DeepSeek-V3 on ep 64 over 8 nodes of DGX-H100 with the fake gate: NCCL's all-to-all
    sends k = 8 rows per token, 8 x 56/64 = 7 of them over the network; DeepEP sends one row
    per destination node, 7/8 of a row over the network (its own node 1 in 8), and forwards
    2 x 7/8 over NVLink. One MoE layer's forward (dispatch + combine, BF16) costs what those
    rows take at the fabric's bandwidths."""
    from meshtron.planner import comm
    from meshtron.planner.moe_cost import a2a_time, moe_layer_cost
    from meshtron.planner.moe_deepep import deepep_a2a_time, deepep_rows
    from meshtron.planner.placement import ep_group

    ds = PRESETS["deepseek-v3"]
    cl = resolve_cluster("dgx-h100:64")
    group = ep_group(1, 64, cl.gpus_per_node)
    assert (group.size, group.local) == (64, 8)
    inter, intra = deepep_rows(ds.moe_experts, ds.moe_top_k, group, "contiguous")
    assert (inter, intra) == pytest.approx((7 / 8, 2 * 7 / 8))
    fab = comm.Fabric.of(cl)
    tokens, h = 4096.0, ds.hidden
    one = deepep_a2a_time(tokens, h, 2.0, ds.moe_experts, ds.moe_top_k, group, fab,
                          "contiguous")
    row = tokens * h * 2.0
    assert one == pytest.approx(fab.base_latency + max(
        inter * row / fab.inter_bw + fab.inter_alpha,
        intra * row / fab.intra_bw + fab.intra_alpha), rel=1e-12)

    def layer(dispatch: str):
        return moe_layer_cost(ds, cl, tokens, 64, group, "bf16", 1.0, False, 0, "fused",
                              ep_dispatch=dispatch, expert_routing="contiguous")

    deepep, nccl = layer("deepep"), layer("bf16")
    assert deepep.a2a_fwd == pytest.approx(2 * one, rel=1e-12)
    plain = a2a_time(tokens * ds.moe_top_k * h * 2.0 * 63 / 64, group, fab)
    assert nccl.a2a_fwd == pytest.approx(2 * plain, rel=1e-12)
    # network-bound both: the ratio of the rows, less the latencies
    assert deepep.a2a_fwd < nccl.a2a_fwd / 6
    # the compute differs by the permutation passes DeepEP's dispatcher leaves out: Megatron-
    # Core's alltoall path permutes, sorts the received chunks, unsorts and unpermutes (4
    # passes over the T k routed rows each way); DeepEP's permutes after its dispatch and
    # unpermutes before its combine (2)
    from meshtron.planner import compute
    from meshtron.planner.moe_cost import permute_passes

    assert permute_passes("fused", 64, 4) == 4.0
    assert permute_passes("fused", 64, 4, "deepep") == 2.0
    one_pass = 2 * tokens * ds.moe_top_k * h * 2.0 / compute.membound_bytes_per_s(
        cl.at_dtype("bf16"), "fused")
    assert nccl.compute_fwd - deepep.compute_fwd == pytest.approx(2 * one_pass, rel=1e-9)
    assert nccl.compute_bwd - deepep.compute_bwd == pytest.approx(4 * one_pass, rel=1e-9)


def test_deepep_node_limit_caps_the_nodes():
    """Group-limited routing (DeepSeek-V3: 4 of 8 groups) keeps a token within M nodes."""
    from meshtron.planner.comm import Group
    from meshtron.planner.moe_deepep import deepep_rows

    free, limited = (deepep_rows(256, 8, Group(64, 8), "spread", m) for m in (0, 4))
    assert free[0] > 4 * 7 / 8 and limited[0] == pytest.approx(4 * 7 / 8)


def test_deepep_buffers_are_a_fixed_workspace():
    """DeepEP's Buffer preallocates NVLink (and past 8 ranks RDMA) buffers from its config's
    size hints: for Qwen3-30B-A3B's hidden 2048 on ep 8, 10 channels x 8 peers x 256 tokens of
    (4096 row + 8 meta + 128 x 8 indices + 128 x 4 weights + 128 x 4 scales) bytes plus
    10 x 8 x 5 ints of counters, rounded to 128. A plan that dispatches through DeepEP holds
    them beside its tensors, in the workspace, outside the fragmentation allowance."""
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.moe_deepep import deepep_buffer_bytes

    want = 10 * 8 * 5 * 4 + 10 * 8 * 256 * (4096 + 8 + 1024 + 512 + 512)
    assert deepep_buffer_bytes(2048, 8) == -(-want // 128) * 128
    assert deepep_buffer_bytes(2048, 1) == 0.0
    # across nodes the RDMA buffers come on top (DeepSeek-V3 at ep 64: 0.66 GiB in all)
    assert 0.6 * GIB < deepep_buffer_bytes(7168, 64) < 0.7 * GIB

    def est(dispatch: str):
        ev = Evaluator(MIXTRAL, CLUSTER, 64, 4096,
                       opts=KernelOptions(ep_dispatch=dispatch),
                       mem=MemoryOptions(param_dtype="bf16"))
        return ev.evaluate(Plan(1, 1, 8, 3, 1, "full", False, None, 1, dtype="bf16", ep=8))

    plain, deepep = est("bf16"), est("deepep")
    assert deepep.memory.allocated == pytest.approx(plain.memory.allocated, rel=1e-12)
    assert (deepep.memory.workspace - plain.memory.workspace) * GIB == pytest.approx(
        deepep_buffer_bytes(MIXTRAL.hidden, 8), rel=1e-9)


def test_bf16_model_halves_the_eager_optimizer_traffic():
    """torch.optim.Adam (foreach) over a bf16 model makes the same passes as over fp32
    masters, each on 2-byte tensors, and has no master-to-bf16 copy to write: (86 - 6) / 2
    bytes per parameter (estimate.EAGER_OPTIMIZER_BYTES_PER_PARAM)."""
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.estimate import EAGER_OPTIMIZER_BYTES_PER_PARAM

    def opt_bytes(**mem):
        ev = Evaluator(MIXTRAL, CLUSTER, 64, 4096,
                       opts=KernelOptions(optimizer="foreach", sharding="fsdp"),
                       mem=MemoryOptions(**mem))
        return ev.optimizer_bytes()

    # the passes, plus the gradient clipping's norm read and scaling (3 gradient passes)
    assert opt_bytes() == EAGER_OPTIMIZER_BYTES_PER_PARAM + 3 * 4.0
    assert opt_bytes(param_dtype="bf16") == (EAGER_OPTIMIZER_BYTES_PER_PARAM - 6.0) / 2 + 3 * 2.0


def test_bf16_cross_entropy_keeps_its_three_tensors_in_bf16():
    """AutoModel's MaskedCrossEntropy with fp32_upcast false runs F.cross_entropy on the bf16
    logits: log_softmax's saved output, the incoming gradient and the input gradient are bf16
    (2 + 2 + 2 bytes per logit) where the fp32-cast loss holds 4 + 4 + 4; a pipeline's last
    stage keeps its bf16 output beside them either way; a GPipe stage keeps each micro-batch's
    log_softmax output (2, not 4) beside the output."""
    from meshtron.planner.memory_acts import logits_bytes
    from meshtron.planner.memory_gpipe import loss_saved_bytes

    model = PRESETS["qwen3-30b-a3b"]
    elements = 4 * 4096 * model.vocab
    for pipelined, kept in ((False, 0.0), (True, 2.0)):
        bf16 = logits_bytes(model, 1, 4, 4096, MemoryOptions(loss="eager-bf16"), pipelined)
        fp32 = logits_bytes(model, 1, 4, 4096, MemoryOptions(loss="eager"), pipelined)
        assert bf16 == elements * (6.0 + kept) and fp32 == elements * (12.0 + kept)
    assert loss_saved_bytes(model, 1, 4, 4096, MemoryOptions(loss="eager-bf16")) == \
        elements * 4.0
