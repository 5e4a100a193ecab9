"""GPU check kit: what one lent GPU says about meshtron, in one JSON file, in one call.

    python3 bench/gpu_check.py --budget 480 --out $OUT/gpu_check.json   # one CUDA GPU
    python3 bench/gpu_check.py --dry-run --out /tmp/x.json               # every case on CPU

On a lent GPU: the image (torch 2.11.0+cu130, Python 3.12; ../shared/notes/gpu-h200-facts.md)
lacks tomli_w (every case needs it: meshtron's Plan writes TOML), torchao (fp8, cli_fp8),
pytest (torch_tests) and nvidia-ml-py (optional: the clock-limit reasons and the power limit;
without it clocks come from nvidia-smi), and nothing installs from a registry there. Their
wheels travel in the ignored `.whl/` folder. Here, once:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d .whl tomli_w==1.2.0 torchao==0.18.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
      nvidia-ml-py==13.615.71

then ONE device call (`run`, carry [".whl"], timeout_s 600; do not carry torch: the image's is
the one under test):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 &&
    python3 bench/gpu_check.py --budget 480 --out $OUT/gpu_check.json

(`--only idle` instead of the full order for the idle explanation alone). The kit starts by
naming each of those modules it cannot find (`preflight` in the JSON) and records a case whose
module is missing as "skipped: X not installed (carry ...)", so a missing wheel costs that case,
never the call. `give_back` right after; commit the JSON under bench/results/. The budget,
plus at most 35 s to stop the cases at their caps (SIGTERM, 20 s, SIGKILL, 10 s, 5 s for
the output; a group's overdue members all at once: runner.stop_all), fits a 600 s call; if the call's limit still stops the kit (SIGTERM), it records the
running case as `interrupted` with what it measured, names the cases never started and writes
the JSON. The cases that did not fit run in a second call with `--only NAME,...`, which the
kit prints at its end.
To explain the eager step's idle (issue 31) in one call, the same with `--only idle`: the
JSON's `idle` then says, per micro-batch, how much idle had the host late, what the allocator
retried and freed, and whether expandable segments change it.

Every case runs in its own process (`--run-case NAME`, bench/gpukit/) with its own time cap,
inside a total budget: a case that raises, crashes or runs out of time is recorded (exit code,
the tail of its output, whatever it measured before) and the next one starts. The JSON is
rewritten after every case, and each case rewrites its own part as it measures, so a call cut
short keeps everything measured so far. Cases run most valuable first; one whose shortest
useful run (its floor) no longer fits the remaining budget is recorded as skipped, and the
others run with their cap trimmed to what is left. The cases whose figures are not timings
(the CLI smoke, gputrue, torch_tests: CASES' group "smoke") run side by side, each still in
its own process with its own cap and record (`side_by_side`; bench/gpukit/runner.py): each
process pays ~7 s of torch import and CUDA start-up on the GPU node. The default order is
sized by CASES' `expected` seconds (measured on the H200 or estimated) to fit `--budget 480`
(EXPECTED_WALL_S, tested); eager_expandable runs only with `--only` (the `idle` suite).

Cases (bench/gpukit/*.py say what each measures, CASES below their order and caps): env
(torch, GPU, bf16 matmul ceiling); the CLI smoke (calibrate, plan, train, train --plan auto
under torchrun with checkpoints, planned with the calibration calibrate just wrote, a MoE
model, --compile, --dtype fp8, kill + --resume, export); gputrue (issue 31's device checks:
checkpoint stager order, per-device RNG state, the grouped GEMM saved by selective recompute,
context parallelism's block masks, the backend helper on a real NCCL group); checkpoint (sync
vs async); rehearse (`meshtron rehearse` of a tp=8 and a pp=4 rank of Llama-3-70B on 64 H200s,
real tensors: measured peak and compute-only step beside the planner's); hf (the same shape as
a plain Hugging Face loop); offload; eager and compile (the largest Llama-3-8B-shaped model the
planner fits, with the planner's step time, memory and MFU beside each figure, against the
catalogue and against this node's calibration, and a profiler window by category); fp8 (bf16
vs FP8 compiled, half the layers); torch_tests (the CPU tests of the device-explicit pieces
under the image's torch). The ratios the issue targets are computed here (`targets`).
Each case's record has its wall `seconds` and `cpu_s` (CPU seconds of it and every process it
waited for: on a shared machine wall time follows the load, this does not).

Each profiler window (`<case>.result.<engine>.profile`: eager, compile, fp8, offload, hf;
bench/gpukit/profile.py, clocks.py, timeline.py) records, besides the time by category and the
top kernels:
- `clocks`: the SM clock (MHz), power (W) and temperature (C) sampled every 50 ms during the
  window (`source`: pynvml, torch.cuda or nvidia-smi, the first that works), each as
  {min, median, max}, with `max_sm_clock_mhz` / `power_limit_w` (pynvml), `limit_reasons`
  (samples per clock-limit reason: `sw_power_cap` is the power limit holding the clock) and the
  `samples` ({t_s from `t0_unix_ns`, the profiler's clock; sm_clock_mhz, power_w, ...;
  `gemm_share`: the share of the interval before the sample that GEMM kernels ran, so a clock
  falling as GEMMs fill the window shows}); on CPU `source` is null and `reason` says why;
- `gaps`: the idle gaps between consecutive kernels on the compute stream (`lane`: the stream
  that ran the most kernels): `units`, `span_us`, `busy_us`, `gaps`, `idle_in_gaps_us`,
  `histogram` ({lt_10us, 10_100us, 100us_1ms, ge_1ms}: count and us; launch-bound idle is many
  small gaps, host syncs a few large ones), `largest` (start_us from the first kernel, us, the
  kernel `before` and `after`, the `launcher` CPU operator of the kernel after and its shapes,
  `launch_lead_us` = kernel start - its launch call's start: small means the host launched it
  just in time, large that it waited on the device; `host_at_gap_start`, the launching thread's
  operators then, outermost first; `other_streams_busy_us`, kernels of other streams inside the
  gap) and `by_launcher` (gap time by the operator that launched the kernel after each gap); on
  CPU the leaf operators of the busiest thread stand in for kernels;
- `host` (hostbound.py): per micro-batch (`micro_batches` per step), the idle split by whether
  the launch of the kernel after each gap came after the gap began (`host_late`: the host was
  still issuing, or blocked in cudaFree / cudaMalloc / a sync) or before it (`device_wait`: an
  event, another stream), `late_by_host` (what the launching thread was in when each late gap
  began), the host's issue time per step against the GPU's busy time, kernels and host
  operators per micro-batch, the allocating / synchronising runtime calls (`runtime`), and one
  `verdict` line ("host-bound: X ms of Y ms idle per micro-batch had the host late ...");
- `allocator` (allocator.py): the caching allocator over the window: counter deltas
  (num_alloc_retries, num_device_alloc / num_device_free, segments, feature-detected:
  `missing`), the window's peaks (reserved vs allocated), expandable segments as configured
  (`conf`) and as observed (`expandable_observed`, the snapshot's segments); the engine's
  record also has `allocator_timed_steps` (the same over the timed steps);
- `gemm_shapes`: one more step with input shapes recorded (a window of its own: shapes cost host
  time that would lengthen the gaps), with its own `clocks`: per distinct (op, input shapes) of
  aten::mm / addmm / bmm / baddbmm / _scaled_mm, `calls`, `kernels`, device `us`, `bmnk`,
  `tflops` and the main `kernel`; `total` over all of them.
The JSON's `idle` (second key; also printed after each case) has one row per profiled engine
(`eager`, `compile`, `fp8.bf16`, `hf.hf`, ...): idle ms per micro-batch, of it host-late ms,
allocator retries and device frees, expandable segments, the verdicts; and
`expandable_vs_default`: the eager case beside eager_expandable, the same step in a process
whose environment turns expandable segments on (CASE_ENV), so one call says whether the idle
falls. `--only idle` (SUITES) runs what that needs in one call of about 8 minutes at most.
The cli_calibrate case keeps the cluster file `meshtron calibrate` wrote (`toml`) and its
sustained GEMM table by transformer shape (`gemm`: m, n, k, tflops). pynvml is not in the GPU
image: add `nvidia-ml-py` (pure Python) to the wheels for the limit reasons and the power limit;
without it the kit samples through nvidia-smi.

`--dry-run` runs every case on CPU at toy size (same processes, halving, plans and JSON;
tests/test_gpu_check.py). The kit needs no `pip install`: cases run `python -m meshtron` with
the checkout on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the gpukit package (no torch at its import)

from gpukit import allocator, idle, runner  # noqa: E402
from gpukit.common import Ctx, child_env  # noqa: E402
from gpukit.wheels import WHEELS, preflight, unmet  # noqa: E402

FORMAT = "meshtron-gpu-check/2"

class Case(NamedTuple):
    """One row of CASES."""

    name: str
    fn: str
    """module:function in bench/gpukit/"""
    cap: float
    """seconds at most on the GPU (x3 in a dry run)"""
    floor: float
    """the least time in which the case can still say something"""
    expected: float
    """seconds expected on the H200: measured there (bench/results/
    gpu_check_h200_2026-12-04.json, its `seconds`) or, never measured, estimated"""
    group: str | None = None
    """consecutive rows of one group run at the same time (gpukit/runner.py)"""


# Order: what never ran to its end on a GPU first (the last run, bench/results/
# gpu_check_h200_2026-12-04.json: two CLI commands died on torch 2.11's DefaultStager, three
# cases never started within its budget), then what ran there, again for what changed since.
# Caps: about twice the time measured there (or, never measured, estimated from the shapes),
# never under 30 s. Each case process pays ~7 s of torch import and CUDA start-up there (env:
# 8 s for 0.1 s of matmuls) and each `meshtron` command as much again, so the cases whose
# figures are not timings run side by side ("smoke": the CLI smoke, the device checks, the CPU
# tests) and cost about their longest; EXPECTED_WALL, below the budget, is tested. A second
# call with `--only` (printed at the end) runs what did not fit.
CASES = [
    Case("env", "cases:case_env", 45, 15, 8),  # 8.4 s there
    # 7.3 s there; writes this node's calibration where `--plan auto` looks (the run's folder):
    # cli_train_auto then plans with it, and the model cases put its prediction beside
    Case("cli_calibrate", "cli_cases:case_cli_calibrate", 45, 15, 8),
    # 30 steps under torchrun with checkpoints: died at 22 s there at the first (stager)
    Case("cli_train_auto", "cli_cases:case_cli_train_auto", 120, 40, 30, "smoke"),
    # died at 23 s there in the resume (stager): ~15 s to the first checkpoint (step 20 of
    # 100), the resume ~10 s of start-up and 80 steps of 0.13 s
    Case("cli_kill_resume", "cli_cases:case_cli_kill_resume", 150, 45, 35, "smoke"),
    # stager order, RNG, grouped GEMM, CP (flex compiles), NCCL group: 5 checks in one
    # process (~7 s of start-up, each check 7-9 s alone there: gputrue_h200_2026-12-04.json)
    Case("gputrue", "gputrue:case_gputrue", 180, 40, 40, "smoke"),
    Case("cli_train", "cli_cases:case_cli_train", 60, 15, 15, "smoke"),  # 15.3 s
    Case("cli_moe", "cli_cases:case_cli_moe", 60, 15, 13, "smoke"),  # 12.5 s
    Case("cli_fp8", "cli_cases:case_cli_fp8", 60, 15, 14, "smoke"),  # 14.0 s
    Case("cli_plan", "cli_cases:case_cli_plan", 30, 1, 1, "smoke"),  # 0.5 s
    Case("cli_compile", "cli_cases:case_cli_compile", 90, 30, 29, "smoke"),  # 28.9 s
    # the CPU tests of the device-explicit pieces under the image's torch (never run there;
    # 16 s here on 2 shared cores)
    Case("torch_tests", "gputrue:case_torch_tests", 150, 20, 20, "smoke"),
    Case("cli_export", "cli_cases:case_cli_export", 45, 12, 12),  # 12.4 s; the resumed run
    # never started (budget): --ckpt-gib 2 (~0.18B parameters), 2 GiB saved 4 times
    Case("checkpoint", "cases:case_checkpoint", 120, 30, 30),
    # 70B ranks on the one GPU, new: `meshtron plan` and two `rehearse` processes (~7 s of
    # start-up each, ~1.1B parameters on the rank, three steps of 16 micro-batches)
    Case("rehearse", "rehearse_case:case_rehearse", 180, 50, 50),
    # never started (budget): half the eager shape, meshtron then HF (~5 s to import
    # transformers), 6 steps each of ~1.9 s, a profiler window each
    Case("hf", "hf_case:case_hf", 180, 50, 50),
    # never started (budget): ~1.7B parameters (the embeddings), host AdamW each step
    Case("offload", "cases:case_offload", 150, 45, 45),
    # 68.9 s there with 4 timed steps of 3.7 s (now 3), before the profiler window's GEMM-
    # shapes step (+1 step) and its gap analyses (~3 s); room for a second shape after an OOM
    Case("eager", "cases:case_eager", 150, 60, 72),
    Case("compile", "cases:case_compile", 160, 70, 76),  # 72.8 s there, as eager
    # 68.3 s there: one timed step fewer per engine; the bf16 engine is no longer profiled
    # (the compile case profiles bf16 compiled), the FP8 one gets the shapes step
    Case("fp8", "cases:case_fp8", 140, 60, 66),
    # the eager step again, expandable segments on (CASE_ENV): does the idle fall? (issue 31)
    # Not in the default order (OPTIONAL): the `idle` suite runs it.
    Case("eager_expandable", "cases:case_eager", 150, 60, 72),
]
OPTIONAL = ("eager_expandable",)
"""Cases only `--only` (or a suite) runs: the default order must fit the default budget."""
CASE_ENV = {"eager_expandable": allocator.with_expandable}
"""Environment changes of a case's process, from the kit's own environment (the allocator
reads its configuration once, at the first CUDA allocation: only a process of its own can
change it)."""
SUITES = {"idle": ("cli_calibrate", "env", "eager", "eager_expandable", "compile", "hf")}
"""`--only idle`: what the eager step's unexplained idle needs, in one call, in this order
(calibrate first: the eager case puts this node's calibrated prediction beside its figures;
about 8 + 8 + 72 + 72 + 76 + 50 s expected there, CASES' `expected`: the budget trims hf's
cap to what is left)."""
TARGETS = {"compiled_over_eager_tokens_per_s": 1.10, "fp8_over_bf16_compiled_tokens_per_s": 1.3,
           "mfu_bf16_compiled": 0.55}
EXPECTED_BUDGET_S = 480.0
"""The default `--budget`: the default order's expected wall time (runner.expected_wall)
stays under it (tests/test_gpu_check_budget.py)."""


def _on_term(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the rest would cut the record
    raise runner.Interrupted(f"signal {signum}")


def say(text: str) -> None:
    print(text, flush=True)


def _child_argv(args, name: str, case_out: Path, work: Path, report: dict) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--run-case", name,
            "--case-out", str(case_out), "--work", str(work), "--ckpt-gib", str(args.ckpt_gib)]
    eager_ok = (report["cases"].get("eager") or {}).get("status") == "ok"
    if eager_ok and _get(report, "eager", "oom"):
        # the planner's largest fit did not fit: the later cases start from what did
        argv += ["--fits-layers", str(_get(report, "eager", "run", "model", "layers"))]
    for flag in ("seq_len", "global_batch", "steps", "cli_steps"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + (["--dry-run"] if args.dry_run else [])


def case_env(name: str, dry_run: bool) -> dict[str, str]:
    """The environment of case `name`'s process (CASE_ENV's changes included)."""
    env = child_env()
    if name in CASE_ENV:
        env.update(CASE_ENV[name](env))
    if dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _limits(args, row: Case, left: float) -> tuple[float, float]:
    """(cap, floor) of `row` with `left` seconds of the budget left."""
    scale = 3 if args.dry_run else 1  # a shared 2-core CI box, not a GPU node
    cap = args.caps.get(row.name, row.cap * scale)
    return min(cap, left), min(row.floor * scale, cap)


def _run_batch(args, rows: list[Case], t0: float, work: Path, logs: Path, report: dict,
               record) -> None:
    """Start `rows` (one case, or a group side by side; gpukit/runner.py), each with its cap
    trimmed to the budget left; `record(name, rec)` as each ends or is skipped."""
    started: list[runner.Running] = []

    def done(run: runner.Running, rec: dict) -> None:
        if len(started) > 1:
            rec["side_by_side"] = [r.name for r in started]
        record(run.name, rec)

    try:
        for row in rows:
            _start_row(args, row, len(rows) > 1, t0, work, logs, report, record, started)
    except runner.Interrupted as exc:  # SIGTERM between two starts
        runner.interrupt(started, exc, done)
        raise
    runner.wait_all(started, done)


def _start_row(args, row: Case, grouped: bool, t0: float, work: Path, logs: Path,
               report: dict, record, started: list) -> None:
    """Start case `row` (appended to `started`), or record why it is skipped."""
    left = args.budget - (time.perf_counter() - t0)
    cap, floor = _limits(args, row, left)
    if unmet(row.name, report["preflight"]):
        record(row.name, {"status": "skipped",
                          "reason": f"skipped: {unmet(row.name, report['preflight'])}"})
    elif left < floor:
        record(row.name, {"status": "skipped", "reason": f"{left:.0f} s of the budget left, "
                          f"the case needs at least {floor} s (cap {cap:.0f} s)"})
    else:
        say(f"[{time.perf_counter() - t0:6.1f} s] {row.name}: start (cap {cap:.0f} s, "
            f"{left:.0f} s of the budget left" + (f", side by side in {row.group}" if grouped
                                                   else "") + ")")
        case_out = work / f"{row.name}.json"
        started.append(runner.start(row.name, _child_argv(args, row.name, case_out, work, report),
                                    case_env(row.name, args.dry_run), work, logs, case_out, cap,
                                    say))


def _get(report: dict, case: str, *keys):
    rec = report["cases"].get(case) or {}
    x = rec.get("result", {})
    for k in keys:
        if not isinstance(x, dict) or k not in x:
            return None
        x = x[k]
    return x


def targets(report: dict) -> dict:
    """The issue's targets, from whatever cases have finished."""
    eager, comp = _get(report, "eager", "run", "tokens_per_s"), _get(report, "compile", "run",
                                                                       "tokens_per_s")
    same = all(_get(report, "eager", "run", k) == _get(report, "compile", "run", k)
               for k in ("model", "plan"))  # an OOM fallback in one of them: no ratio
    values = {"compiled_over_eager_tokens_per_s": comp / eager if eager and comp and same
              else None,
              "fp8_over_bf16_compiled_tokens_per_s": _get(report, "fp8",
                                                          "fp8_over_bf16_tokens_per_s"),
              "mfu_bf16_compiled": _get(report, "compile", "run", "mfu")}
    out = {k: {"value": v, "target": TARGETS[k], "met": None if v is None else v >= TARGETS[k]}
           for k, v in values.items()}
    out["meshtron_over_hf_tokens_per_s"] = {"value": _get(report, "hf",
                                                          "meshtron_over_hf_tokens_per_s")}
    cli = {n: r["status"] for n, r in report["cases"].items() if n.startswith("cli_")}
    out["cli_smoke"] = {"all_ok": bool(cli) and all(s == "ok" for s in cli.values()), **cli}
    return out


