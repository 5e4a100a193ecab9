"""Reproduce published runs from their layouts (used by the calibration test and bench).

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
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec, preset
from meshtron.planner.cluster import ClusterSpec, preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.plan import Plan

MEGATRON_2021 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                              fp32_grad_reduce=True, stack="fused")


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


# ---- other published runs (not used to set any constant) ---------------------------------------
#
# Each entry fixes the layout and software the source states; knobs the source does not state
# (micro-batch size, virtual stages) are searched over the values the software allowed, the best
# one kept, as for the Megatron-LM 2021 rows. Figures are from the papers' tables as cited; where
# a detail is our assumption the `note` says so. `metric` is what the source reports:
# 'step_s' (iteration time), 'hw_tflops' (TFLOP/s per GPU counting recomputation, Megatron's
# 96BslH^2(...) formula) or 'model_tflops' (TFLOP/s per GPU without recomputation).


def gpt_model(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200,
              seq: int = 2048, tied: bool = True) -> ModelSpec:
    """A GPT-3-style decoder (GeLU MLP of 4h, LayerNorm, learned positions, biases)."""
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn_hidden=4 * hidden, vocab=vocab, max_seq=seq, mlp="gelu",
                     norm="layernorm", position="learned", tied_embeddings=tied, bias=True)


@dataclass(frozen=True)
class PublishedRun:
    """A published training run with its layout fixed as published."""

    name: str
    source: str
    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    seq_len: int
    tp: int
    pp: int
    dp: int
    zero: int
    recompute: str
    sp: bool
    opts: KernelOptions
    metric: str
    published: float
    micro_batches: tuple[int, ...] = (1,)
    schedules: tuple[str, ...] = ("1f1b",)
    note: str = ""
    confident: bool = True
    """False where the layout or the figure rests on our assumptions (not used in tests)."""


MEGATRON_2022 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                              fp32_grad_reduce=True)
DEEPSPEED_2021 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                               fp32_grad_reduce=False, p2p_scatter_gather=False)


def _jean_zay(nodes: int) -> ClusterSpec:
    # IDRIS Jean Zay A100 partition used for BLOOM: 8 x A100-SXM4-80GB per node on NVLink, 4 x
    # Omni-Path 100 Gb/s per node (BigScience 2022, "BLOOM", section 3.4.1): 50 GB/s per node,
    # 6.25 GB/s per GPU.
    return dataclasses.replace(preset_cluster("dgx-a100", nodes), name=f"jean-zay:{nodes}",
                               inter_node_gb_per_s=6.25)


def published_runs() -> list[PublishedRun]:
    K22 = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer "
           "Models', Tables 3 and 5 (Selene DGX A100)")
    MTNLG = ("Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG "
             "530B', section 2.3 (DGX A100, batch 1920)")
    L3 = "Llama Team 2024, 'The Llama 3 Herd of Models', Table 4 (H100 700 W, 400 Gb/s RoCE)"
    runs: list[PublishedRun] = []
    k22 = [  # name, layers, hidden, heads, tp, pp, gpus, batch, selective+SP s, full s
        ("22B", 48, 6144, 64, 8, 1, 8, 4, 1.10, 1.42),
        ("175B", 96, 12288, 96, 8, 8, 64, 64, 13.75, 18.13),
        ("530B", 105, 20480, 128, 8, 35, 280, 280, 37.83, 49.05),
        ("1T", 128, 25600, 160, 8, 64, 512, 512, 71.49, 94.42),
    ]
    for name, L, h, a, tp, pp, gpus, B, t_sel, t_full in k22:
        model = gpt_model(f"gpt-{name}", L, h, a, tied=False)
        cl = preset_cluster("dgx-a100", gpus // 8)
        mbs = (4,) if name == "22B" else (1,)
        sch = ("1f1b",) if pp == 1 else ("1f1b", "interleaved")
        runs.append(PublishedRun(f"K22 {name} sel+SP", K22, model, cl, B, 2048, tp, pp, 1, 0,
                                 "selective", True, MEGATRON_2022, "step_s", t_sel, mbs, sch,
                                 "dp=1: no data-parallel traffic"))
        runs.append(PublishedRun(f"K22 {name} full", K22, model, cl, B, 2048, tp, pp, 1, 0,
                                 "full", False, MEGATRON_2022, "step_s", t_full, mbs, sch,
                                 "baseline; SP off assumed"))
    runs.append(PublishedRun(
        "K22 530B sel+SP 2240", "Korthikanti et al. 2022, abstract (54.2% MFU on 2240 A100)",
        gpt_model("gpt-530B", 105, 20480, 128, tied=False), preset_cluster("dgx-a100", 280),
        2240, 2048, 8, 35, 8, 0, "selective", True, MEGATRON_2022, "mfu", 0.542, (1,),
        ("1f1b", "interleaved"), "batch 2240 assumed (8 per replica x 280 as the 280-GPU row)",
        confident=False))
    for nodes, t, tf in ((280, 60.1, 126.0), (350, 50.2, 121.0), (420, 44.4, 113.0)):
        dp = nodes * 8 // (8 * 35)
        runs.append(PublishedRun(
            f"MT-NLG 530B {nodes * 8}", MTNLG, gpt_model("mt-nlg-530b", 105, 20480, 128,
                                                         tied=False),
            preset_cluster("dgx-a100", nodes), 1920, 2048, 8, 35, dp, 1, "full", False,
            DEEPSPEED_2021, "hw_tflops", tf, (1,), ("1f1b",),
            "DeepSpeed 1F1B pipeline, ZeRO-1, mb=1 (assumed), gradients reduced after backward"))
    for nodes, dp, tf in ((1024, 64, 430.0), (2048, 128, 400.0)):
        runs.append(PublishedRun(
            f"Llama3 405B {nodes * 8}", L3, preset("llama3-405b"),
            preset_cluster("dgx-h100", nodes), 2048, 8192, 8, 16, dp, 1, "none", True,
            KernelOptions(), "model_tflops", tf, (1,), ("interleaved",),
            "FlashAttention, SP, no recompute, ZeRO-1-like FSDP, mb=1 (assumed)"))
    runs.append(PublishedRun(
        "BLOOM 176B 384", "BigScience 2022, 'BLOOM', section 3.4 (~150 TFLOP/s, Jean Zay A100)",
        gpt_model("bloom-176b", 70, 14336, 112, vocab=250880, tied=False), _jean_zay(48),
        2048, 2048, 4, 12, 8, 1, "full", False,
        KernelOptions(attention="unfused", dropout=False, overlap_grad_reduce=False,
                      p2p_scatter_gather=False),
        "hw_tflops", 150.0, (2,), ("1f1b",),
        "Megatron-DeepSpeed, ZeRO-1, mb=2, full recompute; ALiBi modelled as learned positions",
        confident=False))
    runs.append(PublishedRun(
        "OPT 175B 992", "Zhang et al. 2022, 'OPT', section 2.4 (147 TFLOP/s per A100 80GB)",
        gpt_model("opt-175b", 96, 12288, 96, tied=False), preset_cluster("dgx-a100", 124),
        992, 2048, 8, 1, 124, 3, "full", False,
        KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=True),
        "hw_tflops", 147.0, (1, 2, 4, 8), ("1f1b",),
        "FSDP + Megatron TP; batch 992 (~2M tokens), full recompute and FLOP count assumed",
        confident=False))
    return runs


@dataclass(frozen=True)
class PublishedPrediction:
    """The planner's prediction for a published layout, two ways: `estimate` is the fastest
    unpublished-knob choice that fits the planner's memory model (its layer split may be
    skewed to make it fit); `timing` is the fastest choice with the time-balanced layer split,
    memory ignored (the run did fit on the real machine), so it tests the time model alone."""

    run: PublishedRun
    estimate: Estimate
    timing: Estimate

    def value(self, est: Estimate) -> float:
        metric = self.run.metric
        if metric == "step_s":
            return est.step_time_s
        if metric == "hw_tflops":
            return est.hardware_tflops_per_gpu
        if metric == "model_tflops":
            return est.model_tflops_per_gpu
        return est.mfu

    def rel_error(self, est: Estimate) -> float:
        """Relative error of predicted throughput (positive: the planner is optimistic)."""
        if self.run.metric == "step_s":
            return self.run.published / self.value(est) - 1.0
        return self.value(est) / self.run.published - 1.0

    @property
    def predicted(self) -> float:
        return self.value(self.estimate)

    @property
    def error(self) -> float:
        return self.rel_error(self.estimate)

    @property
    def timing_error(self) -> float:
        return self.rel_error(self.timing)


def predict_published(run: PublishedRun) -> PublishedPrediction:
    """Evaluate `run` with its published layout (see PublishedPrediction)."""
    ev = Evaluator(run.model, run.cluster, run.global_batch, run.seq_len, run.opts)
    roomy = dataclasses.replace(run.cluster, memory_gib=1e6)
    ev_t = Evaluator(run.model, roomy, run.global_batch, run.seq_len, run.opts)
    best: Estimate | None = None
    lean: Estimate | None = None
    fastest: Estimate | None = None
    for mb in run.micro_batches:
        if run.global_batch % (run.dp * mb):
            continue
        m = run.global_batch // (run.dp * mb)
        scheds: list[tuple[str, int]] = []
        for s in run.schedules if run.pp > 1 else ("1f1b",):
            if s == "interleaved":
                scheds += [("interleaved", v) for v in (2, 3, 4, 6, 8)
                           if run.model.layers // run.pp >= v and m % run.pp == 0]
            else:
                scheds.append((s, 1))
        for sched, v in scheds:
            cfg = Plan(run.tp, run.pp, run.dp, run.zero, mb, run.recompute, run.sp, sched, v,
                       dtype="bf16")
            est = ev.evaluate(cfg)
            if est.fits and (best is None or est.step_time_s < best.step_time_s):
                best = est
            if lean is None or est.memory.total < lean.memory.total:
                lean = est
            t = ev_t.evaluate(cfg)
            if fastest is None or t.step_time_s < fastest.step_time_s:
                fastest = t
    if lean is None or fastest is None:
        raise UserError(f"{run.name}: no schedule is valid for the published layout")
    return PublishedPrediction(run, best or lean, fastest)
