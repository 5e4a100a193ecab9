"""Count the ATen calls that reach a kernel (no views, no bare allocations) under a dispatch
mode: what the planner's eager `kernels_per_layer` is checked against."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = ("empty", "empty_strided", "detach", "_unsafe_view")
"""Ops that allocate or alias without a kernel (`_unsafe_view`: a reshape of a fresh tensor,
not flagged as a view)."""


class KernelCount(TorchDispatchMode):
    """`with KernelCount() as c: ...`; then `c.ops[name]` per ATen op."""

    def __init__(self, no_kernel: frozenset[str] | tuple[str, ...] = NO_KERNEL) -> None:
        super().__init__()
        self.no_kernel = frozenset(no_kernel)
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in self.no_kernel:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
