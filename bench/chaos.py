"""Chaos bench: SIGKILL a random rank every K steps of a long run, and report goodput and steps
lost per recovery strategy, side by side in one invocation (same model, batch, steps, ranks).

    .venv/bin/python bench/chaos.py                       # 60 steps, a kill every 15
    .venv/bin/python bench/chaos.py --steps 150 --every 30 --hidden 384 --write-recovery

Strategies (STRATEGIES below), 2 ranks or 2 replica groups each:
- restart_from_disk: `meshtron train --nproc 2 --checkpoint-every C --max-restarts R`: every
  rank restarts (torchrun's agent) and resumes from the newest checkpoint.
- in_memory: the same with `--snapshot-every S --ranks-per-node 1`
  (meshtron/checkpoint/snapshot.py): the restart restores the newest in-memory snapshot (the
  killed process's host memory survives it, as on a real host), so at most S steps are trained
  again.
- replica_ft: `meshtron train --replica-ft 2 --max-restarts R`: the surviving group goes on, a
  warm spare rejoins with the live weights (torchft copies them from the healthy group). A
  group is killed only at full strength (after the previous replacement rejoined), and a
  replacement that rejoins after the survivors finished is not seen: the model must be large
  enough (--hidden, --layers) that the steps after a kill outlast a replacement's start.

Figures per strategy:
- goodput = useful step-seconds / wall seconds from the first step to the last, where useful =
  (the strategy's failure-free median step) x (steps, counting a replica-FT step run by k of G
  groups as k/G of a step); startup before step 1 is excluded (equal for all); "vs base" uses
  restart_from_disk's median step instead, so a strategy's own per-step cost (snapshot copies,
  torchft quorums) counts as lost too;
- rejoined: replacement groups seen committing a step with the live weights (replica_ft);
- steps lost: steps trained again after a restart (restart_from_disk), or batch fractions
  dropped while a group was out (replica_ft: sum of 1 - k/G);
- recovery seconds: kill -> the next committed step (restart); the survivors' extra seconds at
  the failed step, and kill -> the replacement's first committed step (replica_ft).

`--write-recovery` stores the replica-FT medians (stall, rejoin) in
meshtron/reliability/recovery.toml, labelled with this run, which `meshtron cost` and `meshtron
simulate --step` read (its restart and in-memory values come from bench/recovery.py).
On a shared 2-core machine the absolute seconds are dominated by process start-up (import
torch: several seconds under load); the ratios between strategies are the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # meshtron, testkit
COMMON = ["--model", "tiny", "--global-batch", "4", "--seq-len", "32", "--eval-every", "0",
          "--overwrite"]


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def restart_command(run_dir: Path, steps: int, restarts: int, ckpt_every: int) -> list[str]:
    return [sys.executable, "-m", "meshtron", "train", *COMMON, "--steps", str(steps),
            "--nproc", "2", "--plan", "dp=2", "--checkpoint-every", str(ckpt_every),
            "--max-restarts", str(restarts), "--run-dir", str(run_dir)]


def replica_command(run_dir: Path, steps: int, restarts: int, ckpt_every: int) -> list[str]:
    return [sys.executable, "-m", "meshtron", "train", *COMMON, "--steps", str(steps),
            "--replica-ft", "2", "--max-restarts", str(restarts), "--run-dir", str(run_dir)]


SNAPSHOT_EVERY = [1]
"""--snapshot-every of the in_memory strategy (set from the command line)."""


def in_memory_command(run_dir: Path, steps: int, restarts: int, ckpt_every: int) -> list[str]:
    """In-memory snapshots every step (meshtron/checkpoint/snapshot.py; each rank its own and the
    other "node"'s copy, --ranks-per-node 1), the disk checkpoint as for restart_from_disk: a
    killed rank's host memory survives it (a process death, not a host loss), so the restart
    restores the newest snapshot and at most one step is trained again."""
    return [*restart_command(run_dir, steps, restarts, ckpt_every), "--snapshot-every",
            str(SNAPSHOT_EVERY[0]),
            "--ranks-per-node", "1"]


def _group_pids(run_dir: Path) -> list[int]:
    try:
        return list(json.loads((run_dir / "replica_ft" / "pids.json").read_text()).values())
    except (OSError, json.JSONDecodeError):
        return []


def _progress(kind: str, run_dir: Path) -> list[dict]:
    """Committed step records so far, in order, each with a wall time 't'."""
    if kind == "replica_ft":
        recs: dict[int, dict] = {}
        for f in sorted((run_dir / "replica_ft").glob("group*_*.jsonl")):
            for r in _lines(f):
                old = recs.get(r["step"])
                if old is None or r["t"] < old["t"]:
                    recs[r["step"]] = r
        return [recs[k] for k in sorted(recs)]
    # metrics.jsonl: step records, and a restart event before each resumed attempt's records
    # (the resumed attempt rewrites the history after its checkpoint step)
    out, attempt = [], 0
    for r in _lines(run_dir / "metrics.jsonl"):
        if r.get("event") == "restart":
            attempt = r["attempt"]
            out.append(r)
        elif "step" in r:
            out.append({**r, "attempt": attempt})
    return out


def _key(r: dict):
    return ("restart", r["attempt"]) if r.get("event") == "restart" else (r.get("attempt"),
                                                                          r["step"])


def run_strategy(kind: str, cmd: list[str], run_dir: Path, every: int, seed: int,
                 timeout_s: float) -> dict:
    rng = random.Random(seed)
    pids_of = _group_pids if kind == "replica_ft" else _rank_pid_list
    seen: dict = {}  # restart_from_disk: bench-side time each (attempt, step) record appeared
    kills: list[dict] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + timeout_s
    since_kill = 0
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{kind}: no finish within {timeout_s:.0f} s")
        recs = _progress(kind, run_dir)
        for r in recs:
            if _key(r) not in seen:
                seen[_key(r)] = (time.time(), r)
                since_kill += "step" in r
        recs = [r for r in recs if "step" in r]
        pids = pids_of(run_dir)
        # Kill only at full strength: every rank up, every replica group in the last quorum
        # (killing the one group that holds the live state while its replacement is still
        # copying would end a replica-FT run: nothing is left to copy from).
        full = kind != "replica_ft" or (recs and recs[-1]["participants"] == 2)
        if since_kill >= every and len(pids) >= 2 and full:
            victim = rng.choice(sorted(pids))
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills.append({"t": time.time(), "after_records": len(recs),
                          "last_step": recs[-1]["step"] if recs else 0})
            since_kill = 0
        time.sleep(0.02)
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: exit {proc.returncode}\n{err[-2000:]}")
    for r in _progress(kind, run_dir):
        seen.setdefault(_key(r), (time.time(), r))
    recs = [r for r in _progress(kind, run_dir) if "step" in r]
    return summarize(kind, recs, seen, kills, run_dir)


def summarize(kind: str, recs: list[dict], seen: dict, kills: list[dict],
              run_dir: Path) -> dict:
    if kind == "replica_ft":
        times = [r["t"] for r in recs]
        gaps = [b - a for a, b in zip(times, times[1:])]
    else:  # every step record of every attempt, in the order the bench saw them
        steps = sorted((t, r) for k, (t, r) in seen.items() if "step" in r)
        times = [t for t, _ in steps]
        gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:])
                if a[1]["attempt"] == b[1]["attempt"]]
    step_s = statistics.median(gaps)
    wall = times[-1] - times[0] + step_s  # first step's own time counted once
    out = {"kills": len(kills), "median_step_s": step_s, "wall_s": wall}
    if kind == "replica_ft":
        groups = max(r["participants"] for r in recs)
        useful = sum(r["participants"] / groups for r in recs)
        out["steps_lost"] = len(recs) - useful
        stalls, rejoins = [], []
        events = _lines(run_dir / "replica_ft" / "events.jsonl")
        for k in kills:
            after = [r for r in recs if r["t"] > k["t"]]
            before = [r for r in recs if r["t"] <= k["t"]]
            if after and before:
                stalls.append(max(0.0, after[0]["t"] - before[-1]["t"] - step_s))
            rep = next((e for e in events if e["event"] == "replace" and e["t"] >= k["t"] - 1),
                       None)
            if rep is not None:
                f = run_dir / "replica_ft" / f"group{rep['group']}_{rep['attempt']}.jsonl"
                first = _lines(f)
                if first:
                    rejoins.append(first[0]["t"] - k["t"])
        out.update(stall_s=stalls, rejoin_s=rejoins)
    else:
        useful = len({r["step"] for r in recs})
        restarts = [r for k, (t, r) in seen.items() if k[0] == "restart"]
        out["steps_lost"] = sum(r["lost_steps"] for r in restarts)
        # kill -> the first step record of the attempt that followed it
        firsts = sorted(t for k, (t, r) in seen.items()
                        if "step" in r and r["attempt"] > 0
                        and t == min(t2 for k2, (t2, r2) in seen.items()
                                     if "step" in r2 and r2["attempt"] == r["attempt"]))
        out["recovery_s"] = [next((t for t in firsts if t > k["t"]), math.nan) - k["t"]
                             for k in kills]
    out["goodput"] = useful * step_s / wall
    return out


def _rank_pid_list(run_dir: Path) -> list[int]:
    """torchrun's worker processes of this run (testkit/procs.py)."""
    from testkit.procs import rank_pids

    return list(rank_pids(run_dir).values())


STRATEGIES = {"restart_from_disk": restart_command, "in_memory": in_memory_command,
              "replica_ft": replica_command}


def write_recovery(results: dict, note: str) -> None:
    """The replica-FT medians into meshtron/reliability/recovery.toml, labelled with this run
    (the restart and in-memory values there come from bench/recovery.py, which splits them
    into phases and takes the state transfer out)."""
    from meshtron.reliability.goodput import RECOVERY_FILE, update_recovery_file

    f = results.get("replica_ft")
    values = {}
    for key, xs in (("replica_stall_s", f and f["stall_s"]), ("replica_rejoin_s",
                                                              f and f["rejoin_s"])):
        if xs:
            values[key] = (round(statistics.median(xs), 2),
                           f"{note}; median of {len(xs)}")
    update_recovery_file(RECOVERY_FILE, values)
    print(f"wrote {RECOVERY_FILE}: {({k: v[0] for k, v in values.items()})}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=15, help="kill a random rank every K steps")
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="per strategy, seconds")
    ap.add_argument("--snapshot-every", type=int, default=1, help="in_memory strategy")
    ap.add_argument("--only", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    ap.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    ap.add_argument("--hidden", type=int, default=256, help="model.hidden (tiny: 256)")
    ap.add_argument("--layers", type=int, default=4, help="model.layers (tiny: 4)")
    ap.add_argument("--write-recovery", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args()
    # A step long enough that a replacement replica group (seconds to start and copy the
    # live state) rejoins before the survivors finish the run: otherwise no rejoin is seen.
    COMMON.extend(["--set", f"model.hidden={args.hidden}", "--set", f"model.layers={args.layers}",
                   "--set", f"model.ffn_hidden={args.hidden * 8 // 3}"])
    SNAPSHOT_EVERY[0] = args.snapshot_every
    restarts = args.steps // args.every + 2
    results = {}
    tmp = tempfile.mkdtemp(prefix="chaos_")  # kept when a strategy fails, for its logs
    for kind, make in STRATEGIES.items():
        if kind not in args.only:
            continue
        run_dir = Path(tmp) / kind
        cmd = make(run_dir, args.steps, restarts, args.checkpoint_every)
        if cmd is None:
            print(f"{kind:18} skipped (hook not filled in: bench/chaos.py {make.__name__})")
            continue
        results[kind] = run_strategy(kind, cmd, run_dir, args.every, args.seed, args.timeout)
    print(f"\n{args.steps} steps, a random rank SIGKILLed every {args.every} steps "
          f"(checkpoint every {args.checkpoint_every} for restart_from_disk and in_memory, "
          f"in-memory snapshot every {SNAPSHOT_EVERY[0]}), 2 ranks or 2 replica groups each; "
          f"model hidden {args.hidden} x {args.layers} layers; {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f}")
    # goodput_own: useful steps x the strategy's own failure-free step / wall; goodput_base:
    # x the plain restart_from_disk step (what the same steps cost without the strategy's
    # per-step overheads: snapshots, replica-FT quorums), so those overheads count as lost.
    base = results.get("restart_from_disk", {}).get("median_step_s")
    for r in results.values():
        r["goodput_base"] = r["goodput"] * base / r["median_step_s"] if base else None
    print(f"{'strategy':18} {'kills':>5} {'rejoined':>8} {'goodput':>8} {'vs base':>8} "
          f"{'steps lost':>10} {'step s':>7} {'wall s':>7}  recovery")
    for kind, r in results.items():
        rec = (f"kill->step {', '.join(f'{x:.1f}' for x in r['recovery_s'])} s"
               if "recovery_s" in r else
               f"stall {', '.join(f'{x:.1f}' for x in r['stall_s'])} s; rejoin "
               f"{', '.join(f'{x:.1f}' for x in r['rejoin_s'])} s")
        rejoined = str(len(r["rejoin_s"])) if "rejoin_s" in r else "-"
        gb = f"{r['goodput_base']:8.1%}" if r["goodput_base"] is not None else f"{'-':>8}"
        print(f"{kind:18} {r['kills']:5d} {rejoined:>8} {r['goodput']:8.1%} {gb} "
              f"{r['steps_lost']:10.2f} {r['median_step_s']:7.3f} {r['wall_s']:7.1f}  {rec}")
    for kind in ("in_memory", "replica_ft"):
        if "restart_from_disk" in results and kind in results:
            a, b = results[kind], results["restart_from_disk"]
            print(f"{kind} / restart_from_disk goodput: x{a['goodput'] / b['goodput']:.2f} "
                  f"(vs base x{a['goodput_base'] / b['goodput_base']:.2f})")
    import shutil

    if args.keep:
        print(f"run folders kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.write_recovery:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        write_recovery(results, f"bench/chaos.py {when}: {args.steps} steps, a SIGKILL every "
                       f"{args.every}, model hidden "
                       f"{args.hidden} x {args.layers} layers, 2 replica groups of 1 rank on "
                       f"{os.cpu_count()} CPU cores (gloo), load average "
                       f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
