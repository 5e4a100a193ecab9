"""FP8 step-time physics of the planner (issue 30, item 3), each effect pinned from the code it
comes from: what quantising a Linear's operands moves under torchao's recipes (eager and
compiled) and Transformer Engine's delayed / current scaling, how often a stack casts a shared
input, Transformer Engine's once-per-step weight cache, torchao's FP8 all-gather under FSDP2.
No figure of a published row or of a measured run."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner import compute as C
from meshtron.planner import gemm as G
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.fp8 import (EAGER_CAST_BYTES, GEMM_GROUPS, ROWWISE_COMPILED_EXCESS,
                                  cast_bytes, fp8_fractions, fp8_gathers_fp8, fp8_input_casts)
from meshtron.planner.fp8_gather import gathered_weight_casts, torchao_gathers_fp8
from meshtron.planner.frameworks import preset
from meshtron.planner.plan import Plan

H100 = resolve_cluster("dgx-h100:1")
L8 = PRESETS["llama3-8b"]
ALL = dict.fromkeys(GEMM_GROUPS, 1.0)


def _total(cb) -> tuple[float, float, float]:
    """(per activation element, per output-gradient element, per weight element and
    micro-batch) over a whole training step of one Linear."""
    return cb.input_fwd + cb.input_bwd, cb.grad_bwd, cb.weight_fwd + cb.weight_bwd + cb.wgrad_out


def test_torchao_compiled_casts_are_torchaos_own_roofline():
    # rowwise: each activation cast along both axes (fp8 dim0 1 + bf16 transposed copy 2, then
    # the copy read 2 + fp8 1), the weight twice with a transpose between (3 + 4 + 3), and the
    # backward's weight-gradient output scaled after cuBLAS (2 + 2); on the input, what
    # torchao's own rowwise table measures beyond that roofline (test_planner_fp8_rowwise.py)
    assert _total(cast_bytes("torchao", "rowwise", compiled=True)) == \
        (6.0 + ROWWISE_COMPILED_EXCESS, 6.0, 14.0)
    # tensorwise: max-abs fused into the producer, one cast writing both layouts (2 + 1 + 1);
    # the weight: max-abs read (2) and one cast per pass (3 + 3)
    assert _total(cast_bytes("torchao", "tensorwise", compiled=True)) == (4.0, 4.0, 8.0)
    # torchtitan's scaling names the recipe whatever the plan's is
    assert cast_bytes("torchao-tensorwise", "rowwise", True) == \
        cast_bytes("torchao", "tensorwise", True)


def test_torchao_eager_recasts_every_operand_per_gemm():
    # abs (2+2), amax (2), fp32 upcast (2+4), scale (4+4), clamp (4+4), fp8 cast (4+1)
    assert EAGER_CAST_BYTES == 2 + 2 + 2 + 2 + 4 + 4 + 4 + 4 + 4 + 4 + 1
    cb = cast_bytes("torchao", "rowwise", compiled=False)
    # two casts per operand (float8_linear.py casts again for each GEMM), one layout copy of
    # the transposed backward operand (1 + 1), rowwise's in-place rescale of both backward
    # GEMM outputs (2 + 2)
    assert _total(cb) == (2 * 33 + 2, 2 * 33 + 2, 2 * 33 + 2 + 4)
    assert cb.dgrad_out == 4.0 and cb.per_linear
    assert cast_bytes("torchao", "tensorwise").wgrad_out == 0.0  # cuBLAS scales tensorwise
    # eager always moves more than compiled
    for recipe in ("rowwise", "tensorwise"):
        e, c = (_total(cast_bytes("torchao", recipe, x)) for x in (False, True))
        assert all(a > b for a, b in zip(e, c))


def test_transformer_engine_current_scaling_reads_twice_and_caches_weights():
    delayed, current = cast_bytes("te-delayed"), cast_bytes("te-current")
    # a fused cast-transpose: read bf16 once, write both FP8 layouts (2 + 1 + 1)
    assert (delayed.input_fwd, delayed.grad_bwd) == (4.0, 4.0)
    # current scaling's amax is a read of its own (TE docs: two tensor reads per quantization)
    assert (current.input_fwd - delayed.input_fwd, current.grad_bwd - delayed.grad_bwd,
            current.weight_step - delayed.weight_step) == (2.0, 2.0, 2.0)
    # the weight is cast once per step (is_first_microbatch), never per micro-batch
    for cb in (delayed, current):
        assert cb.weight_fwd == cb.weight_bwd == 0.0 and cb.weight_step > 0
        assert not cb.per_linear and cb.input_bwd == 0.0  # the transposed copy was saved


def test_transformer_engine_norm_writes_the_qkv_and_fc1_inputs_quantised():
    """Megatron-Core's QKV and fc1 are LayerNormLinear: with delayed scaling the norm writes
    rowwise FP8 (1 byte) where it wrote bf16 (2) and TE transposes that FP8 tensor for the
    columnwise copy (1 + 1): one byte beyond the bf16 norm; the attention output and the MLP
    activation are cast by a cast-transpose (2 + 1 + 1)."""
    h, f = L8.hidden, L8.ffn_hidden
    fwd, _ = C.quantisation_bytes(L8, 1, ALL, cast_bytes("te-delayed"))
    assert fwd == pytest.approx(4.0 * (h + f) + (1 + 1 + 1 - 2) * 2 * h)
    fwd_cur, _ = C.quantisation_bytes(L8, 1, ALL, cast_bytes("te-current"))
    # current scaling: the norm computes the amax beside its bf16 output (TE >= 2.7,
    # FUSED_NORM_AMAX_FP8), then one read and both FP8 layouts (2 + 1 + 1); the attention
    # output and Megatron's own SwiGLU output pay the unfused cast (amax read 2 + 2 + 1 + 1)
    assert fwd_cur == pytest.approx(4.0 * (h + h) + 6.0 * (h + f))


def test_transformer_engine_current_scaling_norm_fusion_saves_only_the_amax_read():
    """The fused norm-amax removes exactly one bf16 read (2 bytes) per element of the two
    norm-fed inputs (QKV, fc1) per token, and nothing in the backward."""
    cur = cast_bytes("te-current")
    unfused = dataclasses.replace(cur, normed_fwd=None)
    f_fused, b_fused = C.quantisation_bytes(L8, 1, ALL, cur)
    f_unfused, b_unfused = C.quantisation_bytes(L8, 1, ALL, unfused)
    assert f_unfused - f_fused == pytest.approx(2.0 * 2 * L8.hidden)
    assert b_fused == b_unfused
    # delayed scaling knows its scale before the norm runs: the norm writes FP8 itself, only
    # the transpose of that FP8 copy is left (1 + 1 - the bf16 byte it no longer writes)
    assert cast_bytes("te-delayed").normed_fwd == 1.0 < cur.normed_fwd < cur.input_fwd


def test_eager_torchao_casts_a_shared_input_once_per_linear():
    """Llama's wq/wk/wv and w1/w3 are separate Linears reading one tensor: eager torchao casts
    it once per FP8 Linear; a compiled graph (CSE) or a fused QKV / fc1 (TE) once."""
    assert fp8_input_casts(L8, 1, "rowwise", "all") == {"qkv": 3, "out": 1, "up": 2, "down": 1}
    # torchao's rowwise filter keeps wk and wv (N = 1024) in bf16: the qkv input is cast once
    assert fp8_input_casts(L8, 1, "rowwise", "torchao")["qkv"] == 1
    eager = cast_bytes("torchao", "rowwise", False)
    casts = fp8_input_casts(L8, 1, "rowwise", "all")
    once = dataclasses.replace(eager, per_linear=False)
    f_many, b_many = C.quantisation_bytes(L8, 1, ALL, eager, casts)
    f_once, b_once = C.quantisation_bytes(L8, 1, ALL, once, casts)
    h, f = L8.hidden, L8.ffn_hidden
    extra_inputs = 2 * h + 1 * h  # two more casts of the qkv input, one more of the MLP's
    assert f_many - f_once == pytest.approx(eager.input_fwd * extra_inputs)
    assert b_many - b_once == pytest.approx((eager.input_bwd + eager.dgrad_out) * extra_inputs)
    assert f_once == pytest.approx(eager.input_fwd * (h + h + h + f))


def test_layer_cost_difference_between_recipes_is_their_cast_bytes():
    """At every FP8 Linear (fp8_filter 'all') the two torchao recipes run the same GEMMs: the
    compiled layers differ by exactly the bytes their casts move over the streaming
    bandwidth."""
    opts = C.KernelOptions(stack="compiled", fp8_filter="all")
    tokens = 8192
    cost = {r: C.layer_cost(L8, H100, 1, 1, tokens, False, opts, 1, "fp8", None, r)
            for r in ("rowwise", "tensorwise")}
    bw = C.membound_bytes_per_s(H100, "compiled")
    moved = {}
    for r in cost:
        cb = cast_bytes("torchao", r, True)
        if torchao_gathers_fp8(opts, r):  # tensorwise under FSDP2: the weight comes cast
            cb = gathered_weight_casts(cb)
        f, b = C.quantisation_bytes(L8, 1, ALL, cb)
        w = C.fp8_weight_elements(L8, 1, ALL)
        moved[r] = tokens * (f + b) + (cb.weight_fwd + cb.weight_bwd + cb.wgrad_out) * w
    got = sum(cost["rowwise"].__dict__[k] - cost["tensorwise"].__dict__[k] for k in ("fwd", "bwd"))
    assert got == pytest.approx((moved["rowwise"] - moved["tensorwise"]) / bw, rel=1e-9)
    assert got > 0  # rowwise casts every operand along both axes


def test_transformer_engine_weight_cast_is_per_step_not_per_microbatch():
    mcore = preset("megatron@2024").kernel
    assert mcore.fp8_scaling == "te-delayed"
    current = dataclasses.replace(mcore, fp8_scaling="te-current")
    frac = tuple(fp8_fractions(L8, 1, "rowwise", "all").values())
    w = C.fp8_weight_elements(L8, 1, dict(zip(GEMM_GROUPS, frac)))
    bw = C.membound_bytes_per_s(H100, "fused")
    assert C.fp8_step_cast_s(L8, H100, 1, mcore, frac) == pytest.approx(4.0 * w / bw)
    assert C.fp8_step_cast_s(L8, H100, 1, current, frac) == pytest.approx(6.0 * w / bw)
    assert C.fp8_step_cast_s(L8, H100, 1, C.KernelOptions(), frac) == 0.0  # torchao: per mb
    # through the evaluator: one step's weight casts, whatever the number of micro-batches
    cl = resolve_cluster("dgx-h100:1")
    small = dataclasses.replace(L8, layers=2)
    step = {}
    for scaling in ("te-delayed", "te-current"):
        opts = dataclasses.replace(mcore, fp8_scaling=scaling)
        for gb in (2, 8):
            ev = Evaluator(small, cl, gb, 4096, opts)
            step[scaling, gb] = ev.evaluate(Plan(1, 1, 1, 0, 1, "none", False, None, 1,
                                                 dtype="fp8")).step_time_s
    per_step_extra = 2.0 * small.layers * w / bw  # current - delayed weight bytes, once
    extra = {gb: step["te-current", gb] - step["te-delayed", gb] for gb in (2, 8)}
    # the activations' extra amax read scales with the micro-batches, the weights' does not
    act = (extra[8] - extra[2]) / 6  # per micro-batch
    assert extra[2] == pytest.approx(2 * act + per_step_extra, rel=1e-6)


def test_fp8_all_gather_only_where_the_runtime_gathers_fp8():
    assert fp8_gathers_fp8("torchao", "tensorwise")            # meshtron, tensorwise on CUDA
    assert not fp8_gathers_fp8("torchao", "rowwise")           # a rowwise scale spans shards
    assert not fp8_gathers_fp8("torchao-tensorwise", "tensorwise")  # torchtitan's default off
    assert not fp8_gathers_fp8("te-delayed", "tensorwise")
    ev = Evaluator(L8, resolve_cluster("dgx-h100:8"), 64, 8192)
    plan = Plan(1, 1, 64, 3, 1, "full", False, None, 1, dtype="fp8")
    rowwise = ev.dp_flags(plan)["wsize"]
    tensorwise = ev.dp_flags(dataclasses.replace(plan, fp8_recipe="tensorwise"))["wsize"]
    assert rowwise == C.BF16
    # the weights of the FP8 Linears (tensorwise's filter leaves wk and wv, N = 1024 and
    # K = 4096, in bf16) gather 1 byte per parameter instead of 2, the rest of the block 2
    frac = fp8_fractions(L8, 1, "tensorwise", "torchao")
    assert frac["qkv"] == pytest.approx(4096 / 6144) and frac["up"] == 1.0
    block = L8.attention_params() + L8.ffn_params(0)
    assert tensorwise == pytest.approx(2.0 - C.fp8_weight_elements(L8, 1, frac) / block)
    assert 1.0 < tensorwise < 1.1


def test_transformer_engine_fp8_param_gather_moves_one_byte_per_fp8_weight():
    """Megatron's --fp8-param-gather (KernelOptions.fp8_param_gather): the distributed
    optimizer / Megatron-FSDP all-gathers the FP8 Linears' weights (every aligned block
    Linear under TE) at 1 byte; norms stay bf16. Off by default, as in Megatron-Core."""
    mcore = preset("megatron@2024").kernel
    assert not mcore.fp8_param_gather
    assert fp8_gathers_fp8("te-current", "rowwise", True, "zero")
    assert not fp8_gathers_fp8("te-current", "rowwise", False, "zero")
    cl = resolve_cluster("dgx-h100:1")
    plan = Plan(1, 1, 8, 3, 1, "none", False, None, 1, dtype="fp8")
    on = dataclasses.replace(mcore, fp8_scaling="te-current", fp8_param_gather=True)
    ev_off = Evaluator(L8, cl, 64, 8192, dataclasses.replace(on, fp8_param_gather=False))
    ev_on = Evaluator(L8, cl, 64, 8192, on)
    assert ev_off.dp_flags(plan)["wsize"] == C.BF16
    block = L8.attention_params() + L8.ffn_params(0)
    linears = C.fp8_weight_elements(L8, 1, ALL)
    assert ev_on.dp_flags(plan)["wsize"] == pytest.approx(2.0 - linears / block)
    assert ev_on.dp_flags(plan)["wsize"] < 1.01  # a dense block's weights are its Linears
    # the option changes the parameter gathers only: no compute term moves
    a, b = (ev.evaluate(plan).time for ev in (ev_off, ev_on))
    assert a.compute == pytest.approx(b.compute)
    assert b.dp_comm < a.dp_comm  # ZeRO-3 at dp 8 inside a node: the gathers are exposed
    # bf16 plans gather bf16 whatever the option says
    assert ev_on.dp_flags(dataclasses.replace(plan, dtype="bf16"))["wsize"] == C.BF16
    # torchao has no such option: refused by name
    with pytest.raises(UserError, match="fp8_param_gather=True with fp8_scaling='torchao'"):
        C.KernelOptions(fp8_param_gather=True)


def test_unknown_fp8_scaling_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="fp8_scaling='fast'.*te-current"):
        C.KernelOptions(fp8_scaling="fast")
    opts = tmp_path / "o.toml"
    opts.write_text('[options]\nfp8_scaling = "fast"\n')
    proc = subprocess.run([sys.executable, "-m", "meshtron", "plan", "--model", "llama3-8b",
                           "--cluster", "dgx-h100:1", "--global-batch", "8", "--seq-len",
                           "4096", "--dtype", "fp8", "--options", str(opts)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "fp8_scaling='fast'" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_sequence_parallel_inputs_are_cast_on_the_shard_then_transposed():
    """Transformer Engine under sequence parallelism quantises a gathered tensor on the local
    1/tp shard (rowwise only), gathers the FP8 and transposes the gathered copy for the weight
    gradient (Hopper cannot gather the transposed layout): (bytes - 1) / tp + 1 + 1."""
    h, f, tp = L8.hidden, L8.ffn_hidden, 8
    cur = cast_bytes("te-current")
    plain = C.quantisation_bytes(L8, tp, ALL, cur, None, sp=False)
    fwd, bwd = C.quantisation_bytes(L8, tp, ALL, cur, None, sp=True)
    # forward: the attention output (h/tp per token) and the MLP activation (f/tp) as without
    # sequence parallelism; the two normed inputs (h each) on the shard, then transposed
    # (the norm-fed ones at current scaling's fused-amax 4 bytes: 3 on the shard, rowwise)
    assert fwd == pytest.approx(6.0 * (h + f) / tp + ((4.0 - 1.0) / tp + 2.0) * 2 * h)
    # backward: the row-parallel outputs' gradients (out-proj, MLP-down: h each) are gathered
    assert bwd - plain[1] == pytest.approx(((6.0 - 1.0) / tp + 2.0 - 6.0) * 2 * h)
    assert fwd < plain[0] and bwd < plain[1]
    # torchao gathers FP8 under tensorwise scaling only (Float8ColwiseParallel); rowwise
    # gathers bf16 and casts the gathered tensor
    for compiled in (True, False):
        rw = cast_bytes("torchao-rowwise", compiled=compiled)
        assert C.quantisation_bytes(L8, tp, ALL, rw, None, sp=True) == \
            C.quantisation_bytes(L8, tp, ALL, rw, None, sp=False)
        tw = cast_bytes("torchao-tensorwise", compiled=compiled)
        assert C.quantisation_bytes(L8, tp, ALL, tw, None, sp=True)[0] < \
            C.quantisation_bytes(L8, tp, ALL, tw, None, sp=False)[0]


def test_cublas_fp8_gemms_saturate_in_m_and_n_as_bf16_does():
    """Hopper's FP8 tiles are bf16's in m and n and twice as deep in k (the same 128 bytes per
    k-step): at twice the peak, an FP8 GEMM's m and n saturate at the bf16 width d, its k at
    2d. So the FP8 / bf16 speed of a cuBLAS FP8 GEMM depends on k alone, 2 (k + d) / (k + 2d),
    whatever m and n; blockwise scaling (DeepSeek-V3's promotion every 128 k-elements) keeps
    m and n at the FP8 balance's width and loses more on narrow shapes."""
    bf, f8 = H100.at_dtype("bf16"), H100.at_dtype("fp8")
    assert f8.peak_tflops == pytest.approx(2 * bf.peak_tflops, rel=1e-3)  # 1979 and 989
    d = G.SAT_DIM * (bf.peak_flops * bf.matmul_ceiling / bf.hbm_bytes_per_s) / G.REFERENCE_RIDGE
    cublas = C.fp8_tile_scale(C.KernelOptions())
    block = C.fp8_tile_scale(C.KernelOptions(fp8_gemm="blockwise"))
    assert (cublas, block) == (0.5, 1.0)
    k = 4096
    ratios = {}
    for n in (1280, 14336):
        t16 = C.cluster_gemm_time(16384, n, k, bf)
        ratios[n] = {kind: t16 / C.cluster_gemm_time(16384, n, k, f8, C.FP8, scale)
                     for kind, scale in (("cublas", cublas), ("blockwise", block))}
    for n in ratios:
        assert ratios[n]["cublas"] == pytest.approx(2 * (k + d) / (k + 2 * d), rel=2e-3)
    assert ratios[1280]["blockwise"] < ratios[14336]["blockwise"] < ratios[14336]["cublas"]
    # bf16 GEMMs are what they were: the defaults are bf16's bytes and widths
    assert C.cluster_gemm_time(16384, 1280, k, bf) == G.gemm_time(
        16384, 1280, k, bf.peak_flops * bf.matmul_ceiling, bf.hbm_bytes_per_s)


def test_fp8_gemm_kind_prices_fp8_layers_only_and_is_refused_by_name():
    block = C.KernelOptions(stack="fused", fp8_filter="all", fp8_gemm="blockwise")
    cublas = dataclasses.replace(block, fp8_gemm="cublas")
    fp8 = {o.fp8_gemm: C.layer_cost(L8, H100, 1, 1, 8192, False, o, 1, "fp8")
           for o in (block, cublas)}
    # the forward GEMMs: blockwise promotes, cuBLAS accumulates fast; the backward ones
    # promote in both (KernelOptions.fp8_split_accum_bwd, on by default)
    assert fp8["blockwise"].fwd > fp8["cublas"].fwd
    assert fp8["blockwise"].bwd == fp8["cublas"].bwd
    bf16 = [C.layer_cost(L8, H100, 1, 1, 8192, False, o, 1, "bf16") for o in (block, cublas)]
    assert bf16[0] == bf16[1]
    with pytest.raises(UserError, match="fp8_gemm='fast': allowed values are cublas, blockwise"):
        C.KernelOptions(fp8_gemm="fast")


def test_fp8_backward_gemms_promote_their_partial_sums_the_forward_one_does_not():
    """torchao (Float8LinearConfig: gemm_config_output fast accumulation, grad_input and
    grad_weight the Float8GemmConfig default without) and Transformer Engine
    (`_2X_ACC_FPROP = False`, `_2X_ACC_DGRAD = _2X_ACC_WGRAD = True`) run a Linear's two
    backward GEMMs with split accumulation: the partial sums leave the tensor cores every few
    k-steps, the promotion blockwise kernels make, so those GEMMs saturate as blockwise ones
    do and the forward GEMM as cuBLAS's fast-accumulating kernel. Dropping it (every GEMM
    with fast accumulation) leaves the forward as it was and speeds up the backward only;
    bf16 layers never read the option."""
    fast = C.KernelOptions(stack="fused", fp8_filter="all", fp8_split_accum_bwd=False)
    split = dataclasses.replace(fast, fp8_split_accum_bwd=True)
    assert C.KernelOptions().fp8_split_accum_bwd  # the stacks' default
    assert (C.fp8_tile_scale(split), C.fp8_tile_scale(split, backward=True)) == (0.5, 1.0)
    assert (C.fp8_tile_scale(fast), C.fp8_tile_scale(fast, backward=True)) == (0.5, 0.5)
    for tp, tokens in ((1, 8192), (8, 4096)):
        lc = {o.fp8_split_accum_bwd: C.layer_cost(L8, H100, tp, 1, tokens, tp > 1, o, 1, "fp8")
              for o in (fast, split)}
        assert lc[True].fwd == lc[False].fwd
        assert lc[True].bwd > lc[False].bwd
        # the weight-gradient GEMMs are the promoted ones: what a zero-bubble W step runs
        assert lc[True].wgrad > lc[False].wgrad
        # the backward GEMMs cost what blockwise GEMMs of the same shapes cost
        block = C.layer_cost(L8, H100, tp, 1, tokens, tp > 1,
                             dataclasses.replace(fast, fp8_gemm="blockwise"), 1, "fp8")
        assert lc[True].wgrad == pytest.approx(block.wgrad, rel=1e-12)
        assert lc[True].bwd - lc[False].bwd == pytest.approx(
            2 * (lc[True].wgrad - lc[False].wgrad), rel=1e-9)
    bf16 = [C.layer_cost(L8, H100, 1, 1, 8192, False, o, 1, "bf16") for o in (fast, split)]
    assert bf16[0] == bf16[1]


def test_fp8_fast_accumulation_option_reads_from_the_options_table():
    """A stack whose backward GEMMs accumulate fast says so in [options]; a non-boolean is
    refused in one line naming the field."""
    from meshtron.planner.frameworks import with_options

    fw = with_options(preset("torchtitan"), {"fp8_split_accum_bwd": False})
    assert fw.kernel.fp8_split_accum_bwd is False
    with pytest.raises(UserError, match="fp8_split_accum_bwd"):
        with_options(preset("torchtitan"), {"fp8_split_accum_bwd": "no"})


def test_selective_recompute_replays_the_forward_gemms_not_the_promoted_backward_ones():
    """torchtitan's "op" policy keeps every other matmul output, meshtron's keeps them all: what
    the backward runs again is priced from the forward's GEMMs (LayerCost.linear_fwd), so
    promoting the backward GEMMs (fp8_split_accum_bwd) adds exactly their extra time to a
    layer, twice per Linear, and nothing to the replayed forward."""
    from meshtron.planner.memory import MemoryOptions

    tt = preset("torchtitan").kernel
    cl = resolve_cluster("dgx-h100:1")
    for mem in (MemoryOptions(framework="fsdp2", activations="alternate-matmul"),
                MemoryOptions(framework="fsdp2")):
        layer = {}
        for split in (False, True):
            opts = dataclasses.replace(tt, fp8_split_accum_bwd=split)
            ev = Evaluator(L8, cl, 8, 8192, opts, mem=mem)
            micro = ev._micro(1, 1, False, "selective", 1, "fp8", 1, "tensorwise")
            lc = C.layer_cost(L8, cl, 1, 1, 8192, False, opts, 1, "fp8", None, "tensorwise",
                              ev.mem.gqa_copies and ev.mem.framework != "megatron")
            layer[split] = (micro.layer, lc)
        (fast, lc_fast), (slow, lc_slow) = layer[False], layer[True]
        assert lc_slow.linear_fwd == lc_fast.linear_fwd < lc_slow.wgrad
        assert slow - fast == pytest.approx(lc_slow.bwd - lc_fast.bwd, rel=1e-9)


def test_fp8_expert_gemms_promote_in_the_backward_as_the_dense_ones_do():
    """The routed experts' grouped GEMMs (Transformer Engine's GroupedLinear takes the same
    split-accumulator flags) are priced, in the backward, with the promoted kernel the dense
    equivalent's backward was charged with: the expert extra over it moves with the option,
    the forward's does not; blockwise GEMMs promote whatever the option says."""
    from meshtron.planner import moe_cost, placement

    moe = PRESETS["qwen3-30b-a3b"]
    cl = resolve_cluster("dgx-h100:1")
    group = placement.ep_group(1, 8, 8)

    def cost(split, gemm="cublas"):
        return moe_cost.moe_layer_cost(moe, cl, 8192.0, 8, group, "fp8", 1.0, False, 0,
                                       "fused", 1, 1, 0.0, 0.0, True, "te-current", gemm,
                                       split)

    fast, slow = cost(False), cost(True)
    assert slow.compute_fwd == fast.compute_fwd
    # the experts' GEMMs run on few rows each, where promotion costs most: their extra grows
    assert slow.compute_bwd > fast.compute_bwd
    assert cost(False, "blockwise") == cost(True, "blockwise")
    # bf16 experts never read it
    bf = [moe_cost.moe_layer_cost(moe, cl, 8192.0, 8, group, "bf16", 1.0, False, 0, "fused",
                                  1, 1, 0.0, 0.0, True, "te-current", "cublas", s)
          for s in (False, True)]
    assert bf[0] == bf[1]


def _fp8_tps(*framework: str) -> list[int]:
    """tp of every plan and alternative `meshtron plan --dtype fp8 --json` offers."""
    import json

    proc = subprocess.run([sys.executable, "-m", "meshtron", "plan", "--model", "llama3-8b",
                           "--cluster", "dgx-h100:4", "--global-batch", "256", "--seq-len",
                           "8192", "--dtype", "fp8", "--top", "20", "--json", *framework],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    alts = [int(a["layout"].split(",")[0].split("=")[1]) for a in doc["alternatives"]]
    return [p["tp"] for p in doc["plans"]] + alts


def test_meshtrons_fp8_plans_never_use_tensor_parallelism_its_runtime_refuses():
    """meshtron's runtime trains FP8 at tp = 1 only (plan.fp8_runtime_problem); the search for
    its stack offered tp = 2 FP8 plans (the 8b-fp8 answer's best) that `train` then refused.
    Another stack's search still prices FP8 with tp."""
    ours = _fp8_tps()
    assert ours and set(ours) == {1}, ours
    theirs = _fp8_tps("--framework", "torchtitan")
    assert any(tp > 1 for tp in theirs), theirs


def test_a_pinned_fp8_tp_layout_for_meshtrons_runtime_names_why_in_one_line():
    """Every point of a pinned tp=8 FP8 layout is refused for meshtron's runtime, hopeless ones
    included (their leanest point is refused too): the answer is the validity function's
    reason, not "no layout is valid"."""
    proc = subprocess.run([sys.executable, "-m", "meshtron", "plan", "--model", "llama3-70b",
                           "--cluster", "dgx-h100:1", "--global-batch", "64", "--seq-len", "8192",
                           "--dtype", "fp8", "--layout", "tp=8,pp=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "plan.dtype='fp8' with tp=8" in proc.stderr, proc.stderr
