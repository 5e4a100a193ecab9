"""Goodput (useful step time / wall time) under failures for three recovery strategies, from
measured recovery times (meshtron/reliability/recovery.toml, written by bench/recovery.py and
bench/chaos.py, each value labelled with the run that measured it).

Failures are a Poisson process with the job's MTBF M (reliability/interval.py). Per strategy:

- restart-from-disk: every rank restarts and reads the newest checkpoint. Daly's complete model
  (interval.py `expected_wall_s`) with the checkpoint save stall delta, Daly's interval, and
  recovery R = measured fixed seconds + reading the checkpoint back at storage bandwidth.
  Goodput = 1 / (expected wall seconds per useful second).
- in-memory: the same model with the in-memory snapshot's stall (asynchronous: ~0, so a snapshot
  every step) and R = measured fixed seconds + each GPU's state shard over the network from a
  peer's host memory (Gemini, Wang et al. SOSP 2023).
- replica fault tolerance (meshtron/train/replica.py): no restart. Each failure costs every
  group the measured stall plus the half step in flight on average (the step is retried), and
  takes 1/G of the throughput away while the replacement rejoins (measured rejoin seconds +
  its state shard over the network): lost useful seconds L = stall + step/2 + rejoin/G per
  failure, goodput = 1 - L / M (first order: failures during a recovery are not compounded).
  A failure of every group at once is outside this model (a disk checkpoint covers it).

Sizes: the checkpoint is CHECKPOINT_BYTES_PER_PARAM bytes per parameter (fp32 master weights
and two AdamW moments), spread over the GPUs; in replica FT each group holds a full copy over
gpus / G GPUs.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.errors import UserError
from meshtron.reliability.interval import daly_interval_s, expected_wall_s

RECOVERY_FILE = Path(__file__).with_name("recovery.toml")
"""The measured recovery seconds; bench/recovery.py and bench/chaos.py --write-recovery
rewrite their values in it (update_recovery_file)."""
CHECKPOINT_BYTES_PER_PARAM = 12.0
"""fp32 master weights + two fp32 AdamW moments (as meshtron/cost/model.py)."""
DEFAULT_PEER_GB_PER_S = 25.0
"""Network bandwidth per GPU for a peer-to-peer state copy, GB/s: one 400 Gb/s NIC per GPU
(DGX H100)."""


FIELDS = ("restart_from_disk_s", "in_memory_s", "replica_stall_s", "replica_rejoin_s")
"""The recovery seconds recovery.toml holds, each with a `<name>_source` label beside it."""
_HEADER = """\
# Measured recovery seconds for meshtron/reliability/goodput.py (`meshtron cost`, `meshtron
# simulate --step`). Written by the benches, each value with the run that measured it:
#   restart_from_disk_s, in_memory_s: python bench/recovery.py --write-recovery
#     (SIGKILL -> every rank's first step again, minus the state transfer, which goodput.py
#     adds per model: checkpoint read at storage bandwidth, peer copy at network bandwidth);
#   replica_stall_s, replica_rejoin_s: python bench/chaos.py --write-recovery
#     (replica FT: the survivors' extra seconds at the failed step beyond one step, and
#     SIGKILL -> the replacement group's first committed step with the live weights).
"""


@dataclass(frozen=True)
class RecoveryTimes:
    """Measured fixed recovery seconds (small models: the state transfer is added per run)."""

    restart_from_disk_s: float
    """A rank's death to every rank training again, restarted from the disk checkpoint."""
    in_memory_s: float
    """The same, restored from peers' host memory."""
    replica_stall_s: float
    """Surviving replica groups' extra seconds at the failed step, beyond one step."""
    replica_rejoin_s: float
    """A group's death to its replacement back in the quorum with the live state."""
    source: str = ""
    """Where the numbers come from (the file, or a caller's note)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Per value (FIELDS): what measured it, where and when."""


def load_recovery_times(path: Path | str | None = None) -> RecoveryTimes:
    """RecoveryTimes from a TOML file (default: the packaged RECOVERY_FILE)."""
    p = Path(path) if path is not None else RECOVERY_FILE
    try:
        doc = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"recovery times {str(p)!r}: cannot be read ({e})") from None
    for name in FIELDS:
        v = doc.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                math.isfinite(v) and v >= 0):
            raise UserError(f"{p}: {name}={v!r}; give a finite number of seconds >= 0")
    sources = {n: str(doc.get(f"{n}_source", "unlabelled")) for n in FIELDS}
    where = "packaged" if path is None else str(p)
    return RecoveryTimes(**{n: float(doc[n]) for n in FIELDS},
                         source=f"{p.name} ({where}), measured by the benches named per value",
                         sources=sources)


