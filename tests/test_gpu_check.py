"""bench/gpu_check.py: the GPU kit. `--dry-run` runs every case on CPU at toy size, each in its
own process, through the same code (halving, plans built for the shape run, subprocesses, the
JSON rewritten after every case), so the one call on a lent GPU does not find the kit's own
bugs. Also: a case that fails, runs out of time or no longer fits the budget is recorded and
never stops the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check import CASES, _child_argv  # noqa: E402
from gpukit import clocks, events, timeline  # noqa: E402
from gpukit.profile import busy_us, category, rows_of, summarize  # noqa: E402
from gpukit.timeline import Rec  # noqa: E402


def _start(tmp_path, *argv) -> tuple[subprocess.Popen, Path]:
    """The kit started, its output in a file beside its JSON (a pipe left unread while the
    other call is waited for would stall this one)."""
    out = tmp_path / "gpu_check.json"
    with open(tmp_path / "kit.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(KIT), "--dry-run", "--out", str(out), *argv],
                                stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, out


def _kit(tmp_path, *argv, timeout=1500):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(KIT), "--dry-run", "--out", str(out), *argv],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, out


CORE = ("cli_calibrate,cli_train_auto,gputrue,eager", "cli_kill_resume,checkpoint,fp8")
"""The default suite's dry run: calibrate feeding `--plan auto` (and the eager case's calibrated
prediction), a halved model (fp8), the checkpointer's stager and a kill and --resume through
the CLI (the two paths the first GPU run found broken), issue 31's device checks. Every case
(the rehearsal too): -m slow.

Two kit calls side by side, each running its cases in a process each, as on the GPU (the
first call's cli_train_auto and gputrue side by side: CASES' group "smoke"): a case is mostly
imports of torch (and matplotlib, torchao, dynamo) and a few toy steps on one core, about 40
CPU seconds in all, and a CI box has two cores (about 21 and 20 CPU seconds per call). The first call's cases share its work folder: calibrate's file is what
`--plan auto` and the eager case find there; the second's need nothing of it."""


@pytest.fixture(scope="module")
def dry_run_core(tmp_path_factory):
    calls = [_start(tmp_path_factory.mktemp("gpu-kit-core"), "--budget", "900", "--only", only)
             for only in CORE]
    merged: dict = {"order": [], "cases": {}, "idle": {}}
    try:
        for proc, out in calls:
            proc.wait(timeout=1500)
            assert proc.returncode == 0, out.with_name("kit.log").read_text()[-6000:]
            report = json.loads(out.read_text())
            merged["order"] += report["order"]
            merged["cases"].update(report["cases"])
            merged["idle"].update(report["idle"])
            assert list(report)[:2] == ["format", "idle"]  # the summary at the JSON's top
    finally:
        for proc, _ in calls:  # the other call, when one failed
            if proc.poll() is None:
                proc.kill()
    return merged


def test_core_cases_on_cpu(dry_run_core):
    r = dry_run_core
    assert r["order"] == ",".join(CORE).split(",")
    full = _ok(r, "eager")["largest_fit_layers"]
    f = _ok(r, "fp8")
    assert f["model"]["layers"] == full // 2 and f["stage_layers"] == [full // 2]
    assert 0 < f["loss_delta_max_rel"] < 0.05
    c = _ok(r, "checkpoint")
    assert c["bytes"] > 0 and c["commit_s"]["async"][0] > 0
    k = _ok(r, "cli_kill_resume")
    assert k["killed"] and k["killed_after"] and "resumed from" in k["resumed_line"]
    assert all(rec["cpu_s"] > 0 for rec in r["cases"].values())


