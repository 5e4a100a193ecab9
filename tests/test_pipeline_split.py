"""Each stack's own layer-to-stage split (planner/pipeline_split.py, plan_rules.split_problem)
and what torch.distributed.pipelining's gradient reduction costs a pipeline rank
(pipeline.reduce_after_drain)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.model.spec import PRESETS
from meshtron.planner import Plan, resolve_cluster
from meshtron.planner import comm, pipeline
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.memory import layer_params_local
from meshtron.planner.pipeline_split import chunks, deepspeed_split, megatron_split
from meshtron.planner.plan_rules import plan_problems, split_problem
from testkit.pipeline_walk import event_walk
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

L405 = ("--model", "llama3-405b", "--cluster", "dgx-h100:64", "--global-batch", "512",
        "--seq-len", "8192")


# ---- the rules ---------------------------------------------------------------------------------
def test_megatron_2021_needs_layers_divisible_by_pp_and_chunks():
    assert split_problem("megatron-even", 32, 4) is None
    assert split_problem("megatron-even", 32, 4, 2) is None  # 4 layers per chunk
    problem = split_problem("megatron-even", 30, 4)
    assert problem.startswith("plan.pp=4: the model's 30 layers are not divisible")
    assert "\n" not in problem
    assert split_problem("megatron-even", 32, 4, 3) is not None  # 8 per stage, 3 chunks
    # torchtitan's split points and meshtron's runtime express any split
    assert split_problem("any", 30, 4) is None
    assert split_problem(None, 30, 4) is None


def test_megatron_core_sets_the_end_stages_apart():
    # --decoder-first/last-pipeline-num-layers: 30 = 7 + 8 + 8 + 7
    assert split_problem("megatron-ends", 30, 4) is None
    assert split_problem("megatron-ends", 30, 4, stage_layers=[7, 8, 8, 7]) is None
    # middle stages must stay equal
    assert split_problem("megatron-ends", 30, 4, stage_layers=[7, 9, 7, 7]) is not None
    # account_for_embedding/loss_in_pipeline_split: 126 + 2 = 128 = 8 stages x 8 chunks x 2
    assert split_problem("megatron-ends", 126, 8, 8) is None
    # neither form: 125 layers, 8 chunks per stage (125 % 8, 126 and 127 not multiples of 64)
    assert split_problem("megatron-ends", 125, 8, 8) is not None
    # one counted layer per chunk: the very first and last chunks build none (Megatron-Core
    # asserts >= 0 layers there), 126 + 2 = 8 stages x 16 chunks
    assert split_problem("megatron-ends", 126, 8, 16) is None
    n = megatron_split("megatron-ends", 126, 8, 16, 1.0, 0.1, 1.0)
    assert n == [15] + [16] * 6 + [15]
    c = chunks("megatron-ends", n, 16)
    assert c[0] == 0 and c[-1] == 0 and set(c[1:-1]) == {1}
    assert plan_problems({"pp": 8, "virtual_stages": 16, "stage_layers": c}, None,
                         PRESETS["llama3-405b"], runtime=False, split="megatron-ends") == []


def test_megatron_split_is_expressible_and_the_fastest_of_those():
    # identical layers, a head worth two layers on the last stage
    n = megatron_split("megatron-ends", 30, 4, 1, 1.0, 0.0, 2.0)
    assert sum(n) == 30 and len(set(n[1:-1])) == 1
    assert split_problem("megatron-ends", 30, 4, stage_layers=n) is None
    best = pipeline.partition_layers(30, 4, 1.0, 0.0, 2.0)  # any split: 32 units over 4
    slowest = max(n[0], n[1], n[-1] + 2.0)
    assert slowest == max(best[0], best[1], best[2], best[-1] + 2.0) == 8  # [8, 8, 8, 6]
    assert megatron_split("megatron-even", 30, 4, 1, 1.0, 0.0, 2.0) is None
    assert megatron_split("megatron-even", 32, 4, 1, 1.0, 0.0, 2.0) == [8, 8, 8, 8]
    # Llama 3 405B on 16 stages: one layer less on the first and the last (Meta's split)
    assert megatron_split("megatron-ends", 126, 16, 1, 1.0, 0.5, 1.0) == [7] + [8] * 14 + [7]


def test_megatron_account_for_chunks_short_at_the_pipeline_ends():
    n = megatron_split("megatron-ends", 126, 8, 8, 1.0, 0.1, 1.0)
    assert n == [15] + [16] * 6 + [15]
    c = chunks("megatron-ends", n, 8)
    assert c[0] == 1 and c[-1] == 1 and set(c[1:-1]) == {2}
    assert split_problem("megatron-ends", 126, 8, 8, stage_layers=c) is None
    # meshtron's spread of the same counts is not one Megatron builds
    spread = pipeline.split_virtual(n, 8)
    assert split_problem("megatron-ends", 126, 8, 8, stage_layers=spread) is not None


def test_deepspeed_partition_fills_the_first_stages():
    # type:transformer weighs blocks only: 10 blocks on 4 stages -> _lprobe's 3, 3, 3, 1
    assert deepspeed_split(10, 4, (0.0, 1.0, 0.0)) == [3, 3, 3, 1]
    assert deepspeed_split(105, 35, (0.0, 1.0, 0.0)) == [3] * 35
    # 'parameters': an embedding and a head of half a block each move a block inward
    assert deepspeed_split(30, 4, (0.5, 1.0, 0.5)) == [7, 8, 8, 7]
    # a stage left without blocks is not priced
    assert deepspeed_split(9, 4, (0.0, 1.0, 0.0)) is None


def test_deepspeed_2024_partitions_by_its_dynamic_programme():
    """DeepSpeed >= 0.12.5 (PR #4312; deepspeed@2024 is 0.14-0.16) replaced the left-greedy
    probe by a dynamic programme that keeps the smallest heaviest-minus-lightest stage: 10
    equal blocks on 4 stages are 3, 3, 2, 2 (a difference of 1), not _lprobe's 3, 3, 3, 1
    (2), and 9 blocks on 4 stages split (3, 2, 2, 2) where the older probe left one empty."""
    from meshtron.planner.pipeline_split import deepspeed_dp_split, split_for

    assert deepspeed_dp_split(10, 4, (0.0, 1.0, 0.0)) == [3, 3, 2, 2]
    assert deepspeed_dp_split(9, 4, (0.0, 1.0, 0.0)) == [3, 2, 2, 2]
    # the older probe's answer when both are balanced
    assert deepspeed_dp_split(30, 4, (0.5, 1.0, 0.5)) == [7, 8, 8, 7]
    # the heaviest-minus-lightest programme is path-dependent, not the min-max split: an
    # 80-block model with heavy ends (what 0.14's PipelineModule gives a Llama's embedding)
    got = deepspeed_dp_split(80, 8, (1.0, 0.8, 1.0))
    assert got == [9, 10, 10, 10, 11, 11, 10, 9] and sum(got) == 80
    # the 2024 preset's rule prices it; the 2021 rule keeps the probe
    assert split_for("deepspeed-parameters", 10, 4, 1, 1.0, 0.0, 0.0,
                     weights=(0.0, 1.0, 0.0)) == [3, 3, 2, 2]
    assert split_for("deepspeed-transformer", 10, 4, 1, 1.0, 0.0, 0.0) == [3, 3, 3, 1]
    # memoised: a caller's list is its own
    got.append(0)
    assert deepspeed_dp_split(80, 8, (1.0, 0.8, 1.0)) == [9, 10, 10, 10, 11, 11, 10, 9]


def test_deepspeed_0_12_5_partition_keeps_the_stages_range_least():
    """deepspeed@2024 (DeepSpeed 0.14-0.16) partitions 'parameters' with the dynamic programme
    of microsoft/DeepSpeed#4312 (0.12.5+), not 0.3.15's bottleneck fill: the pipes work priced
    the fill, which on Llama 3 8B over 8 stages leaves the last stage only the head (None
    here), and the evaluator then fell back to a split DeepSpeed does not build."""
    from meshtron.planner.memory import (embedding_params_local, head_params_local,
                                         layer_params_local)
    from meshtron.planner.pipeline_split import deepspeed_dp_split
    # type weights: the fill gives 3, 3, 3, 1 (range 2); the programme a range of 1, its last
    # cut on ties (DeepSpeed's `>=`), so the surplus on the first stages
    assert deepspeed_dp_split(10, 4, (0.0, 1.0, 0.0)) == [3, 3, 2, 2]
    assert deepspeed_dp_split(30, 4, (0.5, 1.0, 0.5)) == [7, 8, 8, 7]  # as the fill
    # ends of three blocks' weight each would hold only them (stage sums 3, 3, 3, 3)
    assert deepspeed_dp_split(6, 4, (3.0, 1.0, 3.0)) is None  # ends holding no block: that pp is left out
    m = PRESETS["llama3-8b"]
    w = (embedding_params_local(m, 1), layer_params_local(m, 1, 8), head_params_local(m, 1, 8))
    assert deepspeed_split(32, 8, w) is None  # the fill: 2, 5 x 6 and the head alone
    n = deepspeed_dp_split(32, 8, w)
    assert n == [2, 5, 5, 5, 5, 4, 4, 2]
    sums = [k * w[1] + (w[0] if i == 0 else 0.0) + (w[2] if i == 7 else 0.0)
            for i, k in enumerate(n)]
    assert max(sums) - min(sums) <= w[1]  # one block: 28 middle blocks over 6 stages
    # through the evaluator: the deepspeed@2024 preset prices that split
    fw = preset("deepspeed@2024")
    ev = Evaluator(m, resolve_cluster("dgx-a100:4"), 64, 2048, fw.kernel, mem=fw.memory)
    plan = Plan(tp=1, pp=8, dp=4, zero=1, micro_batch=1, recompute="full", schedule="1f1b",
                dtype="bf16")
    assert ev.evaluate(plan).stage_layers == [2, 5, 5, 5, 5, 4, 4, 2]


def test_the_validity_function_carries_the_stack_rule():
    model = PRESETS["llama3-405b"]
    k = {"tp": 8, "pp": 8, "dp": 8}
    assert plan_problems(k, 512, model, runtime=False) == []
    problems = plan_problems(k, 512, model, runtime=False, split="megatron-even")
    assert problems and "126 layers" in problems[0]
    assert plan_problems(k, 512, model, runtime=False, split="megatron-ends") == []


# ---- through the command line ------------------------------------------------------------------
def test_a_pinned_layout_megatron_2021_cannot_split_is_priced_on_uneven_ends(plan_cli):
    """Issue 30: a published layout is answered. 126 layers over pp=8 is not one of Megatron-LM
    2021's equal splits: priced on the uneven end stages Megatron-Core 0.9+ runs, with one
    warning naming the rule and the split priced."""
    rc, out, err = plan_cli(*L405, "--framework", "megatron@2021", "--layout", "tp=8,pp=8,dp=8",
                            "--schedule", "1f1b", "--json", "--top", "1")
    assert rc == 0
    doc = json.loads(out)
    plan = doc["plans"][0]
    assert plan["stage_layers"] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert split_problem("megatron-ends", 126, 8, 1, plan["stage_layers"]) is None
    # Megatron-LM 2021 has no ZeRO (plan_rules_zero): its replicated optimizer states do not
    # fit this layout, priced anyway (pinned) with the memory warning after the split's
    assert plan["step_time_s"] > 0 and plan["zero"] == 0 and doc["pinned"]
    warning, memory = doc["warnings"]
    assert memory.startswith("predicted not to fit")
    assert warning.startswith("megatron@2021 cannot split this pinned layout")
    assert "126 layers" in warning and "15,16,16,16,16,16,16,15" in warning
    assert "--decoder-first/last-pipeline-num-layers" in warning
    assert err.strip().splitlines()[0] == f"warning: {warning}"  # on stderr, one line each
    assert len(err.strip().splitlines()) == 2
    # the text output prints it too
    rc, out, _ = plan_cli(*L405, "--framework", "megatron@2021", "--layout", "tp=8,pp=8,dp=8",
                          "--schedule", "1f1b", "--top", "1")
    assert rc == 0 and "Warning: megatron@2021 cannot split" in " ".join(out.split())


def test_the_warning_names_the_megatron_core_release_that_runs_the_split():
    """Megatron-Core 0.9 and 0.10 assert uneven stages without interleaving
    (transformer_block.get_num_layers_to_build); 0.11 builds uneven virtual stages and the
    account_for_* split; 0.13 (ADLR/megatron-lm!2795) any layout."""
    from meshtron.planner.pipeline_split import configured_as
    ends = [15] + [16] * 6 + [15]
    assert "(Megatron-Core >= 0.9)" in configured_as("megatron-even", "megatron-ends", ends, 1)
    text = configured_as("megatron-even", "megatron-ends", [14] + [16] * 6 + [16], 2)
    assert "--num-virtual-stages-per-pipeline-rank (Megatron-Core >= 0.11)" in text
    assert "account_for_embedding/loss_in_pipeline_split (Megatron-Core >= 0.11)" in \
        configured_as("megatron-even", "megatron-ends", ends, 8)
    assert ">= 0.13" in configured_as("megatron-ends", "any", ends, 1)
    assert "DeepSpeed" in configured_as("deepspeed-transformer", "any", ends, 1)


def test_a_layout_pinned_by_the_gpu_count_is_answered_too(plan_cli):
    # tp and dp fixed leave pp=8 on 512 GPUs
    rc, out, _ = plan_cli(*L405, "--framework", "megatron@2021", "--layout", "tp=8,dp=8",
                          "--schedule", "1f1b", "--json", "--top", "1")
    assert rc == 0
    doc = json.loads(out)
    # two warnings: the split's, and the memory one (megatron@2021 runs zero 0 only)
    assert doc["plans"][0]["pp"] == 8 and len(doc["warnings"]) == 2
    assert "126 layers" in doc["warnings"][0]


def test_a_fixed_pp_megatron_cannot_split_is_refused_when_the_layout_is_open(plan_cli):
    # pp=8 with tp (and so dp) open: the planner chooses the layout, the stack's rule stands
    rc, out, err = plan_cli(*L405, "--framework", "megatron@2021", "--layout", "pp=8")
    assert rc == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "plan.pp=8" in line and "126 layers" in line


def test_megatron_core_prices_virtual_stages_it_cannot_build_on_any_split(plan_cli):
    # 126 layers in 8 x 5 chunks: neither uneven ends (126 % 5) nor account_for (127, 128 are
    # not multiples of 40): priced on the time-balanced split pipeline_model_parallel_layout
    # can place
    assert split_problem("megatron-ends", 126, 8, 5) is not None
    rc, out, _ = plan_cli(*L405, "--framework", "megatron@2024", "--layout", "tp=8,pp=8,dp=8",
                          "--schedule", "interleaved:5", "--json", "--top", "1")
    assert rc == 0
    doc = json.loads(out)
    plan = doc["plans"][0]
    assert plan["virtual_stages"] == 5 and sum(plan["stage_layers"]) == 126
    assert len(plan["stage_layers"]) == 40
    assert "--pipeline-model-parallel-layout" in doc["warnings"][0]


def test_a_pinned_interleaved_schedule_no_chunk_count_of_the_stack_splits(plan_cli, tmp_path):
    # 125 layers on pp=8: Megatron-Core splits none of v = 2, 3, 4, 6, 8 (125 % v, and 126
    # and 127 are not multiples of 8v); `--schedule interleaved` fixed, v searched
    model = tmp_path / "m.toml"
    model.write_text('[model]\npreset = "llama3-405b"\nlayers = 125\n')
    args = ("--model", str(model), "--cluster", "dgx-h100:64", "--global-batch", "512",
            "--seq-len", "8192", "--framework", "megatron@2024", "--layout", "tp=8,pp=8,dp=8",
            "--schedule", "interleaved", "--json", "--top", "1")
    rc, out, _ = plan_cli(*args)
    assert rc == 0
    doc = json.loads(out)
    plan = doc["plans"][0]
    assert plan["schedule"] == "interleaved" and sum(plan["stage_layers"]) == 125
    assert "no searched virtual_stages (2, 3, 4, 6, 8)" in doc["warnings"][0]
    # pp open: the search leaves those splits out (no pp=8 plan), and warns about nothing
    rc, out, _ = plan_cli(*args[:-7], "--layout", "tp=8", "--schedule", "interleaved",
                          "--zero", "1", "--recompute", "full", "--sp", "on", "--micro-batch",
                          "1", "--json", "--top", "10")
    # (only pp=2, v=3 splits 125 + 1: its 2-byte weights and 4-byte grad buffer, which
    # Megatron-Core's optimizer offload keeps on the device, need 150 GB: nothing fits)
    doc = json.loads(out)
    assert rc == 2 and doc["warnings"] == [] and not doc["plans"]
    assert (doc["near_miss"]["pp"], doc["near_miss"]["virtual_stages"]) == (2, 3)


def test_deepspeed_pinned_layout_without_blocks_on_the_last_stage_is_answered(plan_cli):
    # 32 blocks over 12 stages: partition_balanced fills 3 per stage and leaves the last empty
    args = ("--model", "llama3-8b", "--cluster", "dgx-h100:12", "--global-batch", "96",
            "--seq-len", "4096", "--layout", "tp=8,pp=12,dp=1", "--json", "--top", "1")
    rc, out, _ = plan_cli(*args, "--framework", "deepspeed@2021")
    assert rc == 0
    doc = json.loads(out)
    plan = doc["plans"][0]
    assert min(plan["stage_layers"]) > 0 and sum(plan["stage_layers"]) == 32
    assert plan["schedule"] == "1f1b" and plan["virtual_stages"] == 1  # still its engine's
    assert "partition_balanced" in doc["warnings"][0]


def test_a_split_priced_instead_keeps_the_stacks_engine():
    """The split priced instead is only the split: DeepSpeed's engine keeps its pipe buffers
    (memory_pipeline.deepspeed_pipe_buffers), its schedules stay its own (search_space)."""
    ds = preset("deepspeed@2021")
    model, cluster = PRESETS["llama3-8b"], resolve_cluster("dgx-a100:4")
    plan = Plan(tp=1, pp=4, dp=8, zero=1, micro_batch=1, recompute="full", schedule="1f1b",
                dtype="bf16")

    def stage1(mem):
        return Evaluator(model, cluster, 64, 2048, ds.kernel, mem=mem).evaluate(plan, stage=1)

    priced = stage1(dataclasses.replace(ds.memory, split_priced="any"))
    plain = stage1(dataclasses.replace(ds.memory, pipeline_split="any"))
    assert priced.stage_layers == plain.stage_layers != [8, 8, 8, 8]
    assert priced.memory.total > plain.memory.total  # the engine's buffers
    assert dataclasses.replace(ds.memory, split_priced="any").engine == "deepspeed-transformer"


def test_a_split_the_stack_cannot_build_is_saved_with_the_warning(plan_cli, tmp_path):
    from meshtron.planner.plan import load_plan
    path = tmp_path / "plan.toml"
    # pp=32: Megatron-LM 2021's replicated optimizer states (zero 0) and its activations
    # without sequence parallelism (which it had not) fit, unlike at pp=16
    rc, out, _ = plan_cli(*L405, "--framework", "megatron@2021", "--layout", "tp=8,pp=32,dp=2",
                          "--schedule", "1f1b", "--top", "1", "--save", str(path))
    assert rc == 0 and "not megatron@2021's own" in " ".join(out.split())
    assert list(load_plan(path).stage_layers) == [3] + [4] * 30 + [3]


def test_a_split_priced_instead_that_does_not_fit_says_both(plan_cli, tmp_path):
    args = (*L405, "--framework", "megatron@2021", "--layout", "tp=8,pp=8,dp=8", "--recompute",
            "none", "--zero", "0", "--offload", "none", "--top", "1")
    rc, out, err = plan_cli(*args, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["pinned"] and not doc["fits"]
    split, memory = doc["warnings"]
    assert "cannot split" in split and memory.startswith("predicted not to fit")
    assert err.count("\n") == 2
    # --save refuses the plan predicted not to fit (planner/pinned.py), not the split
    rc, out, err = plan_cli(*args, "--save", str(tmp_path / "p.toml"))
    assert rc == 2 and "predicted not to fit" in err and not (tmp_path / "p.toml").exists()


def test_a_schedule_the_stack_has_no_engine_for_stays_refused(plan_cli):
    for fw, sched in (("megatron@2021", "zb"), ("megatron@2024", "gpipe"),
                      ("deepspeed@2021", "interleaved:2"), ("deepspeed", "zb")):
        rc, out, err = plan_cli(*L405, "--framework", fw, "--layout", "tp=8,pp=8,dp=8",
                                "--schedule", sched)
        assert rc == 2 and out == "", fw
        assert "\n" not in err.strip() and "plan.schedule=" in err, (fw, err)


def test_megatron_search_proposes_only_expressible_splits(plan_cli):
    # Megatron-LM 2021 (no ZeRO, equal stages: pp divides 126) fits llama3-405b on 126 nodes
    # (tp=8,pp=63,dp=2), not on 64 (pp 1 or 2 only: 470 GiB per GPU of replicated states)
    on_126 = (*L405[:2], "--cluster", "dgx-h100:126", *L405[4:])
    for fw, rule, args in (("megatron@2021", "megatron-even", on_126),
                           ("megatron@2024", "megatron-ends", L405)):
        rc, out, _ = plan_cli(*args, "--framework", fw, "--json", "--top", "10")
        assert rc == 0
        plans = json.loads(out)["plans"]
        assert plans and json.loads(out)["warnings"] == []  # nothing priced off the rule
        for p in plans:
            if p["pp"] > 1:
                assert split_problem(rule, 126, p["pp"], p["virtual_stages"],
                                     p["stage_layers"]) is None, (fw, p)
    # a pinned pp=8 on Megatron-Core: only its own splits, every schedule
    rc, out, _ = plan_cli(*L405, "--framework", "megatron@2024", "--layout", "tp=8,pp=8,dp=8",
                          "--json", "--top", "5")
    assert rc == 0
    for p in json.loads(out)["plans"]:
        assert split_problem("megatron-ends", 126, 8, p["virtual_stages"],
                             p["stage_layers"]) is None, p


def test_meshtron_keeps_its_time_balanced_split(plan_cli):
    args = ("--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch", "64",
            "--seq-len", "4096", "--layout", "tp=1,pp=4,dp=8", "--schedule", "1f1b", "--json",
            "--top", "1")
    rc, out, _ = plan_cli(*args)
    mesh = json.loads(out)["plans"][0]
    rc2, out2, _ = plan_cli(*args, "--framework", "megatron@2021")
    mega = json.loads(out2)["plans"][0]
    assert rc == rc2 == 0
    assert mega["stage_layers"] == [8, 8, 8, 8]
    # the 128k-vocabulary head weighs about two blocks: meshtron gives the last stage fewer
    assert mesh["stage_layers"][-1] < 8 and sum(mesh["stage_layers"]) == 32
    assert split_problem("megatron-even", 32, 4, stage_layers=mesh["stage_layers"]) is not None


# ---- FSDP2's gradient reduction under torch.distributed.pipelining ------------------------------
def test_reduce_after_drain_is_exposed_on_rank_zero_and_hidden_by_the_drain():
    rs, bwd = 0.4, 1.0
    assert pipeline.reduce_after_drain(rs, 1, 0, bwd, interference=0.0) == pytest.approx(rs)
    assert pipeline.reduce_after_drain(rs, 1, 1, bwd, interference=0.0) == pytest.approx(0.0)
    # interleaved: the compute stream waits for each chunk's reductions (FSDP2's
    # finalize_backward), so nothing but the drain hides them: rank 0 pays them whole, a later
    # rank hides its last chunk's behind the drain only
    assert pipeline.reduce_after_drain(rs, 2, 0, bwd, interference=0.0) == pytest.approx(rs)
    assert pipeline.reduce_after_drain(4.0, 2, 0, bwd, interference=0.0) == pytest.approx(4.0)
    assert pipeline.reduce_after_drain(rs, 2, 1, bwd, interference=0.0) == pytest.approx(rs / 2)


def _drain_walk(p: int, v: int, m: int, f: float, b: float, stall: list[float],
                schedule: str = "interleaved") -> float:
    """Makespan of the schedule's device orders (simulate/schedule.py; interleaved at v = 1 is
    1F1B), chunk forwards f and backwards b, each rank's compute stream stalled `stall[rank]`
    after each chunk's last backward (torch pipelining's REDUCE_GRAD waiting for FSDP2's
    reductions)."""
    from meshtron.simulate.schedule import device_orders

    orders = device_orders(schedule if v > 1 else "1f1b", p, v, m)
    last = {s: (kind, s, j) for order in orders for kind, s, j in order if kind == "B"}
    return event_walk(orders, p * v, lambda kind, _: f if kind == "F" else b,
                      stall=lambda r, op: stall[r] if last[op[1]] == op else 0.0)


@pytest.mark.parametrize("schedule,p,v,m", [
    ("interleaved", 4, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 8, 2, 16),
    ("interleaved", 4, 4, 8), ("interleaved", 2, 3, 4),
    # torch's Interleaved1F1B with fewer micro-batches than stages: one round of all m
    ("interleaved", 8, 2, 4), ("interleaved", 4, 3, 1), ("interleaved", 8, 2, 7),
    # looped BFS, and fewer micro-batches than stages: each chunk change idles p - m slots
    ("gpipe", 4, 2, 8), ("gpipe", 4, 2, 2), ("gpipe", 8, 3, 4), ("gpipe", 8, 2, 7)])
def test_reduce_after_drain_matches_an_event_walk_of_the_schedule(schedule, p, v, m):
    f, b = 1.0, 2.0  # per chunk and micro-batch
    base = _drain_walk(p, v, m, f, b, [0.0] * p, schedule)
    for per_chunk in (0.5, 3.0, 7.0, 11.0):
        for rank in range(p):
            stall = [0.0] * p
            stall[rank] = per_chunk
            walked = _drain_walk(p, v, m, f, b, stall, schedule) - base
            model = pipeline.reduce_after_drain(v * per_chunk, v, rank, v * b, max(0, p - m),
                                                0.0)
            assert model == pytest.approx(walked), (rank, per_chunk)


@pytest.mark.parametrize("schedule,p,v,m", [
    ("interleaved", 4, 2, 2), ("interleaved", 8, 2, 4), ("interleaved", 4, 3, 1),
    ("interleaved", 8, 2, 7), ("interleaved", 4, 2, 8)])
def test_interleaved_bubble_is_the_simulators_walk(schedule, p, v, m):
    """pipeline.bubble_time's m < p idle (p - m chunk-slots per chunk change) is also the
    makespan of the simulator's interleaved 1F1B order (torch's Interleaved1F1B: one round of
    all m; test_looped_bubble_counts_the_wait_for_the_wave_when_m_is_below_p walks GPipe's)."""
    f, b = 1.0, 2.0  # per chunk and micro-batch
    walked = _drain_walk(p, v, m, f, b, [0.0] * p, schedule)
    stage = v * (f + b)
    assert walked == pytest.approx(m * stage + pipeline.bubble_time(schedule, v, [stage] * p,
                                                                     [0.0] * p, m))


