"""`env = refuse_in_ranks(folder, modules, os.environ)`: an environment in which every rank that
torchrun starts (a process with RANK set) fails on importing any of `modules` (or their
submodules), while the launcher and torchrun's agent import as they like.

The ranks are fresh interpreters (`python -m meshtron`, started by torchrun's agent), so the
guard travels as a `sitecustomize.py` in `folder`, put first on PYTHONPATH: the interpreter's
`site` imports it at start-up in every process of the launch. It puts a finder first on
`sys.meta_path` (testkit/no_torch.py's way: RuntimeError, not ImportError, so that an optional
`try: import ... except ImportError` cannot swallow it), only where RANK is set. No patching of
torch or of `builtins.__import__`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

_SITECUSTOMIZE = '''import os
import sys

REFUSED = {refused!r}


class RefuseInRank:
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in REFUSED):
            raise RuntimeError(f"testkit.rank_imports: rank {{os.environ['RANK']}} imported "
                               f"{{name!r}}, which a rank of this run must not need")
        return None


if "RANK" in os.environ:
    sys.meta_path.insert(0, RefuseInRank())
'''


def refuse_in_ranks(folder: Path, modules: tuple[str, ...],
                    environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with `folder` (written here) first on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(refused=tuple(modules)))
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**environ, "PYTHONPATH": os.pathsep.join([str(folder), *paths])}
