"""Run a function on N real processes joined by a gloo process group (CPU), for tests.

    results = run_on_ranks(fn, world_size, *args, timeout=120, **kwargs)

`fn(*args, **kwargs)` runs once per rank, in its own new process (forked from rank r's fork
server, which imported torch once per test run: testkit/zygote.py; a fresh interpreter where
that cannot run or MESHTRON_TEST_FRESH_RANKS=1), after
`torch.distributed.init_process_group("gloo")` over a FileStore in a private temporary
directory (no ports to race for). `fn` must be importable by the child: a module-level
function of an importable module (a pytest test module works: the parent's `sys.path` is
handed to the child). The return values (picklable) come back as a list indexed by rank.

Failure: if a rank raises, the other ranks get a short grace period and are then killed, and
the parent raises `RankError` whose message holds the failing rank's traceback text (and the
tail of its stderr). A rank that dies without a Python traceback (signal, `os._exit`) is
reported with its exit code and stderr tail.

Timeout: after `timeout` seconds the unfinished ranks get SIGUSR1 (their `faulthandler` then
prints every thread's Python stack to stderr), then are killed; `RankTimeout` names the ranks
that did not finish and shows the stack each was stuck in.

A rank exits by itself when the launching process disappears (no orphans after a killed test
run). A rank that returned but then failed in teardown still counts as successful (its result
was written); the teardown below makes that rare.

Each rank: `torch.set_num_threads(1)` (more threads than cores is 20-50x slower), env
RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE set, and on success teardown is barrier +
`destroy_process_group()` + `os._exit(0)`, which avoids the SIGABRT at interpreter shutdown
that gloo + FSDP2 sometimes produce.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_on_ranks", "RankError", "RankTimeout"]

_GRACE_AFTER_FAILURE_S = 3.0
_STACK_DUMP_WAIT_S = 1.5
_TAIL_CHARS = 4000


class RankError(RuntimeError):
    """A rank raised (or died); the message carries its traceback."""

    def __init__(self, message: str, failed_ranks: list[int]):
        super().__init__(message)
        self.failed_ranks = failed_ranks


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout."""

    def __init__(self, message: str, hung_ranks: list[int]):
        super().__init__(message)
        self.hung_ranks = hung_ranks


def _tail(path: Path, n: int = _TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                 env: dict[str, str] | None = None, backend: str = "gloo",
                 **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the results by rank.
    `backend="recorded"`: the ranks join meshtron doctor's recording gloo process group, as
    `meshtron train` ranks do (meshtron/doctor/backend.py).

    Raises RankError when a rank fails (with its traceback), RankTimeout when ranks are still
    running after `timeout` seconds (naming them, with their stacks).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive integer")
    if getattr(fn, "__module__", None) in (None, "__main__") or "<locals>" in getattr(
            fn, "__qualname__", "<locals>"):
        raise ValueError(f"fn={fn!r}: must be a module-level function of an importable module")
    with tempfile.TemporaryDirectory(prefix="meshtron-ranks-") as tmp:
        tmpdir = Path(tmp)
        payload = tmpdir / "payload.pkl"
        payload.write_bytes(pickle.dumps({"fn": fn, "args": args, "kwargs": kwargs,
                                          "backend": backend}))
        (tmpdir / "sys_path.json").write_text(json.dumps([p for p in sys.path if p]))
        child_env = dict(os.environ)
        child_env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                          "PYTHONFAULTHANDLER": "1"})
        pkg_root = str(Path(__file__).resolve().parents[2])
        child_env["PYTHONPATH"] = os.pathsep.join(
            [pkg_root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if env:
            child_env.update(env)
        procs: list = []
        logs = []
        try:
            procs = _fork(tmpdir, world_size, child_env) or []
            for rank in range(len(procs), world_size):
                out = open(tmpdir / f"rank{rank}.log", "wb")
                logs.append(out)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "testkit.rank_child", str(tmpdir), str(rank),
                     str(world_size), str(os.getpid())],
                    stdout=out, stderr=subprocess.STDOUT, env=child_env,
                    start_new_session=True))
            return _wait(procs, tmpdir, world_size, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill(p)
            for out in logs:
                out.close()


def _fork(tmpdir: Path, world_size: int, env: dict[str, str]):
    """The ranks forked from the fork servers (testkit/zygote.py: torch imported once per test
    run, not once per rank), or None: then fresh interpreters. MESHTRON_TEST_FRESH_RANKS=1
    always starts fresh interpreters."""
    if os.environ.get("MESHTRON_TEST_FRESH_RANKS") == "1":
        return None
    from testkit import zygote

    return zygote.spawn_ranks(str(tmpdir), world_size, env,
                              str(Path(__file__).resolve().parents[1]))


def _kill(p: subprocess.Popen) -> None:
    try:
        p.kill()
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _read_result(tmpdir: Path, rank: int):
    path = tmpdir / f"result{rank}.pkl"
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _wait(procs, tmpdir: Path, world_size: int, timeout: float) -> list[Any]:
    def poll() -> tuple[list[int], list[int]]:
        """(ranks still running, ranks that ended without an 'ok' result)."""
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code is not None
                  and (_read_result(tmpdir, rank) or ("",))[0] != "ok"]
        return [r for r, c in enumerate(codes) if c is None], failed

    deadline = time.monotonic() + timeout
    first_failure_at = None
    while True:
        running, failed = poll()
        if failed and first_failure_at is None:
            first_failure_at = time.monotonic()
        if not running:
            break
        if first_failure_at is not None and time.monotonic() - first_failure_at > _GRACE_AFTER_FAILURE_S:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)

    running, failed = poll()
    if running:
        # Ask the stuck ranks for their stacks (faulthandler is registered on SIGUSR1).
        for r in running:
            try:
                procs[r].send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(_STACK_DUMP_WAIT_S)
        for r in running:
            _kill(procs[r])
    if failed:
        # Root cause first: a rank that died without a traceback (a signal: a gloo abort, a
        # segfault; its peers then raise "Connection closed by peer"), then the ranks that
        # raised, earliest first.
        def when(rank):
            res = _read_result(tmpdir, rank)
            return res[2] if res is not None and res[0] == "error" else float("-inf")

        failed.sort(key=when)
        parts = []
        for rank in failed:
            res = _read_result(tmpdir, rank)
            if res is not None and res[0] == "error":
                parts.append(f"--- rank {rank} raised:\n{res[1]}")
            else:
                parts.append(f"--- rank {rank} died with exit code {procs[rank].poll()} and no Python "
                             f"traceback; output tail:\n{_tail(tmpdir / f'rank{rank}.log')}")
        also = f" (ranks {running} were still running and were killed)" if running else ""
        raise RankError(f"{len(failed)} of {world_size} ranks failed{also}; first failure "
                        f"first:\n" + "\n".join(parts), failed)
    if running:
        hung = [r for r in running if _read_result(tmpdir, r) is None]
        teardown = [r for r in running if r not in hung]
        parts = [f"--- rank {r} output tail (stack dump at timeout):\n"
                 f"{_tail(tmpdir / f'rank{r}.log')}" for r in hung]
        extra = (f" (ranks {teardown} returned but were waiting for the others in teardown)"
                 if teardown else "")
        raise RankTimeout(f"timeout after {timeout:.0f}s: ranks {hung or running} of {world_size} "
                          f"did not finish{extra}:\n" + "\n".join(parts), hung or running)
    results = []
    for rank in range(world_size):
        res = _read_result(tmpdir, rank)
        results.append(res[1])
    return results
