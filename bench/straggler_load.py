"""`meshtron doctor`'s straggler statistic on real 2-rank runs under real CPU load.

Runs `meshtron train --nproc 2 --plan dp=2 --model debug` healthy, and with rank 1 SIGSTOPped
`--stop` s of every `--period` s (SIGSTOP/SIGCONT from a thread here), beside 0, 2 or 4
`python -c 'while True: pass'` processes (killed after each run), and prints per run: the
host's 1-minute load average before and after, each rank's lateness counted by the rule
(diagnose/straggler.py) as a % of the span compared, the named rank's ratio to the other,
the verdict, and the shares the rule counted before it took gloo's transport threads apart
(the same dumps without `transport_cpu_s`). The margin lines: the weakest faulty share over
the worst healthy share, now and before.

    .venv/bin/python bench/straggler_load.py --reps 3 --loads 0,2,4 --out /tmp/straggler
    .venv/bin/python bench/straggler_load.py --table /tmp/straggler    # runs kept there
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TRAIN = [sys.executable, "-m", "meshtron", "train", "--nproc", "2", "--plan", "dp=2",
         "--model", "debug", "--eval-every", "0"]


def _stop_cycles(pid: int, stop_s: float, period_s: float, done: threading.Event) -> None:
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(period_s - stop_s)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _rank_pid(run_dir: Path, proc: subprocess.Popen) -> int:
    hello = run_dir / "trace" / "rank_1.hello.json"
    while not hello.is_file():
        if proc.poll() is not None:
            raise SystemExit(f"the run in {run_dir} ended before rank 1 started")
        time.sleep(0.02)
    time.sleep(0.05)
    return json.loads(hello.read_text())["pid"]


def run_one(out: Path, kind: str, load: int, rep: int, args) -> dict:
    run_dir = out / f"{kind}_L{load}_{rep}"
    before = os.getloadavg()[0]
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    done = threading.Event()
    try:
        proc = subprocess.Popen([*TRAIN, "--steps", str(args.steps), "--run-dir", str(run_dir)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        if kind == "faulty":
            threading.Thread(target=_stop_cycles, daemon=True,
                             args=(_rank_pid(run_dir, proc), args.stop, args.period,
                                   done)).start()
        proc.wait(timeout=900)
    finally:
        done.set()
        for p in loops:
            p.kill()
            p.wait()
    row = {"run": run_dir.name, "kind": kind, "load": load, "rc": proc.returncode,
           "loadavg_before": before, "loadavg_after": os.getloadavg()[0]}
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _shares(trace) -> dict[int, float]:
    """rank -> its lateness counted by the rule, as a share of the span compared."""
    from meshtron.diagnose import straggler

    lates, _, _, span = straggler._lateness(trace)
    steps = straggler._steps(trace)
    own = bool(steps) and all(s.blocked is not None for w in steps.values() for s in w.values())
    counted = straggler._counted(lates, steps, own)
    return {r: counted[r] / span for r in sorted(counted)}


def statistic(run_dir: Path, kind: str) -> dict:
    from meshtron.diagnose.analyze import diagnose
    from meshtron.diagnose.trace import load_trace

    trace = load_trace(run_dir)
    share = _shares(trace)
    rank = 1 if kind == "faulty" else max(share, key=share.get)
    other = max(v for r, v in share.items() if r != rank)
    d = diagnose(trace)
    for dump in trace.dumps.values():  # the rule before the transport threads' reading
        for beat in dump.get("step_times", []):
            beat.pop("transport_cpu_s", None)
    return {"share": share, "rank": rank, "ratio": share[rank] / other if other else float("inf"),
            "before": _shares(trace), "verdict": f"{d.kind} {d.culprit_ranks}"}


def table(out: Path) -> None:
    worst = {"healthy": [0.0, 0.0], "faulty": [float("inf"), float("inf")]}  # now, before
    print("run              loadavg     counted % of span (r0 r1)  named  ratio  verdict"
          "          before (r0 r1)")
    for line in open(out / "runs.jsonl"):
        row = json.loads(line)
        s = statistic(out / row["run"], row["kind"])
        pick = min if row["kind"] == "faulty" else max
        for i, share in enumerate((s["share"], s["before"])):
            mine = share[s["rank"]] if row["kind"] == "faulty" else max(share.values())
            worst[row["kind"]][i] = pick(worst[row["kind"]][i], mine)
        print(f"{row['run']:16s} {row['loadavg_before']:5.1f}/{row['loadavg_after']:5.1f}  "
              + " ".join(f"{100 * v:5.1f}" for v in s["share"].values())
              + f"{'':16s} r{s['rank']}  {s['ratio']:6.1f}  {s['verdict']:16s} "
              + " ".join(f"{100 * v:5.1f}" for v in s["before"].values()))
    for i, when in enumerate(("", " (before the transport threads' reading)")):
        healthy, faulty = worst["healthy"][i], worst["faulty"][i]
        print(f"worst healthy {100 * healthy:.1f}%, weakest faulty {100 * faulty:.1f}%: "
              f"margin {faulty / max(healthy, 1e-9):.1f}x{when}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/straggler_load"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--loads", default="0,2,4", help="busy loops beside each run, e.g. 0,2,4")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop", type=float, default=0.1, help="seconds rank 1 is stopped")
    p.add_argument("--period", type=float, default=0.5, help="seconds per stop cycle")
    p.add_argument("--table", type=Path, help="only print the table of runs kept there")
    args = p.parse_args()
    if args.table:
        table(args.table)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        for load in (int(x) for x in args.loads.split(",")):
            for kind in ("healthy", "faulty"):
                run_one(args.out, kind, load, rep, args)
    table(args.out)


if __name__ == "__main__":
    main()
