"""Process-group backend strings: the one place that builds them and the one that reads them.

meshtron's CUDA ranks join one group with a backend per device type, "cuda:nccl,cpu:gloo"
(NCCL for CUDA tensors, gloo for the CPU tensors of object broadcasts and checkpoint metadata),
so `dist.get_backend()` returns that string, never "nccl": comparing it with "nccl" (as the
doctor and async TP once did) is false on every GPU run. `is_nccl` answers from the string
itself, for the group meshtron made, a plain "nccl" group of a user's own, or any other.

No torch import at module level: the doctor's and the planner's callers may be torch-free.
"""

from __future__ import annotations

from typing import Any

CUDA_BACKEND = "cuda:nccl,cpu:gloo"
CPU_BACKEND = "gloo"


def backend_for(device_type: str) -> str:
    """The backend string a rank on `device_type` ("cuda" or "cpu") initialises its default
    process group with."""
    return CUDA_BACKEND if device_type == "cuda" else CPU_BACKEND


def device_backends(backend: str) -> dict[str, str]:
    """{device type: backend} of a backend string: "cuda:nccl,cpu:gloo" -> {"cuda": "nccl",
    "cpu": "gloo"}; a plain name serves the devices it supports ("nccl" -> {"cuda": "nccl"},
    "gloo" -> {"cpu": "gloo", "cuda": "gloo"})."""
    text = str(backend).strip().lower()
    if ":" not in text:
        return {"cuda": text} if text == "nccl" else {"cpu": text, "cuda": text}
    pairs = (part.split(":", 1) for part in text.split(",") if part.strip())
    return {device.strip(): name.strip() for device, name in pairs}


def is_nccl(backend: str | None, device_type: str = "cuda") -> bool:
    """Whether tensors on `device_type` go through NCCL in a group with `backend`."""
    return backend is not None and device_backends(backend).get(device_type) == "nccl"


def group_backend(group: Any = None) -> str | None:
    """The backend string of `group` (default: the default group), or None when there is no
    initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend(group))


def group_is_nccl(group: Any = None, backend: str | None = None) -> bool:
    """Whether `group`'s CUDA collectives run on NCCL. `backend`: the backend string to judge
    instead of asking torch (tests inject "cuda:nccl,cpu:gloo" on a CPU machine)."""
    return is_nccl(group_backend(group) if backend is None else backend)
