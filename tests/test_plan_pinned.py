"""A layout the user pinned is answered even when it is predicted not to fit (issue 30).

Through `meshtron plan` (main(), as the command line runs it): Llama 3 405B's published 4D
layout on 1,024 DGX H100 nodes at no recomputation, which meshtron's runtime is predicted to
overfill, is priced (exit 0, fits false, a warning, the cheapest change that fits) on the layer
split a fitting plan gets (time-balanced), not the memory-minimising one; a layout the knobs
leave open stays a one-line refusal; --save of the non-fitting plan writes nothing. What pins a
layout: the search space holds exactly one (planner/pinned.py `layout_pinned`).
"""

from __future__ import annotations

import json
import re

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.frameworks import preset, resolve, with_options
from meshtron.planner.pinned import layout_pinned
from meshtron.planner.search import search_plans
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

L405 = ("--model", "llama3-405b", "--cluster", "dgx-h100:1024", "--global-batch", "2048",
        "--seq-len", "8192")
PINNED = (*L405, "--layout", "tp=8,cp=1,pp=16,dp=64", "--zero", "1", "--sp", "on",
          "--recompute", "none", "--micro-batch", "1", "--schedule", "interleaved")
SMALL_HOST = ('gpu = "H100"\ngpus_per_node = 8\nnodes = 1\nintra_node_gb_per_s = 450\n'
              'inter_node_gb_per_s = 50\nhost_memory_gib = 512\n')


@pytest.fixture
def cli(plan_cli):
    return plan_cli


@pytest.fixture(scope="module")
def pinned_doc():
    """`meshtron plan ... --json` of the pinned 405B layout: (rc, document, stderr)."""
    import contextlib
    import io

    import meshtron.cli as top

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = top.main(["plan", *PINNED, "--json"])
    return rc, json.loads(out.getvalue()), err.getvalue()


def test_pinned_layout_that_does_not_fit_is_priced(pinned_doc):
    rc, doc, err = pinned_doc
    assert rc == 0
    assert doc["fits"] is False and doc["pinned"] is True and len(doc["plans"]) == 1
    plan = doc["plans"][0]
    assert (plan["tp"], plan["cp"], plan["pp"], plan["dp"]) == (8, 1, 16, 64)
    assert (plan["zero"], plan["recompute"], plan["micro_batch"], plan["sp"]) == (1, "none", 1,
                                                                                   True)
    assert plan["fits"] is False and plan["schedule"] == "interleaved"
    mem = plan["memory_gib"]
    assert mem["total"] > mem["capacity"] == pytest.approx(80.0)
    # priced: a step, its throughput and its MFU, consistent with each other
    assert plan["step_time_s"] > 0 and 0 < plan["mfu"] < 1
    assert plan["tokens_per_s"] == pytest.approx(2048 * 8192 / plan["step_time_s"], rel=1e-6)
    # the warning: once on stderr (stdout stays JSON), and in the document; it states the
    # memory of the split priced and, lower, the least any split of this config needs
    assert err.count("\n") == 1 and err.startswith("warning: predicted not to fit: needs ")
    assert doc["warnings"] == [err.strip().removeprefix("warning: ")]
    assert f"{mem['total']:.1f} GiB per GPU > 80 GiB" in err
    lean = doc["near_miss"]["memory_gib"]["total"]
    assert lean < mem["total"] and f"at least {lean:.1f} GiB on the layer split" in err
    # meshtron's own runtime short of GPU memory: the rehearsal's word applies
    assert "within 5% of a rehearsal of meshtron's runtime; `--rehearse` checks" in err
    # the search's count includes the re-pricing and the searches for a change that fits
    assert doc["evaluated"] > 4


def test_pinned_plan_is_priced_on_the_time_balanced_split(pinned_doc):
    # the review's finding: the near miss's memory-minimising split ([6, 6, 7, ..., 10, 10])
    # inflated the step by 27%; the pinned plan must cost what the search costs a candidate
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    _, doc, _ = pinned_doc
    p = doc["plans"][0]
    fw = resolve(None, None)
    cfg = Plan.trusted(p["tp"], p["pp"], p["dp"], p["zero"], p["micro_batch"], p["recompute"],
                       p["sp"], p["schedule"], p["virtual_stages"], p["dtype"],
                       p["dp_replicate"], p["cp"], p["reduce_dtype"],
                       p["accumulate_unsharded"], p["ep"], offload=p["offload"])
    ev = Evaluator(PRESETS["llama3-405b"], resolve_cluster("dgx-h100:1024"), 2048, 8192,
                   fw.kernel, mem=fw.memory)
    timed = ev.evaluate(cfg, exact_memory=False)
    lean = ev.evaluate(cfg)  # the split that needs the least memory
    assert p["step_time_s"] == pytest.approx(timed.step_time_s, rel=1e-9)
    assert p["stage_layers"] == list(timed.stage_layers)
    assert p["memory_gib"]["total"] == pytest.approx(timed.memory.total, rel=1e-9)
    # and that is a different, faster answer than the memory-minimising split's
    assert lean.step_time_s > 1.1 * timed.step_time_s
    assert doc["near_miss"]["step_time_s"] == pytest.approx(lean.step_time_s, rel=1e-9)


