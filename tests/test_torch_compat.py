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
    for names in torch_compat.ONE_OF:  # every alternative is registered, one exists here
        assert set(names) <= set(torch_compat.PRIVATE_APIS)
        assert any(torch_compat.available(n) for n in names), names
