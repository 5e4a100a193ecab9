"""The planner's collective list (`meshtron.planner.step_collectives`) against real gloo steps.

One 4-rank launch trains every ZeRO stage with 4 micro-batches per step, without and with a
pipeline (dp=4; dp=2 x pp=2, 1F1B), with `accumulate_unsharded`, a bf16 reduction and bf16
compute (the slow suite adds HSDP, ZeRO-0 and ZeRO-2 under the pipeline, ZeRO-2 accumulating
unsharded, bf16 ZeRO-3 HSDP, bf16 ZeRO-1 under the pipeline):

- every data-parallel and pipeline collective of the second step (the first includes FSDP2's
  lazy initialisation), as the collective recorder sees them (its dispatch-mode path: every
  c10d op of this thread), grouped by (kind, mesh axis, bytes of the input per call, group
  size, dtype), must equal exactly, call counts included, what the planner's
  `step_collectives(plan, model, global_batch, seq_len, pp_rank)` lists for that rank: the
  same list the planner's time model prices (tests/test_planner_stacks.py);
- fp32 losses, gradient norms and parameters must match the single-process run (1e-5); the
  bf16-compute layouts are checked for their collectives only (their numerics are the bf16
  equivalence sweep's subject).

The vocabulary is a multiple of the data-parallel groups: FSDP2 pads every parameter's dim 0
to a multiple of the group and the planner counts unpadded parameters (a row per rank at most).
"""

from __future__ import annotations

from collections import Counter

import pytest

from testkit.equivalence import DEFAULT_CFG, compare, format_report, reference_run
from testkit.multiproc import run_on_ranks

TOL = 1e-5
CFG = dict(DEFAULT_CFG, batch=16, steps=2, spec=dict(DEFAULT_CFG["spec"], vocab=132))
# recorder op names -> the planner's kinds
KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "send": "send", "recv": "recv",
         "all_to_all_single": "all_to_all"}
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "int64": "int64"}

LAYOUTS = [
    dict(dp=4, zero=0, micro_batch=1), dict(dp=4, zero=1, micro_batch=1),
    dict(dp=4, zero=2, micro_batch=1), dict(dp=4, zero=3, micro_batch=1),
    dict(dp=4, zero=3, micro_batch=1, accumulate_unsharded=True, reduce_dtype="bf16"),
    dict(dp=4, zero=1, micro_batch=1, dtype="bf16"),
    dict(dp=2, pp=2, zero=1, schedule="1f1b", micro_batch=2),
    dict(dp=2, pp=2, zero=3, schedule="1f1b", micro_batch=2),
]
# The rest of the grid, in the slow suite (same checks, one more launch).
SLOW_LAYOUTS = [
    dict(dp=4, zero=2, micro_batch=1, accumulate_unsharded=True),
    dict(dp=4, zero=3, dp_replicate=2, micro_batch=1),
    dict(dp=2, pp=2, zero=0, schedule="1f1b", micro_batch=2),
    dict(dp=2, pp=2, zero=2, schedule="1f1b", micro_batch=2, reduce_dtype="bf16"),
    dict(dp=4, zero=3, dp_replicate=2, micro_batch=1, dtype="bf16"),
    dict(dp=2, pp=2, zero=1, schedule="1f1b", micro_batch=2, dtype="bf16"),
]


def planned(layout: dict, pp_rank: int) -> Counter:
    """The planner's list for this layout on a rank of pipeline rank `pp_rank`:
    {(kind, axis, bytes per call, group size, dtype): calls per step}."""
    from meshtron.parallel.mesh import resolve_plan
    from meshtron.planner import step_collectives
    from testkit.equivalence import make_spec

    spec = make_spec(CFG)
    plan = resolve_plan(layout, 4, spec)
    return Counter({(c.kind, c.axis, c.bytes, c.group_size, c.dtype): c.count
                    for c in step_collectives(plan, spec, CFG["batch"], CFG["seq"], pp_rank)})


