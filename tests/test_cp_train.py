"""Context parallelism through the runtime (`parallelize`, `build_mesh`, `forward_backward`),
`meshtron train` and the plan's validity rules.

Default suite, one 4-rank gloo launch: cp=2 x dp=2 (FSDP ZeRO-3 over dp_shard x cp) with packed
documents crossing every chunk boundary on a Gemma-3-style windowed model (WINDOW_MODEL; its
global blocks run the plain document path), and cp=2 x tp=2 with sequence parallelism (ZeRO-2), train 2 AdamW steps each
(gradient clipping active; DEFAULT_STEPS_CFG: the second step is the first on parameters and
moments the optimizer wrote into each layout's shards, a third repeated it; session 53) and must give the single-process run's losses, gradient norms and
every parameter to 1e-5 relative (the sweep's tolerance, tests/test_parallel.py); the same
launch counts one step's collectives against the planner (FSDP2's: `step_collectives`;
attention's K/V all-gathers and reduce-scatters: counts and bytes). One 2-rank `meshtron train
--plan cp=2` of a windowed model with packed documents against one process, its doctor trace
showing the sliding block's halo exchange (window - 1 rows, not the whole sequence).
Slow: more compositions (the plain model with documents at cp=2 x dp=2; ZeRO-2 with micro-batches, full recomputation and documents; tp x cp
ZeRO-3 with selective recomputation and documents; cp=4; the windowed model under tp x cp and
at cp=4), a DCP checkpoint saved at cp=2 x dp=2 and resumed at cp=1 (dp=4 ZeRO-3, and tp=2 x
dp=2): the next step's loss and parameters equal continuing at cp=2; and `meshtron train
--plan tp=2,cp=2 --attention-mask document` against one process through the CLI, and the
command with a window reaching over two chunks. Refusals (no
ranks start): one line, exit 2.
"""

from __future__ import annotations

import json

import pytest

from meshtron.errors import UserError
from meshtron.planner.plan import Plan
from testkit.equivalence import (
    DEFAULT_CFG,
    GPT_MODEL,
    compare,
    format_report,
    layout_cfg,
    make_spec,
    parallel_rank_fn,
    reference_run,
)
from testkit.multiproc import run_on_ranks

TOL = 1e-5

WINDOW_MODEL = dict(name="equiv-window", sliding_window=3, window_every=2,
                    rope_local_theta=100.0)
"""Gemma 3's pattern on the 4 blocks: blocks 0 and 2 slide (a window of 3, shorter than a
cp=2 chunk of 4 tokens, under documents of 5 that cross the chunk borders) and rotate at a
RoPE base of their own; blocks 1 and 3 attend globally."""
LAYOUTS = [
    dict(cp=2, dp=2, zero=3, documents=True, model=WINDOW_MODEL),
    dict(cp=2, tp=2, sp=True, zero=2, micro_batch=4),
]
"""The default suite's layouts (one launch with the collective count). The windowed model's
global blocks run the plain document path, so the plain model with documents is slow only.
cp x tp runs 2 micro-batches of 4 rows (the first and last of the accumulation; 8 of one row
cost ~0.4 s each per rank in DTensor's CPU dispatch)."""
SLOW_LAYOUTS = [
    dict(cp=2, dp=2, zero=3, documents=True),
    dict(cp=2, dp=2, zero=2, micro_batch=2, recompute="full", documents=True),
    dict(cp=2, tp=2, sp=True, zero=3, recompute="selective", documents=True),
    dict(cp=4, zero=3),
    dict(cp=2, dp=2, zero=3),
    dict(cp=2, tp=2, sp=True, zero=2, model=WINDOW_MODEL),  # 11 s of the default launch
    dict(cp=4, zero=3, model=WINDOW_MODEL),  # chunks of 2 tokens, windows of 3
]
"""`make test-slow`: more compositions, with the DCP resume at cp=1."""
DEFAULT_STEPS_CFG = dict(DEFAULT_CFG, steps=2)
"""The default launch's cfg: DEFAULT_CFG with 2 steps (module docstring); the slow one keeps 3."""
SAVE = dict(cp=2, dp=2, zero=3)
RESUME = {"dp4": dict(dp=4, zero=3), "tp2dp2": dict(tp=2, dp=2, zero=3, sp=True)}


