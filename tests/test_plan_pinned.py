"""A layout the user pinned is answered even when it is predicted not to fit (issue 30).

Through `meshtron plan` (main(), as the command line runs it): Llama 3 405B's published 4D
layout on 1,024 DGX H100 nodes at no recomputation, which meshtron's runtime is predicted to
overfill, is priced (exit 0, fits false, a warning, the cheapest change that fits); the same
model with only pp fixed stays a one-line refusal; --save of the non-fitting plan writes
nothing. Which knobs pin a layout: planner/pinned.py `layout_pinned`.
"""

from __future__ import annotations

import json

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner.frameworks import preset
from meshtron.planner.plan_knobs import Knobs
from meshtron.planner.pinned import layout_pinned

L405 = ("--model", "llama3-405b", "--cluster", "dgx-h100:1024", "--global-batch", "2048",
        "--seq-len", "8192")
PINNED = (*L405, "--layout", "tp=8,cp=1,pp=16,dp=64", "--zero", "1", "--sp", "on",
          "--recompute", "none", "--micro-batch", "1", "--schedule", "interleaved")


@pytest.fixture
def cli(monkeypatch, capsys):
    import meshtron.cli as top

    monkeypatch.setattr(top, "COMMAND_MODULES", ["meshtron.planner.cli"])

    def run(*argv: str) -> tuple[int, str, str]:
        rc = top.main(["plan", *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


def test_pinned_layout_that_does_not_fit_is_priced(cli):
    rc, out, err = cli(*PINNED, "--json")
    assert rc == 0
    doc = json.loads(out)
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
    assert doc["near_miss"]["memory_gib"]["total"] == mem["total"]
    # the warning: once on stderr (stdout stays JSON), and in the document
    assert err.count("\n") == 1 and err.startswith("warning: predicted not to fit: needs ")
    assert doc["warnings"] == [err.strip().removeprefix("warning: ")]
    assert f"{mem['total']:.1f} GiB per GPU > 80 GiB" in err


def test_pinned_layout_names_the_cheapest_change_that_fits(cli):
    rc, out, err = cli(*PINNED, "--json")
    doc = json.loads(out)
    change, plan = doc["fit_change"], doc["plans"][0]
    assert rc == 0 and change is not None
    # the same layout, one knob the user fixed changed, fitting, and slower than the pinned plan
    assert [change[k] for k in ("tp", "cp", "pp", "dp")] == [8, 1, 16, 64]
    assert change["fits"] is True
    assert change["memory_gib"]["total"] <= change["memory_gib"]["capacity"]
    assert change["step_time_s"] >= plan["step_time_s"]
    fixed = {"recompute": "none", "zero": 1, "micro_batch": 1, "sp": True}
    moved = [k for k, v in fixed.items() if change[k] != v]
    assert len(moved) == 1 and f"{moved[0]}=" in change["change"]
    assert f"to fit: {change['change']} (" in err


def test_pinned_layout_text_marks_the_plan(cli):
    rc, out, err = cli(*PINNED)
    assert rc == 0 and err == ""
    assert "PREDICTED NOT TO FIT" in out and out.count("Warning: predicted not to fit") == 1
    assert ">80" in out  # the memory column: needed > capacity
    assert "Pinned plan: step" in out and "Best plan" not in out


def test_unpinned_search_that_finds_nothing_still_refuses(cli):
    # the same run with only tp and pp fixed: dp is the search's, and nothing it may pick fits
    unpinned = (*L405, "--layout", "tp=8,pp=16", "--zero", "1", "--sp", "on", "--recompute",
                "none", "--micro-batch", "1", "--schedule", "interleaved")
    rc, out, err = cli(*unpinned)
    assert rc == 2 and err.count("\n") == 1 and "fits on no layout" in err
    assert "needs at least" in err and "Nothing fits" in out and "Traceback" not in err
    rc, out, _ = cli(*unpinned, "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["fits"] is False and doc["pinned"] is False and doc["plans"] == []


def test_save_of_a_pinned_plan_that_does_not_fit_refuses(cli, tmp_path):
    path = tmp_path / "plan.toml"
    rc, out, err = cli(*PINNED, "--save", str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert f"save={str(path)!r}: not saved, the plan is predicted not to fit" in err
    assert not path.exists()


def test_which_knobs_pin_a_layout():
    dense, moe = PRESETS["llama3-8b"], PRESETS["tiny-moe"]
    assert layout_pinned(Knobs(tp=2, pp=2, dp=4), dense)
    assert layout_pinned(Knobs(tp=2, pp=2, dp=4, cp=2), dense)
    assert not layout_pinned(Knobs(tp=2, pp=2), dense)  # dp (and cp) left to the search
    assert not layout_pinned(Knobs(tp=2, cp=2, dp=4), dense)
    # a mixture of experts: ep is not fixed by the GPU count where the stack runs it
    assert not layout_pinned(Knobs(tp=1, pp=2, dp=4), moe)
    assert layout_pinned(Knobs(tp=1, pp=2, dp=4, ep=2), moe)
    assert layout_pinned(Knobs(tp=1, pp=2, dp=4), moe, preset("megatron@2021"))  # no EP there


def test_cli_table_counts_a_pinned_row_as_answered():
    # bench/planner_cli_table.py runs each published row through `meshtron plan` with its layout
    # pinned: Llama 3 405B at 8,192 GPUs (once refused for memory) is answered, and a row
    # predicted not to fit is counted apart from the fitting ones, never as rejected
    import bench.planner_cli_table as table
    from bench.published.runs import published_runs

    run = next(r for r in published_runs() if r.name == "Llama3 405B 8192")
    row = table.run_row(run)
    assert row["status"] in ("ok", "unfit") and row["value"] > 0
    assert row["error"] == pytest.approx(row["value"] / run.published - 1)
    s = table.summarise([row], run.part)
    assert (s["n"], s["answered"], s["rejected"]) == (1, 1, 0)
    assert s["unfit"] == (row["status"] == "unfit") == (row["need"] > 80)