def _rank_fn(cfg, layouts):
    """Per rank: train each layout (a "model" entry overrides cfg's spec: equivalence.layout_cfg)
    and count the last step's collectives by (kind, axis, bytes, group size, dtype); expert
    parallelism's all-to-alls are on axis "ep", the routed experts' FSDP on "dp_shard_mod_ep"
    (tests/test_ep_pp.py reuses this)."""
    import torch
    import torch.distributed as dist

    from testkit.collective_mode import CollectiveMode
    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import data_mesh, expert_meshes, release_mesh
    from testkit.equivalence import layout_cfg, make_data, make_spec
    from meshtron.train.optim import adamw_kernel

    base_cfg = cfg
    out = []
    for layout in layouts:
        cfg, plan = layout_cfg(base_cfg, layout)
        inputs, targets = make_data(cfg)
        mesh = build_mesh(plan, device_type="cpu")
        # Groups by their ranks, named as the planner names them: ZeRO-1's flattened "dp"
        # group has the ranks of "dp_replicate" (dp_shard is 1 there).
        label = {}
        for axis in ("pp", "tp", "dp_replicate", "dp_shard"):
            label[tuple(dist.get_process_group_ranks(mesh[axis].get_group()))] = axis
        experts, a2a = expert_meshes(mesh), None
        if experts is not None:  # the all-to-alls' group may have the ranks of "dp_shard"
            a2a = tuple(dist.get_process_group_ranks(experts.ep.get_group()))
            mod = experts.data.get_group()  # dp_shard_mod_ep (ZeRO-2/3) or dp_mod_ep (0/1)
            label[tuple(dist.get_process_group_ranks(mod))] = experts.data_axis
        torch.manual_seed(cfg["seed"])
        with torch.device("meta"):
            model = Transformer(make_spec(cfg))
        pm = parallelize(model, plan, mesh)
        opt = build_optimizer(pm, lr=cfg["lr"], betas=(0.9, 0.95), eps=cfg["eps"],
                              weight_decay=cfg["weight_decay"], **adamw_kernel("cpu"))
        dp, r = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
        rows = cfg["batch"] // dp
        losses, norms, counted = [], [], Counter()
        for step in range(cfg["steps"]):
            rec = CollectiveMode(dist.get_rank())
            with rec:
                loss = pm.forward_backward(inputs[step, r * rows:(r + 1) * rows],
                                           targets[step, r * rows:(r + 1) * rows])
            if step == cfg["steps"] - 1:
                for rr in rec.snapshot():
                    sizes = [int(torch.Size(s).numel()) for s in rr["shapes"]]
                    # the loss's scalar reductions are not gradient/parameter traffic
                    if "peer" not in rr and max(sizes) <= 1:
                        continue
                    # bytes of the input per call: all_gather's is its shard (the smaller
                    # tensor), reduce_scatter's the whole buffer, the others' their tensor
                    # (all_to_all_single: the first, its input; uneven splits change the output)
                    numel = (min(sizes) if rr["op"] == "all_gather_into_tensor"
                             else sizes[0] if rr["op"] == "all_to_all_single" else max(sizes))
                    dtype = rr["dtypes"][0]
                    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
                    ranks = tuple(rec.groups[rr["group"]].ranks)
                    axis = ("ep" if rr["op"] == "all_to_all_single" and ranks == a2a
                            else label.get(ranks, str(ranks)))
                    counted[(KINDS.get(rr["op"], rr["op"]), axis,
                             numel * width, len(ranks), DTYPES.get(dtype, dtype))] += 1
            losses.append(float(loss))
            norms.append(float(pm.clip_grad_norm_(cfg["clip"])))
            opt.step()
            opt.zero_grad()
        params = pm.full_parameters()
        keep = mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("tp") == 0
        out.append({"layout": layout, "losses": losses, "norms": norms, "seconds": 0.0,
                    "params": params if keep else None, "counted": dict(counted),
                    "pp_rank": mesh.get_local_rank("pp")})
        del pm, opt, model
        release_mesh(mesh)
    return out


def _check(layouts):
    results = run_on_ranks(_rank_fn, 4, CFG, layouts, timeout=600)
    fp32 = [i for i, lay in enumerate(layouts) if lay.get("dtype", "fp32") == "fp32"]
    report = compare(reference_run(CFG), [[per[i] for i in fp32] for per in results])
    print(format_report(report))
    for r in report:
        assert not (r["missing"] or r["extra"]), r
        if r["layout"].get("reduce_dtype") == "bf16":
            # Gradients rounded to bf16 (2^-9 relative) once per step: losses and gradient
            # norms (sums over many elements) move ~1e-6 / 1e-5 (measured 1e-6 / 1.5e-5); a
            # parameter moves up to 2 lr per step where rounding flips the sign of a near-zero
            # gradient that AdamW's first steps turn into +-lr (2 steps x 2e-3 / 0.025 max
            # weight: measured 7.7e-3). A wrong scale or a missing reduction shows in the norm.
            assert r["loss_rel"] < 1e-5 and r["norm_rel"] < 1e-4 and r["param_rel"] < 5e-2, r
        else:
            assert max(r["loss_rel"], r["norm_rel"], r["param_rel"]) <= TOL, r
    for rank, per_layout in enumerate(results):
        for got in per_layout:
            plan = got["layout"]
            want = planned(plan, got["pp_rank"])
            # the data and pipeline axes: tensor-parallel collectives are not planned here
            counted = Counter({k: v for k, v in got["counted"].items() if k[1] != "tp"})
            assert counted == want, (rank, plan, sorted(counted.items()), sorted(want.items()))
            if rank in (0, 3):  # pipeline ranks 0 and 1 of the pp layouts: the README table
                print(rank, plan, _summary(counted))


def _summary(counted: Counter) -> str:
    """'calls kind (bytes) + ...' per kind and axis, for the README table."""
    calls, nbytes = Counter(), Counter()
    for (kind, axis, size, _, dtype), n in counted.items():
        calls[(kind, axis, dtype)] += n
        nbytes[(kind, axis, dtype)] += n * size
    return " + ".join(f"{calls[k]} {k[0]} {k[2]} ({nbytes[k] / 1e6:.3f} MB)"
                      for k in sorted(calls))


def test_collectives_per_step_and_equivalence():
    _check(LAYOUTS)


@pytest.mark.slow
def test_collectives_per_step_and_equivalence_rest_of_grid():
    _check(SLOW_LAYOUTS)
