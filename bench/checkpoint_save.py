"""Checkpoint cost: how long training is blocked per save, asynchronous vs synchronous.

One process, one model, one optimizer state (after a real training step), the same Checkpointer
that `meshtron train --checkpoint-every` uses, alternating rounds (sync, async, sync, ...) so
machine noise (other jobs on a shared box) hits both alike:

  sync   `save(step, blocking=True)`: stage, write every shard, checksum, commit, then return.
  async  `save(step)`: stage to host memory and return; the write, checksum and commit run on the
         background thread (its total time is reported too, and the train steps that ran while
         it was in flight, against steps with nothing in flight).

Printed: median blocking seconds of each and their ratio (goal <= 0.1), save and load
throughput (MB/s of checkpoint files), the cost of each checksum algorithm (MB/s, and as a share
of a synchronous save), and with --kill the steps of work lost when a run is SIGKILLed between
checkpoints (real process, real signal, then --resume).

    .venv/bin/python bench/checkpoint_save.py                 # ~12M-parameter model, 4 rounds
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

import torch

from meshtron.checkpoint import CheckpointConfig, store
from meshtron.checkpoint.checkpointer import Checkpointer
from meshtron.config import config_from_dict
from meshtron.train.loop import LocalEngine, build_run_data


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


def bench_saves(args, work: Path) -> None:
    cfg = config_from_dict({
        "model": {"preset": "tiny", "hidden": args.hidden, "layers": args.layers,
                  "ffn_hidden": int(args.hidden * 8 / 3) // 8 * 8},
        "data": {"seq_len": 64, "global_batch": 4},
        "train": {"steps": 1000, "eval_every": 0, "run_dir": str(work / "run")}})
    torch.set_num_threads(1)
    data = build_run_data(cfg)
    engine = LocalEngine(cfg)

    def step():
        t0 = time.perf_counter()
        engine.train_step(*data.next_batch())
        return time.perf_counter() - t0

    step()  # optimizer states exist from here on
    ck = Checkpointer(CheckpointConfig(every=1, keep=2), cfg, engine, data, work / "run")
    ck.start()
    baseline = [step() for _ in range(3)]
    sync_s, async_s, async_total, during = [], [], [], []
    n = 1
    for _ in range(args.rounds):
        for mode in ("sync", "async"):
            n += 1
            if mode == "sync":
                sync_s.append(ck.save(n, blocking=True))
                continue
            t0 = time.perf_counter()
            async_s.append(ck.save(n))
            while ck._inflight is not None and not ck._inflight.done():
                during.append(step())
            ck.wait()
            async_total.append(time.perf_counter() - t0)
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
          f"({len(list(folder.iterdir()))} files); {args.rounds} rounds each")
    print(f"{'':34}{'sync':>12}{'async':>12}{'async/sync':>12}")
    print(f"{'blocking s per save (median)':34}{med(sync_s):12.3f}{med(async_s):12.3f}"
          f"{med(async_s) / med(sync_s):12.3f}")
    print(f"{'save to commit s (median)':34}{med(sync_s):12.3f}{med(async_total):12.3f}"
          f"{med(async_total) / med(sync_s):12.3f}")
    print(f"save throughput (sync, write+checksum+commit): {_rate(nbytes, med(sync_s))}")
    print(f"load throughput (verify {verify_s:.3f} s + DCP load into the model, optimizer): "
          f"{_rate(nbytes, load_s)}  [{load_s:.3f} s; checksums ok: {problem is None}]")
    if during:
        print(f"train step while a save is in flight: {med(during):.3f} s vs {med(baseline):.3f} "
              f"s with none (x{med(during) / med(baseline):.2f}; {len(during)} steps)")
    costs = _checksum_costs(folder)
    for name, secs in costs.items():
        print(f"checksum {name:8}: {_rate(nbytes, secs)}  = {secs / med(sync_s) * 100:5.1f}% of "
              "a synchronous save")


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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kill", action="store_true", help="also measure steps lost after SIGKILL")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshtron-ckpt-bench-"))
    try:
        bench_saves(args, work)
        if args.kill:
            bench_kill(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