def test_profile_window_records_clock_gaps_and_gemm_shapes_on_cpu(dry_run_core):
    prof = _ok(dry_run_core, "eager")["run"]["profile"]
    for clock in (prof["clocks"], prof["gemm_shapes"]["clocks"]):  # nothing to sample on CPU
        assert clock["source"] is None and "dry run" in clock["reason"]
        assert clock["sm_clock_mhz"] is None and clock["samples"] == []
    g = prof["gaps"]  # the leaf operators of the busiest thread stand in for the kernels
    assert g["source"] == "cpu leaf ops (dry run)" and g["units"] > 10 and g["gaps"] > 0
    assert sum(b["count"] for b in g["histogram"].values()) == g["gaps"]
    assert sum(b["us"] for b in g["histogram"].values()) == pytest.approx(g["idle_in_gaps_us"])
    assert g["busy_us"] + g["idle_in_gaps_us"] <= g["span_us"] * 1.0001
    lengths = [x["us"] for x in g["largest"]]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > 0
    assert any(x["launcher"] for x in g["largest"]) and g["by_launcher"]
    s = prof["gemm_shapes"]  # the forward's and backward's matrix products, by shape
    assert s["source"] == "cpu ops (dry run)" and s["total"]["tflops"] > 0
    assert s["distinct_shapes"] >= 2 and {row["op"] for row in s["rows"]} & {"aten::mm",
                                                                              "aten::addmm"}
    for row in s["rows"]:
        b, m, n, k = row["bmnk"]
        assert row["tflops"] == pytest.approx(2 * b * m * n * k * row["calls"] / row["us"] / 1e6)


def test_profile_window_says_whether_the_host_was_late_and_what_the_allocator_did(
        dry_run_core):
    """Issue 31's idle: on CPU every gap between operators is host time (each starts as its
    thread issues it), and there is no caching allocator: the record says so, with the
    configuration the environment sets."""
    run = _ok(dry_run_core, "eager")["run"]
    prof = run["profile"]
    g, h = prof["gaps"], prof["host"]
    per = h["micro_batches_in_window"]
    assert per == prof["micro_batches"] >= 1 and h["source"] == g["source"]
    # the same gaps as the gap analysis, all host-late
    assert h["idle_us_per_micro_batch"] * per == pytest.approx(g["idle_in_gaps_us"])
    assert h["gaps"] == {"host_late": g["gaps"], "device_wait": 0, "unknown": 0}
    assert h["host_late_share"] == 1.0 and h["kernels_per_micro_batch"] * per == g["units"]
    assert h["host_ops_per_micro_batch"] > h["kernels_per_micro_batch"]
    assert sum(x["us_per_micro_batch"] for x in h["late_by_host"]) <= h[
        "host_late_us_per_micro_batch"] * 1.0001 and h["late_by_host"][0]["gaps"] > 0
    assert h["host_issue_us_per_step"] > 0 and h["gpu_busy_us_per_step"] == pytest.approx(
        g["busy_us"])
    assert h["verdict"].startswith("host-bound: ")
    for rec in (prof["allocator"], run["allocator_timed_steps"]):
        assert rec["source"] is None and "dry run" in rec["reason"]
        assert rec["conf"]["expandable_segments"] is False
    row = dry_run_core["idle"]["eager"]
    assert row["idle_ms_per_micro_batch"] == pytest.approx(h["idle_us_per_micro_batch"] / 1e3)
    assert row["host_late_ms_per_micro_batch"] == row["idle_ms_per_micro_batch"]
    assert row["allocator_retries"] is None and row["expandable_segments"] is False
    assert row["verdict"] == h["verdict"] and "not recorded" in row["allocator"]
    # the FP8 engine's window; bf16 compiled is the compile case's (one window fewer)
    assert "fp8.fp8" in dry_run_core["idle"] and "fp8.bf16" not in dry_run_core["idle"]
    assert "gemm_shapes" in _ok(dry_run_core, "fp8")["fp8"]["profile"]


def test_plan_auto_plans_with_the_calibration_calibrate_wrote(dry_run_core):
    r = dry_run_core
    cal = _ok(r, "cli_calibrate")
    assert cal["device_name"] == "cpu" and cal["matmul_tflops"] > 0
    # the cluster file itself and the sustained GEMM table travel in the JSON
    assert 'name = "local-1"' in cal["toml"] and "matmul_efficiency" in cal["toml"]
    assert cal["gemm"] and all(g["tflops"] > 0 and g["m"] * g["n"] * g["k"] for g in cal["gemm"])
    auto = _ok(r, "cli_train_auto")
    assert auto["cluster_source"].startswith("calibrated on cpu: matmul ")
    assert "runs/calibration/local-1.toml" in auto["plan_line"] and auto["checkpoints"]
    run = _ok(r, "eager")["run"]  # the calibrated prediction beside the catalogue's
    assert run["calibrated"]["predicted"]["step_time_s"] > 0
    assert run["calibrated"]["predicted"]["step_time_s"] != run["predicted"]["step_time_s"]