def test_torchtitan_pipeline_pays_rank_zeros_reduce_scatter_whole():
    """torchtitan (FSDP2 + pipelining) ZeRO-3 at pp=2: the first stage's gradient
    reduce-scatter waits for its last backward and nothing hides it."""
    fw = preset("torchtitan")
    model, cluster = PRESETS["llama3-70b"], resolve_cluster("dgx-h100:16")
    ev = Evaluator(model, cluster, 256, 4096, fw.kernel, mem=fw.memory)
    plan = Plan(tp=8, pp=2, dp=8, zero=3, micro_batch=1, recompute="full", sp=True,
                schedule="1f1b", dtype="bf16")
    est = ev.evaluate(plan)
    groups = ev._groups(plan)
    layers0 = est.stage_layers[0]
    params0 = layers0 * layer_params_local(model, 8, 2)
    rs = comm.reduce_scatter(4.0 * params0, groups["dp_shard"], ev.fab)  # fp32 reduce
    assert rs > 0.05  # big enough to matter
    assert est.time.dp_comm >= 0.95 * rs


# ---- the looped schedules' bubble --------------------------------------------------------------
def _looped_makespan(p: int, v: int, m: int, f: float, b: float) -> float:
    """Dependency simulation of a looped schedule run chunk by chunk (looped BFS; torch's
    Interleaved1F1B with m < p is all forwards first too: its warm-up covers every forward):
    device d runs F of virtual stage c*p + d for micro-batches 0..m-1, chunk after chunk, then
    the backwards in reverse; an F waits for the previous virtual stage's F of its micro-batch,
    a B for the next virtual stage's B (or, on the last, its own F)."""
    n = p * v
    done: dict[tuple[str, int, int], float] = {}
    orders = [[("F", c * p + d, j) for c in range(v) for j in range(m)]
              + [("B", c * p + d, j) for c in reversed(range(v)) for j in range(m)]
              for d in range(p)]
    clock, pos = [0.0] * p, [0] * p
    while any(pos[d] < len(orders[d]) for d in range(p)):
        for d in range(p):
            while pos[d] < len(orders[d]):
                kind, s, j = orders[d][pos[d]]
                dep = (("F", s - 1, j) if s > 0 else None) if kind == "F" else \
                    (("B", s + 1, j) if s < n - 1 else ("F", s, j))
                if dep is not None and dep not in done:
                    break
                start = max(clock[d], done.get(dep, 0.0))
                clock[d] = start + (f if kind == "F" else b) / v
                done[(kind, s, j)] = clock[d]
                pos[d] += 1
    return max(clock)


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 1, 2), (4, 2, 8), (4, 2, 4), (4, 2, 2),
                                   (8, 4, 3), (4, 3, 1)])
