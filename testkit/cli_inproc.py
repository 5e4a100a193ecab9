"""`meshtron ARGV` in the test process, through `meshtron.cli.main` with the argv a user types:
(exit code, stdout, stderr).

For one-process commands whose test reads only those and the files the command writes: a child
`python -m meshtron` imports torch again (~3.5 s of CPU each on the CI box, the suite's main
cost; docs/measurements.md#suite-cut-s53-suvar). Not for what needs a process of its own: a
signal or kill, torchrun or the `--nproc N` launcher, the start-up itself, environment variables
read at import, or a check that a command never imports torch.
"""

from __future__ import annotations

import contextlib
import io


def meshtron_main(*argv: str) -> tuple[int, str, str]:
    """Runs `meshtron ARGV` here; an argparse refusal (SystemExit) is its exit code, as in a
    child."""
    from meshtron.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue(), err.getvalue()
