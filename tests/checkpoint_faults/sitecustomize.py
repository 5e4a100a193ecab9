"""Fault injection for tests/test_checkpoint_cli.py (on PYTHONPATH only in those tests' child
processes): with MESHTRON_TEST_SLOW_WRITE_S=S, every checkpoint shard write of DCP's
FileSystemWriter first sleeps S seconds, so that a test can SIGKILL a run while an asynchronous
save is still in flight (nothing else about the save changes)."""

import os
import sys

_SLOW = os.environ.get("MESHTRON_TEST_SLOW_WRITE_S")

# not in the launcher under testkit.no_torch (it writes no checkpoint, and its guard refuses a
# torch imported at start-up: test_survive_causes' preemption-save test failed on that)
if _SLOW and "testkit.no_torch" not in sys.orig_argv[:3]:
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    _write_data = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(float(_SLOW))
        return _write_data(self, plan, planner)

    FileSystemWriter.write_data = write_data

# With MESHTRON_TEST_SLOW_PREEMPT_RANK=R: rank R, once its preemption checkpoint is written,
# takes 3 s more before it records the preemption (a slow disk for metrics.jsonl), so that its
# peers finish their part of the preemption well before it does.
if os.environ.get("RANK") and os.environ.get("RANK") == os.environ.get(
        "MESHTRON_TEST_SLOW_PREEMPT_RANK"):
    import time

    from meshtron.checkpoint import checkpointer

    _append = checkpointer.history.append

    def append(path, record):
        if record.get("event") == "preempted":
            time.sleep(3.0)
        return _append(path, record)

    checkpointer.history.append = append
