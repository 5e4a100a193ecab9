"""The stacks users name with `meshtron plan --framework NAME[@ERA]` (planner/frameworks.py):
each name through the command as a user types it, the one-line refusal of a name that is
none, and the published rows that price those stacks taking them from the presets, with
only their per-run settings as options (so the rows and the command line cannot drift)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from meshtron.planner.frameworks import for_model, resolve, with_options
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
L8 = ("--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
      "--seq-len", "8192", "--json", "--top", "1")


@pytest.mark.parametrize("name, key, facts", [
    ("megatron-bridge", "megatron-bridge@2025",
     {"tp_comm_overlap": True, "fp8_scaling": "te-current", "fp8_param_gather": True,
      "grad_bucket_passes": 1, "fp32_grad_reduce": True}),
    ("nemo-automodel", "nemo-automodel@2025",
     {"stack": "eager", "sharding": "fsdp", "fp32_grad_reduce": False, "optimizer": "foreach"}),
    ("automodel", "nemo-automodel@2025", {"torch_ring": True}),
    ("llm-foundry", "llm-foundry@2024",
     {"optimizer": "for-loop", "fp32_grad_reduce": True, "separate_projections": False}),
    ("llm-foundry@2023", "llm-foundry@2023", {"fp32_grad_reduce": False}),
    ("megatron-deepspeed", "deepspeed@2021",
     {"p2p_blocking": True, "zero1_all_reduce": True, "p2p_grads_whole": True}),
    ("gpt-neox", "gpt-neox@2022",
     {"stack": "eager", "dropout": False, "residual_reduce_once": True}),
    ("torchtitan@2024", "torchtitan@2024", {"optimizer": "foreach", "eager_norm": "python"}),
])
def test_each_stack_name_prices_a_plan(plan_cli, name, key, facts):  # noqa: F811
    rc, out, err = plan_cli(*L8, "--framework", name)
    assert rc == 0, err
    doc = json.loads(out)
    fw = doc["framework"]
    assert f"{fw['name']}@{fw['era']}" == key
    assert {k: fw["kernel"][k] for k in facts} == facts
    assert fw["reduce_dtype"] == ("fp32" if fw["kernel"]["fp32_grad_reduce"] else "bf16")
    assert doc["plans"] and doc["plans"][0]["step_time_s"] > 0


def test_the_stacks_memory_is_what_their_code_keeps(plan_cli):  # noqa: F811
    rc, out, _ = plan_cli(*L8, "--framework", "nemo-automodel")
    mem = json.loads(out)["framework"]["memory"]
    # MaskedCrossEntropy(fp32_upcast=True) casts the whole logits; flash-attn 2 takes
    # grouped K/V as they are
    assert rc == 0 and mem["loss"] == "eager" and mem["gqa_copies"] is False
    rc, out, _ = plan_cli(*L8, "--framework", "llm-foundry")
    assert rc == 0 and json.loads(out)["framework"]["memory"]["loss"] == "flash-ce"


def test_a_name_that_is_none_is_refused_in_one_line_naming_the_stacks(plan_cli):  # noqa: F811
    rc, out, err = plan_cli(*L8, "--framework", "megatron-brige")
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "framework='megatron-brige'" in lines[0]
    for name in ("megatron-bridge", "nemo-automodel", "llm-foundry", "gpt-neox",
                 "megatron-deepspeed", "torchtitan@2024"):
        assert name in lines[0]


def test_an_era_a_stack_never_had_is_refused(plan_cli):  # noqa: F811
    rc, _, err = plan_cli(*L8, "--framework", "megatron-bridge@2021")
    assert rc == 2 and "framework='megatron-bridge@2021': allowed values" in err


def test_performance_mode_is_an_options_table_on_the_preset(tmp_path):
    f = tmp_path / "perf.toml"
    f.write_text('framework = "megatron-bridge"\n[options]\ngrad_bucket_passes = 0\n'
                 'fp32_grad_reduce = false\nreduce_dtype = "bf16"\n')
    fw = resolve(None, f)
    assert fw.label == "megatron-bridge@2025 +3 option(s)" and fw.reduce_dtype == "bf16"
    assert fw.kernel.grad_bucket_passes == 0 and fw.kernel.tp_comm_overlap


# the rows of bench/published that price a nameable stack: (row-name prefix, preset the table's
# command line uses, the options a row may add to it: its run's own settings)
ROW_STACKS = [
    ("LF ", ("llm-foundry@2024", "llm-foundry@2023"), {"flash_unpad", "flash_isa"}),
    ("MT-NLG ", ("deepspeed@2021",), set()),
    ("GPT-NeoX ", ("gpt-neox@2022",), {"stack"}),
    ("TT Llama3", ("torchtitan@2024",), {"stack"}),
    ("TT 8B FSDP", ("torchtitan@2024",), {"stack"}),
    ("TT 70B FSDP32", ("torchtitan@2024",), {"stack", "tp_comm_overlap"}),
    ("TT 405B", ("torchtitan@2024",), {"stack", "tp_comm_overlap"}),
    ("MB25.11 Llama3", ("megatron-bridge@2025",), {"grad_bucket_passes"}),
    ("MB26.02 Llama3", ("megatron-bridge@2025",), {"grad_bucket_passes"}),
    # (FP8 parameters gathered as the preset and the recipes' 'fp8_cs' set them; 26.02's flex
    # dispatcher with DeepEP: ep_dispatch)
    ("MB25.11 Qwen3 30B", ("megatron-bridge@2025",),
     {"grad_bucket_passes", "ep_overlap", "fp32_grad_reduce", "reduce_dtype",
      "expert_imbalance"}),
    ("MB26.02 Qwen3 30B", ("megatron-bridge@2025",),
     {"grad_bucket_passes", "ep_overlap", "fp32_grad_reduce", "reduce_dtype",
      "expert_imbalance", "ep_dispatch"}),
    # NeMo AutoModel's MoE rows: the preset's MoE path plus the fake balanced gate and
    # MaskedCrossEntropy(fp32_upcast=False) their yamls set
    ("AM DSV3", ("nemo-automodel@2025",), {"expert_imbalance", "expert_routing", "loss"}),
    ("AM Kimi K2", ("nemo-automodel@2025",), {"expert_imbalance", "expert_routing", "loss"}),
    ("AM Qwen3 30B-A3B", ("nemo-automodel@2025",),
     {"expert_imbalance", "expert_routing", "loss"}),
]
# what every row's memory adds (PublishedRun.row_memory: K/V repeated per query head), and the
# stack rules a row leaves unset (None: the preset's own, which the options file omits)
ROW_ANY = {"gqa_copies"}


def _published():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from planner_cli_table import _options_for

        from bench.published.runs import published_runs
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return published_runs(), _options_for


def test_published_rows_of_named_stacks_are_the_presets_plus_their_runs_settings():
    runs, options_for = _published()
    seen = {prefix: 0 for prefix, _, _ in ROW_STACKS}
    for run in runs:
        match = [s for s in ROW_STACKS if run.name.startswith(s[0])]
        if not match:
            continue
        prefix, keys, allowed = match[0]
        key, diff = options_for(run)
        set_options = {k for k, v in diff.items() if v is not None}
        assert key in keys, (run.name, key)
        assert set_options <= allowed | ROW_ANY, (run.name, set_options - allowed - ROW_ANY)
        # the row prices exactly what `--framework KEY --options ...` resolves to
        fw = for_model(with_options(resolve(key), {k: v for k, v in diff.items()
                                                   if v is not None}), run.model)
        assert fw.kernel == run.opts, run.name
        seen[prefix] += 1
    assert all(seen.values()), [p for p, n in seen.items() if not n]



@pytest.mark.parametrize("name, flag, says", [
    ("nemo-automodel", ("--zero", "2"), "NeMo Automodel (nemo-automodel)"),
    ("llm-foundry", ("--offload", "optimizer"), "FSDP CPU Offload not supported yet"),
])
def test_what_a_named_stack_cannot_run_is_refused_by_its_code(plan_cli, name, flag,  # noqa: F811
                                                               says):
    rc, out, err = plan_cli(*L8, "--framework", name, *flag)
    assert rc == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1


Q8 = ("--model", "qwen3-30b-a3b", "--cluster", "dgx-h100:1", "--global-batch", "64",
      "--seq-len", "4096", "--layout", "tp=1,pp=1,dp=8,ep=8", "--zero", "3",
      "--recompute", "full", "--json", "--top", "1")


def test_nemo_automodel_runs_a_mixture_of_experts_through_its_moe_path(plan_cli):  # noqa: F811
    # components/moe/parallelizer.py: apply_fsdp's MixedPrecisionPolicy reduces in fp32, TE
    # kernels and DeepEP by default; the dense path (L8) keeps bf16 reduce
    rc, out, err = plan_cli(*Q8, "--framework", "nemo-automodel")
    assert rc == 0, err
    doc = json.loads(out)
    fw, plan = doc["framework"], doc["plans"][0]
    assert plan["ep"] == 8 and plan["reduce_dtype"] == "fp32" and plan["time_s"]["ep_comm"] > 0
    assert fw["reduce_dtype"] == "fp32" and fw["overrides"] == {}
    assert {k: fw["kernel"][k] for k in ("stack", "ep_dispatch", "fp32_grad_reduce",
                                         "v_width")} == {
        "stack": "fused", "ep_dispatch": "deepep", "fp32_grad_reduce": True, "v_width": "native"}
    assert fw["memory"]["param_dtype"] == "bf16" and fw["memory"]["experts_outside_fsdp"]
    rc, out, _ = plan_cli(*L8, "--framework", "nemo-automodel")
    dense = json.loads(out)
    assert rc == 0 and dense["framework"]["reduce_dtype"] == "bf16"
    assert dense["plans"][0]["reduce_dtype"] == "bf16"
    # the dense path builds the Hugging Face model in bf16 too (from_config: torch_dtype 'auto'
    # -> bfloat16): no fp32 master on either path (test_planner_stack_layouts prices it)
    assert dense["framework"]["memory"]["param_dtype"] == "bf16"


def test_an_option_the_user_gives_beats_the_moe_path(plan_cli, tmp_path):  # noqa: F811
    opts = tmp_path / "opts.toml"
    opts.write_text('[options]\nep_dispatch = "bf16"\nreduce_dtype = "bf16"\n'
                    'fp32_grad_reduce = false\n')
    rc, out, err = plan_cli(*Q8, "--framework", "nemo-automodel", "--options", str(opts))
    assert rc == 0, err
    doc = json.loads(out)
    fw = doc["framework"]
    assert fw["kernel"]["ep_dispatch"] == "bf16" and fw["reduce_dtype"] == "bf16"
    assert doc["plans"][0]["reduce_dtype"] == "bf16"
    assert fw["kernel"]["stack"] == "fused"  # the rest of the MoE path still applies
    assert set(fw["overrides"]) == {"ep_dispatch", "reduce_dtype", "fp32_grad_reduce"}


def test_automodel_refuses_a_mixture_of_experts_under_tensor_parallelism(plan_cli):  # noqa: F811
    # components/moe/parallelizer.py asserts tp 1 for its MoE models; dense ones take tp
    layout = [a.replace("tp=1,pp=1,dp=8,ep=8", "tp=2,pp=1,dp=4,ep=4") for a in Q8]
    rc, out, err = plan_cli(*layout, "--framework", "nemo-automodel")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "plan.tp=2" in err and "parallelizer.py" in err and "use tp=1" in err
    rc, _, err = plan_cli(*layout, "--framework", "torchtitan")
    assert rc == 0, err
    rc, _, err = plan_cli(*L8, "--framework", "nemo-automodel", "--layout", "tp=2,pp=1,dp=4")
    assert rc == 0, err
