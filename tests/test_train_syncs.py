"""No host synchronisation per micro-batch in the training step (issue 31).

Runs `meshtron train` in-process (its defaults: recorder, watchdog, chunked loss, clipping;
gradient accumulation over 4 micro-batches) under testkit's sync detector, and asserts that the
training loop's only host reads are the logging points' one read (`read_values`) and the
evaluation's mean. A new read anywhere below the loop fails with its stack."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.model.moe import GroupedExperts
from testkit.syncs import SyncDetector

STEPS, LOG_EVERY = 3, 3
LOG_POINTS = 2  # steps 1 and 3 (the first, every LOG_EVERY-th, the last): step 2 logs nothing
EVAL_BATCHES = 2  # one read per evaluation, not per batch: 2 batches tell them apart


def _train(tmp_path, *extra: str) -> SyncDetector:
    args = ["train", "--model", "debug", "--steps", str(STEPS), "--seq-len", "32",
            "--global-batch", "8", "--micro-batch", "2", "--log-every", str(LOG_EVERY),
            "--eval-every", str(STEPS), "--set", f"data.eval_batches={EVAL_BATCHES}",
            "--run-dir", str(tmp_path / "run"), *extra]
    with SyncDetector() as detector:
        assert main(args) == 0
    return detector


def _expect(detector: SyncDetector, allowed: Counter) -> None:
    found = detector.sites(within="_run_steps")
    assert found == allowed, "host syncs in the training loop:\n" + detector.report("_run_steps")


PER_LOG_POINT = Counter({("Tensor.tolist", "meshtron/train/loop.py:read_values"): LOG_POINTS,
                         ("float(tensor)", "meshtron/train/loop.py:evaluate"): 1})


# Slow (suite time, session 56): the one-process MoE run below is this loop with every dense
# piece but the feed-forward (attention, chunked loss, clipping, AdamW, logging, evaluation;
# the same allowed reads plus the router's), and test_parallel_steps_read_the_host_only_at_logging_points
# trains the dense debug model (its SwiGLU feed-forward) under the detector at pp=2.
@pytest.mark.slow
def test_dense_step_reads_the_host_only_at_logging_points(tmp_path):
    _expect(_train(tmp_path), PER_LOG_POINT)


def test_moe_step_reads_the_host_only_at_logging_points(tmp_path, monkeypatch):
    # The kernel a CUDA bf16 run uses (the CPU fallback loops over experts, reading counts).
    monkeypatch.setattr(GroupedExperts, "kernel", "grouped")
    detector = _train(tmp_path, "--model", "tiny-moe", "--dtype", "bf16")
    _expect(detector, PER_LOG_POINT + Counter(
        {("Tensor.tolist", "meshtron/train/router.py:router_record"): LOG_POINTS}))


def test_detector_sees_what_cuda_would_wait_for():
    import torch

    x = torch.arange(6.0) - 2
    with SyncDetector() as d:
        float(x.sum()), bool(x[0] > 0), x.tolist()
        x[x > 0], torch.bincount(x.long().clamp(min=0)), torch.repeat_interleave(x.long().abs())
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized: no sync
        x * 2, x.sum()  # no reads
        x[x > 5] = 0  # a host scalar through a mask: ATen runs masked_fill_, no sync
    ops = [op for op, _ in d.sites()]
    assert ops == ["float(tensor)", "bool(tensor)", "Tensor.tolist", "aten.index.Tensor",
                   "aten.bincount", "aten.repeat_interleave.Tensor"]


PAR_STEPS = 6  # torch's set-up reads (4 DeviceMesh reads on pp=2, seen at 4 steps) under one a step


def _ranks_body(base: str, layout: str, model: str) -> tuple[dict, str, int]:
    """Rank body: train `layout` under the detector; (op, site, torch-internal?) -> count within
    the loop, and the number of MoE layer forwards this rank ran."""
    import torch

    from meshtron.config import config_from_dict
    from meshtron.launch import current_world
    from meshtron.train.job import ParallelRequest
    from meshtron.train.parallel import train_on_rank
    from meshtron.train.planning import fixed_knobs, resolve_run_plan

    GroupedExperts.kernel = "grouped"  # the CUDA bf16 kernel (this rank process only)
    world = current_world()
    cfg = config_from_dict({
        "model": model, "data": {"seq_len": 32, "global_batch": 8, "micro_batch": 2,
                                 "eval_batches": 1},
        # no evaluation: torch's pipeline warm-up reruns at every train/eval switch, which would
        # blur "once per run" into "once per evaluation"
        "train": {"steps": PAR_STEPS, "eval_every": 0, "log_every": 3, "dtype": "bf16",
                  "run_dir": str(Path(base) / layout.replace(",", "_"))}})
    request = ParallelRequest(plan=layout, nproc=world.world_size,
                              knobs=fixed_knobs(layout, None, None, None, 2, None))
    plan, cluster = resolve_run_plan(cfg, request, world.world_size)
    from meshtron import doctor

    # the rank's doctor session, as `meshtron train` starts it (heartbeat, watchdog, recorder)
    doctor.start(cfg.train.run_dir, world.rank, world.world_size, recorder=True)
    try:
        with SyncDetector() as detector:
            train_on_rank(cfg, plan, world, torch.device("cpu"), cluster, show_progress=False)
    finally:
        doctor.stop()
    found = {}
    for s in detector.reads("_run_steps"):
        key = f"{s.op}|{s.site}|{'torch' if 'meshtron/' not in s.inner else 'ours'}"
        found[key] = found.get(key, 0) + 1
    # MoE layer forwards: one dispatcher read each (the documented per-layer split sizes)
    calls = sum(1 for s in detector.reads("_run_steps")
                if s.site == "meshtron/parallel/expert.py:__call__")
    return found, detector.report("_run_steps"), calls


def _check_ranks(found: dict, report: str, moe: bool) -> None:
    allowed = {"Tensor.tolist|meshtron/train/loop.py:read_values|ours": 3}  # steps 1, 3, 6
    if moe:
        allowed["Tensor.tolist|meshtron/train/router.py:router_record|ours"] = 3
    ours = {k: n for k, n in found.items() if k.endswith("|ours")
            and "parallel/expert.py:__call__" not in k}
    assert ours == allowed, "host syncs in the training loop:\n" + report
    # torch's own reads (pipeline warm-up per schedule and train/eval switch, a DeviceMesh
    # slice on first use) are set-up: fewer than one per step, never per micro-batch
    per_step = {k: n for k, n in found.items() if k.endswith("|torch") and n >= PAR_STEPS}
    assert not per_step, f"per-step reads inside torch: {per_step}\n{report}"


def test_parallel_steps_read_the_host_only_at_logging_points(tmp_path):
    """pp=2 (dense) and dp=2 x ep=2 (MoE, the expert all-to-all) on gloo, 2 ranks each."""
    from testkit.multiproc import run_on_ranks

    for layout, model in (("pp=2", "debug"), ("dp=2,ep=2", "tiny-moe")):
        results = run_on_ranks(_ranks_body, 2, str(tmp_path), layout, model, timeout=300)
        for found, report, calls in results:
            _check_ranks(found, report, moe=model != "debug")
            # the dispatcher's split sizes: exactly one read per MoE layer forward
            forwards = PAR_STEPS * 2 * 4  # 2 micro-batches per step and rank, 4 MoE layers
            assert calls == (forwards if model != "debug" else 0), \
                f"{calls} dispatcher reads for {forwards} MoE layer forwards\n{report}"


def test_batch_to_device_leaves_a_host_batch_alone_on_cpu():
    """The CPU branch of the batch copy: no page-locking (CPU has none) and no copy; the CUDA
    branch (pin, then one asynchronous copy) needs a GPU: bench/gpu_check's train step."""
    import torch

    from meshtron.runtime import batch_to_device

    batch = torch.arange(12).view(3, 4)
    assert batch_to_device(batch, torch.device("cpu")) is batch
    assert not batch.is_pinned()


def test_batch_bound_for_cuda_is_page_locked_first():
    """The CUDA branch of the batch copy, run on CPU with the page-locking kernel injected: a
    pageable host batch bound for a GPU is page-locked once (then copied asynchronously);
    a batch bound for the CPU, or already on a device, is not."""
    import torch

    from meshtron.runtime import copy_source

    locked = []

    def pin(t):
        locked.append(t)
        return t.clone()

    batch = torch.arange(12).view(3, 4)
    staged = copy_source(batch, torch.device("cuda", 1), pin)
    assert locked == [batch] and staged is not batch and torch.equal(staged, batch)
    assert copy_source(batch, torch.device("cpu"), pin) is batch
    on_device = torch.empty(3, 4, device="meta")
    assert copy_source(on_device, torch.device("cuda", 1), pin) is on_device
    assert len(locked) == 1
