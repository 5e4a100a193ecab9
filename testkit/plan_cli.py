"""meshtron's commands in the test process, through meshtron.cli.main as a user's argv reaches it
(only the named command modules loaded): `plan_cli(*argv)` runs `meshtron plan ...`;
`commands_fixture(*modules)` makes a fixture whose `run(*argv)` runs any of those commands. Each
returns (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest


def _runner(monkeypatch, capsys, modules: list[str]):
    import meshtron.cli as top

    monkeypatch.setattr(top, "COMMAND_MODULES", modules)

    def run(*argv: str) -> tuple[int, str, str]:
        rc = top.main(list(argv))
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


def commands_fixture(*modules: str):
    """A pytest fixture running `meshtron <argv>` with only `modules` as command modules."""

    @pytest.fixture
    def cli(monkeypatch, capsys):
        return _runner(monkeypatch, capsys, list(modules))
    return cli


@pytest.fixture
def plan_cli(monkeypatch, capsys):
    run = _runner(monkeypatch, capsys, ["meshtron.planner.cli"])
    return lambda *argv: run("plan", *argv)
