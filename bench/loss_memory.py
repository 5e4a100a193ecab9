"""Peak memory of the loss step: whole-logits fp32 cross-entropy vs the chunked loss.

The loss step is what `Transformer.forward(tokens, targets)` runs after the final norm: the
output head and the cross-entropy, forward and backward, on one micro-batch of hidden states
(same shapes, seed and data for both). Peak memory is the most bytes of tensor storage alive
at once during the step, counted by a TorchDispatchMode that sees every storage the step
allocates and a finalizer on each that sees it freed: the CPU counterpart of
`torch.cuda.max_memory_allocated` (used instead on CUDA). Process RSS is not used: glibc keeps
freed chunks, so it measures the allocator more than the tensors.

    .venv/bin/python bench/loss_memory.py
    .venv/bin/python bench/loss_memory.py --tokens 4096 --vocab 128256 --hidden 1024 --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _tracker():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    state = {"live": 0, "peak": 0}
    seen: set = set()

    def freed(key, n):
        seen.discard(key)
        state["live"] -= n

    class LiveBytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()  # one Python object per storage (preserved)
                    if id(st) not in seen and st.nbytes():
                        seen.add(id(st))
                        state["live"] += st.nbytes()
                        state["peak"] = max(state["peak"], state["live"])
                        weakref.finalize(st, freed, id(st), st.nbytes())
            return out

    return LiveBytes(), state


def run_variant(variant: str, tokens: int, vocab: int, hidden: int, dtype: str,
                device: str) -> dict:
    import torch

    from meshtron.model.loss import chunked_cross_entropy, cross_entropy_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device)
    h = torch.randn(1, tokens, hidden, device=device, requires_grad=True)
    t = torch.randint(0, vocab, (1, tokens), device=device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        mode, state = None, None
    else:
        mode, state = _tracker()
    ctx = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else \
        torch.autocast(device, enabled=False)
    t0 = time.perf_counter()
    with mode if mode is not None else contextlib.nullcontext():
        with ctx:
            loss = (cross_entropy_loss(head(h), t) if variant == "plain"
                    else chunked_cross_entropy(head, h, t))
        loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = state["peak"]
    return {"peak_mib": peak / 2**20, "loss": float(loss), "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = {v: run_variant(v, args.tokens, args.vocab, args.hidden, args.dtype, device)
            for v in ("plain", "chunked")}
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"{device}: tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.dtype}; one fp32 [tokens, vocab] tensor = {logits_mib:.0f} MiB, the head's "
          f"weight {args.vocab * args.hidden * 4 / 2**20:.0f} MiB")
    for v, r in rows.items():
        print(f"{v:<8} peak {r['peak_mib']:8.0f} MiB   loss {r['loss']:.6f}   "
              f"{r['seconds']:.2f} s")
    print(f"ratio chunked / plain: {rows['chunked']['peak_mib'] / rows['plain']['peak_mib']:.3f}"
          f"   (losses differ by {abs(rows['chunked']['loss'] - rows['plain']['loss']):.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
