"""Host offload in the planner: host memory per node (cluster.host_memory_gib) bounds what the
GPUs of a node may offload, and offloaded plans are priced beside the ones that fit without
offload and kept when faster (issue 20, items 2-3)."""

from __future__ import annotations

import json

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner.cluster import (GH200_HOST_MEMORY_GIB, HOST_USABLE_FRACTION,
                                      cluster_from_dict, resolve_cluster)
from meshtron.planner.memory import GIB
from meshtron.planner.search import search_plans

# 4 GH200 superchips per node: H100 with 96 GB HBM3 at 4 TB/s, NVLink-C2C to 480 GB LPDDR5X
# (GH200 datasheet: 900 GB/s C2C both directions, up to 512 GB/s LPDDR5X)
GH200 = dict(name="gh200", gpu="H100", memory_gib=96, hbm_gb_per_s=4000, gpus_per_node=4,
             nodes=1, intra_node_gb_per_s=150, inter_node_gb_per_s=25, host_link_gb_per_s=450,
             host_memory_gb_per_s=500, host_memory_gib=4 * GH200_HOST_MEMORY_GIB)


def test_host_memory_defaults_and_override():
    assert resolve_cluster("dgx-h100:2").host_memory_per_node_gib == 2048
    assert resolve_cluster("dgx-h200:1").host_memory_per_node_gib == 2048
    assert resolve_cluster("dgx-a100:1").host_memory_per_node_gib == 2048
    assert cluster_from_dict(dict(GH200)).host_memory_per_node_gib == pytest.approx(1788.1, abs=0.1)
    by_numbers = cluster_from_dict(dict(peak_tflops=100, memory_gib=16, gpus_per_node=2, nodes=1,
                                        intra_node_gb_per_s=10, inter_node_gb_per_s=1))
    assert by_numbers.host_memory_per_node_gib is None  # unknown: not checked
    with pytest.raises(UserError, match=r"cluster.host_memory_gib=-1: must be a positive"):
        cluster_from_dict(dict(GH200, host_memory_gib=-1))


def test_offloaded_states_of_a_node_are_counted_and_bound_by_host_memory():
    # llama3-70b on 8 H100: the model states (16 bytes per parameter) exceed the 640 GB of
    # HBM, so only host offload fits; the node's host holds all of them.
    model = PRESETS["llama3-70b"]
    r = search_plans(model, resolve_cluster("dgx-h100:1"), 16, 4096)
    best = r.best
    assert best is not None and best.config.offload == "full"
    states = 16.0 * model.num_params() / GIB  # fp32 params + grads + two AdamW moments
    assert best.memory.host == pytest.approx(states, rel=0.01)
    assert best.memory.host_capacity == pytest.approx(2048 * HOST_USABLE_FRACTION)
    # the same node with 512 GiB of host memory: offload no longer fits either
    small = cluster_from_dict(dict(gpu="H100", gpus_per_node=8, nodes=1, intra_node_gb_per_s=450,
                                   inter_node_gb_per_s=50, host_memory_gib=512))
    r = search_plans(model, small, 16, 4096)
    assert not r.plans and r.near_miss is not None
    nm = r.near_miss.memory
    assert nm.total <= nm.capacity and not nm.host_fits and nm.host > 512 * HOST_USABLE_FRACTION


def test_activation_offload_counts_in_host_memory():
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    ev = Evaluator(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:1"), 32, 4096)
    base = Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, recompute="none", offload="full")
    a = ev.evaluate(base, keep_infeasible=True)
    b = ev.evaluate(Plan(**{**base.__dict__, "offload_activations": True}), keep_infeasible=True)
    per_node = 8 * (b.memory.activations + b.memory.in_flight)
    assert b.memory.host == pytest.approx(a.memory.host + per_node, rel=1e-6) and per_node > 1


def test_plan_cli_refuses_offload_beyond_host_memory(tmp_path, capsys):
    from meshtron.cli import main

    cl = tmp_path / "small-host.toml"
    cl.write_text('gpu = "H100"\ngpus_per_node = 8\nnodes = 1\nintra_node_gb_per_s = 450\n'
                  'inter_node_gb_per_s = 50\nhost_memory_gib = 512\n')
    rc = main(["plan", "--model", "llama3-70b", "--cluster", str(cl), "--global-batch", "16",
               "--seq-len", "4096"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "host memory per node" in err and "460.8 GiB usable" in err


def test_gh200_offload_is_chosen_because_faster(capsys):
    """On NVLink-C2C (450 GB/s per direction, 7x PCIe Gen5) and LPDDR5X, offloading the states
    of llama3-8b frees enough HBM for two sequences per micro-batch without recomputation; the
    planner prices it next to the plans that fit without offload and keeps it because its step
    is shorter. (At a global batch of 32 a 2-stage zero-bubble pipeline without offload ties
    with it since issue 30's accumulation and FSDP2 copy-out terms: 16 keeps the comparison
    clear-cut.)"""
    from meshtron.cli import main

    cl = cluster_from_dict(dict(GH200))
    r = search_plans(PRESETS["llama3-8b"], cl, 16, 8192)
    assert r.offload_compared and r.best.config.offload == "full"
    alt = r.alternatives[0]
    assert alt.label == "best plan without host offload" and alt.estimate.config.offload == "none"
    assert alt.estimate.step_time_s > r.best.step_time_s
    assert any("chosen because faster" in n for n in r.notes)
    # forced off: the same search without offload gives that alternative as its best
    off = search_plans(PRESETS["llama3-8b"], cl, 16, 8192, fixed={"offload": "none"})
    assert off.best.step_time_s == pytest.approx(alt.estimate.step_time_s)
    assert not off.offload_compared
    # and `plan --json` carries the offload and the host memory
    import tomli_w

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "gh200.toml"
        path.write_text(tomli_w.dumps({k: v for k, v in GH200.items() if k != "name"}))
        assert main(["plan", "--model", "llama3-8b", "--cluster", str(path), "--global-batch",
                     "16", "--seq-len", "8192", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plans"][0]["offload"] == "full" and doc["plans"][0]["memory_gib"]["host"] > 100


def test_offload_compared_but_not_chosen_on_pcie():
    """A plan that fits without offload and needs no recomputation: offload can only add
    PCIe copies and a host optimizer step, the comparison is made and offload loses."""
    r = search_plans(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:8"), 512, 4096)
    assert r.offload_compared and r.offload_best is None
    assert r.best.config.offload == "none"


def test_plan_offload_flag_is_checked_by_name(capsys):
    from meshtron.cli import main

    rc = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
               "--seq-len", "4096", "--offload", "disk"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "plan.offload='disk': allowed values are none, optimizer, full" in err
