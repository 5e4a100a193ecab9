"""Where the ranks come from: torchrun on this machine, or an existing torchrun / Slurm world.

`meshtron train --nproc N` starts torchrun (`torch.distributed.run`, through `python -m
meshtron.launch --standalone --nproc-per-node N -m meshtron`: torchrun's own `parse_args` and
`run`, with its expected failures reported as one line per rank instead of the traceback of
its ChildFailedError) with the ranks' command line in one environment variable
(`MESHTRON_RANK_ARGV`, read only by `rank_argv`: torchrun's own argument parser would otherwise
claim flags such as --nproc that it abbreviates). Inside an existing allocation (`torchrun ...
meshtron train` on every node, or `srun meshtron train` with MASTER_ADDR/MASTER_PORT exported)
the world is taken as it is. meshtron never implements its own launcher or transport.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping

from meshtron.errors import UserError

# gloo on one host: more ranks than this only thrash the CPU (see the shared notes: 8 ranks on
# 2 cores already run 5-10x slower than one process).
MAX_CPU_RANKS = 32
ARGV_ENV = "MESHTRON_RANK_ARGV"


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    world_size: int
    """Number of ranks in the job."""
    source: str
    """'torchrun', 'slurm' or 'single'."""
    local_world_size: int = 1
    """Ranks on this node (they share its cores)."""
    init_method: str | None = None
    """Rendezvous URL for init_process_group; None: torchrun's environment (env://)."""


def current_world(env: Mapping[str, str] | None = None) -> World:
    """The job this process belongs to, read from the environment (never written)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return World(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                     "torchrun", int(env.get("LOCAL_WORLD_SIZE", 1)))
    # SLURM_STEP_NUM_TASKS exists only inside an srun step; the batch script itself also
    # sees SLURM_NTASKS but is not one of the ranks.
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        if "MASTER_ADDR" not in env:
            raise UserError("MASTER_ADDR: not set; under srun export MASTER_ADDR (first node) "
                            "and MASTER_PORT, or start the ranks with torchrun")
        url = f"tcp://{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
        return World(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)),
                     int(env["SLURM_STEP_NUM_TASKS"]), "slurm",
                     int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]), url)
    return World(0, 0, 1, "single")


def rank_argv() -> list[str] | None:
    """The command line `launch_local` handed to this rank, or None (not started by it). The one
    reader of MESHTRON_RANK_ARGV."""
    text = os.environ.get(ARGV_ENV)
    if not text or len(sys.argv) > 1:
        return None
    return list(json.loads(text))


def max_local_ranks() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else MAX_CPU_RANKS


def check_nproc(nproc: int) -> None:
    limit = max_local_ranks()
    if nproc < 1 or nproc > limit:
        raise UserError(f"--nproc={nproc}: allowed 1..{limit} local ranks on this machine")


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0,
                 grace_s: float = 30.0, rendezvous: list[str] | None = None,
                 env: Mapping[str, str] | None = None) -> int:
    """Run `meshtron <argv>` on `nproc` local ranks under torchrun; returns its exit code.

    The ranks run in their own process group so that Ctrl-C or a failure takes all of them down:
    no rank is left running. `max_restarts`: torchrun's elastic agent restarts every rank up to
    this many times when one fails. `grace_s`: after SIGTERM, how long the ranks get to finish
    (e.g. to write a preemption checkpoint) before SIGKILL. `rendezvous`: torchrun's
    rendezvous arguments instead of `--standalone` (an elastic node, meshtron/heal/elastic.py);
    `env`: variables set for torchrun and the ranks.
    """
    check_nproc(nproc)
    cmd = [sys.executable, "-m", "meshtron.launch", *(rendezvous or ["--standalone"]),
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           # torchrun's own SIGTERM handling gives the workers this long before SIGKILL
           f"--shutdown-timeout={math.ceil(grace_s)}", "-m", "meshtron"]
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env[ARGV_ENV] = json.dumps(argv)
    proc = subprocess.Popen(cmd, env=child_env, start_new_session=True)

    def _forward(signum, frame):  # SIGTERM/SIGHUP to us: stop the ranks, then go
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, _forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop_group(proc, grace_s)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM torchrun and its ranks (their own process group), SIGKILL after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def torchrun_main(argv: list[str]) -> int:
    """torchrun (`torch.distributed.run`'s own argument parser and `run`), reporting what it
    expects to happen as one line each instead of a traceback: ranks that failed (exit code or
    signal; a rank that raised has printed its own traceback above) and a signal that stopped
    the agent. Anything else propagates with its traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
                   else f"exit code {failure.exitcode}")
            print(f"torchrun: rank {rank} (pid {failure.pid}) failed: {how}", file=sys.stderr)
        return 1
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}; the ranks were stopped",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
