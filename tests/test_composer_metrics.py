"""llm-foundry's loss and Composer's train metrics in the planner (planner/composer_metrics.py,
KernelOptions flash_ce / train_metrics): flash-attn's fused cross-entropy moves 2 + 4 bytes per
logit, each metric update 6 more after the backward, and the metrics' world-wide sync at the
step's end grows with the ranks (branch lfmpt)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from meshtron.errors import UserError
from meshtron.model import preset
from meshtron.planner import composer_metrics
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute_edges import head_cost
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import PRESETS
from meshtron.planner.gemm import membound_bytes_per_s
from meshtron.planner.kernel_options import KernelOptions
from meshtron.planner.plan import Plan
from testkit.plan_cli import options_refusal, plan_cli  # noqa: F401 (fixture)


def _mpt7b():
    return preset("llama3-8b")  # any dense model: only the vocabulary and hidden size matter


def test_llm_foundry_presets_state_the_loss_and_the_metrics():
    for era in ("2023", "2024"):
        k = PRESETS[f"llm-foundry@{era}"].kernel
        assert k.flash_ce and k.train_metrics == 2, era
    for name, fw in PRESETS.items():
        if not name.startswith("llm-foundry"):
            assert not fw.kernel.flash_ce and fw.kernel.train_metrics == 0, name


def test_flash_ce_moves_two_and_four_bytes_per_logit():
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 1)
    eager = head_cost(model, cl, 1, 6, 2048, False, "eager")
    flash = head_cost(model, cl, 1, 6, 2048, False, "eager", flash_ce=True)
    logits = 6 * 2048 * model.vocab
    hbm = membound_bytes_per_s(cl, "eager")
    assert eager.compute - flash.compute == pytest.approx(logits * (14 + 18 - 2 - 4) / hbm)
    assert eager.fwd - flash.fwd == pytest.approx(logits * (14 - 2) / hbm)


def test_metric_updates_add_six_bytes_per_logit_after_the_backward():
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 1)
    plain = head_cost(model, cl, 1, 6, 2048, False, "eager", flash_ce=True)
    two = head_cost(model, cl, 1, 6, 2048, False, "eager", flash_ce=True, train_metrics=2)
    logits = 6 * 2048 * model.vocab
    extra = 2 * 6.0 * logits / membound_bytes_per_s(cl, "eager")
    assert two.compute - plain.compute == pytest.approx(extra)
    assert two.fwd == plain.fwd  # the updates run after the backward, not in the forward
    assert dict(two.parts)["elementwise"] - dict(plain.parts)["elementwise"] == \
        pytest.approx(extra)


def test_metric_sync_grows_with_the_world():
    """Two host operations per rank and state (zeros_like, ProcessGroupNCCL's copy_): the
    sync at 512 ranks is at least 4 states x 512 x their issue time, about four times 128's."""
    cl = preset_cluster("dgx-h100", 64)
    per_rank = composer_metrics.ZEROS_LIKE_S + composer_metrics.COPY_S
    s512, s128 = (composer_metrics.sync_s(2, n, cl) for n in (512, 128))
    assert s512 >= 4 * 512 * per_rank
    assert 3.5 < s512 / s128 < 4.5
    assert composer_metrics.sync_s(0, 512, cl) == 0.0
    assert composer_metrics.sync_s(2, 1, cl) == 0.0


def _step(framework: str, gpus: int):
    fw = PRESETS[framework]
    model, cl = _mpt7b(), preset_cluster("dgx-h100", gpus // 8)
    ev = Evaluator(model, cl, 6 * gpus, 2048, fw.kernel, mem=fw.memory)
    cfg = Plan(tp=1, pp=1, dp=gpus, zero=3, micro_batch=6, recompute="none", sp=False,
               dtype="bf16", reduce_dtype=fw.reduce_dtype)
    return ev.evaluate(cfg).time


def test_only_composer_pays_the_step_end_sync():
    lf = _step("llm-foundry@2024", 512)
    assert lf.step_host == pytest.approx(composer_metrics.sync_s(2, 512, preset_cluster(
        "dgx-h100", 64)))
    assert lf.to_dict()["step_host"] == lf.step_host
    assert lf.total == pytest.approx(sum(v for v in lf.to_dict().values()))
    tt = _step("torchtitan@2024", 512)
    assert tt.step_host == 0.0 and "step_host" not in tt.to_dict()


def test_train_metrics_must_be_a_count():
    for bad in (-1, 1.5, True, "2", 10**20):
        with pytest.raises(UserError, match="train_metrics"):
            KernelOptions(train_metrics=bad)
    assert dataclasses.replace(KernelOptions(), train_metrics=3).train_metrics == 3


def test_a_bad_grad_bucket_passes_is_one_line_exit_2(plan_cli, tmp_path):
    """A user's typo in an options file (a string, a negative or a huge count) was a
    TypeError traceback or a step of hours, priced with exit 0."""
    for bad in ('"x"', "-3", "2.5", "true", "1000000"):
        err = options_refusal(plan_cli, tmp_path, f"grad_bucket_passes = {bad}", "--model",
                              "llama3-8b", "--cluster", "dgx-h100:1", "--framework",
                              "megatron-bridge")
        assert "grad_bucket_passes=" in err and "from 0 to 16" in err, err


def test_cli_shows_the_step_end_host_time(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "meshtron", "plan", "--model", "llama3-8b", "--cluster",
         "dgx-h100:64", "--global-batch", "3072", "--seq-len", "2048", "--framework",
         "llm-foundry@2024", "--layout", "tp=1,pp=1,dp=512", "--zero", "3", "--recompute",
         "none", "--micro-batch", "6", "--json", "--top", "1"],
        capture_output=True, text=True, cwd=tmp_path, check=True)
    time_s = json.loads(out.stdout)["plans"][0]["time_s"]
    assert time_s["step_host"] > 0.02  # 4 states x 512 ranks x two host operations
    text = subprocess.run(out.args[:-3], capture_output=True, text=True, cwd=tmp_path,
                          check=True).stdout
    shown = f"train-metric sync on the host at the step's end {time_s['step_host']:.3g}"
    assert shown in " ".join(text.split())


def test_bad_train_metrics_option_is_one_line(tmp_path):
    opts = tmp_path / "o.toml"
    opts.write_text("[options]\ntrain_metrics = -2\n")
    out = subprocess.run(
        [sys.executable, "-m", "meshtron", "plan", "--model", "llama3-8b", "--cluster",
         "dgx-h100:1", "--global-batch", "8", "--seq-len", "2048", "--framework",
         "llm-foundry@2024", "--options", str(opts)],
        capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert "train_metrics=-2" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_fsdp1_copies_each_unit_once_per_backward_not_per_gather():
    """Composer's FSDP1 gathers into the flat parameter (no copy-out) and cats the views'
    gradients once per backward: under ZeRO-3 one copy of the model's unsharded bytes per
    micro-batch, where FSDP2 copies out every gather (the forward's and the backward's). Both
    prepare every gather's input and every reduction's gradients, each its own way (the next
    test)."""
    fw = PRESETS["llm-foundry@2024"]
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 64)
    times, prep = {}, {}
    # what FSDP2's backward gathers: every unit but the kept [norm, head] (untied here)
    again = model.num_params() - model.vocab * model.hidden
    for flat in (True, False):
        kernel = dataclasses.replace(fw.kernel, flat_param=flat)
        ev = Evaluator(model, cl, 6 * 512, 2048, kernel, mem=fw.memory)
        cfg = Plan(tp=1, pp=1, dp=512, zero=3, micro_batch=6, recompute="none", sp=False,
                   dtype="bf16", reduce_dtype="fp32")
        times[flat] = ev.evaluate(cfg).time.dp_comm
        prep[flat] = (ev.grad_prep_s(model.num_params(), 4.0, 2.0, 512)
                      + ev.gather_prep_s(model.num_params() + again, 2.0, 512))
        copy = ev.copy_out_s(again, 2.0)
    assert copy > 0 and prep[True] > 0 and prep[False] > 0
    # FSDP2 copies out the forward's gathers (what FSDP1's gradient cat moves) and the
    # backward's on top; each runtime's passes before gathering and reducing
    assert times[False] - times[True] == pytest.approx(copy + prep[False] - prep[True],
                                                       rel=0.01)


def test_fsdp_runtimes_pass_over_every_unsharded_gradient_before_reducing():
    """FSDP1's post-backward hook casts each unit's bf16 gradient to the fp32 reduce dtype
    (2 + 4 bytes), pre-divides it in place (4 + 4) before every reduce-scatter and post-divides
    the shard (world 512: pre 32, post 16); with a bf16 reduction only the divisions (2 + 2).
    FSDP2 (torch 2.13 foreach_reduce) copies the gradients into the reduce-scatter input
    (chunk_cat: 2 + 4; 4 + 4 from an fp32 accumulated gradient), divides nothing for fp32 or
    bf16 (NCCL's AVG) and casts a bf16-reduced shard back to the fp32 parameter (2 + 4 per
    shard element). One rank: none."""
    fw = PRESETS["llm-foundry@2024"]
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 64)
    ev = Evaluator(model, cl, 6 * 512, 2048, fw.kernel, mem=fw.memory)
    p = 1e9
    assert ev.grad_prep_s(p, 4.0, 2.0, 512) == pytest.approx((14.0 + 8.0 / 512) * p / ev.hbm)
    assert ev.grad_prep_s(p, 2.0, 2.0, 512) == pytest.approx((4.0 + 4.0 / 512) * p / ev.hbm)
    assert ev.grad_prep_s(p, 2.0, 2.0, 2) == pytest.approx(4.0 * p / ev.hbm)  # post 1
    assert ev.grad_prep_s(p, 4.0, 2.0, 1) == 0.0
    tt = PRESETS["torchtitan@2024"]
    fsdp2 = Evaluator(model, cl, 6 * 512, 2048, tt.kernel, mem=tt.memory)
    assert fsdp2.grad_prep_s(p, 4.0, 2.0, 512) == pytest.approx(6.0 * p / fsdp2.hbm)
    assert fsdp2.grad_prep_s(p, 4.0, 2.0, 512, accumulated=True) == pytest.approx(
        8.0 * p / fsdp2.hbm)
    assert fsdp2.grad_prep_s(p, 2.0, 2.0, 512) == pytest.approx(
        (4.0 + 6.0 / 512) * p / fsdp2.hbm)
    # a shard group of one rank (meshtron's zero 0): copied in, then copied to the output
    assert fsdp2.grad_prep_s(p, 4.0, 2.0, 1, alone=True) == pytest.approx(14.0 * p / fsdp2.hbm)
    assert fsdp2.grad_prep_s(p, 4.0, 2.0, 1) == 0.0  # not FSDP2's group (left-out experts)


