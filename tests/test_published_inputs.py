"""The inputs of the Megatron-DeepSpeed rows of the published table (bench/published/), each
checked against the code or paper it was read from (issue 30 item 3, branch neox)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.published.runs import published_runs


def _row(name: str):
    return next(r for r in published_runs() if r.name == name)


def test_neox_117_tflops_is_read_with_gpt_neox_own_flop_count():
    """GPT-NeoX logged 'approx flops per GPU' as B*s*(6*P + 60*s*h*L)/(t*gpus) (megatron/
    logging.py get_flops, January-April 2022): model FLOPs without recomputation, not
    Megatron's hardware formula. The row must carry the step that count implies."""
    run = _row("GPT-NeoX 20B 96")
    batch, seq, h, layers, gpus = 1536, 2048, 6144, 44, 96  # configs/20B.yml, 12 nodes x 8
    params = 20_554_567_680  # 44 layers of 12h^2+13h, untied embedding and head of 50432
    per_token = 6 * params + 60 * seq * h * layers
    expected = batch * seq * per_token / (117e12 * gpus)
    assert run.metric == "step_s"
    assert run.published == pytest.approx(expected, rel=1e-6)
    # read as Megatron's hardware FLOPs (recomputation counted) the same 117 would claim a
    # step 8.7% longer than the one the run logged
    vocab = 50432
    megatron = 96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    assert batch * seq * megatron / (117e12 * gpus) == pytest.approx(1.087 * expected, rel=2e-3)


def test_bloom_step_is_the_logged_one_and_its_stack_as_tr11_ran_it():
    """tr11-176B-ml's README logs 104.70 s per iteration at batch 2048 beside 149.77 TFLOP/s,
    Megatron's formula with recomputation (24*4*B*s*L*h^2*(1 + s/6h + V/16Lh)): the row uses
    the step, which the two figures agree on to 0.1%."""
    run = _row("BLOOM 176B 384")
    b, s, L, h, v, gpus = 2048, 2048, 70, 14336, 250880, 384
    flops = 24 * 4 * b * s * L * h * h * (1 + s / (6 * h) + v / (16 * L * h))
    assert run.metric == "step_s" and run.published == 104.70
    assert flops / (run.published * gpus) / 1e12 == pytest.approx(149.77, rel=1e-3)
    # BLOOM ties its word embedding to the head (the README's 'type:transformer|embedding'
    # split places the tied embedding on the first and last stage)
    assert run.model.tied_embeddings


def _neox_eval(**opts):
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    run = _row("GPT-NeoX 20B 96")
    kern = dataclasses.replace(run.opts, **opts)
    ev = Evaluator(run.model, run.cluster, run.global_batch, run.seq_len, kern,
                   mem=run.row_memory)
    plan = Plan(run.tp, run.pp, run.dp, run.zero, 4, "full", False, "1f1b", 1)
    return ev, plan, ev.evaluate(plan)


def test_deepspeed_pipeline_zero1_all_reduces_the_gradients():
    """DeepSpeed's pipeline engine reduces with buffered_allreduce_fallback whatever the ZeRO
    stage: twice the bytes of ZeRO-1's reduce-scatter on the wire."""
    from meshtron.planner import comm

    ev, plan, _ = _neox_eval(zero1_all_reduce=True)
    groups = ev._groups(plan)
    red, gather = ev.once_per_step(1e9, 1, groups, 2.0)
    assert red == pytest.approx(comm.all_reduce(2e9, groups["dp"], ev.fab))
    ev0, _, _ = _neox_eval(zero1_all_reduce=False)
    red0, gather0 = ev0.once_per_step(1e9, 1, groups, 2.0)
    assert gather == gather0 and 1.8 < red / red0 < 2.1


def test_deepspeed_0_3_splits_activations_but_sends_gradients_whole():
    """DeeperSpeed 0.3.15: is_pipe_partitioned = is_model_parallel, is_grad_partitioned =
    False: the pipeline's transfers cost the mean of a split and a whole hop."""
    split = _neox_eval(p2p_scatter_gather=True, p2p_grads_whole=False)[2].time.pp_comm
    whole = _neox_eval(p2p_scatter_gather=False, p2p_grads_whole=False)[2].time.pp_comm
    mixed = _neox_eval(p2p_scatter_gather=True, p2p_grads_whole=True)[2].time.pp_comm
    assert split < mixed < whole
    # the split hop adds the NVLink re-gather, so the mean is a little above the half-way mark
    assert mixed == pytest.approx(0.5 * (split + whole), rel=0.02)


def _layer(model, **opts):
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import KernelOptions, layer_cost

    kern = KernelOptions(attention="unfused", stack="fused", **opts)
    return layer_cost(model, resolve_cluster("dgx-a100:2"), 2, 4, 2048, False, kern)


def test_gpt_j_residual_reduces_the_two_branches_once():
    """GPT-NeoX's gpt_j_residual sums the attention and MLP outputs before one all-reduce:
    half the forward tensor-parallel traffic of a parallel-residual block; the backward keeps
    both input-gradient reductions, and a sequential block is left alone."""
    par = _row("GPT-NeoX 20B 96").model
    seq = dataclasses.replace(par, parallel_residual=False)
    once, each = _layer(par, residual_reduce_once=True), _layer(par)
    assert once.tp_fwd == pytest.approx(0.5 * each.tp_fwd) and once.tp_bwd == each.tp_bwd
    assert _layer(seq, residual_reduce_once=True) == _layer(seq)


