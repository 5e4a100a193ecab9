"""The rank side of `testkit.multiproc.run_on_ranks`: what one rank process runs, whether it is a
fresh interpreter (`python -m testkit.rank_child TMPDIR RANK WORLD_SIZE PARENT_PID`) or a child
forked from a fork server (testkit/zygote.py). Its own module so that the launcher
(multiproc) and the fork server (zygote) both import it and neither imports the other back.

The launch folder holds `payload.pkl` ({fn, args, kwargs, backend}) and `sys_path.json` from the
parent; the rank writes `result<RANK>.pkl` as ("ok", value) or ("error", traceback, time).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _write_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the launching process is gone (killed test runner): no orphaned ranks left
    waiting in a collective forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(4)


def child_main(tmpdir: str, rank: int, world_size: int, parent_pid: int) -> None:
    import faulthandler
    import threading
    import traceback

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # a fatal signal (gloo's abort, a segfault) prints every thread's Python stack into the
    # rank's log, which RankError shows first
    faulthandler.enable(all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    tdir = Path(tmpdir)
    result_path = tdir / f"result{rank}.pkl"
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1"})
    ok = False
    try:
        # The parent's sys.path first, so fn's module (e.g. a pytest test module) imports here
        # as it did there; unpickling fn imports its module.
        for entry in reversed(json.loads((tdir / "sys_path.json").read_text())):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        data = pickle.loads((tdir / "payload.pkl").read_bytes())
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(str(tdir / "store"), world_size)
        backend = data.get("backend", "gloo")
        if backend == "recorded":
            from meshtron.runtime import cpu_backend

            backend = cpu_backend(record=True)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        value = data["fn"](*data["args"], **data["kwargs"])
        _write_atomic(result_path, ("ok", value))
        ok = True
    except BaseException:
        _write_atomic(result_path, ("error", traceback.format_exc(), time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    if not ok:
        os._exit(1)
    try:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    os._exit(0)


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
