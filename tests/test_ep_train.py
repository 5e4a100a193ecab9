"""Expert parallelism from a plan (`ep` in the Plan, the placement's mesh and `parallelize`)
against one process, on real gloo process groups.

Each layout trains STEPS AdamW steps of a small MoE (both router kinds: softmax top-2 with the
auxiliary loss, as Mixtral; DeepSeek-V3's sigmoid, group-limited, shared expert, first block
dense) through `testkit.equivalence.parallel_rank_fn`, the sweep every other layout
passes: losses, gradient norms and every parameter (experts gathered from their ep x FSDP
shards) must equal the single-process run on the same seed and data within its fp32 tolerance.
The reference uses the plan's micro-batch (the auxiliary loss is per micro-batch in both).

Default suite: one 4-rank launch with ep=2 x dp=4 (ZeRO-3: experts FSDP-sharded over
dp_shard_mod_ep = 2, sigmoid router) and the DCP resharding below; the doctor's skipped
all-to-all; the bad-input rules. Slow: the rest of the grid (ep=2 x tp=2 with and without sequence
parallelism, ep=4 ZeRO-2 and ZeRO-3, HSDP, recomputation full/selective, both router kinds
everywhere; ZeRO-0/1 with ep=4 (no expert replicas) and with tp=2), and DCP from ZeRO-3 ep=2 into
ZeRO-1 ep=2 and ZeRO-0 ep=4. Pipelines with ep, and the default check of ep=2 x dp=4 under
ZeRO-0 / ZeRO-1 (with the planner's collectives): tests/test_ep_pp.py.
Bad input: ep not dividing the experts or the ranks, ep on a dense model: one line, exit 2.
"""

from __future__ import annotations

import sys

import pytest

from testkit.equivalence import DEFAULT_CFG, compare, format_report, layout_cfg, \
    parallel_rank_fn, reference_run
from testkit.multiproc import run_on_ranks

TOL = 1e-5
TIMEOUT = 600
MICRO = 1
CFG = dict(DEFAULT_CFG, micro_batch=MICRO)
SOFTMAX = dict(name="equiv-moe", moe_experts=8, moe_top_k=2, moe_ffn_hidden=32,
               moe_aux_loss=0.01)
SIGMOID = dict(name="equiv-moe-ds", moe_experts=8, moe_top_k=2, moe_ffn_hidden=32,
               moe_shared_experts=1, moe_dense_layers=1, moe_router="sigmoid", moe_groups=4,
               moe_topk_groups=2, moe_route_scale=2.5, moe_bias_update=1e-3)


def _layout(model, **kw):
    return {"model": model, "micro_batch": MICRO, "zero": 3, **kw}


LAYOUTS = [
    _layout(SIGMOID, dp=4, ep=2),
]
SLOW_LAYOUTS = [
    _layout(SOFTMAX, dp=2, ep=2, tp=2, sp=True),
    _layout(SIGMOID, dp=4, ep=4, zero=2),
    _layout(SOFTMAX, dp=4, ep=2),
    _layout(SIGMOID, dp=2, ep=2, tp=2, sp=True),
    _layout(SIGMOID, dp=2, ep=2, tp=2),
    _layout(SOFTMAX, dp=4, ep=4),
    _layout(SIGMOID, dp=4, ep=2),
    _layout(SOFTMAX, dp=4, ep=2, dp_replicate=2),
    _layout(SIGMOID, dp=4, ep=4, recompute="full"),
    _layout(SOFTMAX, dp=4, ep=2, recompute="selective"),
    _layout(SOFTMAX, dp=2, ep=2, zero=2, tp=2, recompute="full"),
    _layout(SIGMOID, dp=4, ep=4, zero=0),
    _layout(SOFTMAX, dp=4, ep=4, zero=1),
    _layout(SOFTMAX, dp=2, ep=2, zero=0, tp=2, sp=True),
    _layout(SIGMOID, dp=2, ep=2, zero=1, tp=2),
]


DCP_TARGETS = ((4, 3), (1, 3))
"""(ep, zero) the default launch loads its ZeRO-3 ep=2 checkpoint into."""


def _check(layouts, ckpt_dir=None, targets=DCP_TARGETS):
    refs: dict = {}

    def ref_for(layout):
        cfg, _ = layout_cfg(CFG, layout)
        key = cfg["spec"]["name"]
        if key not in refs:
            refs[key] = reference_run(cfg)
        return refs[key]

    if ckpt_dir is None:
        results = run_on_ranks(parallel_rank_fn, 4, CFG, layouts, timeout=TIMEOUT)
    else:
        ranks = run_on_ranks(ep_dcp_rank_fn, 4, CFG, layouts, ckpt_dir, targets,
                             timeout=TIMEOUT)
        results = [r["sweep"] for r in ranks]
        for r in ranks:
            for target in targets:
                loss, diff, same_names = r[target]
                assert same_names, target
                assert abs(loss - r["want_loss"]) <= TOL * abs(r["want_loss"]), (target, r)
                assert diff <= TOL, (target, r)
    report = compare(ref_for, results)
    print(format_report(report))
    bad = [r for r in report if r["missing"] or r["extra"]
           or max(r["loss_rel"], r["norm_rel"], r["param_rel"]) > TOL]
    assert not bad, f"layouts off the single-process run by more than {TOL}:\n" + \
        format_report(bad)