def write(report: dict, out: Path) -> None:
    try:
        report["idle"] = idle.summary(report["cases"])
    except Exception as exc:  # noqa: BLE001 - a summary never costs the cases' records
        report["idle"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    report["targets"] = targets(report)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, out)


def _headline(rec: dict) -> str:
    r = rec.get("result", {})
    run = r.get("run") or {}
    if "tokens_per_s" in run:
        return f"{run['tokens_per_s']:.0f} tokens/s, MFU {run['mfu']:.1%}" + _window_note(
            run.get("profile") or {})
    if "matmul" in r:
        return f"matmul {r['matmul']['tflops']:.1f} TFLOP/s on {r.get('device')}"
    if "summary" in r and "files" in r:
        return r["summary"]
    if "verdicts" in r:
        return ", ".join(f"{k} {v}" for k, v in r["verdicts"].items())
    if "ranks" in r:
        return "; ".join(f"{k}: peak {v['peak_gib']:.2f} GiB (planner {v['planner_allocated_gib']:.2f})"
                         + (f", step {v['step_s']:.3f} s (planner {v['planner_compute_s']:.3f})"
                            if "step_s" in v else "") for k, v in r["ranks"].items())
    for key in ("fp8_over_bf16_tokens_per_s", "meshtron_over_hf_tokens_per_s",
                "offloaded_over_device_step_time", "async_blocking_over_sync"):
        if r.get(key) is not None:
            return f"{key} {r[key]:.3f}"
    cmds = [f"{k}: exit {v['exit_code']} in {v['seconds']:.1f} s" for k, v in r.items()
            if isinstance(v, dict) and "argv" in v]
    if cmds and rec["status"] == "ok":
        return "; ".join(cmds)
    return rec.get("reason", "") or (rec.get("output_tail") or [""])[-1][:160]


