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
rank's share, DCP load). Reported per strategy:

  restore_s       seconds to get the state back (the restart record's figure: slowest rank,
                  from the decision to a loaded engine);
  kill_to_resume  seconds from the SIGKILL to the restored state (torchrun's restart, process
                  start, imports, process groups, model build, restore);

and the bytes each rank holds. The checkpoint was just written, so its files come from the
page cache: a real restart from shared storage is slower, so the disk figure is a lower bound.

    .venv/bin/python bench/recovery.py                       # ~25M parameters, 2 rounds each
    .venv/bin/python bench/recovery.py --hidden 256 --layers 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshtron.checkpoint import store
from meshtron.heal import snapshot_files as files


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _rank_pids(run_dir: Path) -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0")
                       if b"=" in x)
        except OSError:
            continue
        if str(run_dir).encode() in env.get(b"MESHTRON_RANK_ARGV", b"") and b"RANK" in env:
            out[int(env[b"RANK"])] = int(d.name)
    return out


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
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(out[-3000:])
    restart, = [r for r in _records(run_dir) if r.get("event") == "restart"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"restored_from": restart["restored_from"], "from_peer": restart.get("from_peer"), "resumed": restart["resumed_from_step"],
            "restore_s": restart["restore_s"], "kill_to_resume_s": restart["time"] - killed_at,
            "parts": restart.get("restore_parts_s"), "stall_s": summary["snapshot"]["stall_s_max"],
            "bytes": summary["snapshot"]["bytes_per_rank"][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    argv = ["--model", "tiny", "--set", f"model.hidden={a.hidden}", "--set",
            f"model.layers={a.layers}", "--set", f"model.ffn_hidden={a.hidden * 8 // 3}",
            "--set", "model.vocab=259", "--steps", str(2 * a.every + 2), "--seq-len", "32",
            "--global-batch", "8", "--eval-every", "0", "--nproc", "2", "--plan", "dp=2",
            "--zero", "3", "--ranks-per-node", "1", "--snapshot-every", str(a.every),
            "--checkpoint-every", str(a.every), "--max-restarts", "1"]
    results: dict[str, list[dict]] = {"memory": [], "peer": [], "disk": []}
    with tempfile.TemporaryDirectory(prefix="meshtron-recovery-") as tmp:
        for i in range(a.rounds):
            for name in results:
                r = one_round(Path(tmp), argv, a.every, name, a.timeout)
                assert r["restored_from"] == ("disk" if name == "disk" else "memory"), r
                assert name != "peer" or r["from_peer"] == [1], r
                results[name].append(r)
                parts = ", ".join(f"{k} {v:.3f}" for k, v in (r["parts"] or {}).items())
                print(f"round {i + 1} {name}: restore {r['restore_s']:.3f} s"
                      f"{f' ({parts})' if parts else ''}, kill -> resumed "
                      f"{r['kill_to_resume_s']:.2f} s; snapshot stall max {r['stall_s']:.3f} s",
                      flush=True)
    b = results["memory"][0]["bytes"]
    print(f"\nstate per rank {b['own'] / 2**20:.1f} MiB (snapshot host memory per rank "
          f"{b['host_total'] / 2**20:.1f} MiB: own + peer copy, 2 generations)")
    print(f"{'strategy':<8} {'restore_s':>10} {'kill_to_resume_s':>17}   (median of "
          f"{a.rounds})")
    med = {}
    for name, rs in results.items():
        med[name] = (statistics.median(r["restore_s"] for r in rs),
                     statistics.median(r["kill_to_resume_s"] for r in rs))
        print(f"{name:<8} {med[name][0]:>10.3f} {med[name][1]:>17.2f}")
    for name in ("memory", "peer"):
        print(f"disk / {name}: restore {med['disk'][0] / med[name][0]:.1f}x, kill -> resumed "
              f"{med['disk'][1] / med[name][1]:.2f}x")


if __name__ == "__main__":
    main()
