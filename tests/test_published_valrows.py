"""The inputs of the validation rows added in session 39 (bench/published/rows_nvidia_h100.py,
rows_pytorch.py torchtitan_float8_1d / torchtitan_async_tp_2025) and in session 42
(rows_dgxc2504.py), checked against the other columns of their own sources: a misread figure or
shape shows here, not in an error."""

from __future__ import annotations

import pytest

from bench.published.rows_nvidia_h100 import (_padded_vocab, mcore_flops_per_sequence,
                                              megatron_readme, nemo_2407)
from bench.published.runs import ADDED_S39, published_runs

# the MC24 table's columns the rows do not use: model size, MFU (%), aggregate PFLOP/s
MC24_CHECK = {"1.7B": (1.7, 41, 19.6), "7.1B": (7.1, 47, 44.7), "16B": (16, 49, 93.9),
              "32B": (32, 46, 176.5), "70B": (70, 42, 322.3), "119B": (119, 43, 645.9),
              "177B": (177, 44, 997.2), "314B": (314, 48, 1457.4),
              "462B": (462, 47, 2825.6)}


@pytest.mark.parametrize("run", megatron_readme(), ids=lambda r: r.name)
def test_megatron_readme_rows_agree_with_the_table_s_other_columns(run):
    size = run.name.split()[2]
    billions, mfu, pflops = MC24_CHECK[size]
    # the shapes give the published size (untied embeddings; tied, 177B would be 175.6B) to
    # the label's precision (1.75B is labelled 1.7B, 31.5B 32B)
    assert run.model.num_params() / 1e9 == pytest.approx(billions, rel=0.035)
    # the tokens/s the row holds, back to Megatron's TFLOP/s: the MFU column over 989 and
    # the aggregate column over the GPUs
    tflops = run.published * mcore_flops_per_sequence(run.model, run.seq_len) / run.seq_len / 1e12
    assert abs(tflops / 989.0 * 100 - mfu) <= 0.55
    assert tflops * run.gpus / 1e3 == pytest.approx(pflops, abs=0.06)
    assert run.dp == 48 and run.seq_len == 4096 and run.model.vocab == 131072


def test_megatron_flop_count_is_the_2024_formula():
    """72 B s L h^2 (1 + s/6h + V/12Lh) for a GPT with 4h MLP and as many KV as query heads:
    num_floating_point_operations reduces to N21's formula without recomputation (3/4 of 96)."""
    run = megatron_readme()[6]  # 177B: L 96, h 12288
    m, s = run.model, 4096
    expected = 72 * s * m.layers * m.hidden**2 * (1 + s / (6 * m.hidden)
                                                  + m.vocab / (12 * m.layers * m.hidden))
    assert mcore_flops_per_sequence(m, s) == pytest.approx(expected, rel=1e-12)


def test_nemo_rows_keep_the_published_gpu_counts_and_padding():
    published_gpus = [64, 64, 128, 512, 8, 16, 64, 64, 64, 128, 8, 64]
    rows = nemo_2407()
    assert [r.gpus for r in rows] == published_gpus
    assert all(r.dtype == "fp8" for r in rows)
    assert _padded_vocab(50257, 4) == 50688 and _padded_vocab(50257, 1) == 50304
    by_name = {r.name: r for r in rows}
    # the Nemotron shapes give the models' names: 8.5B, 21.3B and 341B
    assert by_name["NM24.07 Nemotron-340B 128xH100"].model.num_params() / 1e9 == \
        pytest.approx(340, rel=0.01)
    assert by_name["NM24.07 LLAMA3-70B 64xH100"].cp == 2


def test_added_rows_are_validation_unless_looked_at():
    """Validation as added; rows looked at in session 39 are calibration: the NeMo rows' memory
    breakdowns (branch nemomem, the reason in their note), the four float8 rowwise rows (branch
    rowwise) and the MC24 rows (branch smallgemm)."""
    from bench.published.runs import LOOKED_AT

    runs = {r.name: r for r in published_runs()}
    assert ADDED_S39 <= set(runs)
    # the 12 NeMo rows (branch nemomem: their memory) and the four float8 rowwise rows (branch
    # rowwise) steered choices (2026-12-05): calibration, with the reason; every other added row
    # is still validation and unseen
    seen = ADDED_S39 & set(LOOKED_AT)
    rowwise = {f"TT25 {s} FSDP{f} TP8 rowwise {label}" for s, f in (("70B", 32), ("8B", 8))
               for label in ("TP", "AsyncTP")}
    mc24 = {r.name for r in megatron_readme()}
    assert len(mc24) == 9
    assert seen == {r.name for r in nemo_2407()} | rowwise | mc24
    assert all(runs[n].part == "calibration" for n in seen)
    assert all("nemomem" in runs[n].note for n in seen - rowwise - mc24)
    assert all(runs[n].part == "validation" for n in ADDED_S39 - seen)


def _cli_memory(run) -> dict:
    """The row's plan through `meshtron plan` (bench/planner_cli_table.py): its memory, GiB."""
    from bench.planner_cli_table import run_row

    row = run_row(run)
    assert row["status"] in ("ok", "unfit")
    return row


