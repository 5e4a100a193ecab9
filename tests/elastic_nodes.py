"""Simulated nodes of an elastic job on one machine, for tests/test_elastic*.py: each node is
one `meshtron train --nnodes MIN:MAX` invocation (its own torchrun agent, its own ranks) joined
to one c10d rendezvous endpoint on localhost; a node is lost by SIGKILL of its whole process
tree (launcher, agent and ranks at once), as a machine that dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MESHTRON = [sys.executable, "-m", "meshtron"]
# Fast failure detection and short waits for stragglers on one machine (torchrun's defaults are
# for clusters: 5 s heartbeats, a 30 s last call).
RDZV_CONF = "last_call_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One simulated node: a `meshtron train --nnodes` process and its descendants."""

    def __init__(self, name: str, args: list[str], port: int, run_id: str, host: bool,
                 log_dir: Path):
        self.name = name
        self.log = log_dir / f"node_{name}.log"
        conf = f"{RDZV_CONF},is_host={1 if host else 0}"
        cmd = MESHTRON + ["train", *args, "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", run_id, "--rdzv-conf", conf]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def tree(self) -> list[int]:
        """This node's processes: the launcher and every descendant (the agent starts its ranks
        in sessions of their own, so a process group does not hold them all)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def kill9(self) -> list[int]:
        """SIGKILL every process of the node at once (a machine lost)."""
        pids = self.tree()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        return pids

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill9()
        self._out.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir) if "step" in r}


def replans(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == "replan"]


def wait_for(cond, timeout: float, nodes: list[Node], what: str, poll: float = 0.05):
    """Poll `cond()` until truthy; fail with the nodes' logs on a timeout or a dead node."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    logs = "\n".join(f"--- node {n.name} ---\n{n.text()[-4000:]}" for n in nodes)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")
