"""DeepSeek's DualPipe priced for DeepSeek's stack (planner/pipeline_dualpipe.py): the README's
bubble and memory columns, the pairing of stages r and PP-1-r on a rank, its hidden transfers,
and the one validity function refusing it everywhere else (meshtron's runtime included)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import pipeline, pipeline_dualpipe
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.plan import Plan, plan_problems
from meshtron.planner.plan_parse import parse_schedule
from testkit.plan_cli import commands_fixture, plan_cli  # noqa: F401  (fixture)

cli = commands_fixture("meshtron.planner.cli", "meshtron.train.cli", "meshtron.simulate.cli")


def test_bubble_is_the_readmes_formula_per_chunk():
    """(PP/2 - 1)(F&B + B - 3W), F&B = F + B: PP = 8 stages as a V of 4 ranks (two chunks
    each), per chunk F = 1, B = 2 (input 1 + weight 1), W = 1: 3 x (3 + 2 - 3) = 6."""
    rank = [2.0 * (1 + 2)] * 4  # both chunks of a rank, per micro-batch: forward + backward
    assert pipeline.bubble_time("dualpipe", 2, rank, [2.0] * 4, 64, [2.0] * 4) == \
        pytest.approx(6.0)
    # a longer pipeline: PP = 16, (8 - 1)(3 + 2 - 3) = 14
    assert pipeline.bubble_time("dualpipe", 2, [6.0] * 8, [2.0] * 8, 64, [2.0] * 8) == \
        pytest.approx(14.0)
    # ZB-H1 on the same 8 chunks of one stage each pays (p - 1)(F + B - W) = 7 x 2 = 14 > 6
    assert pipeline.bubble_time("zb", 1, [3.0] * 8, [1.0] * 8, 64, [1.0] * 8) > 6.0


def test_every_rank_holds_pp_plus_one_chunks_and_two_stages():
    """README: activations PP+1 chunks per device; a V rank holds stages r and 2p-1-r."""
    for p in (2, 4, 8):
        for r in range(p):
            # micro-batches' worth of the rank's layers (two chunks): (2p + 1) / 2
            assert pipeline.in_flight("dualpipe", p, 2, 1000, r) == pytest.approx(p + 0.5)
            assert pipeline.stages_of_rank(p, 2, "dualpipe", r) == [r, 2 * p - 1 - r]
    assert pipeline.head_rank(4, 2, "dualpipe") == 0  # head beside the embedding (3.2.3)


def test_the_schedule_is_spelled_on_the_command_line():
    assert parse_schedule("dualpipe") == ("dualpipe", 1)
    assert parse_schedule("dualpipev") == ("dualpipe", 2)


def test_the_validity_function_refuses_dualpipe_outside_deepseeks_stack():
    k = {"tp": 1, "pp": 4, "dp": 2, "schedule": "dualpipe", "virtual_stages": 1,
         "global_batch": 64, "micro_batch": 1}
    model = PRESETS["llama3-8b"]
    runtime = plan_problems(k, 8, model)  # meshtron's runtime
    assert runtime and runtime[0].startswith("plan.schedule='dualpipe': DeepSeek's DualPipe")
    assert plan_problems(k, 8, model, runtime=False, split="any")  # another stack's engine
    assert plan_problems(k, 8, model, runtime=False, split="megatron-ends")
    assert plan_problems(k, 8, model, runtime=False, split="dualpipe") == []
    # dualpipe.py's asserts: even ranks, an even m of at least 2 pp
    odd = plan_problems({**k, "pp": 3, "dp": 1, "global_batch": 6}, 3, None, runtime=False,
                        split="dualpipe")
    assert odd and "even number of pipeline ranks" in odd[0]
    few = plan_problems({**k, "global_batch": 12}, 8, model, runtime=False, split="dualpipe")
    assert few and "at least 2*pp=8" in few[0]
    uneven = plan_problems({**k, "global_batch": 18}, 8, model, runtime=False,
                           split="dualpipe")
    assert uneven and "an even number" in uneven[0]
    # DualPipeV (dualpipev.py): any m >= 2 pp
    v2 = {**k, "virtual_stages": 2, "global_batch": 18}
    assert plan_problems(v2, 8, model, runtime=False, split="dualpipe") == []


def _deepseek_evaluator(model, batch: int = 256):
    """Megatron-Core 2024's pricing with DeepSeek's engine as the split rule."""
    fw = preset("megatron@2024")
    mem = dataclasses.replace(fw.memory, pipeline_split="dualpipe")
    return Evaluator(model, resolve_cluster("dgx-h100:4"), batch, 4096, fw.kernel, mem=mem)


def test_a_rank_runs_half_the_micro_batches_through_each_of_its_two_stages():
    """DualPipe on 4 ranks (a 32k vocabulary: the head well under a block's time), split
    [1, 3, 3, 1] (stage order): rank 0 runs stages 0 and 3 (2 blocks, embedding and head),
    rank 1 stages 1 and 2 (6 blocks), m/2 micro-batches through each: rank 1 sets the step
    with 6 m / 2 block-passes. On [1, 2, 3, 2] rank 1 holds 5 blocks: 5/6 of that. ZB-H1 on
    [1, 2, 3, 2] is paced by its 3-block stage over all m: 3 m against DualPipe's 2.5 m."""
    model = PRESETS["llama3-8b"].replace(layers=8, vocab=32000)
    ev = _deepseek_evaluator(model)
    base = Plan(tp=1, pp=4, dp=8, zero=1, micro_batch=1, recompute="full",
                schedule="dualpipe", dtype="bf16")
    even = ev.evaluate(dataclasses.replace(base, stage_layers=(1, 3, 3, 1)))
    skew = ev.evaluate(dataclasses.replace(base, stage_layers=(1, 2, 3, 2)))
    assert even.config.pp == 4 and even.config.dp == 8  # told as asked, not as the folded V
    assert even.num_microbatches == 32
    assert even.stage_layers == [1, 3, 3, 1] and skew.stage_layers == [1, 2, 3, 2]
    assert skew.time.compute == pytest.approx(even.time.compute * 5 / 6, rel=0.02)
    assert even.time.pp_comm == 0.0  # hidden in the overlapped chunks (report 3.2.1)
    zb = _zb_evaluator(model).evaluate(dataclasses.replace(
        base, schedule="zb", stage_layers=(1, 2, 3, 2)))
    assert zb.time.compute == pytest.approx(skew.time.compute * 3 / 2.5, rel=0.02)
    assert zb.time.pp_comm > 0.0


def _zb_evaluator(model):
    fw = preset("megatron@2024")
    mem = dataclasses.replace(fw.memory, pipeline_split="any")
    return Evaluator(model, resolve_cluster("dgx-h100:4"), 256, 4096, fw.kernel, mem=mem)


def test_two_stages_of_parameters_and_pp_plus_one_chunks_per_rank():
    """README: 2x parameters per device against ZB-H1 on the same stages, and PP+1 chunks of
    activations on every rank where ZB-H1's first stage holds PP."""
    model = PRESETS["llama3-8b"].replace(layers=16)
    plan = Plan(tp=1, pp=4, dp=8, zero=1, micro_batch=1, recompute="full",
                schedule="dualpipe", dtype="bf16", stage_layers=(4, 4, 4, 4))
    dual = _deepseek_evaluator(model).evaluate(plan, stage=1)
    zb = _zb_evaluator(model).evaluate(dataclasses.replace(plan, schedule="zb"), stage=1)
    # rank 1 holds stages 1 and 2: 8 blocks' weights against ZB-H1's 4
    assert dual.memory.params == pytest.approx(2 * zb.memory.params, rel=0.01)
    # activations: (4 + 1) chunks of 4 blocks = 20 block-micro-batches; ZB-H1's stage 1 keeps
    # 3 micro-batches of its 4 blocks = 12
    dual_acts = dual.memory.activations + dual.memory.in_flight
    zb_acts = zb.memory.activations + zb.memory.in_flight
    assert dual_acts / zb_acts == pytest.approx(20 / 12, rel=0.01)


def test_the_runtime_refuses_dualpipe_through_the_command_line(plan_cli):
    rc, out, err = plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:1",
                            "--global-batch", "64", "--seq-len", "2048", "--layout",
                            "tp=1,pp=4,dp=2", "--schedule", "dualpipe")
    assert rc == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0
    assert "DeepSeek's DualPipe runs only in DeepSeek's own stack" in err


