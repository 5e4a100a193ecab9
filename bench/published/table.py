"""Published training runs, reproduced from their layouts: the planner's honest validation table.

Every row fixes what its source states: model shapes, GPU and network, software stack, layout
(tp, pp, dp, ZeRO stage / FSDP sharding), global batch, sequence length, recomputation,
attention kernel. Knobs a source does not state (micro-batch size, virtual stages) are searched
over the values the software allowed and the fastest kept, as a user tuning the run would have.
Where a row rests on other assumptions, its `note` says so and `confident` is False.

Rows are split in two parts:

* 'calibration': what the model's constants were chosen while looking at (Megatron-LM 2021,
  Table 1, in ../shared/calibration and `calibration.megatron_2021_rows`; Korthikanti et al.
  2022, Table 5, which the tests have asserted since the first planner). They are not fitted
  one by one, but they are not independent evidence either.
* 'validation': every other row. No constant was set, and no formula chosen, by looking at
  their errors. Their mean and max error are the planner's honest accuracy.

What each published figure counts (`metric`), converted to the planner's outputs as:

* 'hw_tflops': TFLOP/s per GPU counting recomputation, Megatron's 96BslH^2(1 + s/6h + V/16lh)
  formula (Narayanan et al. 2021, eq. 3): the planner's hardware TFLOP/s (tests check the two
  FLOP counts agree to 1% with full recomputation);
* 'model_tflops': TFLOP/s per GPU without recomputation (6N + attention square);
* 'mfu': model TFLOP/s over the dense bf16 peak;
* 'step_s': seconds per optimizer step;
* 'tokens_per_gpu': tokens per second per GPU (torchtitan's TPS/GPU, llm-foundry's T/s/GPU):
  free of any FLOP convention.

Error = predicted throughput / published throughput - 1 (positive: the planner is optimistic).
The prediction is the planner's time for the published layout with its layer split balanced for
time (the run fitted on the real machine; whether the planner's memory model agrees is reported
separately as `fits`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import ClusterSpec, preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Estimate, Evaluator
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.plan import Plan
from meshtron.planner.plan_rules_pipeline import most_chunks

METRICS = ("hw_tflops", "model_tflops", "mfu", "step_s", "tokens_per_gpu")
PARTS = ("calibration", "validation")


@dataclass(frozen=True)
class PublishedRun:
    """A published training run with its layout fixed as published."""

    name: str
    """Short label."""
    source: str
    """Citation: paper / document, table or section."""
    stack: str
    """Software that ran it (Megatron-LM, DeepSpeed, torchtitan, llm-foundry, ...)."""
    model: ModelSpec
    """Model shapes."""
    cluster: ClusterSpec
    """GPUs and network."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel degree."""
    zero: int
    """ZeRO stage (3 = fully sharded: FSDP FULL_SHARD, ZeRO-3; 2 = SHARD_GRAD_OP)."""
    recompute: str
    """'none' | 'selective' | 'full' | 'half' (every second layer fully recomputed: torchtitan's
    selective layer AC; its op-level AC recomputes a comparable share and is costed the same) |
    'any' (not published: the fastest the memory model accepts, as for micro-batches)."""
    sp: bool
    """Sequence parallelism."""
    opts: KernelOptions
    """Software choices (stack, attention kernel, dropout, gradient reduction)."""
    metric: str
    """What `published` counts (module docstring)."""
    published: float
    """The published figure."""
    part: str = "validation"
    """'calibration' or 'validation' (module docstring)."""
    micro_batches: tuple[int, ...] = (1,)
    """Micro-batch sizes the run may have used (the fastest is kept)."""
    schedules: tuple[str, ...] = ("1f1b",)
    """Pipeline schedules it may have used."""
    dp_replicate: int = 1
    """HSDP replica groups (with zero >= 2)."""
    note: str = ""
    """Assumptions and details."""
    confident: bool = True
    """False where the layout or the figure rests on our assumptions."""
    memory: MemoryOptions | None = None
    """Whose memory layout the run had (memory.MemoryOptions); None: the stack's default
    (memory.options_for: meshtron's FSDP2 runtime for 'eager', Megatron-LM for 'fused')."""

    @property
    def row_memory(self) -> MemoryOptions:
        """`memory` (or the stack's default) as the run's model code kept it: every published
        stack here repeated K and V per query head for grouped-query attention (torchtitan's
        and Hugging Face's `repeat_kv`; Megatron's saved-tensor list does not read it), so
        `gqa_copies` is set, where meshtron's own model uses SDPA's native GQA."""
        import dataclasses

        from meshtron.planner import memory as _memory

        return dataclasses.replace(self.memory or _memory.options_for(self.opts),
                                   gqa_copies=True)
    cp: int = 1
    """Context-parallel degree (GPUs = tp * cp * pp * dp)."""
    dtype: str = "bf16"
    """Precision: 'bf16', or 'fp8' (Float8 linears, torchao / Transformer Engine)."""
    published_memory_gib: float | None = None
    """Peak memory per GPU the source reports, GiB (None: not reported)."""
    virtual_stages: int | None = None
    """Virtual pipeline stages per rank of an interleaved schedule, where the source or the
    software's default fixes them (None: searched)."""
    ep: int = 1
    """Expert-parallel degree (mixtures of experts; folded over dp x cp, not a factor of the
    GPUs)."""
    etp: int | None = None
    """Expert tensor-parallel degree the run's recipe sets (Megatron-Core's folding: ep * etp
    divides tp x cp x dp; Plan.etp); None: the stack's own."""
    pipeline_runs: int = 1
    """Pipeline schedule calls per optimizer step where the source states them (NeMo
    AutoModel's GA column with PP: GA schedule.step calls of LBS/MBS micro-batches; Plan.
    pipeline_runs); 1: one schedule of all the step's micro-batches."""
    regression: str = ""
    """Where the software's own maintainers say the figure measures a performance regression
    they then fixed (an issue or release note): such rows stay in the table and are reported
    both with and without them."""

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise UserError(f"metric={self.metric!r}: allowed {', '.join(METRICS)}")
        if self.part not in PARTS:
            raise UserError(f"part={self.part!r}: allowed {', '.join(PARTS)}")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def gpu(self) -> str:
        return self.cluster.gpu or self.cluster.name

    def layout(self) -> str:
        z = f" zero={self.zero}" if self.zero else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        ep += f" etp={self.etp}" if self.etp is not None else ""
        runs = f" runs={self.pipeline_runs}" if self.pipeline_runs > 1 else ""
        return f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}{ep}{z}{runs}"


