"""Fork servers for `run_on_ranks`: rank r of every launch is forked from zygote r, a process
that imported torch once per test run.

A rank started with `python -m testkit.rank_child` spends 2-4 s of CPU importing torch and its
distributed packages before it reaches `init_process_group`; the default suite starts ~130
ranks on 2 cores. A zygote imports them once (`PRELOAD`) and forks a rank per request: the
child is a new process (its own pid, session, environment, log file, process group and gloo
threads, all made after the fork) that runs exactly `testkit.rank_child.child_main`, as the
fresh interpreter would.

Safe to fork: the zygote runs no torch operation and starts no thread (it checks that it has
one thread after the imports and refuses requests otherwise; `multiproc` then starts fresh
interpreters), so no lock or thread pool is copied half-held. Python's `random` reseeds itself
in a forked child; torch's generators are the untouched defaults of a fresh import.

Protocol (lines on stdin/stdout): the parent writes a JSON request {tmpdir, rank, world_size,
env, cwd, log}; the zygote answers with the child's pid (or "error ..."). When a
child ends, the zygote writes its exit code (as `Popen.returncode`: -N for signal N) to
`tmpdir/exit<rank>`. The zygote leaves when stdin closes (the test run ended or died); its
ranks follow within a second (they watch their parent, `rank_child._watch_parent`).
"""

from __future__ import annotations

import json
import os
import select
import sys

PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining",
           # what test modules import when a rank unpickles its function (meshtron reads no
           # environment at import: tests/test_no_torch_patching.py imports all of it)
           "numpy", "pytest", "meshtron.parallel", "meshtron.model.transformer")

_children: dict[int, str] = {}  # pid -> its exit-code file


def _reap() -> None:
    while _children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = _children.pop(pid, None)
        if path is not None:
            tmp = path + ".tmp"
            try:
                with open(tmp, "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, path)
            except OSError:  # the launch's folder is gone: nobody waits for this rank
                pass


def _become_rank(req: dict) -> None:
    """In the forked child: a new session, the request's environment, cwd and log; then the
    rank's body. Never returns (`child_main` ends in os._exit)."""
    try:
        os.setsid()
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        from testkit.rank_child import child_main

        child_main(req["tmpdir"], req["rank"], req["world_size"], os.getppid())
    finally:
        os._exit(5)


def _serve() -> None:
    forkable = len(os.listdir("/proc/self/task")) == 1
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        _reap()
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            return  # the test run is gone
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if not forkable:
                answer = "error: the zygote has threads after its imports"
            else:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _become_rank(req)
                _children[pid] = os.path.join(req["tmpdir"], f"exit{req['rank']}")
                answer = str(pid)
            sys.stdout.write(answer + "\n")
            sys.stdout.flush()


# ---- parent side ---------------------------------------------------------------------------------
class Rank:
    """A forked rank, with the part of `subprocess.Popen` that `multiproc` uses."""

    def __init__(self, pid: int, exit_file: str, server: "subprocess.Popen"):
        self.pid, self._exit_file, self._server = pid, exit_file, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                with open(self._exit_file) as f:
                    self.returncode = int(f.read())
            except (OSError, ValueError):
                if self._server.poll() is not None and not os.path.exists(f"/proc/{self.pid}"):
                    self.returncode = -9  # the zygote died before it could reap this rank
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("rank", timeout)
            time.sleep(0.02)
        return self.returncode


_servers: dict[tuple, "subprocess.Popen"] = {}


def _servers_for(env: dict[str, str], world_size: int, root: str) -> list | None:
    """One zygote per rank index and environment, started (in parallel) on first use; None if
    one cannot run. Per rank index: each zygote is its own interpreter with its own random
    string-hash seed, so ranks differ in set iteration order as torchrun's ranks do (a
    collective issued in set order would still deadlock here). Per environment: torch reads
    some variables at import."""
    import atexit
    import subprocess

    # pytest names the running test in PYTEST_CURRENT_TEST: not something torch reads
    key = frozenset((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")
    launch_env = dict(env, PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    started = []
    for rank in range(world_size):
        server = _servers.get((key, rank))
        if server is None or server.poll() is not None:
            server = subprocess.Popen([sys.executable, "-m", "testkit.zygote"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=launch_env, cwd=root, text=True)
            atexit.register(server.stdin.close)
            _servers[(key, rank)] = server
            started.append(server)
    for server in started:
        if server.stdout.readline().strip() != "ready":
            server.kill()
            return None
    return [_servers[(key, rank)] for rank in range(world_size)]


def spawn_ranks(tmpdir: str, world_size: int, env: dict[str, str], root: str) -> list | None:
    """Fork ranks 0..world_size-1 (rank r from zygote r of `env`), logging to
    tmpdir/rank<r>.log; None when that cannot be done (the caller then starts fresh
    interpreters; nothing forked is left running)."""
    servers = _servers_for(env, world_size, root)
    if servers is None:
        return None
    ranks: list[Rank] = []
    for rank, server in enumerate(servers):
        req = dict(tmpdir=tmpdir, rank=rank, world_size=world_size, env=env, cwd=os.getcwd(),
                   log=os.path.join(tmpdir, f"rank{rank}.log"))
        try:
            server.stdin.write(json.dumps(req) + "\n")
            server.stdin.flush()
            answer = server.stdout.readline().strip()
        except OSError:  # BrokenPipeError included: the zygote is gone
            answer = ""
        if not answer.isdigit():
            for r in ranks:
                r.kill()
            return None
        ranks.append(Rank(int(answer), os.path.join(tmpdir, f"exit{rank}"), server))
    return ranks


if __name__ == "__main__":
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    gc.freeze()  # the imported modules' objects: never scanned (nor copied) by a rank's gc
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    _serve()
