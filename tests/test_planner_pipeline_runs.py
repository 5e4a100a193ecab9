"""Pipeline schedules called several times per optimizer step (Plan.pipeline_runs): torchtitan
(trainer.py: gradient_accumulation_steps calls of pp_schedule.step) and NeMo AutoModel
(train_ft._run_train_optim_step: one schedule.step per local batch) run the step's m
micro-batches as `runs` schedule calls of m / runs. Each call pays its own fill and drain
(bubble and pipeline transfers), holds the in-flight activations and receive buffers of m / runs
micro-batches, and under torch.distributed.pipelining syncs and reshards FSDP at its last
backward, so the data-parallel reductions and gathers repeat per call. One step of R calls at
global batch G is therefore priced as R calls of the one-call step at G / R for everything but
the compute. The one validity function refuses counts that do not divide m, calls too short
for the schedule, stacks that run one schedule per step (Megatron, DeepSpeed) and meshtron's
runtime, in one line each, through `meshtron plan --pipeline-runs`."""

from __future__ import annotations

import json

import pytest

from meshtron.cli import main
from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.plan import Plan, load_plan

L8B = PRESETS["llama3-8b"]
CLUSTER = "dgx-h100:4"  # 32 GPUs: tp 1 x pp 4 x dp 8
ARGS = ["plan", "--model", "llama3-8b", "--cluster", CLUSTER, "--seq-len", "4096",
        "--layout", "tp=1,pp=4,dp=8", "--micro-batch", "1", "--zero", "3",
        "--recompute", "full", "--top", "1"]


def _evaluator(batch: int, framework: str = "torchtitan@2025") -> Evaluator:
    fw = preset(framework)
    return Evaluator(L8B, resolve_cluster(CLUSTER), batch, 4096, fw.kernel, mem=fw.memory)


def _plan(schedule: str, v: int, runs: int, batch: int) -> Plan:
    # the layer split given, so that every compared plan prices the same stages
    return Plan(1, 4, 8, 3, 1, "full", False, schedule, v, stage_layers=(32 // (4 * v),) * 4 * v,
                dtype="bf16", global_batch=batch, pipeline_runs=runs)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)])
def test_runs_price_each_call_as_the_one_call_step_of_its_micro_batches(schedule, v):
    # m = 256 / 8 = 32 micro-batches in 4 calls of 8: bubble, transfers, data-parallel time and
    # in-flight memory are 4 calls (memory: one) of the 8-micro-batch step; compute is m's
    runs = _evaluator(256).evaluate(_plan(schedule, v, 4, 256))
    call = _evaluator(64).evaluate(_plan(schedule, v, 1, 64))
    whole = _evaluator(256).evaluate(_plan(schedule, v, 1, 256))
    assert runs.time.bubble == pytest.approx(4 * call.time.bubble, rel=1e-9)
    assert runs.time.pp_comm == pytest.approx(4 * call.time.pp_comm, rel=1e-9)
    assert runs.time.dp_comm == pytest.approx(4 * call.time.dp_comm, rel=1e-9)
    assert runs.time.compute == pytest.approx(whole.time.compute, rel=1e-9)
    assert runs.memory.in_flight == pytest.approx(call.memory.in_flight, rel=1e-9)
    # and they differ from one schedule of all 32 (what was priced before)
    assert runs.time.bubble > 3 * whole.time.bubble
    assert runs.time.dp_comm > 3 * whole.time.dp_comm
    assert runs.step_time_s > whole.step_time_s
    assert runs.memory.in_flight <= whole.memory.in_flight


def test_gpipe_holds_one_calls_micro_batches():
    # GPipe keeps every micro-batch of a call in flight: 8, not 32
    runs = _evaluator(256).evaluate(_plan("gpipe", 1, 4, 256)).memory
    whole = _evaluator(256).evaluate(_plan("gpipe", 1, 1, 256)).memory
    # (not exactly a quarter: the fullest moment's other terms move with m too, memory_gpipe)
    assert runs.in_flight < whole.in_flight / 3
    assert runs.total < whole.total - 0.5 * whole.in_flight


def test_one_run_is_the_plan_without_the_field():
    ev = _evaluator(256)
    a, b = ev.evaluate(_plan("1f1b", 1, 1, 256)), ev.evaluate(
        Plan(1, 4, 8, 3, 1, "full", False, "1f1b", 1, stage_layers=(8,) * 4, dtype="bf16",
             global_batch=256))
    assert a.step_time_s == b.step_time_s and a.memory.total == b.memory.total


def test_validity_rules_name_the_field():
    def refusal(**kw) -> str:
        with pytest.raises(UserError) as exc:
            Plan(**{"pp": 4, "dp": 8, "global_batch": 256, **kw})
        return str(exc.value)

    assert refusal(pipeline_runs=3) == ("plan.pipeline_runs=3: must divide the 32 micro-batches "
                                        "per step (each schedule call runs m / pipeline_runs "
                                        "of them)")
    assert "8 / 8 = 1 micro-batches per schedule call" in refusal(
        global_batch=64, pipeline_runs=8) and "needs at least pp=4" in refusal(
        global_batch=64, pipeline_runs=8)
    assert refusal(pp=1, pipeline_runs=2).startswith("plan.pipeline_runs=2: needs a pipeline")
    assert refusal(pipeline_runs=0) == "plan.pipeline_runs=0: must be a positive integer"
    assert refusal(pipeline_runs=True).startswith("plan.pipeline_runs=True: must be")
    # interleaved: torch's rounds of pp within each call (8 per call: fine; 32 in 4 calls of
    # 8 where v = 2)
    Plan(pp=4, dp=8, global_batch=256, schedule="interleaved", virtual_stages=2,
         pipeline_runs=4)


