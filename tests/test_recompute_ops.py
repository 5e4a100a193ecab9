"""Selective recomputation keeps the MoE experts' grouped GEMMs (issue 31, item 3): the policy
saved `mm` (the CPU expert path) but not `_grouped_mm` (the CUDA one), so on GPUs the expert
GEMMs the planner counts as saved were recomputed. `torch._grouped_mm` runs on the CPU in fp32,
so the policy is checked here by counting the op's executions."""

from __future__ import annotations

import types
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.parallel import recompute


def test_saved_ops_include_the_grouped_gemm_when_torch_has_it():
    ops = recompute._saved_ops()
    assert torch.ops.aten.mm.default in ops
    for name in ("_grouped_mm", "_scaled_grouped_mm"):  # bf16 and FP8 experts
        if hasattr(torch.ops.aten, name):
            assert getattr(torch.ops.aten, name).default in ops, name


def test_missing_ops_are_skipped():
    aten = types.SimpleNamespace(mm=torch.ops.aten.mm)  # a torch without the grouped GEMMs
    root = types.SimpleNamespace(aten=aten, _c10d_functional=types.SimpleNamespace())
    assert recompute._saved_ops(root) == {torch.ops.aten.mm.default}


class CountGroupedMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _experts(x, w, offs):
    return torch.nn.functional.silu(torch._grouped_mm(x, w, offs=offs)).sum()


def _grouped_mm_runs(saved: set) -> int:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g, requires_grad=True)
    w = torch.randn(2, 8, 4, generator=g, requires_grad=True)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    context = partial(create_selective_checkpoint_contexts,
                      partial(recompute._selective_policy, saved))
    with CountGroupedMM() as count:
        checkpoint(_experts, x, w, offs, use_reentrant=False, context_fn=context).backward()
    return count.calls


def test_grouped_gemm_is_not_recomputed_in_backward():
    saved = recompute._saved_ops()
    without = saved - {torch.ops.aten._grouped_mm.default}
    # Recomputing runs the forward GEMM once more in backward; saving it does not.
    assert _grouped_mm_runs(saved) == _grouped_mm_runs(without) - 1