def at_job_scale(times: RecoveryTimes, restart_s: float, label: str) -> RecoveryTimes:
    """The fixed recovery seconds of a job at its own scale. recovery.toml's are measured on
    small runs (a few CPU ranks, no scheduler, no communicator set-up across nodes): the
    floor of a restart, not its size on thousands of GPUs, where detecting the failure,
    rescheduling, starting every process and initialising the communicators dominate: the
    cost model's job restart `restart_s` (cost/model.py DEFAULT_RESTART_S, --restart-min).
    Every strategy that starts processes again pays it (restart-from-disk, in-memory, a
    replica group's replacement); they differ by the state transfer goodput_table adds and
    by how much work they redo. The survivors' stall of replica FT restarts nothing: kept as
    measured. The larger of the two figures is used, so a measured restart slower than the
    assumption is never hidden."""
    _check("restart_s", restart_s, positive=False)
    fixed = {}
    sources = dict(times.sources)
    for name in ("restart_from_disk_s", "in_memory_s", "replica_rejoin_s"):
        measured = getattr(times, name)
        fixed[name] = max(restart_s, measured)
        sources[name] = (f"{label} (the job's restart at this scale; measured {measured:g} s "
                         f"on a small run: {times.sources.get(name, 'unlabelled')})")
    # the header says when the floor, not the figure given, is what the table uses
    raised = [f"{name.removesuffix('_s')} {fixed[name]:g} s" for name in fixed
              if fixed[name] > restart_s]
    floor = f", raised to the measured floor ({', '.join(raised)})" if raised else ""
    return RecoveryTimes(**fixed, replica_stall_s=times.replica_stall_s,
                         source=f"job restart {restart_s:g} s ({label}){floor} for every "
                                "strategy that restarts processes; replica stall measured "
                                f"({times.source})",
                         sources=sources)


def update_recovery_file(path: Path, values: dict[str, tuple[float, str]]) -> None:
    """Set some of the recovery seconds in `path` (name -> (seconds, label: what measured it,
    where, when)); the other values and their labels stay."""
    doc = tomllib.loads(path.read_text()) if path.exists() else {}
    for name, (seconds, label) in values.items():
        if name not in FIELDS:
            raise ValueError(f"{name}: not one of {FIELDS}")
        doc[name], doc[f"{name}_source"] = float(seconds), label
    lines = [_HEADER]
    for name in FIELDS:
        label = str(doc.get(f"{name}_source", "unlabelled")).replace("\\", "/").replace('"', "'")
        lines.append(f'{name} = {doc.get(name, 0.0)}\n{name}_source = "{label}"\n')
    text = "\n".join(lines)
    tomllib.loads(text)  # still valid
    path.write_text(text)


@dataclass(frozen=True)
class StrategyGoodput:
    """One strategy's figures at the given failure rate."""

    name: str
    """restart_from_disk | in_memory | replica_ft."""
    goodput: float | None
    """Useful step time / wall time in [0, 1]; None when the strategy does not apply."""
    recovery_s: float | None
    """Seconds of one recovery (fixed + transfer); None when it does not apply."""
    lost_per_failure_s: float | None
    """Expected seconds one failure costs: for the checkpoint strategies the wall overhead
    per MTBF, (1/goodput - 1) M (recovery, redone work and checkpoint stalls); for replica FT
    the useful seconds lost (stall, half a step, rejoin / G)."""
    note: str = ""
    """Why it does not apply, or where a number comes from."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _check(name: str, value: float, positive: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > 0 if positive else value >= 0):
        raise UserError(f"{name}={value!r}: must be a {'positive' if positive else 'non-negative'}"
                        " finite number")
    return float(value)


def checkpoint_goodput(step_s: float, mtbf_s: float, save_s: float, recovery_s: float
                       ) -> tuple[float, float]:
    """(goodput, checkpoint interval s) of a checkpoint/restart strategy: Daly's model at
    Daly's interval (at least one step); a zero save stall snapshots every step."""
    tau = step_s if save_s == 0 else max(step_s, daly_interval_s(save_s, mtbf_s))
    return 1.0 / expected_wall_s(1.0, tau, save_s, mtbf_s, recovery_s), tau  # 0: never done


def _lost_per_failure(goodput: float, mtbf_s: float) -> float:
    """(1/goodput - 1) M: the wall overhead per MTBF (inf at goodput 0: never finishes)."""
    return (1.0 / goodput - 1.0) * mtbf_s if goodput > 0 else math.inf


def replica_goodput(step_s: float, mtbf_s: float, groups: int, stall_s: float,
                    rejoin_s: float) -> tuple[float, float]:
    """(goodput, lost useful seconds per failure) of replica fault tolerance over G groups."""
    lost = stall_s + step_s / 2.0 + rejoin_s / groups
    return max(0.0, 1.0 - lost / mtbf_s), lost


