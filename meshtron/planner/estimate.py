"""Evaluate one fully specified plan: memory of the fullest GPU, step time and its breakdown.

Step time (per optimizer step, on the critical pipeline stage c):

    step = m * (compute_c + tp_comm_c) + bubble + pp_comm + dp_exposed + optimizer

* compute, tp_comm: per micro-batch times of the stage's layers and its embedding / LM head
  (compute.py), with recomputation (full: forward again incl. its tensor-parallel collectives;
  selective: the attention core again).
* bubble: pipeline.py (schedule dependent).
* pp_comm: every micro-batch crosses every (virtual) stage boundary forward and backward, and
  the fill adds p-1 transfers: (m*v + p - 1) * 2 * (alpha + bytes/bw). Megatron sends the
  [micro_batch*s, h] activation split over the tensor group ("scatter/gather", Narayanan et al.
  2021, section 4.1; already split with sequence parallelism), re-gathered over NVLink;
  KernelOptions(p2p_scatter_gather=False) sends the whole activation from every tensor rank
  and p2p_blocking=True pays a stage's receive and its send per direction (DeepSpeed's
  pipeline engine: blocking transfers in each stage's instruction stream).
* dp_exposed: gradient synchronisation over the data-parallel group (comm.py) overlapped with
  backward work (bucketed all-reduce as in PyTorch DDP, Li et al. 2020; Megatron's
  overlap_grad_reduce): ZeRO-0 all-reduces once per step, during the last micro-batch's backward;
  stage i finishes its backward i stage-backwards before stage 0, which hides more. ZeRO-1
  reduce-scatters instead and all-gathers updated bf16 weights, hidden behind the next step's
  first forward. ZeRO-2 must reduce-scatter after every micro-batch (gradients are not kept
  whole). That is DeepSpeed's and Megatron's way (KernelOptions.sharding='zero'); FSDP-based
  runtimes, meshtron's included (sharding='fsdp', the default), reduce gradients after every
  micro-batch, run ZeRO-1 as all-reduce plus owner broadcasts of the updated fp32 parameters
  (parallel/data_parallel.py), and ZeRO-2 as ZeRO-3 without the backward all-gather.
  ZeRO-3 / FSDP is costed per wrapped unit (`_zero3_per_microbatch`): one all-gather
  before each unit's forward, one before its backward (two when recomputation re-gathers), one
  reduce-scatter after it, each an NCCL collective with its own latency over the shard group
  (then an all-reduce over the replica group under HSDP); prefetching hides a unit's collective
  behind the previous unit's compute only (Rajbhandari et al. 2020, section 7; FSDP, Zhao et al.
  2023, section 3.3), so per unit max(0, comm - compute) stays exposed, plus the first
  all-gather and the last reduce-scatter. Runtimes that reduce every parameter separately
  (DeepSpeed 0.3.x) pay more reduce-scatters than gathers (`reduce_units_per_layer`); those that
  pass lists of per-rank chunks to torch.distributed (DeepSpeed 0.3.x on PyTorch <= 1.10) also
  pay the host's walk over every rank of every call (`LIST_HOST_S_PER_RANK`), which grows with
  the group like NCCL's ring latency does.
* optimizer: AdamW is memory bound; fused (apex / Transformer Engine, stack 'fused') it reads
  and writes fp32 master and two moments, reads the gradient and writes bf16 weights: 28 bytes
  (30 with an fp32 gradient buffer); torch.optim's unfused AdamW (stack 'eager') makes a pass
  per arithmetic step, 86 bytes; both at 80% of HBM bandwidth.

Throughput figures: tokens/s = global_batch * seq / step; model TFLOP/s per GPU counts
ModelSpec.flops_per_token (no recomputation; MFU = that / peak, PaLM's definition, Chowdhery et
al. 2022); hardware TFLOP/s adds recomputed FLOPs (HFU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, compression, compute, memory, pipeline, placement
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.plan import Plan

OPTIMIZER_BYTES_PER_PARAM = 28.0
"""Fused AdamW update traffic per local parameter (see module docstring)."""
EAGER_OPTIMIZER_BYTES_PER_PARAM = 86.0
"""torch.optim.AdamW without fusion (for-loop or foreach: multi-tensor launches, same bytes):
weight decay (4+4), first moment lerp (4+4+4), second moment scale and addcmul (4+4, 4+4+4),
sqrt, bias-correction divide and eps add (3 x (4+4)), addcdiv (4+4+4+4), then the bf16 copy
of the fp32 master (4+2): 86 bytes per parameter."""
OVERLAP_INTERFERENCE = 0.15
"""Overlapped communication is not free: NCCL kernels take SMs and HBM bandwidth from the
GEMMs they run beside (GEMMs slow by 10-25% while overlapped, e.g. Wang et al. 2023 "Overlap
communication with dependent computation via decomposition", Pati et al. 2024 "T3"). The hidden
part of data-parallel traffic costs this fraction of its duration."""

LIST_HOST_S_PER_RANK = 8e-6
"""Host time per group member of one list-based collective (KernelOptions.list_collectives):
DeepSpeed 0.3.x builds the per-rank chunk list in a Python loop (`narrow` per rank in
partition_parameters.py `_allgather_param` / `_reduce_scatter_gradient`), and PyTorch's
ProcessGroupNCCL (<= 1.10) copies every chunk separately (`copy_` per rank after all_gather,
before reduce_scatter via flatten_for_scatter_gather). About 2 us for a Python tensor view plus
about 3 us to issue one small copy (cudaMemcpyAsync launch); the host does this for every rank
of every call, serially, because ZeRO-3 of that era synchronises the device around each fetch."""


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
    """AdamW update."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble
                + self.optimizer)

    def to_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm,
                "dp_comm_exposed": self.dp_comm, "bubble": self.bubble,
                "optimizer": self.optimizer}


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

    @property
    def step_time_s(self) -> float:
        return self.time.total

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
            "tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "zero": c.zero,
            "micro_batch": c.micro_batch, "reduce_dtype": c.reduce_dtype,
            "accumulate_unsharded": c.accumulate_unsharded,
            "num_microbatches": self.num_microbatches, "recompute": c.recompute, "sp": c.sp,
            "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "dp_replicate": c.dp_replicate, "dtype": c.dtype,
            "stage_layers": list(self.stage_layers), "fits": self.fits,
            "memory_gib": self.memory.to_dict(), "time_s": self.time.to_dict(),
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu, "hfu": self.hfu,
        }
        if tokens is not None and gpus is not None:
            d["days"] = self.days(tokens)
            d["gpu_hours"] = self.gpu_hours(tokens, gpus)
            d["cost"] = d["gpu_hours"] * price if price is not None else None
        return d


