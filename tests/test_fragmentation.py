"""The caching allocator's fragmentation allowance per stack (memory_options.FRAGMENTATION, the
model's one undetermined margin, and FRAGMENTATION_EXPANDABLE): a stack that runs PyTorch's
allocator with expandable segments (an options file's `expandable_segments = true`, as
torchtitan's run_train.sh launches) is charged no fragmentation, the others 8% of the tensors at
the peak; the fixed workspace is the same for all."""

from __future__ import annotations

import pytest

from meshtron.errors import UserError
from meshtron.planner import frameworks, memory
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.memory import GIB, MemoryOptions
from meshtron.planner.plan import Plan
from meshtron.model.spec import resolve_model


@pytest.mark.parametrize("name, expandable", [("meshtron", False), ("torchtitan", False),
                                              ("torchtitan", True), ("megatron", False),
                                              ("deepspeed", False)])
def test_each_stack_workspace_is_fixed_plus_its_fragmentation(name, expandable):
    """No preset assumes expandable segments (torchtitan's multinode_trainer.slurm does not set
    them); an options file does, for a run launched with them (its run_train.sh)."""
    fw = frameworks.preset(name)
    assert fw.memory.expandable_segments is False
    if expandable:
        fw = frameworks.with_options(fw, {"expandable_segments": True})
    cluster = preset_cluster("dgx-h100", 1)
    ev = Evaluator(resolve_model("llama3-8b"), cluster, 64, 4096, fw.kernel, mem=fw.memory)
    cfg = Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, recompute="full", dtype="bf16")
    m = ev.evaluate(cfg).memory
    frac = memory.FRAGMENTATION_EXPANDABLE if expandable else memory.FRAGMENTATION
    fixed = memory.workspace_fixed(cluster.memory_bytes) / GIB
    assert m.workspace == pytest.approx(fixed + frac * m.allocated, rel=1e-9)
    # the search's budget of tensors is the same equation solved for them
    assert ev.tensor_budget * (1 + frac) + fixed * GIB == pytest.approx(cluster.memory_bytes)


def test_expandable_segments_charge_no_fragmentation_and_the_default_eight_percent():
    assert MemoryOptions().fragmentation == memory.FRAGMENTATION == 0.08
    assert MemoryOptions(expandable_segments=True).fragmentation == 0.0


def test_expandable_segments_must_be_a_bool():
    with pytest.raises(UserError, match=r"memory.expandable_segments='yes': allowed values "
                                        r"are true, false"):
        MemoryOptions(expandable_segments="yes")


def _plan_json(capsys, *extra: str) -> dict:
    import json

    from meshtron.cli import main

    rc = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch",
               "64", "--seq-len", "4096", "--layout", "tp=1,pp=1,dp=8", "--zero", "3",
               "--recompute", "full", "--micro-batch", "1", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_an_options_file_sets_expandable_segments_through_the_command(capsys, tmp_path):
    """The user's path: `--options` with `expandable_segments = true` drops the 8% from the
    workspace of the same plan and says so in the JSON's framework; a non-bool is refused
    with one line naming the field (exit 2)."""
    from meshtron.cli import main

    base = _plan_json(capsys, "--framework", "torchtitan")
    opts = tmp_path / "launch.toml"
    opts.write_text('framework = "torchtitan"\n[options]\nexpandable_segments = true\n')
    exp = _plan_json(capsys, "--options", str(opts))
    assert base["framework"]["memory"]["expandable_segments"] is False
    assert exp["framework"]["memory"]["expandable_segments"] is True
    b, e = base["plans"][0]["memory_gib"], exp["plans"][0]["memory_gib"]
    fixed = memory.workspace_fixed(80 * GIB) / GIB
    assert b["workspace"] == pytest.approx(fixed + memory.FRAGMENTATION * (b["total"]
                                                                           - b["workspace"]))
    assert e["workspace"] == pytest.approx(fixed)
    bad = tmp_path / "bad.toml"
    bad.write_text('framework = "torchtitan"\n[options]\nexpandable_segments = "yes"\n')
    rc = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch",
               "64", "--seq-len", "4096", "--options", str(bad)])
    _, err = capsys.readouterr()
    assert rc == 2 and "expandable_segments='yes'" in err and "Traceback" not in err