def test_looped_bubble_counts_the_wait_for_the_wave_when_m_is_below_p(p, v, m):
    f, b = 1.0, 2.0
    span = _looped_makespan(p, v, m, f, b)
    t = [f + b] * p
    assert m * (f + b) + pipeline.bubble_time("gpipe", v, t, [0.0] * p, m) == \
        pytest.approx(span)
    # the interleaved schedule has the same fill and, with m < p, the same wait
    assert pipeline.bubble_time("interleaved", v, t, [0.0] * p, m) == \
        pipeline.bubble_time("gpipe", v, t, [0.0] * p, m)
    if m < p and v > 1:  # without the wait the formula is short by (v-1)(p-m) chunk-times
        assert pipeline.bubble_time("interleaved", v, t, [0.0] * p) < \
            pipeline.bubble_time("interleaved", v, t, [0.0] * p, m)


def test_megatron_pays_the_tied_embedding_all_reduce_between_the_pipeline_ends():
    fw = preset("megatron@2021")
    tied = PRESETS["gpt3-175b"]
    assert tied.tied_embeddings
    untied = dataclasses.replace(tied, tied_embeddings=False)
    cluster = resolve_cluster("dgx-a100:16")
    plan = Plan(tp=8, pp=8, dp=2, zero=1, micro_batch=1, recompute="full", schedule="1f1b",
                dtype="bf16")
    t = Evaluator(tied, cluster, 512, 2048, fw.kernel, mem=fw.memory).evaluate(plan)
    u = Evaluator(untied, cluster, 512, 2048, fw.kernel, mem=fw.memory).evaluate(plan)
    ev = Evaluator(tied, cluster, 512, 2048, fw.kernel, mem=fw.memory)
    grad = 4.0 * tied.vocab * tied.hidden / 8  # fp32 main_grad of the tied word embedding
    expected = comm.all_reduce(grad, comm.Group(2, 1), ev.fab)  # stages on different nodes
    assert expected > 1e-3
    assert t.time.pp_comm - u.time.pp_comm == pytest.approx(expected, rel=1e-6)