def _exposed(comm_time: float, window: float) -> float:
    """Communication time not hidden behind `window` seconds of compute, plus the interference
    the hidden part causes."""
    if comm_time <= window:
        return OVERLAP_INTERFERENCE * comm_time
    return comm_time - window + OVERLAP_INTERFERENCE * window


class Evaluator:
    """Cost model bound to one model, cluster and batch; evaluates Plans (cached pieces)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 opts: KernelOptions | None = None,
                 mem: memory.MemoryOptions | None = None) -> None:
        self.model, self.cluster = model, cluster
        self.global_batch, self.seq = global_batch, seq_len
        self.opts = opts or KernelOptions()
        # the framework decides the bytes (memory.py; default: meshtron's runtime), the plan's
        # dtype the precision
        self.mem = mem or memory.options_for(self.opts)
        self.fab = comm.Fabric.of(cluster)
        self.capacity = cluster.memory_bytes
        self.ws_fixed = memory.workspace_fixed(self.capacity)
        # Tensors must fit in what the allowance leaves: (tensors)(1 + frag) + fixed <= capacity.
        self.tensor_budget = (self.capacity - self.ws_fixed) / (1.0 + memory.FRAGMENTATION)
        tokens = global_batch * seq_len
        self.tokens = tokens
        self.model_flops = compute.model_flops_per_step(model, tokens, seq_len)
        self.n_gpus = cluster.num_gpus
        self.hbm = cluster.hbm_bytes_per_s * compute.HBM_EFFICIENCY
        # fp32 gradient accumulation buffer (Megatron's main_grad) or bf16 gradients
        self.grad_bytes = 4.0 if self.opts.fp32_grad_reduce else memory.GRAD_BYTES
        # AdamW traffic per local parameter: 24 bytes of fp32 master + moments read and written,
        # bf16 weight written (2), gradient read (2 or 4)
        if self.opts.stack == "eager":
            self.opt_bytes = EAGER_OPTIMIZER_BYTES_PER_PARAM
        else:
            self.opt_bytes = OPTIMIZER_BYTES_PER_PARAM - memory.GRAD_BYTES + self.grad_bytes
        self._cache: dict[Any, Any] = {}
        self.evaluated = 0

    # ---- cached pieces ---------------------------------------------------------------------
    def _micro(self, tp: int, mb: int, sp: bool, rec: str, cp: int = 1, dtype: str = "bf16"):
        key = ("micro", tp, mb, sp, rec, cp, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        m, cl, opts, s = self.model, self.cluster, self.opts, self.seq
        lc = compute.layer_cost(m, cl, tp, mb, s, sp, opts, cp, dtype)
        c_l, tpc_l, f_l, w_l = lc.per_microbatch(rec, opts.attention)
        if rec == "selective" and opts.attention == "flash":
            # what the framework's selective policy runs again in the backward (memory.py):
            # meshtron's keeps matmul and collective outputs only (the attention kernel and the
            # memory-bound ops are recomputed); torchtitan's "op" policy keeps every other
            # matmul and the attention output; Korthikanti's recomputes the core, which flash
            # never stores (nothing)
            saved = self.mem.saved
            if saved == "eager":
                c_l += lc.fwd - lc.wgrad
            elif saved == "alternate-matmul":
                c_l += lc.fwd - lc.wgrad - lc.core_fwd + 0.5 * lc.wgrad
        emb = compute.embedding_cost(m, cl, tp, mb, s, sp, cp)
        head = compute.head_cost(m, cl, tp, mb, s, sp, opts.stack, cp, dtype)
        # pipeline p2p: [mb*s/cp, h] in the compute dtype split over the tensor group,
        # re-gathered on NVLink (already split with sequence parallelism); without
        # scatter/gather each tensor rank sends the whole activation over its own link
        p2p_bytes = (4.0 if dtype == "fp32" else compute.BF16) * mb * s / cp * m.hidden / tp
        gather = 0.0 if sp else comm.all_gather(p2p_bytes * tp, self._tp_group(tp), self.fab)
        if not opts.p2p_scatter_gather and not sp:
            p2p_bytes, gather = p2p_bytes * tp, 0.0
        hit = (c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather)
        self._cache[key] = hit
        return hit

    def _memory_pieces(self, tp: int, mb: int, sp: bool, rec: str, dtype: str, cp: int = 1):
        """(memory options, activations per layer, recompute working set, logits) in bytes for
        one micro-batch at the plan's dtype (memory.py); a context rank holds seq/cp tokens of
        each sequence (the unfused score matrix is then counted for seq/cp keys: a combination
        no context-parallel stack runs)."""
        key = ("mem", tp, mb, sp, rec, dtype, cp)
        hit = self._cache.get(key)
        if hit is None:
            mem = self.mem
            if mem.dtype != dtype:
                mem = dataclasses.replace(mem, dtype=dtype)
            seq = self.seq // cp
            args = (self.model, tp, sp, mb, seq, rec, self.opts, mem)
            hit = (mem, memory.activation_bytes(*args), memory.recompute_working_bytes(*args),
                   memory.logits_bytes(self.model, tp, mb, seq, mem))
            self._cache[key] = hit
        return hit

    def _groups(self, cfg: Plan) -> dict[str, Any]:
        """Where the plan's tp / pp / dp groups sit on this cluster (placement.py)."""
        key = ("groups", cfg.tp, cfg.pp, cfg.dp, cfg.zero >= 2, cfg.dp_replicate,
               cfg.virtual_stages > 1)
        hit = self._cache.get(key)
        if hit is None:
            hit = placement.groups_for_cost(cfg, self.cluster.gpus_per_node)
            self._cache[key] = hit
        return hit

    def _tp_group(self, tp: int) -> comm.Group:
        return placement.tp_group(tp, self.cluster.gpus_per_node)

    def _params(self, tp: int, pp: int) -> tuple[float, float, float, float]:
        key = ("params", tp, pp)
        hit = self._cache.get(key)
        if hit is None:
            hit = (memory.layer_params_local(self.model, tp),
                   memory.embedding_params_local(self.model, tp),
                   memory.head_params_local(self.model, tp, pp),
                   memory.largest_param_local(self.model, tp))
            self._cache[key] = hit
        return hit

    def _time_partition(self, pp: int, v: int, t_layer: float, e_first: float, e_last: float):
        key = ("part", pp, v, t_layer, e_first, e_last)
        hit = self._cache.get(key)
        if hit is None:
            hit = pipeline.partition_layers(self.model.layers, pp, t_layer, e_first, e_last,
                                            None, v)
            self._cache[key] = hit
        return hit

    def _in_flight(self, schedule: str, pp: int, v: int, m: int) -> list[float]:
        key = ("inflight", schedule, pp, v, m)
        hit = self._cache.get(key)
        if hit is None:
            hit = [pipeline.in_flight(schedule, pp, v, m, i) for i in range(pp)]
            self._cache[key] = hit
        return hit

    def dp_flags(self, cfg: Plan) -> dict[str, Any]:
        """How a plan's data-parallel collectives run, as keyword arguments of `_dp_time`:
        `gsize` bytes per gradient element on the wire (the plan's reduce_dtype), `reduce_once`
        (ZeRO-2/3 reduce-scatter once per step: accumulate_unsharded, or pipelining, whose
        schedule turns FSDP's gradient sync and resharding off until the last backward in
        torch.distributed.pipelining), `gather_once` (pipelining: parameters stay gathered
        over the step's micro-batches, torchtitan's reshard_after_forward=False with pp)."""
        pipelined = cfg.pp > 1 and self.opts.sharding == "fsdp"
        return {"gsize": 4.0 if cfg.reduce_dtype == "fp32" else compute.BF16,
                "reduce_once": cfg.zero >= 2 and (cfg.accumulate_unsharded or pipelined),
                "gather_once": cfg.zero >= 2 and pipelined}

    def _param_wire(self) -> float:
        """Bytes per parameter of ZeRO-1/2 parameter all-gathers after the step: FSDP2-based
        runtimes keep fp32 parameters (meshtron's distributed optimizer gathers them), 16-bit
        weight frameworks gather the bf16 weights (fp32 with fp32_params_autocast)."""
        if self.opts.fp32_params_autocast or (self.mem.framework == "fsdp2"
                                              and self.opts.sharding == "fsdp"):
            return 4.0
        return compute.BF16

    def _dp_time(self, params: float, zero: int, groups: dict[str, Any], m: int, fwd: float,
                 bwd: float, layers: int = 1, regather: bool = False,
                 wire: float | None = None, gsize: float = 4.0, reduce_once: bool = False,
                 gather_once: bool = False) -> float:
        """Exposed data-parallel time of a stage holding `params` parameters in `layers` layers
        (module docstring); `wire`: bytes per gradient element when compressed
        (planner/compression.py); the rest: `dp_flags`."""
        group = groups["dp"]
        key = ("dp", params, zero, group, groups["dp_replicate"], m, fwd, bwd, layers, regather,
               wire, gsize, reduce_once, gather_once)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        gsize = wire or gsize
        nbytes = gsize * params
        wbytes = self._param_wire() * params
        fsdp = self.opts.sharding == "fsdp"
        if (zero == 3 or (zero == 2 and fsdp)) and not (reduce_once or gather_once):
            # per unit and micro-batch, with its own overlap rules
            exp = m * self._zero3_per_microbatch(params, groups, layers, fwd, bwd, regather,
                                                 backward_gather=zero == 3, wire=gsize)
            self._cache[key] = exp
            return exp
        if zero >= 2 and fsdp:
            exp = self._fsdp_accumulated(params, groups, layers, m, fwd, bwd, zero, gsize,
                                         reduce_once, gather_once, regather)
            self._cache[key] = exp
            return exp
        if not self.opts.overlap_grad_reduce:
            fwd = bwd = 0.0
        if zero == 0:
            # one all-reduce per step (gradient sync off but on the last micro-batch: FSDP2's
            # set_requires_gradient_sync, DDP's no_sync, Megatron's and DeepSpeed's buffers)
            exp = _exposed(comm.all_reduce(nbytes, group, self.fab), bwd)
        elif zero == 1:
            # distributed optimizer: reduce-scatter once, step on the shard, all-gather the
            # updated parameters behind the next step's forward (Megatron-LM
            # docs/distrib_optimizer.md; meshtron's ZeRO-1)
            exp = (_exposed(comm.reduce_scatter(nbytes, group, self.fab), bwd)
                   + _exposed(comm.all_gather(wbytes, group, self.fab), fwd))
        elif zero == 3:  # DeepSpeed-style ZeRO-3 under sharding='zero': per unit per micro-batch
            exp = m * self._zero3_per_microbatch(params, groups, layers, fwd, bwd, regather,
                                                 backward_gather=True, wire=gsize)
        else:
            shard, rep = groups["dp_shard"], groups["dp_replicate"]
            rs = (comm.reduce_scatter(nbytes, shard, self.fab)
                  + comm.all_reduce(nbytes / shard.size, rep, self.fab))
            exp = _exposed(rs, bwd) + _exposed(comm.all_gather(wbytes, shard, self.fab), fwd)
        self._cache[key] = exp
        return exp

    def _fsdp_accumulated(self, params: float, groups: dict[str, Any], layers: int, m: int,
                          fwd: float, bwd: float, zero: int, gsize: float, reduce_once: bool,
                          gather_once: bool, regather: bool) -> float:
        """FSDP2 ZeRO-2/3 whose gradients accumulate unsharded over the step's micro-batches
        (one reduce-scatter per unit per step, after the last backward: exposed behind that
        backward only) and, with pipelining, whose parameters stay gathered (one all-gather
        per unit per step, before the first forward); otherwise the gathers stay per
        micro-batch (`_zero3_per_microbatch` with the reduction taken out)."""
        units = max(1, layers * self.opts.shard_units_per_layer)
        shard, rep = groups["dp_shard"], groups["dp_replicate"]
        wsize = 4.0 if self.opts.fp32_params_autocast else compute.BF16
        rs = units * (comm.reduce_scatter(gsize * params / units, shard, self.fab)
                      + comm.all_reduce(gsize * params / units / shard.size, rep, self.fab))
        out = _exposed(rs, bwd)  # fwd, bwd: one micro-batch's
        if gather_once:
            ag = units * comm.all_gather(wsize * params / units, shard, self.fab)
            return out + _exposed(ag, fwd)
        per_mb = self._zero3_per_microbatch(params, groups, layers, fwd, bwd, regather,
                                            backward_gather=zero == 3, wire=gsize,
                                            reduce=False)
        return out + m * per_mb

    def _zero3_per_microbatch(self, params: float, groups: dict[str, Any], layers: int,
                              fwd: float, bwd: float, regather: bool = False,
                              backward_gather: bool = True, wire: float | None = None,
                              reduce: bool = True) -> float:
        """ZeRO-3 / FSDP: one all-gather per wrapped unit before its forward, another before its
        backward (parameters are resharded after the forward) and one reduce-scatter of its
        gradients after it (HSDP: over the shard group, then an all-reduce of the shard over the
        replica group); the next unit's collectives are prefetched while this unit computes
        (FSDP's forward/backward prefetch, Zhao et al. 2023, section 3.3; DeepSpeed's parameter
        prefetch). Exposed per unit: max(0, comm - compute) plus the interference of the hidden
        part; the first unit's all-gather (fill) and the last reduce-scatter (drain) are never
        hidden. Collectives are counted per unit, each paying its own NCCL latency. Without
        `backward_gather` (FSDP's ZeRO-2: no resharding after the forward) the backward only
        reduce-scatters."""
        opts = self.opts
        units = max(1, layers * opts.shard_units_per_layer)
        # gradient reductions per step may be finer than the gathers (DeepSpeed reduces every
        # parameter, biases and norms included); spread over the gather units for the overlap
        r_units = max(1, layers * (opts.reduce_units_per_layer or opts.shard_units_per_layer))
        shard, rep = groups["dp_shard"], groups["dp_replicate"]
        gsize = wire or 4.0
        wsize = 4.0 if opts.fp32_params_autocast else compute.BF16
        ag = comm.all_gather(wsize * params / units, shard, self.fab)
        rs_one = comm.reduce_scatter(gsize * params / r_units, shard, self.fab)
        if opts.list_collectives:
            # staging copies on the collective's critical path, and the host's per-rank list
            # handling (one chunk view and one chunk copy issued per member, every call)
            host = shard.size * LIST_HOST_S_PER_RANK
            ag += 3.0 * wsize * params / units / self.hbm + host
            rs_one += 2.0 * gsize * params / r_units / self.hbm + host
        rs = rs_one * r_units / units
        rs += comm.all_reduce(gsize * params / units / shard.size, rep, self.fab)
        if not reduce:
            rs = 0.0
        f_u, b_u = fwd / units, bwd / units
        # share of a unit's all-gather that prefetching can start early
        pre = self.opts.prefetch_params
        hide = 1.0 if pre is None else min(1.0, pre * units / max(params, 1.0))
        fwd_u = (1 - hide) * ag + _exposed(hide * ag, f_u)
        # recomputation that re-gathers: a second all-gather per unit in the backward
        ag_b = (2 * ag if regather else ag) if backward_gather else 0.0
        # gradient reduce-scatters hide behind the next unit's backward only when reduction
        # overlaps (DeepSpeed's overlap_comm, on in FSDP)
        rs_hidden, rs_exposed = (rs, 0.0) if self.opts.overlap_grad_reduce else (0.0, rs)
        bwd_u = (1 - hide) * ag_b + rs_exposed + _exposed(hide * ag_b + rs_hidden, b_u)
        return ag + units * fwd_u + (ag if backward_gather else 0.0) + units * bwd_u + rs

    # ---- the cost model --------------------------------------------------------------------
    def evaluate(self, cfg: Plan, keep_infeasible: bool = True,
                 exact_memory: bool = True, cutoff: float = float("inf")) -> Estimate | None:
        """Estimate a config. Infeasible ones come back with fits == False and the memory they
        need under the most memory-balanced layer split (`exact_memory`; otherwise under the
        time-balanced split), or as None when `keep_infeasible` is False. Feasible ones slower
        than `cutoff` seconds per step come back as None (the search has no use for them)."""
        self.evaluated += 1
        model, seq = self.model, self.seq
        tp, pp, dp, zero, mb, rec = cfg.tp, cfg.pp, cfg.dp, cfg.zero, cfg.micro_batch, cfg.recompute
        v = cfg.virtual_stages
        m = self.global_batch // (dp * mb)
        cp = cfg.cp
        c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather = self._micro(tp, mb, cfg.sp, rec,
                                                                          cp, cfg.dtype)
        mem_opts, act, work, logits = self._memory_pieces(tp, mb, cfg.sp, rec, cfg.dtype, cp)
        flags = self.dp_flags(cfg)
        # ZeRO shards and gradient reductions span dp x cp ranks (FSDP over dp_shard x cp)
        shard_dp = dp * cp
        keep = flags["gather_once"] and mem_opts.framework == "fsdp2"
        accum = flags["gsize"] if flags["reduce_once"] and mem_opts.framework == "fsdp2" else 0.0
        t_layer = c_l + tpc_l
        e_first = emb.compute + emb.tp
        e_last = head.compute + head.tp
        if pp == 1:
            e_first, e_last = e_first + e_last, 0.0
        p_layer, p_emb, p_head, largest = self._params(tp, pp)
        states = compression.with_state_bytes(
            cfg, memory.state_bytes(zero, shard_dp, self.grad_bytes, mem_opts))
        # memory of stage i = n_i * per_layer[i] + fixed[i] (memory.stage_memory)
        inflight = self._in_flight(cfg.schedule, pp, v, m)
        roots = [0.0] * pp
        roots[0] += p_emb
        roots[-1] += p_head
        per_layer, fixed = [], []
        for i in range(pp):
            sm = memory.stage_memory(mem_opts, zero, shard_dp, states, p_layer, roots[i],
                                     largest, act, inflight[i], work,
                                     logits if i == pp - 1 else 0.0, self.grad_bytes, keep, accum)
            per_layer.append(sm.per_layer)
            fixed.append(sm.fixed)
        budget = self.tensor_budget
        n = self._time_partition(pp, v, t_layer, e_first, e_last)
        fits = n is not None and all(
            k * a + f <= budget for k, a, f in zip(n, per_layer, fixed))
        if not fits:
            caps = [int((budget - f) // a) if budget > f else 0 for a, f in zip(per_layer, fixed)]
            if sum(caps) >= model.layers:
                n = pipeline.partition_layers(model.layers, pp, t_layer, e_first, e_last, caps, v)
            else:
                n = None
            fits = n is not None
            if n is None:
                if not keep_infeasible:
                    return None
                if exact_memory:
                    _, n = pipeline.min_memory_partition(model.layers, per_layer, fixed, v)
                else:
                    n = self._time_partition(pp, v, t_layer, e_first, e_last) or \
                        pipeline.min_memory_partition(model.layers, per_layer, fixed, v)[1]

        # ---- time -------------------------------------------------------------------------
        stage_t = [k * t_layer for k in n]
        stage_w = [k * w_l for k in n]
        stage_f = [k * f_l for k in n]
        stage_c = [k * c_l for k in n]
        stage_t[0] += e_first
        stage_c[0] += emb.compute
        stage_f[0] += emb.fwd
        stage_t[-1] += e_last if pp > 1 else 0.0
        stage_c[-1] += head.compute
        stage_f[-1] += head.fwd
        stage_w[-1] += head.wgrad
        crit = max(range(pp), key=stage_t.__getitem__)
        compute_t = m * stage_c[crit]
        # exactly zero without tensor parallelism (the difference of sums leaves rounding)
        tp_t = m * (stage_t[crit] - stage_c[crit]) if tp > 1 else 0.0
        bubble = pipeline.bubble_time(cfg.schedule, v, stage_t, stage_w)
        groups = self._groups(cfg)
        pp_t = 0.0
        if pp > 1:
            cross = groups["pp_hop_crosses_nodes"]
            hop = comm.send(p2p_bytes, cross, self.fab) + gather
            per_boundary = 4.0 if self.opts.p2p_blocking else 2.0
            pp_t = (m * v + pp - 1) * per_boundary * hop
        dp_t = 0.0
        opt_t = 0.0
        seen: set[tuple[int, bool, bool]] = set()
        for i, k in enumerate(n):
            first, last = i == 0, i == pp - 1
            if (k, first, last) in seen:
                continue  # an earlier identical stage hides less: it dominates
            seen.add((k, first, last))
            params_i = k * p_layer + (p_emb if first else 0.0) + (p_head if last else 0.0)
            local = params_i / shard_dp if zero >= 1 else params_i
            opt_t = max(opt_t, self.opt_bytes * local / self.hbm)
            if shard_dp > 1:
                bwd = stage_t[i] - stage_f[i]
                # stage i finishes its last backward about i stage-backwards before stage 0
                args = (params_i, groups, m, stage_f[i], bwd if zero >= 2 else (1 + i) * bwd,
                        k, rec == "full" and self.opts.recompute_regathers)
                if compression.changes_dp(cfg):  # gradient compression or DiLoCo
                    dp_t = max(dp_t, compression.dp_time(self, cfg, *args))
                else:
                    dp_t = max(dp_t, self._dp_time(args[0], zero, *args[1:], **flags))
        times = TimeBreakdown(compute=compute_t, tp_comm=tp_t, pp_comm=pp_t, dp_comm=dp_t,
                              bubble=bubble, optimizer=opt_t)
        step = times.total
        if fits and step > cutoff:
            return None

        # ---- memory breakdown of the fullest stage -------------------------------------------
        totals = [k * a + f for k, a, f in zip(n, per_layer, fixed)]
        worst = max(range(pp), key=totals.__getitem__)
        mem = memory.breakdown(mem_opts, zero, shard_dp, states, n[worst], p_layer, roots[worst],
                               largest, act, inflight[worst], work,
                               logits if worst == pp - 1 else 0.0, self.capacity, worst,
                               self.grad_bytes, keep, accum)
        hw_flops = self.model_flops + compute.recompute_flops_per_token(
            model, seq, rec, self.opts.attention) * self.tokens
        peak = self.cluster.peak_flops
        per_gpu = step * self.n_gpus
        stage_layers = n if v == 1 else pipeline.split_virtual(n, v)
        return Estimate(
            config=cfg, stage_layers=list(stage_layers), num_microbatches=m, memory=mem,
            time=times, tokens_per_s=self.tokens / step,
            model_tflops_per_gpu=self.model_flops / per_gpu / 1e12,
            hardware_tflops_per_gpu=hw_flops / per_gpu / 1e12,
            mfu=self.model_flops / per_gpu / peak, hfu=hw_flops / per_gpu / peak, fits=fits)

    def lower_bound_step(self, cfg: Plan) -> float:
        """A cheap lower bound of the step time: perfectly balanced stages, no bubble, no
        pipeline or data-parallel communication."""
        m = self.global_batch // (cfg.dp * cfg.micro_batch)
        c_l, tpc_l, _, _, emb, head = self._micro(cfg.tp, cfg.micro_batch, cfg.sp,
                                                  cfg.recompute, cfg.cp, cfg.dtype)[:6]
        work = (c_l + tpc_l) * self.model.layers + emb.compute + emb.tp + head.compute + head.tp
        return m * work / cfg.pp



@dataclass(frozen=True)
class StepPieces:
    """One plan's costs per operation, for the step-level simulator (meshtron/simulate): the
    numbers `Evaluator.evaluate` adds up, before it adds them up."""

    fwd: list[float]
    """Forward of one micro-batch per virtual stage (pipeline order), tp comm included."""
    bwd: list[float]
    """Backward of one micro-batch per virtual stage (input + weight gradients, recomputation
    and tp comm included)."""
    wgrad: list[float]
    """Weight-gradient part of `bwd` (zero-bubble schedules defer it)."""
    hop_s: float
    """One pipeline transfer between neighbouring stages."""
    hop_crosses_nodes: bool
    """The transfer leaves the node (shares the NIC with data-parallel traffic)."""
    reduce_s: list[float]
    """Per device stage: one gradient reduction over the data-parallel group (raw collective
    time; 0 where `fold_s` carries the data-parallel cost)."""
    reduce_every_microbatch: bool
    """Gradients are reduced after every micro-batch (FSDP-style), not once per step."""
    fold_s: list[float]
    """Per device stage: exposed ZeRO-3 / FSDP per-unit communication per micro-batch (the
    planner's per-unit overlap model), added to each micro-batch's work."""
    tail_s: list[float]
    """Per device stage: exposed communication after the optimizer (ZeRO-1 parameter
    all-gather or owners' broadcast)."""
    optimizer_s: list[float]
    """Per device stage: optimizer step."""
    interference: float
    """Fraction of hidden communication charged to compute (OVERLAP_INTERFERENCE)."""


def step_pieces(ev: Evaluator, est: Estimate) -> StepPieces:
    """Break an evaluated plan into per-operation costs, with the same formulas and layer split
    as `ev.evaluate` (stage times, pipeline hop, data-parallel collectives, optimizer)."""
    cfg, n = est.config, est.stage_layers
    tp, pp, v, zero = cfg.tp, cfg.pp, cfg.virtual_stages, cfg.zero
    m = est.num_microbatches
    c_l, tpc_l, f_l, w_l, emb, head, p2p_bytes, gather = ev._micro(tp, cfg.micro_batch, cfg.sp,
                                                                    cfg.recompute, cfg.cp,
                                                                    cfg.dtype)
    t_layer = c_l + tpc_l
    nv = len(n)
    fwd = [k * f_l for k in n]
    tot = [k * t_layer for k in n]
    wg = [k * w_l for k in n]
    fwd[0] += emb.fwd
    tot[0] += emb.compute + emb.tp
    fwd[-1] += head.fwd
    tot[-1] += head.compute + head.tp
    wg[-1] += head.wgrad
    groups = ev._groups(cfg)
    hop = 0.0
    if pp > 1:
        hop = comm.send(p2p_bytes, groups["pp_hop_crosses_nodes"], ev.fab) + gather
    device_layers = [sum(n[j] for j in range(i, nv, pp)) for i in range(pp)]
    p_layer, p_emb, p_head, _ = ev._params(tp, pp)
    flags = ev.dp_flags(cfg)
    gsize = flags["gsize"]
    fsdp = ev.opts.sharding == "fsdp"
    shard_dp = cfg.dp * cfg.cp
    # per-unit ZeRO-3 / FSDP ZeRO-2 collectives are folded into every micro-batch's work (the
    # evaluator's per-unit overlap model); accumulated ones (reduce_once / gather_once) too,
    # spread over the micro-batches
    per_unit = zero == 3 or (zero == 2 and fsdp)
    reduce_s, fold, tail, opt = [], [], [], []
    for i, k in enumerate(device_layers):
        params = k * p_layer + (p_emb if i == 0 else 0.0) + (p_head if i == pp - 1 else 0.0)
        local = params / shard_dp if zero >= 1 else params
        opt.append(ev.opt_bytes * local / ev.hbm)
        group = groups["dp"]
        red = tl = fo = 0.0
        if shard_dp > 1 and per_unit:
            stage_f = sum(fwd[j] for j in range(i, nv, pp))
            stage_t = sum(tot[j] for j in range(i, nv, pp))
            fo = ev._dp_time(params, zero, groups, m, stage_f, stage_t - stage_f, k,
                             cfg.recompute == "full" and ev.opts.recompute_regathers,
                             **flags) / m
        elif shard_dp > 1:
            nbytes = gsize * params
            window = sum(fwd[j] for j in range(i, nv, pp))
            if zero == 0:
                red = comm.all_reduce(nbytes, group, ev.fab)
            elif zero == 1:
                red = comm.reduce_scatter(nbytes, group, ev.fab)
                tl = _exposed(comm.all_gather(ev._param_wire() * params, group, ev.fab), window)
            else:  # ZeRO-2, DeepSpeed / Megatron style
                shard, rep = groups["dp_shard"], groups["dp_replicate"]
                red = (comm.reduce_scatter(nbytes, shard, ev.fab)
                       + comm.all_reduce(nbytes / shard.size, rep, ev.fab))
                tl = _exposed(comm.all_gather(ev._param_wire() * params, shard, ev.fab), window)
        reduce_s.append(red)
        fold.append(fo)
        tail.append(tl)
    # ZeRO-0/1/2 with raw reductions reduce once per step, in every framework
    every = False
    return StepPieces(fwd=fwd, bwd=[t - f for t, f in zip(tot, fwd)], wgrad=wg, hop_s=hop,
                      hop_crosses_nodes=bool(pp > 1 and groups["pp_hop_crosses_nodes"]),
                      reduce_s=reduce_s, reduce_every_microbatch=every, fold_s=fold,
                      tail_s=tail, optimizer_s=opt, interference=OVERLAP_INTERFERENCE)