def _deepseek_plan(plan_cli, tmp_path, *extra: str) -> dict:
    """`meshtron plan` with Megatron-Core's preset and DeepSeek's engine from an options file."""
    import json

    opts = tmp_path / "deepseek.toml"
    opts.write_text('framework = "megatron@2024"\n[options]\npipeline_split = "dualpipe"\n')
    rc, out, err = plan_cli("--model", "llama3-8b", "--cluster", "dgx-h100:4",
                            "--global-batch", "256", "--seq-len", "4096", "--layout",
                            "tp=1,pp=4,dp=8", "--zero", "1", "--micro-batch", "1",
                            "--options", str(opts), "--json", "--top", "1", *extra)
    assert rc == 0, err
    return json.loads(out)["plans"][0]


def test_deepseeks_engine_is_priced_through_the_command_line(plan_cli, tmp_path):
    """Through the user's path: DualPipe pinned, and the search left to pick: it tries only
    DeepSeek's two schedules (DualPipe, DualPipeV), never another stack's."""
    pinned = _deepseek_plan(plan_cli, tmp_path, "--schedule", "dualpipe")
    assert pinned["schedule"] == "dualpipe" and pinned["pp"] == 4 and pinned["dp"] == 8
    assert pinned["time_s"]["pp_comm"] == 0.0 and pinned["num_microbatches"] == 32
    assert len(pinned["stage_layers"]) == 4 and sum(pinned["stage_layers"]) == 32
    open_ = _deepseek_plan(plan_cli, tmp_path)
    assert open_["schedule"] == "dualpipe" and open_["virtual_stages"] in (1, 2)


