"""Releasing a mesh: `release_mesh` destroys the process groups `build_mesh` made, so a process
that builds one layout after another (the equivalence sweep, an API user trying layouts) keeps
a flat thread count instead of accumulating every earlier layout's backend threads."""

from testkit.equivalence import DEFAULT_CFG, parallel_rank_fn
from testkit.multiproc import run_on_ranks

# The same layouts twice: the second build of a mesh equal to a released one must not meet the
# released mesh again through torch's caches (DTensor sharding propagation).
# TP runs 2 micro-batches of 4 rows (the threads and caches are the mesh's, not the batch's;
# 8 micro-batches of one row cost ~0.4 s each per rank in DTensor's CPU dispatch).
LAYOUTS = [dict(dp=2, zero=3), dict(tp=2, sp=True, micro_batch=4), dict(dp=2, zero=3),
           dict(tp=2, sp=True, micro_batch=4)]


def _threads_rank_fn(cfg):
    released = parallel_rank_fn(cfg, LAYOUTS, release=True)
    kept = parallel_rank_fn(cfg, LAYOUTS, release=False)
    return ([r["threads"] for r in released], [r["threads"] for r in kept],
            [r["losses"] for r in released], [r["losses"] for r in kept])


def test_released_meshes_leave_no_threads_behind():
    cfg = dict(DEFAULT_CFG, steps=1)
    for released, kept, losses_r, losses_k in run_on_ranks(_threads_rank_fn, 2, cfg,
                                                           timeout=300):
        # The same layout twice: the same thread count when released, more when kept.
        assert released[2] == released[0] and released[3] == released[1], released
        assert kept[2] > kept[0] and kept[3] > kept[1], kept
        assert losses_r == losses_k  # releasing changes nothing numerically