def replica_groups(requested: int | None, dp: int, replicas: int) -> int:
    """The replica groups the replica-FT row prices: the plan's replicated groups, or
    `--replica-groups` G, a what-if of the plan's dp data-parallel ranks regrouped into G
    replicas (HSDP's dp_replicate; torchft's replica groups). G must divide dp: 3 groups of 4
    ranks' worth of replicas is no layout, and was priced as one."""
    if requested is None:
        return replicas
    if dp % requested:
        allowed = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        raise UserError(f"--replica-groups={requested}: the plan's dp={dp} data-parallel "
                        f"ranks cannot form {requested} replica groups; allowed: {allowed}")
    return requested


def goodput_table(step_s: float, mtbf_s: float, params: float, gpus: int, save_s: float,
                  replica_groups: int, times: RecoveryTimes,
                  peer_gb_per_s: float = DEFAULT_PEER_GB_PER_S,
                  snapshot_stall_s: float = 0.0) -> list[StrategyGoodput]:
    """The three strategies side by side. `save_s`: the disk checkpoint's save (and read)
    seconds; `replica_groups`: G (< 2: replica FT does not apply)."""
    step_s, mtbf_s = _check("step_time_s", step_s), _check("mtbf_s", mtbf_s)
    _check("params", params)
    _check("save_s", save_s, positive=False)
    bw = _check("peer_gb_per_s", peer_gb_per_s) * 1e9
    if not (isinstance(gpus, int) and gpus >= 1):
        raise UserError(f"gpus={gpus!r}: must be a whole number >= 1")
    if not (isinstance(replica_groups, int) and 1 <= replica_groups <= gpus):
        raise UserError(f"replica-groups={replica_groups!r}: must be a whole number in 1..{gpus}")
    state = CHECKPOINT_BYTES_PER_PARAM * params
    out = []
    r_disk = times.restart_from_disk_s + save_s
    g, tau = checkpoint_goodput(step_s, mtbf_s, save_s, r_disk)
    out.append(StrategyGoodput("restart_from_disk", g, r_disk, _lost_per_failure(g, mtbf_s),
                               f"checkpoint every {tau:.0f} s of work"))
    r_mem = times.in_memory_s + state / gpus / bw
    g, tau = checkpoint_goodput(step_s, mtbf_s, _check("snapshot_stall_s", snapshot_stall_s,
                                                       positive=False), r_mem)
    out.append(StrategyGoodput("in_memory", g, r_mem, _lost_per_failure(g, mtbf_s),
                               "a snapshot every step" if snapshot_stall_s == 0 else ""))
    if replica_groups < 2:
        out.append(StrategyGoodput("replica_ft", None, None, None,
                                   "needs >= 2 replica groups (dp with zero 0/1, or HSDP "
                                   "dp_replicate); try --replica-groups"))
    else:
        r_rep = times.replica_rejoin_s + state * replica_groups / gpus / bw
        g, lost = replica_goodput(step_s, mtbf_s, replica_groups, times.replica_stall_s, r_rep)
        out.append(StrategyGoodput("replica_ft", g, r_rep, lost,
                                   f"{replica_groups} replica groups"))
    return out


def goodput_doc(rows: list[StrategyGoodput], times: RecoveryTimes, mtbf_s: float
                ) -> dict[str, Any]:
    """The 'goodput' section of `meshtron cost` / `simulate --step` JSON."""
    return {"mtbf_s": mtbf_s, "recovery_source": times.source,
            "recovery_fixed_s": {n: getattr(times, n) for n in FIELDS},
            "recovery_sources": dict(times.sources),
            "strategies": {r.name: r.to_dict() for r in rows}}


def render_goodput(rows: list[StrategyGoodput], times: RecoveryTimes, mtbf_s: float,
                   counts: str = "") -> list[str]:
    """Text lines: one per strategy (`counts`: what the MTBF counts, said beside it)."""
    said = f" ({counts})" if counts else ""
    lines = [f"Goodput at job MTBF {mtbf_s / 3600:.2f} h{said} (recovery seconds: "
             f"{times.source}):"]
    for r in rows:
        if r.goodput is None:
            lines.append(f"  {r.name:18} n/a: {r.note}")
            continue
        lines.append(f"  {r.name:18} {r.goodput:7.2%}  recovery {r.recovery_s:8.1f} s"
                     f"{'  (' + r.note + ')' if r.note else ''}")
    for name in FIELDS:
        if name in times.sources:
            lines.append(f"  fixed {name} = {getattr(times, name):g} s: {times.sources[name]}")
    return lines
