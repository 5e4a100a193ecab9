"""Mixture-of-experts rehearsal on CPU (issue 30): the MoE layer's static token counts
(`StaticCounts`), what its routed part saves for backward against planner/moe_memory.py, the
planner's MoE memory against `meshtron rehearse` per layout kind, and the command with its
defaults on a MoE model.

The agreement table uses a 4-block model whose MoE terms dominate (16 experts of 512, top-4,
hidden 1024): at 2 blocks the per-step fixed terms (gathered FSDP units at the peak) weigh as
much as the blocks and hide what the MoE model gets right or wrong. The default suite runs three
kinds, recorded (tests/data/rehearsals/moe-fast.json: the planner priced now against the
rehearsal measured then, testkit/recorded_rehearsal.py; re-rehearsed live by a `slow` test);
the whole table live is `slow`. The dense-first stages' rehearsal and the MoE layer's saved
bytes under fake tensors are recorded too (moe-dense-first-stages.json, moe-routed-saved.json).
The rehearsal itself keeps a live default test here: `meshtron rehearse` with its defaults on a
MoE model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.recorded_rehearsal import case, live_check, recorded_table, recorded_values
from testkit.rehearsal import check_totals, run_kinds

from meshtron.model.moe import StaticCounts

ROOT = Path(__file__).resolve().parents[1]

MOE = dict(name="mid-moe", layers=4, hidden=1024, heads=8, kv_heads=4, ffn_hidden=2816,
           vocab=8192, max_seq=4096, moe_experts=16, moe_top_k=4, moe_ffn_hidden=512,
           moe_aux_loss=0.01)
DS = dict(MOE, name="mid-moe-ds", moe_shared_experts=1, moe_dense_layers=1,
          moe_router="sigmoid", moe_groups=4, moe_topk_groups=2, moe_route_scale=2.5,
          moe_bias_update=1e-3, moe_aux_loss=0.0)
BASE = dict(tp=1, pp=1, dp=8, zero=1, micro_batch=2, recompute="none", sp=False,
            dtype="bf16", global_batch=32, seq_len=1024)
KINDS = {
    "ep zero-1": (MOE, dict(ep=4)),
    "ep zero-3": (MOE, dict(ep=4, zero=3)),
    "ep=dp zero-0": (MOE, dict(ep=8, zero=0)),
    "ep+tp+sp": (MOE, dict(ep=2, tp=2, dp=4, zero=3, sp=True)),
    "ep+pp 1f1b": (MOE, dict(ep=2, pp=2, dp=4, zero=1, schedule="1f1b")),
    "ep selective": (MOE, dict(ep=4, zero=3, recompute="selective")),
    "ep full": (MOE, dict(ep=4, zero=3, recompute="full")),
    "ds ep zero-1": (DS, dict(ep=4)),
    "ds ep zero-3": (DS, dict(ep=4, zero=3)),
    "ds ep+tp+sp": (DS, dict(ep=2, tp=2, dp=4, zero=3, sp=True)),
    # no ep, ZeRO-3: every expert in the block's FSDP unit (the unit is larger than the
    # head's; planner/memory_peak.py: the loss's moment holds the head's unit only)
    "zero-3 no ep": (MOE, dict(zero=3)),
    "zero-3 no ep, 2 blocks": (dict(MOE, layers=2), dict(zero=3)),
    "ds ep+pp 1f1b": (DS, dict(ep=2, pp=2, dp=4, zero=1, schedule="1f1b")),
}
FAST = ("ds ep zero-3", "ep+tp+sp", "zero-3 no ep, 2 blocks")

RUN_KINDS = """
import json, sys
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.plan import as_plan
from meshtron.rehearse.run import rehearse
base, kinds = json.loads(sys.argv[1])
out = {}
for name, (model, knobs) in kinds.items():
    spec = ModelSpec(**model)
    plan = as_plan({**base, **knobs, "model": spec.name}).validate(8, spec)
    report = rehearse(spec, plan, resolve_cluster("dgx-h100:1"), "cpu")
    out[name] = {r["row"]: [r["rehearsal_gib"], r["planner_gib"]] for r in report["memory"]}