def test_fsdp_runtimes_prepare_every_all_gather_input():
    """Before each all-gather FSDP1 casts the fp32 shard to bf16 (_use_low_precision_shard:
    4 + 2 bytes per shard element) and gathers from it; FSDP2 casts it too (the foreach copy
    to param_dtype) and copies it into the output's slot (all_gather_copy_in: 2 + 2); a
    bf16-sharded model (NeMo AutoModel) only copies it in; fp32 gathers of fp32 shards cast
    nothing. Zero sharding gathers in place, FSDP1's NO_SHARD gathers nothing."""
    fw = PRESETS["llm-foundry@2024"]
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 64)
    p = 8e9
    fsdp1 = Evaluator(model, cl, 64, 2048, fw.kernel, mem=fw.memory)
    assert fsdp1.gather_prep_s(p, 2.0, 8) == pytest.approx(6.0 * p / 8 / fsdp1.hbm)
    tt = PRESETS["torchtitan@2024"]
    fsdp2 = Evaluator(model, cl, 64, 2048, tt.kernel, mem=tt.memory)
    assert fsdp2.gather_prep_s(p, 2.0, 8) == pytest.approx(10.0 * p / 8 / fsdp2.hbm)
    assert fsdp2.gather_prep_s(p, 4.0, 8) == pytest.approx(8.0 * p / 8 / fsdp2.hbm)
    am = PRESETS["nemo-automodel@2025"]
    bf16 = Evaluator(model, cl, 64, 2048, am.kernel, mem=am.memory)
    assert am.memory.param_dtype == "bf16"
    assert bf16.gather_prep_s(p, 2.0, 8) == pytest.approx(4.0 * p / 8 / bf16.hbm)
    zero = Evaluator(model, cl, 64, 2048, PRESETS["megatron@2024"].kernel,
                     mem=PRESETS["megatron@2024"].memory)
    assert zero.gather_prep_s(p, 2.0, 8) == 0.0 == fsdp1.gather_prep_s(p, 2.0, 1)
    # FSDP2 on a shard group of one rank (meshtron's zero 0) prepares the whole parameter
    assert fsdp2.gather_prep_s(p, 2.0, 1, alone=True) == pytest.approx(10.0 * p / fsdp2.hbm)


