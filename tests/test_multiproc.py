"""The multi-process test harness: real gloo process groups in real processes."""

import time

import pytest

from testkit.multiproc import RankError, RankTimeout, run_on_ranks


def _all_reduce(base):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(base + dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _broadcast(src):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.broadcast(t, src=src)
    return rank, dist.get_world_size(), t.tolist(), torch.get_num_threads()


def _fail_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the healthy rank waits here for the failed one; it must be killed
    return "unreachable"


def _hang_on_rank(bad_rank):
    import torch.distributed as dist

    dist.barrier()  # both ranks started: the one that returns proves the other is in the hang
    if dist.get_rank() == bad_rank:
        time.sleep(600)
    return dist.get_rank()


def test_all_reduce_two_ranks():
    assert run_on_ranks(_all_reduce, 2, 10, timeout=300) == [21.0, 21.0]


def test_broadcast_four_ranks():
    results = run_on_ranks(_broadcast, 4, src=2, timeout=300)
    for rank, (r, ws, values, threads) in enumerate(results):
        assert (r, ws, threads) == (rank, 4, 1)
        assert values == [0.0, 3.0, 6.0, 9.0]


def test_failure_propagates_with_traceback():
    with pytest.raises(RankError) as info:
        run_on_ranks(_fail_on_rank, 2, 1, timeout=300)
    text = str(info.value)
    assert info.value.failed_ranks[0] == 1  # root cause first; rank 0 may fail after it
    assert text.index("--- rank 1 raised") < text.find("--- rank 0") or "--- rank 0" not in text
    assert "deliberate failure on rank 1" in text
    assert "_fail_on_rank" in text  # the child's traceback, not just the message


def test_timeout_names_hung_rank():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        # The test controls the hang: the timeout only has to cover two ranks' start-up
        # (~3 s on an idle 2-core machine); waiting longer proves nothing more.
        run_on_ranks(_hang_on_rank, 2, 0, timeout=8)
    assert time.monotonic() - start < 60
    hung = info.value.hung_ranks
    assert 0 in hung
    if hung == [0]:  # on a badly overloaded machine rank 1 may not have started in time
        assert "ranks [0] of 2 did not finish" in str(info.value)
        assert "_hang_on_rank" in str(info.value)  # the stack dumped at timeout


def test_rejects_local_function():
    def local():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        run_on_ranks(local, 2)