def _dcp_cp_to_cp1(cfg, ckpt_dir):
    """Train 2 steps at SAVE, save model + optimizer with DCP, take step 3; load the checkpoint
    into each RESUME layout (a different init, which the load must overwrite) and take step 3
    there. Returns the losses and worst parameter differences."""

    from meshtron.parallel.mesh import release_mesh
    from testkit.equivalence import build_parallel, dcp_load, dcp_save, make_data, train_step

    inputs, targets = make_data(cfg)

    def build(layout, seed):
        return build_parallel(cfg, layout, seed)

    def step(pm, opt, mesh, i):
        return train_step(pm, opt, mesh, cfg, (inputs[i], targets[i]))

    pm, opt, mesh = build(SAVE, cfg["seed"])
    for i in range(2):
        step(pm, opt, mesh, i)
    dcp_save(pm, opt, ckpt_dir)
    out = {"want_loss": step(pm, opt, mesh, 2)}
    want = pm.full_parameters()
    del pm, opt
    release_mesh(mesh)
    for name, layout in RESUME.items():
        pm2, opt2, mesh2 = build(layout, cfg["seed"] + 99)
        dcp_load(pm2, opt2, ckpt_dir)
        loss = step(pm2, opt2, mesh2, 2)
        got = pm2.full_parameters()
        out[name] = (loss, max(float((got[k] - want[k]).abs().max() / want[k].abs().max())
                               for k in want), sorted(got) == sorted(want))
        del pm2, opt2
        release_mesh(mesh2)
    return out


COUNT = dict(cp=2, dp=2, zero=3, micro_batch=2)
"""The layout whose second step's collectives are counted (2 micro-batches per step)."""


def _count_step(cfg):
    """Collectives of the second training step of COUNT on this rank, by (op, group, dtype):
    group "cp" (attention's K/V), "dp_shard_cp" (FSDP2), or the ranks; the loss and metric
    scalars are left out. Also the bytes of every cp collective's largest tensor."""
    from collections import Counter

    import torch
    import torch.distributed as dist

    from testkit.collective_mode import record_last_step
    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import release_mesh
    from testkit.equivalence import make_data

    inputs, targets = make_data(cfg)
    mesh = build_mesh(dict(COUNT), device_type="cpu")
    label = {tuple(dist.get_process_group_ranks(mesh["cp"].get_group())): "cp",
             tuple(dist.get_process_group_ranks(
                 mesh["dp_shard", "cp"]._flatten("dp_shard_cp").get_group())): "dp_shard_cp"}
    torch.manual_seed(cfg["seed"])
    pm = parallelize(Transformer(make_spec(cfg)), dict(COUNT), mesh)
    opt = build_optimizer(pm, lr=cfg["lr"])
    counted, cp_bytes = Counter(), Counter()
    rec = record_last_step(pm, opt, mesh, inputs, targets, 2)
    for rr in rec.snapshot():
        numel = max(int(torch.Size(sh).numel()) for sh in rr["shapes"])
        if numel <= 1:
            continue
        group = label.get(tuple(rec.groups[rr["group"]].ranks), "other")
        counted[(rr["op"], group)] += 1
        if group == "cp":
            cp_bytes[rr["op"]] += numel * 4
    del pm, opt
    release_mesh(mesh)
    return {"counts": dict(counted), "cp_bytes": dict(cp_bytes)}


def cp_rank_fn(cfg, layouts, ckpt_dir=None):
    out = {"layouts": parallel_rank_fn(cfg, layouts)}
    if ckpt_dir is None:
        out["collectives"] = _count_step(cfg)
    else:
        out["dcp"] = _dcp_cp_to_cp1(cfg, ckpt_dir)
    return out


def test_cp_layouts_match_one_process_and_count_collectives():
    results = run_on_ranks(cp_rank_fn, 4, DEFAULT_STEPS_CFG, LAYOUTS, timeout=600)
    _check_layouts(results, LAYOUTS, DEFAULT_STEPS_CFG)
    _check_collectives(results)


@pytest.mark.slow
def test_cp_more_layouts_and_resume_at_cp1(tmp_path):
    results = run_on_ranks(cp_rank_fn, 4, DEFAULT_CFG, SLOW_LAYOUTS, str(tmp_path / "ckpt"),
                           timeout=1200)
    _check_layouts(results, SLOW_LAYOUTS, DEFAULT_CFG)
    for r in results:
        d = r["dcp"]
        for name in RESUME:
            loss, diff, same_names = d[name]
            assert same_names, name
            assert abs(loss - d["want_loss"]) <= TOL * abs(d["want_loss"]), (name, loss, d)
            assert diff <= TOL, (name, diff)


