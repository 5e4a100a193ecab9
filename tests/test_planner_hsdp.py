"""HSDP in the planner's search (planner/search_space.py `SearchSpace.replicates`): on a stack
whose data parallelism is FSDP, a ZeRO-2/3 plan whose data-parallel group spans nodes is also
priced with one replica per node (dp_replicate = nodes the group spans), as torchtitan's,
OLMo-core's and meshtron's HSDP meshes build it. DiLoCo, whose replicas are the dp_replicate
axis, was limited to ZeRO-0 before (session-55 finding: `plan --diloco 16` on 2 DGX H100 found
a 17.6 s plan where ZeRO-2 with two replicas takes 16.5 s)."""

from __future__ import annotations

import json

from testkit.cli_inproc import meshtron_main

ARGS = ["plan", "--model", "llama3-8b", "--global-batch", "256", "--seq-len", "8192",
        "--diloco", "16"]


def _best(*args: str) -> dict:
    rc, out, err = meshtron_main(*ARGS, *args, "--json")
    assert rc == 0, err
    return json.loads(out)["plans"][0]


def test_diloco_on_two_nodes_plans_one_replica_per_node():
    best = _best("--cluster", "dgx-h100:2", "--top", "1")
    assert best["zero"] >= 2 and best["dp_replicate"] == 2, best
    assert best["dp"] * best["tp"] * best["cp"] == 16 and best["pp"] == 1, best
    zero0 = _best("--cluster", "dgx-h100:2", "--top", "1", "--zero", "0")
    assert zero0["step_time_s"] > best["step_time_s"], (zero0, best)  # what it was limited to
    rc, out, err = meshtron_main(*ARGS, "--cluster", "dgx-h100:2", "--top", "3")
    text = " ".join(out.split())
    assert rc == 0 and f"{best['tp']}/1/2x{best['dp'] // 2} " in out, out
    assert "dp 'RxS' is HSDP, R replicas of an S-rank sharded group" in text, out


def test_no_replicas_inside_one_node_or_on_a_stack_without_fsdp():
    one_node = _best("--cluster", "dgx-h100:1", "--top", "1")
    assert (one_node["zero"], one_node["dp_replicate"]) == (0, 1), one_node
    deepspeed = _best("--cluster", "dgx-h100:2", "--top", "1", "--framework", "deepspeed")
    assert deepspeed["dp_replicate"] == 1, deepspeed


def test_replicas_searched_per_layout():
    from meshtron.planner.cli import load_model
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.frameworks import preset
    from meshtron.planner.plan_knobs import Knobs
    from meshtron.planner.search_space import SearchSpace

    fw = preset("meshtron")

    def space(**knobs):
        return SearchSpace(load_model("llama3-8b"), preset_cluster("dgx-h100", 4), 256, 4096,
                           Knobs(**knobs), fw.kernel, fw.memory, True, fw)

    s = space()
    assert s.replicates(tp=2, cp=1, dp=16, zero=3) == [1, 4]  # 4 ranks of each node shard
    assert s.replicates(tp=2, cp=2, dp=8, zero=2) == [1, 4]
    assert s.replicates(tp=1, cp=1, dp=8, zero=3) == [1]  # the group is one node
    assert s.replicates(tp=8, cp=1, dp=4, zero=3) == [1]  # one rank per node: nothing sharded
    assert s.replicates(tp=1, cp=1, dp=32, zero=1) == [1]  # HSDP shards: ZeRO-2/3 only
    assert space(dp_replicate=1).replicates(tp=1, cp=1, dp=32, zero=3) == [1]  # fixed


def test_the_twins_floor_bounds_every_replica_split():
    """search_bound skips an HSDP point on its one-replica twin's figures: the twin's step less
    its data-parallel, optimizer and host-copy parts must not exceed the HSDP step, and the
    twin's memory less its gathered buffers and workspace must not exceed the HSDP plan's (a
    twin just over the memory can have an HSDP twin that fits: 78.90 vs 78.81 GiB, 8B tp2 pp2
    dp8 ZeRO-2)."""
    from meshtron.planner.cli import load_model
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.frameworks import preset
    from meshtron.planner.plan import Plan

    fw = preset("meshtron")
    checked = 0
    for model, nodes, layouts in (("llama3-8b", 4, [(1, 1, 32), (2, 1, 16), (2, 2, 8)]),
                                  ("llama3-70b", 4, [(4, 2, 4), (8, 2, 2), (2, 2, 8)])):
        ev = Evaluator(load_model(model), preset_cluster("dgx-h100", nodes), 256, 8192,
                       fw.kernel, mem=fw.memory)
        for tp, pp, dp in layouts:
            for zero in (2, 3):
                for rec in ("none", "full"):
                    sched = "1f1b" if pp > 1 else None
                    twin = Plan(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=1, recompute=rec,
                                sp=tp > 1, schedule=sched)
                    r = dp * tp // 8  # one replica per node the stage's dp group spans
                    assert r >= 2
                    hsdp = Plan(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=1, recompute=rec,
                                sp=tp > 1, schedule=sched, dp_replicate=r)
                    a = ev.evaluate(twin, keep_infeasible=True, exact_memory=False)
                    b = ev.evaluate(hsdp, keep_infeasible=True, exact_memory=False)
                    floor = ev.replica_floor(a)
                    assert floor == float("inf") or b.step_time_s >= floor - 1e-9, (twin, hsdp)
                    mem = a.memory
                    assert b.memory.total >= mem.total - mem.gathered - mem.workspace, (twin, hsdp)
                    assert floor < float("inf") or not b.fits, (twin, hsdp)
                    checked += 1
    assert checked == 24