def _window_note(prof: dict) -> str:
    """The profiler window in a few words: the SM clock, the idle between kernels and the
    GEMMs' rate (the JSON has the rest)."""
    parts = []
    sm = (prof.get("clocks") or {}).get("sm_clock_mhz")
    if sm:
        parts.append(f"SM clock {sm['min']:.0f}/{sm['median']:.0f}/{sm['max']:.0f} MHz")
    gaps = prof.get("gaps") or {}
    if "idle_in_gaps_us" in gaps:
        parts.append(f"{gaps['idle_in_gaps_us'] / 1e3:.1f} ms idle in {gaps['gaps']} gaps")
    tflops = ((prof.get("gemm_shapes") or {}).get("total") or {}).get("tflops")
    if tflops:
        parts.append(f"GEMMs {tflops:.1f} TFLOP/s")
    return f"; {', '.join(parts)}" if parts else ""


def drive(args) -> dict:
    out = Path(args.out or os.path.join(os.environ.get("OUT", ""), "gpu_check.json"))
    if not args.out and not os.environ.get("OUT"):
        raise SystemExit("gpu_check: --out FILE (or $OUT) is needed")
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_name(out.stem + "_logs")
    logs.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="meshtron-gpu-check-"))
    chosen = chosen_cases(args.only)
    # "idle" first: per throughput case, the idle per micro-batch and what explains it
    report = {"format": FORMAT, "idle": {}, "dry_run": args.dry_run, "budget_s": args.budget,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "order": [c[0] for c in chosen], "cases": {}}
    pre = report["preflight"] = preflight()
    report["expected_wall_s"] = runner.expected_wall(chosen)  # on the H200 (CASES' expected)
    say(f"{len(chosen)} cases, expected about {report['expected_wall_s']:.0f} s on an H200 "
        f"(budget {args.budget:.0f} s)")
    for mod in pre["missing"]:
        say(f"preflight: {mod} not installed" + ("" if WHEELS[mod] is None else
                                                 f" (its wheel: {WHEELS[mod]})"))
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, _on_term)

    def record(name: str, rec: dict) -> None:
        report["cases"][name] = rec
        report["wall_s"] = round(time.perf_counter() - t0, 2)
        report["cpu_s"] = round(sum(r.get("cpu_s", 0) for r in report["cases"].values()), 2)
        write(report, out)
        say(f"[{time.perf_counter() - t0:6.1f} s] {name}: {rec['status']} "
            f"{rec.get('seconds', 0):.1f} s  {_headline(rec)}")
        if "error" not in report["idle"]:
            for key, line in idle.lines(report["idle"], name):
                say(f"    idle {key}: {line}")

    try:
        for rows in runner.batches(chosen):
            _run_batch(args, rows, t0, work, logs, report, record)
    except runner.Interrupted as exc:
        for name, *_ in chosen:  # what never started: named, so the rerun line lists it
            report["cases"].setdefault(name, {"status": "skipped",
                                              "reason": "not started: the kit was stopped"})
        say(f"stopped: {exc}")
        write(report, out)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    say(f"wrote {out}: " + ", ".join(f"{n} {r['status']}" for n, r in report["cases"].items()))
    rest = [n for n, r in report["cases"].items() if r["status"] != "ok"]
    if "cli_export" in rest and "cli_kill_resume" not in rest:  # exports that run's folder
        rest.insert(rest.index("cli_export"), "cli_kill_resume")
    if rest:
        say(f"to run what did not pass, in another call: --only {','.join(rest)}")
    say("targets: " + json.dumps(report["targets"], default=str))
    return report


