"""`meshtron doctor` on a healthy run's on-demand dumps (SIGUSR1) under CPU load: the command
sequence of tests/test_doctor_restarts.py::test_no_dump_is_said_not_judged, repeated.

Each repetition starts `meshtron train --nproc 2 --plan dp=2 --model debug` beside `--load`
busy loops (`python -c 'while True: pass'`, killed after each run), with rank 1 SIGSTOPped as
its process starts (tests/faults: MESHTRON_TEST_STOP_RANK); SIGUSR1 dumps rank 0 while it waits
for rank 1 to join (that dump is moved aside, as the test does), SIGCONT lets rank 1 join, and
once metrics.jsonl exists (or `--after-steps` steps are logged) both ranks are sent SIGUSR1
together; `meshtron doctor --json` then judges the two dumps. A healthy run's verdict is
`none`; anything else is kept (the run folder and doctor's JSON) under OUT/rep_N.

    .venv/bin/python bench/straggler_on_demand.py --reps 20 --load 3 --out /tmp/on_demand
    .venv/bin/python bench/straggler_on_demand.py --table /tmp/on_demand   # runs kept there
    git archive 8b6ed315 meshtron | tar -x -C /tmp/old    # the rule before session 50
    .venv/bin/python bench/straggler_on_demand.py --table /tmp/on_demand --before /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from meshtron.doctor.dump import process_state  # noqa: E402
from testkit.procs import rank_pids  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAULTS = str(ROOT / "tests" / "faults")
TRAIN = [sys.executable, "-m", "meshtron", "train", "--nproc", "2", "--plan", "dp=2",
         "--model", "debug", "--seq-len", "32", "--global-batch", "8", "--eval-every", "0",
         "--steps", "100000"]


def _wait(predicate, proc: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"run ended or timed out (rc {proc.poll()}) before "
                               f"{predicate}")
        time.sleep(0.1)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return -1
    return sum(1 for x in path.read_text().splitlines() if '"step"' in x)


def _pids(trace: Path) -> list[int]:
    return [json.loads((trace / f"rank_{r}.hello.json").read_text())["pid"] for r in (0, 1)]


def run_one(run_dir: Path, after_steps: int) -> dict:
    """One repetition: doctor's JSON on the on-demand dumps of a healthy run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MESHTRON_TEST_STOP_RANK="1",
               PYTHONPATH=os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", str(ROOT))]))
    run_dir.mkdir(parents=True)
    log = open(run_dir / "out.log", "w")
    proc = subprocess.Popen([*TRAIN, "--run-dir", str(run_dir)], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    trace = run_dir / "trace"
    try:
        _wait((trace / "rank_0.hello.json").is_file, proc)
        time.sleep(0.2)  # the test runs doctor here (a second, on a loaded host)
        os.kill(_pids_first(trace), signal.SIGUSR1)
        _wait((trace / "rank_0.json").is_file, proc)
        (trace / "rank_0.json").rename(run_dir / "joining.json")
        # rank 1 stops itself as its interpreter starts: a SIGCONT before that is lost (on a
        # loaded host the pilot sent one first once; that rank stayed stopped)
        _wait(lambda: process_state(rank_pids(run_dir).get(1, -1)) == "stopped", proc)
        os.kill(rank_pids(run_dir)[1], signal.SIGCONT)
        _wait(lambda: _steps_logged(run_dir) >= after_steps, proc)
        for pid in _pids(trace):
            os.kill(pid, signal.SIGUSR1)
        _wait(lambda: all((trace / f"rank_{r}.json").is_file() for r in (0, 1)), proc)
        time.sleep(0.5)  # the atomic writes are complete once the files exist
    finally:
        proc.kill()  # its ranks end with it (their parent-death signal)
        proc.wait()
        log.close()
    out = subprocess.run([sys.executable, "-m", "meshtron", "doctor", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


def _pids_first(trace: Path) -> int:
    return json.loads((trace / "rank_0.hello.json").read_text())["pid"]


_JUDGE = """
import sys
tree = sys.argv[1]
if tree:  # that meshtron source, not the editable install of this checkout
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
    sys.path.insert(0, tree)
from meshtron.cli import main
sys.exit(main(["doctor", sys.argv[2], "--json"]))
"""


def judge(run_dir: Path, tree: Path | None = None) -> dict:
    """`meshtron doctor --json` on a kept run, by this checkout or by the meshtron source in
    `tree` (e.g. `git archive COMMIT meshtron | tar -x -C TREE`: the rule before a change)."""
    out = subprocess.run([sys.executable, "-c", _JUDGE, str(tree or ""), str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


def _verdict(doc: dict) -> str:
    return f"{doc['kind']} {doc['culprit_ranks']}".replace("[]", "").strip()


def table(out: Path, before: Path | None) -> None:
    rows = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    print("rep  load  loadavg      dump steps (r0 r1)  verdict now"
          + ("      before" if before else ""))
    named = {"now": 0, "before": 0}
    rows = [r for r in rows if (out / f"rep_{r['rep']}" / "trace").is_dir()]  # kept runs
    for row in rows:
        run_dir = out / f"rep_{row['rep']}"
        docs = {"now": judge(run_dir)}
        if before:
            docs["before"] = judge(run_dir, before)
        for when, doc in docs.items():
            named[when] += doc["kind"] != "none"
        print(f"{row['rep']:3d}  {row['load']:4d}  {row['loadavg_before']:5.1f}/"
              f"{row['loadavg_after']:5.1f}  {row['steps'][0]:5d} {row['steps'][1]:5d}"
              f"         {_verdict(docs['now']):16s}"
              + (f" {_verdict(docs['before'])}" if before else ""))
    for when in docs:
        print(f"{when}: {named[when]} of {len(rows)} healthy runs judged other than `none`")


def _dump_steps(run_dir: Path) -> list[int]:
    paths = [run_dir / "trace" / f"rank_{r}.json" for r in (0, 1)]
    return [json.loads(p.read_text()).get("step", -1) if p.is_file() else -1 for p in paths]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/straggler_on_demand"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--load", type=int, default=3, help="busy loops beside each run")
    p.add_argument("--after-steps", type=int, default=0,
                   help="steps logged before the SIGUSR1s (0: as soon as metrics.jsonl exists)")
    p.add_argument("--table", type=Path, help="only print the table of runs kept there")
    p.add_argument("--before", type=Path,
                   help="also judge with the meshtron source tree there (the rule before)")
    args = p.parse_args()
    if args.table:
        table(args.table, args.before)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    start = sum(1 for _ in open(args.out / "runs.jsonl")) if (args.out / "runs.jsonl").is_file() \
        else 0
    for rep in range(start, start + args.reps):
        run_dir = args.out / f"rep_{rep}"
        before = os.getloadavg()[0]
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(args.load)]
        try:
            doc = run_one(run_dir, args.after_steps)
        except RuntimeError as exc:
            doc = {"kind": f"error: {exc}", "culprit_ranks": []}
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        row = {"rep": rep, "load": args.load, "loadavg_before": before,
               "loadavg_after": os.getloadavg()[0], "kind": doc["kind"],
               "culprits": doc["culprit_ranks"],
               "steps": _dump_steps(run_dir)}
        with open(args.out / "runs.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        for extra in run_dir.iterdir():  # the dumps stay, for --table to judge again
            if extra.name not in ("trace", "joining.json", "out.log"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
        (run_dir / "doctor.json").write_text(json.dumps(doc, indent=1))
    table(args.out, args.before)


if __name__ == "__main__":
    main()