def _check_layouts(results, layouts, cfg):
    """Every layout against the one-process run of `cfg` (the cfg the ranks trained)."""
    refs: dict[tuple, dict] = {}

    def reference(layout):
        key = (bool(layout.get("documents")), bool(layout.get("model")))
        if key not in refs:
            refs[key] = reference_run(layout_cfg(cfg, layout)[0])
        return refs[key]

    report = compare(reference, [r["layouts"] for r in results])
    print("\n" + format_report(report))
    bad = [r for r in report if r["missing"] or r["extra"]
           or max(r["loss_rel"], r["norm_rel"], r["param_rel"]) > TOL]
    assert len(report) == len(layouts) and not bad, format_report(bad)
    # documents and windows change the loss: such layouts were compared with their own run
    for docs, window in list(refs):
        if docs:
            assert refs[docs, window]["losses"] != reference(
                dict(model=WINDOW_MODEL) if window else {})["losses"]
        if window:
            assert refs[docs, window]["losses"] != reference(dict(documents=docs))["losses"]


def _check_collectives(results):
    """The counted step equals the planner: FSDP2's collectives on dp_shard x cp are what
    `step_collectives` says (its "dp_shard" axis spans dp x cp ranks); attention's are, per
    micro-batch and layer, an all-gather of K and one of V in forward and a reduce-scatter of
    each in backward (the planner prices the same bytes as one all-gather and one
    reduce-scatter of K and V together per layer: compute.layer_cost)."""
    from collections import Counter

    from meshtron.planner.collectives import step_collectives

    spec = make_spec(DEFAULT_CFG)
    plan = Plan(**COUNT, global_batch=DEFAULT_CFG["batch"], seq_len=DEFAULT_CFG["seq"])
    m = DEFAULT_CFG["batch"] // (plan.dp * plan.micro_batch)
    want: Counter = Counter()
    for c in step_collectives(plan, spec, plan.global_batch, plan.seq_len):
        assert c.axis == "dp_shard" and c.group_size == 4, c
        want[({"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
              [c.kind], "dp_shard_cp")] += c.count
    want[("all_gather_into_tensor", "cp")] = 2 * spec.layers * m
    want[("reduce_scatter_tensor", "cp")] = 2 * spec.layers * m
    # [rows/m, kv_heads, seq, head_dim] fp32: the gathered K or V (the reduce-scatter's
    # input); the all-gather's input is this rank's 1/cp of it
    kv = DEFAULT_CFG["batch"] // (plan.dp * m) * spec.kv_heads * DEFAULT_CFG["seq"] * \
        spec.head_dim * 4
    for r in results:
        assert Counter(r["collectives"]["counts"]) == want, r["collectives"]
        assert r["collectives"]["cp_bytes"] == {
            "all_gather_into_tensor": 2 * spec.layers * m * kv // plan.cp,
            "reduce_scatter_tensor": 2 * spec.layers * m * kv}, r["collectives"]


# ---- refusals: the one validity function (no processes) -------------------------------------
SPEC = make_spec(DEFAULT_CFG)


@pytest.mark.parametrize("kw, world, model, match", [
    (dict(cp=2, pp=2), 4, None, r"^plan.cp=2 with plan.pp=2: .*use pp=1$"),
    (dict(cp=2, dp=2, zero=1), 4, None, r"^plan.zero=1 with plan.cp=2: .*use zero 2 or 3$"),
    (dict(cp=2, dp=2, zero=0), 4, None, r"^plan.zero=0 with plan.cp=2"),
    (dict(cp=2, dp=2, zero=2, grad_compression="int8"), 4, None,
     r"^plan.cp=2: gradient compression and DiLoCo"),
    (dict(cp=2, zero=3), 2, GPT_MODEL, r"^plan.cp=2: model equiv-gpt has 'learned' position"),
    (dict(cp=2, zero=3, seq_len=18), 2, None, r"^plan.cp=2: seq_len=18 must be divisible by 2\*cp=4"),
])
def test_cp_refusals_are_one_line(kw, world, model, match):
    spec = make_spec(dict(DEFAULT_CFG, spec=dict(DEFAULT_CFG["spec"], **model))) if model \
        else SPEC
    with pytest.raises(UserError, match=match) as e:
        Plan(**kw).validate(world, spec)
    assert "\n" not in str(e.value)


def test_cp_runs_and_is_searched():
    """The plans that run validate; meshtron's own search (runtime limits on) now tries cp."""
    for kw in (dict(cp=2, dp=2, zero=3), dict(cp=2, tp=2, sp=True, zero=2), dict(cp=4, zero=2)):
        Plan(**kw).validate(4, SPEC)
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.search import search_plans
    from meshtron.model.spec import PRESETS

    # 128k tokens of Llama 3 8B on 8 H100s: without cp only tp*pp can split the activations
    res = search_plans(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:1"), 8, 131072,
                       {}, top_k=20, explain=False)
    plans = [e.config for e in res.plans]
    assert plans and any(p.cp > 1 for p in plans), [p.describe() for p in plans]
    for p in plans:  # every plan the search returns runs: the runtime's rules applied
        if p.cp > 1:
            assert p.pp == 1 and p.zero >= 2, p.describe()


# ---- `meshtron train` ------------------------------------------------------------------------
RUN = ["--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch", "4",
       "--eval-every", "0", "--log-every", "1"]


@pytest.mark.parametrize("plan, extra, needle", [
    ("cp=2,pp=2", [], "plan.cp=2 with plan.pp=2: meshtron's runtime does not run context"),
    ("cp=2,dp=2", ["--zero", "1"], "plan.zero=1 with plan.cp=2"),
    ("cp=3", ["--nproc", "3"], "plan.cp=3: seq_len=32 must be divisible by 2*cp=6"),
    ("cp=2,dp=2", ["--set", "model.position=learned"], "position embeddings"),
])
def test_train_refuses_what_cp_does_not_run(capsys, tmp_path, plan, extra, needle):
    from meshtron.cli import main

    nproc = [] if "--nproc" in extra else ["--nproc", "4"]
    code = main(["train", *nproc, "--plan", plan, *RUN, *extra, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "r").exists()


def _metrics(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _short_documents(tmp_path):
    """A .jsonl of 200 documents of 5 to 20 bytes (the debug model's byte tokens): several per
    32-token sequence, crossing the chunk borders. The default corpus (the stdlib's files) has
    no end of document inside a 3-step run, so with it `--attention-mask document` trains
    exactly as causal (measured: bit-equal losses) and a document test checks nothing."""
    import json
    import random

    rng = random.Random(0)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh ")
                                                        for _ in range(rng.randint(5, 20)))})
                            + "\n" for _ in range(200)))
    return ["--data", str(data)]