# ---- the schedules each stack's engine runs ----------------------------------------------------
def test_stacks_run_only_their_engines_schedules():
    from meshtron.planner.plan_rules import schedule_problem
    assert schedule_problem("megatron-ends", "interleaved", 8, 4) is None
    assert schedule_problem("megatron-even", "1f1b", 8, 1) is None
    assert "Megatron-Core runs 1F1B" in schedule_problem("megatron-ends", "zb", 8, 1)
    assert schedule_problem("megatron-even", "gpipe", 8, 1) is not None
    assert schedule_problem("deepspeed-transformer", "interleaved", 8, 2) is not None
    assert "virtual_stages=2" in schedule_problem("deepspeed-parameters", "1f1b", 8, 2)
    for s in ("1f1b", "interleaved", "zb", "gpipe"):  # torch.distributed.pipelining
        assert schedule_problem("any", s, 8, 2) is None
    assert schedule_problem("megatron-ends", "zb", 1, 1) is None  # no pipeline


def test_megatron_and_deepspeed_plans_use_their_engines_schedules(plan_cli):
    rc, out, err = plan_cli(*L405, "--framework", "megatron@2024", "--layout", "tp=8,pp=8,dp=8",
                            "--schedule", "zb")
    assert rc == 2 and out == "" and "\n" not in err.strip()
    assert "plan.schedule='zb'" in err and "Traceback" not in err
    for fw, allowed in (("megatron@2024", {"1f1b", "interleaved"}),
                        ("deepspeed@2021", {"1f1b"})):
        rc, out, _ = plan_cli(*L405, "--framework", fw, "--layout", "tp=8,pp=2,dp=32", "--json",
                              "--top", "10")
        assert rc == 0, fw
        plans = json.loads(out)["plans"]
        assert plans and {p["schedule"] for p in plans} <= allowed, fw
        if fw.startswith("deepspeed"):
            assert {p["virtual_stages"] for p in plans} == {1}
    # torchtitan and meshtron keep every torch schedule
    for fw in ("meshtron", "torchtitan"):
        rc, out, _ = plan_cli(*L405, "--framework", fw, "--layout", "tp=8,pp=8,dp=8",
                              "--schedule", "zb", "--json", "--top", "1")
        assert rc == 0 and json.loads(out)["plans"][0]["schedule"] == "zb", fw


