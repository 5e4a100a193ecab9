"""The GPU kit's idle explanation (issue 31), on CPU by construction: whether the host was late
for each idle gap (bench/gpukit/hostbound.py) on a synthetic kernel timeline, the caching
allocator's record (allocator.py) from injected readers shaped as torch 2.11-2.13's
memory_stats and an older one's, and the JSON's `idle` summary (idle.py) from case records.
The kit's dry run exercises the same code on CPU operators (tests/test_gpu_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check import CASES, SUITES, case_env, chosen_cases, only  # noqa: E402
from gpukit import allocator, hostbound, idle  # noqa: E402
from gpukit.timeline import Rec  # noqa: E402


def _window() -> list[Rec]:
    """Main thread 1, autograd thread 2, compute stream 7, NCCL on stream 9. Gaps on stream 7:
    none before k2; 290 us before k3, whose launch waited for a cudaFree (host late, in it);
    106 us before k4, launched by the autograd thread after the gap began, between operators
    (host late); 300 us before k5, launched 328 us ahead while NCCL ran 250 us of the gap
    (device wait)."""
    return [
        Rec("aten::mm", "op", 0, 10, lane=1, corr=101),
        Rec("cudaLaunchKernel", "runtime", 2, 4, lane=1, corr=1, linked=101),
        Rec("gemm_k1", "kernel", 5, 100, lane=7, corr=1, linked=101),
        Rec("aten::add_", "op", 12, 20, lane=1, corr=102),
        Rec("cudaLaunchKernel", "runtime", 14, 16, lane=1, corr=2, linked=102),
        Rec("add_k2", "kernel", 100, 110, lane=7, corr=2, linked=102),
        Rec("aten::mm", "op", 30, 400, lane=1, corr=103),
        Rec("cudaFree", "runtime", 35, 380, lane=1, corr=50, linked=103),
        Rec("cudaMalloc", "runtime", 381, 390, lane=1, corr=51, linked=103),
        Rec("cudaLaunchKernel", "runtime", 392, 394, lane=1, corr=3, linked=103),
        Rec("gemm_k3", "kernel", 400, 500, lane=7, corr=3, linked=103),
        Rec("aten::mul", "op", 600, 610, lane=2, corr=104),
        Rec("cudaLaunchKernel", "runtime", 602, 604, lane=2, corr=4, linked=104),
        Rec("mul_k4", "kernel", 606, 650, lane=7, corr=4, linked=104),
        Rec("aten::copy_", "op", 620, 630, lane=2, corr=105),
        Rec("cudaLaunchKernel", "runtime", 622, 624, lane=2, corr=5, linked=105),
        Rec("ncclDevKernel_AllReduce", "kernel", 650, 900, lane=9, corr=6, linked=106),
        Rec("copy_k5", "kernel", 950, 1000, lane=7, corr=5, linked=105),
        # a sync outside any operator: no link, recorded as an "op", still a runtime call
        Rec("cudaStreamSynchronize", "op", 1000, 1010, lane=1, corr=60),
    ]


def test_host_late_and_device_wait_idle_of_a_synthetic_timeline():
    h = hostbound.analyse(_window(), steps=1, micro_batches=2)
    assert h["source"] == "cuda kernels" and h["micro_batches_in_window"] == 2
    assert h["gaps"] == {"host_late": 2, "device_wait": 1, "unknown": 0}
    assert h["idle_us_per_micro_batch"] == (290 + 106 + 300) / 2
    assert h["host_late_us_per_micro_batch"] == (290 + 106) / 2
    assert h["device_wait_us_per_micro_batch"] == 300 / 2
    assert h["device_wait_other_streams_us_per_micro_batch"] == 250 / 2
    assert h["host_late_share"] == pytest.approx(396 / 696)
    assert h["late_by_host"] == [
        {"host": "cudaFree", "gaps": 1, "us_per_micro_batch": 145.0},
        {"host": hostbound.BETWEEN_OPS, "gaps": 1, "us_per_micro_batch": 53.0}]
    # first host operator (0) to the last launch (622); every stream's kernels, overlaps once
    assert h["host_issue_us_per_step"] == 622
    assert h["gpu_busy_us_per_step"] == 95 + 10 + 100 + 44 + 250 + 50
    assert h["kernels_per_micro_batch"] == 3 and h["host_ops_per_micro_batch"] == 2.5
    rt = h["runtime"]
    assert rt["calls"]["cudaFree"] == {"calls": 1, "us": 345}
    assert rt["calls"]["cudaStreamSynchronize"] == {"calls": 1, "us": 10}
    assert "cudaLaunchKernel" not in rt["calls"]
    assert rt["alloc_calls_per_micro_batch"] == 1 and rt["alloc_us_per_micro_batch"] == 177
    assert rt["sync_calls_per_micro_batch"] == 0.5
    assert h["verdict"].startswith("host-bound: 0.20 ms of 0.35 ms idle per micro-batch had "
                                   "the host late (most in cudaFree: 0.14")
    assert "host issued a step in 0.6 ms for 0.5 ms of device work" in h["verdict"]


def test_a_device_bound_window_and_kernels_without_launch_records():
    """Every kernel queued long before it ran: not host-bound. A kernel whose launch call
    was not recorded is `unknown`, counted in neither."""
    recs = [Rec("aten::mm", "op", 0, 5, lane=1, corr=101),
            Rec("cudaLaunchKernel", "runtime", 1, 2, lane=1, corr=1, linked=101),
            Rec("cudaLaunchKernel", "runtime", 3, 4, lane=1, corr=2, linked=101),
            Rec("k1", "kernel", 10, 20, lane=7, corr=1),
            Rec("k2", "kernel", 50, 60, lane=7, corr=2),
            Rec("k3", "kernel", 70, 80, lane=7, corr=3)]
    h = hostbound.analyse(recs)
    assert h["gaps"] == {"host_late": 0, "device_wait": 1, "unknown": 1}
    assert h["unknown_us_per_micro_batch"] == 10 and h["host_late_share"] == 0
    assert h["verdict"].startswith("not host-bound: 0.00 ms of 0.04 ms idle")
    # no launch call, but its operator began after the gap did: late, whatever the call's time
    late_op = recs + [Rec("aten::mul", "op", 85, 88, lane=1, corr=102),
                      Rec("k4", "kernel", 90, 95, lane=7, corr=4, linked=102)]
    assert hostbound.analyse(late_op)["gaps"] == {"host_late": 1, "device_wait": 1, "unknown": 1}
    # most of the idle with no launch record: no verdict either way
    blind = [Rec("k1", "kernel", 0, 10, lane=7), Rec("k2", "kernel", 50, 60, lane=7)]
    assert hostbound.analyse(blind)["verdict"].startswith("undecided")
    assert hostbound.analyse([])["reason"] and "no verdict" in hostbound.verdict({})


def test_on_cpu_operators_every_gap_is_host_time():
    """The dry run's stand-in: a CPU operator starts when its thread issues it (lead 0)."""
    ops = [Rec("aten::linear", "op", 0, 100, lane=1, corr=1),
           Rec("aten::mm", "op", 10, 20, lane=1, corr=2),
           Rec("aten::add", "op", 50, 60, lane=1, corr=3)]
    h = hostbound.analyse(ops)
    assert h["source"] == "cpu leaf ops (dry run)" and h["host_late_share"] == 1.0
    assert h["late_by_host"] == [{"host": "aten::linear", "gaps": 1, "us_per_micro_batch": 30}]
    assert h["host_issue_us_per_step"] == 50 and h["gpu_busy_us_per_step"] == 20