print("RESULT" + json.dumps(out))
"""


def _run_kinds(names) -> dict:
    return run_kinds(RUN_KINDS, [BASE, {n: KINDS[n] for n in names}])


def _check(results: dict) -> None:
    check_totals(results, "MoE rehearsal", digits=4)


RECORDED_TABLES = {"moe-fast": {n: case(KINDS[n][0], {**BASE, **KINDS[n][1]}) for n in FAST}}


def test_planner_agrees_with_moe_rehearsal_on_three_layout_kinds():
    """The planner priced now against the FAST kinds' recorded rehearsal (moe-fast.json):
    +0.1%, +0.8%, +4.2% (zero-3 no ep, 2 blocks: the closest to the bound) at the recording
    (2026-12-07)."""
    _check(recorded_table("tests/test_rehearse_moe.py", "moe-fast", RECORDED_TABLES["moe-fast"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe-fast", "moe-dense-first-stages", "moe-routed-saved"])
def test_recorded_moe_kinds_are_what_the_rehearsal_measures(name, tmp_path):
    """A recording's regeneration command, run live, writes what is committed."""
    live_check("tests/test_rehearse_moe.py", name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(set(KINDS) - set(FAST)))
def test_planner_agrees_with_moe_rehearsal_on_every_layout_kind(kind):
    _check(_run_kinds([kind]))


RUN_STAGES = """
import json, sys
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.plan import as_plan
from meshtron.rehearse import compare
from meshtron.rehearse.run import rehearse
base, model, knobs = json.loads(sys.argv[1])
spec = ModelSpec(**model)
plan = as_plan({**base, **knobs, "model": spec.name}).validate(8, spec)
out = []
for pp_rank in range(plan.pp):
    rank = compare.first_rank_of_stage(compare.with_layer_split(plan, spec), pp_rank)
    report = rehearse(spec, plan, resolve_cluster("dgx-h100:1"), "cpu", rank=rank)
    out.append({r["row"]: [r["rehearsal_gib"], r["planner_gib"]] for r in report["memory"]})
print("RESULT" + json.dumps(out))
"""


RECORDED_TABLES["moe-dense-first-stages"] = {
    f"pp rank {r}": case(KINDS["ds ep+pp 1f1b"][0], {**BASE, **KINDS["ds ep+pp 1f1b"][1]}, r)
    for r in range(2)}


def test_a_stage_of_dense_first_blocks_is_priced_as_its_own_blocks():
    """DeepSeek-style dense first block under ep + pp: pipeline rank 0 holds one dense and one
    MoE block, rank 1 two MoE blocks; the planner prices each stage's own blocks (parameters
    and the routed activations, moe_memory.stage_blocks), both within 5% of the rehearsal
    (every stage priced as MoE blocks, rank 0 read +15.3% and rank 1 -4.2%; -0.6% and +2.0% at
    the recording, 2026-12-07). The rehearsal is recorded (moe-dense-first-stages.json;
    re-rehearsed live by test_recorded_moe_kinds_are_what_the_rehearsal_measures, slow)."""
    name = "moe-dense-first-stages"
    got = recorded_table("tests/test_rehearse_moe.py", name, RECORDED_TABLES[name])
    for pp_rank, rows in enumerate(got.values()):
        rehearsed, planned = rows["total"]
        assert rows["optimizer"][0] == pytest.approx(rows["optimizer"][1], rel=0.05), pp_rank
        assert planned / rehearsed - 1 == pytest.approx(0.0, abs=0.05), (pp_rank, rows)

