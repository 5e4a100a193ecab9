"""The planner's named results for one plan: `TimeBreakdown` (seconds by cause) and
`Estimate` (the prediction). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.planner import memory
from meshtron.planner.pipeline import stages_of_rank
from meshtron.planner.plan import Plan


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one optimizer step, by cause (they add up to the step time)."""

    compute: float
    """Computation of the critical stage over all its micro-batches (recomputation included)."""
    tp_comm: float
    """Tensor-parallel collectives of the critical stage (not overlapped)."""
    pp_comm: float
    """Pipeline point-to-point transfers on the critical path."""
    dp_comm: float
    """Data-parallel / ZeRO communication left exposed after overlap with compute."""
    bubble: float
    """Pipeline fill and drain idle time."""
    optimizer: float
    """AdamW update (on the host with plan.offload)."""
    ep_comm: float = 0.0
    """Expert-parallel all-to-alls of the critical stage left exposed (planner/moe_cost.py)."""
    offload: float = 0.0
    """Host-link copies of offloaded shards and gradients (planner/offload.py), not overlapped."""
    step_host: float = 0.0
    """Host work once per step that the idle GPU waits for, outside the micro-batches and the
    optimizer: Composer's synchronisation of its train metrics at the batch's end
    (planner/composer_metrics.py); 0 for every other stack."""
    fp8_sync: float = 0.0
    """Transformer Engine's delayed-scaling FP8 amax all-reduces over a stage's dp x tp x cp
    ranks (planner/fp8_amax.py: a few bytes each, latency-bound, blocking, never overlapped):
    not data-parallel traffic (no gradient compression shrinks them); 0 without them."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble
                + self.optimizer + self.ep_comm + self.offload + self.step_host + self.fp8_sync)

    def to_dict(self) -> dict[str, float]:
        out = {"compute": self.compute, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm,
               "dp_comm_exposed": self.dp_comm, "bubble": self.bubble,
               "optimizer": self.optimizer, "ep_comm": self.ep_comm}
        if self.offload:
            out["offload"] = self.offload
        if self.step_host:
            out["step_host"] = self.step_host
        if self.fp8_sync:
            out["fp8_sync"] = self.fp8_sync
        return out


@dataclass(frozen=True)
class SplitChoice:
    """How the layers were assigned to the pipeline ranks (estimate_memory._split), for the
    plan's explanation (search_explain.split_text)."""

    by: str
    """'given' (the plan's stage_layers), 'rule' (the priced stack's rule: `rule`), 'memory'
    (the rule's split did not fit: re-split within the per-rank `caps`), 'unfit' (no split
    fits: the rule's, which would run out of memory) or 'least' (no split fits: the one
    needing the least memory, pipeline.min_memory_partition)."""
    rule: str
    """The layer-to-stage rule priced (memory_options.PIPELINE_SPLITS)."""
    layers: int
    """The model's layers."""
    layer_s: float
    """One layer's forward and backward per micro-batch on one rank, seconds."""
    first_s: float
    """What the first rank runs beside its layers per micro-batch (the embedding), seconds."""
    last_s: float
    """What the last rank runs beside its layers (the output head and the loss), seconds."""
    free: tuple[int, ...] = ()
    """by='memory': the rule's split without memory limits, which did not fit."""
    caps: tuple[int, ...] = ()
    """by='memory': the most layers each rank's memory holds."""
    over: tuple[int, ...] = ()
    """by='memory': the ranks `free` put over their memory."""
    head_first: bool = False
    """The output head and loss run on rank 0 beside the embedding (torch's V: `first_s`
    holds both, pipeline.head_rank)."""


@dataclass(frozen=True)
class Estimate:
    """The planner's prediction for one plan."""

    config: Plan
    """Knobs of the plan."""
    stage_layers: list[int]
    """Layers per (virtual) stage, pipeline order."""
    num_microbatches: int
    """Micro-batches per replica per step."""
    memory: memory.MemoryBreakdown
    """Memory of the fullest GPU, GiB."""
    time: TimeBreakdown
    """Step time by cause, seconds."""
    tokens_per_s: float
    """Training throughput of the whole cluster."""
    model_tflops_per_gpu: float
    """Model FLOPs (no recomputation) per second per GPU, TFLOP/s."""
    hardware_tflops_per_gpu: float
    """Executed FLOPs (recomputation included) per second per GPU, TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation: model TFLOP/s / peak."""
    hfu: float
    """Hardware FLOPs utilisation: hardware TFLOP/s / peak."""
    fits: bool
    """Some layer split keeps every stage within device memory."""
    split: SplitChoice | None = None
    """How the layer split was chosen (pp > 1; None without a pipeline)."""

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def layers_per_rank(self) -> list[int]:
        """Layers each pipeline rank holds: the sum of its virtual stages (`stage_layers` is
        in pipeline order; torch's V puts stages r and 2pp-1-r on rank r:
        pipeline.stages_of_rank)."""
        c = self.config
        sched = c.schedule or "1f1b"
        return [sum(self.stage_layers[s] for s in stages_of_rank(c.pp, c.virtual_stages, sched, r))
                for r in range(c.pp)]

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 86400.0

    def gpu_hours(self, tokens: float, gpus: int) -> float:
        return tokens / self.tokens_per_s / 3600.0 * gpus

    def to_plan(self, model_name: str, cluster_name: str, gpus: int, global_batch: int,
                seq_len: int, attention: str) -> Plan:
        c = self.config
        if gpus != c.gpus:
            raise ValueError(f"to_plan: gpus={gpus} but the plan has tp*cp*pp*dp={c.gpus}")
        return c.replace(model=model_name, cluster=cluster_name, global_batch=global_batch,
                    seq_len=seq_len, stage_layers=tuple(self.stage_layers), attention=attention,
                    predicted={"step_time_s": round(self.step_time_s, 6),
                               "tokens_per_s": round(self.tokens_per_s, 1),
                               "memory_gib": round(self.memory.total, 3),
                               "mfu": round(self.mfu, 4), "hfu": round(self.hfu, 4)})

    def to_dict(self, tokens: float | None = None, gpus: int | None = None,
                price: float | None = None) -> dict[str, Any]:
        c = self.config
        d: dict[str, Any] = {
            "tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "zero": c.zero,
            "micro_batch": c.micro_batch, "reduce_dtype": c.reduce_dtype,
            "accumulate_unsharded": c.accumulate_unsharded,
            "num_microbatches": self.num_microbatches, "recompute": c.recompute, "sp": c.sp,
            "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "dp_replicate": c.dp_replicate, "dtype": c.dtype, "offload": c.offload,
            "stage_layers": list(self.stage_layers), "fits": self.fits,
            "memory_gib": self.memory.to_dict(), "time_s": self.time.to_dict(),
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu, "hfu": self.hfu,
        }
        if getattr(c, "etp", None) is not None:  # Megatron-Core's folding (Plan.etp)
            d["etp"] = c.etp
        if c.pipeline_runs > 1:  # schedule calls per step (Plan.pipeline_runs)
            d["pipeline_runs"] = c.pipeline_runs
        if tokens is not None and gpus is not None:
            d["days"] = self.days(tokens)
            d["gpu_hours"] = self.gpu_hours(tokens, gpus)
            d["cost"] = d["gpu_hours"] * price if price is not None else None
        return d