def test_a_saved_dualpipe_plan_is_refused_by_train_and_the_step_walk(cli, tmp_path):
    """A plan priced for DeepSeek's stack and saved: `meshtron train` refuses it through the
    validity function, `meshtron simulate --step` (torch's orders only) in one line too."""
    opts = tmp_path / "deepseek.toml"
    opts.write_text('framework = "megatron@2024"\n[options]\npipeline_split = "dualpipe"\n')
    plan = tmp_path / "plan.toml"
    rc, out, err = cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100:4",
                       "--global-batch", "256", "--seq-len", "4096", "--layout",
                       "tp=1,pp=4,dp=8", "--micro-batch", "1", "--options", str(opts),
                       "--schedule", "dualpipe", "--save", str(plan))
    assert rc == 0, err
    # the save line says so too, not "`meshtron train --plan` trains in it"
    said = " ".join(out.split())
    assert "`meshtron train` will refuse this plan: plan.schedule='dualpipe'" in said
    assert "(dtype bf16; " in said  # the dtype is not what is refused
    assert "trains in it" not in said
    rc, _, err = cli("train", "--plan", str(plan))
    assert rc == 2 and "Traceback" not in err and err.strip().count("\n") == 0
    assert "DeepSeek's DualPipe runs only in DeepSeek's own stack" in err
    rc, _, err = cli("simulate", "--step", "--plan", str(plan), "--options", str(opts))
    assert rc == 2 and "Traceback" not in err and err.strip().count("\n") == 0
    assert "walks torch.distributed.pipelining's schedules, not DeepSeek's DualPipe" in err


