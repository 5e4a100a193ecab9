"""The inputs of llm-foundry's MPT rows of the published table (bench/published/rows_pytorch.py),
each checked against what llm-foundry's benchmark scripts ran, and the cost of flash-attn's
unpad / pad around the kernel that its `attn_impl: flash` runs (issue 30 item 3, branch mpt)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.published.runs import published_runs

# NumParams of scripts/train/benchmarking/README.md's H100 tables (llm-foundry, January 2024)
README_PARAMS = {("1b", 2048): 1315950592, ("3b", 2048): 2651837440,
                 ("7b", 2048): 6658859008, ("13b", 2048): 12853954560,
                 ("30b", 2048): 29975214080, ("70b", 2048): 64862437376,
                 ("7b", 8192): 6684024832}


def _lf_rows():
    return [r for r in published_runs() if r.name.startswith("LF MPT-")]


def _size_seq(name: str) -> tuple[str, int]:
    size, seq = name.split()[1:3]
    return size.removeprefix("MPT-"), int(seq.removeprefix("s"))


def test_mpt_rows_are_the_models_the_benchmarks_built():
    """The benchmark yamls set neither no_bias nor alibi: biases everywhere and a learned
    position table, which the README's NumParams count to the parameter; 30b has 56 heads of
    128 (mpt-30b.yaml), not 64."""
    rows = _lf_rows()
    assert len(rows) == 18
    for run in rows:
        size, seq = _size_seq(run.name)
        assert run.model.bias and run.model.position == "learned", run.name
        assert run.model.head_dim == 128, run.name
        if (size, seq) in README_PARAMS:
            assert run.model.num_params() == README_PARAMS[(size, seq)], run.name
    # without biases every size would miss its published count (13 h per layer + 2 h)
    seven = next(r for r in rows if r.name == "LF MPT-7b s2048 512xH100").model
    assert dataclasses.replace(seven, bias=False).num_params() < README_PARAMS[("7b", 2048)]


def test_mpt_rows_attention_implementation_is_the_sweeps():
    """sweep.py (llm-foundry #838) ran `--attn_impl flash` for 1b, 3b, 7b and 70b and `triton`
    for 13b and 30b on >= 128 H100s; sweep.sh (#543) left the 8-GPU rows at
    submit_benchmarks.py's default 'triton'. Only the flash rows pay bert_padding."""
    flash = {"1b", "3b", "7b", "70b"}
    for run in _lf_rows():
        size, _ = _size_seq(run.name)
        gpus = int(run.name.split()[-1].split("x")[0])
        expect = size in flash and gpus >= 128 and "H100" in run.name
        assert run.opts.flash_unpad == expect, run.name
        assert ("attn_impl flash" in run.note) == expect, run.name
        # the 2022 Triton kernel (triton-pre-mlir) issues Ampere's mma.sync only
        assert run.opts.flash_isa == ("native" if expect else "sm80"), run.name


def _layer(flash_unpad: bool, tp: int = 1):
    from bench.published.table import mpt_model
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import KernelOptions, layer_cost

    model = mpt_model("mpt-1b", 24, 2048, 16, 2048)
    kern = KernelOptions(stack="eager", flash_unpad=flash_unpad)
    cl = resolve_cluster("dgx-h100:1")
    return layer_cost(model, cl, tp, 12, 2048, False, kern), model, cl


def test_flash_unpad_costs_its_copies_and_synchronisations():
    """bert_padding around the varlen kernel (planner/flash_unpad.py): per token and layer, 3
    gathers of h-wide bf16 tensors (read + write) and the output's zeros + index_put forward
    (18 h bytes in all), the pad's gather and 3 x (zeros + scatter) backward (22 h bytes);
    six host synchronisations and 16 launches with an empty queue per forward."""
    from meshtron.planner import host
    from meshtron.planner.compute import dispatch_s, membound_bytes_per_s

    with_, model, cl = _layer(True)
    plain, _, _ = _layer(False)
    h, tokens = model.hidden, 12 * 2048
    bw = membound_bytes_per_s(cl, "eager")
    idle = 6 * host.SYNC_S + 16 * dispatch_s(cl)
    assert with_.fwd - plain.fwd == pytest.approx(tokens * 18 * h / bw + idle, rel=1e-6)
    assert with_.bwd - plain.bwd == pytest.approx(tokens * 22 * h / bw, rel=1e-6)
    # the copies are per tensor-parallel rank: half the heads, half the bytes
    half, _, _ = _layer(True, tp=2)
    half_plain, _, _ = _layer(False, tp=2)
    assert half.bwd - half_plain.bwd == pytest.approx(0.5 * (with_.bwd - plain.bwd), rel=1e-6)


def test_flash_unpad_lengthens_the_flash_rows_step():
    """The priced step of MPT-1b at 512 H100 (attn_impl flash) grows by the unpad cost: over
    2% of it (24 layers of 18 + 22 h bytes per token and six synchronisations each)."""
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    def step(run, unpad: bool) -> float:
        kern = dataclasses.replace(run.opts, flash_unpad=unpad)
        ev = Evaluator(run.model, run.cluster, run.global_batch, run.seq_len, kern,
                       mem=run.row_memory)
        plan = Plan(1, 1, run.dp, run.zero, run.micro_batches[0], run.recompute, False,
                    None, 1, dtype="bf16")
        return ev.evaluate(plan).time.total

    rows = {r.name: r for r in _lf_rows()}
    one_b = rows["LF MPT-1b s2048 512xH100"]
    assert one_b.opts.flash_unpad
    assert step(one_b, True) > 1.02 * step(one_b, False)


def test_mpt_rows_mixed_precision_is_the_composer_they_ran():
    """Composer's FSDP 'DEFAULT' gathers bf16 parameters since composer#2047 (March 2023) and
    reduces in fp32 since composer#2628 (v0.16.4): the January 2024 >= 128-GPU rows (Composer
    0.17.2) reduce in fp32, the October 2023 8-GPU rows (llm-foundry v0.3.0, Composer 0.16.3
    assumed) in bf16; no row gathers fp32 parameters. PURE: bf16 everywhere."""
    for run in _lf_rows():
        gpus = int(run.name.split()[-1].split("x")[0])
        amp = run.note.split("; ")[2] == "amp"
        assert not run.opts.fp32_params_autocast, run.name
        assert run.opts.fp32_grad_reduce == (amp and gpus >= 128), run.name
        # every row stays calibration: priced before with the fp32-parameter mechanism, or
        # read as validation from the start (the A100 PURE rows)
        assert run.part == ("validation" if not amp else "calibration"), run.name


def _core(isa: str, cluster: str, seq: int = 2048) -> float:
    """Forward attention-core seconds of one MPT-7b layer (12 sequences) with the flash
    kernel issuing `isa`'s instructions."""
    from bench.published.table import mpt_model
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import KernelOptions, layer_cost

    model = mpt_model("mpt-7b", 32, 4096, 32, seq)
    kern = KernelOptions(stack="eager", flash_isa=isa)
    return layer_cost(model, resolve_cluster(cluster), 1, 12, seq, False, kern).core_fwd


def test_mma_sync_flash_kernel_runs_at_half_the_hopper_peak():
    """planner/flash_isa.py: a kernel compiled to mma.sync (llm-foundry's Triton kernel) sees
    Ampere's per-SM tensor rate, half an H100's datasheet peak: its core's GEMMs are priced at
    that peak, slower than a native kernel's by what the GEMM model gives at half the FLOP
    rate (not exactly 2x: the head_dim-wide GEMMs are partly bandwidth- and tile-bound), and
    never faster. On an A100 mma.sync is the native instruction: no change."""
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.flash_isa import core_cluster

    h100 = resolve_cluster("dgx-h100:1")
    assert core_cluster(h100, "sm80").peak_tflops == pytest.approx(h100.peak_tflops / 2)
    assert core_cluster(h100, "native") is h100
    for seq in (2048, 8192):
        native, sm80 = _core("native", "dgx-h100:1", seq), _core("sm80", "dgx-h100:1", seq)
        assert 1.15 * native < sm80 <= 2.0 * native, seq
    # short sequences: the tile model at half the peak saturates sooner; never faster
    assert _core("sm80", "dgx-h100:1", 512) >= _core("native", "dgx-h100:1", 512)
    assert _core("sm80", "dgx-a100:1") == _core("native", "dgx-a100:1")


def test_flash_isa_is_one_of_its_names():
    from meshtron.errors import UserError
    from meshtron.planner.compute import KernelOptions

    with pytest.raises(UserError, match="flash_isa='wgmma': allowed values are native, sm80"):
        KernelOptions(flash_isa="wgmma")
