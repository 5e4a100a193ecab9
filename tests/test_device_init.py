"""Device-explicit model build and initialization (issue 31, item 1).

On a GPU `meshtron train` one process crashed with "Expected a 'cuda' device type for
generator but found 'cpu'": the model was built under `with torch.device("cuda")` and the
initialization drew `torch.randn(..., generator=<cpu>)` without `device=`. The same class of
defect shows on the CPU when the default device is anything but the CPU, e.g. "meta", so these
tests run the product's build and initialization under a meta default device, and check the
source for the two causes: non-meta default-device contexts and random draws without a device.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from meshtron.model import init as minit
from meshtron.model.spec import ModelSpec
from meshtron.model.transformer import Transformer
from testkit.equivalence import DEFAULT_CFG

PACKAGE = Path(__file__).resolve().parents[1] / "meshtron"
SPEC = ModelSpec(**dict(DEFAULT_CFG["spec"]))
RANDOM_FACTORIES = {"randn", "rand", "randint", "randperm", "normal", "bernoulli",
                    "multinomial", "poisson"}


def _plain(seed: int = 7) -> Transformer:
    return Transformer(SPEC, init_seed=seed, device="cpu")


def test_materialize_under_a_meta_default_device_equals_the_cpu_build():
    """The single-process engine's path (build on meta, materialize on the device) draws on
    the target device whatever the default device is."""
    want = _plain()
    with torch.device("meta"):
        model = Transformer(SPEC, init_seed=7)
        minit.materialize([model], torch.device("cpu"))
    for (name, a), (_, b) in zip(want.named_parameters(), model.named_parameters()):
        assert b.device.type == "cpu" and torch.equal(a, b), name
    assert torch.equal(want.rope, model.rope)


def test_init_box_and_explicit_device_under_a_meta_default_device():
    name = "layers.0.feed_forward.w1.weight"
    cpu = minit.init_box(name, (40, 24), (0, 0), (40, 24), 3, 2)
    with torch.device("meta"):
        box = minit.init_box(name, (40, 24), (8, 4), (16, 8), 3, 2)
        built = Transformer(SPEC, init_seed=7, device="cpu")
    assert box.device.type == "cpu" and torch.equal(box, cpu[8:24, 4:12])
    want = _plain()
    assert all(torch.equal(a, b) for a, b in zip(want.parameters(), built.parameters()))


def test_local_engine_builds_on_meta_and_materializes():
    """`meshtron train` without a plan: the engine's model equals the plain model of the same
    seed, and its construction works under a meta default device (the CUDA crash's class)."""
    from meshtron.config import config_from_dict
    from meshtron.train.loop import LocalEngine

    cfg = config_from_dict({"model": dict(DEFAULT_CFG["spec"]), "train": {"steps": 1, "seed": 5}})
    torch.manual_seed(5)
    want = Transformer(cfg.model, device="cpu")
    with torch.device("meta"):
        engine = LocalEngine(cfg, device=torch.device("cpu"))
    for (name, a), (_, b) in zip(want.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(a, b), name


def _product_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text(), str(path))


def _is_torch_attr(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def test_no_default_device_context_but_meta_and_every_draw_names_its_device():
    problems = []
    for rel, tree in _product_sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    ctx = item.context_expr
                    if isinstance(ctx, ast.Call) and _is_torch_attr(ctx.func, "device"):
                        arg = ctx.args[0] if ctx.args else None
                        if not (isinstance(arg, ast.Constant) and arg.value == "meta"):
                            problems.append(f"{rel}:{node.lineno}: with torch.device(...) "
                                            "other than 'meta'")
            if not isinstance(node, ast.Call):
                continue
            if _is_torch_attr(node.func, "set_default_device"):
                problems.append(f"{rel}:{node.lineno}: torch.set_default_device")
            if (isinstance(node.func, ast.Attribute) and node.func.attr in RANDOM_FACTORIES
                    and _is_torch_attr(node.func, node.func.attr)
                    and not any(k.arg == "device" for k in node.keywords)):
                problems.append(f"{rel}:{node.lineno}: torch.{node.func.attr} without device=")
    assert not problems, "\n".join(problems)


def test_the_source_check_sees_the_defects_it_looks_for(tmp_path, monkeypatch):
    """The check above flags the crash's own pattern (it is not vacuous)."""
    bad = tmp_path / "meshtron"
    bad.mkdir()
    (bad / "bad.py").write_text(
        "import torch\n"
        "def f(g):\n"
        "    with torch.device('cuda'):\n"
        "        return torch.randn(3, generator=g)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", bad)
    try:
        test_no_default_device_context_but_meta_and_every_draw_names_its_device()
    except AssertionError as exc:
        assert "bad.py:3" in str(exc) and "bad.py:4" in str(exc)
    else:
        raise AssertionError("the source check missed a cuda context and a draw without device")
