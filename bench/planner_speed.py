"""Planner search speed: plans evaluated per second and search time from 64 to 131,072 GPUs.

The headline case is llama3-405b on dgx-h100:2048 (16,384 GPUs), global batch 2048 x 8192.
Each search is timed cold (the layer-cost caches are cleared first), best of 3 runs. The search
is single-threaded; "cpu s" is the process CPU time (what one core spends), "wall s" the elapsed
time, which is larger when the machine is shared.

The last table is the whole command as a user runs it, start-up included: `meshtron plan
--model llama3-405b --cluster dgx-h100:2048 --global-batch 2048 --seq-len 8192 --json` in a
fresh interpreter (best of 5; cpu s from the child's rusage), and how many modules it imports;
then the same for COMMANDS: an open search (70B on 512 GPUs) and a pinned 405B layout that does
not fit (priced, plus the searches for the cheapest change that fits: planner/pinned.py).

    python bench/planner_speed.py [--startup]     # --startup: only the whole-command tables
    python bench/planner_speed.py --vs OLD [--sweep]  # CPU of VERSUS in this tree and OLD's

--vs OLD: the CPU of each command in VERSUS (the 405B plan on 2,048 GPUs the audits time, a
DeepSeek-V3 plan on 256 GPUs; with --sweep also the 512..131,072-GPU simulate sweep, ~150 s a
run before session 48) run in a fresh interpreter from OLD (a checkout or `git archive` of
another commit) and from this tree, alternately, best of 2, as a ratio old / new.

Before/after a change, run both trees side by side with farm-bench (pairs A B A B ...):
    farm-bench -n 3 --vs "sh -c 'cd OLD && PYTHONPATH=OLD exec python bench/planner_speed.py'" \
        -- python bench/planner_speed.py
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtron.model.spec import resolve_model  # noqa: E402
from meshtron.planner.cluster import resolve_cluster  # noqa: E402
from meshtron.planner.compute import embedding_cost, head_cost, layer_cost  # noqa: E402
from meshtron.planner.search import search_plans  # noqa: E402


def clear_caches() -> None:
    import meshtron.planner.estimate as estimate
    import meshtron.planner.estimate_pieces as estimate_pieces

    # the process-wide memos of estimate.py (absent before session 35; in estimate_pieces.py
    # since its split, where getattr on estimate alone found none)
    memos = [getattr(module, name, None) for module in (estimate, estimate_pieces)
             for name in ("_recompute_flops", "_weighted_in_flight", "_peak_outputs")]
    for f in (layer_cost, head_cost, embedding_cost, *filter(None, memos)):
        f.cache_clear()


def time_search(model_name: str, nodes: int, batch: int, seq: int, repeats: int = 3):
    model = resolve_model(model_name)
    cluster = resolve_cluster(f"dgx-h100:{nodes}")
    best = None
    for _ in range(repeats):
        clear_caches()
        wall, cpu = time.perf_counter(), time.process_time()
        result = search_plans(model, cluster, batch, seq)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if best is None or cpu < best[0]:
            best = (cpu, wall, result)
    return best


HEADLINE = ["plan", "--model", "llama3-405b", "--cluster", "dgx-h100:2048", "--global-batch",
            "2048", "--seq-len", "8192", "--top", "1", "--json"]
COMMANDS = {
    "open search, 70B on 512 GPUs": ["plan", "--model", "llama3-70b", "--cluster", "dgx-h100:64",
                                     "--global-batch", "512", "--seq-len", "8192"],
    "pinned 405B layout, no fit": [
        "plan", "--model", "llama3-405b", "--cluster", "dgx-h100:1024", "--global-batch", "2048",
        "--seq-len", "8192", "--layout", "tp=8,cp=1,pp=16,dp=64", "--zero", "1", "--sp", "on",
        "--recompute", "none", "--micro-batch", "1", "--schedule", "interleaved",
        "--offload", "none", "--json"],
}


def time_command(repeats: int = 5, argv: list[str] = HEADLINE) -> tuple[float, float, int]:
    """(best wall s, its cpu s, modules imported) of `meshtron argv` in a fresh interpreter."""
    probe = ("import sys; from meshtron.cli import main; rc = main(sys.argv[1:]); "
             "print(len(sys.modules), file=sys.stderr); sys.exit(rc)")
    best = None
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
        wall = time.perf_counter() - wall
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if best is None or wall < best[0]:
            best = (wall, cpu, int(out.stderr.strip().splitlines()[-1]))
    return best


VERSUS = {
    "plan 405B, 2,048 GPUs": ["plan", "--model", "llama3-405b", "--cluster", "dgx-h100:256",
                              "--global-batch", "2048", "--seq-len", "8192", "--top", "1"],
    "plan DeepSeek-V3, 256 GPUs": ["plan", "--model", "deepseek-v3", "--cluster", "dgx-h100:32",
                                   "--global-batch", "1024", "--seq-len", "4096", "--top", "1"],
}
SWEEP = ["simulate", "--model", "llama3-405b", "--gpus", "512..131072", "--global-batch",
         "2048", "--seq-len", "8192", "--batch-growth", "16384"]


def command_cpu(tree: Path, argv: list[str]) -> float:
    """CPU seconds (user + system, the child's rusage) of `meshtron argv` run from `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as out:
        argv = [a.replace("{out}", out) for a in argv]
        subprocess.run([sys.executable, "-c", "import sys; from meshtron.cli import main; "
                        "sys.exit(main(sys.argv[1:]))", *argv], cwd=tree, check=True,
                       env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def versus(old: Path, sweep: bool, repeats: int = 2) -> None:
    """Old tree against this one, command by command (alternating runs, best of `repeats`)."""
    new = Path(__file__).resolve().parent.parent
    cases = dict(VERSUS, **({"simulate sweep 512..131,072": SWEEP + ["--out", "{out}"]}
                            if sweep else {}))
    print(f"{'command':<30} {'old cpu s':>10} {'new cpu s':>10} {'old / new':>10}")
    for name, argv in cases.items():
        best = {old: float("inf"), new: float("inf")}
        for _ in range(repeats):
            for tree in (old, new):
                best[tree] = min(best[tree], command_cpu(tree, argv))
        print(f"{name:<30} {best[old]:>10.2f} {best[new]:>10.2f} "
              f"{best[old] / best[new]:>10.2f}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--startup", action="store_true",
                   help="time only the whole `meshtron plan` commands, not the search table")
    p.add_argument("--vs", type=Path, metavar="OLD",
                   help="only the side-by-side CPU of VERSUS in OLD's tree and this one")
    p.add_argument("--sweep", action="store_true", help="with --vs: the simulate sweep too")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.vs:
        versus(args.vs.resolve(), args.sweep)
        return 0
    if not args.startup:
        search_table()
    wall, cpu, modules = time_command()
    print(f"\nmeshtron plan, 405B on 16,384 GPUs, whole command: {wall:.3f} s wall, {cpu:.3f} s "
          f"cpu, {modules} modules imported")
    for name, argv_ in COMMANDS.items():
        wall, cpu, _ = time_command(argv=argv_)
        print(f"meshtron plan, {name}, whole command: {wall:.3f} s wall, {cpu:.3f} s cpu")
    return 0


def search_table() -> None:
    print(f"{'model':<12} {'GPUs':>7} {'batch':>6} {'configs':>8} {'evaluated':>9} "
          f"{'cpu s':>7} {'wall s':>7} {'plans/s':>9}  best plan")
    cases = [("llama3-8b", 8, 512), ("llama3-70b", 32, 1024), ("llama3-70b", 64, 1024),
             ("llama3-405b", 256, 2048), ("llama3-405b", 1024, 2048), ("llama3-405b", 2048, 2048),
             ("llama3-405b", 4096, 4096), ("llama3-405b", 8192, 8192),
             ("llama3-405b", 16384, 16384)]
    for model_name, nodes, batch in cases:
        cpu, wall, r = time_search(model_name, nodes, batch, 8192)
        best = r.best.config.describe() if r.best else "nothing fits"
        print(f"{model_name:<12} {nodes * 8:>7} {batch:>6} {r.enumerated:>8} {r.evaluated:>9} "
              f"{cpu:>7.3f} {wall:>7.3f} {r.enumerated / max(cpu, 1e-9):>9,.0f}  {best}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
