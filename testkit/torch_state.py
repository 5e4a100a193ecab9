"""What of torch a process could patch, snapshotted so that a later snapshot can be compared
with it (tests/test_no_torch_patching.py, tests/guard/sitecustomize.py).

A snapshot holds, by reference (so that a replaced object can never share an id with its
replacement):
- every attribute of every loaded `torch*` module (`vars(module)`) and of every class defined
  in one (`vars(cls)`, which holds methods such as `Work.wait`), and the operator packets of
  the collective operator namespaces (`torch.ops.c10d.*`, `torch.ops._c10d_functional.*`:
  replacing one is how a recorder would intercept DTensor's collectives);
- the dispatcher's table of every operator in those namespaces (`torch._C._dispatch_dump`: a
  kernel registered with `torch.library.Library(ns, "IMPL")` shows there) and the set of
  Python kernels torch.library has registered (`torch.library._impls`).

`changes(before)` lists what differs from then: an attribute of a module or class replaced by
code that is not torch's own, such code added to a class (values that are not callables or
classes are settings and caches; torch's own code is torch patching itself as it runs, e.g.
the Optimizer's profiler hook around `step`), a collective operator's changed dispatcher table
or a Python kernel registered for one.
"""

from __future__ import annotations

import os
import sys
from typing import Any

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _is_code(value: Any) -> bool:
    return callable(value) or isinstance(value, (type, staticmethod, classmethod, property))


def _torch_made(value: Any) -> bool:
    """The object's code comes from torch itself (torch keeps patching its own classes as it
    runs: Optimizer wraps `step` for its profiler hooks, dynamo installs `_init_group`...):
    a function defined in a file under torch's package folder, or an object of a torch type."""
    import torch

    home = os.path.dirname(torch.__file__) + os.sep
    func = value
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    elif isinstance(func, property):
        func = func.fget
    func = getattr(func, "__func__", func)  # bound methods
    code = getattr(func, "__code__", None)
    if code is not None:
        return code.co_filename.startswith(home)
    module = getattr(value, "__module__", None) or type(value).__module__ or ""
    return module == "torch" or module.startswith("torch.")


def _op_names() -> list[str]:
    import torch

    return sorted(n for n in torch._C._dispatch_get_all_op_names()
                  if n.partition("::")[0] in COLLECTIVE_NAMESPACES)


def snapshot() -> dict[str, Any]:
    import torch

    attrs: dict[tuple, Any] = {}
    classes: dict[tuple, set] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "torch" or name.startswith("torch.")):
            continue
        for key, value in list(vars(mod).items()):
            attrs[(name, key)] = value
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                members = dict(vars(value))
                classes[(name, key)] = set(members)
                for ck, cv in members.items():
                    attrs[(name, key, ck)] = cv
    ops = _op_names()
    for full in ops:  # the packets, loaded now so that a later replacement shows
        ns, _, op = full.partition("::")
        attrs[("torch.ops", ns, op.partition(".")[0])] = getattr(
            getattr(torch.ops, ns), op.partition(".")[0])
    return {"attrs": attrs, "classes": classes,
            "dispatch": {n: torch._C._dispatch_dump(n) for n in ops},
            "impls": set(getattr(torch.library, "_impls", ()))}


def _current(key: tuple) -> tuple[bool, Any]:
    import torch

    if key[0] == "torch.ops":
        ns = getattr(torch.ops, key[1])
        return key[2] in vars(ns), vars(ns).get(key[2])
    mod = sys.modules.get(key[0])
    if mod is None:
        return False, None
    obj = vars(mod)
    if len(key) == 3:
        cls = obj.get(key[1])
        if not isinstance(cls, type):
            return False, None
        obj = vars(cls)
    return key[-1] in obj, obj.get(key[-1])


def changes(before: dict[str, Any]) -> list[str]:
    """What was patched since `before` was taken: one line each."""
    import torch

    out = []
    for key, old in before["attrs"].items():
        if not _is_code(old):
            continue
        present, new = _current(key)
        if not present:
            out.append(f"removed {'.'.join(key)}")
        elif new is not old and not _torch_made(new):
            out.append(f"replaced {'.'.join(key)}: {old!r} -> {new!r}")
    for (mod, cls), names in before["classes"].items():
        current = vars(sys.modules[mod]).get(cls)
        if isinstance(current, type):
            for added in sorted(set(vars(current)) - names):
                value = vars(current)[added]
                # torch keeps state and caches on its classes as it runs (pickle's
                # __slotnames__, dynamo's and the RNG decompositions' trackers): only code
                # added to a class changes what its instances do.
                # (Backend.MESHTRON_GLOO, a name torch's register_backend adds for meshtron's
                # recording group, is a string: not code)
                if _is_code(value) and not _torch_made(value):
                    out.append(f"added {mod}.{cls}.{added}: {value!r}")
    for name, table in before["dispatch"].items():
        if torch._C._dispatch_dump(name) != table:
            out.append(f"dispatcher table of {name} changed")
    for impl in sorted(set(getattr(torch.library, "_impls", ())) - before["impls"]):
        if impl.partition("/")[0] in COLLECTIVE_NAMESPACES:
            out.append(f"python kernel registered: {impl}")
    return out


# ---- which torch modules a package imports (static) -------------------------------------------
def torch_modules_imported(package_dir) -> list[str]:
    """Every `torch...` module the package's source imports (ast: `import torch.x`,
    `from torch.x import y` (y too, when it is a module)), sorted."""
    import ast
    from pathlib import Path

    names: set[str] = set()
    for path in Path(package_dir).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.split(".")[0] == "torch")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "torch":
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return sorted(names)


def preload(package_dir) -> list[str]:
    """Import every torch module the package imports, so that torch's own import-time
    registrations (e.g. DTensor's, FSDP2's operator kernels) happen before a snapshot; returns
    those that imported (names that are functions or classes, or CUDA-only, do not)."""
    import importlib

    loaded = []
    for name in torch_modules_imported(package_dir):
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception:  # noqa: BLE001 - `from torch.x import function`, or no CUDA
            continue
    return loaded
