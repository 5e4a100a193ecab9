"""Fault injection for tests/test_checkpoint_cli.py (on PYTHONPATH only in those tests' child
processes): with MESHTRON_TEST_SLOW_WRITE_S=S, every checkpoint shard write of DCP's
FileSystemWriter first sleeps S seconds, so that a test can SIGKILL a run while an asynchronous
save is still in flight (nothing else about the save changes)."""

import os

_SLOW = os.environ.get("MESHTRON_TEST_SLOW_WRITE_S")

if _SLOW:
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    _write_data = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(float(_SLOW))
        return _write_data(self, plan, planner)

    FileSystemWriter.write_data = write_data