def test_a_rank_whose_two_stages_differ_holds_each_at_its_own_count():
    """dualpipe.py's steps: rank r holds PP - r micro-batches of stage r and r + 1 of stage
    PP-1-r. PP = 4, rank 0 of [3, 1, 1, 1]: 3 x 4 + 1 x 1 = 13 block-micro-batches; of
    [1, 1, 1, 3]: 1 x 4 + 3 x 1 = 7 (the README's equal chunks: 2.5 x 4 = 10 for both)."""
    assert pipeline_dualpipe.rank_in_flight([3, 1, 1, 1], 2) == [13 / 4, 5 / 2]
    assert pipeline_dualpipe.rank_in_flight([2, 2, 2, 2], 2) == [2.5, 2.5]
    model = PRESETS["llama3-8b"].replace(layers=6)
    ev = _deepseek_evaluator(model)
    plan = Plan(tp=1, pp=4, dp=8, zero=1, micro_batch=1, recompute="full",
                schedule="dualpipe", dtype="bf16")
    front = ev.evaluate(dataclasses.replace(plan, stage_layers=(3, 1, 1, 1)), stage=0)
    back = ev.evaluate(dataclasses.replace(plan, stage_layers=(1, 1, 1, 3)), stage=0)

    def acts(e):
        return e.memory.activations + e.memory.in_flight
    assert acts(front) / acts(back) == pytest.approx(13 / 7, rel=1e-6)


def test_dualpipe_at_pp_2_is_refused_in_one_line_not_folded_into_an_invalid_plan(plan_cli,
                                                                                  tmp_path):
    """DualPipe is priced as the V it is per rank on pp/2 ranks (pipeline_dualpipe.fold): at
    pp 2 that fold is pp 1, which Plan refuses. The open search of DeepSeek's stack on 16 GPUs
    reached pp 2 and stopped with that inner plan's "needs plan.pp > 1" though no pp 1 was
    asked; pinned pp 2 answered the same. Now the validity function refuses pp 2 for DualPipe
    (the search skips it, a pinned layout gets the reason) and DualPipeV at pp 2 still runs."""
    import json

    opts = tmp_path / "deepseek.toml"
    opts.write_text('framework = "megatron@2024"\n[options]\npipeline_split = "dualpipe"\n')
    base = ("--model", "llama3-8b", "--cluster", "dgx-h100:2", "--global-batch", "64",
            "--seq-len", "4096", "--options", str(opts))
    rc, out, err = plan_cli(*base, "--schedule", "dualpipe", "--json", "--top", "3")
    assert rc == 0, err
    assert all(p["pp"] >= 4 for p in json.loads(out)["plans"])
    rc, out, err = plan_cli(*base, "--layout", "tp=1,pp=2", "--schedule", "dualpipe")
    assert rc == 2 and "Traceback" not in err and err.strip().count("\n") == 0, err
    assert "plan.pp=2: DualPipe on two ranks" in err, err
    rc, out, err = plan_cli(*base, "--layout", "tp=1,pp=2", "--schedule", "dualpipev",
                            "--json", "--top", "1")
    assert rc == 0, err
    assert json.loads(out)["plans"][0]["virtual_stages"] == 2


def test_plan_help_names_what_dualpipe_needs(plan_cli, tmp_path):
    """`meshtron plan --help` said pipeline_split = "dualpipe" in --options was enough; with
    meshtron's own (default) stack the runtime's refusal still answers. The help names the
    other stack too, and what it names works where the options file alone does not."""
    import subprocess
    import sys

    help_text = subprocess.run([sys.executable, "-m", "meshtron", "plan", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    flat = " ".join(help_text.split())
    assert 'pipeline_split = "dualpipe"' in flat and "other than meshtron's" in flat
    assert 'framework = "megatron@2024"' in flat
    base = ("--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch", "256",
            "--seq-len", "4096", "--layout", "tp=1,pp=4,dp=8", "--schedule", "dualpipe")
    alone = tmp_path / "alone.toml"
    alone.write_text('[options]\npipeline_split = "dualpipe"\n')
    rc, _, err = plan_cli(*base, "--options", str(alone))
    assert rc == 2 and "DeepSeek's DualPipe runs only in DeepSeek's own stack" in err
    named = tmp_path / "named.toml"
    named.write_text('framework = "megatron@2024"\n[options]\npipeline_split = "dualpipe"\n')
    rc, _, err = plan_cli(*base, "--options", str(named))
    assert rc == 0, err
