"""A saved plan keeps the stack and options it was priced with (Plan.framework,
Plan.framework_options): `cost --plan`, `simulate --step --plan` and `rehearse --plan` price
what `meshtron plan` priced; `train --plan` refuses another stack's plan in one line.

The `train` refusals and `rehearse --plan` reports run through `meshtron.cli.main` in the
test's process with the argv a user types (testkit/cli_inproc.py: a child imports torch
again, ~3.5 CPU s each); `meshtron rehearse --plan` as typed, in a process of its own:
test_rehearse_fit_line_reads_as_a_sum_through_the_command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import meshtron.cli as top_cli
from testkit.cli_inproc import meshtron_main
from testkit.plan_cli import commands_fixture


cli = commands_fixture("meshtron.planner.cli", "meshtron.cost.cli", "meshtron.simulate.cli")
EVERY_COMMAND = list(top_cli.COMMAND_MODULES)  # before any test narrows them

# Megatron-Core with TE's userbuffers TP overlap, bf16 gradient reduction and the unfused
# attention flag: a stack and three options that each change the price of this layout
OPTIONS = '[options]\ntp_comm_overlap = true\nreduce_dtype = "bf16"\n'
PLAN = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
        "--seq-len", "4096", "--layout", "tp=2,pp=2,dp=2", "--zero", "1", "--top", "1"]


def _saved(cli, tmp_path, *extra: str) -> tuple[Path, dict]:
    """`meshtron plan ... --framework megatron@2024 --options FILE --attention unfused --save`:
    (the plan file, the plan's JSON row)."""
    options = tmp_path / "options.toml"
    options.write_text(OPTIONS)
    path = tmp_path / "plan.toml"
    rc, out, err = cli("plan", *PLAN, "--framework", "megatron@2024", "--options", str(options),
                       "--attention", "unfused", "--save", str(path), "--json", *extra)
    assert rc == 0, err
    return path, json.loads(out)["plans"][0]


def test_the_file_records_the_stack_and_every_option(cli, tmp_path):
    from meshtron.planner.plan import load_plan

    path, _ = _saved(cli, tmp_path)
    plan = load_plan(path)
    assert plan.framework == "megatron@2024"
    assert dict(plan.framework_options) == {"tp_comm_overlap": True, "reduce_dtype": "bf16",
                                            "attention": "unfused"}
    assert load_plan(path) == plan  # the file reads back to the same plan


def test_cost_and_simulate_price_what_plan_priced(cli, tmp_path):
    path, row = _saved(cli, tmp_path)
    rc, out, err = cli("cost", "--plan", str(path), "--json")
    assert rc == 0 and err == "", err
    cost = json.loads(out)
    assert cost["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-12)
    assert cost["framework"] == "megatron@2024 +3 option(s)" and cost["fits"] == row["fits"]
    rc, out, err = cli("simulate", "--step", "--plan", str(path), "--json")
    assert rc == 0 and err == "", err
    sim = json.loads(out)
    assert sim["analytical_step_s"] == pytest.approx(row["step_time_s"], rel=1e-12)
    assert sim["memory_gib"] == pytest.approx(row["memory_gib"]["total"], rel=1e-12)
    # the same layout priced as meshtron's runtime (what these commands did before) differs
    bare = tmp_path / "bare.toml"
    bare.write_text("\n".join(line for line in path.read_text().split("[framework_options]")[0]
                              .splitlines() if not line.startswith("framework")) + "\n")
    rc, out, err = cli("cost", "--plan", str(bare), "--json")
    assert rc == 0, err
    assert json.loads(out)["framework"].startswith("meshtron@")
    assert json.loads(out)["step_time_s"] != pytest.approx(row["step_time_s"], rel=1e-3)


def test_another_framework_is_priced_and_said_in_one_line(cli, tmp_path):
    path, row = _saved(cli, tmp_path)
    rc, out, err = cli("cost", "--plan", str(path), "--framework", "megatron-bridge", "--json")
    assert rc == 0, err
    lines = err.splitlines()
    assert len(lines) == 1 and "saved priced for megatron@2024 +3 option(s)" in lines[0]
    assert "priced here as megatron-bridge@2025 (--framework)" in lines[0]
    assert json.loads(out)["framework"] == "megatron-bridge@2025"
    # the stack it was saved for, named again: no line, and the saved options still apply
    rc, out, err = cli("cost", "--plan", str(path), "--framework", "megatron", "--json")
    assert rc == 0 and err == "", err
    assert json.loads(out)["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-12)


def test_an_option_flag_applies_on_top_of_the_saved_ones(cli, tmp_path):
    path, row = _saved(cli, tmp_path)
    rc, out, err = cli("cost", "--plan", str(path), "--attention", "flash", "--json")
    assert rc == 0 and err == "", err
    doc = json.loads(out)
    assert doc["framework"] == "megatron@2024 +4 option(s)"
    assert doc["step_time_s"] < row["step_time_s"]  # flash attention is the faster kernel


def test_a_meshtron_plan_file_is_unchanged_and_old_files_read_as_meshtron(cli, tmp_path):
    from meshtron.planner.plan import load_plan

    path = tmp_path / "plan.toml"
    rc, out, err = cli("plan", *PLAN, "--save", str(path))
    assert rc == 0, err
    assert "framework" not in path.read_text()
    assert load_plan(path).framework is None and load_plan(path).framework_options == ()
    rc, out, err = cli("cost", "--plan", str(path), "--json")
    assert rc == 0 and json.loads(out)["framework"].startswith("meshtron@")


@pytest.mark.parametrize("text, field", [
    ('framework = "megatron@1999"\n', "plan.framework='megatron@1999'"),
    ('framework = 3\n', "plan.framework=3"),
    ('framework = "megatron@2024"\n[framework_options]\nno_such_option = 1\n',
     "plan.framework_options.no_such_option"),
    ('[framework_options]\ntp_comm_overlap = [1, 2]\n', "plan.framework_options.tp_comm_overlap"),
])
def test_a_bad_stack_in_a_plan_file_is_one_line(cli, tmp_path, text, field):
    path = tmp_path / "plan.toml"
    rc, _, err = cli("plan", *PLAN, "--save", str(path))
    assert rc == 0, err
    body, _, predicted = path.read_text().partition("[predicted]")
    path.write_text(body + text + "\n[predicted]" + predicted)
    rc, _, err = cli("cost", "--plan", str(path))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and field in lines[0] and "Traceback" not in err


def _meshtron(*argv: str) -> subprocess.CompletedProcess:
    """`meshtron ARGV` in this process with every command (the `cli` fixture loads only the
    planner's): exit code, stdout and stderr as a child's."""
    narrowed, top_cli.COMMAND_MODULES = top_cli.COMMAND_MODULES, EVERY_COMMAND
    try:
        code, out, err = meshtron_main(*argv)
    finally:
        top_cli.COMMAND_MODULES = narrowed
    return subprocess.CompletedProcess(["meshtron", *argv], code, out, err)


TINY = ["--model", "tiny", "--cluster", "dgx-h100:1", "--global-batch", "16", "--seq-len", "256",
        "--layout", "tp=2,dp=4", "--zero", "1", "--top", "1"]


def test_train_refuses_another_stacks_plan_and_runs_meshtrons_with_options(cli, tmp_path):
    """Another stack's plan: one line naming it, exit 2, before any rank starts. meshtron's
    own preset with an option its runtime takes is what the runtime runs: the same
    validity function passes it."""
    from meshtron.planner.plan import load_plan

    other = tmp_path / "other.toml"
    rc, _, err = cli("plan", *TINY, "--framework", "megatron@2024", "--save", str(other))
    assert rc == 0, err
    done = _meshtron("train", "--plan", str(other), "--steps", "1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "plan.framework='megatron@2024'" in lines[0] and "Traceback" not in done.stderr
    # an option meshtron's runtime takes (a measurement: plan_rules_options.RUNTIME_OPTIONS)
    # is saved with the plan and the runtime runs it; one it does not run is refused at plan
    # time already (tests/test_runtime_options.py)
    own, options = tmp_path / "own.toml", tmp_path / "options.toml"
    options.write_text("[options]\nexpert_imbalance = 1.5\n")
    rc, _, err = cli("plan", *TINY, "--options", str(options), "--save", str(own))
    assert rc == 0, err
    plan = load_plan(own)
    assert plan.framework == "meshtron@2026" and dict(plan.framework_options) == {
        "expert_imbalance": 1.5}
    assert plan.validate(plan.gpus) is plan
    # a hand-edited meshtron plan with an option the runtime does not run: refused by the
    # same rule `meshtron plan` applies, before any rank starts
    edited = tmp_path / "edited.toml"
    edited.write_text(own.read_text().replace("expert_imbalance = 1.5", 'stack = "fused"'))
    assert 'stack = "fused"' in edited.read_text()
    done = _meshtron("train", "--plan", str(edited), "--steps", "1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "options.stack='fused'" in lines[0] and "Traceback" not in done.stderr


def test_rehearse_prices_the_saved_stack_and_says_whether_it_fits(cli, tmp_path):
    options = tmp_path / "options.toml"
    options.write_text("[options]\ntp_comm_overlap = true\n")
    path = tmp_path / "plan.toml"
    rc, out, err = cli("plan", *TINY, "--framework", "megatron@2024", "--options",
                       str(options), "--save", str(path), "--json")
    assert rc == 0, err
    row = json.loads(out)["plans"][0]
    done = _meshtron("rehearse", "--plan", str(path), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    # what `meshtron plan` priced for the rank (the GPU's kernels), and its verdict
    assert report["planner_gpu_total_gib"] == pytest.approx(row["memory_gib"]["total"])
    assert report["framework"] == "megatron@2024 +1 option(s)"
    fit = report["fit"]
    assert fit["planner_fits"] is row["fits"] is True and fit["capacity_gib"] == 80
    _assert_the_verdict_is_the_gpus(report)
    assert fit["cpu_kernels_gib"] > 0  # meshtron's runtime ran RMSNorm's composite kernel


def _assert_the_verdict_is_the_gpus(report: dict) -> None:
    """On CPU the verdict takes off the rehearsal's peak what the CPU's kernels hold and the
    GPU's do not (the planner's CPU-kernel total minus its GPU-kernel total, for meshtron's
    runtime, which the rehearsal runs), so that it lands on `meshtron plan`'s GPU figure up to
    the rehearsal-vs-planner gap."""
    fit = report["fit"]
    total = {r["row"]: r for r in report["memory"]}["total"]
    assert fit["cpu_kernels_gib"] >= 0
    assert fit["need_gib"] == pytest.approx(total["rehearsal_gib"] - fit["cpu_kernels_gib"]
                                            + fit["workspace_gib"])
    if "framework" not in report:  # the planner column prices the runtime the rank ran
        gap = abs(total["rehearsal_gib"] - total["planner_gib"])
        assert abs(fit["need_gib"] - report["planner_gpu_total_gib"]) <= gap + 1e-6
    assert fit["fits"] is (fit["need_gib"] <= fit["capacity_gib"])


@pytest.mark.slow  # an 8B rank of fake tensors: ~15 s
def test_rehearse_on_cpu_of_an_8b_plan_that_fits_says_it_fits(cli, tmp_path):
    """llama3-8b dp=16 on two DGX H100s: 79.1 GiB of tensors on the CPU's kernels, of which
    ~12 GiB are RMSNorm's fp32 copies a GPU kernel does not keep; `meshtron plan` says 73.3
    GiB, fits, and so must the rehearsal's verdict."""
    path = tmp_path / "ms.toml"
    rc, out, err = cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--save",
                       str(path), "--json")
    assert rc == 0, err
    row = json.loads(out)["plans"][0]
    done = _meshtron("rehearse", "--plan", str(path), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert row["fits"] is report["fit"]["planner_fits"] is True
    _assert_the_verdict_is_the_gpus(report)
    assert report["fit"]["cpu_kernels_gib"] > 5 and report["fit"]["fits"] is True


def test_rehearse_on_cpu_takes_the_cpu_kernels_off_the_verdict(cli, tmp_path):
    """The default suite's small case: a meshtron plan of the tiny model, whose CPU-kernel
    total (composite RMSNorm) exceeds its GPU-kernel total; the verdict is the GPU's."""
    path = tmp_path / "plan.toml"
    rc, _, err = cli("plan", *TINY, "--save", str(path))
    assert rc == 0, err
    done = _meshtron("rehearse", "--plan", str(path), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    _assert_the_verdict_is_the_gpus(report)
    assert report["fit"]["cpu_kernels_gib"] > 0  # the composite RMSNorm's fp32 copies
    assert report["fit"]["workspace_gib"] < report["planner_workspace_gib"]


def test_rehearse_text_has_a_verdict_and_no_percentage_against_zero():
    import contextlib
    import io

    from meshtron.rehearse.compare import fit_verdict, rows_table
    from meshtron.rehearse.compare import verdict_line as compare_line
    from meshtron.rehearse.run import print_report

    rows = rows_table({"grads": 0.0, "gathered": 0.003, "total": 0.05},
                      {"grads": 0.006, "gathered": 0.0001, "total": 0.04})
    assert [r["planner_vs_rehearsal"] for r in rows] == [None, None, pytest.approx(-0.2)]
    report = {"plan": {"tp": 2, "dp": 4, "zero": 1, "micro_batch": 4, "recompute": "none"},
              "rank": 0, "pp_rank": 0, "stages": [0], "layers": 4, "model": "tiny",
              "device": "cpu", "measured": "fake tensors", "wall_s": 1.0, "memory": rows,
              "planner_workspace_gib": 79.0, "capacity_gib": 80.0,
              "fit": fit_verdict(2.05, 79.0, 80.0, 79.04, True)}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_report(report)
    text = buf.getvalue()
    for name in ("grads", "gathered"):
        line = next(line for line in text.splitlines() if line.startswith(name))
        assert line.split()[-1] == "-"
    assert "inf" not in text and "nan" not in text
    assert ("fit: the rank does NOT fit: peak + workspace = 81.0 GiB of the GPU's 80 GiB "
            "(the planner: 79.0 GiB, fits)") in text
    # on CPU: the CPU kernels' extra is taken off and the line says so
    line = compare_line(fit_verdict(83.0, 7.0, 80.0, 77.5, True, cpu_kernels_gib=12.5))
    assert line == ("fit: the rank fits: peak on the GPU's kernels (less the CPU kernels' "
                    "12.5 GiB) + workspace = 77.5 GiB of the GPU's 80 GiB (the planner: "
                    "77.5 GiB, fits)")


def test_the_python_api_prices_a_saved_plan_as_saved(cli, tmp_path):
    from meshtron.planner import evaluate_plan, load_plan, resolve_cluster
    from meshtron.planner.cli import load_model

    path, row = _saved(cli, tmp_path)
    plan = load_plan(path)
    est = evaluate_plan(load_model("llama3-8b"), resolve_cluster("dgx-h100:1"), 64, 4096, plan)
    assert est.step_time_s == pytest.approx(row["step_time_s"], rel=1e-12)


def test_a_file_saved_before_plans_recorded_their_stack_is_flagged(cli, tmp_path):
    """`plan --framework megatron@2024 --save` before savefw wrote no `framework`: re-priced
    as meshtron's runtime it moves far from its own [predicted] (47.7 s, 76.4 GiB ->
    56.6 s, 81.3 GiB): one warning line, exit 0; files that re-price as saved get none."""
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--top", "1"]
    saved, own = tmp_path / "saved.toml", tmp_path / "own.toml"
    rc, _, err = cli("plan", *args, "--framework", "megatron@2024", "--save", str(saved))
    assert rc == 0, err
    rc, _, err = cli("plan", *args, "--save", str(own))
    assert rc == 0, err
    old = tmp_path / "old.toml"
    old.write_text("".join(line for line in saved.read_text().splitlines(keepends=True)
                           if not line.startswith("framework = ")))
    rc, out, err = cli("cost", "--plan", str(old), "--json")
    assert rc == 0, err
    said = [w for w in json.loads(out)["warnings"] if "recorded their stack" in w]
    assert len(said) == 1 and "pass --framework NAME@ERA" in said[0], said
    import tomllib

    was = tomllib.loads(old.read_text())["predicted"]
    assert f"[predicted]: {was['step_time_s']:.2f} s, {was['memory_gib']:.1f} GiB" in said[0]
    for path, extra in ((saved, ()), (own, ()), (old, ("--framework", "megatron@2024"))):
        rc, out, err = cli("cost", "--plan", str(path), "--json", *extra)
        assert rc == 0 and "recorded their stack" not in out + err, (path, err)
    rc, _, err = cli("simulate", "--step", "--plan", str(old))
    assert rc == 2 and err.count("\n") == 1 and "pass --framework NAME@ERA" in err


def test_train_names_the_stack_before_the_world_size_it_asks_for(cli, tmp_path):
    """A 128-GPU plan saved for Megatron was refused for its world size ("--nproc=128:
    allowed 1..N local ranks") before its stack was named (user audit): the stack's line
    comes first, since no world size makes meshtron's runtime run it."""
    path = tmp_path / "big.toml"
    rc, _, err = cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100:16",
                     "--global-batch", "128", "--seq-len", "2048", "--framework", "megatron@2024",
                     "--save", str(path))
    assert rc == 0, err
    done = _meshtron("train", "--plan", str(path), "--steps", "1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "plan.framework='megatron@2024'" in lines[0] and "--nproc" not in lines[0]


def test_rehearse_fit_line_reads_as_a_sum_through_the_command(tmp_path, monkeypatch):
    """Session-50 user audit: `meshtron rehearse --plan plan.toml` on CPU printed "peak on the
    GPU's kernels (less the CPU kernels' 15.2 GiB) + workspace 76.2 GiB", which reads as a 76.2
    GiB workspace; the total is now given after "=". Both commands as typed, through
    `meshtron.cli.main` in this process (testkit/cli_inproc.py; suite time, session 57: the
    rehearsal's child imported torch again, ~3.5 CPU s)."""
    from testkit.cli_inproc import meshtron_main

    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan.toml"
    code, _, err = meshtron_main("plan", "--model", "debug", "--cluster", "nominal-cpu:2",
                                 "--global-batch", "4", "--seq-len", "32", "--save", plan)
    assert code == 0, err
    code, stdout, err = meshtron_main("rehearse", "--plan", plan)
    assert code == 0, err
    line = next(x for x in stdout.splitlines() if x.startswith("fit: "))
    assert "+ workspace = " in line and " GiB of the GPU's " in line, line