def test_nemo_gradient_buffer_is_the_launchers_bf16_one():
    """NeMo 24.07's FP8 examples ran Apex's DistributedFusedAdam with grad_sync_dtype bf16
    (NeMo-Framework-Launcher tag 24.07: examples/training/{gpt,llama}/h100/*fp8*.sh,
    nemotron_340b.yaml; not the Nemotron-8B/22B scripts), whose contiguous gradient buffer
    is whole-size in that dtype (apex distributed_fused_adam.py `_init_grad_buffer`). Llama 2
    7B on 8 GPUs, term by term from the code: bf16 weights (DFA's contiguous param buffer) 2
    bytes per parameter, Transformer Engine's cached FP8 weight and transpose 2 per block GEMM
    weight, the gradient buffer 2, the optimizer's int16 param remainders + two fp32 moments
    2 + 8 over dp 8 (NeMo 2.0.0rc1 megatron_base_model.py `setup_optimization`:
    store_param_remainders for an fp32 optimizer beside the bf16 O2 model; branch mem405,
    MemoryOptions.master_weights). With the megatron preset's fp32 gradient buffer it read
    81.0 GiB, predicted not to fit."""
    rows = {r.name: r for r in nemo_2407()}
    fp32 = {n for n, r in rows.items() if r.opts.fp32_grad_reduce}
    assert fp32 == {"NM24.07 Nemotron-8B 64xH100", "NM24.07 Nemotron-22B 64xH100"}
    run = rows["NM24.07 LLAMA2-7B 8xH100"]
    m = run.model
    total = m.num_params()
    gemm = m.layers * (m.attention_params() + m.mlp_params())
    doc = _cli_memory(run)
    gib = 2.0**30
    mem = doc["memory"]
    assert mem["grads"] * gib == pytest.approx(2.0 * total, rel=1e-6)
    assert mem["params"] * gib == pytest.approx(2.0 * total + 2.0 * gemm, rel=1e-6)
    assert mem["optimizer"] * gib == pytest.approx((2.0 + 8.0) * total / 8, rel=1e-6)
    assert doc["status"] == "ok" and doc["need"] < 80.0


# session 42's rows (bench/published/rows_dgxc2504.py): the step times of the same tables,
# NVIDIA/dgxc-benchmarking v25.04 llama3.1/README.md, nemotron/README.md,
# nemo_megatron/README_175b.md ("Training step time (seconds per step)")
DGXC2504_STEP_S = {
    "Llama3.1 8B": {("BF16", 8): 12.27, ("BF16", 128): 12.33, ("FP8", 8): 9.33,
                    ("FP8", 128): 9.54},
    "Llama3.1 70B": {("BF16", 64): 14.66, ("BF16", 2048): 14.66, ("FP8", 64): 9.86,
                     ("FP8", 2048): 10.15},
    "Llama3.1 405B": {("BF16", 512): 19.78, ("BF16", 2048): 19.87, ("FP8", 512): 12.37,
                      ("FP8", 2048): 12.56},
    "Nemotron4 15B": {("BF16", 16): 2.66, ("BF16", 2048): 2.78, ("FP8", 16): 1.98,
                      ("FP8", 2048): 2.09},
    "Nemotron4 340B": {("BF16", 256): 4.36, ("BF16", 2048): 4.43, ("FP8", 256): 2.93,
                       ("FP8", 2048): 3.05},
    "GPT3 175B": {("BF16", 128): 8.309, ("BF16", 2048): 8.49, ("FP8", 128): 5.626,
                  ("FP8", 2048): 5.96},
}


def test_dgxc2504_rows_agree_with_their_tables_step_times():
    """Each row's tokens/s/GPU (the README's tokens/s column over the GPUs) equals sequence x
    global batch / step time of the same table over the GPUs, to the step time's rounding: a
    misread batch, GPU count or figure shows here."""
    from bench.published.rows_dgxc2504 import added_s42

    rows = added_s42()
    assert len(rows) == sum(len(v) for v in DGXC2504_STEP_S.values()) == 24
    for run in rows:
        _, family, size, gpus, dtype = run.name.split(" ")
        gpu_count = int(gpus.removesuffix("xH100"))
        assert gpu_count == run.cluster.nodes * 8 == run.tp * run.pp * run.cp * run.dp
        step_s = DGXC2504_STEP_S[f"{family} {size}"][(dtype, gpu_count)]
        tokens_s = run.seq_len * run.global_batch / step_s / gpu_count
        assert run.published == pytest.approx(tokens_s, rel=0.006), run.name


def test_olmo_core_rows_build_the_released_olmo_2_sizes():
    """The OLMC rows' OLMo 7B / 13B, built from OLMo-core's llama_like rule (rows_olmo_core.py:
    FFN 8 d / 3 rounded up to 256, the dolma2 vocabulary padded to 100,352, untied, QK-norm
    over the whole projections), have the parameter counts of the released OLMo-2-1124 models
    (7.3B and 13.7B): a misread width, depth or vocabulary shows here."""
    from bench.published.rows_olmo_core import DOLMA2_PADDED, olmo_core

    models = {r.name.split(" 8xH100")[0]: r.model for r in olmo_core()}
    assert DOLMA2_PADDED == 100352
    assert models["OLMC OLMo 7B"].num_params() == pytest.approx(7.3e9, rel=0.005)
    assert models["OLMC OLMo 13B"].num_params() == pytest.approx(13.7e9, rel=0.005)
    assert models["OLMC OLMo 7B"].ffn_hidden == 11008
    assert models["OLMC OLMo 13B"].ffn_hidden == 13824
    assert models["OLMC Llama 8B"].ffn_hidden == 14336
