"""Host cost of one eager operation forward (Python + dispatcher + autograd recording) against
one backward node (autograd's C++ engine), on CPU with tiny tensors, so what is timed is the
host's work, not the arithmetic. The figures feed planner/host.py (FORWARD_DISPATCH_US,
NO_GRAD_DISPATCH_US, BACKWARD_NODE_US): on a GPU every op adds the same cudaLaunchKernel,
which this CPU run lacks (host.py LAUNCH_US), so the GPU ratios lie between these and 1.

    python bench/host_dispatch.py [--ops 500] [--repeats 41]

Prints microseconds per forward op (with and without autograd recording), per backward node,
and their ratios; the fastest of `repeats` runs of each (the machine may be shared: contention
only adds time, so the minimum is the intrinsic cost)."""

from __future__ import annotations

import argparse
import time


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=41)
    return ap


if __name__ == "__main__":
    _parser().parse_args()  # --help and bad options answered before torch loads

import torch  # noqa: E402


def _chain(x: torch.Tensor, ops: int) -> torch.Tensor:
    # alternate a product and a sum so every op records one autograd node with a cheap backward
    for i in range(ops):
        x = x * 1.0001 if i % 2 == 0 else x + 0.0001
    return x


def measure(ops: int, repeats: int) -> dict[str, float]:
    leaf = torch.ones(8, requires_grad=True)
    fwd, nograd, bwd = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = _chain(leaf, ops)
        t1 = time.perf_counter()
        y.sum().backward()
        t2 = time.perf_counter()
        with torch.no_grad():
            _chain(leaf, ops)
        t3 = time.perf_counter()
        fwd.append((t1 - t0) / ops)
        bwd.append((t2 - t1) / ops)
        nograd.append((t3 - t2) / ops)
    # the minimum: the machine is shared, and contention only ever adds time
    out = {"forward_us": min(fwd) * 1e6, "forward_no_grad_us": min(nograd) * 1e6,
           "backward_node_us": min(bwd) * 1e6}
    out["backward_over_forward"] = out["backward_node_us"] / out["forward_us"]
    out["forward_over_no_grad"] = out["forward_us"] / out["forward_no_grad_us"]
    return out


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(1)
    res = measure(args.ops, args.repeats)
    print(f"torch {torch.__version__}, CPU, {args.ops} ops x {args.repeats} repeats (fastest)")
    for k, v in res.items():
        print(f"  {k:24s} {v:8.2f}")


if __name__ == "__main__":
    main()
