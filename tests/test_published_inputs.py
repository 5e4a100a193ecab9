"""The inputs of the Megatron-DeepSpeed rows of the published table (bench/published/), each
checked against the code or paper it was read from (issue 30 item 3, branch neox)."""

from __future__ import annotations

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
