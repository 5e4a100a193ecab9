"""What a resume must match: checks made before any tensor is loaded (one line each, exit 2).

`check_compatible`: the checkpoint's model shape and learning-rate schedule against this run's
(the ranks call it before loading, the launcher before starting them); `prepare_start`: the
launcher's checks, before any rank starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from meshtron.checkpoint import store
from meshtron.checkpoint.config import CheckpointConfig
from meshtron.errors import UserError

_SHAPE_IGNORED = ("name",)

SCHEDULE_FIELDS = (("train", "steps"), ("optim", "lr"), ("optim", "warmup_steps"),
                   ("optim", "min_lr_ratio"))
"""The inputs of the learning-rate schedule (meshtron/train/optim.py: warm-up, then cosine decay
to min_lr_ratio * lr at train.steps). The checkpoint holds the schedule's position, not its
shape: resuming with another value would silently jump the learning rate at the resumed step
(e.g. --steps 12 -> 20 moved it from 2.07e-4 to 5.39e-4). As Megatron-LM's scheduler checks
(`--override-opt_param-scheduler` to bypass) and torchtitan's schedule being a function of the
configured steps, a change must be explicit: here, a new run."""

DATA_FIELDS = (("data", "source"), ("data", "tokenizer"), ("data", "seq_len"))
"""What the checkpoint's data position is counted in: sample n of the shuffled seq_len+1-token
windows of that source as that tokenizer splits it (data/dataset.py). The ranks refused another
one (as "data state: num_windows", or not at all when the counts happened to agree) only after
the run's config.json had been rewritten with it; checked here, before anything is written."""


def check_compatible(meta: dict[str, Any], cfg: Any, folder: Path) -> None:
    """Refuse a checkpoint of another model shape or learning-rate schedule (one line)."""
    saved_cfg = meta.get("config", {})
    now_cfg = json.loads(json.dumps(cfg.to_dict(), default=str))
    saved, now = dict(saved_cfg.get("model", {})), now_cfg["model"]
    for key in sorted(set(saved) | set(now)):
        if key not in _SHAPE_IGNORED and saved.get(key) != now.get(key):
            raise UserError(f"--resume: checkpoint {folder} holds a model with "
                            f"model.{key}={saved.get(key)!r}, this run has {now.get(key)!r}; "
                            "resume with the same model or start a new --run-dir")
    for fields, what in ((SCHEDULE_FIELDS, "the learning-rate schedule is a function of it"),
                         (DATA_FIELDS, "the data position it holds counts windows of that data")):
        for section, key in fields:
            if section not in saved_cfg or key not in saved_cfg[section]:
                continue  # a checkpoint written before the field existed
            was, want = saved_cfg[section][key], now_cfg[section][key]
            if was != want:
                raise UserError(f"--resume: {section}.{key}={want!r}: the checkpoint "
                                f"{folder.name} was saved by a run with {section}.{key}={was!r}, "
                                f"and {what}; allowed: {section}.{key}={was!r} (or train a new "
                                "--run-dir)")


def prepare_start(ckpt: CheckpointConfig, cfg: Any, overwrite: bool) -> None:
    """Checks in the launching process, before any rank starts: `--resume` needs a complete
    checkpoint (sizes checked here; checksums by the ranks) of the same model; a fresh run over
    an old one (--overwrite) drops the old checkpoints so a later --resume cannot pick them up."""
    root = store.checkpoint_root(cfg.train.run_dir)
    if ckpt.resume:
        found = store.find_latest(root, deep=False)
        if found.path is None:
            why = "; ".join(f"{a}: {b}" for a, b in found.rejected)
            raise UserError(f"--resume: no complete checkpoint in {root}"
                            + (f" ({why})" if why else ""))
        check_compatible(store.read_meta(found.path), cfg, found.path)
        (root / store.PREEMPTED).unlink(missing_ok=True)
    elif overwrite and root.exists():
        shutil.rmtree(root)