def test_flash_ce_keeps_the_logits_beside_their_new_gradient():
    """flash-attn's CrossEntropyLoss defaults to inplace_backward=False and llm-foundry passes
    only ignore_index: at the loss's backward the 16-bit logits (which Composer also keeps for
    its metrics) and a new 16-bit gradient, twice what the in-place variant holds."""
    from meshtron.planner.memory_acts import logits_bytes
    from meshtron.planner.memory_options import MemoryOptions

    model = _mpt7b()
    inplace = logits_bytes(model, 1, 6, 2048, MemoryOptions(loss="inplace"))
    flash = logits_bytes(model, 1, 6, 2048, MemoryOptions(loss="flash-ce"))
    assert inplace == 6 * 2048 * model.vocab * 2.0
    assert flash == 2 * inplace
    assert PRESETS["llm-foundry@2024"].memory.loss == "flash-ce"


def test_fsdp1_shard_grad_op_gathers_again_every_micro_batch():
    """FSDP1's SHARD_GRAD_OP frees the unsharded parameters in each backward that syncs
    gradients, and Composer syncs every micro-batch: two micro-batches gather twice, where
    FSDP2's ZeRO-2 keeps the parameters gathered over the step. The memory holds the gathered
    model either way (from each forward to its backward)."""
    fw = PRESETS["llm-foundry@2024"]
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 64)
    out = {}
    for flat in (True, False):
        kernel = dataclasses.replace(fw.kernel, flat_param=flat)
        ev = Evaluator(model, cl, 2 * 4 * 512, 2048, kernel, mem=fw.memory)
        cfg = Plan(tp=1, pp=1, dp=512, zero=2, micro_batch=4, recompute="none", sp=False,
                   dtype="bf16", reduce_dtype="fp32")
        assert ev.dp_flags(cfg)["gather_once"] is (not flat)
        est = ev.evaluate(cfg)
        out[flat] = (est.time.dp_comm, est.memory.total)
    assert out[True][1] == pytest.approx(out[False][1], rel=0.02)
    assert out[True][0] > out[False][0]


