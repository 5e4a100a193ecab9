"""Private and version-specific torch symbols (issue 31, item 2): every one meshtron uses is
registered in meshtron/torch_compat.py and exists on the installed torch. The scan reads the
package's source: imports from private modules or of private names, attribute chains from a
torch name that pass a private component, and getattr/hasattr with a private string on one.
A new private use fails here until it is registered (and so checked on every torch CI runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from meshtron import torch_compat
from meshtron.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1] / "meshtron"


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _torch_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch path it stands for, from the file's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def private_symbols(root: Path) -> dict[str, list[str]]:
    """Dotted private torch symbol -> where it is used ("file:line")."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = _torch_names(tree)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        where = f"{path.relative_to(root.parent)}"

        def add(symbol: str, line: int) -> None:
            found.setdefault(symbol, []).append(f"{where}:{line}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch" and _private(a.name.split(".")):
                        add(a.name, node.lineno)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                for a in node.names:
                    symbol = f"{node.module}.{a.name}"
                    if _private(symbol.split(".")):
                        add(symbol, node.lineno)
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = _chain(node)
                if chain and chain[0] in names:
                    full = names[chain[0]].split(".") + chain[1:]
                    if _private(full[len(names[chain[0]].split(".")):]):
                        add(".".join(full), node.lineno)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                chain, name = _chain(node.args[0]), node.args[1]
                if (chain and chain[0] in names and isinstance(name, ast.Constant)
                        and isinstance(name.value, str) and _private([name.value])):
                    add(".".join([names[chain[0]], *chain[1:], name.value]), node.lineno)
    return found


def test_every_private_torch_symbol_is_registered():
    unregistered = {s: w for s, w in private_symbols(PACKAGE).items()
                    if s not in torch_compat.PRIVATE_APIS}
    assert not unregistered, ("register these in meshtron/torch_compat.py PRIVATE_APIS: "
                              f"{unregistered}")


def test_every_registered_symbol_exists_on_this_torch():
    assert torch_compat.missing() == []


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    pkg = tmp_path / "meshtron"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import torch\n"
        "import torch._inductor.config as cfg\n"
        "from torch.distributed.tensor._utils import helper\n"
        "from torch.distributed import _private_fn\n"
        "x = torch._grouped_mm(a, b)\n"
        "cfg._flag = True\n"
        "ok = hasattr(torch.ops.aten, '_scaled_mm')\n"
        "fine = torch.nn.Module.__init__\n")
    assert set(private_symbols(pkg)) == {
        "torch._inductor.config", "torch._inductor.config._flag",
        "torch.distributed.tensor._utils.helper", "torch.distributed._private_fn",
        "torch._grouped_mm", "torch.ops.aten._scaled_mm"}


def test_require_names_the_torch_version_and_feature(monkeypatch):
    import torch

    monkeypatch.setitem(torch_compat.PRIVATE_APIS, "torch._no_such_symbol", "a test")
    with pytest.raises(UserError) as err:
        torch_compat.require("torch._no_such_symbol", "plan.async_tp=true")
    line = str(err.value)
    assert "\n" not in line and torch.__version__ in line and "plan.async_tp=true" in line
    assert not torch_compat.available("torch._no_such_symbol")
    assert torch_compat.require("torch._grouped_mm", "MoE") is torch._grouped_mm
    with pytest.raises(KeyError):
        torch_compat.available("torch._never_registered")


def test_a_symbol_under_its_older_name_is_not_missing(monkeypatch):
    """torch 2.11 (the H200 image) lacks all_gather_single and PipelineStage's
    _forward_metadata_inference, but has their older names: the registry must not call them
    missing there (the kit's torch_tests case runs this file under the image's torch), yet a
    symbol with no name present still is."""
    monkeypatch.setitem(torch_compat.PRIVATE_APIS, "torch._no_such_symbol", "a test")
    monkeypatch.setitem(torch_compat.PRIVATE_APIS, "torch._no_such_other", "a test")
    assert set(torch_compat.missing()) == {"torch._no_such_symbol", "torch._no_such_other"}
    monkeypatch.setattr(torch_compat, "ONE_OF", (*torch_compat.ONE_OF,
                                                 ("torch._no_such_symbol", "torch._grouped_mm")))
    assert torch_compat.missing() == ["torch._no_such_other"]
    registered = set(torch_compat.PRIVATE_APIS) | set(torch_compat.PRIVATE_ATTRIBUTES)
    for names in torch_compat.ONE_OF:  # every alternative is registered, one exists here
        assert set(names) <= registered
        assert any(torch_compat.present(n) for n in names), names


