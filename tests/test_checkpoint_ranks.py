"""Checkpoints on real gloo ranks (testkit/multiproc.py): bit-identical resume of a
pipeline run, a SIGTERM delivered to one rank alone, and resumes on other layouts (pp=2 -> one
process, ZeRO-1 -> ZeRO-3), all in two launches of two ranks. Also who hashes what: at a save
each rank hashes only the files it wrote, off the training thread; on resume each rank re-hashes
its share, and the shares cover the checkpoint once.

The command-line scenarios with torchrun (SIGKILL + --max-restarts, SIGTERM to the launcher,
4-rank layout changes) are in tests/test_checkpoint_cli.py (slow).
"""

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint import CheckpointConfig, load_full_state_dict, store
from meshtron.config import config_from_dict
from testkit.multiproc import run_on_ranks
from meshtron.train.loop import train

STEPS = 4


def _cfg(run_dir):
    return config_from_dict({"model": "debug", "data": {"seq_len": 32, "global_batch": 8},
                             "train": {"steps": STEPS, "eval_every": 0,
                                       "run_dir": str(run_dir)}})


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl")
                                                .read_text().splitlines()) if "step" in r]


def _sigterm_self_at(batch: int) -> None:
    """Send this process SIGTERM when it fetches its `batch`-th training batch (mid-run, from
    inside: only this rank gets the signal)."""
    from meshtron.data.dataset import TrainLoader

    original, calls = TrainLoader.next_batch, [0]

    def next_batch(self):
        calls[0] += 1
        if calls[0] == batch:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    TrainLoader.next_batch = next_batch


def _record_hashing(log):
    """Append (run, folder, file, on the training thread) for every checksum this rank computes."""
    original = store.file_digest

    def file_digest(path, *args, **kwargs):
        path = Path(path)
        log.append((path.parent.parent.parent.name, path.parent.name, path.name,
                    threading.current_thread() is threading.main_thread()))
        return original(path, *args, **kwargs)

    store.file_digest = file_digest


def _jobs(jobs):
    """Rank body: run each (run_dir, layout, zero, every, resume, sigterm_at) job in turn."""
    from meshtron.checkpoint.checkpointer import Preempted
    from meshtron.launch import current_world
    from meshtron.train.job import ParallelRequest
    from meshtron.train.parallel import train_on_rank
    from meshtron.train.planning import fixed_knobs, resolve_run_plan

    world = current_world()
    out, hashed = [], []
    _record_hashing(hashed)
    for run_dir, layout, zero, every, resume, sigterm_at in jobs:
        cfg = _cfg(run_dir)
        request = ParallelRequest(plan=layout, nproc=world.world_size,
                                  knobs=fixed_knobs(layout, zero, None, None, None, None))
        plan, cluster = resolve_run_plan(cfg, request, world.world_size)
        if sigterm_at and world.rank == 1:
            _sigterm_self_at(sigterm_at)
        try:
            train_on_rank(cfg, plan, world, torch.device("cpu"), cluster, show_progress=False,
                          checkpoint=CheckpointConfig(every=every, resume=resume))
            out.append(("done", plan.layout(), plan.zero))
        except Preempted as exc:
            out.append(("preempted", exc.step))
    return out, hashed


def _close(got, want, rel=1e-5):
    assert [s for s, _ in got] == [s for s, _ in want]
    for (s, a), (_, b) in zip(got, want):
        assert abs(a - b) <= rel * abs(b), (s, a, b)


