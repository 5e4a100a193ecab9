"""One rule for the stack options under framework meshtron (planner/plan_rules_options.py): every
option field has a decision whether meshtron's runtime runs it, every value it does not run is
refused by `meshtron plan` in one line (exit 2, nothing saved), the values it runs are priced,
and no meshtron preset sets a refused one."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest

from meshtron.planner.compute import KernelOptions
from meshtron.planner.framework_presets import PRESETS
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.plan_rules import options_runtime_problems
from meshtron.planner.plan_rules_options import (ANY, NOT_OPTIONS, RUNTIME_OPTIONS,
                                                 option_values, runs)
from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

REFUSED = {
    # KernelOptions: a value the field takes that meshtron's runtime does not run
    "attention": '"unfused"', "dropout": "true", "overlap_grad_reduce": "false",
    "fp32_grad_reduce": "true", "p2p_scatter_gather": "true", "p2p_blocking": "true",
    "stack": '"fused"', "shard_units_per_layer": "6", "reduce_units_per_layer": "12",
    "prefetch_params": "5e7", "max_live_params": "1e9", "live_embedding": "true",
    "recompute_regathers": "true", "fp8_filter": '"all"', "fp8_scaling": '"te-delayed"',
    "fp8_gemm": '"blockwise"', "fp8_split_accum_bwd": "false",
    "separate_projections": "false", "fp8_param_gather": "true", "list_collectives": "true",
    "sharding": '"zero"', "fp32_params_autocast": "true", "tp_comm_overlap": "true",
    "async_tp": "true", "cp_overlap": "true", "complex_rope": "true", "torch_ring": "true",
    "ep_overlap": "true", "ep_node_limit": "4", "ep_dispatch": '"deepep"',
    "expert_routing": '"contiguous"', "router_dtype": '"fp32"', "expert_capacity": "1.5", "expert_capacity_pad": "false",
    "p2p_overlap": "true", "eager_norm": '"python"', "megatron_linear": "true",
    "optimizer": '"foreach"', "grad_accum_fusion": "true", "zero1_all_reduce": "true",
    "p2p_grads_whole": "true", "residual_reduce_once": "true", "score_bias_copy": "true",
    "flash_unpad": "true", "flash_isa": '"sm80"', "v_width": '"native"',
    "launch_blocking": "true", "vocab_parallel_ce": "true", "grad_bucket_passes": "3",
    "flash_ce": "true", "flat_param": "true", "train_metrics": "2", "z_loss": "true",
    "logits_fp32": "true", "fp8_fsdp_gather": "true",
    # MemoryOptions
    "framework": '"megatron"', "activations": '"korthikanti"', "loss": '"eager"',
    "gqa_copies": "true", "fused_norm": "false", "moe_weighted_act": "true",
    "recompute_norms": "true", "recompute_up_proj": "true", "swiglu_recompute": "true",
    "attn_out_e5m6": "true", "bf16_moments": "true", "master_weights": '"remainders"',
    "grads_at_first_backward": "true", "param_dtype": '"bf16"',
    "experts_outside_fsdp": "true", "expandable_segments": "true",
    "fold_after_weight_pass": "false",
    "pipeline_split": '"megatron-even"', "host_offload": '"mcore-optimizer"',
    "zero_stages": '"megatron-core"', "layouts": '"llm-foundry"', "half_counts": '"rank"',
}
"""Per field with a value meshtron's runtime does not run: one such value, as TOML."""
RUN = {
    # fields whose every value runs (or a measurement): another value than the preset's, as TOML
    "grad_clip": "false", "reduce_dtype": '"bf16"', "expert_imbalance": "1.5",
}
"""Per field whose every value is run: a value other than the preset's, priced."""

ARGS = ("--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "16",
        "--seq-len", "2048")


def _fields() -> set[str]:
    kernel = {f.name for f in dataclasses.fields(KernelOptions)}
    memory = {f.name for f in dataclasses.fields(MemoryOptions)} - set(NOT_OPTIONS)
    return kernel | memory | {"reduce_dtype"}


def test_every_option_field_has_one_decision():
    # a field added to KernelOptions / MemoryOptions without a decision fails here
    assert set(RUNTIME_OPTIONS) == _fields()
    # and this table tries it: a refused value where one exists, else a run one
    assert set(REFUSED) | set(RUN) == _fields()
    assert not set(REFUSED) & set(RUN)
    for name in RUN:
        allowed = RUNTIME_OPTIONS[name][0]
        assert allowed is ANY or len(allowed) > 1, name
    # the decision itself refuses each value (some the options' own consistency refuses
    # first under fsdp2: the CLI test below sees theirs)
    for name, text in REFUSED.items():
        value = tomllib.loads(f"v = {text}")["v"]
        assert not runs(value, RUNTIME_OPTIONS[name][0]), name
        assert list(options_runtime_problems({name: value}, {})), name