def _own_attributes(trees: list[ast.AST]) -> set[str]:
    """Attribute names meshtron defines itself: its classes' methods and class-level names,
    attributes it assigns (`x._name = ...`, setattr with a literal name)."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                own.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "setattr" and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):
                own.add(node.args[1].value)
    return own


def _imported(tree: ast.AST) -> dict[str, str]:
    """Local name -> the module path it was imported from (any package)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def private_attribute_reads(root: Path) -> dict[str, list[str]]:
    """Private attribute names read on objects that are not meshtron's (a DeviceMesh's
    `mesh._flatten(...)`, `getattr(state, "_fsdp_param_groups", None)`): the uses the import
    scan above cannot see, since the object is a variable, not a torch import. Names meshtron
    defines itself and reads on its own modules or the standard library's are left out."""
    paths = sorted(root.rglob("*.py"))
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    own = _own_attributes(list(trees.values()))
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        imported = _imported(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                name, obj = node.attr, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                name, obj = node.args[1].value, node.args[0]
            else:
                continue
            if not _private([name]) or name in own:
                continue
            if isinstance(obj, ast.Name) and obj.id in imported \
                    and not imported[obj.id].split(".")[0].startswith("torch"):
                continue  # sys._getframe, a meshtron module's own helper
            found.setdefault(name, []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


NOT_TORCH = {"_fields": "a namedtuple recognised by its fields (checkpoint/staging.py)"}
"""Private names read on objects that are not torch's, which the scan cannot tell apart."""


def test_every_private_attribute_read_on_a_torch_object_is_registered():
    """Issue 31's list missed these because the object is a variable (a DeviceMesh, an FSDP
    state, a checkpoint wrapper): each name read must end a PRIVATE_APIS symbol or be a
    PRIVATE_ATTRIBUTES entry, so that test above checks it on the installed torch."""
    names = {part for s in torch_compat.PRIVATE_APIS for part in s.split(".")
             if _private([part])}
    names |= {s.split(":")[1] for s in torch_compat.PRIVATE_ATTRIBUTES}
    names |= set(NOT_TORCH)
    unregistered = {n: w for n, w in private_attribute_reads(PACKAGE).items() if n not in names}
    assert not unregistered, ("register these in meshtron/torch_compat.py (PRIVATE_APIS, or "
                              f"PRIVATE_ATTRIBUTES for instance attributes): {unregistered}")


def test_the_attribute_scan_finds_reads_on_torch_objects_only(tmp_path):
    pkg = tmp_path / "meshtron"
    pkg.mkdir()
    (pkg / "helpers.py").write_text("def _helper():\n    return 1\n")
    (pkg / "m.py").write_text(
        "import sys\n"
        "from meshtron import helpers\n"
        "class Own:\n"
        "    def _mine(self):\n"
        "        self._cache = {}\n"
        "        return self._cache\n"
        "def f(mesh, state, block, o):\n"
        "    dp = mesh._flatten('dp')\n"
        "    groups = getattr(state, '_fsdp_param_groups', None)\n"
        "    inner = getattr(block, '_checkpoint_wrapped_module', block)\n"
        "    return o._mine(), o._cache, helpers._helper(), sys._getframe(), dp.__class__\n")
    assert set(private_attribute_reads(pkg)) == {
        "_flatten", "_fsdp_param_groups", "_checkpoint_wrapped_module"}


def test_a_private_attribute_is_present_only_where_its_module_names_it():
    assert torch_compat.attribute_present("torch.distributed.device_mesh:_pg_registry")
    assert not torch_compat.attribute_present("torch.distributed.device_mesh:_no_such_name")
    assert not torch_compat.attribute_present("torch._no_such_module:_pg_registry")


def test_expert_parallelism_on_a_torch_without_unflatten_is_one_line(monkeypatch):
    """The ep mesh is split with DeviceMesh._unflatten, private and not in every torch: on one
    without it the run stops in one line naming the torch version and the plan field, before
    any process group is made (the mesh is never touched: None here)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from meshtron.parallel.mesh import _expert_meshes
    from meshtron.planner.plan import Plan, parse_layout

    plan = Plan(**{"tp": 1, "pp": 1, "zero": 3, "micro_batch": 1, "recompute": "none",
                   "sp": False, "schedule": None, "virtual_stages": 1,
                   **parse_layout("dp=4,ep=2")})
    monkeypatch.delattr(DeviceMesh, "_unflatten")
    with pytest.raises(UserError) as err:
        _expert_meshes(None, plan)
    line = str(err.value)
    assert "\n" not in line and line.startswith("plan.ep=2") and torch.__version__ in line