def test_multirank_resume_exact_preemption_and_other_layouts(tmp_path, capfd):
    pp, term = tmp_path / "pp2", tmp_path / "term"
    first = run_on_ranks(_jobs, 2, [(pp, "pp=2", None, 2, False, None),
                                    (term, "dp=2", 1, 100, False, 3)], timeout=300)
    saves = [h for _, h in first]
    first = [r for r, _ in first]
    # Saving: each rank hashed exactly the files it wrote, on its background thread.
    for rank, hashed in enumerate(saves):
        assert hashed and not any(main for *_, main in hashed), hashed
        for run, folder, name, _ in hashed:
            assert folder.startswith(store.TMP_PREFIX)
            assert name in (f"rank_{rank}.json", *((".metadata", "meta.json") if rank == 0
                                                   else ())) or name.startswith(f"__{rank}_")
    for folder in store.checkpoint_root(pp).iterdir():  # and together: every file, once
        if folder.name.startswith("step_"):
            names = [n for run, f, n, _ in saves[0] + saves[1] if (run, f) == (
                "pp2", store.TMP_PREFIX + folder.name)]
            manifest = json.loads((folder / store.MANIFEST).read_text())["files"]
            assert sorted(names) == sorted(manifest)
    # Rank 1 alone got SIGTERM while fetching step 3's batch: both ranks finished step 3, agreed,
    # committed one checkpoint and stopped.
    assert [r[1] for r in first] == [("preempted", 3)] * 2
    assert json.loads((store.checkpoint_root(term) / store.PREEMPTED).read_text())["step"] == 3
    assert [s for s, _ in store.committed(store.checkpoint_root(term))] == [3]
    assert first[0][0][1:] == ("tp=1,pp=2,dp=1", 0)

    again = tmp_path / "pp2-again"
    shutil.copytree(pp, again)
    root = store.checkpoint_root(again)
    shutil.rmtree(root / "step_00000004")  # as if killed after step 3
    # A flipped byte (same size) in a file of rank 1's verification share of step 4: only
    # rank 1's checksum can see it, and every rank must then fall back to step 2.
    damaged = tmp_path / "pp2-damaged"
    shutil.copytree(pp, damaged)
    newest = store.checkpoint_root(damaged) / "step_00000004"
    files = json.loads((newest / store.MANIFEST).read_text())["files"]
    victim = newest / max(store.share(files, 1, 2), key=lambda n: files[n]["bytes"])
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    second = run_on_ranks(_jobs, 2, [(again, "pp=2", None, 2, True, None),
                                     (term, "dp=2", 3, 2, True, None),
                                     (damaged, "pp=2", None, 2, True, None)], timeout=300)
    # Resuming: the ranks re-hashed disjoint shares of the chosen checkpoint that cover it.
    shares = [{n for run, f, n, main in h if main and (run, f) == ("pp2-again", "step_00000002")}
              for _, h in second]
    manifest = json.loads((root / "step_00000002" / store.MANIFEST).read_text())["files"]
    assert all(shares) and not shares[0] & shares[1] and shares[0] | shares[1] == set(manifest)
    second = [r for r, _ in second]
    assert second[0][1] == ("done", "tp=1,pp=1,dp=2", 3)
    resumed = [json.loads(x) for x in (damaged / "metrics.jsonl").read_text().splitlines()]
    assert [r["resumed_from_step"] for r in resumed if r.get("event") == "resume"] == [2]
    assert _losses(damaged) == _losses(pp)
    # Same layout: bit-identical losses and final parameters + optimizer state.
    assert _losses(again) == _losses(pp)
    want, got = (load_full_state_dict(d, optimizer=True) for d in (pp, again))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    # Another layout follows the uninterrupted run to float tolerance, data position included:
    # ZeRO-1 (dp=2) preempted at step 3, resumed as ZeRO-3; each step logged once. (Each layout
    # equals the single-process run: tests/test_parallel.py.)
    reference = _losses(pp)
    _close(_losses(term), reference)
    events = [json.loads(x) for x in (term / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if "event" in e] == ["preempted", "resume"]
    # pp=2 on 2 ranks -> one process (the loop's resume path, no process group).
    single = tmp_path / "pp2-single"
    shutil.copytree(pp, single)
    shutil.rmtree(store.checkpoint_root(single) / "step_00000004")
    train(_cfg(single), show_progress=False, checkpoint=CheckpointConfig(every=2, resume=True))
    _close(_losses(single), reference)
    assert "layout tp=1 pp=2 dp=1" in capfd.readouterr().err
