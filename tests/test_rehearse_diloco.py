"""`meshtron rehearse` of a DiLoCo plan: the outer loop's state (compress/diloco.py: the outer
copy, and the momentum where there is one) is built by the engine's features, not by the
rehearsal's rank; the rehearsal adds the planner's exact per-rank count of it
(planner/memory_compress.py, equal to the runtime's measured bytes: tests/test_compress_
priced.py) to its optimizer row, its total and its fit verdict. Before, a DiLoCo plan's
rehearsal read half the planner's optimizer row (llama3-8b tp2 2x4 HSDP: 7.48 against 14.96
GiB) and its verdict left the state out."""

from __future__ import annotations

import json

from testkit.cli_inproc import meshtron_main


def test_rehearsal_of_a_diloco_plan_counts_the_outer_state(tmp_path):
    plan = tmp_path / "plan.toml"
    rc, out, err = meshtron_main("plan", "--model", "debug", "--cluster", "nominal-cpu:2",
                                 "--diloco", "4", "--save", plan)
    assert rc == 0, err
    rc, out, err = meshtron_main("rehearse", "--plan", plan, "--json")
    assert rc == 0, err
    report = json.loads(out)
    unbuilt = report["unbuilt_state_gib"]
    assert unbuilt > 0
    rows = {r["row"]: r for r in report["memory"]}
    # the outer copy: fp32 of every local parameter (ZeRO-0 replicas, no momentum at H = 4)
    # and the outer all-reduce's mean residual, zeros uncompressed (memory_compress.py)
    assert abs(rows["optimizer"]["rehearsal_gib"] - rows["optimizer"]["planner_gib"]) <= \
        0.02 * rows["optimizer"]["planner_gib"], rows
    rc, out, err = meshtron_main("rehearse", "--plan", plan)
    assert rc == 0 and "of DiLoCo / compression state the rank holds in a run" in out, out


def test_nothing_is_added_without_diloco_or_compression():
    from meshtron.model.spec import preset
    from meshtron.planner.plan import Plan
    from meshtron.rehearse.compare import rehearsal_rows, unbuilt_state_gib

    spec = preset("debug")
    assert unbuilt_state_gib(spec, Plan(dp=2), 0) == 0.0
    with_state = unbuilt_state_gib(spec, Plan(dp=2, diloco=4), 1)
    assert with_state > 0
    peak = dict.fromkeys(("params", "grads", "optimizer", "gathered", "activations",
                          "temporaries", "total"), 2.0 ** 30)
    rows = rehearsal_rows(peak, with_state)
    assert rows["optimizer"] == rows["total"] == 1.0 + with_state  # in the row and the total
    assert rows["params"] == rows["grads"] == 1.0
