"""Host offload in the planner: device memory it frees, host-link traffic and the host's
optimizer step (plan.offload; the runtime: meshtron/parallel/offload.py).

- 'full' (FSDP2 CPUOffloadPolicy, ZeRO-2/3): the parameter shards (fp32), their gradients and
  AdamW's moments live in host memory; the device keeps only the gathered compute copies and
  the activations. Every all-gather first copies the unit's fp32 shard host -> device (FSDP2
  `FSDPParam.to_device`), every reduce-scatter copies the reduced fp32 gradient shard back:
  per micro-batch twice (forward, backward re-gather) under ZeRO-3, once per step under ZeRO-2
  (parameters kept gathered), and one gradient copy per reduction.
- 'optimizer' (DeepSpeed ZeRO-Offload, Ren et al. 2021, section 4): the weights stay on the
  device, gradients go to the host once per step (4 bytes), AdamW steps there and the updated
  weights come back (4 bytes: FSDP2 parameters are the fp32 master weights). Megatron-Core's
  HybridDeviceOptimizer (0.12, --optimizer-cpu-offload) keeps the DDP gradient buffer on the
  device (the reduce-scatter writes into it; the optimizer copies the shard out): its
  gradients stay (`device_states` with rule 'mcore-optimizer').

Which kinds each stack runs: plan_rules_offload.STACK_OFFLOADS. DeepSpeed moves 16-bit
parameters (2 bytes) where FSDP2 moves fp32 shards: priced at 4 bytes, an upper bound there.

The transfers are counted serial with the step (not overlapped with compute): an upper bound
(FSDP2 issues them on its all-gather stream; ZeRO-Offload overlaps the gradient copy with
backward). The host optimizer step is memory-bandwidth bound: AdamW reads the parameter,
gradient and two moments and writes the parameter and moments, 28 bytes per parameter
(estimate.OPTIMIZER_BYTES_PER_PARAM), at the host memory bandwidth one GPU's share of the node
reaches (`ClusterSpec.host_memory_gb_per_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

OFFLOAD_BYTES = 4.0
"""Bytes per parameter element that cross the host link per copy: FSDP2's fp32 shards."""
HOST_ADAM_BYTES = 28.0
"""Host memory bytes one AdamW update touches per parameter (see the module doc)."""


GRAD_BUFFER_STAYS = ("mcore-optimizer",)
"""Stacks whose optimizer offload keeps the gradient buffer on the device (Megatron-Core:
megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py copies grads out of the DDP buffer,
megatron/core/distributed/param_and_grad_buffer.py allocates it on the device)."""


@dataclass(frozen=True)
class OffloadCost:
    """What offload adds to one step of one GPU."""

    h2d_bytes: float
    """Host -> device bytes per step (parameter shards, or updated weights)."""
    d2h_bytes: float
    """Device -> host bytes per step (gradient shards)."""
    transfer_s: float
    """Seconds of host-link traffic: the larger direction (PCIe and NVLink-C2C are full
    duplex) at the link's bandwidth."""
    host_step_s: float
    """Seconds of the AdamW step on the host."""

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.host_step_s


def device_states(offload: str, states: tuple[float, float, float],
                  rule: str | None = None) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer) left on the device (`rule`: the
    stack's MemoryOptions.host_offload)."""
    w, g, o = states
    if offload == "full":
        return 0.0, 0.0, 0.0
    if offload == "optimizer":
        return (w, g if rule in GRAD_BUFFER_STAYS else 0.0, 0.0)
    return states


def offload_cost(offload: str, local_params: float, zero: int, micro_batches: int,
                 reduce_once: bool, link_bytes_per_s: float,
                 host_mem_bytes_per_s: float) -> OffloadCost:
    """Traffic and host step for `local_params` parameter elements held by this GPU (its
    shard), `micro_batches` per step; `reduce_once`: gradients reduced once per step."""
    if offload == "none":
        return OffloadCost(0.0, 0.0, 0.0, 0.0)
    if offload == "full":
        gathers = 2 * micro_batches if zero == 3 else 1
        reductions = 1 if reduce_once else micro_batches
    else:  # optimizer: gradients out and weights back, once per step
        gathers, reductions = 1, 1
    h2d = OFFLOAD_BYTES * local_params * gathers
    d2h = OFFLOAD_BYTES * local_params * reductions
    return OffloadCost(h2d, d2h, max(h2d, d2h) / link_bytes_per_s,
                       HOST_ADAM_BYTES * local_params / host_mem_bytes_per_s)
