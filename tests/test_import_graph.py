"""meshtron's import graph, read from the source with `ast` (every import statement, those inside
functions and under TYPE_CHECKING included): no module import circle, and no import from a lower
layer up into a higher one (model -> parallel -> train, the planner beside them)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "meshtron"

# A module of a lower layer must not import a higher layer's package (docs/development.md).
FORBIDDEN = {
    "model": {"parallel", "train", "planner", "checkpoint", "compress", "doctor"},
    "parallel": {"train", "checkpoint", "doctor"},
    "planner": {"parallel", "train", "checkpoint", "compress", "doctor"},
    # checkpoints (in-memory snapshots and restart phases included) sit under the training
    # paths that restart from them; the doctor runs inside the parallel runtime, which names
    # its groups for it
    "checkpoint": {"parallel", "train", "doctor"},
    # what the ranks record sits under the runtime, the calibration and the trainer that start
    # it; reading a run folder afterwards (`diagnose`, which asks the trainer for its cluster)
    # is above them
    "doctor": {"parallel", "train", "runtime", "calibrate", "diagnose"},
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The meshtron modules `name` imports (a name imported from a package counts as its
    submodule when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target.startswith("meshtron") and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> imported modules; a package's __init__ importing its own children (and a child
    importing its package) is the package's interface, not a circle of design."""
    mods = modules()
    out = {}
    for name, path in mods.items():
        deps = imports(name, path, mods)
        out[name] = {d for d in deps if not d.startswith(name + ".")
                     and not name.startswith(d + ".")}
    return out


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_circle_finder_finds_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    g = graph()
    assert len(g) > 100, "the package was not found"
    found = circles(g)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_up_a_layer():
    bad = []
    for name, deps in graph().items():
        layer = name.split(".")[1] if name.count(".") else ""
        for dep in deps:
            if dep.split(".")[1] in FORBIDDEN.get(layer, ()):
                bad.append(f"{name} -> {dep}")
    assert not bad, "imports up a layer: " + ", ".join(sorted(bad))