def test_device_checks_run_on_cpu(dry_run_core):
    g = _ok(dry_run_core, "gputrue")
    assert g["shared_process"] and g["verdicts"] == dict.fromkeys(g["verdicts"], True)
    assert set(g["checks"]) == {"stager_order", "rng_own_device", "recompute_grouped_mm",
                                "cp_attention", "backend_nccl", "loss_window"}
    assert g["checks"]["backend_nccl"]["result"]["get_backend"] == "gloo"
    assert g["checks"]["cp_attention"]["result"]["sdpa_kernel"] == "cpu-flash"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    # every case, the optional one (eager_expandable, the idle suite's) too
    proc, out = _kit(tmp_path_factory.mktemp("gpu-kit"), "--budget", "1200", "--only",
                     ",".join(c.name for c in CASES))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), out


def _ok(report, name):
    rec = report["cases"][name]
    assert rec["status"] == "ok", (name, rec.get("output_tail"))
    return rec["result"]


@pytest.mark.slow
def test_every_case_runs_on_cpu(dry_run):
    r, out = dry_run
    assert r["format"] == "meshtron-gpu-check/2" and r["dry_run"] is True
    assert r["order"] == [c[0] for c in CASES]
    bad = {n: (c["status"], c.get("output_tail", [])[-5:]) for n, c in r["cases"].items()
           if c["status"] != "ok"}
    assert not bad, bad
    assert all(c["result"].get("done") for c in r["cases"].values())
    logs = out.with_name("gpu_check_logs")
    assert {p.stem for p in logs.iterdir()} == {c[0] for c in CASES}


@pytest.mark.slow
def test_throughput_cases_put_the_planner_beside_the_measurement(dry_run):
    r, _ = dry_run
    env = _ok(r, "env")
    assert env["matmul"]["tflops"] > 0 and env["device"] == "cpu"
    for name in ("eager", "compile"):
        run = _ok(r, name)["run"]
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0 and len(run["step_times_s"]) == 2
        assert run["predicted"]["step_time_s"] > 0 and run["predicted"]["allocated_bytes"] > 0
        assert run["measured_over_predicted_step_time"] > 0
        m = run["memory"]  # the planner's exact per-rank states are what the runtime holds
        for k in ("params", "grads", "optimizer"):
            assert m["measured_bytes"][k] == m["planned_bytes"][k] > 0, (name, k)
        prof = run["profile"]
        assert prof["source"] == "cpu ops (dry run)" and prof["window_us"] > 0
        assert prof["us"]["gemm"] > 0 and prof["us"]["optimizer"] > 0
        assert prof["us"]["idle"] >= 0 and prof["top"]
    c = _ok(r, "compile")
    assert c["backend"] == "aot_eager" and c["run"]["compiled"] and c["run"]["compile_time_s"] > 0
    # the same step in a process of its own with expandable segments configured, side by side
    x = _ok(r, "eager_expandable")
    assert x["allocator_conf"]["expandable_segments"] is True
    assert _ok(r, "eager")["allocator_conf"]["expandable_segments"] is False
    cmp = r["idle"]["expandable_vs_default"]
    assert cmp["same_model_and_plan"] and cmp["expandable_segments"] == [False, True]
    assert cmp["idle_ratio"] > 0 and cmp["tokens_per_s_ratio"] > 0
    assert c["predicted_compiled_over_eager_tokens_per_s"] > 0
    t = r["targets"]
    assert t["compiled_over_eager_tokens_per_s"]["value"] == pytest.approx(
        c["run"]["tokens_per_s"] / _ok(r, "eager")["run"]["tokens_per_s"])
    assert t["mfu_bf16_compiled"]["value"] == c["run"]["mfu"]
    assert t["fp8_over_bf16_compiled_tokens_per_s"]["target"] == 1.3


