"""Peak memory and time of the loss step: whole logits vs checkpointed chunks vs the fused loss.

The loss step is what `Transformer.forward(tokens, targets)` runs after the final norm: the
output head and the cross-entropy, forward and backward, on one micro-batch of hidden states
(same shapes, seed and data for every variant):

* `plain`: whole [tokens, vocab] logits, fp32 cross-entropy (`cross_entropy_loss`);
* `checkpointed`: the chunked loss meshtron ran until 2026-12-05 (kept here as the baseline):
  head + loss per chunk under `torch.utils.checkpoint`, replayed in backward, autograd summing
  one [vocab, hidden] weight gradient per chunk;
* `fused`: meshtron/model/loss.py's fused linear cross-entropy (every gradient computed in the
  forward, the weight gradient accumulated in fp32 inside addmm, backward only scaling).

Peak memory is the most bytes of tensor storage the step allocates alive at once (the head's
weight and the hidden states, made before, are not counted), seen by a TorchDispatchMode
with a finalizer on each new storage: the CPU counterpart of `torch.cuda.max_memory_allocated`
(used instead on CUDA). Process RSS is not used: glibc keeps freed chunks. Time is the median
of `--repeat` steps after one warm-up, each variant in turn, in this one process: compare the
ratios, not the seconds, across machines.

    .venv/bin/python bench/loss_memory.py
    .venv/bin/python bench/loss_memory.py --tokens 4096 --vocab 32000 --hidden 1024 --params bf16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("plain", "checkpointed", "fused")


def _tracker(known):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    state = {"live": 0, "peak": 0}
    seen: set = {id(t.untyped_storage()) for t in known}

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


def checkpointed_cross_entropy(head, h, targets):
    """The previous chunked loss (meshtron/model/loss.py before the fused one), the baseline:
    per chunk of Liger's size, head + fp32 loss under non-reentrant checkpointing."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from meshtron.model.loss import IGNORE_INDEX, chunk_tokens

    def piece(w, hc, tc):
        return F.cross_entropy(F.linear(hc, w).float(), tc, reduction="sum",
                               ignore_index=IGNORE_INDEX)

    flat_h, flat_t = h.flatten(0, 1), targets.flatten()
    chunk = chunk_tokens(flat_h.shape[0], flat_h.shape[-1], head.weight.shape[0])
    sums = [checkpoint(piece, head.weight, hc, tc, use_reentrant=False)
            for hc, tc in zip(flat_h.split(chunk), flat_t.split(chunk))]
    return torch.stack(sums).sum() / (flat_t != IGNORE_INDEX).sum()


def _inputs(tokens, vocab, hidden, params, device):
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if params == "bf16" else torch.float32
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device).to(dtype)
    h = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (1, tokens), device=device)
    return head, h, t


def _step(variant, head, h, t, autocast):
    import torch

    from meshtron.model.loss import chunked_cross_entropy, cross_entropy_loss

    device = h.device.type
    ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        if variant == "plain":
            loss = cross_entropy_loss(head(h), t)
        elif variant == "checkpointed":
            loss = checkpointed_cross_entropy(head, h, t)
        else:
            loss = chunked_cross_entropy(head, h, t)
    loss.backward()
    return loss


def run_variant(variant, tokens, vocab, hidden, params, autocast, device, repeat) -> dict:
    import torch

    head, h, t = _inputs(tokens, vocab, hidden, params, device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        mode, state = contextlib.nullcontext(), None
    else:
        mode, state = _tracker([head.weight, h, t])
    with mode:
        loss = _step(variant, head, h, t, autocast)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base if cuda else state["peak"]
    grad_w = head.weight.grad.float().clone()
    times = []
    for _ in range(repeat):  # the first step above was the warm-up
        head.weight.grad, h.grad = None, None
        t0 = time.perf_counter()
        _step(variant, head, h, t, autocast)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"peak_mib": peak / 2**20, "loss": float(loss.detach()), "grad_w": grad_w,
            "seconds": statistics.median(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--params", choices=("fp32", "bf16"), default="fp32",
                    help="the head's and hidden states' dtype (bf16: FSDP2's compute copies)")
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast over fp32 params")
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = {v: run_variant(v, args.tokens, args.vocab, args.hidden, args.params,
                           args.autocast, device, args.repeat)
            for v in args.variants.split(",")}
    dtype = "bf16 autocast" if args.autocast else f"{args.params} params"
    print(f"{device}: tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, {dtype}; "
          f"one fp32 [tokens, vocab] = {args.tokens * args.vocab * 4 / 2**20:.0f} MiB, one "
          f"fp32 [vocab, hidden] = {args.vocab * args.hidden * 4 / 2**20:.0f} MiB")
    ref = rows.get("plain") or next(iter(rows.values()))
    for v, r in rows.items():
        dg = float((r["grad_w"] - ref["grad_w"]).abs().max() / ref["grad_w"].abs().max())
        print(f"{v:<13} peak {r['peak_mib']:8.1f} MiB   {r['seconds']:7.3f} s   loss "
              f"{r['loss']:.6f}   weight grad vs {next(iter(rows))}: {dg:.1e} (rel. max)")
    if "fused" in rows and "checkpointed" in rows:
        f, c = rows["fused"], rows["checkpointed"]
        print(f"fused / checkpointed: peak {f['peak_mib'] / c['peak_mib']:.3f}, "
              f"time {f['seconds'] / c['seconds']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
