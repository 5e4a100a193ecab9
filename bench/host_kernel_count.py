"""Count the operations meshtron's own transformer block launches, forward and backward, from
its code path: one Block of a preset run eagerly on CPU under a TorchDispatchMode that records
every ATen call reaching a backend (views and allocations launch no kernel and are left out).
Each counted call is one kernel launch on a GPU (the dispatcher picks the CUDA kernel of the
same op; the CPU flash-attention op is one op as on CUDA). torch.nn.RMSNorm is one fused ATen
kernel forward and one backward on CUDA (aten::_fused_rms_norm, PyTorch >= 2.8) but decomposes
on CPU, so the block is counted with LayerNorm, one ATen op each way on both, standing in for
it (`--norm-as-is` counts the CPU decomposition instead). Printed next to
the planner's `kernels_per_layer` and planner/host.py's backward rule (twice the forward's
launches), so the host model can be checked against what the code issues.

    python bench/host_kernel_count.py [--model tiny] [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--norm-as-is", action="store_true")
    return ap


if __name__ == "__main__":
    _parser().parse_args()  # --help and bad options answered before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from testkit.kernel_count import KernelCount  # noqa: E402

NO_KERNEL = {"empty", "empty_strided", "detach", "alias", "lift_fresh", "_unsafe_view"}
"""ATen ops that allocate or alias without a kernel (`_unsafe_view` is a reshape of a fresh
tensor, not flagged as a view)."""


def count(model_name: str, tokens: int, norm_as_is: bool = False) -> tuple[Counter, Counter]:
    from meshtron.model.rope import rope_cache
    from meshtron.model.spec import PRESETS
    from meshtron.model.transformer import Block

    spec = PRESETS[model_name]
    if spec.norm == "rmsnorm" and not norm_as_is:
        spec = dataclasses.replace(spec, norm="layernorm")
    torch.manual_seed(0)
    block = Block(spec).to(torch.bfloat16)
    rope = rope_cache(spec)
    x = torch.randn(1, tokens, spec.hidden, dtype=torch.bfloat16, requires_grad=True)
    with KernelCount(NO_KERNEL) as fwd:
        y = block(x, rope)
    grad = torch.ones_like(y)
    with KernelCount(NO_KERNEL) as bwd:
        y.backward(grad)
    return fwd.ops, bwd.ops


def main() -> None:
    args = _parser().parse_args()
    from meshtron.model.spec import PRESETS
    from meshtron.planner.compute import KernelOptions, kernels_per_layer

    fwd, bwd = count(args.model, args.tokens, args.norm_as_is)
    nf, nb = sum(fwd.values()), sum(bwd.values())
    planned = kernels_per_layer(PRESETS[args.model], KernelOptions())
    print(f"meshtron Block ({args.model}), eager, torch {torch.__version__} on CPU")
    print(f"  forward launches  {nf:4d}  {dict(fwd)}")
    print(f"  backward launches {nb:4d}  {dict(bwd)}")
    print(f"  backward / forward {nb / nf:.2f} (planner/host.py assumes 2)")
    print(f"  planner kernels_per_layer (eager) {planned}")


if __name__ == "__main__":
    main()