def test_plan_files_carry_the_field_only_when_set(tmp_path):
    plan = Plan(pp=4, dp=8, global_batch=256, dtype="bf16", pipeline_runs=4)
    assert "pipeline_runs = 4" in plan.to_toml()
    assert "pipeline_runs" not in plan.replace(pipeline_runs=1).to_toml()
    assert plan.to_dict()["pipeline_runs"] == 4
    path = tmp_path / "plan.toml"
    plan.save(path)
    assert load_plan(path) == plan
    # meshtron's runtime runs one schedule.step per optimizer step: it refuses the plan
    with pytest.raises(UserError, match=r"^plan.pipeline_runs=4: meshtron's runtime runs one"):
        load_plan(path).validate(32)


def _refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def test_cli_prices_the_runs_for_the_stacks_that_call_the_schedule_per_batch(capsys, tmp_path):
    out = {}
    for runs in (1, 4):
        save = tmp_path / f"runs{runs}.toml"
        argv = ARGS + ["--global-batch", "256", "--framework", "torchtitan", "--json",
                       "--save", str(save)] + (["--pipeline-runs", str(runs)] if runs > 1 else [])
        assert main(argv) == 0
        out[runs] = json.loads(capsys.readouterr().out)["plans"][0]
        assert load_plan(save).pipeline_runs == runs
    assert out[4]["pipeline_runs"] == 4 and "pipeline_runs" not in out[1]
    assert out[4]["step_time_s"] > out[1]["step_time_s"]
    assert main(ARGS + ["--global-batch", "256", "--framework", "nemo-automodel",
                        "--pipeline-runs", "4"]) == 0
    assert "interleaved:4 x4" in capsys.readouterr().out  # the table shows the calls


def test_cli_refuses_runs_where_the_code_runs_one_schedule(capsys):
    line = _refusal(capsys, ARGS + ["--global-batch", "256", "--framework", "megatron@2024",
                                    "--pipeline-runs", "4"])
    assert line.startswith("meshtron plan: error: plan.pipeline_runs=4: Megatron-Core runs one "
                           "schedule of all")
    # torchtitan's gradient accumulation came with pytorch/torchtitan#1238 (June 2025)
    line = _refusal(capsys, ARGS + ["--global-batch", "256", "--framework", "torchtitan@2024",
                                    "--pipeline-runs", "4"])
    assert line.startswith("meshtron plan: error: plan.pipeline_runs=4: torchtitan@2024 calls "
                           "its pipeline schedule once per optimizer step")
    line = _refusal(capsys, ARGS + ["--global-batch", "256", "--pipeline-runs", "4"])
    assert "plan.pipeline_runs=4: meshtron's runtime runs one pipeline schedule" in line
    line = _refusal(capsys, ARGS + ["--global-batch", "256", "--framework", "torchtitan",
                                    "--pipeline-runs", "3"])
    assert "plan.pipeline_runs=3: must divide the 32 micro-batches" in line
    line = _refusal(capsys, ARGS + ["--global-batch", "256", "--framework", "torchtitan",
                                    "--pipeline-runs", "0"])
    assert "--pipeline-runs" in line and "0" in line


def test_step_simulator_refuses_several_calls(capsys, tmp_path):
    # its graph (simulate/step.py) is one schedule of all the micro-batches per step
    path = tmp_path / "runs.toml"
    assert main(ARGS + ["--global-batch", "256", "--framework", "torchtitan",
                        "--pipeline-runs", "4", "--save", str(path)]) == 0
    capsys.readouterr()
    line = _refusal(capsys, ["simulate", "--step", "--plan", str(path), "--framework",
                             "torchtitan"])
    assert "plan.pipeline_runs=4: the step simulator walks one pipeline schedule" in line


def test_search_takes_schedules_whose_formulas_hold_per_call(capsys):
    # 256 / 8 = 32 micro-batches in 16 calls of 2 < pp = 4: the searched schedules' formulas
    # (1F1B and ZB-H1 need pp in flight, interleaving whole rounds of pp) hold for none
    line = _refusal(capsys, ARGS + ["--global-batch", "256", "--framework", "torchtitan",
                                    "--pipeline-runs", "16"])
    assert "plan.pipeline_runs=16: 2 micro-batches per schedule call, fewer than pp=4" in line
    assert main(ARGS + ["--global-batch", "256", "--framework", "torchtitan", "--pipeline-runs",
                        "16", "--schedule", "gpipe", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert (plan["schedule"], plan["pipeline_runs"]) == ("gpipe", 16)