@pytest.mark.slow
def test_train_cli_tp2_cp2_with_documents_equals_one_process(tmp_path):
    """`meshtron train --plan tp=2,cp=2 --attention-mask document` on 4 gloo ranks logs the
    single-process run's losses and gradient norms (fp32), on short packed documents; the
    causal run in this process shows that the documents change the losses."""
    import os
    import subprocess
    import sys

    from meshtron.cli import main

    env = dict(os.environ, OMP_NUM_THREADS="1")
    data = _short_documents(tmp_path)
    rows = {}
    for name, args in (("one", ["--nproc", "1"]), ("cp", ["--nproc", "4", "--plan", "tp=2,cp=2"])):
        out = subprocess.run([sys.executable, "-m", "meshtron", "train", *args, *RUN, *data,
                              "--attention-mask", "document", "--run-dir", str(tmp_path / name)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        rows[name] = _metrics(tmp_path / name)
    assert main(["train", *RUN, *data, "--run-dir", str(tmp_path / "causal")]) == 0
    assert len(rows["one"]) == len(rows["cp"]) == 3
    for a, b in zip(rows["one"], rows["cp"]):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (key, a, b)
    causal = _metrics(tmp_path / "causal")
    assert causal[-1]["loss"] != pytest.approx(rows["one"][-1]["loss"], rel=1e-4)


WINDOW_RUN = [*RUN, "--set", "model.sliding_window=6", "--set", "model.window_every=2",
              "--set", "model.rope_local_theta=100.0"]
"""Gemma 3's pattern on the debug model: block 0 slides (a window of 6, shorter than a cp=2
chunk of 8 tokens) at a RoPE base of its own, block 1 attends globally."""


def test_train_cli_cp2_window_with_documents_equals_one_process(tmp_path):
    """`meshtron train --nproc 2 --plan cp=2 --attention-mask document` of a windowed model
    (refused before: a plan rule, and packed documents with a window at train) logs the
    single-process run's losses and gradient norms (fp32); the one-process runs in this
    process show that the window and the documents each change the losses."""
    docs = [*_short_documents(tmp_path), "--attention-mask", "document"]
    runs = {"cp": ["--nproc", "2", "--plan", "cp=2", *WINDOW_RUN, *docs],
            "one": ["--nproc", "1", *WINDOW_RUN, *docs],
            "causal": ["--nproc", "1", *WINDOW_RUN, *_short_documents(tmp_path)],
            "no_window": ["--nproc", "1", *RUN, *docs]}
    rows = _cp_run_equals_one_process(tmp_path, runs)
    for other in ("causal", "no_window"):
        assert rows[other][-1]["loss"] != pytest.approx(rows["one"][-1]["loss"], rel=1e-4)
    # the sliding block exchanged only the window - 1 = 5 rows before each chunk (none before
    # rank 0's chunk 0; rank 1's chunk b = 2 follows its own chunk 1), K and V side by side,
    # instead of all-gathering the sequence: the run's own collective records (meshtron
    # doctor's trace; forward receives, backward returns the sent rows' gradients)
    _check_halo_trace(tmp_path / "cp", {0: {5}, 1: {5}})


def _cp_run_equals_one_process(tmp_path, runs: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Each of `runs` through `meshtron train` in its own run folder; run "cp" has the losses
    and gradient norms of run "one" (fp32, 3 steps). Returns every run's metrics lines."""
    from meshtron.cli import main

    rows = {}
    for name, args in runs.items():
        assert main(["train", *args, "--run-dir", str(tmp_path / name)]) == 0, name
        rows[name] = _metrics(tmp_path / name)
    assert len(rows["one"]) == len(rows["cp"]) == 3
    for a, b in zip(rows["one"], rows["cp"]):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (key, a, b)
    return rows


def _check_halo_trace(run, rows: dict[int, set[int]]) -> None:
    """The cp all_to_alls in each rank's doctor trace moved `rows[rank]` rows (the first
    dimensions of their outputs), K and V of the debug model side by side."""
    for rank, rows_moved in rows.items():
        trace = json.loads((run / "trace" / f"rank_{rank}.json").read_text())
        halos = {tuple(r["shapes"][0]) for r in trace["records"]
                 if r["op"] == "all_to_all_single" and r["axis"] == "cp"}
        assert halos == {(n, 4, 2, 32) for n in rows_moved}, (rank, halos)  # batch, kv heads


WIDE_WINDOW_RUN = [*RUN, "--set", "model.sliding_window=12", "--set", "model.window_every=2",
                   "--set", "model.rope_local_theta=100.0"]
"""Block 0 slides in a window of 12: its 11 rows before a query reach into two cp=2 chunks of
8 tokens."""


# Slow (suite time, session 56): test_train_cli_cp2_window_with_documents_equals_one_process keeps
# the command's cp=2 halo path (windowed model, packed documents, the trace's rows) default;
# windows reaching over two and three chunks against one process, with the rows the halo moved:
# tests/test_context_parallel.py::test_context_parallel_matches_one_process (cp=2 and cp=4).
@pytest.mark.slow
def test_train_cli_cp2_window_over_two_chunks_equals_one_process(tmp_path):
    """`meshtron train --nproc 2 --plan cp=2` of a model whose window reaches past the previous
    chunk (window - 1 = 11 > c = 8), packed documents: the single-process run's losses and
    gradient norms (fp32), and the sliding block's halo exchange moved only the rows its
    queries see: rank 0 (chunks 0, 3) receives rows 13..23 (11: chunks 1 and 2 of rank 1)
    and sends chunk 0 (8 rows: rank 1's chunk 1 sees all of it; its chunk 2's rows 5..15 lie
    in chunk 0 and in its own chunk 1, each laid out once)."""
    docs = [*_short_documents(tmp_path), "--attention-mask", "document"]
    runs = {"cp": ["--nproc", "2", "--plan", "cp=2", *WIDE_WINDOW_RUN, *docs],
            "one": ["--nproc", "1", *WIDE_WINDOW_RUN, *docs]}
    _cp_run_equals_one_process(tmp_path, runs)
    _check_halo_trace(tmp_path / "cp", {0: {11, 8}, 1: {8, 11}})