def test_deepspeed_rule_and_a_direct_evaluation_refuse_what_the_stack_cannot_build():
    from meshtron.errors import UserError
    # 9 blocks on 4 stages: _lprobe gives 3, 3, 3 and nothing to the last stage
    assert "without blocks" in split_problem("deepspeed-transformer", 9, 4)
    assert split_problem("deepspeed-transformer", 10, 4) is None
    fw = preset("megatron@2021")
    ev = Evaluator(PRESETS["llama3-405b"], resolve_cluster("dgx-h100:64"), 512, 8192, fw.kernel,
                   mem=fw.memory)
    plan = Plan(tp=8, pp=8, dp=8, zero=1, micro_batch=1, recompute="full", sp=True,
                schedule="1f1b")
    with pytest.raises(UserError, match="126 layers"):
        ev.evaluate(plan)


def test_an_options_table_names_another_split_rule(plan_cli, tmp_path):
    """Megatron-Core 0.13+'s pipeline_model_parallel_layout places any layers: an [options]
    table says so; a rule that does not exist is refused by name."""
    opts = tmp_path / "any.toml"
    opts.write_text('framework = "megatron@2021"\n[options]\npipeline_split = "any"\n')
    rc, out, _ = plan_cli(*L405, "--options", str(opts), "--layout", "tp=8,pp=8,dp=8", "--json",
                          "--top", "1")
    assert rc == 0 and sum(json.loads(out)["plans"][0]["stage_layers"]) == 126
    bad = tmp_path / "bad.toml"
    bad.write_text('[options]\npipeline_split = "even"\n')
    rc, out, err = plan_cli(*L405, "--options", str(bad), "--layout", "tp=8,pp=8,dp=8")
    assert rc == 2 and "pipeline_split='even'" in err and "megatron-ends" in err
    assert "\n" not in err.strip()


