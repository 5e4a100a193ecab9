"""The CLI smoke: the `meshtron` command as a user runs it (`python -m meshtron`, so the
checkout runs without `pip install`), each sub-command's exit code, seconds and last stderr
lines. On the GPU the commands are the ones that broke there (shared notes) with the product's
defaults; the dry run adds a toy batch (`--seq-len 32 --global-batch 2 --eval-every 0`) and
fewer steps. Nothing here imports torch: a case is a command and what it left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpukit.common import Ctx, child_env, stop_group

TAIL = 15


def _tail(path: Path, n: int = TAIL) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _stop(proc: subprocess.Popen, run_dir: Path | None, grace_s: float = 15.0) -> None:
    """SIGTERM the command's process group (meshtron then stops its torchrun ranks), SIGKILL
    after `grace_s`; then any rank still training into `run_dir` (torchrun's ranks run in a
    session of their own)."""
    stop_group(proc, grace_s, 5.0)
    if run_dir is not None:
        from testkit.procs import rank_pids

        for pid in rank_pids(run_dir).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_RUNNING: list[tuple[subprocess.Popen, Path]] = []
"""The commands started by this case process, with their work folders (for on_sigterm)."""


_WAITING: list = [None]
"""The command `run` is waiting for (it stops and records that one itself)."""


class Stopped(Exception):
    """The driver's time cap (SIGTERM) arrived while a command ran."""


def on_sigterm(signum, frame) -> None:
    """The driver's time cap: `run` records the command it waits for and stops it; anything
    else this case started is stopped on the way out (with its torchrun ranks)."""
    for proc, folder in _RUNNING:
        if proc is not _WAITING[0] and proc.poll() is None:
            _stop(proc, folder, grace_s=5.0)
    raise Stopped(f"signal {signum}: the case's time cap")


def start(ctx: Ctx, name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    log = ctx.work / f"cli-{name}"
    out, err = open(f"{log}.out", "w"), open(f"{log}.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", *argv], cwd=ctx.work,
                            stdout=out, stderr=err, env=child_env(), start_new_session=True)
    out.close()
    err.close()
    run_dir = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else ctx.work
    _RUNNING.append((proc, Path(run_dir)))
    return proc, log


def run(ctx: Ctx, name: str, argv: list[str], cap_s: float, run_dir: Path | None = None,
        proc: subprocess.Popen | None = None) -> dict:
    """Run `meshtron argv` (or wait for `proc`) at most `cap_s` seconds; emit its record."""
    t0 = time.perf_counter()
    if proc is None:
        proc, log = start(ctx, name, argv)
    else:
        log = ctx.work / f"cli-{name}"
    rec = {"argv": ["meshtron", *argv], "cap_s": cap_s}
    stopped = None
    _WAITING[0] = proc
    try:
        rec["exit_code"] = proc.wait(timeout=cap_s)
    except (subprocess.TimeoutExpired, Stopped) as exc:
        _stop(proc, run_dir, grace_s=5.0 if isinstance(exc, Stopped) else 15.0)
        rec.update(exit_code=None, timed_out=True)
        stopped = exc if isinstance(exc, Stopped) else None
    finally:
        _WAITING[0] = None
    rec["seconds"] = time.perf_counter() - t0
    rec["stderr_tail"] = _tail(Path(f"{log}.err"))
    rec["stdout_tail"] = _tail(Path(f"{log}.out"), 5)
    ctx.emit(**{name: rec})
    if stopped is not None:
        raise stopped
    if rec["exit_code"] != 0:
        raise RuntimeError(f"meshtron {argv[0]} exited {rec['exit_code']}: "
                           + " | ".join(rec["stderr_tail"][-3:]))
    return rec


def _toy(ctx: Ctx, steps: int, gpu_steps: int) -> list[str]:
    if ctx.cli_steps:
        steps = gpu_steps = ctx.cli_steps
    if ctx.dry_run:
        return ["--steps", str(steps), "--seq-len", "32", "--global-batch", "2",
                "--eval-every", "0"]
    return ["--steps", str(gpu_steps)]


def calibration(ctx: Ctx) -> Path:
    """Where `meshtron calibrate` writes a 1-rank calibration run from the kit's work folder
    (every command runs there), which is where `meshtron train --plan auto` looks for it."""
    return ctx.work / "runs" / "calibration" / "local-1.toml"


def case_cli_calibrate(ctx: Ctx) -> None:
    run(ctx, "calibrate", ["calibrate"], 240)
    record = json.loads(calibration(ctx).with_suffix(".json").read_text())
    # the cluster file itself (the work folder is deleted at the end) and the sustained GEMM
    # table by transformer shape: what the planner's GEMM rate is compared against
    ctx.emit(file=str(calibration(ctx)), toml=calibration(ctx).read_text(),
             gemm=record.get("gemm"), **{k: record.get(k) for k in (
                 "device_name", "gpu", "matmul_tflops", "memory_gb_per_s",
                 "elementwise_gb_per_s", "kernel_overhead_us")})