@dataclass(frozen=True)
class PublishedPrediction:
    """The planner's prediction for a published layout: `timing` is the fastest unpublished-knob
    choice with the time-balanced layer split (memory ignored: the run did fit), `estimate` the
    fastest one the planner's memory model accepts (None when it rejects them all)."""

    run: PublishedRun
    timing: Estimate
    estimate: Estimate | None
    step_s: float
    """Predicted seconds per step (for 'half' recomputation: the mean of none and full)."""

    def value(self) -> float:
        run, est = self.run, self.timing
        gpus = run.gpus
        tokens = run.global_batch * run.seq_len
        if run.metric == "step_s":
            return self.step_s
        if run.metric == "tokens_per_gpu":
            return tokens / self.step_s / gpus
        model_tflops = est.model_tflops_per_gpu * est.step_time_s / self.step_s
        if run.metric == "model_tflops":
            return model_tflops
        if run.metric == "mfu":
            return model_tflops * 1e12 / run.cluster.peak_flops
        return est.hardware_tflops_per_gpu * est.step_time_s / self.step_s

    @property
    def predicted(self) -> float:
        return self.value()

    @property
    def error(self) -> float:
        """Relative error of predicted throughput (positive: the planner is optimistic)."""
        if self.run.metric == "step_s":
            return self.run.published / self.value() - 1.0
        return self.value() / self.run.published - 1.0

    @property
    def fits(self) -> bool:
        return self.estimate is not None