def test_simulate_sweep_counts_the_step_end_sync(tmp_path):
    """`meshtron simulate`'s sweep writes every part of the step (they add up to its time) and
    names the metric sync, which grows with the world, as what scales worse at 512 GPUs."""
    import csv

    from meshtron.planner.estimate_results import TimeBreakdown

    subprocess.run(
        [sys.executable, "-m", "meshtron", "simulate", "--model", "llama2-7b", "--global-batch",
         "3072", "--seq-len", "2048", "--framework", "llm-foundry@2024", "--gpus", "256,512",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, check=True)
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["gpus"]) for r in rows] == [256, 512]
    for r in rows:
        parts = sum(float(r[f"{f.name}_s"]) for f in dataclasses.fields(TimeBreakdown))
        assert parts == pytest.approx(float(r["step_time_s"]), rel=1e-9)
        assert float(r["step_host_s"]) > 0
    assert "train-metric sync" in rows[1]["cause"]


def test_flat_param_on_a_stack_without_fsdp_is_one_line(tmp_path):
    """FSDP1's flat parameters are PyTorch FSDP's: on DeepSpeed's ZeRO (sharding 'zero') they
    would price FSDP1's gradient passes on a stack that has none; refused, exit 2."""
    with pytest.raises(UserError, match="flat_param=True with sharding='zero'"):
        KernelOptions(sharding="zero", flat_param=True)
    opts = tmp_path / "o.toml"
    opts.write_text("[options]\nflat_param = true\n")
    out = subprocess.run(
        [sys.executable, "-m", "meshtron", "plan", "--model", "llama3-8b", "--cluster",
         "dgx-h100:8", "--global-batch", "512", "--seq-len", "2048", "--framework",
         "deepspeed", "--options", str(opts), "--zero", "3"],
        capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "flat_param=True" in out.stderr


def test_fsdp1_no_shard_all_reduces_every_micro_batch():
    """Composer never enters no_sync for FSDP, so FSDP1's NO_SHARD (zero 0) all-reduces after
    every micro-batch's backward, with its gradient cat, cast and pre-division: four
    micro-batches cost four times one's exposed data-parallel time, where a stack that
    accumulates (no flat parameters) reduces once per step."""
    fw = PRESETS["llm-foundry@2024"]
    model, cl = _mpt7b(), preset_cluster("dgx-h100", 8)
    for flat in (True, False):
        kernel = dataclasses.replace(fw.kernel, flat_param=flat)
        dp = {}
        for m in (1, 4):
            ev = Evaluator(model, cl, 2 * m * 64, 2048, kernel, mem=fw.memory)
            cfg = Plan(tp=1, pp=1, dp=64, zero=0, micro_batch=2, recompute="full", sp=False,
                       dtype="bf16", reduce_dtype="fp32")
            dp[m] = ev.evaluate(cfg).time.dp_comm
        assert dp[1] > 0
        if flat:
            assert dp[4] == pytest.approx(4 * dp[1], rel=1e-9)
        else:
            assert dp[4] == pytest.approx(dp[1], rel=1e-9)