def test_alibi_bias_copy_costs_the_forward_only():
    """baddbmm(alibi, q, k^T, beta=1): the bias copied into the score buffer and read back,
    4 bytes per bf16 score in the forward; no gradient flows to the bias."""
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import membound_bytes_per_s

    model = _row("GPT-NeoX 20B 96").model
    bias, plain = _layer(model, score_bias_copy=True), _layer(model)
    bw = membound_bytes_per_s(resolve_cluster("dgx-a100:2"), "fused")
    scores = (model.heads / 2) * 2048 * (4 * 2048)  # local heads x keys x tokens
    assert bias.fwd - plain.fwd == pytest.approx(4 * scores / bw, rel=1e-6)
    assert bias.bwd == plain.bwd


def test_launch_blocking_adds_the_host_issue_time():
    """CUDA_LAUNCH_BLOCKING=1: the host no longer runs ahead, each layer pays its launches."""
    from meshtron.planner import host
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import KernelOptions, dispatch_s
    from meshtron.planner.elementwise import kernels_per_layer

    model = _row("GPT-NeoX 20B 96").model
    blocking, plain = _layer(model, launch_blocking=True), _layer(model)
    kern = KernelOptions(attention="unfused", stack="fused")
    issue_f, issue_b = host.layer_issue(kernels_per_layer(model, kern),
                                        host.tp_collectives(2, False),
                                        dispatch_s(resolve_cluster("dgx-a100:2")))
    # these layers are far from launch-bound: without blocking the host hides entirely
    assert blocking.fwd - plain.fwd == pytest.approx(issue_f)
    assert blocking.bwd - plain.bwd == pytest.approx(issue_b)


def test_deepspeed_presets_split_pipeline_sends_over_the_tensor_group():
    """DeepSpeed's pipeline engine sends a PartitionedTensor (1/tp of the activation per tensor
    rank, re-gathered by the receiver) in every version read: 0.3.15 for activations only,
    0.5.4 on for gradients too. A pipelined tp=2 plan's transfers cost less than whole sends."""
    from meshtron.planner.frameworks import PRESETS

    old, new = PRESETS["deepspeed@2021"].kernel, PRESETS["deepspeed@2024"].kernel
    assert old.p2p_scatter_gather and old.p2p_grads_whole
    assert new.p2p_scatter_gather and not new.p2p_grads_whole
    whole = _neox_eval(p2p_scatter_gather=False, p2p_grads_whole=False)[2].time.pp_comm
    assert _neox_eval(p2p_scatter_gather=new.p2p_scatter_gather,
                      p2p_grads_whole=new.p2p_grads_whole)[2].time.pp_comm < 0.6 * whole


def test_deepspeed_0_3_pipeline_all_reduces_zero1_and_its_plain_engine_reduce_scatters():
    """The deepspeed@2021 preset (DeepSpeed 0.3.15) and the MT-NLG stack run the pipeline
    engine of 0.3.x, whose `_exec_reduce_grads` all-reduces under ZeRO-1; without a pipeline
    the engine's ZeRO-1 reduce-scatters (runtime/engine.py allreduce_gradients). The same
    ZeRO-1 plan on 16 A100s, pp 2 against pp 1, prices its reduction accordingly."""
    from meshtron.model.spec import preset
    from meshtron.planner import comm
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.frameworks import PRESETS
    from meshtron.planner.plan import Plan
    from bench.published.stacks import DEEPSPEED_PIPE_2021

    fw = PRESETS["deepspeed@2021"]
    assert fw.kernel.zero1_all_reduce and DEEPSPEED_PIPE_2021.zero1_all_reduce
    assert not PRESETS["deepspeed@2024"].kernel.zero1_all_reduce
    ev = Evaluator(preset("llama2-13b"), preset_cluster("dgx-a100", 2), 256, 2048, fw.kernel,
                   mem=fw.memory)
    for pp, collective in ((2, comm.all_reduce), (1, comm.reduce_scatter)):
        groups = ev._groups(Plan(tp=2, pp=pp, dp=8 // pp, zero=1, micro_batch=1))
        red, _ = ev.once_per_step(1e9, 1, groups, 2.0)
        assert red == pytest.approx(collective(2e9, groups["dp"], ev.fab))


def test_torchtitan_rows_price_torchtitan_s_eager_loss_on_both_paths():
    """torchtitan's loss is eager (train.py of December 2024: `torch.compile(loss_fn)`
    commented out): whole fp32 logits, no chunked head replay. The command line's torchtitan
    preset says so; the Python path (`PublishedRun.row_memory`) priced these rows with
    meshtron's chunked loss, the fsdp2 default, until each row stated it."""
    from meshtron.planner.frameworks import preset

    tt = [r for r in published_runs() if r.stack.startswith("torchtitan")]
    assert len(tt) >= 20
    loss = preset("torchtitan").memory.loss_kind
    assert loss == "eager"
    assert {r.name: r.row_memory.loss_kind for r in tt} == {r.name: loss for r in tt}