def test_ep_layouts_match_one_process_and_dcp_reshards_across_ep(tmp_path):
    _check(LAYOUTS, str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_ep_layouts_match_one_process_slow():
    _check(SLOW_LAYOUTS)


@pytest.mark.slow
def test_ep_dcp_resumes_across_zero_stages(tmp_path):
    """The ZeRO-3 ep=2 checkpoint resumed under ZeRO-1 ep=2 (experts' optimizer states sharded
    over dp_mod_ep) and ZeRO-0 ep=4 (replicated): the same step 3."""
    _check([], str(tmp_path / "ckpt"), targets=((2, 1), (4, 0)))


@pytest.mark.parametrize("layout, match", [
    ("ep=3,dp=3", r"^plan.ep=3: must divide the model's 8 routed experts"),
    ("ep=4,dp=2", r"^plan.ep=4: must divide the data x context ranks it is folded over"),
])
def test_bad_ep_is_one_line(layout, match):
    from meshtron.errors import UserError
    from meshtron.model.spec import PRESETS
    from meshtron.planner.plan import Plan, parse_layout

    kw = parse_layout(layout)
    with pytest.raises(UserError, match=match):
        plan = Plan(**{"tp": 1, "pp": 1, "zero": 3, "micro_batch": 1, "recompute": "none",
                       "sp": False, "schedule": None, "virtual_stages": 1, **kw})
        plan.validate(plan.gpus, PRESETS["tiny-moe"])


def test_bad_ep_rules():
    from meshtron.model.spec import PRESETS
    from meshtron.planner.plan_rules import plan_problems

    moe, dense = PRESETS["tiny-moe"], PRESETS["tiny"]
    base = dict(tp=1, pp=1, dp=2, zero=3, ep=2)
    assert plan_problems(base, 2, moe) == []
    assert plan_problems(dict(base), 2, dense)[0].startswith(
        "plan.ep=2: expert parallelism needs a mixture-of-experts model")
    for zero in (0, 1):  # issue 21: ep folds over dp_replicate (parallel/mesh.py ExpertMeshes)
        assert plan_problems(dict(base, zero=zero), 2, moe) == []
        assert plan_problems(dict(base, zero=zero, dp=4), 4, moe) == []
    assert plan_problems(dict(base, dp=2, cp=2, ep=3), 4, moe)[0].startswith("plan.ep=3")
    assert plan_problems(dict(base, pp=2), 4, moe) == []  # ep in a pipeline runs


def test_cli_refuses_bad_ep_in_one_line(capsys, tmp_path):
    # The command's entry point in this process: the refusal comes before any rank starts, so
    # a child process would only add a torch import.
    from meshtron.cli import main

    capsys.readouterr()
    code = main(["train", "--model", "tiny-moe", "--plan", "ep=3,dp=3", "--nproc", "3",
                 "--global-batch", "12", "--steps", "1", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "plan.ep=3: must divide the model's 8 routed experts" in lines[0]


def ep_dcp_rank_fn(cfg, layouts, ckpt_dir, loads=DCP_TARGETS):
    """The equivalence layouts, then DCP across ep sizes: train 2 steps at ep=2 x dp=4
    (ZeRO-3), save model + optimizer, take step 3; load the checkpoint into each (ep, zero) of
    `loads` (a fresh, differently seeded model each) and take the same step 3: losses and
    every parameter must match continuing at ep=2 (the expert weights are DTensors sharded on
    the expert dimension, so DCP reshards them)."""

    from testkit.equivalence import build_parallel, dcp_load, dcp_save, make_data, train_step

    out = {"sweep": parallel_rank_fn(cfg, layouts)}
    cfg, _ = layout_cfg(cfg, {"model": SIGMOID})
    inputs, targets = make_data(cfg)

    def build(ep, seed, zero=3):
        return build_parallel(cfg, dict(dp=4, zero=zero, ep=ep, micro_batch=MICRO), seed)

    def step(pm, opt, mesh, i):
        return train_step(pm, opt, mesh, cfg, (inputs[i], targets[i]))

    pm, opt, mesh = build(2, cfg["seed"])
    for i in range(2):
        step(pm, opt, mesh, i)
    dcp_save(pm, opt, ckpt_dir)
    out["want_loss"] = step(pm, opt, mesh, 2)
    want = pm.full_parameters()
    for ep, zero in loads:
        pm2, opt2, mesh2 = build(ep, cfg["seed"] + 99, zero)  # another init: overwritten
        dcp_load(pm2, opt2, ckpt_dir)
        loss = step(pm2, opt2, mesh2, 2)
        got = pm2.full_parameters()
        diff = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-2))
                   for k in want)
        out[(ep, zero)] = (loss, diff, sorted(got) == sorted(want))
    return out


def test_doctor_names_a_skipped_all_to_all(tmp_path):
    """One rank of an ep pair skips its MoE forward (tests/doctor_faults.py): the doctor names
    it, the collective (the dispatcher's counts all-to-all), its kind, the ep group and the
    sizes the waiting rank sent."""
    from pathlib import Path

    from meshtron.diagnose.analyze import diagnose
    from meshtron.diagnose.trace import load_trace
    from testkit.multiproc import RankError, RankTimeout

    sys.path.insert(0, str(Path(__file__).parent))
    import doctor_faults

    with pytest.raises((RankError, RankTimeout)):
        run_on_ranks(doctor_faults.skipped_all_to_all, 4, str(tmp_path), timeout=90,
                     backend="recorded")
    d = diagnose(load_trace(tmp_path))
    assert d.kind == "never_entered" and d.culprit_ranks == [3], d.to_dict()
    assert d.verdict.startswith("rank 3 (dp=1, ep=1) never entered all_to_all_single #"), \
        d.verdict
    assert "on the expert-parallel group [2, 3]" in d.verdict, d.verdict
    op = d.divergence["ops"]["2"]
    assert op["op"] == "all_to_all_single" and op["dtypes"] == ["int64", "int64"]
    assert op["shapes"] == [[2, 4], [2, 4]]  # [ep, experts/ep] counts out and in
