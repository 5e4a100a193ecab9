"""Host offload (plan.offload, plan.offload_activations), run through PyTorch's own mechanisms.

- offload='full': FSDP2's `CPUOffloadPolicy` on every unit. The parameter shards, their
  gradients and hence the AdamW states live in host memory (pinned on CUDA so the copies are
  asynchronous); each unit's shard is copied to the device before its all-gather and its
  reduced gradient shard copied back after the reduce-scatter, and the optimizer steps on the
  host (PyTorch FSDP2 docs, `torch.distributed.fsdp.CPUOffloadPolicy`). ZeRO-2/3 only:
  FSDP2's offload is of shards (plan.py `offload_runtime_problem`).
- offload='optimizer' (DeepSpeed ZeRO-Offload, Ren et al. 2021: bf16 weights stay on the GPU,
  the fp32 master copy, gradients and states on the host) is planned, not run.
- offload_activations: the tensors autograd saves for backward are copied to (pinned) host
  memory in forward and back in backward (`torch.autograd.graph.save_on_cpu`): a copy, so the
  run is bit-identical to the one without it (tests/test_offload.py), at the cost of the
  transfers. Not with pipelining (the schedules run forward and backward themselves).

Device memory saved and the host-link traffic per step: meshtron/planner/offload.py.
"""

from __future__ import annotations

import contextlib

import torch


def offload_policy(device_type: str):
    """FSDP2's CPU offload policy; host memory pinned when the device is a GPU (a pinned
    buffer makes the host<->device copies asynchronous; there is nothing to pin on CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def activation_offload(enabled: bool, device: torch.device):
    """Context for a micro-batch's forward: saved activations go to host memory, or nothing."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