def only(names: str) -> list[str]:
    """`--only`'s case names, a suite's name (SUITES) standing for its cases."""
    return [c for n in names.split(",") for c in SUITES.get(n, (n,))]


def chosen_cases(names: str | None) -> list[Case]:
    """The CASES rows to run: all but OPTIONAL, or `--only`'s in CASES order (a case may need
    an earlier one's files); a suite alone runs in its own order (most telling first)."""
    if names in SUITES:
        rows = {c[0]: c for c in CASES}
        return [rows[n] for n in SUITES[names]]
    if not names:
        return [c for c in CASES if c.name not in OPTIONAL]
    return [c for c in CASES if c[0] in only(names)]


EXPECTED_WALL_S = runner.expected_wall(chosen_cases(None))
"""The default order's expected seconds on the H200 (under EXPECTED_BUDGET_S, tested)."""


def run_case(args) -> int:
    """Inside a case's process: run it, its result in --case-out."""
    spec = dict((n, f) for n, f, *_ in CASES)[args.run_case]
    module, fn = spec.split(":")
    ctx = Ctx(dry_run=args.dry_run, seq_len=args.seq_len or (32 if args.dry_run else 4096),
              global_batch=args.global_batch or (2 if args.dry_run else 8),
              steps=args.steps or (2 if args.dry_run else 3), work=Path(args.work),
              out=Path(args.case_out), ckpt_gib=args.ckpt_gib, fits_layers=args.fits_layers,
              cli_steps=args.cli_steps)
    mod = importlib.import_module(f"gpukit.{module}")
    if hasattr(mod, "on_sigterm"):
        signal.signal(signal.SIGTERM, mod.on_sigterm)
    getattr(mod, fn)(ctx)
    ctx.emit(done=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON file to write (default $OUT/gpu_check.json)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy size: every case")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all cases")
    ap.add_argument("--only", help="comma-separated case names or suites (idle: the eager "
                    "step's idle explained) (default: all, in order)")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--steps", type=int, help="timed steps per engine (default 3: the 4 of the "
                    "first H200 run were within 2.2%% of each other; one fewer saves a step "
                    "per engine)")
    ap.add_argument("--cli-steps", type=int,
                    help="training steps of the CLI smoke's train commands (default: a few)")
    ap.add_argument("--ckpt-gib", type=float, default=2.0,
                    help="model + optimizer state of the checkpoint case, GiB")
    ap.add_argument("--caps", help="override caps, e.g. fp8=300,hf=120 (seconds)")
    ap.add_argument("--keep-work", action="store_true", help="keep the cases' work folder")
    ap.add_argument("--run-case", help=argparse.SUPPRESS)
    ap.add_argument("--case-out", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--fits-layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        unknown = set(only(args.only)) - {c[0] for c in CASES}
        if unknown:
            ap.error(f"--only={args.only}: unknown {sorted(unknown)}; allowed "
                     f"{', '.join([c[0] for c in CASES] + list(SUITES))}")
    try:
        args.caps = {k: float(v) for k, v in (x.split("=") for x in (args.caps or "").split(",")
                                               if x)}
    except ValueError:
        ap.error(f"--caps={args.caps}: expected NAME=SECONDS[,NAME=SECONDS...]")
    if set(args.caps) - {c[0] for c in CASES}:
        ap.error(f"--caps: unknown case in {sorted(args.caps)}")
    # a cap of 0 s or less was its case's floor too (_limits): it started with what was
    # left of the budget below its floor, or with none left (a negative cap), to be stopped
    # at once
    bad = {k: v for k, v in args.caps.items() if not 0 < v < float("inf")}
    if bad:
        ap.error(f"--caps: {bad}: each cap must be a positive number of seconds")
    if not 0 < args.budget < float("inf"):
        ap.error(f"--budget={args.budget}: must be a positive number of seconds")
    if args.run_case:
        return run_case(args)
    drive(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
