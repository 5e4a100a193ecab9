"""Recovery seconds after a SIGKILL: from in-memory snapshots vs from the disk checkpoint, the
same run at the same size, side by side in one run (alternating rounds, so machine noise hits
both alike).

Every round starts `meshtron train --nproc 2 --plan dp=2 --zero 3 --ranks-per-node 1
--snapshot-every S --checkpoint-every S --max-restarts 1` (both taken at the same steps), waits
until step S's disk checkpoint is committed and its snapshot (own slot and the peer's copy) is
complete on both ranks, then SIGKILLs both ranks. The `memory` round leaves host memory alone
(the processes died, the hosts did not), so torchrun's restart restores from each rank's own
snapshot; the `peer` round deletes node 1's memory (the loss of that host), so rank 1's shard
comes from rank 0's copy over gloo; the `disk` round deletes every snapshot (both shards and
their copies gone), so it restores from the checkpoint (manifest verified, SHA-256 of each
rank's share, DCP load). Reported per strategy, median over the rounds:

  phases          kill -> the first step again, split at the restarted rank 0's marks
                  (meshtron/checkpoint/phases.py, in the restart record): detect_respawn (torchrun
                  notices, stops the group, new rendezvous round, spawns), python_start
                  (interpreter and imports, torch included), process_group, build (plan, model,
                  FSDP2, optimizer, side groups), restore, first_step (the bench sees its record);
  restore parts   slowest rank per part (memory: decide, fetch, template, read, apply; disk:
                  verify, template, read, apply); "beyond template": the strategy's own work;
  steady_step_s   the resumed attempt's median step after its first;

and the bytes each rank holds. The checkpoint was just written, so its files come from the
page cache: a real restart from shared storage is slower, so the disk figure is a lower bound.
`--write-recovery` puts the fixed seconds (kill -> first step minus the state transfer: verify,
read, fetch) of the disk and memory rounds into meshtron/reliability/recovery.toml, labelled.

    .venv/bin/python bench/recovery.py                       # ~25M parameters, 2 rounds each
    .venv/bin/python bench/recovery.py --rounds 5 --write-recovery --json out.json
    .venv/bin/python bench/recovery.py --hidden 256 --layers 2 --rounds 1 --only memory disk
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # meshtron, testkit

from meshtron.checkpoint import store  # noqa: E402
from meshtron.checkpoint import snapshot_files as files  # noqa: E402
from testkit.procs import rank_pids as _rank_pids, records as _records  # noqa: E402


# Rank 0's start-up marks (meshtron/checkpoint/phases.py) in order, and the phases between the kill,
# those marks and the first step record of the resumed attempt.
# (torch_imported is left out: meshtron's command line imports torch before the rank entry, so
# python_start holds the imports.)
PHASE_MARKS = ("process_start", "rank_entry", "group_ready", "engine_built", "restored")
PHASES = ("detect_respawn", "python_start", "process_group", "build", "restore", "first_step")


def _ready(run_dir: Path, step: int, every: int) -> bool:
    """Step `step` is committed on disk and complete in memory (own + copy) on both ranks."""
    if step not in [s for s, _ in store.committed(store.checkpoint_root(run_dir))]:
        return False
    root = files.job_root(run_dir)
    k = (step // every) % files.SLOTS
    for r in range(2):
        lay = files.Layout(r, 2, 1)
        for kind, owner in (("own", r), ("held", lay.source)):
            doc = files.read_meta(lay.slot(root, kind, owner, k))
            if doc is None or doc["step"] != step:
                return False
    return True


def one_round(work: Path, argv: list[str], every: int, name: str, timeout: float) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "train", *argv, "--run-dir",
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _ready(run_dir, every, every):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"step {every} never became ready:\n"
                                   f"{proc.communicate()[0][-3000:]}")
            time.sleep(0.02)
        pids = _rank_pids(run_dir)
        killed_at = time.time()
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        if name == "disk":
            shutil.rmtree(files.job_root(run_dir))
        elif name == "peer":
            shutil.rmtree(files.job_root(run_dir) / "node_1")
        first_step_at = None  # bench-side: when the resumed attempt's first step record appeared
        while proc.poll() is None and first_step_at is None:
            recs = _records(run_dir)
            at = next((i for i, r in enumerate(recs) if r.get("event") == "restart"), None)
            if at is not None and any("step" in r for r in recs[at + 1:]):
                first_step_at = time.time()
            elif time.monotonic() > deadline:
                raise RuntimeError("no step after the restart")
            else:
                time.sleep(0.01)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(out[-3000:])
    restart, = [r for r in _records(run_dir) if r.get("event") == "restart"]
    summary = json.loads((run_dir / "summary.json").read_text())
    marks = restart["phases"]
    recs = _records(run_dir)
    at = next(i for i, r in enumerate(recs) if r.get("event") == "restart")
    resumed_steps = [r["step_time_s"] for r in recs[at + 1:] if "step_time_s" in r]
    times = [killed_at, *(marks[k] for k in PHASE_MARKS), first_step_at or math.nan]
    phases = dict(zip(PHASES, (b - a for a, b in zip(times, times[1:]))))
    return {"restored_from": restart["restored_from"], "from_peer": restart.get("from_peer"),
            "resumed": restart["resumed_from_step"], "restore_s": restart["restore_s"],
            "restore": phases["restore"],
            "presized_optimizer": restart.get("presized_optimizer"),
            "kill_to_resume_s": marks["restored"] - killed_at,
            "kill_to_first_step_s": (first_step_at or math.nan) - killed_at,
            "phases": phases, "parts": restart.get("restore_parts_s"),
            # the resumed attempt's steps: its first (warm-up: FSDP lazy init, first DTensor
            # dispatches) and the median of the others
            "first_step_time_s": resumed_steps[0],
            "steady_step_s": statistics.median(resumed_steps[1:] or resumed_steps),
            "stall_s": summary["snapshot"]["stall_s_max"],
            "bytes": summary["snapshot"]["bytes_per_rank"][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--only", nargs="+", choices=["memory", "peer", "disk"],
                    default=["memory", "peer", "disk"], help="strategies to run")
    ap.add_argument("--json", metavar="PATH", help="also write every round here")
    ap.add_argument("--from-json", metavar="PATH", help="report the rounds of an earlier --json")
    ap.add_argument("--write-recovery", action="store_true",
                    help="store the fixed seconds in meshtron/reliability/recovery.toml")
    a = ap.parse_args()
    argv = ["--model", "tiny", "--set", f"model.hidden={a.hidden}", "--set",
            f"model.layers={a.layers}", "--set", f"model.ffn_hidden={a.hidden * 8 // 3}",
            "--set", "model.vocab=259", "--steps", str(2 * a.every + 2), "--seq-len", "32",
            "--global-batch", "8", "--eval-every", "0", "--nproc", "2", "--plan", "dp=2",
            "--zero", "3", "--ranks-per-node", "1", "--snapshot-every", str(a.every),
            "--checkpoint-every", str(a.every), "--max-restarts", "1"]
    results: dict[str, list[dict]] = {k: [] for k in a.only}
    if a.from_json:  # the rounds of an earlier run: report (and --write-recovery) again
        results = {k: v for k, v in json.loads(Path(a.from_json).read_text())["rounds"].items()
                   if k in a.only}
        a.rounds = len(next(iter(results.values())))
    with tempfile.TemporaryDirectory(prefix="meshtron-recovery-") as tmp:
        for i in range(0 if a.from_json else a.rounds):
            for name in results:
                r = one_round(Path(tmp), argv, a.every, name, a.timeout)
                assert r["restored_from"] == ("disk" if name == "disk" else "memory"), r
                assert name != "peer" or r["from_peer"] == [1], r
                results[name].append(r)
                parts = ", ".join(f"{k} {v:.3f}" for k, v in (r["parts"] or {}).items())
                ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
                print(f"round {i + 1} {name}: kill -> first step {r['kill_to_first_step_s']:.2f}"
                      f" s ({ph}); restore {r['restore_s']:.3f} s ({parts}); snapshot stall "
                      f"max {r['stall_s']:.3f} s", flush=True)
    b = next(iter(results.values()))[0]["bytes"]
    load = json.loads(Path(a.from_json).read_text())["load_average"] if a.from_json \
        else os.getloadavg()[0]
    print(f"\nstate per rank {b['own'] / 2**20:.1f} MiB (snapshot host memory per rank "
          f"{b['host_total'] / 2**20:.1f} MiB: own + peer copy, 2 generations); "
          f"{os.cpu_count()} cores, load average {load:.1f} at the end")
    med = {name: summarize(rs) for name, rs in results.items()}
    cols = [*PHASES, "kill_to_first_step_s", "first_step_time_s", "steady_step_s"]
    print(f"median of {a.rounds} round(s), seconds:")
    print(f"{'phase':<22}" + "".join(f"{n:>10}" for n in med))
    for c in cols:
        print(f"{c:<22}" + "".join(f"{m[c]:>10.3f}" for m in med.values()))
    parts = sorted({k for m in med.values() for k in m["parts"]})
    print("restore parts (slowest rank):")
    for c in parts:
        print(f"  {c:<20}" + "".join(f"{m['parts'].get(c, math.nan):>10.3f}"
                                     for m in med.values()))
    print(f"  {'beyond template':<20}" + "".join(f"{m['restore_beyond_template_s']:>10.3f}"
                                                for m in med.values()))
    for name in [n for n in ("memory", "peer") if n in med and "disk" in med]:
        d, m = med["disk"], med[name]
        print(f"disk / {name}: restore x{d['restore'] / m['restore']:.2f}, restore beyond "
              f"the template x{d['restore_beyond_template_s'] / m['restore_beyond_template_s']:.2f}"
              f", kill -> first step x{d['kill_to_first_step_s'] / m['kill_to_first_step_s']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": argv, "rounds": results, "median": med,
                                            "load_average": load}, indent=1))
    fixed = fixed_seconds(results)
    print("fixed seconds for recovery.toml (start-up phases pooled over every round, + the "
          "strategy's own restore work, no state transfer): "
          + ", ".join(f"{k} {v:.2f}" for k, v in fixed.items()))
    if a.write_recovery:
        write_recovery(fixed, sum(len(r) for r in results.values()), b["own"], a, load)


def fixed_seconds(results: dict[str, list[dict]]) -> dict[str, float]:
    """The fixed recovery seconds per strategy for meshtron/reliability/recovery.toml.

    Every phase but the restore runs the same code for all three strategies (detect, respawn,
    imports, process group, build, first step), and on a shared machine those phases swing
    2-3x between rounds, far more than the strategies differ; so they are pooled over every
    round of every strategy (median of kill -> first step minus the restore phase), and each
    strategy adds the median of its own restore work without the state transfer (disk: verify
    and DCP read; memory: peer fetch and the copy), which goodput.py adds per model at the
    target's bandwidth."""
    rounds = [r for rs in results.values() for r in rs]
    shared = statistics.median(r["kill_to_first_step_s"] - r["phases"]["restore"]
                               for r in rounds)
    moved = ("verify", "read", "fetch")
    return {name: shared + statistics.median(
        r["restore_s"] - sum((r["parts"] or {}).get(k, 0.0) for k in moved) for r in rs)
        for name, rs in results.items()}


