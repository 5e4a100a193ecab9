"""Where an exported weights folder came from: `export.json` beside the weights.

`meshtron export` and `meshtron train --export` write it: the run's id (run.toml's
`train.run_id`, drawn when the run was created: meshtron/checkpoint/run_id.py), the run folder
the weights were trained in (its resolved path), the step they are of, and how that run started
(its `train.init_from`, resolved, or its seed), and the SHA-256 of the run's configuration file
(run.toml, or config.json): which run held that folder, as a folder reused by another run (a
`--overwrite`, or one path on two machines) holds another. The id names the run wherever its
folder is later moved; path and digest are what a run from before the id is known by.
`meshtron merge` reads it to know a branch by what it is, a run at a step, whichever folder
holds it (the run's checkpoint or an export of it), and to check an export's base as it checks
a run's. A folder without it (weights from elsewhere, or exported before it was written) is
known by its own path only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtron.errors import UserError

ORIGIN_FILE = "export.json"
FORMAT = "meshtron-export/1"


def origin_record(run_dir: str | Path, step: int, init_from: str | None,
                  seed: int) -> dict[str, Any]:
    """The record of weights of run `run_dir` at `step` (a run started from `init_from`, or
    from the deterministic init of `seed`)."""
    from meshtron.checkpoint.run_id import folder_run_id

    return {"format": FORMAT, "run_id": folder_run_id(run_dir),
            "run": str(Path(run_dir).resolve()), "step": int(step),
            "init_from": str(Path(init_from).resolve()) if init_from else None,
            "seed": int(seed), "config": config_digest(run_dir)}


def config_digest(run_dir: str | Path) -> str | None:
    """'sha256:<digest>' of the configuration file `meshtron.hf.cli.run_config` reads (run.toml,
    else config.json): one run's weights at one step, whichever folder holds them, have one;
    another run trained in the same folder has its own data, seed or schedule in it. None when
    the folder has neither."""
    from meshtron.checkpoint.store import file_digest

    for name in ("run.toml", "config.json"):
        path = Path(run_dir) / name
        if path.is_file():
            return "sha256:" + file_digest(path, "sha256")
    return None


def write_origin(out_dir: str | Path, record: dict[str, Any]) -> None:
    path = Path(out_dir) / ORIGIN_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def read_origin(folder: str | Path, field: str) -> dict[str, Any] | None:
    """The record of an exported folder, None when it has none; UserError naming `field`, the
    folder and the file when the file is there but not a record meshtron wrote."""
    path = Path(folder) / ORIGIN_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        doc = None
    ok = (isinstance(doc, dict) and doc.get("format") == FORMAT
          and isinstance(doc.get("run"), str) and type(doc.get("step")) is int
          and doc["step"] >= 0 and type(doc.get("seed")) is int
          and (doc.get("init_from") is None or isinstance(doc.get("init_from"), str))
          and (doc.get("config") is None or isinstance(doc.get("config"), str))
          and (doc.get("run_id") is None or isinstance(doc.get("run_id"), str)))
    if not ok:
        raise UserError(f"{field}={str(folder)!r}: {path} is damaged (expected a {FORMAT} "
                        "record with run, step, init_from and seed; remove it to merge the "
                        "folder as weights of unknown origin)")
    return doc


def recorded_path(path: str, run_folder: Path, recorded_run_dir: str) -> Path:
    """A path a run's run.toml recorded (e.g. `train.init_from`) as an absolute path: relative
    ones are relative to the folder `meshtron train` ran in, not to today's working folder.
    That folder is the run folder found now less the `train.run_dir` recorded with it (run.toml
    'runs/a', found at /data/exp/runs/a: /data/exp); when they do not line up (an absolute or
    '..' run_dir, a moved or renamed run folder) the working folder is the best guess."""
    given = Path(path)
    if given.is_absolute():
        return given
    parts = [p for p in Path(recorded_run_dir).parts if p != "."]
    here = run_folder.resolve().parts
    if (parts and not Path(recorded_run_dir).is_absolute() and ".." not in parts
            and len(parts) < len(here) and list(here[-len(parts):]) == parts):
        return Path(*here[:-len(parts)]) / given
    return given.resolve()