@pytest.mark.slow
@pytest.mark.parametrize("model", [MOE, DS], ids=["softmax", "sigmoid+shared"])
def test_looped_bfs_ranks_agree_with_moe_rehearsal(model):
    """Looped BFS (gpipe, v 2) under ep + pp, 8 blocks in chunks of 2 (the DeepSeek-style
    dense first block in rank 0's first chunk): every rank within 5% at the walk of torch's
    order (planner/memory_gpipe.py `looped_moments`). Measured (2026-12-05, branch loopbfs),
    before -> after: softmax rank 0 +6.5% -> -1.0%, rank 1 -2.2% -> -1.0%; sigmoid+shared
    +7.3% -> -1.0%, -1.3% -> -0.7%."""
    knobs = dict(ep=2, pp=2, dp=4, zero=1, schedule="gpipe", virtual_stages=2)
    arg = json.dumps([BASE, dict(model, layers=8), knobs])
    out = subprocess.run([sys.executable, "-c", RUN_STAGES, arg], capture_output=True,
                         text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    check_totals(dict(enumerate(json.loads(line[len("RESULT"):]))), "MoE rehearsal", digits=4)


def test_static_counts_sum_to_the_slots_and_load_the_hot_experts():
    balanced = StaticCounts()(4096 * 4, 16)
    assert sum(balanced) == 4096 * 4 and max(balanced) - min(balanced) <= 1
    skewed = StaticCounts(1.5, hot=(4, 8))(1000, 16)
    assert sum(skewed) == 1000
    mean = 1000 / 16
    assert all(abs(n - 1.5 * mean) <= 1 for n in skewed[4:8])
    assert all(n < mean for n in skewed[:4] + skewed[8:])
    # no ep (the hot range is every expert): imbalance has nothing to move
    assert StaticCounts(2.0, hot=(0, 16))(1000, 16) == StaticCounts()(1000, 16)
    with pytest.raises(ValueError, match="imbalance"):
        StaticCounts(0.5)


SAVED_MODELS = {"softmax": MOE, "sigmoid+shared": DS}
SAVED_TOKENS = 2048


def routed_autograd_saved_bytes(key: str) -> int:
    """Bytes the MoE layer of SAVED_MODELS[key] (shared experts off) saves for backward under
    fake tensors, bf16, SAVED_TOKENS tokens, no expert parallelism, the grouped kernel (what a
    bf16 GPU run uses): every saved tensor of its autograd graph that is not a weight or a view
    of one, deduplicated by storage, less the layer's input (the dense part's bytes). A byte
    count: the same on every run of the same code and torch."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshtron.model.moe import MoE
    from meshtron.model.spec import ModelSpec

    spec = ModelSpec(**{**SAVED_MODELS[key], "moe_shared_experts": 0})
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer = MoE(spec)
            layer.counts_policy = StaticCounts()
            layer.experts.kernel = "grouped"
            x = torch.empty(2, SAVED_TOKENS // 2, spec.hidden, requires_grad=True)
            normed = x * 1.0  # the block's normed input (saved by the gate)
            out = layer(normed)
            saved = _saved_storages(out, {id(p) for p in layer.parameters()})
    finally:
        torch.set_default_dtype(torch.float32)
    return sum(saved.values()) - SAVED_TOKENS * spec.hidden * 2  # less `normed`


def _saved_storages(out, weights: set) -> dict:
    """{storage id: bytes} of what `out`'s autograd graph saves, weights and their views out."""
    import torch

    seen, stack, saved = set(), [out.grad_fn], {}
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            t = getattr(fn, name) if name.startswith("_saved_") else None
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            if id(t) in weights or (t._base is not None and id(t._base) in weights):
                continue  # a weight, or a view of one (the transposed expert matrices)
            saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        stack += [f for f, _ in fn.next_functions]
    return saved


RECORDED_MEASURES = {"moe-routed-saved": (routed_autograd_saved_bytes, list(SAVED_MODELS))}


@pytest.mark.parametrize("model", list(SAVED_MODELS))
def test_routed_saved_bytes_are_what_autograd_saves(model):
    """moe_memory's op list against the MoE layer's autograd graph (fake tensors, one layer, no
    expert parallelism): the routed part's saved bytes exactly, shared experts aside. The
    graph's bytes are recorded (moe-routed-saved.json, `routed_autograd_saved_bytes`;
    measured live by test_recorded_moe_kinds_are_what_the_rehearsal_measures, slow); the
    planner's are computed now."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.moe_memory import routed_saved_bytes

    got = recorded_values("tests/test_rehearse_moe.py", "moe-routed-saved", SAVED_MODELS)[model]
    spec = ModelSpec(**{**SAVED_MODELS[model], "moe_shared_experts": 0})
    want = routed_saved_bytes(spec, SAVED_TOKENS, 1, 1, 1.0, 2.0, "eager")
    assert got == pytest.approx(want, rel=0.01)


DEFAULTS = ["--model", "tiny-moe-ds", "--cluster", "dgx-h100:1", "--global-batch", "8",
            "--seq-len", "256"]
ONE_MICRO_BATCH = ["--layout", "dp=8", "--zero", "0", "--micro-batch", "1"]


def _rehearse(*argv: str) -> subprocess.CompletedProcess:
    """`meshtron rehearse ARGV` through `meshtron.cli.main` in this process (testkit/cli_inproc.py,
    as tests/test_rehearse.py's commands: the test reads its exit code and output; suite time,
    session 57: a child imported torch again, ~3.5 CPU s)."""
    from testkit.cli_inproc import meshtron_main

    code, stdout, stderr = meshtron_main("rehearse", *argv)
    assert code == 0, stderr[-2000:]
    return subprocess.CompletedProcess(["meshtron", "rehearse", *argv], code, stdout, stderr)


@pytest.fixture(scope="module")
def defaults_run() -> subprocess.CompletedProcess:
    """`meshtron rehearse` with the model, cluster and batch only (one launch, read by the two
    tests below)."""
    return _rehearse(*DEFAULTS)


def test_rehearse_command_runs_a_moe_model_with_defaults(defaults_run):
    """The user's path: model, cluster and batch only; the planner picks the layout and the
    knobs, the rank runs on CPU under fake tensors (it used to be refused for a MoE)."""
    out = defaults_run
    assert "of tiny-moe-ds" in out.stdout and "tokens per expert fixed" in out.stdout
    total = [line.split() for line in out.stdout.splitlines() if line.startswith("total")][0]
    rehearsed, planned = float(total[1]), float(total[2])
    # The planner's pick here (dp=8, ZeRO-0, one micro-batch per step, priced at its moments:
    # test_one_microbatch_steps_hold_no_gradients_at_the_loss) is -0.5% of the rehearsal: its
    # params row is -3.0% (132 KB, a [vocab, hidden] fp32 tensor's size) at one micro-batch and
    # at two, whose plan the moments do not touch (-0.4% there, 2026-12-05): open, not this
    # moment's
    assert rehearsed > 0 and -0.01 <= planned / rehearsed - 1 < 0.05


def test_one_microbatch_steps_hold_no_gradients_at_the_loss(defaults_run):
    """The planner within 5% of the rehearsal on a ZeRO-0 plan of one micro-batch per step:
    no gradient exists at the loss (zero_grad set them to None), the head's is made there
    (estimate_gpipe._gpipe_ranks at pp 1; it was +17.0%, 2026-12-04; -0.5% 2026-12-05).

    The planner's own pick for these flags is that plan (dp=8 ZeRO-0 micro-batch 1, its first
    line says so): fixing its knobs cannot change a search's best to another plan that also
    has them, so the defaults' launch is this rehearsal; where the pick differs, the knobs are
    given and the command runs again."""
    out = defaults_run
    if " dp=8 zero=0 micro_batch=1 " not in out.stdout.splitlines()[0]:
        out = _rehearse(*DEFAULTS, *ONE_MICRO_BATCH)
        assert " dp=8 zero=0 micro_batch=1 " in out.stdout.splitlines()[0], out.stdout
    total = [line.split() for line in out.stdout.splitlines() if line.startswith("total")][0]
    rehearsed, planned = float(total[1]), float(total[2])
    assert abs(planned / rehearsed - 1) < 0.05


def _refused(capsys, argv: list[str]) -> str:
    """`meshtron rehearse ARGV` through the command's entry point in this process (the refusal
    comes before any rehearsal: a child would only add a torch import): exit 2, one line."""
    from meshtron.cli import main

    capsys.readouterr()
    code = main(["rehearse", *argv])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("value", ["0.5", "x", "65"])
def test_bad_expert_imbalance_is_one_line_and_exit_2(capsys, value):
    err = _refused(capsys, ["--model", "tiny-moe", "--cluster", "dgx-h100:1", "--global-batch",
                            "8", "--seq-len", "64", "--expert-imbalance", value])
    assert "--expert-imbalance" in err


def test_selective_recompute_of_gathered_experts_is_refused_by_name(capsys):
    """Found by rehearsing: with ep the routed experts are an FSDP unit inside the checkpointed
    block, and where FSDP keeps them gathered (ZeRO-0/1/2, pipelines) torch 2.13's selective
    checkpoint fails in the replay; the validity function says so instead."""
    from meshtron.planner.plan_rules import plan_problems

    for knobs in ({"zero": 1}, {"zero": 2}, {"zero": 3, "pp": 2}):
        problems = plan_problems({"ep": 2, "recompute": "selective", **knobs})
        assert any("plan.recompute='selective' with plan.ep=2" in p for p in problems), knobs
    assert not plan_problems({"ep": 2, "recompute": "selective", "zero": 3})
    assert not plan_problems({"ep": 2, "recompute": "full", "zero": 1})
    _refused(capsys, ["--model", "tiny-moe", "--cluster", "dgx-h100:1", "--global-batch", "16",
                      "--seq-len", "128", "--layout", "dp=8,ep=2", "--zero", "1", "--recompute",
                      "selective"])


# one micro-batch per step without a pipeline under ZeRO-1/3 (estimate_gpipe._gpipe_ranks:
# each unit's gradient shard made after its backward, ZeRO-1's units resharded after it, the
# expert units too). Measured (2026-12-05, branch onembz), before -> after: ep 4 ZeRO-1 +4.3%
# -> -0.9%, full +12.0% -> -2.4%; ZeRO-3 +4.4% -> -1.2%, full +6.8% -> +1.0%; ds ep ZeRO-1
# +4.3% -> -0.6%; no ep ZeRO-3 +7.8% -> +1.7%, ZeRO-1 full +18.6% -> +2.2%
ONE_MB = {
    "ep zero-1, one micro-batch": (MOE, dict(ep=4, global_batch=16)),
    "ep zero-1 full, one micro-batch": (MOE, dict(ep=4, global_batch=16, recompute="full")),
    "ep zero-3, one micro-batch": (MOE, dict(ep=4, zero=3, global_batch=16)),
    "ep zero-3 full, one micro-batch": (MOE, dict(ep=4, zero=3, global_batch=16,
                                                  recompute="full")),
    "ds ep zero-1, one micro-batch": (DS, dict(ep=4, global_batch=16)),
    "zero-3 no ep, one micro-batch": (MOE, dict(zero=3, global_batch=16)),
    "zero-1 no ep full, one micro-batch": (MOE, dict(zero=1, global_batch=16,
                                                     recompute="full")),
}


@pytest.mark.slow
def test_one_microbatch_sharded_moe_agrees_with_rehearsal():
    check_totals(run_kinds(RUN_KINDS, [BASE, ONE_MB]), "rehearsal")
