"""No host synchronisation per micro-batch in the training step (issue 31).

Runs `meshtron train` in-process (its defaults: recorder, watchdog, chunked loss, clipping;
gradient accumulation over 4 micro-batches) under testkit's sync detector, and asserts that the
training loop's only host reads are the logging points' one read (`read_values`) and the
evaluation's mean. A new read anywhere below the loop fails with its stack."""

from __future__ import annotations

from collections import Counter

from meshtron.cli import main
from meshtron.model.moe import GroupedExperts
from testkit.syncs import SyncDetector

STEPS, LOG_EVERY = 4, 2
LOG_POINTS = 3  # steps 1, 2 and 4 (the first, every LOG_EVERY-th, the last)


def _train(tmp_path, *extra: str) -> SyncDetector:
    args = ["train", "--model", "debug", "--steps", str(STEPS), "--seq-len", "32",
            "--global-batch", "8", "--micro-batch", "2", "--log-every", str(LOG_EVERY),
            "--eval-every", str(STEPS), "--run-dir", str(tmp_path / "run"), *extra]
    with SyncDetector() as detector:
        assert main(args) == 0
    return detector


def _expect(detector: SyncDetector, allowed: Counter) -> None:
    found = detector.sites(within="_run_steps")
    assert found == allowed, "host syncs in the training loop:\n" + detector.report("_run_steps")


PER_LOG_POINT = Counter({("Tensor.tolist", "meshtron/train/loop.py:read_values"): LOG_POINTS,
                         ("float(tensor)", "meshtron/train/loop.py:evaluate"): 1})


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
