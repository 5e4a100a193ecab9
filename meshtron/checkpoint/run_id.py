"""A run's identity: a random id written into run.toml (`train.run_id`) when the run is created.

A run folder's path says where a run is, not which run it is: a folder moved or renamed holds
the same run, and one path reused (`--overwrite`, or one path on two machines) holds another.
The id is drawn once, when `meshtron train` creates the run (a new run, an --overwrite), and
kept by everything that continues it (--resume, an automatic restart, an elastic round: the
checkpoint's meta.json records it with the run's config). export.json records it
(meshtron/hf/origin.py) and `meshtron merge` knows a branch by (id, step)
(meshtron/modular/branches.py `same_model`); folders written before the id existed fall back
to their path and configuration digest.
"""

from __future__ import annotations

import json
import secrets
import tomllib
from pathlib import Path

ID_BYTES = 16
"""128 random bits (`secrets`): two runs drawing one id is not a concern (as a UUID4's 122)."""


def new_run_id() -> str:
    return secrets.token_hex(ID_BYTES)


def folder_run_id(run_dir: str | Path) -> str | None:
    """The id the run folder's records hold (run.toml, else config.json), None when neither
    has one (a folder written before the id existed, or not a run folder)."""
    folder = Path(run_dir)
    try:
        if (folder / "run.toml").is_file():
            train = tomllib.loads((folder / "run.toml").read_text()).get("train", {})
        elif (folder / "config.json").is_file():
            train = json.loads((folder / "config.json").read_text()).get("train", {})
        else:
            return None
    except (ValueError, UnicodeDecodeError, OSError, AttributeError):
        return None
    found = train.get("run_id") if isinstance(train, dict) else None
    return found if isinstance(found, str) and found else None


def continued_run_id(run_dir: str | Path) -> str | None:
    """The id of the run a resume continues: the newest complete checkpoint's (its meta.json's
    config), else the folder's records'; None when neither has one."""
    from meshtron.checkpoint.resume import recorded

    found = recorded(run_dir)
    if found is not None:
        kept = (found[1].get("config", {}).get("train") or {}).get("run_id")
        if isinstance(kept, str) and kept:
            return kept
    return folder_run_id(run_dir)
