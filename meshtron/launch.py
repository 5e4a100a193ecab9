"""Where the ranks come from: torchrun on this machine, or an existing torchrun / Slurm world.

`meshtron train --nproc N` starts torchrun (`torch.distributed.run`, through `python -m
meshtron.launch --standalone --nproc-per-node N -m meshtron`: torchrun's own argument parser and
`run`, with its expected failures reported as one line per rank instead of the traceback of
its ChildFailedError) with the ranks' command line in one environment variable
(`MESHTRON_RANK_ARGV`, read only by `rank_argv`: torchrun's own argument parser would otherwise
claim flags such as --nproc that it abbreviates). torchrun's flags are the ones the installed
torchrun's parser knows (`torchrun_args`: 2.11 lacks --shutdown-timeout). torchrun and the
ranks live exactly as long as the launcher (`bind_to_parent`; `launch_local` for how signals
reach them). Inside an existing allocation (`torchrun ... meshtron train` on every node, or
`srun meshtron train` with MASTER_ADDR/MASTER_PORT exported) the world is taken as it is.
meshtron never implements its own launcher or transport.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Mapping

from meshtron.agent_exits import AgentExits, agent_stopped
from meshtron.errors import RunFailed, UserError

# gloo on one host: more ranks than this only thrash the CPU (see the shared notes: 8 ranks on
# 2 cores already run 5-10x slower than one process).
MAX_CPU_RANKS = 32
ARGV_ENV = "MESHTRON_RANK_ARGV"
RUN_DIR_ENV = "MESHTRON_RUN_DIR"
"""The run folder, for torchrun's agent and the ranks to note how the ranks ended
(`agent_exits.AgentExits`, checkpoint/restart.py `end_restarts`)."""
PARENT_ENV = "MESHTRON_PARENT_PID"
"""The pid a process started by `launch_local` must die with (`bind_to_parent`): the
launcher's for torchrun's agent, the agent's for the ranks."""
EXIT_INTERRUPTED = 130
"""Stopped by SIGINT (128 + 2), as the shell reports a Ctrl-C."""
EXIT_LAUNCHER = 3
"""torchrun's agent itself failed (not the ranks): its own line says why."""
EXIT_MARGIN_S = 10.0
"""Time for processes to exit once their work is done, on top of a grace period."""
TORCHRUN_SHUTDOWN_S = 30
"""What torchrun gives workers between SIGTERM and SIGKILL when it has no --shutdown-timeout."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_USAGE = 2
EXIT_STORAGE = 74
"""meshtron.checkpoint.EXIT_STORAGE (a rank's storage error), repeated here: the launcher
never imports torch-side modules before torchrun's own."""
EXIT_PREEMPTED = 75
"""meshtron.checkpoint.EXIT_PREEMPTED (the ranks checkpointed after SIGTERM), repeated here."""
FINAL_CODES = (EXIT_USAGE, EXIT_STORAGE, EXIT_PREEMPTED)
"""Rank exit codes that end the job instead of spending a restart: bad input and a storage
error recur on every attempt, a preemption asks for a requeue (a rank ending with one stops
torchrun's agent: checkpoint/restart.py `end_restarts`)."""


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
        return _checked(World(_env_int(env, "RANK"), _env_int(env, "LOCAL_RANK", "0"),
                              _env_int(env, "WORLD_SIZE", minimum=1), "torchrun",
                              _env_int(env, "LOCAL_WORLD_SIZE", "1", minimum=1)),
                        "RANK", "WORLD_SIZE")
    # SLURM_STEP_NUM_TASKS exists only inside an srun step; the batch script itself also
    # sees SLURM_NTASKS but is not one of the ranks.
    if "SLURM_PROCID" in env and _env_int(env, "SLURM_STEP_NUM_TASKS", "1", minimum=1) > 1:
        if "MASTER_ADDR" not in env:
            raise UserError("MASTER_ADDR: not set; under srun export MASTER_ADDR (first node) "
                            "and MASTER_PORT, or start the ranks with torchrun")
        url = f"tcp://{env['MASTER_ADDR']}:{_env_int(env, 'MASTER_PORT', '29500', minimum=1)}"
        return _checked(World(_env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_LOCALID", "0"),
                              _env_int(env, "SLURM_STEP_NUM_TASKS", minimum=1), "slurm",
                              _env_int(env, "SLURM_NTASKS_PER_NODE", "1", minimum=1), url),
                        "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
    return World(0, 0, 1, "single")


def _env_int(env: Mapping[str, str], name: str, default: str | None = None,
             minimum: int = 0) -> int:
    """An integer a launcher set (torchrun's or Slurm's variables): a value that is not one is
    one line naming the variable, not a ValueError traceback. Slurm writes per-node counts as
    '4(x2)' (4 tasks on each of 2 nodes): the count is the part before '('."""
    text = env.get(name, default)
    try:
        value = int(str(text).split("(")[0])
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(f"{name}={text!r} (environment variable): expected an integer >= "
                        f"{minimum}")
    return value


def _checked(world: World, rank_name: str, size_name: str) -> World:
    if world.rank >= world.world_size:
        raise UserError(f"{rank_name}={world.rank} (environment variable): must be below "
                        f"{size_name}={world.world_size}")
    return world


def rank_argv() -> list[str] | None:
    """The command line `launch_local` handed to this rank, or None (not started by it). The one
    reader of MESHTRON_RANK_ARGV."""
    text = os.environ.get(ARGV_ENV)
    if not text or len(sys.argv) > 1:
        return None
    return list(json.loads(text))


def max_local_ranks() -> int:
    from meshtron.calibrate.device import cuda_available

    if not cuda_available():  # known without torch on a node with no GPU (the launcher)
        return MAX_CPU_RANKS
    import torch

    return torch.cuda.device_count()


def check_nproc(nproc: int) -> None:
    limit = max_local_ranks()
    if nproc < 1 or nproc > limit:
        raise UserError(f"--nproc={nproc}: allowed 1..{limit} local ranks on this machine")


def torchrun_args(nproc: int, max_restarts: int = 0, grace_s: float = 30.0,
                  rendezvous: list[str] | None = None, parser=None) -> list[str]:
    """torchrun's command line for `launch_local` (without the program): the flags every torch
    of the supported range knows, plus the newer ones (OPTIONAL_FLAGS) that `parser`
    (torchrun's own, `torch.distributed.run.get_args_parser()`) accepts, or all of them when
    `parser` is None: then `torchrun_main`, in the agent's process, drops those its torchrun
    lacks (`supported_argv`), so that the launcher never imports torch for its parser.
    Feature detection, not version checks: `--shutdown-timeout` came after torch 2.11, whose
    torchrun refuses it."""
    args = [*(rendezvous or ["--standalone"]), f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}"]
    # torchrun's own SIGTERM handling gives the workers this long before SIGKILL
    optional = [f"--shutdown-timeout={math.ceil(grace_s + EXIT_MARGIN_S)}"]
    return args + [flag for flag in optional if parser is None or accepts(parser, flag)]


OPTIONAL_FLAGS = ("--shutdown-timeout=",)
"""torchrun flags newer than the oldest torch meshtron supports: given only where accepted."""


def supported_argv(argv: list[str], parser) -> list[str]:
    """`argv` less the OPTIONAL_FLAGS this torchrun's `parser` lacks; a dropped
    --shutdown-timeout is said once when the grace period it carried is longer than torchrun's
    fixed one (`warn_unsupported`)."""
    kept = [a for a in argv if not a.startswith(OPTIONAL_FLAGS) or accepts(parser, a)]
    for flag in argv:
        if flag not in kept and flag.startswith("--shutdown-timeout="):
            warn_unsupported(kept, float(flag.split("=", 1)[1]) - EXIT_MARGIN_S)
    return kept


def accepts(parser, flag: str) -> bool:
    """torchrun's parser takes `flag` (`--name=value`) as one of its own options."""
    try:
        _, unknown = parser.parse_known_args([flag, "program"])
    except SystemExit:  # a known flag with a value it refuses
        return False
    return flag not in unknown


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0,
                 grace_s: float = 30.0, rendezvous: list[str] | None = None,
                 env: Mapping[str, str] | None = None) -> int:
    """Run `meshtron <argv>` on `nproc` local ranks under torchrun; returns its exit code.

    torchrun runs in its own session, so that a terminal's Ctrl-C reaches only this process,
    which stops the ranks in order: SIGINT is forwarded to torchrun (which forwards it to the
    ranks; they leave at once) and then raises KeyboardInterrupt here, as in one process;
    SIGTERM and SIGHUP are forwarded as a preemption notice (ranks may checkpoint); a second
    signal, or no exit within the grace period, kills torchrun. If this process dies without
    that (SIGKILL, a crash), torchrun and its ranks die with it: each arms the kernel's
    parent-death signal (`bind_to_parent`). `max_restarts`: torchrun's elastic agent restarts
    every rank up to this many times when one fails. `grace_s`: after SIGTERM, how long the
    ranks get to finish (e.g. to write a preemption checkpoint). `rendezvous`: torchrun's
    rendezvous arguments instead of `--standalone` (an elastic node, meshtron/train/elastic.py);
    `env`: variables set for torchrun and the ranks.
    """
    check_nproc(nproc)
    cmd = [sys.executable, "-m", "meshtron.launch",
           *torchrun_args(nproc, max_restarts, grace_s, rendezvous), "-m", "meshtron"]
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env[ARGV_ENV] = json.dumps(argv)
    child_env[PARENT_ENV] = str(os.getpid())
    forward = _Forward(grace_s + 2 * EXIT_MARGIN_S)
    # A signal this process ignores (a background job's SIGINT, nohup's SIGHUP) stays ignored
    previous = {s: signal.signal(s, forward) for s in FORWARDED
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        forward.proc = subprocess.Popen(cmd, env=child_env, start_new_session=True)
        forward.send_pending()
        code = forward.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if forward.proc is not None and forward.proc.poll() is None:
            _stop_group(forward.proc)
    if signal.SIGINT in forward.received:
        raise KeyboardInterrupt  # the caller's one line, exit 130, as one process
    if code == EXIT_LAUNCHER:
        raise RunFailed("torchrun could not run the ranks (its error is above)")
    return code


def warn_unsupported(cmd: list[str], grace_s: float) -> None:
    """One line when this torch's torchrun cannot give the ranks the grace period asked
    (without the flag it gives them a fixed 30 s, enough for the default --preempt-grace)."""
    if not any(a.startswith("--shutdown-timeout") for a in cmd) \
            and grace_s > TORCHRUN_SHUTDOWN_S:
        import torch

        print(f"meshtron: warning: torchrun of torch {torch.__version__} has no "
              f"--shutdown-timeout: after SIGTERM the ranks get its fixed "
              f"{TORCHRUN_SHUTDOWN_S} s, less than the {grace_s:g} s asked (--preempt-grace)",
              file=sys.stderr, flush=True)


class _Forward:
    """The launcher's handler of SIGINT/SIGTERM/SIGHUP while torchrun runs: the first signal
    goes to torchrun's process group (torchrun forwards it to the ranks, which live in
    sessions of their own), a second one, or the grace period running out, kills torchrun
    (and with it the ranks, by their parent-death signal)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self.received: list[int] = []
        self.deadline: float | None = None

    def __call__(self, signum: int, frame) -> None:
        self.received.append(signum)
        self.send_pending()

    def send_pending(self) -> None:
        if self.proc is None or self.proc.returncode is not None or not self.received:
            return  # not started yet (sent once it is), or already reaped
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
            _signal_group(self.proc, self.received[0])
        elif len(self.received) > 1:
            _signal_group(self.proc, signal.SIGKILL)

    def wait(self) -> int:
        assert self.proc is not None
        while True:
            try:  # wakes up to enforce the deadline (a signal handler cannot)
                return self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    _signal_group(self.proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM torchrun (its own process group), SIGKILL after a grace period."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def bind_to_parent(parent_pid: int | None = None, use_prctl: bool = True) -> str | None:
    """End this process (SIGKILL) when its parent ends: torchrun's agent with the launcher, a
    rank with the agent. Linux: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG),
    which needs no thread and fires even when the parent was SIGKILLed; elsewhere (or
    `use_prctl=False`) a daemon thread that watches the parent pid every 0.2 s. SIGKILL, not
    SIGTERM: SIGTERM means preemption and would let ranks write a checkpoint into a folder whose
    launcher, and lock, are gone. `parent_pid`: from PARENT_ENV when None; nothing to do when
    neither names one (not launched by meshtron). Returns the mechanism ('prctl', 'watch') or
    None."""
    if parent_pid is None:
        text = os.environ.get(PARENT_ENV)
        if not text:
            return None
        parent_pid = int(text)
    mode = "prctl" if use_prctl and _arm_parent_death_signal() else "watch"
    if mode == "watch":
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="meshtron-parent-watch").start()
    if os.getppid() != parent_pid:  # the parent ended before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    return mode


def leave_on_interrupt() -> None:
    """A rank's SIGINT (the launcher's Ctrl-C, forwarded by torchrun): leave at once and
    quietly, exit code 130; the launcher says "interrupted" once for all ranks. Not
    KeyboardInterrupt: a rank blocked in a collective would unwind into "peer gone" errors
    and tracebacks. Installed before torch is imported; a SIGINT that came earlier, while the
    interpreter started (`_defer_sigint_in_ranks` blocked it), is delivered here."""
    signal.signal(signal.SIGINT, _leave)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _defer_sigint_in_ranks() -> None:
    """Start the ranks with SIGINT blocked: a signal mask is inherited through fork and exec
    (POSIX; CPython's subprocess restores the parent thread's mask in the child), so a Ctrl-C
    forwarded while a rank's interpreter still runs its site files and imports stays pending
    until `leave_on_interrupt` installs the quiet handler and unblocks it, instead of a
    KeyboardInterrupt traceback. Only this (the agent's main) thread blocks it: torchrun spawns
    the ranks from it, and a thread started before the block keeps SIGINT deliverable, so the
    agent's own handler (torchrun's, run by the main thread) still sees the signal."""
    if not hasattr(signal, "pthread_sigmask"):
        return
    threading.Thread(target=threading.Event().wait, daemon=True,
                     name="meshtron-sigint").start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _leave(signum, frame) -> None:
    doctor = sys.modules.get("meshtron.doctor")  # imported: a session to mark interrupted
    if doctor is not None:
        doctor.note_interrupted()
    runtime = sys.modules.get("meshtron.runtime")  # imported: NCCL communicators to abort
    if runtime is not None:
        runtime.abort_rank(EXIT_INTERRUPTED)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _arm_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def _not_about_sigint(record: logging.LogRecord) -> bool:
    """False for torchrun's log lines about forwarding SIGINT to the ranks (a rank it then
    has to kill stays reported)."""
    args = record.args if isinstance(record.args, tuple) else ()
    about_sigint = any(a == "SIGINT" or (isinstance(a, signal.Signals) and a == signal.SIGINT)
                       for a in args)
    return not about_sigint or "forcefully" in str(record.msg)


def torchrun_main(argv: list[str]) -> int:
    """torchrun (`torch.distributed.run`'s own argument parser and `run`), bound to the
    launcher's life, reporting what it expects to happen as one line each instead of a
    traceback: ranks that failed (exit code or signal; a rank that raised has printed its own
    traceback above), a signal that stopped the agent (SIGINT: nothing, the launcher says
    "interrupted"), and torchrun itself failing (EXIT_LAUNCHER: its command line refused by
    this torch's torchrun, or an error of the agent, with its traceback)."""
    bind_to_parent()
    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks end with this agent
    _defer_sigint_in_ranks()
    import torch
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for module in (agent_api, mp_api):  # Ctrl-C: the launcher's one line, not torchrun's
        logging.getLogger(module.__name__).addFilter(_not_about_sigint)

    parser = get_args_parser()
    args, unknown = parser.parse_known_args(supported_argv(argv, parser))
    if unknown:
        print(f"meshtron: torchrun of torch {torch.__version__} does not know "
              f"{' '.join(unknown)}; no rank started", file=sys.stderr)
        return EXIT_LAUNCHER
    exits = AgentExits(os.environ.get(RUN_DIR_ENV, ""))
    logging.getLogger(mp_api.__name__).addFilter(exits)
    try:
        run(args)
    except ChildFailedError as exc:
        return _report_failures(exc.failures, exits.last_stopped)
    except SignalException as exc:
        final = _final_code()
        if final is not None:  # a rank ended the job (checkpoint/restart.py `end_restarts`)
            return final
        if exc.sigval != signal.SIGINT:
            print(f"torchrun: stopped by {exc.sigval.name}; the ranks were stopped",
                  file=sys.stderr)
        return 128 + int(exc.sigval)
    except Exception as exc:  # noqa: BLE001 - the agent's own failure: say it is torchrun's
        traceback.print_exc()
        print(f"meshtron: torchrun failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_LAUNCHER
    return 0


def _final_code() -> int | None:
    """The exit code a rank stopped this agent with (`end_restarts`), None when none did."""
    if not os.environ.get(RUN_DIR_ENV):
        return None
    from meshtron.checkpoint.restart import final_code

    return final_code(os.environ[RUN_DIR_ENV])


def _report_failures(failures, stopped: Mapping[int, set[int]] | None = None) -> int:
    """One line per failed rank; the exit code to return: 75 when every failed rank exited
    after its preemption checkpoint (nothing said: the launcher reports the preemption), else
    the first final code (2, 74) a rank exited with, else 1. `stopped`: pid -> the signals
    torchrun's agent sent it after the first failure (`agent_exits.AgentExits`): such a rank
    is said to have been stopped by torchrun, not to have failed of its own."""
    stopped = stopped or {}
    codes = [failure.exitcode for failure in failures.values()]
    if codes and all(code == EXIT_PREEMPTED for code in codes):
        return EXIT_PREEMPTED
    for rank, failure in sorted(failures.items()):
        how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        if agent_stopped(stopped, failure.pid, failure.exitcode):
            print(f"torchrun: rank {rank} (pid {failure.pid}) stopped by torchrun after "
                  f"another rank failed ({how})", file=sys.stderr)
            continue
        print(f"torchrun: rank {rank} (pid {failure.pid}) failed: {how}", file=sys.stderr)
    final = [code for code in codes if code in (EXIT_USAGE, EXIT_STORAGE)]
    return final[0] if final else 1


def exit_agent(code: int) -> None:
    """End torchrun's agent process with `code` once `torchrun_main` returned: its output and
    log handlers flushed, then `os._exit`, skipping the interpreter's teardown of the torch it
    imported (freeing every module and torch.library's operator registrations), which every
    `meshtron train --nproc` paid after its ranks were done: about 0.35 s of CPU (`python -c
    "import torch, torch.distributed.run"` on the shared 2-core machine, mean of 4: 1.39 s with
    a normal exit, 1.05 s with os._exit), and the agent left 0.2 s after its ranks instead of
    0.5-1.2 s (strace of 2-rank launches). Nothing is left to tear down by then:
    torchrun's `run` has stopped and reaped the ranks and shut its rendezvous down before it
    returns or raises (torch/distributed/launcher/api.py `launch_agent`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    try:
        exit_agent(torchrun_main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C before torchrun's own handlers: no rank started yet
        exit_agent(EXIT_INTERRUPTED)
