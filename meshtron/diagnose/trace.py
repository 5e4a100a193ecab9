"""Reading a run's trace folder: every rank's dump and hello file, and naming ranks and groups
the way the verdicts print them ("rank 5 (pp=1, dp=0, tp=1)", "the data-parallel group [1, 5]")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.argtypes import folder_problem
from meshtron.doctor import attempt_dirs
from meshtron.doctor import dump as dumpfile
from meshtron.errors import UserError

AXIS_WORDS = {"tp": "tensor-parallel", "dp": "data-parallel",
              "dp_shard": "data-parallel (shard)", "dp_replicate": "data-parallel (replicate)",
              "pp": "pipeline", "cp": "context-parallel", "ep": "expert-parallel"}
# Frames that say where a rank waits, not where the user's code is.
_INFRA = ("/torch/", "/threading.py", "/selectors.py", "meshtron/doctor/",
          "testkit/rank_child.py", "/runpy.py")


@dataclass
class Trace:
    """Everything a run's ranks left in RUN_DIR/trace (and RUN_DIR/metrics.jsonl)."""

    run_dir: Path
    world_size: int
    dumps: dict[int, dict[str, Any]]
    hellos: dict[int, dict[str, Any]]
    abort: dict[str, Any] | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    mesh: dict[str, Any] | None = None
    trace_dir: Path | None = None
    """The folder the dumps were read from (RUN_DIR/trace, or trace/attempt_N)."""
    attempt: int = 0
    """torchrun's restart attempt these dumps belong to (0: the first start)."""
    unreadable: dict[str, str] = field(default_factory=dict)
    """File name -> why it could not be read (cut short, another format version): a rank
    whose dump is here did dump; it is judged from what the other files say."""

    def unreadable_ranks(self) -> list[int]:
        """Ranks whose dump (not hello file) exists but cannot be read."""
        names = [n.removeprefix("rank_").removesuffix(".json") for n in self.unreadable]
        return sorted(int(n) for n in names if n.isdigit())

    # -- naming --------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a rank (size-1 axes left out; the two data axes read as one)."""
        if not self.mesh:
            return {}
        axes, grid = self.mesh["axes"], self.mesh["grid"]
        sizes, index = _shape(grid), _find(grid, rank)
        if index is None:
            return {}
        c = dict(zip(axes, index))
        size = dict(zip(axes, sizes))
        if "dp_replicate" in c and "dp_shard" in c:
            c["dp"] = c.pop("dp_replicate") * size["dp_shard"] + c.pop("dp_shard")
            size["dp"] = size["dp_replicate"] * size["dp_shard"]
        return {a: v for a, v in c.items() if size.get(a, 1) > 1}

    def label(self, rank: int) -> str:
        c = self.coords(rank)
        inner = ", ".join(f"{a}={v}" for a, v in c.items())
        return f"rank {rank} ({inner})" if inner else f"rank {rank}"

    def group_ranks(self, name: str) -> list[int]:
        for d in self.dumps.values():
            g = d.get("groups", {}).get(name)
            if g:
                return list(g["ranks"])
        return []

    def group_axis(self, name: str) -> str | None:
        for d in self.dumps.values():
            g = d.get("groups", {}).get(name)
            if g and g.get("axis"):
                return g["axis"]
        return None

    def group_label(self, name: str) -> str:
        ranks = self.group_ranks(name)
        axis = self.group_axis(name)
        if axis:
            kind = AXIS_WORDS.get(axis, f"{axis!r}")
        elif ranks and sorted(ranks) == list(range(self.world_size)):
            kind = "world"
        else:
            kind = f"process group {name!r},"
        return f"the {kind} group {ranks}"

    def collectives(self) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
        """group -> rank -> seq -> record, collectives only (the dumps' records without a
        peer; point-to-point operations are numbered apart)."""
        out: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
        for rank, d in self.dumps.items():
            for rec in d.get("records", []):
                if "peer" not in rec:
                    out.setdefault(rec["group"], {}).setdefault(rank, {})[rec["seq"]] = rec
        return out

    def where(self, rank: int) -> str | None:
        """'file.py:88 in load_batch': the innermost frame of the rank's main thread outside
        torch and the doctor, from its dump."""
        d = self.dumps.get(rank)
        if not d:
            return None
        main = next((t for t in d.get("stacks", []) if t.get("main")), None)
        if not main or not main["frames"]:
            return None
        return frame_text(main["frames"])


