"""Bytes each rank sends per training step: uncompressed vs bf16 vs int8 gradient reduction
(and DiLoCo), counted from the collectives the ranks really issue.

4 gloo ranks train the "tiny" model (3.4M parameters) with dp=4 for every ZeRO stage; a
TorchDispatchMode sees every c10d collective (FSDP2's internal ones included: see
../shared/notes/pytorch-2.13-cpu-facts.md) during one steady step and adds what a rank puts on
the wire under the bandwidth-optimal algorithms (ring / pairwise), per collective:
all-reduce 2(n-1)/n B, reduce-scatter and all-to-all (n-1)/n B, all-gather (n-1) B_in,
broadcast B from its root. The tensors' dtypes decide B, so int8 payloads and fp32 scales are
counted as sent.

    .venv/bin/python bench/compress_bytes.py            # about 1 min on 2 cores

Goal (issue 12): int8 <= 0.27 of fp32 including the scales.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = 2
"""Sequences per rank per step, in one micro-batch (FSDP2 reduces after every micro-batch;
meshtron.compress's ZeRO-0/1 path once per step, so more micro-batches would favour it)."""
CASES = [  # (label, plan)
    ("zero0 fp32", dict(dp=4)),
    ("zero0 bf16", dict(dp=4, grad_compression="bf16")),
    ("zero0 int8", dict(dp=4, grad_compression="int8")),
    ("zero1 fp32", dict(dp=4, zero=1)),
    ("zero1 int8", dict(dp=4, zero=1, grad_compression="int8")),
    ("zero2 fp32", dict(dp=4, zero=2)),
    ("zero2 int8", dict(dp=4, zero=2, grad_compression="int8")),
    ("zero3 fp32", dict(dp=4, zero=3)),
    ("zero3 int8", dict(dp=4, zero=3, grad_compression="int8")),
    ("diloco H=8 fp32", dict(dp=4, diloco=8)),
    ("diloco H=8 int8", dict(dp=4, diloco=8, grad_compression="int8")),
]


def _group_size(args) -> int:
    import torch.distributed as dist

    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # another script object (the reduce op)
                continue
    return dist.get_world_size()


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if hasattr(x, "numel") else 0


def _counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Bytes(TorchDispatchMode):
        """Adds the wire bytes of every c10d collective (module doc). Gradient traffic: FSDP2's
        all-reduces / reduce-scatters, and everything meshtron.compress's Reducer sends
        (`in_reducer`, set by the bench around its calls); the rest (parameter all-gathers,
        ZeRO-1 broadcasts) is parameter traffic."""

        def __init__(self):
            super().__init__()
            self.sent = 0.0
            self.gradient_sent = 0.0
            self.in_reducer = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name.startswith("c10d::"):
                self._count(name, args)
            return func(*args, **(kwargs or {}))

        def _count(self, name, args):
            n = _group_size(args)
            if n <= 1:
                return
            if "allreduce" in name:
                b, grad = 2 * (n - 1) / n * _nbytes(args[0]), True
            elif "reduce_scatter" in name:
                b, grad = (n - 1) / n * _nbytes(args[1]), True
            elif "alltoall" in name:
                b, grad = (n - 1) / n * _nbytes(args[1]), True
            elif "allgather" in name:
                b, grad = (n - 1) * _nbytes(args[1]), False
            elif "broadcast" in name:
                b, grad = _nbytes(args[0]) * (n - 1) / n, False  # roots take turns (ZeRO-1)
            else:
                return
            self.sent += b
            if grad or self.in_reducer:
                self.gradient_sent += b

    return Bytes()


def _flag_reducer(reducer, counter_ref: list) -> None:
    """Mark the Reducer's collectives as gradient traffic (bench instrumentation only)."""
    for name in ("all_reduce", "reduce_scatter"):
        inner = getattr(reducer, name)

        def wrapped(*a, _inner=inner, **k):
            counter_ref[0].in_reducer = True
            try:
                return _inner(*a, **k)
            finally:
                counter_ref[0].in_reducer = False

        setattr(reducer, name, wrapped)


def rank_body(cases, steps):
    import torch
    import torch.distributed as dist

    from meshtron.compress import diloco as dl
    from meshtron.model import Transformer, preset
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import data_mesh, release_mesh

    out = []
    n = dist.get_world_size()
    for label, plan in cases:
        plan = dict(plan, micro_batch=ROWS)  # one micro-batch: FSDP2 reduces once per step too
        mesh = build_mesh(plan, n, device_type="cpu")
        torch.manual_seed(0)
        pm = parallelize(Transformer(preset("tiny")), plan, mesh)
        opt = build_optimizer(pm, lr=1e-3)
        outer = dl.attach(pm, pm.layout)
        current: list = [None]
        for owner in (outer, pm.grad_sync):
            if owner is not None:
                _flag_reducer(owner.reducer, current)
        r = data_mesh(mesh).get_local_rank()
        g = torch.Generator().manual_seed(r)
        params = sum(p.numel() for p in Transformer(preset("tiny")).parameters())
        sent = grad = 0.0
        for step in range(steps):
            x = torch.randint(0, 259, (ROWS, 65), generator=g)
            counter = current[0] = _counter()
            with counter:
                pm.forward_backward(x[:, :-1], x[:, 1:])
                opt.step()
                opt.zero_grad()
                if outer is not None:
                    outer.after_inner_step()
            if step >= 1:  # the first step builds buffers; count the steady ones
                sent += counter.sent
                grad += counter.gradient_sent
        out.append({"label": label, "sent": sent / (steps - 1), "grad": grad / (steps - 1),
                    "params": params})
        del pm, opt
        release_mesh(mesh)
    return out


def main() -> None:
    from testkit.multiproc import run_on_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compress_bytes import rank_body as body  # importable by the ranks (not __main__)

    steps = 9  # one warm-up + 8 counted: a whole DiLoCo round of H=8
    res = run_on_ranks(body, 4, CASES, steps, timeout=900)[0]
    by = {r["label"]: r for r in res}
    params = res[0]["params"]
    print(f"tiny model: {params:,} parameters = {4 * params / 2**20:.2f} MiB of fp32 gradients;"
          " dp=4 gloo ranks; MiB a rank sends per step (steady steps, mean)")
    print(f"{'case':18} {'all MiB':>9} {'gradient MiB':>13} {'vs fp32 (all)':>14} "
          f"{'vs fp32 (gradient)':>19}")
    for r in res:
        stage = r["label"].split()[0]
        base = by.get(f"{stage} fp32") or by["zero0 fp32"]
        print(f"{r['label']:18} {r['sent'] / 2**20:9.3f} {r['grad'] / 2**20:13.3f} "
              f"{r['sent'] / base['sent']:14.3f} {r['grad'] / max(base['grad'], 1):19.3f}")
    ratio = by["zero0 int8"]["grad"] / by["zero0 fp32"]["grad"]
    print(f"int8 / fp32 gradient bytes (zero0, incl. scales): {ratio:.3f} "
          f"(goal <= 0.27: {'met' if ratio <= 0.27 else 'NOT met'})")


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    main()
