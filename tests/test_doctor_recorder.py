"""The recorder a training rank installs (dispatcher kernels + functional-collective proxies)
records every collective a TorchDispatchMode on the c10d namespaces sees (shared notes,
"Seeing collectives"), on real FSDP2, DTensor and pipeline steps, and, per process group,
exactly as many collectives as gloo itself ran (PyTorch's Flight Recorder, which on gloo counts
collectives but not send/recv). The mode misses the collectives DTensor issues inside its own
operator handlers (the mode is suspended while its handler runs); the installed recorder does
not."""

from __future__ import annotations

import pytest

from collections import Counter

from meshtron.testing.multiproc import run_on_ranks

LAYOUTS = [{"dp": 2, "zero": 3}, {"tp": 2},
           {"pp": 2, "schedule": "1f1b", "global_batch": 4, "micro_batch": 1}]


def _gloo_counts() -> dict[str, int]:
    """Collectives per process-group name in the Flight Recorder."""
    import json

    from torch._C._distributed_c10d import _dump_fr_trace_json

    entries = json.loads(_dump_fr_trace_json(includeCollectives=True)).get("entries", [])
    return dict(Counter(str(e["process_group"][0]) for e in entries))


def _records_both_ways(plans):
    import torch
    import torch.distributed as dist

    import meshtron
    from meshtron.doctor.recorder import CollectiveRecorder
    from meshtron.model import Transformer, preset

    spec = preset("debug")
    out = []
    for plan in plans:
        mesh = meshtron.build_mesh(plan, spec=spec)
        pm = meshtron.parallelize(Transformer(spec), plan, mesh)
        x = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
        got = {}
        for how in ("installed", "mode"):
            rec = CollectiveRecorder(dist.get_rank())
            if how == "installed":
                before = _gloo_counts()
                rec.install()
                pm.forward_backward(x, x)
                pm.clip_grad_norm_(1.0)
                rec.uninstall()
                after = _gloo_counts()
                got["gloo"] = {g: n - before.get(g, 0) for g, n in after.items()
                               if n > before.get(g, 0)}
                got["recorded"] = dict(Counter(r["group"] for r in rec.snapshot()
                                               if "peer" not in r))
            else:
                with rec:
                    pm.forward_backward(x, x)
                    pm.clip_grad_norm_(1.0)
            got[how] = [(r["op"], r["seq"], tuple(rec.groups[r["group"]].ranks),
                         r.get("peer"), str(r["shapes"]), str(r["dtypes"]))
                        for r in rec.snapshot()]
        out.append(got)
        meshtron.parallel.release_mesh(mesh)
    # After uninstall nothing is recorded any more.
    rec = CollectiveRecorder(dist.get_rank())
    rec.install()
    rec.uninstall()
    dist.all_reduce(torch.ones(2))
    assert not rec.records
    return out


def test_installed_recorder_sees_what_the_dispatch_mode_sees():
    results = run_on_ranks(_records_both_ways, 2, LAYOUTS, timeout=240,
                           env={"TORCH_FR_BUFFER_SIZE": "20000"})
    for rank, per_layout in enumerate(results):
        for plan, got in zip(LAYOUTS, per_layout):
            assert got["recorded"] == got["gloo"], (rank, plan, got["recorded"], got["gloo"])
            strip = [(op, ranks, peer, shapes) for op, _, ranks, peer, shapes, _ in
                     got["installed"]]
            it = iter(strip)  # the mode's records, in order, are a subsequence
            assert all(any(m == r for r in it) for m in
                       [(op, ranks, peer, shapes) for op, _, ranks, peer, shapes, _ in
                        got["mode"]]), (rank, plan)
            ops = {op for op, *_ in got["installed"]}
            assert len(got["installed"]) >= 6, (plan, got["installed"])
            if plan.get("zero") == 3:
                assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= ops, ops
            if plan.get("tp"):
                assert "all_reduce" in ops
            if plan.get("pp"):
                assert {"send", "recv"} <= ops and all(
                    peer == 1 - rank for op, _, _, peer, *_ in got["installed"]
                    if op in ("send", "recv"))
