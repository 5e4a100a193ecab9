"""A guard against the class of bug of issue 28: product code (`meshtron/`) must never replace
an attribute of a torch module or class, nor put its own kernels in front of torch's operators
(the old collective recorder did all three: `Work.wait` replaced, `torch.ops._c10d_functional.*`
replaced by proxies, Python kernels at the Autograd key of every `c10d` operator; compiled
tensor parallelism then trained a different model through the command line).

Three checks, each shown able to fail on the old recorder's mechanisms:
- static: no assignment of anything but a literal setting (`torch.backends...fp32_precision =
  "tf32"`), no `setattr`/`delattr` or deletion on anything reached from a torch import, and no
  `torch.library` kernel registered for another namespace's operators, anywhere in `meshtron/`
  (ast; `_violations`);
- import time: a fresh interpreter snapshots torch (testkit/torch_state.py), imports every
  meshtron module and registers the recording backend, and finds nothing changed;
- run time: tests/test_compile_recorder.py runs `meshtron train` with tests/guard/sitecustomize.py,
  which compares every rank's torch with its start-up snapshot at every training batch (doctor
  session, recorder, watchdog and compiled blocks live).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "meshtron"
_REGISTERS = {"impl", "register_kernel", "register_fake", "register_autograd",
              "register_torch_dispatch"}


def _root(node: ast.AST) -> str | None:
    """The name an expression reaches torch objects through: `a.b[c].d` -> a; `getattr(x, n)`
    -> x's root; any other call makes a new object (an instance, not a torch namespace)."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and node.args:
            node = node.args[0]
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def _torch_names(tree: ast.AST) -> set[str]:
    """Names bound to torch modules, classes or functions (imports), and names assigned from
    expressions rooted in those (flow-insensitive: any scope of the file)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
    for _ in range(3):  # a few rounds reach chains of aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _root(node.value) in names:
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
    return names


def _library_call(node: ast.Call) -> str | None:
    """`Library("ns", "IMPL"/"FRAGMENT")` or `torch.library.impl("ns::op", ...)`-style kernel
    registrations for an operator outside meshtron's own namespace: their text, else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0] if node.args else None
    text = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) \
        else None
    if name == "Library" and len(node.args) > 1:
        kind = node.args[1]
        if isinstance(kind, ast.Constant) and kind.value in ("IMPL", "FRAGMENT") and \
                text != "meshtron":
            return f"torch.library.Library({text or '<expr>'}, {kind.value!r})"
    root = _root(func.value) if isinstance(func, ast.Attribute) else None
    if name in _REGISTERS and root in ("torch", "library") and \
            not (text or "").startswith("meshtron::"):
        return f"torch.library.{name}({text or '<expr>'})"
    return None


def _violations(source: str, filename: str = "<source>") -> list[str]:
    tree = ast.parse(source, filename)
    torch_names = _torch_names(tree)
    out = []

    def flag(node, what):
        out.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        # A literal value is a setting (`torch.backends.cuda.matmul.fp32_precision = "tf32"`,
        # inductor's config flags): torch's documented switches, not replaced code.
        value = getattr(node, "value", None)
        setting = isinstance(value, ast.Constant) and value.value is not None
        for t in targets:
            if isinstance(t, ast.Attribute) and _root(t) in torch_names and not setting:
                flag(node, f"assigns or deletes {ast.unparse(t)}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and \
                    node.args and _root(node.args[0]) in torch_names:
                flag(node, f"{func.id}({ast.unparse(node.args[0])}, ...)")
            registration = _library_call(node)
            if registration:
                flag(node, registration)
    return out


# The old recorder's three mechanisms, as it wrote them (meshtron/doctor/recorder.py and
# timeline.py before issue 28).
OLD_RECORDER = '''
import torch
from torch._C._distributed_c10d import Work

def install(self, proxy):
    for name in torch._C._dispatch_get_all_op_names():
        ns, _, raw = name.partition("::")
        namespace = getattr(torch.ops, ns)
        packet = getattr(namespace, raw)
        if ns == "_c10d_functional":
            setattr(namespace, raw, proxy)
            continue
        lib = self._libs.setdefault(ns, torch.library.Library(ns, "IMPL"))

def capture(wait):
    Work.wait = wait
'''


def test_the_static_scan_finds_the_old_recorders_patches():
    found = _violations(OLD_RECORDER)
    assert any("setattr(namespace" in v for v in found), found
    assert any("Library(<expr>, 'IMPL')" in v for v in found), found
    assert any("assigns or deletes Work.wait" in v for v in found), found
    # Ordinary uses of torch objects are not patching.
    assert len(_violations("import torch\ntorch.Tensor.add = None\n"
                           "from torch import nn\nnn.Linear.forward = lambda s, x: x\n")) == 2
    assert _violations("import torch\nm = torch.nn.Linear(2, 2)\nm.weight = None\n"
                       "x = torch.ones(2)\nx.grad = None\n"
                       "lib = torch.library.Library('meshtron', 'FRAGMENT')\n") == []


def test_no_module_of_the_product_patches_torch():
    found = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100, len(files)
    for path in files:
        found += _violations(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "\n".join(found)


_IMPORT_ALL = '''
import importlib, json, pkgutil, sys
sys.path.insert(0, {root!r})
import torch
from testkit import torch_state
torch_state.preload({package!r})
before = torch_state.snapshot()
import meshtron
names = [m.name for m in pkgutil.walk_packages(meshtron.__path__, "meshtron.")
         if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
from meshtron.doctor.backend import register
register()
print(json.dumps({{"modules": len(names), "changes": torch_state.changes(before)}}))
{patch}
print(json.dumps({{"changes": torch_state.changes(before)}}))
'''

_OLD_PATCHES = '''
from torch._C._distributed_c10d import Work
orig = Work.wait
Work.wait = lambda self, *a, **k: orig(self, *a, **k)
packet = torch.ops._c10d_functional.all_reduce
setattr(torch.ops._c10d_functional, "all_reduce", lambda *a, **k: packet(*a, **k))
lib = torch.library.Library("c10d", "IMPL")
lib.impl("allreduce_", lambda keyset, *a, **k: None, "Autograd", with_keyset=True)
'''


@pytest.fixture(scope="module")
def import_all() -> tuple[dict, dict]:
    """One fresh interpreter: the snapshot, every product module imported (what changed), then
    the old recorder's patches applied (what changed now): (after the imports, after the
    patches). One process for both checks: importing every module takes ~10 s on 2 cores."""
    code = _IMPORT_ALL.format(root=str(ROOT), package=str(PACKAGE), patch=_OLD_PATCHES)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported, patched = map(json.loads, proc.stdout.strip().splitlines()[-2:])
    return imported, patched


def test_importing_every_module_patches_nothing(import_all):
    got = import_all[0]
    assert got["modules"] > 100, got
    assert got["changes"] == [], "\n".join(got["changes"])


def test_the_snapshot_sees_the_old_recorders_patches(import_all):
    """The same check, with the old recorder's three patches applied after the snapshot (and
    after every product module was imported)."""
    changes = import_all[1]["changes"]
    assert any(c.startswith("replaced torch.distributed.distributed_c10d.Work.wait") or
               c.startswith("replaced torch._C._distributed_c10d.Work.wait")
               for c in changes), changes
    assert any(c.startswith("replaced torch.ops._c10d_functional.all_reduce")
               for c in changes), changes
    assert "dispatcher table of c10d::allreduce_ changed" in changes, changes
    assert "python kernel registered: c10d/allreduce_/Autograd" in changes, changes