def test_deepspeed_engine_keeps_its_pipe_buffers():
    from meshtron.planner.frameworks import with_options
    from meshtron.planner.memory import GIB
    from meshtron.planner.memory_pipeline import deepspeed_pipe_buffers, stage_output_bytes
    # stage s keeps max(2, min(pp - s, m)) buffers of (input, output), ends without one side
    assert deepspeed_pipe_buffers(4, 8) == [4 + 1, 3 * 2 + 2, 2 * 2 + 2, 2 + 1]
    assert deepspeed_pipe_buffers(1, 8) == [0.0]
    ds = preset("deepspeed@2021")
    even = with_options(ds, {"pipeline_split": "megatron-even"})  # same equal split, no buffers
    model, cluster = PRESETS["llama3-8b"], resolve_cluster("dgx-a100:4")
    plan = Plan(tp=1, pp=4, dp=8, zero=1, micro_batch=1, recompute="full", schedule="1f1b",
                dtype="bf16")

    def stage1(fw):
        est = Evaluator(model, cluster, 64, 2048, fw.kernel, mem=fw.memory).evaluate(plan,
                                                                                    stage=1)
        assert est.stage_layers == [8, 8, 8, 8]
        return est.memory.total

    extra = (stage1(ds) - stage1(even)) * GIB
    held = (3 * 2 + 2) * stage_output_bytes(model.hidden, 1, False, 1, 2048, 2.0)
    # the allocator's fragmentation allowance rides on top of the tensors
    assert held <= extra <= 1.1 * held


