"""Activation memory per rank under context parallelism, cp = 1, 2, 4 (meshtron/parallel/context.py).

The "tiny" model (4 layers, hidden 256, 8 query / 4 key-value heads) on one 512-token sequence,
fp32, recomputation none and full. Each cp rank runs the forward on its 512/cp tokens; a
`saved_tensors_hooks` pair records every tensor autograd keeps for backward (unique storages,
parameters excluded): that is the activation memory held between forward and backward, counted
exactly rather than read from an allocator. The gathered K/V (every rank keeps the full
sequence's keys and values of each layer for the backward, Llama 3's all-gather design) are
reported separately: they do not shrink with cp.

    .venv/bin/python bench/cp_memory.py          # about 1 min on 2 cores

Expected: everything but the gathered K/V divides by cp; K/V per layer are
2 * seq * kv_heads * head_dim * 4 bytes = 2 * 512 * 128 * 4 = 512 KiB on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ = 512
MODES = ("none", "full")


def measure(cp: int, recompute: str) -> dict:
    import torch
    import torch.distributed as dist

    from meshtron.model.spec import PRESETS
    from meshtron.model.transformer import Transformer, cross_entropy_loss
    from meshtron.parallel.context import apply_context_parallel, shard_batch
    from meshtron.parallel.recompute import apply_recompute

    spec = PRESETS["tiny"]
    model = Transformer(spec, init_seed=0)
    apply_recompute(model, recompute)
    rank = 0
    if cp > 1:
        apply_context_parallel(model, dist.group.WORLD)
        rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec.vocab, (1, SEQ + 1), generator=g)
    shard = shard_batch(x[:, :-1], x[:, 1:], cp, rank)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    kv_shape = (1, spec.kv_heads, SEQ, spec.head_dim)
    gathered: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
            if cp > 1 and tuple(t.shape) == kv_shape:
                gathered[ptr] = saved[ptr]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_loss(model(shard.tokens), shard.targets)
    loss.backward()
    return {"saved": sum(saved.values()), "kv": sum(gathered.values())}


def rank_fn(cp: int) -> list[dict]:
    return [measure(cp, mode) for mode in MODES]


def main() -> None:
    from testkit.multiproc import run_on_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cp_memory import rank_fn as body  # importable by the ranks (not __main__)

    rows = {1: [measure(1, m) for m in MODES]}
    for cp in (2, 4):
        rows[cp] = max(run_on_ranks(body, cp, cp, timeout=600),
                       key=lambda r: r[0]["saved"])  # the fullest rank
    print(f"tiny, seq {SEQ}, fp32: activation bytes kept for backward, per rank (fullest)")
    print(f"{'cp':>3} {'recompute':>9} {'saved MiB':>10} {'vs cp=1':>8} "
          f"{'gathered K/V MiB':>17} {'rest vs cp=1':>13}")
    for cp, res in rows.items():
        for mode, r, base in zip(MODES, res, rows[1]):
            rest = (r["saved"] - r["kv"]) / base["saved"]
            print(f"{cp:>3} {mode:>9} {r['saved'] / 2**20:>10.2f} {r['saved'] / base['saved']:>8.3f} "
                  f"{r['kv'] / 2**20:>17.2f} {rest:>13.3f}")


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    main()
