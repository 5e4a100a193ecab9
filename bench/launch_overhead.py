"""What `meshtron train --nproc 2` costs before and around its ranks, side by side for two
checkouts: `python bench/launch_overhead.py --against DIR [--runs 3]`, DIR holding another
`meshtron/` package (e.g. `git archive main meshtron | tar -x -C DIR`).

Each run is the 2-rank debug launch a user types (`train --model debug --steps 2 --nproc 2`,
defaults otherwise), alternating between the two trees so that a shared machine's load falls on
both. Per tree, the median over the runs of: the launcher's own CPU seconds (user+sys of the
parent process alone, read at its exit), the modules it had imported and whether torch was one,
the CPU seconds of the whole launch (the parent, torchrun's agent and the ranks: this process's
children's rusage) and the wall time. The ratios are this tree's over DIR's.

`--tests FILE...` (DIR then a whole checkout: `git archive main | tar -x -C DIR`) also runs
each of those test files in both trees (`pytest -q -p no:cacheprovider --durations=20`, from
the tree's root, so its conftest puts its own meshtron first), file by file, the tree that goes
first alternating, so that a load that drifts falls on both; per tree: the sum of the 15
slowest test durations over the files (setup and call phases, as pytest lists them), the CPU
seconds (user+sys of pytest and everything it started) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LAUNCH = ["train", "--model", "debug", "--steps", "2", "--nproc", "2"]

# The launcher's own figures, printed by the parent at exit (os.times: this process alone).
PROBE = """import atexit, os, runpy, sys
def said():
    t = os.times()
    print("LAUNCHER", t.user + t.system, len(sys.modules), int("torch" in sys.modules),
          file=sys.stderr, flush=True)
atexit.register(said)
sys.argv = ["meshtron", *sys.argv[1:]]
runpy.run_module("meshtron", run_name="__main__", alter_sys=True)
"""


def one_launch(tree: Path, work: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PROBE, *LAUNCH, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, cwd=work, env=env, timeout=600)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stderr.splitlines() if x.startswith("LAUNCHER "))
    parent_cpu, modules, torch = line.split()[1:]
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"launcher_cpu_s": float(parent_cpu), "launcher_modules": int(modules),
            "launcher_torch": bool(int(torch)), "total_cpu_s": total, "wall_s": wall}


SLOWEST = 15
"""How many of the slowest test durations are summed."""


def test_file(tree: Path, files: list[str]) -> dict:
    """pytest on `files` from `tree`'s root: its durations, CPU and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--durations=20", *files], capture_output=True, text=True, cwd=tree,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=3600)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    durations = sorted((float(m.group(1)) for m in re.finditer(
        r"^([0-9.]+)s (?:setup|call|teardown) ", proc.stdout, re.M)), reverse=True)
    return {"durations": durations, "exit_code": proc.returncode,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "wall_s": wall,
            "result": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""}


def test_files(trees: dict[str, Path], files: list[str]) -> dict:
    """Each file in every tree, the first tree alternating; per tree the sum of the SLOWEST
    slowest durations over all files, the CPU and wall seconds, each file's result line."""
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i, name_file in enumerate(files):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(test_file(trees[name], [name_file]))
    out = {}
    for name, done in runs.items():
        durations = sorted((d for r in done for d in r["durations"]), reverse=True)
        out[name] = {"slowest_sum_s": round(sum(durations[:SLOWEST]), 2),
                     "cpu_s": round(sum(r["cpu_s"] for r in done), 2),
                     "wall_s": round(sum(r["wall_s"] for r in done), 2),
                     "results": [r["result"] for r in done],
                     "exit_codes": [r["exit_code"] for r in done]}
    return out


def median(runs: list[dict]) -> dict:
    return {k: (statistics.median(r[k] for r in runs) if not isinstance(runs[0][k], bool)
                else runs[0][k]) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, type=Path, help="a folder holding meshtron/")
    ap.add_argument("--runs", type=int, default=3, help="launches per tree (0: none)")
    ap.add_argument("--tests", nargs="*", default=[], metavar="FILE",
                    help="test files to run in both trees (DIR a whole checkout)")
    args = ap.parse_args()
    trees = {"this": HERE, "against": args.against.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.runs):  # the tree that goes first alternates
            for name in list(trees) if i % 2 == 0 else list(reversed(trees)):
                runs[name].append(one_launch(trees[name], Path(work)))
    result: dict = {}
    if args.runs > 0:
        result = {name: median(r) for name, r in runs.items()}
        result["ratio_this_over_against"] = {
            k: round(result["this"][k] / result["against"][k], 3)
            for k in ("launcher_cpu_s", "launcher_modules", "total_cpu_s", "wall_s")}
        result["runs"] = runs
    if args.tests:
        tests = test_files(trees, args.tests)
        result["tests"] = {"files": args.tests, **tests, "ratio_this_over_against": {
            k: round(tests["this"][k] / tests["against"][k], 3)
            for k in ("slowest_sum_s", "cpu_s", "wall_s")}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