def test_megatron_interleaving_needs_its_micro_batch_counts():
    from meshtron.planner.plan_rules import schedule_problem
    assert "multiple of pp=8" in schedule_problem("megatron-even", "interleaved", 8, 2, 12)
    assert schedule_problem("megatron-even", "interleaved", 8, 2, 16) is None
    assert schedule_problem("megatron-ends", "interleaved", 8, 2, 12) is None  # group N = 12
    assert "at least pp=8" in schedule_problem("megatron-ends", "interleaved", 8, 2, 4)
    assert schedule_problem("megatron-ends", "1f1b", 8, 1, 4) is None
    assert schedule_problem("any", "interleaved", 8, 2, 4) is None  # torch: one round of 4
    k = {"tp": 8, "pp": 8, "dp": 8, "micro_batch": 1, "global_batch": 96,
         "schedule": "interleaved", "virtual_stages": 2}
    problems = plan_problems(k, 512, PRESETS["llama3-8b"], runtime=False, split="megatron-even")
    assert problems and "multiple of pp=8" in problems[0]
    bad = {**k, "dp": "eight"}  # the field rules speak first; nothing raises
    assert plan_problems(bad, 512, runtime=False, split="megatron-even")


def test_the_evaluator_passes_the_looped_schedules_idle_to_the_reduction(monkeypatch):
    """A torch-pipelined FSDP plan with fewer micro-batches than stages idles p - m
    chunk-slots at each chunk change (pipeline.bubble_time): the reduction's stalls hide there
    (pipeline.reduce_after_drain's `idle`), and only on looped schedules."""
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.plan import Plan

    seen = []
    real = pipeline.reduce_after_drain

    def spy(reduce_s, v, stage, bwd, idle=0, *rest):
        seen.append((v, idle))
        return real(reduce_s, v, stage, bwd, idle, *rest)

    monkeypatch.setattr(pipeline, "reduce_after_drain", spy)
    model, cluster = PRESETS["llama3-8b"], preset_cluster("dgx-h100", 2)
    for schedule, v, batch, want in (("interleaved", 2, 4, 2), ("interleaved", 2, 16, 0),
                                     ("gpipe", 2, 2, 3), ("1f1b", 1, 2, 0)):
        seen.clear()
        plan = Plan(tp=2, pp=4, dp=2, zero=1, micro_batch=1, recompute="full", sp=True,
                    schedule=schedule, virtual_stages=v, dtype="bf16")
        # m = batch / (dp * micro_batch)
        assert Evaluator(model, cluster, batch, 4096).evaluate(plan) is not None
        assert seen and {s for s in seen} == {(v, want)}, (schedule, batch, seen)


