"""Checkpoint cost: how long training is blocked per save, and how long until it commits.

One process, one model, one optimizer state (after a real training step), the same Checkpointer
that `meshtron train --checkpoint-every` uses, alternating rounds (sync, async, async-thread,
sync, ...) so machine noise (other jobs on a shared box) hits all alike:

  sync          `save(step, blocking=True)`: stage, write every shard, checksum, commit, return.
  async         `save(step)` with the copy to host memory on the training thread (the previous
                design): the write, checksum and commit run on the background thread.
  async-thread  `save(step)` as `meshtron train` runs it: the copy runs on DCP's stager thread
                too; training blocks only in the next optimizer step, if the copy is not done.

Blocking = seconds in `save` + seconds the next optimizer step waited (Checkpointer.stalls_s);
commit = seconds from the call to the committed folder. Also printed: save and load throughput,
each checksum algorithm's cost, train steps while a save is in flight, and with --kill the steps
lost when a run is SIGKILLed between checkpoints (real process, real signal, then --resume).

With --ranks N (default 2): N gloo ranks (ZeRO-3, dp=N: each rank writes its shard) compare,
side by side, rank 0 checksumming every file alone (the previous design, at every commit and on
every resume) against each rank hashing its own files / verifying its share (integrity.py).

    .venv/bin/python bench/checkpoint_save.py                 # ~12M-parameter model, 4 rounds
    .venv/bin/python bench/checkpoint_save.py --size-gb 1 --rounds 2 --ranks 2
    .venv/bin/python bench/checkpoint_save.py --hidden 256 --layers 2 --rounds 3 --kill
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
import zlib
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--size-gb", type=float, default=None,
                   help="size the model so that its checkpoint holds about this many GB "
                        "(hidden 1024; overrides --hidden/--layers)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ranks", type=int, default=0,
                   help="also compare rank-0-alone and shared checksums on this many ranks")
    p.add_argument("--kill", action="store_true", help="also measure steps lost after SIGKILL")
    return p


if __name__ == "__main__":
    _parser().parse_args()  # --help and bad options answered before torch loads

import torch  # noqa: E402

from meshtron.checkpoint import CheckpointConfig, store  # noqa: E402
from meshtron.checkpoint.checkpointer import Checkpointer  # noqa: E402
from meshtron.config import config_from_dict  # noqa: E402
from meshtron.train.loop import LocalEngine, build_run_data  # noqa: E402


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 2**20 / max(seconds, 1e-9):8.1f} MB/s"


def _checksum_costs(folder: Path) -> dict[str, float]:
    """Seconds to checksum every file of `folder` with each algorithm (files read from the page
    cache, as they are right after a save)."""
    import hashlib

    files = [p for p in folder.iterdir() if p.is_file()]
    out = {}
    for name in ("sha256", "blake2b", "crc32"):
        t0 = time.perf_counter()
        for path in files:
            if name == "crc32":
                crc = 0
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        crc = zlib.crc32(chunk, crc)
            else:
                h = hashlib.new(name)
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
        out[name] = time.perf_counter() - t0
    return out


def _config(args, run_dir: Path):
    hidden, layers = args.hidden, args.layers
    if args.size_gb:
        # fp32 parameters + AdamW's two moments: 12 bytes per parameter, ~12 h^2 per block.
        hidden = 1024
        layers = max(1, round(args.size_gb * 2**30 / 12 / (12 * hidden * hidden)))
    return config_from_dict({
        "model": {"preset": "tiny", "hidden": hidden, "layers": layers,
                  "ffn_hidden": int(hidden * 8 / 3) // 8 * 8},
        "data": {"seq_len": args.seq_len, "global_batch": 2},
        "train": {"steps": 1000, "eval_every": 0, "run_dir": str(run_dir)}})


def _load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_saves(args, work: Path) -> None:
    cfg = _config(args, work / "run")
    torch.set_num_threads(1)
    data = build_run_data(cfg)
    engine = LocalEngine(cfg)

    def step():
        t0 = time.perf_counter()
        engine.train_step(*data.next_batch())
        return time.perf_counter() - t0

    step()  # optimizer states exist from here on
    every = CheckpointConfig(every=1, keep=1)
    main_thread = Checkpointer(every, cfg, engine, data, work / "run", staging_thread=False)
    ck = Checkpointer(every, cfg, engine, data, work / "run-thread")
    main_thread.start()
    ck.start()
    baseline = [step() for _ in range(3)]
    blocked = {"sync": [], "async": [], "async-thread": []}
    commit = {"sync": [], "async": [], "async-thread": []}
    during = {"async": [], "async-thread": []}
    n = 1
    load_before = _load_average()
    for _ in range(args.rounds):
        for mode, who in (("sync", main_thread), ("async", main_thread), ("async-thread", ck)):
            n += 1
            t0 = time.perf_counter()
            who.save(n, blocking=mode == "sync")
            if mode != "sync":
                while who._inflight is not None and not who._inflight.done():
                    during[mode].append(step())
                who.wait()
            commit[mode].append(time.perf_counter() - t0)
            blocked[mode].append(who.stalls_s[-1])  # incl. the wait in the next optimizer step
    main_thread.close()
    ck.close()
    folder = store.find_latest(ck.root).path
    nbytes = _folder_bytes(folder)
    t0 = time.perf_counter()
    problem = store.verify(folder)
    verify_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck.load(folder)
    load_s = time.perf_counter() - t0
    med = statistics.median
    print(f"model: {cfg.model.num_params():,} parameters; checkpoint {nbytes / 2**20:.1f} MB "
          f"({len(list(folder.iterdir()))} files); {args.rounds} rounds each; load average "
          f"{load_before} -> {_load_average()} on {os.cpu_count()} cores")
    print(f"{'(medians, s)':30}{'sync':>10}{'async':>10}{'async-thread':>14}"
          f"{'async/sync':>12}{'thread/sync':>12}")
    for label, d in (("blocking per save", blocked), ("save to commit", commit)):
        a, b, c = (med(d[m]) for m in ("sync", "async", "async-thread"))
        print(f"{label:30}{a:10.3f}{b:10.3f}{c:14.3f}{b / a:12.3f}{c / a:12.3f}")
    print(f"save throughput (sync, write+checksum+commit): {_rate(nbytes, med(commit['sync']))}")
    print(f"load throughput (verify {verify_s:.3f} s + DCP load into the model, optimizer): "
          f"{_rate(nbytes, load_s)}  [{load_s:.3f} s; checksums ok: {problem is None}]")
    for mode, steps in during.items():
        if steps:
            print(f"train step while a {mode} save is in flight: {med(steps):.3f} s vs "
                  f"{med(baseline):.3f} s with none (x{med(steps) / med(baseline):.2f}; "
                  f"{len(steps)} steps)")
    sync_s = commit["sync"]
    costs = _checksum_costs(folder)
    for name, secs in costs.items():
        print(f"checksum {name:8}: {_rate(nbytes, secs)}  = {secs / med(sync_s) * 100:5.1f}% of "
              "a synchronous save")


def rank_hashing(args, run_dir: str, rounds: int) -> dict[str, list[float]] | None:
    """Rank body (--ranks): one ZeRO-3 save, then rounds of rank 0 hashing / verifying every
    file alone vs every rank its own files / its share. Rank 0 returns the seconds."""
    import torch.distributed as dist

    from meshtron.checkpoint import integrity
    from meshtron.launch import current_world
    from meshtron.train.job import ParallelRequest
    from meshtron.train.parallel import ParallelEngine
    from meshtron.train.planning import fixed_knobs, resolve_run_plan

    world = current_world()
    cfg = _config(args, Path(run_dir))
    layout = f"dp={world.world_size}"
    request = ParallelRequest(plan=layout, nproc=world.world_size,
                              knobs=fixed_knobs(layout, 3, None, None, None, None))
    plan, _ = resolve_run_plan(cfg, request, world.world_size)
    engine = ParallelEngine(cfg, plan, torch.device("cpu"))
    data = build_run_data(cfg, dp_rank=engine.dp_rank, dp_size=plan.dp, main=engine.is_main)
    engine.train_step(*data.next_batch())
    ck = Checkpointer(CheckpointConfig(every=1, keep=1), cfg, engine, data, run_dir, plan)
    ck.start()
    ck.save(1)
    ck.wait()
    dist.barrier()  # rank 0 commits after the others' part of the save is done
    folder = store.find_latest(ck.root, deep=False).path
    names = sorted(p.name for p in folder.iterdir() if p.name != store.MANIFEST)
    own = [n for n in names if n.startswith(f"__{world.rank}_")
           or n == f"rank_{world.rank}.json"] + (
        [".metadata", store.META] if world.rank == 0 else [])
    out: dict[str, list[float]] = {k: [] for k in ("hash rank 0 alone", "hash shared",
                                                   "verify rank 0 alone", "verify shared")}

    def timed(key, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # the others wait for rank 0 (previous design) or for the slowest
        out[key].append(time.perf_counter() - t0)

    for _ in range(rounds):
        timed("hash rank 0 alone",
              lambda: world.rank == 0 and store.digest_files(folder, names))
        timed("hash shared", lambda: integrity.gather_digests(
            folder, own, world.rank, world.world_size, ck.save_group))
        timed("verify rank 0 alone", lambda: world.rank == 0 and store.verify(folder))
        timed("verify shared", lambda: integrity.find_latest(
            ck.root, world.rank, world.world_size, ck.vote_group))
    ck.close()
    nbytes = _folder_bytes(folder)
    engine.release()
    return {**out, "bytes": [nbytes]} if world.rank == 0 else None


def bench_ranks(args, work: Path) -> None:
    sys.path.append(str(Path(__file__).resolve().parent.parent))  # testkit/
    from testkit.multiproc import run_on_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkpoint_save import rank_hashing  # importable by the ranks (not __main__)

    res = run_on_ranks(rank_hashing, args.ranks, args, str(work / "ranks"), args.rounds,
                       timeout=3600)[0]
    nbytes = res.pop("bytes")[0]
    med = statistics.median
    print(f"{args.ranks} gloo ranks, ZeRO-3, checkpoint {nbytes / 2**20:.1f} MB; medians of "
          f"{args.rounds} rounds (the other ranks wait at a barrier); load average "
          f"{_load_average()}")
    for what in ("hash", "verify"):
        alone, shared = med(res[f"{what} rank 0 alone"]), med(res[f"{what} shared"])
        print(f"  {what:7} rank 0 alone {alone:8.3f} s   shared {shared:8.3f} s   "
              f"shared/alone {shared / alone:6.3f}")


def bench_kill(work: Path, every: int = 4, kill_after: int = 10) -> None:
    """SIGKILL a one-process run after step `kill_after`, resume, and read the lost steps."""
    run = work / "kill"
    argv = [sys.executable, "-m", "meshtron", "train", "--model", "debug", "--steps", "16",
            "--seq-len", "32", "--global-batch", "8", "--eval-every", "0", "--run-dir", str(run),
            "--checkpoint-every", str(every)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.exists() and any(json.loads(x).get("step") == kill_after
                                    for x in metrics.read_text().splitlines() if x.strip()):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    subprocess.run(argv + ["--resume"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    event = next(r for r in map(json.loads, metrics.read_text().splitlines())
                 if r.get("event") == "resume")
    print(f"SIGKILL after step {kill_after} with --checkpoint-every {every}: resumed from step "
          f"{event['resumed_from_step']}, {event['last_logged_step'] - event['resumed_from_step']} "
          f"step(s) of work lost (expected about every/2 = {every / 2:g} on average, at most "
          f"{every} + the steps of a save still in flight)")


def main() -> None:
    args = _parser().parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshtron-ckpt-bench-"))
    try:
        bench_saves(args, work)
        if args.ranks:
            bench_ranks(args, work)
        if args.kill:
            bench_kill(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
