"""Recorded rehearsal tables: the planner priced NOW against a rehearsal measured before.

A default rehearsal-vs-planner table test (tests/test_rehearse_kinds.py, ...) guards the
PLANNER's memory model, which changes often; the rehearsal (meshtron/rehearse/, fake tensors),
which changes rarely, keeps live default checks of its own (tests/test_rehearse.py,
tests/test_gpu_check_rehearse.py). So a default table reads what each layout kind rehearsed
from a committed recording, tests/data/rehearsals/NAME.json, prices the same plans with the
planner at test time (torch-free, in the test's process: `recorded_table`) and holds them as
testkit.rehearsal.check_totals does. A `slow` test per table re-rehearses it live through the
command that writes the recording (`python -m testkit.recorded_rehearsal TEST_FILE NAME`,
`--out` a folder) and holds the new recording equal to the committed one (`same_rehearsal`).
A test file may record other deterministic measurements the same way (RECORDED_MEASURES,
`recorded_values`).

A table is {kind: case}, a case {"model": ModelSpec fields or a preset name, "plan": the
as_plan knobs (validated on 8 GPUs), "pp_rank": a pipeline rank or None (the planner's
fullest), "cp_rank": a context-parallel rank or None}; a test file lists its recorded tables
in RECORDED_TABLES = {name: table}. The recording holds the table as given (a test whose
table changed fails until it is recorded again), the rank rehearsed, each row's rehearsed
GiB, and its provenance: torch's version, the date, the commit, the command.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "rehearsals"
GPUS = 8
CLUSTER = "dgx-h100:1"
DEVICE = "cpu"
SAME_GIB = 1e-9
"""How close a live rehearsal must be to its recording, per row (GiB): a fake-tensor rehearsal
counts the bytes of the tensors a rank holds, the same on every run of the same code and torch
(no timing, no data, no randomness in a byte count); 1e-9 GiB (one byte) only absorbs float
summation order. A difference means the runtime or torch changed what a rank holds: re-record
and say why."""


def case(model, plan: dict, pp_rank: int | None = None, cp_rank: int | None = None) -> dict:
    """One row of a recorded table, in the form its recording holds (JSON: tuples as lists)."""
    return json.loads(json.dumps({"model": model, "plan": plan, "pp_rank": pp_rank,
                                  "cp_rank": cp_rank}))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def regenerate_command(source: str, name: str) -> str:
    return f"python -m testkit.recorded_rehearsal {source} {name}"


# ---- both sides: the inputs -------------------------------------------------------------

def _spec(model):
    from meshtron.model.spec import PRESETS, ModelSpec

    if isinstance(model, str):
        return PRESETS[model]
    return ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in model.items()})


def _plan(row: dict, spec):
    from meshtron.planner.plan import as_plan

    return as_plan({**row["plan"], "model": spec.name}).validate(GPUS, spec)


def _rank(row: dict, plan, spec) -> int | None:
    """The global rank a case names (its pipeline or context-parallel rank's first), or None:
    the planner's fullest stage, as `meshtron rehearse` picks."""
    from meshtron.planner.placement import placement
    from meshtron.rehearse import compare

    if row["pp_rank"] is not None:
        return compare.first_rank_of_stage(compare.with_layer_split(plan, spec), row["pp_rank"])
    if row["cp_rank"] is not None:
        place = placement(plan, plan.gpus)
        return place.rank({**{a: 0 for a in place.axes}, "cp": row["cp_rank"]})
    return None


# ---- the planner's side (torch-free) ----------------------------------------------------

def priced(row: dict, pp_rank: int, ran_eager: bool) -> dict[str, float]:
    """The planner's rows (compare.ROWS, GiB) for a case's pipeline rank `pp_rank`, as
    meshtron/rehearse/run.py `rehearse` prices them on the CPU's kernels, through the same
    pieces (compare.pricing: the saved stack, its expert imbalance, the runtime's layer
    split; compare.as_ran: eager where the rehearsal ran the blocks eagerly)."""
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.rehearse import compare

    spec = _spec(row["model"])
    plan, fw, imbalance = compare.pricing(_plan(row, spec), spec)
    bd = compare.planner_estimate(spec, resolve_cluster(CLUSTER),
                                  compare.as_ran(plan, ran_eager), DEVICE, imbalance,
                                  stage=pp_rank, framework=fw).memory
    return compare.planner_rows(bd)


def recorded_table(source: str, name: str, table: dict) -> dict:
    """{kind: {row: [rehearsed GiB (recorded), planned GiB (now)]}} for `table`, as
    check_totals reads it; a kind the rehearsal ran eagerly also has "compiled": [the
    rehearsal's note, the planner's compiled total now]. Fails, naming the command, when the
    recording is missing or recorded another table."""
    path = DATA / f"{name}.json"
    redo = regenerate_command(source, name)
    assert path.exists(), f"no recording {_shown(path)}: run `{redo}`"
    rec = json.loads(path.read_text())
    want = {kind: case(**row) for kind, row in table.items()}
    got = {kind: r["case"] for kind, r in rec["kinds"].items()}
    assert got == want, f"{_shown(path)} recorded another table: run `{redo}`"
    out = {}
    for kind, r in rec["kinds"].items():
        planned = priced(r["case"], r["pp_rank"], r["compile"] is not None)
        out[kind] = {row: [gib, planned[row]] for row, gib in r["rehearsed_gib"].items()}
        if r["compile"] is not None:
            out[kind]["compiled"] = [r["compile"], priced(r["case"], r["pp_rank"], False)["total"]]
    return out


# ---- the rehearsal's side (torch, fake tensors) ------------------------------------------

def rehearse_case(row: dict) -> dict:
    """Rehearse one case through meshtron/rehearse/run.py `rehearse` (as `meshtron rehearse`
    does); what a recording keeps of it. The planner's column of the report must be what
    `priced` computes, to float rounding: the default test's planner side is this one's."""
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.rehearse.run import rehearse

    spec = _spec(row["model"])
    plan = _plan(row, spec)
    report = rehearse(spec, plan, resolve_cluster(CLUSTER), DEVICE, _rank(row, plan, spec))
    rehearsed = {r["row"]: r["rehearsal_gib"] for r in report["memory"]}
    planner = {r["row"]: r["planner_gib"] for r in report["memory"]}
    compiled = report.get("compile")
    again = priced(row, report["pp_rank"], compiled is not None)
    off = {k: (v, again[k]) for k, v in planner.items() if abs(v - again[k]) > SAME_GIB}
    assert not off, f"priced() is not rehearse()'s planner column: {off}"
    return {"case": row, "rank": report["rank"], "pp_rank": report["pp_rank"],
            "compile": compiled, "rehearsed_gib": rehearsed,
            "planner_gib_when_recorded": planner}


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def record(source: str, name: str, table: dict) -> dict:
    """Rehearse every case of `table` (in this process: it imports torch); the recording."""
    import torch

    kinds = {}
    for kind, row in table.items():
        kinds[kind] = rehearse_case(case(**row))
        torch.set_default_dtype(torch.float32)  # a rehearsal's own setting ends with it
    return {"table": name, "source": source, "command": regenerate_command(source, name),
            "function": "testkit.recorded_rehearsal.record", "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "commit": _commit(), "gpus": GPUS,
            "cluster": CLUSTER, "device": DEVICE, "kinds": kinds}


def same_rehearsal(recorded: dict, live: dict) -> list[str]:
    """Where a live recording differs from the committed one: the table, the rank, the
    compile note or a row beyond SAME_GIB (empty: the same rehearsal)."""
    out = []
    for kind, r in recorded["kinds"].items():
        got = live["kinds"].get(kind)
        if got is None:
            out.append(f"{kind}: not rehearsed")
            continue
        for key in ("case", "rank", "pp_rank", "compile"):
            if r[key] != got[key]:
                out.append(f"{kind}: {key} {r[key]!r} recorded, {got[key]!r} now")
        for row, gib in r["rehearsed_gib"].items():
            now = got["rehearsed_gib"].get(row)
            if now is None or abs(now - gib) > SAME_GIB:
                out.append(f"{kind}: {row} {gib!r} GiB recorded, {now!r} now")
    out += [f"{kind}: not recorded" for kind in set(live["kinds"]) - set(recorded["kinds"])]
    return out


def live_check(source: str, name: str, tmp_dir: Path) -> None:
    """The slow test's check: the regeneration command, run into `tmp_dir`, writes what the
    committed recording holds."""
    out = subprocess.run([sys.executable, "-m", "testkit.recorded_rehearsal", source, name,
                          "--out", str(tmp_dir)], capture_output=True, text=True, cwd=ROOT,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    live = json.loads((tmp_dir / f"{name}.json").read_text())
    recorded = json.loads((DATA / f"{name}.json").read_text())
    diff = same_values(recorded, live) if "values" in recorded else same_rehearsal(recorded, live)
    assert not diff, (f"the rehearsal no longer measures what {name}.json recorded (run "
                      f"`{regenerate_command(source, name)}` and say why): {diff}")


# ---- recorded measurements other than a rehearsal -----------------------------------------
# A test file's RECORDED_MEASURES = {name: (function, keys)}: a deterministic measurement of
# torch's (e.g. what a block saves for backward, bytes) per key, recorded as {key: value} with
# the same provenance, read by `recorded_values`, re-measured by the same command and check.

def recorded_values(source: str, name: str, keys) -> dict:
    """{key: value} of a recorded measurement; fails, naming the command, when it is missing
    or recorded other keys."""
    path = DATA / f"{name}.json"
    redo = regenerate_command(source, name)
    assert path.exists(), f"no recording {_shown(path)}: run `{redo}`"
    values = json.loads(path.read_text())["values"]
    assert sorted(values) == sorted(keys), f"{_shown(path)} recorded other keys: run `{redo}`"
    return values


def measure(source: str, name: str, function, keys) -> dict:
    """Run `function(key)` for every key (in this process); the recording."""
    import torch

    values = {}
    for key in keys:
        values[key] = function(key)
        torch.set_default_dtype(torch.float32)
    return {"table": name, "source": source, "command": regenerate_command(source, name),
            "function": f"{function.__qualname__} (in {source})",
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "commit": _commit(), "values": values}


def same_values(recorded: dict, live: dict) -> list[str]:
    """Where a live measurement differs from its recording (exactly: byte counts)."""
    keys = set(recorded["values"]) | set(live["values"])
    return [f"{k}: {recorded['values'].get(k)!r} recorded, {live['values'].get(k)!r} now"
            for k in sorted(keys) if recorded["values"].get(k) != live["values"].get(k)]


def _module(source: str):
    """A test file, loaded by path (its RECORDED_TABLES and RECORDED_MEASURES)."""
    spec = importlib.util.spec_from_file_location("_recorded_tables", ROOT / source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recording(source: str, name: str, module) -> dict | None:
    tables = getattr(module, "RECORDED_TABLES", {})
    if name in tables:
        return record(source, name, tables[name])
    measures = getattr(module, "RECORDED_MEASURES", {})
    if name in measures:
        return measure(source, name, *measures[name])
    return None


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m testkit.recorded_rehearsal",
                                 description="Rehearse a test file's recorded tables and "
                                             "write their recordings.")
    ap.add_argument("source", help="the test file, e.g. tests/test_rehearse_kinds.py")
    ap.add_argument("names", nargs="*", help="its tables (default: all of RECORDED_TABLES)")
    ap.add_argument("--out", type=Path, default=DATA, help=f"folder (default {DATA})")
    args = ap.parse_args(argv)
    module = _module(args.source)
    names = [*getattr(module, "RECORDED_TABLES", {}), *getattr(module, "RECORDED_MEASURES", {})]
    for name in args.names or names:
        if name not in names:
            print(f"table={name!r}: {args.source} records {', '.join(names) or 'nothing'}",
                  file=sys.stderr)
            return 2
        rec = _recording(args.source, name, module)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        rows = rec.get("kinds") or rec["values"]
        print(f"wrote {args.out / (name + '.json')}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
