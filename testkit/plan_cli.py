"""The `meshtron plan` command in the test process: `plan_cli(*argv)` -> (exit code, stdout,
stderr), through meshtron.cli.main as a user's argv reaches it (only the planner's command
module loaded)."""

from __future__ import annotations

import pytest


@pytest.fixture
def plan_cli(monkeypatch, capsys):
    import meshtron.cli as top

    monkeypatch.setattr(top, "COMMAND_MODULES", ["meshtron.planner.cli"])

    def run(*argv: str) -> tuple[int, str, str]:
        rc = top.main(["plan", *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run
