"""`python -m testkit.no_torch ARGS...`: `meshtron ARGS...` in a process that may not import
torch (the launcher of `meshtron train --nproc N` on a node without a GPU: launch.py).

A finder first on `sys.meta_path` refuses every `torch` module in THIS interpreter only: the
agent and the ranks the launcher starts are new interpreters (`python -m meshtron.launch`) and
import torch as they must. It raises RuntimeError, not ImportError, so that an optional import
(`try: import torch / except ImportError`) cannot swallow it: the run then ends with exit 1 and
a traceback naming the import chain. No patching of torch or of `builtins.__import__`."""

from __future__ import annotations

import runpy
import sys

COMMAND = [sys.executable, "-m", "testkit.no_torch"]
"""The argv prefix that replaces `python -m meshtron`."""


class RefuseTorch:
    """A meta-path finder that fails the import of torch and of every torch submodule."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise RuntimeError(f"testkit.no_torch: this process imported {name!r}; the "
                               "launcher must start its ranks without torch")
        return None


def main() -> None:
    if "torch" in sys.modules:  # imported at start-up (a .pth file): the guard would see nothing
        raise SystemExit("testkit.no_torch: torch was imported before the guard")
    sys.meta_path.insert(0, RefuseTorch())
    sys.argv = ["meshtron", *sys.argv[1:]]
    runpy.run_module("meshtron", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