def test_megatron_core_builds_an_embedding_only_first_chunk(plan_cli):
    """Megatron-Core's account_for_embedding/loss_in_pipeline_split counts the embedding and
    the loss as a layer each: 126 layers on pp 16 with 8 chunks per rank (128 virtual stages,
    the Llama 3 paper's layout, section 3.3.2) is a split it builds, the very first chunk the
    embedding alone and the very last the loss alone; stacks without it are refused."""
    model = PRESETS["llama3-405b"]
    k = {"tp": 8, "pp": 16, "dp": 4, "virtual_stages": 8, "schedule": "interleaved"}
    assert plan_problems(k, 512, model, runtime=False, split="megatron-ends") == []
    problems = plan_problems(k, 512, model, runtime=False, split="any")
    assert problems and "more pipeline stages than model layers" in problems[0]
    rc, out, err = plan_cli(*L405, "--framework", "megatron@2024", "--layout",
                            "tp=8,pp=16,dp=4", "--schedule", "interleaved:8", "--json",
                            "--top", "1")
    assert rc == 0, err
    plan = json.loads(out)["plans"][0]
    assert plan["virtual_stages"] == 8
    assert plan["stage_layers"] == [0] + [1] * 126 + [0]
    rc, _, err = plan_cli(*L405, "--framework", "meshtron", "--layout", "tp=8,pp=16,dp=4",
                          "--schedule", "interleaved:8", "--json", "--top", "1")
    assert rc == 2 and "126" in err