def _candidates(run: PublishedRun, recompute: str) -> list[Plan]:
    plans = []
    for mb in run.micro_batches:
        if run.global_batch % (run.dp * mb):
            continue
        m = run.global_batch // (run.dp * mb)
        scheds: list[tuple[str, int]] = []
        for s in run.schedules if run.pp > 1 else ("1f1b",):
            if s == "interleaved":
                vs = (run.virtual_stages,) if run.virtual_stages else (2, 3, 4, 6, 8)
                most = most_chunks(run.row_memory.split_rule, run.model.layers, run.pp)
                scheds += [("interleaved", v) for v in vs if most >= v and m % run.pp == 0]
            else:
                scheds.append((s, 1))
        for sched, v in scheds:
            plans.append(Plan(run.tp, run.pp, run.dp, run.zero, mb, recompute, run.sp, sched, v,
                              dp_replicate=run.dp_replicate, dtype=run.dtype, cp=run.cp,
                              ep=run.ep, etp=run.etp,
                              pipeline_runs=run.pipeline_runs if run.pp > 1 else 1,
                              attention=run.opts.attention,
                              reduce_dtype="fp32" if run.opts.fp32_grad_reduce else "bf16"))
    return plans


def _fastest(run: PublishedRun, recompute: str) -> tuple[Estimate, Estimate | None]:
    ev = Evaluator(run.model, run.cluster, run.global_batch, run.seq_len, run.opts,
                   mem=run.row_memory)
    roomy = dataclasses.replace(run.cluster, memory_gib=1e6)
    ev_t = Evaluator(run.model, roomy, run.global_batch, run.seq_len, run.opts, mem=run.row_memory)
    timing: Estimate | None = None
    fitting: Estimate | None = None
    for plan in _candidates(run, recompute):
        t = ev_t.evaluate(plan)
        if timing is None or t.step_time_s < timing.step_time_s:
            timing = t
        est = ev.evaluate(plan)
        if est.fits and (fitting is None or est.step_time_s < fitting.step_time_s):
            fitting = est
    if timing is None:
        raise UserError(f"{run.name}: no micro-batch / schedule is valid for the published layout")
    return timing, fitting


def predict_published(run: PublishedRun) -> PublishedPrediction:
    """Evaluate `run` with its published layout (see PublishedPrediction)."""
    if run.recompute == "any":
        best = None
        for rec in ("none", "selective", "full"):
            t, f = _fastest(run, rec)
            if f is not None and (best is None or f.step_time_s < best[1].step_time_s):
                best = (t, f)
        if best is None:
            t, f = _fastest(run, "full")
            return PublishedPrediction(run, t, None, t.step_time_s)
        return PublishedPrediction(run, best[0], best[1], best[0].step_time_s)
    if run.recompute == "half":
        t0, f0 = _fastest(run, "none")
        t1, f1 = _fastest(run, "full")
        step = 0.5 * (t0.step_time_s + t1.step_time_s)
        return PublishedPrediction(run, t0, f1, step)
    timing, fitting = _fastest(run, run.recompute)
    return PublishedPrediction(run, timing, fitting, timing.step_time_s)


def summary(preds: list[PublishedPrediction]) -> dict[str, float]:
    """Mean and max |error| and the count of a list of predictions."""
    errs = [abs(p.error) for p in preds]
    if not errs:
        return {"n": 0, "mean": 0.0, "max": 0.0}
    return {"n": len(errs), "mean": sum(errs) / len(errs), "max": max(errs)}


# ---- models -----------------------------------------------------------------------------------
def gpt_model(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200,
              seq: int = 2048, tied: bool = True, bias: bool = True) -> ModelSpec:
    """A GPT-3-style decoder (GeLU MLP of 4h, LayerNorm, learned positions, biases)."""
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn_hidden=4 * hidden, vocab=vocab, max_seq=seq, mlp="gelu",
                     norm="layernorm", position="learned", tied_embeddings=tied, bias=bias)


