"""Context parallelism's attention without documents, side by side: SDPA's flash kernels per
query chunk with no mask (parallel/cp_sdpa.py, what runs now) against the boolean-mask path
it replaced on CPU (SDPA with a [chunk, prefix] mask), forward + backward of one rank's two
chunks against the gathered keys, and the largest mask the old path built. Ratios only
(old / new); the CPU here, the same code on a GPU with --device cuda.

    .venv/bin/python bench/cp_attention.py [--seq 8192 --cp 4 --rank 0 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    return ap


if __name__ == "__main__":
    _parser().parse_args()  # --help and bad options answered before torch loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from meshtron.parallel.cp_sdpa import chunk_attention, kernel_for  # noqa: E402


def masked(q, k, v, chunks):
    """The boolean-mask path (context.py's, without documents)."""
    c = q.shape[2] // 2
    outs = []
    for i, chunk in enumerate(chunks):
        end = (chunk + 1) * c
        mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(end - c)
        outs.append(F.scaled_dot_product_attention(q[:, :, i * c:(i + 1) * c], k[:, :, :end],
                                                   v[:, :, :end], attn_mask=mask,
                                                   enable_gqa=True))
    return torch.cat(outs, dim=2)


def flash(q, k, v, chunks):
    c = q.shape[2] // 2
    kern = kernel_for(q)
    return torch.cat([chunk_attention(q[:, :, i * c:(i + 1) * c], k, v, chunk, kern)
                      for i, chunk in enumerate(chunks)], dim=2)


def timed(fn, q, k, v, chunks, reps: int, dev) -> float:
    times = []
    for _ in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn(q, k, v, chunks).sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    args = _parser().parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    local = args.seq // args.cp
    q = torch.randn(1, args.heads, local, args.head_dim, device=dev, dtype=dtype,
                    requires_grad=True)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, device=dev, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    chunks = (args.rank, 2 * args.cp - 1 - args.rank)
    with torch.no_grad():
        err = float((flash(q, k, v, chunks) - masked(q, k, v, chunks)).abs().max())
    old = timed(masked, q, k, v, chunks, args.reps, dev)
    new = timed(flash, q, k, v, chunks, args.reps, dev)
    c = local // 2
    print(json.dumps({"device": str(dev), "seq": args.seq, "cp": args.cp, "rank": args.rank,
                      "max_abs_diff": err, "masked_over_flash_step_time": old / new,
                      "largest_mask_bytes_old_path": c * (max(chunks) + 1) * c,
                      "mask_bytes_new_path": 0}))


if __name__ == "__main__":
    main()
