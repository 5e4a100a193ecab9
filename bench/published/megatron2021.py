"""Reproduce published runs from their layouts (used by the calibration test and bench).

The validation table of other published runs lives in published.py / published_runs.py (and is
re-exported here).

`megatron_2021_rows(path)` reads `../shared/calibration/megatron_2021_weak_scaling.csv`
(Narayanan et al. 2021, Table 1); `predict_megatron_row(row)` evaluates the row's layout with the
software of that paper, the things the paper states and the product models as options:
GPT-style model (GeLU MLP of 4h, LayerNorm, learned positions, tied embeddings, biases), unfused
attention with dropout (FlashAttention did not exist), full recomputation, interleaved 1F1B,
no sequence parallelism and no ZeRO (both came later), fp32 gradient reduction not overlapped
with the backward pass (Megatron-LM 2021's DDP). Micro-batch size and virtual stages are not
published: the best of them is used, as a user tuning the run would have done.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.plan import Plan
from bench.published.table import PublishedPrediction, PublishedRun, predict_published
# The options the validation table uses for Megatron-LM 2021-2022 (stacks.py).
from bench.published.runs import published_runs
from bench.published.stacks import MEGATRON_2021

__all__ = ["MEGATRON_2021", "Prediction", "PublishedPrediction", "PublishedRun",
           "megatron_2021_rows", "predict_megatron_row", "predict_published", "published_runs"]


@dataclass(frozen=True)
class Prediction:
    """Predicted versus published hardware TFLOP/s per GPU for one row."""

    row: dict[str, str]
    """The CSV row."""
    estimate: Estimate
    """The planner's estimate for the best micro-batch / virtual-stage choice."""
    published: float
    """Published TFLOP/s per GPU (hardware FLOPs, recomputation counted)."""
    predicted_csv_formula: float
    """The CSV's FLOP formula divided by the predicted step time, per GPU."""

    @property
    def predicted(self) -> float:
        return self.estimate.hardware_tflops_per_gpu

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


def megatron_2021_rows(path: str | Path) -> list[dict[str, str]]:
    lines = [line for line in Path(path).read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(lines))


def predict_megatron_row(row: dict[str, str]) -> Prediction:
    h, L, a = int(row["hidden"]), int(row["layers"]), int(row["heads"])
    V, s = int(row["vocab"]), int(row["seq_len"])
    model = ModelSpec(name=f"gpt-{row['params_b']}b", layers=L, hidden=h, heads=a, kv_heads=a,
                      ffn_hidden=4 * h, vocab=V, max_seq=s, mlp="gelu", norm="layernorm",
                      position="learned", tied_embeddings=True, bias=True)
    gpus, tp, pp, B = int(row["gpus"]), int(row["tp"]), int(row["pp"]), int(row["global_batch"])
    dp = gpus // (tp * pp)
    cluster = preset_cluster("dgx-a100", gpus // 8)
    ev = Evaluator(model, cluster, B, s, MEGATRON_2021)
    best: Estimate | None = None
    for mb in (1, 2, 4, 8):
        if B % (dp * mb):
            continue
        m = B // (dp * mb)
        if pp == 1:
            scheds = [("1f1b", 1)]
        else:
            scheds = [("interleaved", v) for v in range(2, 9) if L // pp >= v and m % pp == 0]
            scheds = scheds or [("1f1b", 1)]
        for sched, v in scheds:
            est = ev.evaluate(Plan(tp, pp, dp, 0, mb, "full", False, sched, v, dtype="bf16"))
            if est.fits and (best is None or est.step_time_s < best.step_time_s):
                best = est
    if best is None:
        raise UserError(f"row {row['params_b']}B: no micro-batch fits in memory")
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return Prediction(row=row, estimate=best, published=float(row["tflops_per_gpu"]),
                      predicted_csv_formula=flops / best.step_time_s / gpus / 1e12)