def test_meshtron_presets_set_no_refused_option():
    presets = [fw for fw in PRESETS.values() if fw.name == "meshtron"]
    assert presets
    for fw in presets:
        values = option_values(fw.kernel, fw.memory, fw.reduce_dtype)
        assert set(values) == _fields()
        assert list(options_runtime_problems(values, {})) == [], fw.label
        for name, value in values.items():
            assert runs(value, RUNTIME_OPTIONS[name][0]), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_meshtron_refuses_an_option_its_runtime_does_not_run(name, plan_cli, tmp_path):
    options, saved = tmp_path / "options.toml", tmp_path / "plan.toml"
    options.write_text(f"[options]\n{name} = {REFUSED[name]}\n")
    rc, out, err = plan_cli(*ARGS, "--options", str(options), "--save", str(saved))
    line = err.strip()
    assert rc == 2 and len(line.splitlines()) == 1 and "Traceback" not in line, (name, err)
    assert f"{name}=" in line, line
    assert not saved.exists() and out == ""
    # the stack options table refused it in its runtime's words, unless the options'
    # own consistency (KernelOptions / MemoryOptions) refused the value first
    if f"options.{name}=" in line:
        assert "meshtron's runtime" in line and "allowed: " in line, line


@pytest.mark.parametrize("name", sorted(RUN))
def test_meshtron_prices_an_option_its_runtime_runs(name, plan_cli, tmp_path):
    options = tmp_path / "options.toml"
    options.write_text(f"[options]\n{name} = {RUN[name]}\n")
    rc, out, err = plan_cli(*ARGS, "--options", str(options), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    value = tomllib.loads(f"v = {RUN[name]}")["v"]
    assert doc["framework"]["overrides"] == {name: value}
    if name == "reduce_dtype":  # the plan carries it: FSDP2's reduce dtype in `meshtron train`
        assert doc["plans"][0]["reduce_dtype"] == "bf16"


def test_the_compiled_stack_is_the_plans_compile(plan_cli, tmp_path):
    # meshtron's runtime compiles per block when the plan says so (parallel/compile.py): a
    # plan priced on the compiled stack is saved with compile = true, so `meshtron train`
    # runs what was priced
    options, saved = tmp_path / "options.toml", tmp_path / "plan.toml"
    options.write_text('[options]\nstack = "compiled"\n')
    rc, _, err = plan_cli(*ARGS, "--options", str(options), "--save", str(saved))
    assert rc == 0, err
    assert tomllib.loads(saved.read_text())["compile"] is True
    rc, _, err = plan_cli(*ARGS, "--save", str(saved))
    assert rc == 0 and tomllib.loads(saved.read_text()).get("compile", False) is False


def test_other_stacks_price_what_meshtron_refuses(plan_cli, tmp_path):
    options = tmp_path / "options.toml"
    options.write_text("[options]\nflash_ce = true\ntrain_metrics = 2\n")
    rc, _, err = plan_cli(*ARGS, "--options", str(options))
    assert rc == 2 and "options.flash_ce=true: meshtron's runtime" in err
    rc, _, err = plan_cli(*ARGS, "--options", str(options), "--framework", "llm-foundry")
    assert rc == 0, err


def test_meshtrons_pipeline_sends_whole_activations_without_sequence_parallelism():
    # torch.distributed.pipelining sends what each tensor rank holds (parallel/pipeline.py):
    # replicated without sp (parallel/tensor.py), a sequence shard with it
    from meshtron.model.spec import preset as model
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator
    from meshtron.planner.frameworks import preset
    from meshtron.planner.plan import Plan

    ours = preset("meshtron").kernel
    scattered = dataclasses.replace(ours, p2p_scatter_gather=True)

    def pp_comm(opts, sp: bool) -> float:
        ev = Evaluator(model("llama3-8b"), preset_cluster("dgx-h100", 2), 64, 4096, opts)
        plan = Plan(tp=4, pp=4, dp=1, zero=1, micro_batch=1, recompute="full", sp=sp,
                    schedule="1f1b")
        return ev.evaluate(plan, keep_infeasible=True).time.pp_comm

    assert pp_comm(ours, False) > 2 * pp_comm(scattered, False)
    assert pp_comm(ours, True) == pytest.approx(pp_comm(scattered, True), rel=1e-12)