def summarize(rounds: list[dict]) -> dict:
    """Medians per phase, per restore part, and the fixed seconds for recovery.toml."""
    m = {c: statistics.median(r["phases"][c] for r in rounds) for c in PHASES}
    for c in ("kill_to_first_step_s", "first_step_time_s", "steady_step_s"):
        m[c] = statistics.median(r[c] for r in rounds)
    keys = {k for r in rounds for k in (r["parts"] or {})}
    m["parts"] = {k: statistics.median(r["parts"].get(k, 0.0) for r in rounds) for k in keys}
    # The strategy's own restore work: all but the state-dict template, which both paths
    # build alike (EngineState.presize_optimizer, or torch's zero-lr optimizer step without it).
    m["restore_beyond_template_s"] = statistics.median(
        r["restore_s"] - r["parts"].get("template", 0.0) for r in rounds)
    return m


def write_recovery(fixed: dict[str, float], n: int, own_bytes: int, a: argparse.Namespace,
                   load: float) -> None:
    """Put the fixed seconds (fixed_seconds) into meshtron/reliability/recovery.toml (restart
    from disk: `disk`; in memory: `memory`), each labelled with what, where and when."""
    from meshtron.reliability.goodput import RECOVERY_FILE, update_recovery_file

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(
        Path(a.from_json).stat().st_mtime if a.from_json else None))
    label = (f"bench/recovery.py {when}: kill -9 of both ranks -> first step, start-up phases "
             f"pooled over {n} rounds (memory, peer, disk alternating) + this strategy's own "
             f"restore work, no state transfer; 2 gloo ranks (dp=2 ZeRO-3, "
             f"{own_bytes / 2**20:.0f} MiB state per rank) on {os.cpu_count()} CPU cores, load "
             f"average {load:.1f}")
    values = {}
    if "disk" in fixed:
        values["restart_from_disk_s"] = (round(fixed["disk"], 2), label)
    if "memory" in fixed:
        values["in_memory_s"] = (round(fixed["memory"], 2), label)
    update_recovery_file(RECOVERY_FILE, values)
    print(f"wrote {RECOVERY_FILE}: " + ", ".join(f"{k} = {v[0]}" for k, v in values.items()))


if __name__ == "__main__":
    main()