STATS_213 = {"num_alloc_retries": 3, "num_ooms": 0, "num_sync_all_streams": 3,
             "num_device_alloc": 40, "num_device_free": 10, "segment.all.allocated": 40,
             "segment.all.freed": 10, "allocated_bytes.all.peak": 100,
             "reserved_bytes.all.peak": 130, "active_bytes.all.peak": 110,
             "requested_bytes.all.peak": 99, "allocated_bytes.all.current": 50,
             "reserved_bytes.all.current": 120, "inactive_split_bytes.all.current": 7}


def _reader(before: dict, after: dict, segments=None, log=None):
    reads = iter([before, after])
    log = [] if log is None else log
    return allocator.Reader(lambda: next(reads), lambda: log.append("reset"),
                            lambda: segments, lambda: "native")


def test_allocator_window_from_injected_readers(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    after = {**STATS_213, "num_alloc_retries": 5, "num_sync_all_streams": 5,
             "num_device_alloc": 46, "num_device_free": 16, "segment.all.allocated": 44,
             "segment.all.freed": 14, "allocated_bytes.all.peak": 200,
             "reserved_bytes.all.peak": 260}
    log: list = []
    ran: list = []
    rec = allocator.measured(_reader(STATS_213, after, [{"is_expandable": True}] * 3, log),
                             lambda: ran.append(log[:]))
    assert ran == [["reset"]]  # the peaks are the window's own: reset before it ran
    assert rec["source"] == "torch.cuda.memory_stats" and rec["missing"] == []
    assert (rec["retries"], rec["device_frees"], rec["device_allocs"]) == (2, 6, 6)
    assert rec["counters"]["num_sync_all_streams"] == 2
    assert rec["counters"]["segment.all.freed"] == 4
    assert rec["peak_bytes"] == {"allocated_bytes": 200, "reserved_bytes": 260,
                                 "active_bytes": 110, "requested_bytes": 99}
    assert rec["reserved_minus_allocated_peak_bytes"] == 60
    assert rec["after_bytes"]["inactive_split_bytes"] == 7 and rec["backend"] == "native"
    assert rec["expandable_observed"] == {"segments": 3, "expandable": 3}
    assert allocator.expandable_on(rec) is True
    assert allocator.verdict(rec).startswith("allocator: 2 retries, 6 device frees, 6 device "
                                             "allocs, 2 stream syncs in the window (a retry")


def test_allocator_on_a_torch_without_the_device_counters():
    """An older torch's stats lack num_device_alloc / num_device_free: the segments obtained
    and released stand in, the missing keys are named; a snapshot whose segments do not say
    whether they are expandable leaves the configuration to say it."""
    old = {k: v for k, v in STATS_213.items() if not k.startswith("num_device")
           and k != "requested_bytes.all.peak"}
    after = {**old, "segment.all.freed": 12, "segment.all.allocated": 41}
    rec = allocator.measured(_reader(old, after, [{"total_size": 1}]), lambda: None,
                             reset_peak=False)
    assert rec["missing"] == ["num_device_alloc", "num_device_free", "requested_bytes.all.peak"]
    assert (rec["device_frees"], rec["device_allocs"], rec["retries"]) == (2, 1, 0)
    assert rec["peaks_since"] == "engine"
    assert rec["expandable_observed"] == {"segments": 1, "expandable": None}
    assert allocator.expandable_on(rec) is rec["conf"]["expandable_segments"]


def test_allocator_reader_failures_and_no_allocator_never_stop_the_window():
    ran: list = []

    def broken():
        raise RuntimeError("memory_stats: not on this torch")

    rec = allocator.measured(allocator.Reader(broken, lambda: None, lambda: None,
                                              lambda: None), lambda: ran.append(1))
    assert ran == [1] and rec["source"] is None and "not on this torch" in rec["error"]
    rec = allocator.measured(None, lambda: ran.append(2), "dry run: no allocator")
    assert ran == [1, 2] and rec["reason"] == "dry run: no allocator"
    assert allocator.verdict(rec) == "allocator: not recorded (dry run: no allocator)"
    import torch

    assert allocator.cuda_reader(torch.device("cpu")) is None

    def oom():  # the window's own error is the case's (its out-of-memory fallback), unchained
        raise torch.OutOfMemoryError("CUDA out of memory")

    for reader in (None, allocator.Reader(broken, lambda: None, lambda: None, lambda: None),
                   _reader(STATS_213, STATS_213)):
        with pytest.raises(torch.OutOfMemoryError) as info:
            allocator.measured(reader, oom)
        assert info.value.__context__ is None


def test_allocator_configuration_and_the_expandable_variant_environment(monkeypatch):
    assert allocator.conf({}) == {"env": None, "value": None, "expandable_segments": False}
    c = allocator.conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:"
                                                   "True"})
    assert c["env"] == "PYTORCH_CUDA_ALLOC_CONF" and c["expandable_segments"] is True
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:False",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator.conf(both)["expandable_segments"] is False  # torch reads the first
    assert allocator.with_expandable({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator.with_expandable(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:False"}) == {
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}
    for var in allocator.CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    assert case_env("eager_expandable", False)["PYTORCH_CUDA_ALLOC_CONF"] == \
        "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in case_env("eager", False)
    assert case_env("eager", True)["OMP_NUM_THREADS"]


def test_the_idle_suite_names_cases_in_the_kits_order():
    names = [c[0] for c in CASES]
    assert set(SUITES["idle"]) <= set(names) and {"eager", "eager_expandable"} <= set(
        SUITES["idle"])
    assert only("idle,cli_plan") == [*SUITES["idle"], "cli_plan"]
    # a suite alone runs in its own order (eager before hf); a list runs in the kit's order
    assert [c[0] for c in chosen_cases("idle")] == list(SUITES["idle"])
    assert [c[0] for c in chosen_cases("idle,cli_plan")] == [
        n for n in names if n in SUITES["idle"] or n == "cli_plan"]
    # eager_expandable is the idle suite's (OPTIONAL): the default order fits the budget
    assert [c[0] for c in chosen_cases(None)] == [n for n in names if n != "eager_expandable"]
    assert dict((n, f) for n, f, *_ in CASES)["eager_expandable"] == "cases:case_eager"


def _engine(recs, micro_batches, stats_after, tokens_per_s, plan="p"):
    host = hostbound.analyse(recs, 1, micro_batches)
    alloc = allocator.measured(_reader(STATS_213, stats_after), lambda: None)
    return {"model": {"layers": 13}, "plan": plan, "tokens_per_s": tokens_per_s,
            "step_time_s": 1.0, "profile": {"host": host, "allocator": alloc},
            "allocator_timed_steps": {"retries": 4}}


def test_idle_summary_rows_and_the_expandable_comparison():
    retried = {**STATS_213, "num_alloc_retries": 4, "num_device_free": 13}
    cases = {
        "env": {"status": "ok", "result": {"matmul": {}}},
        "eager": {"status": "ok", "result": {"run": _engine(_window(), 2, retried, 100.0)}},
        "eager_expandable": {"status": "ok", "result": {
            "run": _engine(_window()[:6], 2, STATS_213, 110.0)}},
        "fp8": {"status": "timeout", "result": {"bf16": _engine(_window(), 1, STATS_213, 9.0)}},
        "hf": {"status": "error", "result": {}}}
    s = idle.summary(cases)
    assert set(s) == {"eager", "eager_expandable", "fp8.bf16", "expandable_vs_default"}
    e = s["eager"]
    assert e["idle_ms_per_micro_batch"] == pytest.approx(0.348)
    assert e["host_late_ms_per_micro_batch"] == pytest.approx(0.198)
    assert (e["allocator_retries"], e["device_frees"], e["allocator_retries_timed_steps"]) == (
        1, 3, 4)
    assert e["allocator_syncs"] == 0 and e["device_allocs"] == 0
    assert e["verdict"].startswith("host-bound") and e["allocator"].startswith("allocator: 1 ")
    assert s["eager_expandable"]["idle_ms_per_micro_batch"] == 0  # k1, k2: no gap
    cmp = s["expandable_vs_default"]
    assert cmp["same_model_and_plan"] and cmp["idle_ratio"] == 0
    assert cmp["tokens_per_s_ratio"] == pytest.approx(1.1)
    assert cmp["allocator_retries"] == [1, 0] and cmp["device_frees"] == [3, 0]
    printed = dict(idle.lines(s, "eager_expandable"))
    assert printed["expandable_vs_default"].startswith("idle per micro-batch 0.35 -> 0.00 ms")
    (_, counts), (_, verdict) = idle.lines(s, "eager")
    assert counts.startswith("0.35 ms idle per micro-batch, 0.20 ms of it host-late; "
                             "allocator retries 1, device frees 3")
    assert verdict == e["verdict"]
    cases["eager_expandable"]["result"]["run"]["plan"] = "other"
    assert idle.summary(cases)["expandable_vs_default"]["same_model_and_plan"] is False


def test_other_streams_cover_a_gap_once_however_many_kernels_overlap():
    cover = hostbound._Coverage([(10, 30), (20, 40), (50, 60), (70, 71)])
    assert cover(0, 100) == 30 + 10 + 1  # 10-40 once, 50-60, 70-71
    assert cover(25, 55) == 15 + 5 and cover(41, 49) == 0 and cover(0, 5) == 0
    assert hostbound._Coverage([])(0, 10) == 0


def test_a_malformed_engine_record_costs_only_its_own_row():
    cases = {"eager": {"status": "error", "result": {"run": {"profile": {"host": "garbage"}}}}}
    s = idle.summary(cases)
    assert "AttributeError" in s["eager"]["error"] and "expandable_vs_default" not in s
    assert list(idle.lines(s, "eager")) == [("eager", f"no summary: {s['eager']['error']}")]
