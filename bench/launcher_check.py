"""The launcher on the torch a machine carries, as a user runs it: `python bench/launcher_check.py
--out DIR`. Each case is a real `meshtron train` (torchrun, the default device) with real
signals; DIR/launcher_check.json is rewritten after every case, so one failure loses nothing.

Cases: the torchrun argv this torch's torchrun parses (flags it lacks left out); `--plan auto`
with checkpoints (one rank under torchrun); a rank SIGKILLed under `--max-restarts 1` (the
restarted group is made by the same init path: NCCL + device_id on a GPU); the launcher
SIGKILLed (time until the last rank is gone); Ctrl-C (SIGINT) to the launcher (one line, 130).
On a GPU with torch 2.11 this is what issue 31 saw fail ("the 1 ranks failed").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit.procs import run_processes as run_procs  # noqa: E402

TRAIN = [sys.executable, "-m", "meshtron", "train", "--model", "debug", "--seq-len", "32",
         "--global-batch", "8", "--eval-every", "0", "--plan", "auto"]


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "step" in rec and "loss" in rec:
            out.append(rec["step"])
    return out


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, "--run-dir", str(run_dir), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, limit_s: float) -> float:
    t0 = time.monotonic()
    while max(steps(run_dir), default=0) < step:
        if proc.poll() is not None:
            raise RuntimeError(f"ended early, exit {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError(f"no step {step} within {limit_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def case_argv(work: Path) -> dict:
    import torch
    from torch.distributed.run import get_args_parser

    from meshtron.launch import supported_argv, torchrun_args

    # what the agent parses: the launcher's argv less the flags this torchrun lacks
    argv = supported_argv(torchrun_args(1, 1, 30.0), get_args_parser()) + ["-m", "meshtron"]
    args = get_args_parser().parse_args(argv)
    return {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "argv": argv,
            "parsed": {"nproc_per_node": args.nproc_per_node, "max_restarts": args.max_restarts,
                       "shutdown_timeout": getattr(args, "shutdown_timeout", "absent")}}


def case_plan_auto(work: Path) -> dict:
    run_dir = work / "auto"
    t0 = time.monotonic()
    proc = subprocess.run([*TRAIN, "--steps", "30", "--checkpoint-every", "10", "--run-dir",
                           str(run_dir)], capture_output=True, text=True, timeout=240)
    return {"exit": proc.returncode, "wall_s": round(time.monotonic() - t0, 2),
            "steps": len(steps(run_dir)), "stderr_tail": proc.stderr[-1500:]}


def case_restart(work: Path) -> dict:
    run_dir = work / "restart"
    proc = start(run_dir, "--steps", "300", "--checkpoint-every", "50", "--max-restarts", "1")
    try:
        wait_for_step(proc, run_dir, 120, 240)
        victim = [p for p, who in run_procs(run_dir).items() if who == "rank 0"][0]
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restart = [r for r in records if r.get("event") == "restart"]
    return {"exit": proc.returncode, "restart": restart[:1], "last_step": max(steps(run_dir)),
            "stderr_tail": err[-1500:]}


def case_sigkill(work: Path) -> dict:
    run_dir = work / "sigkill"
    proc = start(run_dir, "--steps", "1000000")
    try:
        wait_for_step(proc, run_dir, 5, 240)
        before = run_procs(run_dir)
        killed = time.monotonic()
        proc.kill()
        proc.wait()
        while run_procs(run_dir) and time.monotonic() - killed < 30:
            time.sleep(0.005)
        gone_s = time.monotonic() - killed
        left = run_procs(run_dir)
        n = len(steps(run_dir))
        time.sleep(2)
        return {"processes": sorted(before.values()), "gone_after_s": round(gone_s, 3),
                "left": sorted(left.values()), "steps_written_2s_later": len(steps(run_dir)) - n}
    finally:
        for pid in run_procs(run_dir):
            os.kill(pid, signal.SIGKILL)


def case_sigint(work: Path) -> dict:
    run_dir = work / "sigint"
    proc = start(run_dir, "--steps", "1000000")
    try:
        wait_for_step(proc, run_dir, 5, 240)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        return {"exit": proc.returncode, "after_s": round(time.monotonic() - t0, 2),
                "stderr_after_training": [x for x in err.splitlines()
                                          if "warning" not in x][-5:],
                "left": sorted(run_procs(run_dir).values())}
    finally:
        for pid in run_procs(run_dir):
            os.kill(pid, signal.SIGKILL)


CASES = {"argv": case_argv, "plan_auto": case_plan_auto, "restart": case_restart,
         "sigkill": case_sigkill, "sigint": case_sigint}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    out = Path(args.out)
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.cases.split(","):
        t0 = time.monotonic()
        try:
            results[name] = {"ok": True, **CASES[name](work)}
        except Exception as exc:  # noqa: BLE001 - recorded, the next case still runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["case_s"] = round(time.monotonic() - t0, 1)
        print(name, json.dumps(results[name])[:600], flush=True)
        (out / "launcher_check.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