def test_pinned_layout_names_the_cheapest_change_that_fits(pinned_doc):
    _, doc, err = pinned_doc
    change, plan = doc["fit_change"], doc["plans"][0]
    assert change is not None
    # the same layout, one knob the user fixed changed, fitting, and slower than the pinned plan
    assert [change[k] for k in ("tp", "cp", "pp", "dp")] == [8, 1, 16, 64]
    assert change["fits"] is True
    assert change["memory_gib"]["total"] <= change["memory_gib"]["capacity"]
    fixed = {"recompute": "none", "zero": 1, "micro_batch": 1, "sp": True}
    moved = [k for k, v in fixed.items() if change[k] != v]
    assert len(moved) == 1 and list(change["fixed_changed"]) == moved
    assert change["fixed_changed"][moved[0]] == [fixed[moved[0]], change[moved[0]]]
    # what the user left open (the interleaved schedule's virtual stages) is labelled apart
    for name, (old, new) in change["searched_changed"].items():
        assert name not in fixed and plan[name] == old and change[name] == new
    assert f"{moved[0]}={change[moved[0]]} (fixed: " in change["change"]
    # the printed change in step time: signed, vs the pinned plan, and a slowdown here (the
    # pinned plan keeps everything in memory; fitting costs recomputation)
    pct = float(re.search(r"s per step, ([+-][0-9.]+)% vs the pinned plan", err).group(1))
    assert pct == pytest.approx((change["step_time_s"] / plan["step_time_s"] - 1) * 100,
                                abs=0.06)
    assert pct > 0 and f"to fit: {change['change']} (" in err


def test_pinned_layout_text_marks_the_plan(cli):
    rc, out, err = cli(*PINNED)
    assert rc == 0 and err == ""
    assert "PREDICTED NOT TO FIT" in out and out.count("Warning: predicted not to fit") == 1
    assert ">80" in out and "host>" not in out  # the memory column: GPU over capacity
    assert "Pinned plan: step" in out and "Best plan" not in out


@pytest.fixture
def host_bound(tmp_path) -> tuple[str, ...]:
    """llama3-70b on 8 H100 fits only with host offload, and 512 GiB of host memory per node
    cannot take it: the GPUs fit (16.7 of 80 GiB), the host does not."""
    cl = tmp_path / "small-host.toml"
    cl.write_text(SMALL_HOST)
    return ("--model", "llama3-70b", "--cluster", str(cl), "--global-batch", "16",
            "--seq-len", "4096", "--layout", "tp=1,pp=1,dp=8")


def test_host_memory_shortfall_is_marked_apart(cli, host_bound):
    args = host_bound
    rc, out, _ = cli(*args, "--json")
    doc = json.loads(out)
    plan = doc["plans"][0]
    mem = plan["memory_gib"]
    assert rc == 0 and doc["pinned"] is True and plan["offload"] == "full"
    assert mem["total"] <= mem["capacity"] and mem["host"] > mem["host_capacity"]
    (warning,) = doc["warnings"]
    assert f"needs {mem['host']:.1f} GiB of host memory per node" in warning
    assert "rehearsal" not in warning  # the rehearsal checks GPU memory, not the host's
    rc, out, _ = cli(*args)
    cell = f"{mem['total']:.1f}/80 host>"
    assert rc == 0 and cell in out and f"{mem['total']:.1f}>80" not in out
    assert "'host>' is a plan whose GPUs fit" in out


