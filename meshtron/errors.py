"""The two errors that end a command with one line instead of a traceback.

`UserError` is bad input (a flag, a config field, a file, a plan that cannot run): raised only
by validation code, it becomes one line naming the field, the value and what is allowed, and
exit code 2. It subclasses `ValueError` so that API callers can catch either, but the command
line catches `UserError` alone: a `ValueError` raised anywhere else (torch, numpy, a bug of
ours) keeps its traceback and exits 1.

`RunFailed` is a job that started correctly and could not finish (diverged loss, failed ranks,
failed calibration): one line, exit code 1.
"""


class UserError(ValueError):
    """Bad input from the user, found by validation code (exit code 2, one line)."""


class RunFailed(RuntimeError):
    """The job itself failed (diverged loss, failed ranks, failed calibration)."""