def case_cli_plan(ctx: Ctx) -> None:
    cal = calibration(ctx)
    cluster = str(cal) if cal.is_file() else "dgx-h200:1"  # cli_calibrate's, else a preset
    model, batch = ("tiny", ["--global-batch", "2", "--seq-len", "32"]) if ctx.dry_run else (
        "llama3-8b", ["--global-batch", "8", "--seq-len", "4096"])
    ctx.emit(cluster=cluster)
    run(ctx, "plan", ["plan", "--model", model, "--cluster", cluster, *batch], 60)


def _train(ctx: Ctx, name: str, model: str, steps: tuple[int, int], *flags: str,
           cap_s: float = 180) -> dict:
    """`meshtron train --model MODEL [flags]` for (dry run, GPU) steps, in run-NAME/."""
    d = ctx.work / f"run-{name}"
    return run(ctx, name, ["train", "--model", model, *_toy(ctx, *steps), *flags,
                           "--run-dir", str(d)], cap_s, d)


def case_cli_train(ctx: Ctx) -> None:
    _train(ctx, "train", "debug", (3, 20))


def case_cli_train_auto(ctx: Ctx) -> None:
    """torchrun, one rank, the planner's plan, periodic checkpoints; the plan line says which
    cluster figures it planned with: this node's calibration when cli_calibrate wrote one."""
    d = ctx.work / "run-auto"
    rec = run(ctx, "train_auto", ["train", "--model", "debug", *_toy(ctx, 4, 30),
                                  "--checkpoint-every", "2" if ctx.dry_run else "10", "--plan",
                                  "auto", "--run-dir", str(d)], 240, d)
    text = (ctx.work / "cli-train_auto.out").read_text(errors="replace")
    line = " ".join(x for x in text.splitlines() if x.startswith("plan ") or "cluster:" in x)
    source = line.split("cluster: ", 1)[1].strip() if "cluster: " in line else None
    ctx.emit(plan_line=line, cluster_source=source, checkpoints=_committed(d))
    if calibration(ctx).is_file() and not (source or "").startswith("calibrated on"):
        raise RuntimeError(f"--plan auto did not plan with this node's calibration "
                           f"{calibration(ctx)}: {source!r}")
    if not _committed(d):
        raise RuntimeError(f"--checkpoint-every: no committed checkpoint in {d} "
                           f"(exit {rec['exit_code']})")


def case_cli_moe(ctx: Ctx) -> None:
    _train(ctx, "moe", "tiny-moe-ds", (3, 10))


def case_cli_compile(ctx: Ctx) -> None:
    _train(ctx, "compile", "debug", (3, 20), "--compile", cap_s=300)


def case_cli_fp8(ctx: Ctx) -> None:
    if ctx.dry_run:
        ctx.emit(note="cpu dry-run: torchao's emulated float8")
    _train(ctx, "fp8", "debug", (3, 10), "--dtype", "fp8")


def _committed(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []


def case_cli_kill_resume(ctx: Ctx) -> None:
    """SIGKILL a one-process run right after its first committed checkpoint (a real signal to
    its whole process group), then `--resume` it to the end."""
    d = ctx.work / "run-kill"
    # 100 steps on the GPU (the first run's 300 left 280 for the resume, ~30 s of the budget):
    # the first checkpoint commits at step 20, ~8 s before the run could end (0.13 s a step
    # there)
    argv = ["train", "--model", "debug", *_toy(ctx, 8, 100), "--checkpoint-every",
            "2" if ctx.dry_run else "20", "--run-dir", str(d)]
    proc, _ = start(ctx, "killed", argv)
    deadline = time.monotonic() + 180
    while not _committed(d) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = proc.poll() is None
    if killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ctx.emit(killed_after=_committed(d), killed=killed, first_exit_code=proc.returncode)
    if not killed:
        raise RuntimeError(f"the run ended (exit {proc.returncode}) before it could be killed "
                           "after a committed checkpoint")
    rec = run(ctx, "resume", [*argv, "--resume"], 240, d)
    resumed = [line for line in rec["stderr_tail"] if "resumed from" in line]
    out = (ctx.work / "cli-resume.err").read_text(errors="replace")
    ctx.emit(resumed_line=next((x for x in out.splitlines() if "resumed from" in x), None))
    if "resumed from" not in out and not resumed:
        raise RuntimeError("--resume exited 0 without saying it resumed from a checkpoint")


def case_cli_export(ctx: Ctx) -> None:
    """Export the checkpoint of the killed-and-resumed run (or of the --plan auto run)."""
    for d in (ctx.work / "run-kill", ctx.work / "run-auto"):
        if _committed(d):
            break
    else:
        raise RuntimeError("no run with a committed checkpoint to export (cli_kill_resume and "
                           "cli_train_auto failed or did not run)")
    out = ctx.work / "hf-export"
    ctx.emit(run_dir=str(d))
    run(ctx, "export", ["export", str(d), "--to", str(out)], 120)
    ctx.emit(files=sorted(p.name for p in out.iterdir()))