def test_no_fitting_change_is_said_truthfully(cli, host_bound, tmp_path):
    # the host-bound layout: no value of any knob fits it, so there is no change to name
    args = host_bound
    rc, out, _ = cli(*args, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["fit_change"] is None
    assert doc["warnings"][0].endswith("no value of recompute, zero, micro-batch, sp, schedule "
                                       "or offload fits this layout: change the layout")
    path = tmp_path / "plan.toml"
    rc, out, err = cli(*args, "--save", str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1 and not path.exists()
    assert err.strip().endswith("no value of the fixed knobs fits this layout: change the "
                                "layout or drop --save")


def test_pinned_moe_layout_through_the_cli(cli):
    # Mixtral 8x7B on one node at pp=8: dp x cp = 1 leaves ep = 1, and mixtures of experts
    # keep tp = 1 unless fixed, so `--layout pp=8` pins it; it does not fit at any knobs
    rc, out, err = cli("--model", "mixtral-8x7b", "--cluster", "dgx-h100:1", "--global-batch",
                       "64", "--seq-len", "4096", "--layout", "pp=8", "--json")
    doc = json.loads(out)
    plan = doc["plans"][0]
    assert rc == 0 and doc["pinned"] is True and plan["fits"] is False
    assert [plan[k] for k in ("tp", "cp", "pp", "dp", "ep")] == [1, 1, 8, 1, 1]
    assert plan["memory_gib"]["total"] > 80 and plan["step_time_s"] > 0
    assert doc["fit_change"] is None and err.count("\n") == 1


def test_moe_with_open_expert_parallelism_still_refuses(cli):
    # Qwen3 235B on two nodes at pp=8: dp = 2, so ep may be 1 or 2: open, refused; ep given:
    # pinned and priced
    base = ("--model", "qwen3-235b-a22b", "--cluster", "dgx-h100:2", "--global-batch", "64",
            "--seq-len", "4096", "--json", "--layout")
    rc, out, _ = cli(*base, "pp=8")
    doc = json.loads(out)
    assert rc == 2 and doc["pinned"] is False and doc["plans"] == []
    rc, out, _ = cli(*base, "pp=8,ep=2")
    doc = json.loads(out)
    assert rc == 0 and doc["pinned"] is True and doc["plans"][0]["ep"] == 2


def test_unpinned_search_that_finds_nothing_still_refuses(cli):
    # pp=8 on two DGX A100 nodes: tp (1 or 2, with dp 2 or 1) and cp are the search's, and
    # nothing it may pick fits
    unpinned = ("--model", "llama3-405b", "--cluster", "dgx-a100:2", "--global-batch", "64",
                "--seq-len", "8192", "--layout", "pp=8")
    rc, out, err = cli(*unpinned)
    assert rc == 2 and err.count("\n") == 1 and "fits on no layout" in err
    assert "needs at least" in err and "Nothing fits" in out and "Traceback" not in err
    rc, out, _ = cli(*unpinned, "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["fits"] is False and doc["pinned"] is False and doc["plans"] == []
    assert doc["near_miss"] is not None and doc["near_miss"]["fits"] is False


def test_save_of_a_pinned_plan_that_does_not_fit_refuses(cli, tmp_path):
    path = tmp_path / "plan.toml"
    rc, out, err = cli(*PINNED, "--save", str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert f"save={str(path)!r}: not saved, the plan is predicted not to fit" in err
    assert "fix the change that fits (recompute=" in err and err.strip().endswith("drop --save")
    assert not path.exists()


def _layouts(model: str, cluster: str, knobs: dict, framework=None, batch: int = 64,
             seq: int = 4096):
    return search_plans(PRESETS[model], resolve_cluster(cluster), batch, seq,
                        {"recompute": "full", "micro_batch": 1, **knobs}, top_k=1,
                        explain=False, framework=framework)


def test_pinned_means_one_layout_left_to_the_search():
    # dense: pp=8 on 8 GPUs leaves tp = dp = cp = 1 (one layout) however few axes were typed
    one = _layouts("llama3-8b", "dgx-h100:1", {"pp": 8})
    assert one.layouts == ((1, 1, 8, 1, 1),) and layout_pinned(one)
    # tp=2 on 16 GPUs: pp (and with it dp) left open
    open_ = _layouts("llama3-8b", "dgx-h100:2", {"tp": 2})
    assert {lay[2] for lay in open_.layouts} >= {1, 2, 4} and not layout_pinned(open_)
    # tp=8, cp=1, pp=16 on 1,024 nodes: the GPU count forces dp = 64
    forced = _layouts("llama3-405b", "dgx-h100:1024", {"tp": 8, "cp": 1, "pp": 16, "zero": 1,
                                                         "sp": True, "schedule": "1f1b"},
                      batch=2048, seq=8192)
    assert forced.layouts == ((8, 1, 16, 64, 1),) and layout_pinned(forced)
    # a mixture of experts: ep folds over dp x cp; 1 when that is 1, open when it is not
    moe = _layouts("tiny-moe", "dgx-h100:1", {"tp": 1, "pp": 4, "cp": 1}, seq=256)
    assert moe.layouts == ((1, 1, 4, 2, 1), (1, 1, 4, 2, 2)) and not layout_pinned(moe)
    assert layout_pinned(_layouts("tiny-moe", "dgx-h100:1", {"tp": 1, "pp": 4, "cp": 1,
                                                               "ep": 2}, seq=256))
    # a stack without expert parallelism has ep = 1: pinned without it (megatron@2021 priced
    # with `layouts = "any"`: its code had no MoE at all, plan_rules_stack)
    no_ep = with_options(preset("megatron@2021"), {"layouts": "any"})
    assert layout_pinned(_layouts("tiny-moe", "dgx-h100:1", {"tp": 1, "pp": 4, "cp": 1},
                                  no_ep, seq=256))


def test_cli_table_counts_a_pinned_row_as_answered(cli, tmp_path):
    # bench/planner_cli_table.py runs each published row through `meshtron plan` with its layout
    # pinned: Llama 3 405B at 8,192 GPUs (once refused for memory) is answered, and a row
    # predicted not to fit is counted apart from the fitting ones, never as rejected
    import bench.planner_cli_table as table
    from bench.published.runs import published_runs

    run = next(r for r in published_runs() if r.name == "Llama3 405B 8192")
    row = table.run_row(run)
    assert row["status"] in ("ok", "unfit") and row["value"] > 0
    # independently: the row's command run on its own gives the same plan, and the row's
    # value and error are that plan's model TFLOP/s against Meta's published 430
    rc, out, _ = cli(*table._args(run, tmp_path)[1:])
    plan = json.loads(out)["plans"][0]
    assert rc == 0 and (plan["tp"], plan["pp"], plan["dp"]) == (8, 16, 64)
    assert row["value"] == pytest.approx(plan["model_tflops_per_gpu"], rel=1e-9)
    assert row["error"] == pytest.approx(plan["model_tflops_per_gpu"] / 430.0 - 1, rel=1e-9)
    assert row["need"] == pytest.approx(plan["memory_gib"]["total"], rel=1e-9)
    assert (row["status"] == "unfit") == (plan["fits"] is False)
    s = table.summarise([row], run.part)
    assert (s["n"], s["answered"], s["rejected"]) == (1, 1, 0)
    assert s["unfit"] == (row["status"] == "unfit")



def test_llama3_rows_price_the_papers_pipeline_split_and_fp32_gradients(cli, tmp_path):
    """The Llama 3 405B rows as the paper describes its stack (section 3.3.2): 8 one-layer
    chunks per pipeline rank, the very first chunk only the embedding and the very last only
    the loss (Megatron-Core's account_for_embedding/loss split), gradients accumulated and
    reduced in fp32: a 4-byte gradient buffer on the fullest rank's 8 layers."""
    import bench.planner_cli_table as table
    from bench.published.runs import published_runs

    run = next(r for r in published_runs() if r.name == "Llama3 405B 8192")
    rc, out, _ = cli(*table._args(run, tmp_path)[1:])
    plan = json.loads(out)["plans"][0]
    assert rc == 0 and plan["virtual_stages"] == 8 and plan["reduce_dtype"] == "fp32"
    assert plan["stage_layers"] == [0] + [1] * 126 + [0]
    mem = plan["memory_gib"]
    assert mem["stage"] == 1 and mem["grads"] == pytest.approx(2 * mem["params"], rel=1e-9)

def test_rehearse_takes_the_plan_that_plan_prices(cli):
    """`meshtron rehearse` of a pinned layout that does not fit rehearses the plan `meshtron
    plan` prices (the time-balanced split), not the memory-minimising near miss."""
    import argparse

    from meshtron.rehearse import cli as rehearse_cli

    rc, out, _ = cli(*PINNED, "--offload", "none", "--json")
    priced = json.loads(out)["plans"][0]
    parser = argparse.ArgumentParser()
    rehearse_cli.register(parser.add_subparsers())
    args = parser.parse_args(["rehearse", *PINNED])
    _, plan, _ = rehearse_cli._resolve(args)
    assert rc == 0 and priced["fits"] is False
    assert list(plan.stage_layers) == priced["stage_layers"]
    assert plan.virtual_stages == priced["virtual_stages"]