def mpt_model(name: str, layers: int, hidden: int, heads: int, seq: int) -> ModelSpec:
    """MosaicML MPT as llm-foundry's benchmark yamls build it (scripts/train/yamls/pretrain/
    mpt-*.yaml with MPTConfig's defaults, 2023-24): GeLU MLP of 4h, LayerNorm, tied embeddings,
    vocabulary 50368, and, since the yamls set neither `no_bias` nor `alibi`, biases in every
    linear and norm (no_bias=False) and a learned position table (learned_pos_emb=True, alibi
    False): the benchmark README's NumParams are 12Lh^2 + 13Lh + 50368h + seq*h + 2h exactly
    (tests/test_published_mpt.py). The released MPT checkpoints' ALiBi and no-bias settings
    are not what the benchmarks ran."""
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn_hidden=4 * hidden, vocab=50368, max_seq=seq, mlp="gelu",
                     norm="layernorm", position="learned", tied_embeddings=True, bias=True)


# ---- clusters ---------------------------------------------------------------------------------
def grand_teton_h100_500w(nodes: int) -> ClusterSpec:
    """torchtitan's benchmark machines (benchmarks/llama3_h100_202412_torchtitan.md): H100 with
    96 GB HBM2e at 2.4 TB/s, 500 W power limit, 400 Gb/s per GPU. The document says the peak is
    'between SXM and NVL' and unknown: we take the middle of 989 (SXM) and 835 (NVL) TFLOP/s."""
    c = preset_cluster("dgx-h100", nodes)
    return dataclasses.replace(c, name=f"grand-teton-500w:{nodes}", peak_tflops=912.0,
                               hbm_gb_per_s=2400.0, memory_gib=95.0)


def jean_zay(nodes: int) -> ClusterSpec:
    """IDRIS Jean Zay A100 partition used for BLOOM: 8 x A100-SXM4-80GB per node on NVLink, 4 x
    Omni-Path 100 Gb/s per node (BigScience 2022, 'BLOOM', section 3.4.1): 6.25 GB/s per GPU."""
    return dataclasses.replace(preset_cluster("dgx-a100", nodes), name=f"jean-zay:{nodes}",
                               inter_node_gb_per_s=6.25)


def dgx2h(nodes: int, gpus_per_node: int = 16) -> ClusterSpec:
    """NVIDIA DGX-2H (Megatron-LM 2019, Shoeybi et al., section 5): 16 V100-SXM3 32 GB per node
    on NVSwitch (150 GB/s per direction), 8 x 100 Gb/s InfiniBand per node: 6.25 GB/s per GPU.
    `gpus_per_node` < 16: a run on part of one node."""
    return ClusterSpec(name=f"dgx-2h:{nodes}", gpu="V100-SXM2-32GB", peak_tflops=125.0,
                       memory_gib=32.0, gpus_per_node=gpus_per_node, nodes=nodes,
                       intra_node_gb_per_s=150.0, inter_node_gb_per_s=6.25, hbm_gb_per_s=900.0)


def a100_40gb(nodes: int, nic_gb_per_s: float = 25.0) -> ClusterSpec:
    """A100-SXM4-40GB nodes of 8 on NVLink with `nic_gb_per_s` of network per GPU."""
    return dataclasses.replace(preset_cluster("dgx-a100", nodes), gpu="A100-SXM4-40GB",
                               memory_gib=40.0, hbm_gb_per_s=1555.0,
                               inter_node_gb_per_s=nic_gb_per_s, name=f"a100-40gb:{nodes}")


def h800(nodes: int) -> ClusterSpec:
    """DeepSeek's H800 cluster (DSV3 sections 3.1, 3.2.2): H100 silicon with NVLink cut to 400
    GB/s bidirectional (200 per direction; 160 achieved, as the preset's 0.8 gives) and one
    400 Gb/s InfiniBand NIC per GPU (50 GB/s)."""
    c = preset_cluster("dgx-h100", nodes)
    # the catalogue's H100-SXM5-80GB: the same compute and HBM (the cut is NVLink only)
    return dataclasses.replace(c, name=f"h800:{nodes}", intra_node_gb_per_s=200.0,
                               inter_node_gb_per_s=50.0)