def frame_text(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside the infrastructure (innermost is last)."""
    for f in reversed(frames):
        if not any(s in f["file"] for s in _INFRA):
            return f"{Path(f['file']).name}:{f['line']} in {f['function']}"
    f = frames[-1]
    return f"{Path(f['file']).name}:{f['line']} in {f['function']}"


def _shape(grid) -> list[int]:
    out = []
    while isinstance(grid, list):
        out.append(len(grid))
        grid = grid[0] if grid else None
    return out


def _find(grid, rank: int, prefix: tuple = ()) -> tuple | None:
    if not isinstance(grid, list):
        return prefix if grid == rank else None
    for i, sub in enumerate(grid):
        hit = _find(sub, rank, prefix + (i,))
        if hit is not None:
            return hit
    return None


def load_trace(run_dir: Path | str, attempt: int | None = None) -> Trace:
    """RUN_DIR (or RUN_DIR/trace itself) -> the Trace of one attempt (default: the latest;
    `meshtron train --max-restarts` keeps each restart's dumps in trace/attempt_N). UserError
    when there is nothing to read."""
    run_dir, base = _folders(run_dir)
    folders = attempt_dirs(base)
    number = max(folders) if attempt is None else attempt
    return _load(run_dir, folders[number], number)


def load_attempts(run_dir: Path | str) -> list[Trace]:
    """Every attempt's Trace, first to latest (one for a run that never restarted)."""
    run_dir, base = _folders(run_dir)
    folders = attempt_dirs(base)
    found = [n for n, folder in folders.items() if any(folder.glob("rank_*.json"))]
    return [_load(run_dir, folders[n], n) for n in found or [max(folders)]]


def _folders(run_dir: Path | str) -> tuple[Path, Path]:
    run_dir = Path(run_dir)
    if (problem := folder_problem(run_dir)) is not None:
        raise UserError(f"RUN_DIR={str(run_dir)!r}: {problem}")
    tdir = run_dir / "trace" if (run_dir / "trace").is_dir() else run_dir
    if tdir.name == "trace" and run_dir.name == "trace":
        run_dir = run_dir.parent
    return run_dir, tdir


def _load(run_dir: Path, tdir: Path, attempt: int) -> Trace:
    dumps: dict[int, dict[str, Any]] = {}
    hellos: dict[int, dict[str, Any]] = {}
    unreadable: dict[str, str] = {}
    for path in sorted(tdir.glob("rank_*.json")):
        doc, why = _read_rank_file(path)
        if why:
            unreadable[path.name] = why
            continue
        (hellos if path.name.endswith(".hello.json") else dumps)[doc["rank"]] = doc
    exits = _agent_exits(run_dir, attempt)
    if not dumps and not hellos and not exits and not (tdir / dumpfile.ABORT_FILE).is_file():
        # nothing of a run but files that are not readable dumps: not a run folder
        damaged = (f"; {len(unreadable)} unreadable or not meshtron's: "
                   + ", ".join(f"{n} ({why})" for n, why in list(unreadable.items())[:3])
                   if unreadable else "")
        if not damaged and (run_dir / "run.toml").is_file() \
                and not (run_dir / "plan.toml").is_file():
            # a one-process run (no --nproc, --plan or restarts) leaves run.toml and no
            # plan.toml: it has no process group, so nothing recorded collectives for a dump
            raise UserError(f"RUN_DIR={str(run_dir)!r}: a one-process run (trained without "
                            "--nproc or --plan): it has no ranks and records no collectives, "
                            "so there is no trace to read; its metrics are in metrics.jsonl "
                            "(`meshtron train --nproc N` runs ranks the doctor can read)")
        raise UserError(f"RUN_DIR={str(run_dir)!r}: no trace (expected trace/rank_N.json, "
                        f"written by `meshtron train` ranks){damaged}")
    world = max([int(d.get("world_size", 0)) for d in [*dumps.values(), *hellos.values()]]
                + [r + 1 for r in [*_ranks_named(unreadable), *exits]])
    abort = None
    if (tdir / dumpfile.ABORT_FILE).is_file():
        try:
            abort = json.loads((tdir / dumpfile.ABORT_FILE).read_text())
        except ValueError:
            abort = None
    mesh = next((d["mesh"] for d in dumps.values() if d.get("mesh")), None)
    return Trace(run_dir, world, dumps, hellos, abort, _metrics(run_dir), mesh, tdir, attempt,
                 unreadable)


def _read_rank_file(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(document, None), or (None, why it cannot be read): a file cut short (a copy or a full
    disk; the ranks write theirs atomically) or of another format version is said, never
    taken for a rank that did not dump."""
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    except ValueError:  # UnicodeDecodeError included
        return None, "truncated or damaged (not complete JSON)"
    if not isinstance(doc, dict) or "format" not in doc:
        return None, "not a meshtron trace file (no format field)"
    if doc["format"] != dumpfile.FORMAT:
        return None, (f"format {doc['format']!r}, written by another meshtron version; this "
                      f"doctor reads {dumpfile.FORMAT!r}")
    if not isinstance(doc.get("rank"), int):
        return None, "damaged (no rank number)"
    return doc, None


def _agent_exits(run_dir: Path, attempt: int) -> dict[int, int]:
    """What torchrun's agent saw of each rank's end (attempts/attempt_N/exits.json): a run
    whose ranks ended before any reached meshtron's start left only that."""
    from meshtron.checkpoint.restart import agent_exits

    return agent_exits(run_dir, attempt)


def _ranks_named(names) -> list[int]:
    out = []
    for name in names:
        number = name.removeprefix("rank_").split(".")[0]
        if number.isdigit():
            out.append(int(number))
    return out


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    """RUN_DIR/metrics.jsonl's records; for a launch a --resume kept (RUN_DIR/earlier/N, which
    holds no metrics of its own) the run's `preempted` records, of which endings.py picks the
    launch's by time (audit s55: `doctor --earlier 1` of a preempted launch said 'kind:
    none'); not its steps or restarts, which may be later launches' (a straggler's steady
    step times, the attempt a restart resumed: review s55)."""
    metrics = []
    kept = not (run_dir / "metrics.jsonl").is_file() and run_dir.parent.name == "earlier"
    if kept:
        run_dir = run_dir.parent.parent
    if (run_dir / "metrics.jsonl").is_file():
        # a damaged log reads as far as it is JSON (not a UnicodeDecodeError traceback)
        text = (run_dir / "metrics.jsonl").read_bytes().decode("utf-8", errors="replace")
        for line in text.splitlines():
            try:
                metrics.append(json.loads(line))
            except ValueError:
                break
    if kept:  # only its preemption: the steps (no time) and restarts may be later launches'
        metrics = [m for m in metrics if isinstance(m, dict) and m.get("event") == "preempted"]
    return metrics
