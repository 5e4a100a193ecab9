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


def options_refusal(plan_cli, tmp_path, options: str, *argv: str) -> str:
    """`meshtron plan ARGV --options FILE` with FILE's [options] table `options`, which must be
    refused as bad input (exit 2, one line, no traceback): that line."""
    path = tmp_path / "options.toml"
    path.write_text(f"[options]\n{options}\n")
    rc, _, err = plan_cli(*argv, "--options", str(path))
    err = err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (options, err)
    return err


def refused(capsys, *argv) -> str:
    """Run `meshtron argv` in this process; assert exit 2 with one line and no traceback;
    return the line (the project's bad-input rule)."""
    from meshtron.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]
