"""Errors that end a command with one line: `ValueError` for bad input (exit code 2, raised
everywhere), `RunFailed` for a run that started correctly and could not finish (exit code 1)."""


class RunFailed(RuntimeError):
    """The job itself failed (diverged loss, failed ranks, failed calibration)."""
