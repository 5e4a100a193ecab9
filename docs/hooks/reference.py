"""MkDocs hook: the reference pages, generated from the code at build time.

- `reference/cli.md`: the `--help` of `meshtron` and of every subcommand, from the same argparse
  parsers the command builds (`meshtron.cli.build_parser`; torch-free, as `meshtron --help` is).
- `reference/config.md`: every run-file key, plan field and model field with its default and
  the docstring written under it in the dataclass (read with `ast`, nothing imported).
- `reference/api.md`: the names `import meshtron` exports, with signature and docstring.

Nothing generated is written into docs/: the pages exist only in the build, so they cannot go
stale. docs/reference/ holds a placeholder of each (saying where the page is built), so that the
links to them resolve when the repository is browsed; the build replaces it.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "meshtron"

# (title, file, class, table name in a run file or plan file)
CONFIG_CLASSES = [
    ("Run file: `[data]`", "config.py", "DataConfig", "data"),
    ("Run file: `[optim]`", "config.py", "OptimConfig", "optim"),
    ("Run file: `[train]`", "config.py", "TrainConfig", "train"),
    ("Run file: `[model]` (ModelSpec fields, on top of `preset = ...`)", "model/shapes.py",
     "ModelSpec", "model"),
    ("Plan file (`meshtron plan --save`, `meshtron train --plan FILE`)", "planner/plan.py",
     "Plan", None),
]


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"{name} not found in {path}")


def _fields(cls: ast.ClassDef):
    """(name, annotation, default, docstring) of each annotated field, in source order; the
    docstring is the string literal right under the field (the convention of this code)."""
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = ""
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            doc = " ".join(nxt.value.value.split())
        default = ast.unparse(node.value) if node.value is not None else "(required)"
        if default.startswith("field("):
            default = "(computed)"
        yield node.target.id, ast.unparse(node.annotation), default, doc


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_page() -> str:
    out = ["# Configuration keys", "",
           "Generated at build time from the dataclasses' field docstrings "
           "(`meshtron/config.py`, `meshtron/model/shapes.py`, `meshtron/planner/plan.py`). "
           "Any key is also settable from the command line with `--set TABLE.KEY=VALUE`.", ""]
    for title, rel, cls_name, table in CONFIG_CLASSES:
        out += [f"## {title}", "", f"`{cls_name}` in `meshtron/{rel}`.", "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, ann, default, doc in _fields(_class(PKG / rel, cls_name)):
            key = f"{table}.{name}" if table else name
            out.append(f"| `{key}` | `{_cell(ann)}` | `{_cell(default)}` | {_cell(doc)} |")
        out.append("")
    return "\n".join(out)


def cli_page() -> str:
    from meshtron.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; fixed width, stable pages
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    out = ["# Command line", "",
           "Generated at build time from the parsers `meshtron` itself builds "
           "(`meshtron.cli.build_parser`). Bad input to any command is one line naming the "
           "field, the value and what is allowed, and exit code 2.", "",
           "## meshtron", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub_parser in sub.choices.items():
        out += [f"## meshtron {name}", "", "```text", sub_parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _lazy_exports() -> dict[str, str]:
    tree = ast.parse((PKG / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError("meshtron/__init__.py has no _LAZY table")


def _module_file(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    return PKG / rel / "__init__.py" if (PKG / rel).is_dir() else PKG / f"{rel}.py"


def _find_def(module: str, name: str, seen: frozenset = frozenset()):
    """The def/class `name` in `module`, following `from X import name` re-exports."""
    tree = ast.parse(_module_file(module).read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return module, node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if _module_file(module).name == "__init__.py" else parts[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base not in seen:
                return _find_def(base, name, seen | {module})
    raise LookupError(f"{name} not found from {module}")


def api_page() -> str:
    out = ["# Python API", "",
           "Generated at build time from the source: the names `import meshtron` exports "
           "(loaded on first use, so `import meshtron` stays torch-free), with their "
           "signatures and docstrings.", ""]
    for name, module in _lazy_exports().items():
        home, node = _find_def(module, name)
        if isinstance(node, ast.FunctionDef):
            sig = f"def {name}({ast.unparse(node.args)})"
            if node.returns is not None:
                sig += f" -> {ast.unparse(node.returns)}"
        else:
            sig = f"class {name}"
        doc = ast.get_docstring(node) or "(no docstring)"
        out += [f"## `meshtron.{name}`", "", f"Defined in `{home}`.", "",
                "```python", sig, "```", "", "```text", doc, "```", ""]
    return "\n".join(out)


PAGES = {"reference/cli.md": cli_page, "reference/config.md": config_page,
         "reference/api.md": api_page}


def on_files(files, config):
    for uri, make in PAGES.items():
        placeholder = files.get_file_from_path(uri)
        if placeholder is not None:
            files.remove(placeholder)
        files.append(File.generated(config, uri, content=make()))
    return files