@pytest.mark.slow
def test_halved_cases_run_plans_built_for_their_own_shape(dry_run):
    """The old kit passed the full model's plan to the halved model (stage_layers mismatch)."""
    r, _ = dry_run
    full = _ok(r, "eager")["largest_fit_layers"]
    assert full == 4  # tiny fits whole on the nominal CPU cluster
    f = _ok(r, "fp8")
    assert f["model"]["layers"] == full // 2 and f["stage_layers"] == [full // 2]
    assert "cpu dry-run" in f["note"]
    assert f["bf16"]["compiled"] and f["fp8"]["compiled"] and f["fp8"]["dtype"] == "fp8"
    assert f["fp8"]["predicted"] is None  # no FP8 peak on a CPU cluster
    # e4m3 rounding, compounding over the 4 steps on one repeated batch: a few percent (the
    # exact tolerances are tests/test_fp8_numerics.py's); broken FP8 is far off or not finite
    assert 0 < f["loss_delta_max_rel"] < 0.05
    o = _ok(r, "offload")
    assert o["model"]["layers"] == max(1, full // 8)
    assert o["loss_max_abs_diff"] <= 1e-6  # offload moves tensors, it changes no number
    assert o["offloaded"]["predicted"]["allocated_bytes"] < \
        o["device"]["predicted"]["allocated_bytes"]
    assert o["predicted_host_bytes"] > 0
    h = _ok(r, "hf")
    assert h["model"]["layers"] == full // 2 and h["recompute"] == "full"
    assert h["hf"]["params"] == h["model"]["params"]  # the same architecture, HF's code
    assert h["hf"]["tokens_per_s"] > 0 and h["meshtron_over_hf_tokens_per_s"] > 0
    assert h["hf"]["profile"]["us"]["gemm"] > 0


@pytest.mark.slow
def test_rehearsed_ranks_beside_the_planner(dry_run):
    ranks = _ok(dry_run[0], "rehearse")["ranks"]
    assert [ranks[k]["pp_rank"] for k in ("first_stage", "last_stage")] == [0, 1]
    for rank in ranks.values():  # fake tensors on CPU: the planner's allocation vs the peak
        assert rank["peak_gib"] > 0 and 0.5 < rank["planner_over_measured_peak"] < 2
        assert rank["measured"].startswith("fake tensors")
    t = _ok(dry_run[0], "torch_tests")
    assert t["exit_code"] == 0 and " passed" in t["summary"] and not t["failed"]


@pytest.mark.slow
def test_checkpoint_and_cli_smoke(dry_run):
    r, _ = dry_run
    c = _ok(r, "checkpoint")
    assert c["bytes"] > 0 and c["blocking_s"]["sync"][0] > 0 and c["commit_s"]["async"][0] > 0
    for name in [n for n, *_ in CASES if n.startswith("cli_")]:
        res = _ok(r, name)
        for rec in (v for v in res.values() if isinstance(v, dict) and "argv" in v):
            assert rec["exit_code"] == 0 and rec["argv"][0] == "meshtron", (name, rec)
    k = _ok(r, "cli_kill_resume")
    assert k["killed"] and k["killed_after"] and "resumed from" in k["resumed_line"]
    assert "config.json" in _ok(r, "cli_export")["files"]
    assert _ok(r, "cli_train_auto")["train_auto"]["argv"][-3:-1] == ["auto", "--run-dir"]
    assert r["targets"]["cli_smoke"]["all_ok"] is True


def test_failures_timeouts_and_the_budget_are_recorded_not_fatal(tmp_path):
    # env gets 1 s: torch does not even import; eager needs 3 x 60 s (dry run) of a 100 s
    # budget: skipped; cli_train (a million steps: it cannot finish, however fast the
    # machine) is stopped at 8 s, its command's record kept; cli_export alone has no run to
    # export: it raises. The kit still exits 0 with its JSON.
    proc, out = _kit(tmp_path, "--only", "cli_export,env,eager,cli_train", "--caps",
                     "env=1,cli_train=8", "--budget", "100", "--cli-steps", "1000000",
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    e = r["cases"]["cli_export"]
    assert e["status"] == "error" and e["exit_code"] == 1
    assert any("no run with a committed checkpoint" in x for x in e["output_tail"])
    assert r["cases"]["env"]["status"] == "timeout" and r["cases"]["env"]["seconds"] < 30
    assert r["cases"]["eager"]["status"] == "skipped" and "budget" in r["cases"]["eager"]["reason"]
    t = r["cases"]["cli_train"]
    assert t["status"] == "timeout" and t["result"]["train"]["timed_out"] is True
    assert t["result"]["train"]["argv"][:2] == ["meshtron", "train"]
    assert r["targets"]["cli_smoke"]["all_ok"] is False


def test_bad_flags_are_one_line(tmp_path):
    proc, _ = _kit(tmp_path, "--only", "nope", timeout=60)
    assert proc.returncode == 2 and "unknown ['nope']" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_profile_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert category("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert category("flash_fwd_kernel") == "attention"
    assert category("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert category("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == \
        "optimizer"
    assert category("triton_poi_fused_add_mul_silu_0") == "elementwise"
    assert category("aten::mm") == "gemm" and category("aten::add_") == "elementwise"
    # overlapping kernels on two streams count once; the gap is idle
    assert busy_us([(0, 10), (5, 12), (20, 25)]) == 17
    s = summarize([("ncclKernel", 7, 5, 12), ("gemm_a", 10, 0, 10), ("relu", 5, 20, 25)],
                  30, "cuda kernels")
    assert s["busy_us"] == 17 and s["idle_us"] == 13 and s["us"]["communication"] == 7
    assert s["share"]["idle"] == pytest.approx(13 / 30)


def test_profile_rows_leave_out_the_annotation_ranges_on_the_device():
    """On CUDA (torch 2.11, H200) the profiler puts 'Optimizer.step#AdamW.step' on the device
    timeline around the optimizer's kernels: counted, it would double the optimizer time."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def ev(i, name, start, end, device, annotation=False):
        return FunctionEvent(i, name, 0, start, end, device_type=device,
                             is_user_annotation=annotation)

    cuda = [ev(1, "Optimizer.step#AdamW.step", 0, 130, DeviceType.CUDA, annotation=True),
            ev(2, "multi_tensor_apply_kernel", 10, 75, DeviceType.CUDA),
            ev(3, "aten::mm", 0, 200, DeviceType.CPU)]
    rows = rows_of(cuda, cuda=True)
    assert [r[0] for r in rows] == ["multi_tensor_apply_kernel"] and rows[0][1] == 65
    assert [r[0] for r in rows_of(cuda, cuda=False)] == ["aten::mm"]


def test_after_an_oom_the_later_cases_start_from_the_shape_that_fitted(tmp_path):
    """The planner's largest fit ran out of memory in the eager case, which then measured two
    layers fewer: the next cases are told, instead of running out of memory again."""
    import argparse

    args = argparse.Namespace(ckpt_gib=3.0, seq_len=None, global_batch=None, steps=None,
                              cli_steps=None, dry_run=False)
    eager = {"status": "ok", "result": {"oom": {"layers": 28},
                                        "run": {"model": {"layers": 26}}}}
    argv = _child_argv(args, "compile", tmp_path / "c.json", tmp_path, {"cases": {"eager": eager}})
    assert argv[argv.index("--fits-layers") + 1] == "26"
    for report in ({"cases": {}}, {"cases": {"eager": {**eager, "status": "error"}}},
                   {"cases": {"eager": {"status": "ok", "result": {"run": {}}}}}):
        assert "--fits-layers" not in _child_argv(args, "compile", tmp_path / "c.json",
                                                  tmp_path, report)


def _synthetic_cuda_window() -> list[Rec]:
    """Thread 1 launches kernels on stream 7 (compute); stream 9 runs one NCCL kernel. Gaps on
    stream 7: 2 us (before k2), none (k3 starts as k2 ends), 140 us (k4: launched 5 us before it
    ran, during an optimizer step: host-bound), 1200 us (k5: launched 1400 us ahead, waiting on
    the NCCL kernel that fills 1090 us of the gap)."""
    mm = ((8192, 4096), (4096, 4096))
    return [
        Rec("aten::mm", "op", 0, 5, lane=1, corr=101, shapes=mm),
        Rec("cudaLaunchKernel", "runtime", 1, 3, lane=1, corr=1, linked=101),
        Rec("nvjet_gemm_a", "kernel", 0, 10, lane=7, corr=1, linked=101),
        Rec("aten::mm", "op", 6, 11, lane=1, corr=102, shapes=mm),
        Rec("cudaLaunchKernel", "runtime", 7, 9, lane=1, corr=2, linked=102),
        Rec("nvjet_gemm_a", "kernel", 12, 50, lane=7, corr=2, linked=102),
        Rec("aten::add_", "op", 20, 25, lane=1, corr=103),
        Rec("cudaLaunchKernel", "runtime", 21, 23, lane=1, corr=3, linked=103),
        Rec("elementwise_add", "kernel", 50, 60, lane=7, corr=3, linked=103),
        Rec("Optimizer.step#AdamW.step", "op", 40, 400, lane=1, corr=104),
        Rec("aten::_foreach_add_", "op", 190, 198, lane=1, corr=105),
        Rec("cudaLaunchKernel", "runtime", 195, 197, lane=1, corr=4, linked=105),
        Rec("multi_tensor_apply_kernel", "kernel", 200, 300, lane=7, corr=4, linked=105),
        Rec("ncclDevKernel_AllReduce", "kernel", 400, 1490, lane=9, corr=5, linked=106),
        Rec("aten::copy_", "op", 99, 102, lane=1, corr=107),
        Rec("cudaMemcpyAsync", "runtime", 100, 101, lane=1, corr=6, linked=107),
        Rec("Memcpy DtoD", "kernel", 1500, 1600, lane=7, corr=6, linked=107),
    ]


def test_gap_analysis_of_a_synthetic_kernel_timeline():
    g = timeline.gaps(_synthetic_cuda_window(), top=10)
    assert g["source"] == "cuda kernels" and g["lane"] == 7 and g["units"] == 5
    assert g["gaps"] == 3 and g["idle_in_gaps_us"] == 2 + 140 + 1200
    assert g["span_us"] == 1600 and g["busy_us"] == 10 + 38 + 10 + 100 + 100
    h = g["histogram"]
    assert (h["lt_10us"], h["10_100us"]) == ({"count": 1, "us": 2}, {"count": 0, "us": 0})
    assert h["100us_1ms"] == {"count": 1, "us": 140} and h["ge_1ms"] == {"count": 1, "us": 1200}
    big, mid, small = g["largest"]
    assert (big["start_us"], big["us"], big["before"], big["after"]) == (
        300, 1200, "multi_tensor_apply_kernel", "Memcpy DtoD")
    assert big["launcher"] == "aten::copy_" and big["launch_lead_us"] == 1400
    assert big["other_streams_busy_us"] == 1090  # the NCCL kernel ran in the gap
    assert big["host_at_gap_start"] == ["Optimizer.step#AdamW.step"]
    assert (mid["us"], mid["launcher"], mid["launch_lead_us"]) == (140, "aten::_foreach_add_", 5)
    assert mid["before"] == "elementwise_add" and mid["other_streams_busy_us"] == 0
    assert (small["us"], small["launcher"], small["launcher_shapes"]) == (
        2, "aten::mm", [[8192, 4096], [4096, 4096]])
    assert g["by_launcher"][0] == {"launcher": "aten::copy_", "gaps": 1, "us": 1200}


def test_gemm_tflops_per_shape_of_a_synthetic_timeline():
    recs = _synthetic_cuda_window() + [  # one more call of the same shape, with a split-K
        Rec("aten::mm", "op", 2000, 2005, lane=1, corr=201, shapes=((8192, 4096), (4096, 4096))),
        Rec("nvjet_gemm_b", "kernel", 2010, 2062, lane=7, corr=7, linked=201),
        Rec("splitKreduce_kernel", "kernel", 2062, 2070, lane=7, corr=8, linked=201),
        Rec("aten::addmm", "op", 2100, 2105, lane=1, corr=202,
            shapes=((4096,), (1024, 4096), (4096, 4096), (), ())),
        Rec("cutlass_gemm", "kernel", 2110, 2130, lane=7, corr=9, linked=202)]
    s = timeline.gemm_shapes(recs, lambda name: category(name) == "gemm" or "splitK" in name)
    assert s["source"] == "cuda kernels" and s["distinct_shapes"] == 2
    mm, addmm = s["rows"]
    assert (mm["op"], mm["calls"], mm["kernels"], mm["us"]) == ("aten::mm", 3, 4, 10 + 38 + 60)
    assert mm["bmnk"] == [1, 8192, 4096, 4096]
    assert mm["kernel"] == "nvjet_gemm_b"  # the kernel with the most time: 52 us vs 10 + 38
    assert mm["tflops"] == pytest.approx(3 * 2 * 8192 * 4096 * 4096 / 108e-6 / 1e12)
    assert addmm["bmnk"] == [1, 1024, 4096, 4096] and addmm["calls"] == 1
    assert s["total"]["us"] == 128 and s["total"]["calls"] == 4
    assert s["total"]["tflops"] == pytest.approx(
        (3 * 2 * 8192 * 4096**2 + 2 * 1024 * 4096**2) / 128e-6 / 1e12)
    assert timeline.gemm_flops("aten::bmm", [[4, 8, 16], [4, 16, 32]]) == (
        2.0 * 4 * 8 * 32 * 16, [4, 8, 32, 16])
    assert timeline.gemm_flops("aten::mm", [[8]]) is None  # a shape it cannot read


def test_profiler_records_on_cpu_carry_operators_with_shapes_and_ids():
    import torch
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        a @ b
    recs = events.records(prof)
    mm = [r for r in recs if r.name == "aten::mm"]
    assert mm and mm[0].kind == "op" and mm[0].corr > 0 and mm[0].end > mm[0].start
    assert mm[0].shapes[:2] == ((8, 16), (16, 4))
    s = timeline.gemm_shapes(recs, lambda name: category(name) == "gemm")
    assert s["rows"][0]["bmnk"] == [1, 8, 4, 16] and s["rows"][0]["tflops"] > 0


def test_clock_sampler_summary_and_no_clock_on_cpu():
    import time

    import torch

    readings = iter([(1980, 690.0, 61, 0x4), (1755, 700.0, 63, 0x4), (1830, 650.0, 62, 0x0)])
    last = [None]

    def read():
        sm, w, c, mask = next(readings, last[0] or (None, None, None, None))
        last[0] = (sm, w, c, mask)
        return {"sm_clock_mhz": sm, "power_w": w, "temperature_c": c, "reasons": mask}

    with clocks.Sampler(read, "injected", {"power_limit_w": 700.0}, interval_s=0.001) as s:
        deadline = time.monotonic() + 30
        while len(s.samples) < 5 and time.monotonic() < deadline:
            time.sleep(0.002)
    out = s.summary()
    assert out["source"] == "injected" and out["reason"] is None and out["power_limit_w"] == 700
    assert out["t0_unix_ns"] > 1.6e18  # the profiler's clock: samples go on its timeline
    assert out["sm_clock_mhz"]["min"] == 1755 and out["sm_clock_mhz"]["max"] == 1980
    assert out["power_w"]["max"] == 700.0 and out["temperature_c"]["min"] == 61
    assert out["limit_reasons"]["sw_power_cap"] == 2 and out["n"] == len(out["samples"])
    assert clocks.reasons(0x24) == ["sw_power_cap", "sw_thermal"]
    sampler, why = clocks.sampler(torch.device("cpu"))
    assert sampler is None and "no GPU clock" in why
    assert clocks.unavailable(why)["sm_clock_mhz"] is None


def test_each_clock_sample_carries_the_gemm_load_of_the_interval_before_it():
    """A clock that drops as GEMMs fill the window (a power limit) can be told from one that
    does not only when each sample says how busy the GEMMs kept the GPU meanwhile."""
    from gpukit.profile import _gemm_load

    t0_us = 1.7e15  # the profiler's Unix-epoch clock, as on a real run
    recs = [Rec("nvjet_gemm", "kernel", t0_us + 0, t0_us + 500, lane=7),
            Rec("elementwise_add", "kernel", t0_us + 500, t0_us + 1000, lane=7),
            Rec("nvjet_gemm", "kernel", t0_us + 1250, t0_us + 1750, lane=7),
            Rec("nvjet_gemm", "kernel", t0_us + 1900, t0_us + 2100, lane=7)]
    edges = [t0_us + x for x in (0, 1000, 2000, 3000)]
    assert timeline.share_over(recs, lambda n: "gemm" in n, edges) == pytest.approx([0.5, 0.6, 0.1])
    s = clocks.Sampler(lambda: {}, "injected")
    s.t0_unix_ns = int(t0_us * 1e3)
    s.samples = [{"t_s": 0.0, "sm_clock_mhz": 1980}, {"t_s": 0.001, "sm_clock_mhz": 1900},
                 {"t_s": 0.002, "sm_clock_mhz": 1800}]
    _gemm_load(recs, s)
    assert "gemm_share" not in s.samples[0]
    assert [x["gemm_share"] for x in s.samples[1:]] == [pytest.approx(0.5), pytest.approx(0.6)]
    assert s.summary()["samples"][2]["gemm_share"] == pytest.approx(0.6)


def test_nvidia_smi_sampler_reads_its_lines_and_stops_it(tmp_path, monkeypatch):
    """The image may lack pynvml: then nvidia-smi samples the window (one `-lms` process).
    A stand-in nvidia-smi that, like older drivers, rejects the newer reasons field name."""
    import time

    import torch

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   'case "$*" in *clocks_event_reasons*) echo "not a valid field" >&2; exit 2;; '
                   "esac\n"
                   'case "$*" in *-lms*) while true; do echo "1755, 699.12, 63, '
                   '0x0000000000000004"; sleep 0.02; done;; esac\n'
                   'echo "1980, 120.50, 40, 0x0000000000000000"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert clocks._smi_index(torch.device("cuda", 0)) == "3"
    s = clocks._smi(torch.device("cuda", 0))
    with s:
        deadline = time.monotonic() + 30
        while len(s.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    out = s.summary()
    assert out["source"] == "nvidia-smi" and out["n"] >= 3
    assert out["sm_clock_mhz"]["median"] == 1755 and out["power_w"]["max"] == 699.12
    assert out["limit_reasons"] == {"sw_power_cap": out["n"]}
    assert s._thread.is_alive() is False


def test_gap_analysis_on_host_operators_when_there_are_no_kernels():
    """The dry run's stand-in: the leaf operators of the busiest thread, the enclosing operator
    as the launcher (one on another thread never encloses them)."""
    ops = [Rec("aten::linear", "op", 0, 100, lane=1, corr=1),
           Rec("aten::mm", "op", 10, 20, lane=1, corr=2),
           Rec("aten::add", "op", 50, 60, lane=1, corr=3),
           Rec("autograd::engine", "op", 0, 200, lane=2, corr=4),
           Rec("aten::fill_", "op", 15, 16, lane=2, corr=5)]
    g = timeline.gaps(ops)
    assert g["source"] == "cpu leaf ops (dry run)" and g["lane"] == 1 and g["units"] == 2
    (gap,) = g["largest"]
    assert (gap["start_us"], gap["us"], gap["before"], gap["after"]) == (10, 30, "aten::mm",
                                                                           "aten::add")
    assert gap["launcher"] == "aten::linear" and gap["host_at_gap_start"] == ["aten::linear"]
    assert gap["launch_lead_us"] == 0 and g["histogram"]["10_100us"] == {"count": 1, "us": 30}
